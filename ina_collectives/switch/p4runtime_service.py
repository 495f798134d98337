"""The software switch's P4Runtime server: the subset of P4Runtime the controller uses.

``ina-switch --p4runtime-port PORT`` serves, over gRPC, on a thread of the switch
process: StreamChannel arbitration, Set/GetForwardingPipelineConfig, Write and Read of
the ``ina_workers`` and ``ina_replicas`` table entries (and ``l2_forward``, stored
only), multicast group entries, the slot registers and the drop counter, with
P4Runtime's error conventions (a failed Write is gRPC UNKNOWN with one p4.v1.Error per
update in grpc-status-details-bin). It obeys what it is told: an installed worker entry
makes a job (K, S, B and the values' width from the pushed P4Info, the slot range and
worker count from the entry) that aggregates only from installed addresses; results go
to the replicas of the job's multicast group, each rewritten by its ``ina_replicas``
entry.

The data path (``_fast/switch_loop.pyx``) is not thread-safe and runs without the GIL:
every request is carried out by the switch's main loop between two batches (the
handler wakes it with a local control packet and waits, bounded), never per packet.
Needs the p4 extra (grpcio, p4runtime); the switch imports this only when asked to serve.
"""
from __future__ import annotations

import ipaddress
import itertools
import logging
import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, status_pb2
from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc

from .. import protocol as P
from ..control import schema as S
from ..errors import P4RuntimeError

MAX_MESSAGE_BYTES = 64 << 20  # the largest P4Runtime request taken (a pipeline push)

log = logging.getLogger("ina_collectives.p4runtime")

API_VERSION = "1.4.1"
WRITE_BATCH_LIMIT = 100_000  # updates per WriteRequest


def _bits_value(data: bytes, bits: int, what: str) -> int:
    value = int.from_bytes(data, "big")
    if not data or value >> bits:
        raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                             f"{what}: {data.hex() or 'empty'} is not a {bits}-bit value")
    return value


def _to_bytes(value: int, bits: int) -> bytes:
    return value.to_bytes((bits + 7) // 8, "big")


@dataclass
class ManagedJob:
    """A job as the installed ina_workers entries say it."""
    job: int
    n: int
    mcast_grp: int
    slot_base: int
    slot_count: int
    workers: dict[int, tuple[int, int]] = field(default_factory=dict)  # id -> addr, port


class Target:
    """The switch's P4Runtime state; every method runs in the switch's main loop."""

    def __init__(self, aggregator: Any, max_elements: int, device_id: int):
        self.aggregator = aggregator
        self.max_elements = max_elements
        self.device_id = device_id
        self.config: Any = None          # p4runtime_pb2.ForwardingPipelineConfig
        self.build: S.Build | None = None
        self.tables: dict[int, dict[tuple, Any]] = {}   # table id -> key -> TableEntry
        self.groups: dict[int, Any] = {}                 # group id -> MulticastGroupEntry
        self.jobs: dict[int, ManagedJob] = {}
        self.primary: tuple[int, int] | None = None      # the primary's election id
        self.streams: dict[int, tuple[int, int]] = {}
        self._register_map: tuple[S.Build, dict[int, tuple[Any, int, bool]]] | None = None
        self.leaf_jobs: set[int] = set()  # jobs an ina_parents entry made a tree's leaf
        self._features = aggregator.features  # what the switch states with no leaf job

    # -- arbitration ---------------------------------------------------------------

    def arbitrate(self, stream: int, election: tuple[int, int] | None) -> bool:
        """Register a stream's election id (None: the stream closed); True if primary."""
        if election is None:
            self.streams.pop(stream, None)
        else:
            self.streams[stream] = election
        self.primary = max(self.streams.values(), default=None)
        return election is not None and election == self.primary

    def check_primary(self, device_id: int, election: tuple[int, int]) -> None:
        if device_id != self.device_id:
            raise P4RuntimeError(code_pb2.NOT_FOUND,
                                 f"device id {device_id}: this switch is device {self.device_id}")
        if self.primary is None or election != self.primary:
            raise P4RuntimeError(code_pb2.PERMISSION_DENIED,
                                 f"election id {election} is not the primary's "
                                 f"({self.primary}); open a StreamChannel first")

    # -- pipeline ------------------------------------------------------------------

    def set_pipeline(self, request: Any) -> None:
        self.check_primary(request.device_id, (request.election_id.high,
                                               request.election_id.low))
        action = request.action
        A = p4runtime_pb2.SetForwardingPipelineConfigRequest
        if action in (A.VERIFY, A.VERIFY_AND_SAVE, A.VERIFY_AND_COMMIT,
                      A.RECONCILE_AND_COMMIT):
            try:
                build = S.read_build(request.config.p4info)
            except ValueError as exc:
                raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                     f"the P4Info is not an INA aggregator's: {exc}") from None
            # max_elements bounds a cell's values in int32s (as the switch's joins do).
            room = (P.MAX_DATAGRAM if self.max_elements >= P.MAX_ELEMENTS
                    else 4 * self.max_elements)
            if (build.k * build.value_bits // 8 > room
                    or P.packet_bytes(build.k, build.block, build.value_bits)
                    > P.MAX_DATAGRAM):
                raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                     f"the P4Info has K = {build.k} value registers of "
                                     f"{build.value_bits} bits (B {build.block}); this "
                                     f"switch takes at most {self.max_elements} int32 "
                                     f"values per packet")
            if action == A.VERIFY:
                return
            if (action == A.RECONCILE_AND_COMMIT and self.config is not None
                    and self.config.p4info == request.config.p4info):
                self.config = request.config  # same program: keep the state
                return
            self._clear()
            self.config, self.build = request.config, build
            self.tables = {t.preamble.id: {} for t in request.config.p4info.tables}
            # A Tofino build's P4Info: the switch serves as that build would (its
            # capabilities, protocol.CAP_*), as ina-switch --like does.
            from .._fast.switch_loop import FEATURES
            self.aggregator.features = (S.TOFINO[build.chip].capabilities if build.chip
                                        else FEATURES)
            log.info("pipeline set: K %d, S %d, B %d, %d-bit values%s", build.k,
                     build.slots, build.block, build.value_bits,
                     f", as the {build.chip} build" if build.chip else "")
        elif action == A.COMMIT:
            if self.config is None:
                raise P4RuntimeError(code_pb2.FAILED_PRECONDITION, "no saved pipeline to commit")
        else:
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT, f"unknown action {action}")

    def get_pipeline(self, request: Any) -> Any:
        if request.device_id != self.device_id:
            raise P4RuntimeError(code_pb2.NOT_FOUND, f"device id {request.device_id}: this "
                                 f"switch is device {self.device_id}")
        if self.config is None:
            raise P4RuntimeError(code_pb2.FAILED_PRECONDITION,
                                 "no forwarding pipeline config has been set")
        reply = p4runtime_pb2.GetForwardingPipelineConfigResponse()
        G = p4runtime_pb2.GetForwardingPipelineConfigRequest
        kind = request.response_type
        reply.config.cookie.CopyFrom(self.config.cookie)
        if kind in (G.ALL, G.P4INFO_AND_COOKIE):
            reply.config.p4info.CopyFrom(self.config.p4info)
        if kind in (G.ALL, G.DEVICE_CONFIG_AND_COOKIE):
            reply.config.p4_device_config = self.config.p4_device_config
        return reply

    def _clear(self) -> None:
        for job in list(self.jobs):
            self.aggregator.free_job(job)
            self._no_leaf(job)
        self.jobs.clear()
        self.tables.clear()
        self.groups.clear()

    def _need_pipeline(self) -> S.Build:
        if self.build is None:
            raise P4RuntimeError(code_pb2.FAILED_PRECONDITION,
                                 "no forwarding pipeline config has been set")
        return self.build

    # -- write ---------------------------------------------------------------------

    def write(self, request: Any) -> list[tuple[int, str]]:
        """Apply each update in order (CONTINUE_ON_ERROR); (code, message) per update."""
        self.check_primary(request.device_id, (request.election_id.high,
                                               request.election_id.low))
        self._need_pipeline()
        if request.atomicity != p4runtime_pb2.WriteRequest.CONTINUE_ON_ERROR:
            raise P4RuntimeError(code_pb2.UNIMPLEMENTED,
                                 "only CONTINUE_ON_ERROR atomicity is supported")
        if len(request.updates) > WRITE_BATCH_LIMIT:
            raise P4RuntimeError(code_pb2.RESOURCE_EXHAUSTED,
                                 f"more than {WRITE_BATCH_LIMIT} updates in one request")
        results = []
        for update in request.updates:
            try:
                self._update(update)
                results.append((code_pb2.OK, ""))
            except P4RuntimeError as exc:
                results.append((exc.code, str(exc)))
        return results

    def _update(self, update: Any) -> None:
        entity, kind = update.entity, update.type
        which = entity.WhichOneof("entity")
        if which == "table_entry":
            self._table_update(kind, entity.table_entry)
        elif which == "packet_replication_engine_entry":
            pre = entity.packet_replication_engine_entry
            if pre.WhichOneof("type") != "multicast_group_entry":
                raise P4RuntimeError(code_pb2.UNIMPLEMENTED,
                                     "only multicast group entries are supported")
            self._group_update(kind, pre.multicast_group_entry)
        elif which == "register_entry":
            self._register_write(kind, entity.register_entry)
        else:
            raise P4RuntimeError(code_pb2.UNIMPLEMENTED,
                                 f"{which} entities are not served by the software switch")

    def _table_update(self, kind: int, entry: Any) -> None:
        build = self._need_pipeline()
        schema = {build.ids[t.name]: t for t in (S.WORKERS, S.REPLICAS, S.MODES, S.PARENTS)
                  if t.name in build.ids}
        table = schema.get(entry.table_id)
        if entry.table_id not in self.tables:
            raise P4RuntimeError(code_pb2.NOT_FOUND, f"no table with id {entry.table_id}")
        if entry.is_default_action:
            raise P4RuntimeError(code_pb2.PERMISSION_DENIED,
                                 "the default actions of this program are const")
        info = next(t for t in self.config.p4info.tables if t.preamble.id == entry.table_id)
        key, fields = self._match(info, entry)
        entries = self.tables[entry.table_id]
        U = p4runtime_pb2.Update
        if kind == U.INSERT and key in entries:
            raise P4RuntimeError(code_pb2.ALREADY_EXISTS,
                                 f"{info.preamble.name}: an entry with this match exists")
        if kind in (U.MODIFY, U.DELETE) and key not in entries:
            raise P4RuntimeError(code_pb2.NOT_FOUND,
                                 f"{info.preamble.name}: no entry with this match")
        if kind not in (U.INSERT, U.MODIFY, U.DELETE):
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT, f"unknown update type {kind}")
        params = None if kind == U.DELETE else self._action(info, entry, table)
        if table is S.WORKERS:
            self._worker_update(kind, fields, params, entries.get(key))
        elif table is S.REPLICAS and params is not None:
            self._validate_rewrite(params)
        elif table is S.MODES:
            self._mode_update(fields["job_id"], params, entries.get(key))
        elif table is S.PARENTS:
            self._parent_update(fields["job_id"], params)
        if kind == U.DELETE:
            del entries[key]
        else:
            stored = p4runtime_pb2.TableEntry()
            stored.CopyFrom(entry)
            entries[key] = stored
        if table is S.REPLICAS:
            self._sync_replicas(group=fields["mcast_grp"])

    def _match(self, info: Any, entry: Any) -> tuple[tuple, dict[str, int]]:
        widths = {m.id: m for m in info.match_fields}
        seen: dict[int, int] = {}
        for m in entry.match:
            spec = widths.get(m.field_id)
            if spec is None:
                raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                     f"{info.preamble.name} has no match field {m.field_id}")
            if m.WhichOneof("field_match_type") != "exact":
                raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                     f"{info.preamble.name}.{spec.name} is an exact match")
            if m.field_id in seen:
                raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                     f"{info.preamble.name}.{spec.name} given twice")
            seen[m.field_id] = _bits_value(S.canonical(m.exact.value), spec.bitwidth,
                                           f"{info.preamble.name}.{spec.name}")
        missing = [m.name for m in info.match_fields if m.id not in seen]
        if missing:
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                 f"{info.preamble.name}: no value for {', '.join(missing)}")
        key = tuple(sorted(seen.items()))
        return key, {m.name: seen[m.id] for m in info.match_fields}

    def _action(self, info: Any, entry: Any, table: S.Table | None) -> dict[str, int]:
        if entry.action.WhichOneof("type") != "action":
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                 f"{info.preamble.name}: a direct action is required")
        action = entry.action.action
        allowed = {r.id for r in info.action_refs if r.scope != r.DEFAULT_ONLY}
        if action.action_id not in allowed:
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                 f"{info.preamble.name}: action {action.action_id} is not "
                                 "one of its entry actions")
        spec = next(a for a in self.config.p4info.actions
                    if a.preamble.id == action.action_id)
        given = {p.param_id: p.value for p in action.params}
        values = {}
        for p in spec.params:
            if p.id not in given:
                raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                     f"{spec.preamble.name}: no value for {p.name}")
            values[p.name] = _bits_value(S.canonical(given.pop(p.id)), p.bitwidth,
                                         f"{spec.preamble.name}({p.name})")
        if given:
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                 f"{spec.preamble.name}: unknown parameters {sorted(given)}")
        return values

    def _worker_update(self, kind: int, key: dict[str, int], params: dict[str, int] | None,
                       old: Any) -> None:
        """An ina_workers entry makes (or unmakes) a worker of a job in the data path."""
        job_id = key["job_id"]
        addr_be, port_be = P.ipv4_int_be(key["src_addr"]), P.port_be(key["src_port"])
        U = p4runtime_pb2.Update
        if kind in (U.MODIFY, U.DELETE):
            job = self.jobs[job_id]
            worker = next(w for w, a in job.workers.items() if a == (addr_be, port_be))
            if kind == U.MODIFY:
                self._check_worker(job_id, params, replacing=worker)
            del job.workers[worker]
            self.aggregator.clear_worker(job_id, worker)
            if not job.workers:
                self.aggregator.free_job(job_id)
                self._no_leaf(job_id)
                del self.jobs[job_id]
                log.info("job %d: last worker entry deleted, job freed", job_id)
            if kind == U.DELETE:
                return
        self._check_worker(job_id, params)
        job = self.jobs.get(job_id)
        if job is None:
            job = ManagedJob(job_id, params["num_workers"], params["mcast_grp"],
                             params["slot_base"], params["slot_count"])
            build = self.build
            if not self.aggregator.add_job(job_id, job.n, build.k, job.slot_count,
                                           build.block, build.value_bits):
                raise P4RuntimeError(code_pb2.RESOURCE_EXHAUSTED,
                                     f"no memory for job {job_id}")
            self.aggregator.set_managed(job_id)
            self.jobs[job_id] = job
            log.info("job %d installed: %d workers, K %d, B %d, %d-bit values, slots "
                     "%d..%d, group %d", job_id, job.n, build.k, build.block,
                     build.value_bits, job.slot_base, job.slot_base + job.slot_count - 1,
                     job.mcast_grp)
        job.workers[params["worker_id"]] = (addr_be, port_be)
        self.aggregator.set_worker(job_id, params["worker_id"], addr_be, port_be)
        self._sync_replicas(job=job_id)

    def _mode_update(self, job_id: int, params: dict[str, int] | None, old: Any) -> None:
        """An ina_modes entry sets the mode a job's results announce (docs/quorum.md);
        deleting it asks for sync again, with the next generation."""
        if self.aggregator.mode(job_id) is None:
            raise P4RuntimeError(code_pb2.NOT_FOUND,
                                 f"{S.MODES.name}: no job {job_id} (install its workers "
                                 "first)")
        if params is None:
            generation = self.aggregator.mode(job_id)[1] + 1
            quorum = 0
        else:
            quorum, generation = params["quorum"], params["generation"]
        try:
            self.aggregator.set_mode(job_id, quorum, generation & 0xFFFFFFFF)
        except ValueError as exc:
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                 f"{S.MODES.name} entry for job {job_id}: {exc}") from None
        log.info("job %d: mode %s (generation %d)", job_id,
                 f"quorum {quorum}" if quorum else "sync", generation)

    def _parent_update(self, job_id: int, params: dict[str, int] | None) -> None:
        """An ina_parents entry makes the job a tree's leaf here (docs/trees.md): its
        completed cells go up to the parent from this switch's socket; deleting it makes
        the job an ordinary one again. The switch's own socket is the leaf's address (the
        entry's port and MAC are a P4 switch's)."""
        job = self.jobs.get(job_id)
        if job is None:
            raise P4RuntimeError(code_pb2.NOT_FOUND,
                                 f"{S.PARENTS.name}: no job {job_id} (install its workers "
                                 "first)")
        if params is None:
            self.aggregator.clear_parent(job_id)
            self._no_leaf(job_id)
            log.info("job %d: no parent, a flat job again", job_id)
            return
        if (params["mcast_grp"], params["slot_base"], params["slot_count"]) != (
                job.mcast_grp, job.slot_base, job.slot_count):
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                 f"{S.PARENTS.name} entry for job {job_id}: group and slots "
                                 f"{params['mcast_grp']}, {params['slot_base']}+"
                                 f"{params['slot_count']} differ from its workers' "
                                 f"{job.mcast_grp}, {job.slot_base}+{job.slot_count}")
        # (While it has a leaf job, its jobs take openings alone, as a leaf by topology:
        # server.py. The capabilities are the switch's, not a job's.)
        self.leaf_jobs.add(job_id)
        self.aggregator.features = self._features & ~(P.CAP_PREDICT | P.CAP_QUORUM)
        try:
            self.aggregator.set_parent(job_id, P.ipv4_int_be(params["parent_addr"]),
                                       P.port_be(params["parent_port"]), params["up_worker"])
        except ValueError as exc:
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                 f"{S.PARENTS.name} entry for job {job_id}: {exc}") from None
        log.info("job %d: a tree's leaf, worker %d of the parent at %s:%d", job_id,
                 params["up_worker"], ipaddress.IPv4Address(params["parent_addr"]),
                 params["parent_port"])

    def _no_leaf(self, job_id: int) -> None:
        """The job is no leaf (any more); with no leaf job left, the switch states
        predicted windows and quorum cells again."""
        self.leaf_jobs.discard(job_id)
        if not self.leaf_jobs:
            self.aggregator.features = self._features

    def _check_worker(self, job_id: int, p: dict[str, int], replacing: int | None = None
                      ) -> None:
        build = self.build
        where = f"{S.WORKERS.name} entry for job {job_id}"

        def bad(message: str) -> P4RuntimeError:
            return P4RuntimeError(code_pb2.INVALID_ARGUMENT, f"{where}: {message}")

        n, w = p["num_workers"], p["worker_id"]
        if not 1 <= n <= P.MAX_WORKERS or w >= n:
            raise bad(f"worker {w} of {n} (at most {P.MAX_WORKERS} workers)")
        if p["worker_bit"] != 1 << w:
            raise bad(f"worker_bit {p['worker_bit']:#x} is not bit {w}")
        if p["mcast_grp"] == 0:
            raise bad("multicast group 0 means none")
        if p["slot_count"] < 1 or p["slot_base"] + p["slot_count"] > build.slots:
            raise bad(f"slots {p['slot_base']}+{p['slot_count']} exceed the pipeline's "
                      f"{build.slots}")
        job = self.jobs.get(job_id)
        if job is None:
            if self.aggregator.job_shape(job_id) is not None:
                raise P4RuntimeError(code_pb2.FAILED_PRECONDITION,
                                     f"{where}: job {job_id} was joined without a controller")
            for other in self.jobs.values():
                if (p["slot_base"] < other.slot_base + other.slot_count
                        and other.slot_base < p["slot_base"] + p["slot_count"]):
                    raise bad(f"slots {p['slot_base']}+{p['slot_count']} overlap job "
                              f"{other.job}'s {other.slot_base}+{other.slot_count}")
            return
        shape = (job.n, job.mcast_grp, job.slot_base, job.slot_count)
        if shape != (n, p["mcast_grp"], p["slot_base"], p["slot_count"]):
            raise bad(f"job {job_id} is installed with {job.n} workers, group "
                      f"{job.mcast_grp}, slots {job.slot_base}+{job.slot_count}; the entry "
                      "disagrees")
        if w in job.workers and w != replacing:
            raise bad(f"worker {w} is installed at another address")

    def _validate_rewrite(self, p: dict[str, int]) -> None:
        if p["dst_addr"] == 0 or p["dst_port"] == 0:
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                 f"{S.REWRITE.name}: address and port must be non-zero")

    def _group_update(self, kind: int, group: Any) -> None:
        U = p4runtime_pb2.Update
        gid = group.multicast_group_id
        if gid == 0:
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT, "multicast group 0 means none")
        if kind == U.INSERT and gid in self.groups:
            raise P4RuntimeError(code_pb2.ALREADY_EXISTS, f"multicast group {gid} exists")
        if kind in (U.MODIFY, U.DELETE) and gid not in self.groups:
            raise P4RuntimeError(code_pb2.NOT_FOUND, f"no multicast group {gid}")
        if kind == U.DELETE:
            del self.groups[gid]
        else:
            if len(group.replicas) > P.MAX_WORKERS:
                raise P4RuntimeError(code_pb2.RESOURCE_EXHAUSTED,
                                     f"multicast group {gid}: at most {P.MAX_WORKERS} "
                                     "replicas")
            seen = {(r.egress_port, r.instance) for r in group.replicas}
            if len(seen) != len(group.replicas):
                raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                     f"multicast group {gid}: a replica is given twice")
            stored = p4runtime_pb2.MulticastGroupEntry()
            stored.CopyFrom(group)
            self.groups[gid] = stored
        self._sync_replicas(group=gid)

    def _sync_replicas(self, job: int | None = None, group: int | None = None) -> None:
        """Recompute where results go, for one job or every job of a group: each replica
        of the job's group whose (group, replica id) has a rewrite entry (a replica
        without one is dropped, as by the P4 program's default action)."""
        info = next(t for t in self.config.p4info.tables
                    if t.preamble.id == self.build.ids[S.REPLICAS.name])
        fields = {m.name: m.id for m in info.match_fields}
        action = next(a for a in self.config.p4info.actions
                      if a.preamble.id == self.build.ids[S.REWRITE.name])
        params = {p.name: p.id for p in action.params}
        by_key = {}
        for entry in self.tables.get(info.preamble.id, {}).values():
            m = {f.field_id: int.from_bytes(f.exact.value, "big") for f in entry.match}
            a = {p.param_id: int.from_bytes(p.value, "big") for p in entry.action.action.params}
            by_key[(m[fields["mcast_grp"]], m[fields["rid"]])] = (a[params["dst_addr"]],
                                                                  a[params["dst_port"]])
        for j in self.jobs.values():
            if (job is not None and j.job != job) or (group is not None and
                                                      j.mcast_grp != group):
                continue
            replicas = []
            entry = self.groups.get(j.mcast_grp)
            for r in (entry.replicas if entry is not None else ()):
                dest = by_key.get((j.mcast_grp, r.instance))
                if dest is not None:
                    addr, port = dest
                    replicas.append((P.ipv4_int_be(addr), P.port_be(port)))
            self.aggregator.set_replicas(j.job, replicas)

    # -- registers and counters --------------------------------------------------------

    def _registers(self) -> dict[int, tuple[Any, int, bool]]:
        """register id -> (what the aggregator calls it, bit width, per slot): "bitmap",
        "count", "chunk", "epoch", ("exponent", g), ("proposal", g) (16 bits), or the
        element index of a value register (V bits); per slot: one entry for both
        versions' cells (a Tofino build's epoch)."""
        build = self._need_pipeline()
        if self._register_map is None or self._register_map[0] is not build:
            self._register_map = (build, {build.ids[reg.name]: (reg.state, reg.bits,
                                                                 build.per_slot(reg))
                                          for reg in build.registers})
        return self._register_map[1]

    def _owner(self, index: int) -> tuple[int, int] | None:
        """The (job, job-local cell) that a pipeline-wide register index belongs to."""
        slots = self.build.slots
        version, slot = divmod(index, slots)
        for j in self.jobs.values():
            if j.slot_base <= slot < j.slot_base + j.slot_count:
                return j.job, version * j.slot_count + slot - j.slot_base
        return None

    def _register_write(self, kind: int, entry: Any) -> None:
        if kind != p4runtime_pb2.Update.MODIFY:
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT,
                                 "register entries can only be modified")
        registers = self._registers()
        if entry.register_id not in registers:
            raise P4RuntimeError(code_pb2.NOT_FOUND, f"no register with id {entry.register_id}")
        what, bits, per_slot = registers[entry.register_id]
        if entry.data.WhichOneof("data") != "bitstring":
            raise P4RuntimeError(code_pb2.INVALID_ARGUMENT, "register data must be a bitstring")
        value = _bits_value(S.canonical(entry.data.bitstring), bits, f"register {what}")
        for index in self._register_indices(entry, per_slot):
            for cell in ((index, index + self.build.slots) if per_slot else (index,)):
                owner = self._owner(cell)
                if owner is not None:  # cells of no installed job hold nothing: always 0
                    self.aggregator.set_cell(owner[0], owner[1], what, value)

    def _register_indices(self, entry: Any, per_slot: bool = False) -> list[int] | range:
        """The entries a register entry names: its index, or every entry if it has none
        (a cell's, or a slot's where ``per_slot``)."""
        cells = self.build.slots if per_slot else 2 * self.build.slots
        if not entry.HasField("index"):
            return range(cells)
        if not 0 <= entry.index.index < cells:
            raise P4RuntimeError(code_pb2.OUT_OF_RANGE,
                                 f"register index {entry.index.index} (size {cells})")
        return [entry.index.index]

    def _register_read(self, entry: Any) -> Iterator[Any]:
        registers = self._registers()
        ids = [entry.register_id] if entry.register_id else sorted(registers)
        for rid in ids:
            if rid not in registers:
                raise P4RuntimeError(code_pb2.NOT_FOUND, f"no register with id {rid}")
            what, bits, per_slot = registers[rid]
            for index in self._register_indices(entry, per_slot):
                owner = self._owner(index)
                value = 0 if owner is None else self.aggregator.get_cell(owner[0], owner[1],
                                                                          what)
                out = p4runtime_pb2.Entity()
                out.register_entry.register_id = rid
                out.register_entry.index.index = index
                out.register_entry.data.bitstring = _to_bytes(value, bits)
                yield out

    def _counter_read(self, entry: Any) -> Iterator[Any]:
        """The drop counter (by reason) and the per-job results counter (by job id; a
        read of all of it yields the jobs present only, not 65536 zeros)."""
        build = self._need_pipeline()
        drops = build.ids.get(S.DROPS_COUNTER_NAME)
        jobs = build.ids.get(S.JOB_RESULTS_COUNTER_NAME)
        leaf = build.ids.get(S.LEAF_COUNTER_NAME)
        wanted = [c for c in (drops, jobs, leaf)
                  if c is not None and entry.counter_id in (0, c)]
        if not wanted:
            raise P4RuntimeError(code_pb2.NOT_FOUND, f"no counter with id {entry.counter_id}")
        sizes = {drops: len(S.DROP_REASONS), jobs: S.JOB_IDS, leaf: len(S.LEAF_EVENTS)}
        for cid in wanted:
            size = sizes[cid]
            if entry.HasField("index") and not 0 <= entry.index.index < size:
                raise P4RuntimeError(code_pb2.OUT_OF_RANGE,
                                     f"counter index {entry.index.index} (size {size})")
            if entry.HasField("index"):
                indices = [entry.index.index]
            else:
                indices = self.aggregator.job_ids() if cid == jobs else range(size)
            for i in indices:
                out = p4runtime_pb2.Entity()
                out.counter_entry.counter_id = cid
                out.counter_entry.index.index = i
                out.counter_entry.data.packet_count = (
                    self.aggregator.drop_count(i) if cid == drops
                    else getattr(self.aggregator, S.LEAF_EVENTS[i]) if cid == leaf
                    else self.aggregator.job_results(i) or 0)
                yield out

    # -- read ----------------------------------------------------------------------

    def read(self, request: Any) -> list[Any]:
        if request.device_id != self.device_id:
            raise P4RuntimeError(code_pb2.NOT_FOUND, f"device id {request.device_id}: this "
                                 f"switch is device {self.device_id}")
        self._need_pipeline()
        found: list[Any] = []
        for entity in request.entities:
            which = entity.WhichOneof("entity")
            if which == "table_entry":
                found.extend(self._table_read(entity.table_entry))
            elif which == "packet_replication_engine_entry":
                gid = entity.packet_replication_engine_entry.multicast_group_entry \
                    .multicast_group_id
                for g, group in sorted(self.groups.items()):
                    if gid in (0, g):
                        out = p4runtime_pb2.Entity()
                        out.packet_replication_engine_entry.multicast_group_entry.CopyFrom(
                            group)
                        found.append(out)
            elif which == "register_entry":
                found.extend(self._register_read(entity.register_entry))
            elif which == "counter_entry":
                found.extend(self._counter_read(entity.counter_entry))
            else:
                raise P4RuntimeError(code_pb2.UNIMPLEMENTED,
                                     f"reading {which} entities is not supported")
        return found

    def _table_read(self, entry: Any) -> Iterator[Any]:
        if entry.table_id and entry.table_id not in self.tables:
            raise P4RuntimeError(code_pb2.NOT_FOUND, f"no table with id {entry.table_id}")
        for tid in ([entry.table_id] if entry.table_id else sorted(self.tables)):
            info = next(t for t in self.config.p4info.tables if t.preamble.id == tid)
            wanted = None
            if entry.match:
                wanted, _ = self._match(info, entry)
            for key, stored in self.tables[tid].items():
                if wanted is None or key == wanted:
                    out = p4runtime_pb2.Entity()
                    out.table_entry.CopyFrom(stored)
                    yield out


def _status_details(results: list[tuple[int, str]]) -> bytes:
    status = status_pb2.Status(code=code_pb2.UNKNOWN,
                               message="; ".join(m for c, m in results if c) or "write failed")
    for code, message in results:
        error = p4runtime_pb2.Error(canonical_code=code, message=message)
        detail = any_pb2.Any()
        detail.Pack(error)
        status.details.append(detail)
    return status.SerializeToString()


_GRPC_CODE = {c.value[0]: c for c in grpc.StatusCode}


class Servicer(p4runtime_pb2_grpc.P4RuntimeServicer):
    """gRPC handlers: each hands its work to the switch's loop (``run``) and waits."""

    def __init__(self, target: Target, run: Callable[[Callable[[], Any], str], Any]):
        self.target, self.run = target, run
        self._streams = itertools.count(1)

    def _fail(self, context: Any, exc: P4RuntimeError) -> None:
        context.abort(_GRPC_CODE.get(exc.code, grpc.StatusCode.UNKNOWN), str(exc))

    def _call(self, context: Any, fn: Callable[[], Any], what: str) -> Any:
        try:
            return self.run(fn, what)
        except P4RuntimeError as exc:
            self._fail(context, exc)

    def Write(self, request: Any, context: Any) -> Any:
        results = self._call(context, lambda: self.target.write(request), "Write")
        if any(code != code_pb2.OK for code, _ in results):
            context.set_trailing_metadata((("grpc-status-details-bin",
                                            _status_details(results)),))
            context.abort(grpc.StatusCode.UNKNOWN,
                          "; ".join(m for c, m in results if c))
        return p4runtime_pb2.WriteResponse()

    def Read(self, request: Any, context: Any) -> Iterator[Any]:
        entities = self._call(context, lambda: self.target.read(request), "Read")
        for start in range(0, len(entities), 1000):
            reply = p4runtime_pb2.ReadResponse()
            reply.entities.extend(entities[start:start + 1000])
            yield reply
        if not entities:
            yield p4runtime_pb2.ReadResponse()

    def SetForwardingPipelineConfig(self, request: Any, context: Any) -> Any:
        self._call(context, lambda: self.target.set_pipeline(request),
                   "SetForwardingPipelineConfig")
        return p4runtime_pb2.SetForwardingPipelineConfigResponse()

    def GetForwardingPipelineConfig(self, request: Any, context: Any) -> Any:
        return self._call(context, lambda: self.target.get_pipeline(request),
                          "GetForwardingPipelineConfig")

    def Capabilities(self, request: Any, context: Any) -> Any:
        return p4runtime_pb2.CapabilitiesResponse(p4runtime_api_version=API_VERSION)

    def StreamChannel(self, request_iterator: Any, context: Any) -> Iterator[Any]:
        stream = next(self._streams)
        try:
            for message in request_iterator:
                if message.WhichOneof("update") != "arbitration":
                    continue  # packet-out and digest acks: this switch has no CPU port
                arb = message.arbitration
                if arb.device_id != self.target.device_id:
                    context.abort(grpc.StatusCode.NOT_FOUND,
                                  f"device id {arb.device_id}: this switch is device "
                                  f"{self.target.device_id}")
                election = (arb.election_id.high, arb.election_id.low)
                primary = self.run(lambda: self.target.arbitrate(stream, election),
                                   "arbitration")
                reply = p4runtime_pb2.StreamMessageResponse()
                reply.arbitration.device_id = arb.device_id
                reply.arbitration.election_id.CopyFrom(arb.election_id)
                reply.arbitration.status.code = code_pb2.OK if primary else \
                    code_pb2.ALREADY_EXISTS
                reply.arbitration.status.message = "primary" if primary else "backup"
                yield reply
        finally:
            try:
                self.run(lambda: self.target.arbitrate(stream, None), "stream close")
            except P4RuntimeError:
                pass  # the switch is stopping


class Server:
    """The gRPC server on its own threads, bound to host:port (0: any free port)."""

    def __init__(self, target: Target, run: Callable[[Callable[[], Any], str], Any],
                 host: str, port: int):
        # A Tofino build's device config (its context.json, several MiB) is over gRPC's
        # default 4 MiB per message.
        self.server = grpc.server(futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="p4runtime"),
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        p4runtime_pb2_grpc.add_P4RuntimeServicer_to_server(Servicer(target, run), self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if not self.port:
            raise OSError(f"cannot listen for P4Runtime on {host}:{port}")
        self.host = host
        self.server.start()

    def stop(self, grace: float = 1.0) -> None:
        self.server.stop(grace).wait(grace + 1.0)


class LoopRunner:
    """Hands functions to the switch's main loop and waits for them, bounded."""

    def __init__(self, wake: Callable[[], None], timeout: float = 10.0):
        self.wake, self.timeout = wake, timeout
        self.pending: list[tuple[Callable[[], Any], futures.Future]] = []
        self.lock = threading.Lock()
        self.closed = False

    def __call__(self, fn: Callable[[], Any], what: str) -> Any:
        future: futures.Future = futures.Future()
        with self.lock:
            if self.closed:
                raise P4RuntimeError(code_pb2.UNAVAILABLE, "the switch is stopping")
            self.pending.append((fn, future))
        self.wake()
        try:
            return future.result(self.timeout)
        except futures.TimeoutError:
            future.cancel()
            raise P4RuntimeError(code_pb2.UNAVAILABLE,
                                 f"the switch's loop did not carry out the {what} within "
                                 f"{self.timeout:g} s") from None

    def run_pending(self) -> None:
        """In the switch's loop: carry out what the handlers asked for."""
        with self.lock:
            work, self.pending = self.pending, []
        for fn, future in work:
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except P4RuntimeError as exc:
                future.set_exception(exc)
            except Exception as exc:  # a bug: reported to the client, the switch lives
                log.exception("P4Runtime request failed")
                future.set_exception(P4RuntimeError(code_pb2.INTERNAL, f"{type(exc).__name__}: "
                                                    f"{exc}"))

    def close(self) -> None:
        with self.lock:
            self.closed = True
            work, self.pending = self.pending, []
        for _, future in work:
            if future.set_running_or_notify_cancel():
                future.set_exception(P4RuntimeError(code_pb2.UNAVAILABLE,
                                                    "the switch is stopping"))
