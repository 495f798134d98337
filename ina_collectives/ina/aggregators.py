"""The INA engine's aggregators: the links to them, joining, losing and regaining them.

Collective to construct: every rank joins the job at each aggregator named (or, when a
controller installed the job, settings.job, checks its entry with a probe) and the ranks
agree; an aggregator that failed on any rank is used by none (``unavailable`` says why
when none serves). While one is missing, rank 0 probes its address without waiting (a
datagram at most every PROBE_INTERVAL seconds, _AnswerWatch) and its news reaches every
rank at the next call boundary: on the call's agreement, or, where the caller agreed the
call itself (the runtimes' negotiation), in a one-integer broadcast of its own. The call
after it answers again, every rank joins it again. The schedule is rank 0's clock, not a
count of calls: a join that fails waits 0.05, 0.1, 0.2 ... seconds (at most
``switch_retry_seconds``) before rank 0 gives the news again, so a restarted aggregator
serves again within that bound of answering, or at the first call after, at any call
rate. A link granted fewer slots than it asked for asks again at later call boundaries,
backing off 1, 2, 4 ... calls.
"""
from __future__ import annotations

import dataclasses
import logging
import random
import socket
import time
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from .. import protocol as P
from ..collectives.waiting import Deadline, wait
from ..errors import AggregatorUnavailable
from ..protocol import udp_socket
from ..protocol.topology import Topology
from ..settings import Settings
from .link import WorkerLink

log = logging.getLogger("ina_collectives")
REASON_BYTES = 512  # of the first failing rank's reason, sent to every rank
MAX_AGGREGATORS = 63  # one job's: a bit each in the int64 news of a call's agreement
RETRY_FIRST_GAP = 0.05  # seconds after a failed join before the next (then doubling)
GROW_MAX_CALLS = 256  # the longest gap, in calls, between asks for more slots

# The job a controller installed (settings.job: ina-run's) has one entry per rank of the
# job, so one communicator per process can use it: the first whose size fits. Any other
# (a Dup, COMM_SELF, a sub-communicator) joins the aggregators as a job of its own.
_installed_holders: set[int] = set()  # id() of the Aggregators holding it


class Aggregators:
    """The aggregators INA_SWITCH names (their shards included) as every rank uses them
    alike: ``links[i]`` is None while aggregator i is not used, and
    ``missing_reasons[i]`` says why."""

    def __init__(self, comm: MPI.Intracomm, settings: Settings, kernels: SimpleNamespace):
        self.comm, self.settings, self.kernels = comm, settings, kernels
        self._rank = comm.Get_rank()
        self.addresses: list[tuple[str, int]] = []
        self.links: list[WorkerLink | None] = []
        self.retired: dict[str, float] = {}  # the counts of the links closed so far
        self.missing_reasons: dict[int, str] = {}  # aggregator index -> why it is not used
        self.unavailable: str | None = None
        # K of the job's packets and the smallest path MTU of its ranks, agreed at join
        # (0 until then): _agree_elements.
        self.elements = self.path_mtu = 0
        self.outages = self.returns = 0
        # Per aggregator (a tree, with a topology): times it failed mid-call, and times
        # it served again after (stats' aggregators[].outages and .returns).
        self.lost_counts: dict[int, int] = {}
        self.back_counts: dict[int, int] = {}
        # Whether missing aggregators are tried again (False: never, or a lasting failure),
        # and rank 0's schedule: news is given from monotonic time _due_at on, the gap
        # after a failed join doubling from RETRY_FIRST_GAP to switch_retry_seconds.
        self._retrying = False
        self._due_at = 0.0
        self._retry_gap = RETRY_FIRST_GAP
        self._heard = 0  # rank 0: the bits its probes heard, kept until due
        # A link granted fewer slots than it asked for asks again from this call on
        # (every rank alike), backing off as reconnections do.
        self._grow_at: int | None = None
        self._grow_gap = 1
        self._seq = 0  # the number of the call under way (at_call_boundary)
        self._lasting = False  # the last failure was this job's setup: trying again is futile
        self._watch: _AnswerWatch | None = None  # rank 0's probes while one is missing
        self._watch_failed = False  # its socket could not be bound (said once)
        # A tree (INA_TOPOLOGY): this rank's leaf is its aggregator (one per tree: a
        # leaf serves tree t at its port + t), where it is worker _place[0] of
        # _place[1]; _leaves[t], every leaf's address for tree t (rank 0 probes them all
        # while that tree is missing).
        self._place: tuple[int, int] | None = None
        self._leaves: list[list[tuple[str, int]]] = []
        self.tree: dict | None = None  # stats()["switch"]["tree"]: the tree and this rank's leaf
        self.tree_rates: tuple[float, ...] | None = None  # each tree's mbit, where given
        if not settings.switch and not settings.topology:
            self.unavailable = "ina: no aggregator configured (INA_SWITCH)"
            return
        if settings.topology:
            self._from_topology(Topology.load(settings.topology))
            self.links = [None] * len(self.addresses)
            self._connect(list(range(len(self.addresses))))
            self._after_connect()
            return
        try:
            self.addresses = P.parse_addresses(settings.switch)
            if len(self.addresses) > MAX_AGGREGATORS:
                raise ValueError(f"INA_SWITCH names {len(self.addresses)} aggregators; at "
                                 f"most {MAX_AGGREGATORS} (a bit each in rank 0's news)")
        except ValueError as exc:
            # A mistake, not an outage: every rank reads the same text and stops here.
            raise ValueError(f"INA_SWITCH={settings.switch!r}: {exc}") from None
        if settings.job:
            ports = [p for p in settings.worker_ports.split(",") if p.strip()]
            fits = len(ports) == comm.Get_size() * len(self.addresses)
            if _installed_holders or not fits:
                log.info("the installed job %d is %s: this communicator of %d rank(s) "
                         "joins as a job of its own", settings.job,
                         "another communicator's" if _installed_holders
                         else f"for {len(ports)} worker port(s)", comm.Get_size())
                settings = self.settings = dataclasses.replace(settings, job=0,
                                                               worker_ports="")
            else:
                _installed_holders.add(id(self))
        if not settings.job:  # (an installed job's ports are per address as installed)
            self.addresses = self._with_shards(self.addresses)
        self.links = [None] * len(self.addresses)
        self._connect(list(range(len(self.addresses))))
        self._after_connect()

    def _from_topology(self, topology: Topology) -> None:
        """The aggregator of a topology file: its one aggregator, or this rank's leaf of
        its tree."""
        comm = self.comm
        topology.check(comm.Get_size())
        if not topology.is_tree:
            self.addresses = [topology.root.address]
            return
        leaf, worker, members = topology.place(self._rank)
        trees = range(len(topology.roots))
        self.addresses = [topology.leaf_address(leaf, t) for t in trees]
        self._place = (worker, members)
        self._leaves = [[topology.leaf_address(a, t) for a in topology.leaves] for t in trees]
        self.tree = {"root": topology.root.name, "root_address": "%s:%d" % topology.root.address,
                     "roots": [r.name for r in topology.roots],
                     "leaf": leaf.name, "worker": worker, "workers": members,
                     "leaves": {a.name: list(a.ranks) for a in topology.leaves},
                     "mbit": list(topology.tree_rates or ()),
                     "described": topology.describe()}
        self.tree_rates = topology.tree_rates

    def _after_connect(self) -> None:
        settings = self.settings
        if self.missing() and settings.require_switch:  # (agreed: _connect is collective)
            self.release()
            raise AggregatorUnavailable(
                f"INA_REQUIRE_SWITCH is set and the switch cannot serve: "
                f"{self.unavailable or self._why_missing()}")
        if self.missing():
            if self._lasting:
                self._job_warning("%s; calls take the ring",
                                  self.unavailable or self._why_missing())
            else:
                self._schedule(failed=False)
                self._job_warning("%s; %s%s", self.unavailable or self._why_missing(),
                                  "calls take the ring" if self.unavailable
                                  else "calls use the other aggregators", self._retry_text())

    @property
    def seq(self) -> int:
        """The number of the call under way (as at_call_boundary was told)."""
        return self._seq

    @property
    def link(self) -> WorkerLink | None:
        """The first serving link (None: no aggregator serves)."""
        for link in self.links:
            if link is not None:
                return link
        return None

    def serving(self) -> list[int]:
        return [i for i, link in enumerate(self.links) if link is not None]

    def missing(self) -> list[int]:
        return [i for i, link in enumerate(self.links) if link is None]

    def where(self, i: int) -> str:
        return "%s:%d" % self.addresses[i]

    def _why_missing(self) -> str:
        return "; ".join(f"{self.where(i)} not used: {why}"
                         for i, why in sorted(self.missing_reasons.items()))

    def _connect(self, indices: list[int]) -> None:
        """Every rank makes its links to the aggregators ``indices`` and joins (or probes
        its installed entry); collective. An aggregator that failed on any rank is left
        out on every rank, with the first failing rank's reason (``missing_reasons``);
        ``unavailable`` is set when none serves."""
        comm, settings, kernels = self.comm, self.settings, self.kernels
        n, rank = comm.Get_size(), comm.Get_rank()
        block, bits = settings.switch_block, settings.switch_value_bits
        k = self._agree_elements(indices)
        error, lasting = None, True
        if n > P.MAX_WORKERS:
            error = f"{n} ranks exceed the aggregator's {P.MAX_WORKERS} workers"
        elif kernels.name != "fast":
            # (the setting chose the reference kernels, or the build is missing)
            error = getattr(kernels, "why_not_fast", "") or "the compiled fast path is not built"
        ports = [int(p) for p in settings.worker_ports.split(",") if p.strip()]
        # An installed job names each rank's port at each aggregator: n per aggregator.
        wanted = n * len(self.addresses)
        if settings.job and error is None and len(ports) != wanted:
            error = (f"job {settings.job} was installed by a controller, but worker_ports "
                     f"(INA_WORKER_PORTS) names {len(ports)} ports for {n} ranks at "
                     f"{len(self.addresses)} aggregator(s): {wanted} are needed")
        # Rank 0's job id (INA_JOB, or a fresh one to join with) for every rank: one
        # collective whatever the ranks' settings say, so that none can wait alone. With
        # it, this run's epoch: every run of the ranks starts its slots at version 0, and
        # the switch takes a cell last used in another epoch for idle (an installed job's
        # cells are used again by each run, with no register reset).
        draw = random.SystemRandom().randrange
        ids = np.array([settings.job or draw(1, 65536), draw(1, 65536)], np.int32)
        self.collective(comm.Ibcast(ids, root=0), "rank 0's job id and epoch")
        job, epoch = int(ids[0]), int(ids[1])
        if error is None and settings.job != (job if settings.job else 0):
            error = f"INA_JOB is {settings.job} here but {job} on rank 0"
        errors: list[str | None] = [error] * len(indices)
        lasting_of = [lasting] * len(indices)
        for j, i in enumerate(indices):
            if error is not None:
                continue
            try:
                worker, members = self._place or (rank, n)
                link = WorkerLink(self.addresses[i], P.JobFormat(job, n, k, block, bits),
                                  worker, settings.switch_slots,
                                  ports[i * n + rank] if settings.job else 0, epoch,
                                  settings.switch_gso, members)
                self.links[i] = link
                if settings.job:  # installed: worker id = rank (or its place under its leaf)
                    link.probe(settings.switch_join_timeout)
                else:
                    link.join(settings.switch_join_timeout)
            except AggregatorUnavailable as exc:  # the aggregator's doing: may pass
                errors[j], lasting_of[j] = str(exc), False
            except (ValueError, OSError) as exc:
                errors[j] = str(exc)
        # Every rank learns, for each aggregator, whether any rank failed (1: it did not
        # answer or refused; 2: this job's setup, which another try would not change) and
        # the first failing rank's reason.
        mine = np.array([0 if e is None else (1 if not lasting_of[j] else 2)
                         for j, e in enumerate(errors)], np.int8)
        flags = np.empty((n, len(indices)), np.int8)
        self.collective(comm.Iallgather(mine, flags),
                         "every rank's outcome of joining the aggregator")
        self._lasting = False
        for j, i in enumerate(indices):
            column = flags[:, j]
            if not column.any():
                self.missing_reasons.pop(i, None)
                continue
            self._lasting = self._lasting or bool((column == 2).any())
            r = int(np.flatnonzero(column)[0])
            text = np.zeros(REASON_BYTES, np.uint8)
            if rank == r:
                raw = str(errors[j]).encode()[:REASON_BYTES]
                text[:len(raw)] = np.frombuffer(raw, np.uint8)
            self.collective(comm.Ibcast(text, root=r), f"rank {r}'s reason")
            self.missing_reasons[i] = text.tobytes().rstrip(b"\0").decode(errors="replace")
            self.close_link(i)
        short = [i for i in indices if self.links[i] is not None
                 and self.links[i].slots < self.links[i].asked_slots]
        for i in short:
            self._job_warning("the aggregator at %s granted %d of the %d slots asked (its pool is "
                              "shared with other jobs); more are asked for when it has them free",
                              self.where(i), self.links[i].slots, self.links[i].asked_slots)
        if short and self._grow_at is None and settings.switch_retry_seconds:
            self._grow_at = self._seq + self._grow_gap
        if self.serving():
            self.unavailable = None
        else:
            first = min(self.missing_reasons)
            r = int(np.flatnonzero(flags[:, indices.index(first)])[0]) if first in indices \
                else 0
            self.unavailable = (f"ina: aggregator unavailable (rank {r}: "
                                f"{self.missing_reasons[first]})")
            self.close()

    def _agree_elements(self, indices: list[int]) -> int:
        """Collective: K, the values per packet, for the job: each rank takes the largest
        whose datagram fits the MTU of its path to the aggregators ``indices`` (or
        INA_SWITCH_ELEMENTS where set), and the job takes the smallest of the ranks'. A K
        set by hand that is over the path's MTU is warned about: its datagrams leave as
        IP fragments, or not at all where segmentation offload is on."""
        settings = self.settings
        block, bits = settings.switch_block, settings.switch_value_bits
        mtus = {}
        for i in indices:
            try:
                mtus[i] = P.path_mtu(self.addresses[i])
            except OSError:
                pass  # no route: the join says so
        mtu = min(mtus.values(), default=P.MAX_DATAGRAM + P.IP_UDP_HEADER_BYTES)
        try:
            fits = P.elements_for_mtu(mtu, block, bits)
        except ValueError:  # (no packet fits: K 1, which the join refuses, naming the MTU;
            fits = 1        # this rank still takes part in the agreement below)
        given = settings.switch_elements
        if given > fits:
            worst = min(mtus, key=mtus.get)
            log.warning("INA_SWITCH_ELEMENTS=%d makes %d-byte datagrams, over the MTU %d of "
                        "this rank's path to %s: they leave as IP fragments, or not at all; "
                        "leave INA_SWITCH_ELEMENTS unset (packets sized to the path) or set "
                        "it to %d or less", given,
                        P.packet_bytes(given, block, bits) + P.IP_UDP_HEADER_BYTES, mtu,
                        self.where(worst), fits)
        k = np.array([given or fits, mtu], np.int64)
        self.collective(self.comm.Iallreduce(MPI.IN_PLACE, k, op=MPI.MIN),
                        "every rank's packet size (K) and path MTU")
        self.elements, self.path_mtu = int(k[0]), int(k[1])
        return self.elements

    def _with_shards(self, addresses: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Collective: every shard of the switches named (rank 0 asks each address with a
        PROBE of job 0; a switch of several shards lists their ports, CAP_SHARDS), in
        order, each once: INA_SWITCH may name one port of ``ina-switch --threads N``."""
        text = np.zeros(4096, np.uint8)
        if self.comm.Get_rank() == 0:
            found: list[tuple[str, int]] = []
            wait_each = min(0.5, self.settings.switch_join_timeout)
            for host, port in addresses:
                ports = _shard_ports((host, port), wait_each) or (port,)
                found += [(host, p) for p in ports if (host, p) not in found]
            raw = P.address_list_text(found).encode()
            if len(raw) <= text.size:
                text[:len(raw)] = np.frombuffer(raw, np.uint8)
        self.collective(self.comm.Ibcast(text, root=0), "the aggregators' shards")
        listed = text.tobytes().rstrip(b"\0").decode()
        if not listed or listed.count(",") >= MAX_AGGREGATORS:
            return addresses
        expanded = [(host, int(port)) for host, _, port in
                    (part.rpartition(":") for part in listed.split(","))]
        if len(expanded) > len(addresses):
            log.info("the aggregators at %s have %d shards: calls stripe across %s",
                     P.address_list_text(addresses), len(expanded), listed)
        return expanded


    def new_epoch(self) -> None:
        """Collective: a new epoch from rank 0 for every link, their slots from version
        0 again: the switch takes every cell of an earlier epoch for idle, whatever it
        holds (an opening the ranks left half done, docs/protocol.md)."""
        now = {link.epoch for link in self.links if link is not None}
        draw = random.SystemRandom().randrange
        epoch = np.array([draw(1, 65536)], np.int32)
        while int(epoch[0]) in now:
            epoch[0] = draw(1, 65536)
        self.collective(self.comm.Ibcast(epoch, root=0), "rank 0's new epoch")
        for link in self.links:
            if link is not None:
                link.new_epoch(int(epoch[0]))

    def collective(self, request: MPI.Request, what: str) -> None:
        wait(request, Deadline(self.settings.timeout),
             lambda: f"all {self.comm.Get_size()} ranks to exchange {what}")

    def close_link(self, i: int) -> None:
        link, self.links[i] = self.links[i], None
        if link is not None:
            self._count(self.retired, link)
            link.leave()
            link.close()

    def counts(self) -> dict[str, float]:
        """The links' calls' counts all told (transport.Link.totals), over reconnections,
        and the streams' latest RTT estimate (``srtt``, ``rto``: seconds)."""
        out = dict(self.retired)
        for link in self.links:
            if link is not None:
                self._count(out, link)
        return out

    @staticmethod
    def _count(into: dict[str, float], link: WorkerLink) -> None:
        for name, value in link.wire.totals.items():
            into[name] = into.get(name, 0) + value
        srtt, _, rto = link.wire.stream_rtt
        if srtt > 0:
            into["srtt"], into["rto"] = float(srtt), float(rto)

    def release(self) -> None:
        """This communicator is done: another may use the installed job now."""
        self.close()
        _installed_holders.discard(id(self))

    def close(self) -> None:
        self._close_watch()
        for i in range(len(self.links)):
            self.close_link(i)


    # -- leaving aggregators and coming back ----------------------------------------------

    def lost(self, indices: list[int], reason: str, seq: int) -> None:
        """Aggregators failed mid-call (on every rank alike): the others serve on, or
        calls take the ring until one is back."""
        for i in indices:
            self.missing_reasons[i] = reason
            self.close_link(i)
            self.lost_counts[i] = self.lost_counts.get(i, 0) + 1
        self._schedule(failed=False)
        if self.serving():
            self._job_warning("call #%d: %s; %s not used from now on, calls use the others%s",
                              seq, reason, ", ".join(self.where(i) for i in indices),
                              self._retry_text())
            return
        self.unavailable = reason
        self.outages += 1
        self.close()
        self._job_warning("call #%d: %s; calls take the ring%s", seq, reason,
                          self._retry_text())

    def _job_warning(self, message: str, *args: object) -> None:
        """A warning every rank would log alike (they decide together what becomes of the
        aggregators): rank 0 logs it, the others at debug level, so a job says it once."""
        log.log(logging.WARNING if self._rank == 0 else logging.DEBUG, message, *args)

    def _schedule(self, failed: bool) -> float:
        """Missing aggregators are tried again (unless switch_retry_seconds is 0): at once
        once one answers after an outage, or, after a failed join (``failed``), once
        rank 0's clock has passed the next gap (doubling, at most switch_retry_seconds):
        the gap, in seconds (0 after an outage)."""
        cap = self.settings.switch_retry_seconds
        self._retrying = cap > 0
        if not failed:
            self._retry_gap, self._due_at = RETRY_FIRST_GAP, 0.0
            return 0.0
        gap = min(self._retry_gap, cap)
        self._due_at = time.monotonic() + gap
        self._retry_gap = min(2 * self._retry_gap, cap)
        return gap

    def _retry_text(self) -> str:
        if not self._retrying:
            return "; not tried again (switch_retry_seconds is 0)"
        return (f"; rank 0 probes it, and the calls return to it once it answers (within "
                f"{self.settings.switch_retry_seconds:g} s of that, or at the next call)")

    def answers_again(self) -> int:
        """Rank 0's news for the next call boundary: a bit per missing aggregator (its
        index) that answered one of its probes since the last news (it may serve again)
        and is due to be tried (rank 0's clock: ``_schedule``), else 0. While one is
        missing (and tried again), rank 0 sends a probe at most every PROBE_INTERVAL
        seconds and reads the answers without waiting."""
        missing = self.missing()
        if not missing or not self._retrying or self.comm.Get_rank() != 0:
            self._close_watch()
            return 0
        if self._watch is None or self._watch.indices != missing:
            self._close_watch()
            try:
                self._watch = _AnswerWatch([self._prober(i) for i in missing], missing)
            except OSError as exc:  # (an installed port taken by another process)
                if not self._watch_failed:
                    log.warning("rank 0 cannot probe the missing aggregator(s) now: %s; "
                                "it tries again at the next call", exc)
                self._watch_failed = True
                return 0
            self._watch_failed = False
        self._heard |= self._watch.answered()
        if not self._heard or time.monotonic() < self._due_at:
            return 0
        heard, self._heard = self._heard, 0
        return heard

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None
        self._heard = 0

    def quiet_at(self, seq: int) -> bool:
        """Whether ``at_call_boundary(seq)`` is sure to change nothing (no slots grown, no
        aggregator missing that rank 0's news may bring back): the same on every rank."""
        if self._grow_at is not None and seq >= self._grow_at and self.serving():
            return False
        return not self._retrying or not self.missing()

    def at_call_boundary(self, seq: int, answers: int | None = None) -> None:
        """The chooser calls this before offering call number ``seq`` (the same number on
        every rank), with rank 0's news (``answers_again``, carried on the call's
        agreement; None where there was none: then, while an aggregator is missing, rank 0
        broadcasts it here): when a reconnection is due, it happens here, on every rank
        alike."""
        self._seq = seq
        if self._grow_at is not None and seq >= self._grow_at and self.serving():
            self._grow(seq)
        if not self._retrying or not self.missing():
            return
        if answers is None:
            news = np.array([self.answers_again()], np.int64)
            self.collective(self.comm.Ibcast(news, root=0),
                            "rank 0's news of the missing aggregators")
            answers = int(news[0])
        if answers:
            self._reconnect(seq, answers)

    def _reconnect(self, seq: int, alive: int) -> bool:
        """Collective: the missing aggregators that answered (``alive``, a bit per index,
        rank 0's news) are joined again by every rank (a new job and epoch, or the
        installed entry); True if one came back."""
        missing = self.missing()
        self._close_watch()  # (its socket may hold rank 0's installed port)
        back = [i for i in missing if alive >> i & 1]
        if back:
            was_serving = bool(self.serving())
            if not was_serving:
                self.unavailable = None
            self._connect(back)
            if not was_serving and self.link is not None:
                self.returns += 1
        returned = [i for i in back if self.links[i] is not None]
        for i in returned:
            if i in self.lost_counts:
                self.back_counts[i] = self.back_counts.get(i, 0) + 1
        if not returned:
            if self._lasting:
                self._retrying = False
                self._job_warning("call #%d: %s; not tried again", seq,
                                  self.unavailable or self._why_missing())
                return False
            gap = self._schedule(failed=True)
            log.info("call #%d: the aggregator answered but is still unavailable (%s); "
                     "tried again once it answers %.2f s from now or later", seq,
                     self.unavailable or self._why_missing(), gap)
            return False
        self._schedule(failed=False)
        if not self.missing():
            self._retrying = False
        self._job_warning("call #%d: the aggregator at %s serves again; calls return to it",
                          seq, ", ".join(self.where(i) for i in returned))
        return True

    def _prober(self, i: int) -> Prober:
        """How rank 0 asks whether aggregator ``i`` answers again: a PROBE of job 0 from
        any port, or, for a job a controller installed, its own PROBE as worker 0 from
        its installed port (a P4 switch answers nothing else)."""
        ports = [int(p) for p in self.settings.worker_ports.split(",") if p.strip()]
        if self._leaves and self.settings.job:
            # A tree a controller installed: rank 0's own leaf, as its worker there (a P4
            # leaf answers nothing else, and answers whether or not its root does).
            return Prober(self.addresses[i], self.settings.job, self._place[0],
                          ports[i * self.comm.Get_size()])
        if self._leaves:  # a tree: every leaf (each answers once its parent has)
            return [Prober(a) for a in self._leaves[i]]
        if not self.settings.job:
            return Prober(self.addresses[i])
        return Prober(self.addresses[i], self.settings.job, 0,
                      ports[i * self.comm.Get_size()])

    def _grow(self, seq: int) -> None:
        """Collective: rank 0 asks each aggregator that granted fewer slots than asked
        how many it has free (a PROBE of job 0); where some are, every rank leaves that
        aggregator and joins it again, to be granted what is free now."""
        short = [i for i in self.serving() if self.links[i].slots < self.links[i].asked_slots]
        self._grow_at = None
        if not short:
            return
        free = np.zeros(len(short), np.int64)
        if self.comm.Get_rank() == 0:
            wait_each = min(0.5, self.settings.switch_join_timeout)
            free[:] = [_free_slots(self.addresses[i], wait_each) for i in short]
        self.collective(self.comm.Ibcast(free, root=0), "the aggregators' free slots")
        regrow = [i for i, f in zip(short, free) if f > 0]
        for i in regrow:
            self.close_link(i)
        if regrow:  # every rank has left (the job's slots are free) before any joins again
            self.collective(self.comm.Ibarrier(), "every rank to leave the aggregator")
            self._connect(regrow)
            if not self.serving():
                self.lost([], self.unavailable or "ina: the aggregator refused the job",
                           seq)
                return
        if any(self.links[i] is not None and self.links[i].slots < self.links[i].asked_slots
               for i in short):
            self._grow_gap = min(2 * self._grow_gap, GROW_MAX_CALLS)
            self._grow_at = seq + self._grow_gap
        else:
            self._grow_gap = 1
            self._job_warning("call #%d: every aggregator grants the slots asked now", seq)


@dataclasses.dataclass(frozen=True)
class Prober:
    """Who probes an aggregator: its address, and the job, worker and local UDP port the
    PROBE comes from (job 0 from any port: is anyone there?)."""

    address: tuple[str, int]
    job: int = 0
    worker: int = 0
    port: int = 0


class _AnswerWatch:
    """Rank 0's probes of the missing aggregators: a PROBE to each at a call boundary, at
    most one per PROBE_INTERVAL seconds (a fast caller sends no more), answers read
    without waiting (so the call after the next probe's answer can rejoin). ``indices``:
    the aggregators' places in INA_SWITCH, the bits of ``answered``. Each prober has a
    socket of its own (an installed job's probe comes from the worker's installed
    port). An aggregator probed by several (a tree's leaves) answered once each of them
    has."""

    PROBE_INTERVAL = 0.05

    def __init__(self, probers: list[Prober | list[Prober]], indices: list[int]):
        self.indices = indices
        self.probers: list[Prober] = []
        self.owner: list[int] = []  # each prober's aggregator index
        for index, each in zip(indices, probers):
            for prober in each if isinstance(each, list) else [each]:
                self.probers.append(prober)
                self.owner.append(index)
        self.heard: set[int] = set()  # the probers heard since their aggregator's bit
        self.socks: list[socket.socket] = []
        try:
            for prober in self.probers:
                sock = udp_socket("0.0.0.0", prober.port)
                sock.setblocking(False)
                self.socks.append(sock)
        except OSError:
            self.close()
            raise
        self.packets = [P.control_packet(p.job, p.worker, [P.CTRL_PROBE])
                        for p in self.probers]
        self.sent_at = -float("inf")

    def answered(self) -> int:
        """A bit (its index) per aggregator that answered since the last look; sends the
        next probes if due."""
        wanted = P.FLAG_CONTROL | P.FLAG_RESULT
        for at, (prober, sock) in enumerate(zip(self.probers, self.socks)):
            while True:
                try:
                    data, source = sock.recvfrom(65536)
                except (BlockingIOError, InterruptedError):
                    break
                except OSError:  # ICMP port unreachable from an earlier probe: nobody there
                    continue
                try:
                    head, reply = P.read_control(data)
                except ValueError:
                    continue
                if (head["flags"] & wanted == wanted and head["job"] == prober.job
                        and len(reply) >= 2 and reply[0] == P.CTRL_PROBE and reply[1] == 0
                        and source == prober.address):
                    self.heard.add(at)
        seen = 0
        for index in self.indices:
            mine = {at for at, owner in enumerate(self.owner) if owner == index}
            if mine <= self.heard:
                seen |= 1 << index
                self.heard -= mine
        now = time.monotonic()
        if now - self.sent_at >= self.PROBE_INTERVAL:
            self.sent_at = now
            for prober, sock, packet in zip(self.probers, self.socks, self.packets):
                try:
                    sock.sendto(packet, prober.address)
                except OSError:
                    pass  # unreachable now: the next probe tries again
        return seen

    def close(self) -> None:
        for sock in self.socks:
            sock.close()


def _probe(address: tuple[str, int], job: int = 0, worker: int = 0, port: int = 0,
           timeout: float = 0.5) -> P.ControlReply | None:
    """An aggregator's answer to a PROBE (of job 0: is anyone there? its free slots, its
    shards; else: is this worker of the job installed at ``port``?), or None if it does
    not answer within timeout or says no."""
    try:
        with udp_socket("0.0.0.0", port) as s:
            reply = P.control_request(s, address, job, worker, [P.CTRL_PROBE], timeout,
                                      "probe")
    except (AggregatorUnavailable, ValueError, OSError):
        return None
    return reply if reply.status == 0 else None


def _free_slots(address: tuple[str, int], timeout: float) -> int:
    """The free slots an aggregator's pool has; 0 if it does not answer or say."""
    reply = _probe(address, timeout=timeout)
    return max(reply.slots, 0) if reply is not None else 0


def _shard_ports(address: tuple[str, int], timeout: float) -> tuple[int, ...]:
    """The ports of every shard of the switch at ``address``; () if it has one, does
    not answer or does not say."""
    reply = _probe(address, timeout=timeout)
    return reply.shard_ports if reply is not None else ()
