"""The controller: configures an INA job on any aggregator over P4Runtime (p4runtime-shell).

    from ina_collectives.control import Controller, JobSpec, Worker
    job = JobSpec(job_id=7, workers=[Worker("10.0.0.1", 40001), Worker("10.0.0.2", 40001)],
                  slots=8)
    with Controller("127.0.0.1:9559", "p4/ina_aggregator.p4info.txt", "build/ina.json") as c:
        c.configure(job)     # pipeline pushed at connect; workers, group, rewrites, reset
        ...                  # the ranks run (INA_JOB=7, worker id = rank)
        c.teardown(job)

The target is a BMv2 ``simple_switch_grpc`` running p4/ina_aggregator.p4 or the
software switch (``ina-switch --p4runtime-port``); both take the same writes
(docs/control.md). What this module installs, per job:

* ``IngressImpl.ina_workers``: (job, worker IPv4, worker UDP port) -> ``admit`` (worker
  id, its bitmap bit, the worker count, the multicast group, the slot range);
* a multicast group (id = the job's, by default the job id) with one replica per
  worker (egress port = the worker's switch port, replica id = worker id);
* ``EgressImpl.ina_replicas``: (group, replica id) -> ``rewrite_result`` (MAC, IPv4,
  UDP port of the worker);
* zeros in the job's cells of the slot registers (bitmap, count, chunk, epoch) and of
  the per-sub-block ``exponent_<g>`` and ``proposal_<g>``, by raw P4Runtime register
  writes (the shell has no register API); value registers need no reset: the first
  packet of a use loads them.

p4runtime-shell keeps its client in a module global, runs a non-daemon stream thread
and calls sys.exit when setup fails. This module does the shell's setup itself: every
RPC has a deadline, a failed handshake cancels its stream, the stream thread is always
joined with a bound (cancelled if it lingers), and failures raise ControlError naming
the target's error codes. One Controller at a time per process.
"""
from __future__ import annotations

import ipaddress
import logging
import threading
from pathlib import Path
from typing import Any, Iterable, Sequence

from .. import protocol as P
from ..errors import ControlError, TargetUnavailable
from . import pipeline
from . import schema as S
from .job import JobSpec

log = logging.getLogger("ina_collectives.control")

ENTITIES_USED = S.ENTITIES_USED
REGISTER_BATCH = 2048  # register updates per WriteRequest


def _write_error(what: str, exc: BaseException, names: Sequence[str] | None = None) -> str:
    """A shell/gRPC error as text that names the target's codes (and the entries)."""
    errors = getattr(exc, "errors", None)
    if errors:  # P4RuntimeWriteException: [(index, p4.v1.Error)]
        from google.rpc import code_pb2

        parts = []
        for index, error in errors:
            name = code_pb2.Code.Name(error.canonical_code)
            who = names[index] if names and index < len(names) else f"update {index}"
            parts.append(f"{who}: {name} {error.message}".rstrip())
        return f"{what} failed: " + "; ".join(parts)
    rpc = getattr(exc, "grpc_error", exc)  # the shell's P4RuntimeException wraps it
    if callable(getattr(rpc, "code", None)) and callable(getattr(rpc, "details", None)):
        return f"{what} failed: {rpc.code().name} {rpc.details()}"
    return f"{what} failed: {exc}"


def _error_codes(exc: BaseException) -> list[str]:
    from google.rpc import code_pb2

    return [code_pb2.Code.Name(e.canonical_code) for _, e in getattr(exc, "errors", [])]


_session = threading.Lock()  # p4runtime-shell's client and context are module globals


_parsed: dict[tuple[str, int, int], Any] = {}  # parsed_p4info's, by path and version


def _version(path: str | Path) -> tuple[str, int, int]:
    stat = Path(path).stat()
    return str(path), stat.st_mtime_ns, stat.st_size


def parsed_p4info(path: str | Path) -> Any:
    """The P4Info in text format at ``path``, parsed once per version of the file in this
    process (p4runtime-shell's protobuf is the pure-Python one: the parse of a build with
    K = 4096 takes most of a second). The message is shared: read it, copy it, never
    change it."""
    from google.protobuf import text_format
    from p4.config.v1 import p4info_pb2

    key = _version(path)
    if key not in _parsed:
        try:
            message = text_format.Parse(Path(path).read_text(), p4info_pb2.P4Info(),
                                        allow_unknown_field=True)
        except text_format.ParseError as exc:
            raise ControlError(f"{path} is not a P4Info in text format: {exc}") from None
        _parsed.clear()  # (one program at a time, as a rule: keep the last)
        _parsed[key] = message
    return _parsed[key]


def write_p4info(path: str | Path, message: Any) -> None:
    """Write the P4Info ``message`` to ``path`` in text format, and take it as that
    file's parse (parsed_p4info)."""
    from google.protobuf import text_format

    Path(path).write_text(text_format.MessageToString(message))
    _parsed.clear()
    _parsed[_version(path)] = message


class Controller:
    """A P4Runtime session with one target; a context manager (closing always tears the
    session down, bounded). ``push``: "always" sets the pipeline (VERIFY_AND_COMMIT, which
    clears the target's state), "if-needed" only when the target has another P4Info or
    none, "never" uses what the target has."""

    def __init__(self, address: str, p4info: str | Path | None = None,
                 device_config: str | Path | None = None, *, device_id: int = 1,
                 election_id: tuple[int, int] = (0, 1), timeout: float = 10.0,
                 push: str = "always", known_p4info: Any = None,
                 target: str | None = None):
        if push not in ("always", "if-needed", "never"):
            raise ValueError(f"push must be always, if-needed or never, got {push!r}")
        if target is not None and target not in pipeline.TARGETS:
            raise ValueError(f"target must be one of {pipeline.TARGETS}, got {target!r}")
        if device_config is not None and Path(device_config).is_dir():
            # A Tofino build: the compiler's folder, its P4Info beside the pipeline.
            found = pipeline.find_tofino_build(device_config)
            if p4info is None:
                p4info = found.p4info
        if push != "never" and (p4info is None or device_config is None):
            raise ValueError("pushing a pipeline needs the P4Info and the device config")
        for path in (p4info, device_config):
            if path is not None and not Path(path).exists():
                raise ControlError(f"no such file: {path}")
        self.target = target
        self.address, self.device_id, self.election_id = address, device_id, election_id
        self.p4info_path, self.device_config_path = p4info, device_config
        self.timeout, self.push = timeout, push
        self.build: S.Build | None = None
        # What the target runs: the P4Info this session pushed or read (``p4info_message``
        # of another session of this process, passed as ``known_p4info`` with push
        # "never", is taken as it is, not read back).
        self.p4info_message: Any = known_p4info
        # Whether the target's cells are as a pipeline push left them (zero): the first
        # job configured after this session's push needs no register reset.
        self._fresh_cells = False
        self._client: Any = None
        self._sh: Any = None
        self._owns_session = False

    # -- session -------------------------------------------------------------------

    def __enter__(self) -> "Controller":
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def connect(self) -> "Controller":
        try:
            import grpc
            from p4runtime_sh import shell as sh
        except ImportError as exc:
            raise ControlError(f"the controller needs the p4 extra (pip install "
                               f"'ina-collectives[p4]'): {exc}") from None
        if not _session.acquire(blocking=False):
            raise ControlError("another Controller session is open in this process "
                               "(p4runtime-shell keeps one client)")
        self._owns_session, self._sh = True, sh
        try:
            channel = grpc.insecure_channel(self.address)
            try:
                grpc.channel_ready_future(channel).result(timeout=self.timeout)
            except grpc.FutureTimeoutError:
                raise TargetUnavailable(f"no P4Runtime target answers at {self.address} "
                                        f"within {self.timeout:g} s") from None
            finally:
                channel.close()
            self._client = _client_class()(self.device_id, self.address, self.election_id,
                                           self.timeout)
            sh.client = self._client
            # Quiet: the shell prints every field it sets when verbose. (The option shares
            # its value with canonical bytestrings, so values go padded; servers accept
            # both, the software switch compares them canonically.)
            from p4runtime_sh.global_options import global_options
            global_options["verbose"] = False
            info = self._set_pipeline()
            if info is None:
                info = self._rpc("GetForwardingPipelineConfig", self._client.get_p4info)
            self.p4info_message = info
            sh.context.set_p4info(S.with_local_names(info))
            try:
                self.build = S.read_build(info)
            except ValueError as exc:
                raise ControlError(f"the target at {self.address} does not run the INA "
                                   f"aggregator: {exc}") from None
            log.info("connected to %s: K %d, S %d, B %d, %d-bit values", self.address,
                     self.build.k, self.build.slots, self.build.block,
                     self.build.value_bits)
            return self
        except BaseException:
            self.close()
            raise

    def _set_pipeline(self) -> Any:
        """Push the pipeline as ``push`` says; the P4Info the target runs when this
        session knows it without asking (pushed, compared, or ``known_p4info``), else
        None."""
        if self.push == "never":
            return self.p4info_message
        wanted = parsed_p4info(self.p4info_path)
        if self.push == "if-needed":
            try:
                if self._client.get_p4info() == wanted:
                    return wanted
            except Exception:  # no pipeline yet: push one
                pass
        self._clear_groups()
        from p4.v1 import p4runtime_pb2

        A = p4runtime_pb2.SetForwardingPipelineConfigRequest
        request = A(device_id=self.device_id, action=A.VERIFY_AND_COMMIT)
        request.election_id.high, request.election_id.low = self.election_id
        request.config.p4info.CopyFrom(wanted)
        request.config.p4_device_config = pipeline.device_config(self.device_config_path,
                                                                 self.target)
        self._rpc("SetForwardingPipelineConfig", self._client.stub.SetForwardingPipelineConfig,
                  request)
        self._fresh_cells = True
        return wanted

    def _clear_groups(self) -> None:
        """Delete every multicast group the target reports, before a pipeline push.

        BMv2's replication engine keeps its groups across a push while P4Runtime forgets
        them: a group created again after the push would add its replicas to the old
        ones (results delivered twice). Deleted first, nothing is left behind."""
        try:
            info = self._client.get_p4info()
        except Exception:  # no pipeline yet: no groups either
            return
        self._sh.context.set_p4info(S.with_local_names(info))
        for group in self._read("multicast groups", self._sh.MulticastGroupEntry()):
            gid = group.msg().multicast_group_entry.multicast_group_id
            self._write(f"deleting multicast group {gid} before the pipeline push",
                        [self._update("DELETE", group)], [f"multicast group {gid}"])
            log.info("multicast group %d deleted before the pipeline push", gid)

    def _rpc(self, what: str, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ControlError:
            raise
        except Exception as exc:
            raise ControlError(_write_error(f"{what} at {self.address}", exc)) from None

    def close(self) -> None:
        """End the session: stream closed and its thread joined (bounded), never raises."""
        client, self._client = self._client, None
        if client is not None:
            client.shut(self.timeout)
        if self._sh is not None and self._sh.client is client:
            self._sh.client = None
        if self._owns_session:
            self._owns_session = False
            _session.release()

    def _need(self) -> S.Build:
        if self._client is None or self.build is None:
            raise ControlError("the controller is not connected")
        return self.build

    # -- writes --------------------------------------------------------------------

    def _write(self, what: str, updates: list[Any], names: list[str]) -> None:
        from p4.v1 import p4runtime_pb2

        for start in range(0, len(updates), REGISTER_BATCH):
            request = p4runtime_pb2.WriteRequest()
            request.updates.extend(updates[start:start + REGISTER_BATCH])
            try:
                self._client.write(request)
            except Exception as exc:
                error = ControlError(_write_error(f"{what} at {self.address}", exc,
                                                  names[start:start + REGISTER_BATCH]))
                error.codes = _error_codes(exc)  # type: ignore[attr-defined]
                raise error from None

    def _update(self, kind: str, entity: Any) -> Any:
        from p4.v1 import p4runtime_pb2

        update = p4runtime_pb2.Update(type=getattr(p4runtime_pb2.Update, kind))
        message = entity.msg()
        field = ("table_entry" if message.DESCRIPTOR.name == "TableEntry"
                 else "packet_replication_engine_entry")
        getattr(update.entity, field).CopyFrom(message)
        return update

    def _worker_entries(self, job: JobSpec) -> list[Any]:
        sh = self._sh
        entries = []
        for wid, w in enumerate(job.workers):
            te = sh.TableEntry(S.WORKERS.name)(action=S.ADMIT.name)
            te.match["job_id"] = str(job.job_id)
            te.match["src_addr"] = w.ip
            te.match["src_port"] = str(w.udp_port)
            for name, value in (("worker_id", wid), ("worker_bit", 1 << wid),
                                ("num_workers", len(job.workers)), ("mcast_grp", job.group),
                                ("slot_base", job.slot_base), ("slot_count", job.slots)):
                te.action[name] = str(value)
            entries.append(te)
        return entries

    def _parent_entries(self, job: JobSpec) -> list[Any]:
        """The job's ina_parents entry where it is a tree's leaf here, else none."""
        if job.parent is None:
            return []
        p = job.parent
        te = self._sh.TableEntry(S.PARENTS.name)(action=S.SET_PARENT.name)
        te.match["job_id"] = str(job.job_id)
        for name, value in (("parent_addr", p.ip), ("parent_port", str(p.udp_port)),
                            ("parent_mac", p.mac), ("port", str(p.switch_port)),
                            ("up_worker", str(p.worker)), ("mcast_grp", str(job.group)),
                            ("slot_base", str(job.slot_base)), ("slot_count", str(job.slots))):
            te.action[name] = value
        return [te]

    def _parent_key(self, job: JobSpec) -> Any:
        """The job's ina_parents entry as a delete names it (by job id alone: a teardown
        need not know the parent)."""
        te = self._sh.TableEntry(S.PARENTS.name)
        te.match["job_id"] = str(job.job_id)
        return te

    def _group_entry(self, job: JobSpec) -> Any:
        group = self._sh.MulticastGroupEntry(job.group)
        for wid, w in enumerate(job.workers):
            group.add(w.switch_port, wid)
        return group

    def _rewrite_entries(self, job: JobSpec) -> list[Any]:
        entries = []
        for wid, w in enumerate(job.workers):
            te = self._sh.TableEntry(S.REPLICAS.name)(action=S.REWRITE.name)
            te.match["mcast_grp"] = str(job.group)
            te.match["rid"] = str(wid)
            te.action["dst_mac"] = w.mac
            te.action["dst_addr"] = w.ip
            te.action["dst_port"] = str(w.udp_port)
            entries.append(te)
        return entries

    def configure(self, job: JobSpec) -> None:
        """Install the job: worker entries, multicast group, replica rewrites; then zero
        its register cells where the target allows register writes (a courtesy: cells of
        another epoch count as idle). On failure what was installed is removed again."""
        build = self._need()
        if job.elements and job.elements != build.k:
            raise ControlError(f"job {job.job_id}: K {job.elements}, but the target's build "
                               f"has K {build.k} (p4/gen.py --elements)")
        if job.value_bits and job.value_bits != build.value_bits:
            raise ControlError(f"job {job.job_id}: {job.value_bits}-bit values, but the "
                               f"target's build has {build.value_bits}-bit values "
                               f"(p4/gen.py --value-bits)")
        if job.block and job.block != build.block:
            raise ControlError(f"job {job.job_id}: sub-blocks of B {job.block}, but the "
                               f"target's build has B {build.block} (p4/gen.py --block)")
        if job.slot_base + job.slots > build.slots:
            raise ControlError(f"job {job.job_id}: slots {job.slot_base}+{job.slots} exceed "
                               f"the target's {build.slots}")
        if job.parent is not None and S.PARENTS.name not in build.ids:
            raise ControlError(f"job {job.job_id} has a parent, but the target's build has "
                               f"no {S.PARENTS.name}: it cannot be a tree's leaf (the v1model "
                               f"program of p4/gen.py can; p4/README.md)")
        workers = self._worker_entries(job)
        names = [f"worker {i} ({w.ip}:{w.udp_port})" for i, w in enumerate(job.workers)]
        try:
            self._write(f"installing job {job.job_id}'s workers",
                        [self._update("INSERT", te) for te in workers], names)
            self._write(f"installing multicast group {job.group}",
                        [self._update("INSERT", self._group_entry(job))],
                        [f"multicast group {job.group}"])
            self._write(f"installing job {job.job_id}'s result rewrites",
                        [self._update("INSERT", te) for te in self._rewrite_entries(job)],
                        [f"rewrite for worker {i}" for i in range(len(job.workers))])
            self._write(f"installing job {job.job_id}'s parent",
                        [self._update("INSERT", te) for te in self._parent_entries(job)],
                        ["parent"])
        except ControlError as exc:
            codes = getattr(exc, "codes", [])
            if "ALREADY_EXISTS" not in codes:  # never remove another session's entries
                self._remove(job, quiet=True)
            raise
        fresh, self._fresh_cells = self._fresh_cells, False
        try:
            if fresh:  # this session's push left every cell zero (VERIFY_AND_COMMIT)
                log.info("job %d: no register reset, the pipeline was just pushed",
                         job.job_id)
            else:
                self.reset_registers(job)
        except ControlError as exc:
            # Correctness does not depend on it: every run of the ranks draws a new epoch
            # (docs/protocol.md), and a cell last used in another epoch counts as idle.
            # BMv2's P4Runtime server refuses register writes: UNIMPLEMENTED in older
            # builds, RESOURCE_EXHAUSTED for a large batch in 1.15.5 (docs/control.md).
            log.info("job %d: the target did not reset its cells (%s); not needed: "
                     "cells of another epoch are idle", job.job_id, exc)
        log.info("job %d configured: %d workers, slots %d+%d, group %d", job.job_id,
                 len(job.workers), job.slot_base, job.slots, job.group)

    def reset_registers(self, job: JobSpec) -> None:
        """Zero the job's cells (both versions) of the slot state registers and of the
        sub-blocks' exponent and proposal registers; a Tofino build's, its slots'
        epochs (Build.state_registers)."""
        from p4.v1 import p4runtime_pb2

        build = self._need()
        updates, names = [], []
        for reg in build.state_registers:
            rid = build.ids[reg.name]
            zero = bytes((reg.bits + 7) // 8)
            indices = sorted({build.index(reg, version, job.slot_base, slot)
                              for version in (0, 1) for slot in range(job.slots)})
            for index in indices:
                u = p4runtime_pb2.Update(type=p4runtime_pb2.Update.MODIFY)
                u.entity.register_entry.register_id = rid
                u.entity.register_entry.index.index = index
                u.entity.register_entry.data.bitstring = zero
                updates.append(u)
                names.append(f"{reg.name}[{index}]")
        self._write(f"resetting job {job.job_id}'s registers", updates, names)

    def teardown(self, job: JobSpec) -> None:
        """Remove the job's entries; entries already gone are not an error."""
        self._need()
        self._remove(job, quiet=False)
        log.info("job %d torn down", job.job_id)

    def _mode_entry(self, job_id: int, quorum: int = 0, generation: int = 0) -> Any:
        te = self._sh.TableEntry(S.MODES.name)(action=S.SET_MODE.name)
        te.match["job_id"] = str(job_id)
        te.action["quorum"] = str(quorum)
        te.action["generation"] = str(generation)
        return te

    def _mode_of(self, job_id: int) -> tuple[int, int] | None:
        self._need()
        for te in self._read(S.MODES.name, self._sh.TableEntry(S.MODES.name)):
            if int.from_bytes(te.match["job_id"].exact.value, "big") == job_id:
                return (int.from_bytes(te.action["quorum"].value, "big"),
                        int.from_bytes(te.action["generation"].value, "big"))
        return None

    def read_mode(self, job_id: int) -> tuple[int, int]:
        """(quorum k, generation) of a job's mode entry; (0, 0) if it has none: sync."""
        return self._mode_of(job_id) or (0, 0)

    def set_mode(self, job_id: int, quorum: int) -> int:
        """Ask a job for a mode while it runs: 0 sync, else quorum k (a chunk completes
        when k of its n workers contributed). The entry's generation counts up; the
        results announce it and every rank adopts the mode at the same call boundary
        (docs/quorum.md). Returns the new generation."""
        if not 0 <= job_id < S.JOB_IDS:
            raise ValueError(f"job id {job_id} is not 0..{S.JOB_IDS - 1}")
        if not 0 <= quorum <= P.MAX_WORKERS:
            raise ValueError(f"quorum {quorum} is not 0 (sync) .. {P.MAX_WORKERS}")
        entry = self._mode_of(job_id)
        generation = ((entry[1] if entry else 0) + 1) & 0xFFFFFFFF or 1
        self._write(f"setting job {job_id}'s mode",
                    [self._update("MODIFY" if entry else "INSERT",
                                  self._mode_entry(job_id, quorum, generation))],
                    [f"mode of job {job_id}"])
        log.info("job %d: mode %s asked (generation %d)", job_id,
                 f"quorum {quorum}" if quorum else "sync", generation)
        return generation

    def _remove(self, job: JobSpec, quiet: bool) -> None:
        problems = []
        steps = [("parent", [self._parent_key(job)] if S.PARENTS.name in self.build.ids
                  else []), ("mode", [self._mode_entry(job.job_id)]),
                 ("rewrite", self._rewrite_entries(job)), ("group", [self._group_entry(job)]),
                 ("worker", self._worker_entries(job))]
        for what, entities in steps:
            for i, entity in enumerate(entities):
                try:
                    self._write(f"deleting job {job.job_id}'s {what} {i}",
                                [self._update("DELETE", entity)], [f"{what} {i}"])
                except ControlError as exc:
                    if getattr(exc, "codes", None) != ["NOT_FOUND"]:
                        problems.append(str(exc))
        if problems and not quiet:
            raise ControlError("; ".join(problems))

    # -- reads ---------------------------------------------------------------------

    def _read(self, what: str, entity: Any) -> list[Any]:
        try:
            return list(entity.read())
        except Exception as exc:
            raise ControlError(_write_error(f"reading {what} at {self.address}", exc)) from None

    def read_workers(self, job_id: int | None = None) -> list[dict[str, Any]]:
        """The installed ina_workers entries (of one job, or all) as dicts."""
        self._need()
        out = []
        for te in self._read(S.WORKERS.name, self._sh.TableEntry(S.WORKERS.name)):
            m = {f: int.from_bytes(te.match[f].exact.value, "big")
                 for f in ("job_id", "src_addr", "src_port")}
            a = {name: int.from_bytes(te.action[name].value, "big")
                 for name in ("worker_id", "worker_bit", "num_workers", "mcast_grp",
                              "slot_base", "slot_count")}
            if job_id is None or m["job_id"] == job_id:
                out.append({"job_id": m["job_id"], "ip": str(ipaddress.IPv4Address(
                    m["src_addr"])), "udp_port": m["src_port"], **a})
        return sorted(out, key=lambda e: (e["job_id"], e["worker_id"]))

    def read_groups(self) -> dict[int, list[tuple[int, int]]]:
        """Multicast groups: id -> [(egress port, replica id)]."""
        self._need()
        groups = {}
        for g in self._read("multicast groups", self._sh.MulticastGroupEntry()):
            entry = g.msg().multicast_group_entry
            groups[entry.multicast_group_id] = [(r.egress_port, r.instance)
                                                for r in entry.replicas]
        return groups

    def read_rewrites(self) -> list[dict[str, Any]]:
        self._need()
        out = []
        for te in self._read(S.REPLICAS.name, self._sh.TableEntry(S.REPLICAS.name)):
            out.append({"mcast_grp": int.from_bytes(te.match["mcast_grp"].exact.value, "big"),
                        "rid": int.from_bytes(te.match["rid"].exact.value, "big"),
                        "ip": str(ipaddress.IPv4Address(te.action["dst_addr"].value)),
                        "udp_port": int.from_bytes(te.action["dst_port"].value, "big")})
        return sorted(out, key=lambda e: (e["mcast_grp"], e["rid"]))

    def read_register(self, name: str, indices: Iterable[int]) -> list[int]:
        """Cells of a register (a control.schema name), by raw P4Runtime reads."""
        from p4.v1 import p4runtime_pb2

        build = self._need()
        out = []
        for index in indices:
            entity = p4runtime_pb2.Entity()
            entity.register_entry.register_id = build.ids[name]
            entity.register_entry.index.index = index
            try:
                for reply in self._client.read_one(entity):
                    for e in reply.entities:
                        out.append(int.from_bytes(e.register_entry.data.bitstring, "big"))
            except Exception as exc:
                raise ControlError(_write_error(f"reading {name}[{index}]", exc)) from None
        return out

    def read_drops(self) -> dict[str, int]:
        """The aggregator's drop counter, by reason (protocol.DROP_REASONS)."""
        return self._read_counter(S.DROPS_COUNTER_NAME, S.DROP_REASONS, "the drop counter")

    def read_leaf(self) -> dict[str, int]:
        """A tree leaf's traffic with its parents, by event (schema.LEAF_EVENTS: sums sent
        up and sent again, results that came down or came stale, the parents' held answers
        and NACKs), over every job that is a leaf here."""
        if S.LEAF_COUNTER_NAME not in self._need().ids:
            raise ControlError(f"the target's P4Info has no {S.LEAF_COUNTER_NAME} (a build "
                               "without the leaf role)")
        return self._read_counter(S.LEAF_COUNTER_NAME, S.LEAF_EVENTS, "the leaf counter")

    def _read_counter(self, name: str, labels: Sequence[str], what: str) -> dict[str, int]:
        from p4.v1 import p4runtime_pb2

        build = self._need()
        entity = p4runtime_pb2.Entity()
        entity.counter_entry.counter_id = build.ids[name]
        counts = {}
        try:
            for reply in self._client.read_one(entity):
                for e in reply.entities:
                    counts[labels[e.counter_entry.index.index]] = \
                        e.counter_entry.data.packet_count
        except Exception as exc:
            raise ControlError(_write_error(f"reading {what}", exc)) from None
        return counts

    def read_job_results(self, job_id: int) -> int:
        """Results the aggregator has multicast for a job (the per-job counter)."""
        from p4.v1 import p4runtime_pb2

        if not 0 <= job_id < S.JOB_IDS:
            raise ValueError(f"job id {job_id} is not 0..{S.JOB_IDS - 1}")
        build = self._need()
        if S.JOB_RESULTS_COUNTER_NAME not in build.ids:
            raise ControlError(f"the target's P4Info has no {S.JOB_RESULTS_COUNTER_NAME} "
                               "(a build older than the per-job counter)")
        entity = p4runtime_pb2.Entity()
        entity.counter_entry.counter_id = build.ids[S.JOB_RESULTS_COUNTER_NAME]
        entity.counter_entry.index.index = job_id
        try:
            return sum(e.counter_entry.data.packet_count
                       for reply in self._client.read_one(entity) for e in reply.entities)
        except Exception as exc:
            raise ControlError(_write_error(f"reading job {job_id}'s results", exc)) from None


def _client_class() -> type:
    """p4runtime-shell's client with deadlines on every RPC, a handshake that raises
    instead of exiting, and a bounded shutdown."""
    import queue

    import grpc
    from google.rpc import code_pb2
    from p4.v1 import p4runtime_pb2, p4runtime_pb2_grpc
    from p4runtime_sh.p4runtime import P4RuntimeClient

    class RpcDeadline(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
        def __init__(self, timeout: float):
            self.timeout = timeout

        def _with_deadline(self, details: Any) -> Any:
            if details.timeout is not None:
                return details
            return details._replace(timeout=self.timeout) if hasattr(details, "_replace") \
                else _Details(details, self.timeout)

        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(self._with_deadline(details), request)

        def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(self._with_deadline(details), request)

    class _Details(grpc.ClientCallDetails):
        def __init__(self, d: Any, timeout: float):
            self.method, self.metadata, self.credentials = d.method, d.metadata, d.credentials
            self.wait_for_ready, self.timeout = d.wait_for_ready, timeout
            self.compression = getattr(d, "compression", None)

    class Client(P4RuntimeClient):
        def __init__(self, device_id: int, address: str, election_id: tuple[int, int],
                     timeout: float):
            self.device_id, self.election_id, self.role_name = device_id, election_id, None
            self.timeout, self.address = timeout, address
            self.stream_out_q = None
            self.stream_in_q = None
            self.stream_recv_thread = None
            self.channel = grpc.insecure_channel(address)
            self.stub = p4runtime_pb2_grpc.P4RuntimeStub(
                grpc.intercept_channel(self.channel, RpcDeadline(timeout)))
            self.set_up_stream()

        def handshake(self) -> None:
            request = p4runtime_pb2.StreamMessageRequest()
            request.arbitration.device_id = self.device_id
            request.arbitration.election_id.high = self.election_id[0]
            request.arbitration.election_id.low = self.election_id[1]
            self.stream_out_q.put(request)
            try:
                reply = self.stream_in_q["arbitration"].get(timeout=self.timeout)
            except queue.Empty:
                reply = None
            if reply is None:
                self.shut(self.timeout)
                raise TargetUnavailable(f"the P4Runtime target at {self.address} did not "
                                        f"answer the arbitration within {self.timeout:g} s")
            status = reply.arbitration.status
            if status.code != code_pb2.OK:
                self.shut(self.timeout)
                raise ControlError(
                    f"the target at {self.address} made this controller a backup "
                    f"({code_pb2.Code.Name(status.code)} {status.message}): another "
                    f"controller with a higher election id is primary")

        def shut(self, timeout: float) -> None:
            """Close the stream, join its thread (cancel the call if it lingers)."""
            try:
                if self.stream_out_q is not None:
                    self.stream_out_q.put(None)
                thread = self.stream_recv_thread
                if thread is not None:
                    thread.join(timeout)
                    if thread.is_alive():
                        self.stream.cancel()
                        thread.join(timeout)
                self.channel.close()
            except Exception as exc:  # closing is best effort, and bounded
                log.warning("closing the P4Runtime session: %s", exc)

    return Client
