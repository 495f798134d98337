"""Every setting of the library, in one place.

A setting comes from, in order of precedence: a keyword argument of ``init()`` (or of
``ina_collectives.mpi.Intracomm``), the environment variable ``INA_<NAME>``, the default.
``python -m ina_collectives.settings`` prints this table; docs/settings.md is the same.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from . import protocol as P

MiB = 1 << 20
KERNELS = ("", "fast", "numpy")
ORDERINGS = ("priority", "fifo")

# Horovod's variables for the settings it shares: (setting, variable, parse).
HOROVOD_VARIABLES = (
    ("fusion_threshold", "HOROVOD_FUSION_THRESHOLD", int),
    ("cycle_time", "HOROVOD_CYCLE_TIME", lambda v: float(v) / 1000.0),  # ms in Horovod
    ("stall_warning_time", "HOROVOD_STALL_CHECK_TIME_SECONDS", float),
    ("stall_shutdown_time", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", float),
)


def _setting(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc})


def _internal(default: Any, doc: str) -> Any:
    """A setting no user needs: what a launcher tells its ranks, or an A/B switch of the
    tests and benchmarks. Its variable is INTERNAL_PREFIX + its name; the public table
    leaves it out."""
    return field(default=default, metadata={"doc": doc, "internal": True})


@dataclass(frozen=True)
class Settings:
    ring_chunk_bytes: int = _setting(
        1 * MiB,
        "Bytes per point-to-point message of the ring allreduce; chunks are pipelined "
        "so reducing one overlaps receiving the next.",
    )
    ring_min_bytes: int = _setting(
        4 * MiB,
        "Arrays smaller than this go to MPI's own Allreduce, whose latency beats a ring's "
        "2(n-1) steps below a few MiB (bench/micro/test_allreduce.py measures the crossover). "
        "0 sends every size to the ring.",
    )
    timeout: float = _setting(
        300.0,
        "Seconds a collective may wait for its peers before it raises CollectiveTimeout "
        "naming what it waited for. After a timeout the communicator is unusable.",
    )
    check_agreement: bool = _internal(
        True,
        "Before each allreduce, check that every rank passes the same length, dtype and op "
        "(one small allgather); a mismatch raises AgreementError on every rank instead of "
        "hanging or corrupting data.",
    )
    log_level: str = _setting("WARNING", "Level of the 'ina_collectives' logger.")
    switch: str = _setting(
        "",
        "The aggregator as host:port (e.g. 127.0.0.1:47474), or several, comma-separated: "
        "each call is striped across them in shares that follow each one's measured "
        "throughput, and one that fails leaves the others serving (docs/striping.md). "
        "Empty: no in-network aggregation, every call takes the ring or MPI.",
    )
    topology: str = _setting(
        "",
        "A topology file (TOML, docs/trees.md): an aggregation tree, each rank sending to "
        "the leaf aggregator that serves it, each leaf sending its workers' partial sums "
        "up to the root. Set instead of INA_SWITCH (ina-run --topology sets it).",
    )
    require_switch: bool = _setting(
        False,
        "Fail init() (AggregatorUnavailable on every rank, saying why) when the switch "
        "cannot serve the job, or none is configured, instead of warning and letting every "
        "call take the ring. Any launcher: mpiexec, torchrun, ina-run.",
    )
    switch_slots: int = _setting(
        8,
        "S: packets each worker keeps in flight (one per switch slot). The switch's receive "
        "buffer must hold n x S packets. Measured on emulated links (docs/netsim.md): 16-64 "
        "pays above about 2 Gbit/s without loss; 8 holds up best with loss and on slower "
        "links.",
    )
    switch_elements: int = _setting(
        0,
        "K: values per packet; 0: each rank takes the largest whose datagram fits the MTU "
        "of its path to the switch (347 int32 at 1500, 2165 at 9000, 15870 on loopback, "
        "with B 32), and the job the smallest of its ranks'. Set it only to go below "
        "that; a P4 target's K is its build's (ina-run sets it).",
    )
    switch_value_bits: int = _setting(
        32,
        "Width of the values the switch adds: 32 or 16. 16 halves the bytes on the wire "
        "for float tensors, with 14 - log2(n) bits per sub-block (docs/quantization.md "
        "has the error bound and measured errors); int32 tensors then take the ring.",
    )
    switch_gso: bool = _internal(
        True,
        "Send each batch of new packets with UDP segmentation offload (one system call "
        "for up to 64 datagrams of one size) where the kernel takes it; False: sendmmsg. "
        "stats()['switch']['send_path'] says which one is in use.",
    )
    switch_block: int = _setting(
        32,
        "B: values sharing one exponent (a sub-block), a power of two from 1 to 64. "
        "Smaller is more accurate and costs 4 bytes of exponents per B values.",
    )
    switch_min_bytes: int = _setting(
        128 * 1024,
        "Arrays smaller than this skip the aggregator: below it MPI's allreduce was faster "
        "(the crossover measured on bench/cluster/netsim.py, n = 4 at 1 Gbit/s: docs/netsim.md). "
        "The Horovod DistributedOptimizer holds smaller gradients back and sends them "
        "with the next.",
    )
    switch_opening: bool = _internal(
        True,
        "Open each call through the aggregator when it takes openings (the software "
        "switch does): the ranks agree on the call (its length, dtype, op and width) and "
        "on its first exponents in one exchange of small packets through the switch, "
        "with no host collective (docs/protocol.md, A call's opening). False: the "
        "agreement and the exponents go by MPI, as they do with a P4 switch.",
    )
    switch_predict: bool = _internal(
        True,
        "Send the first window of a call that repeats an earlier one (same length, dtype, "
        "op and width) at once, its exponents predicted from the last such call, when the "
        "aggregator takes that (both aggregators do): one switch round trip a call, no "
        "opening (docs/protocol.md, One round trip). False: every call opens first.",
    )
    switch_back_to_back: bool = _internal(
        True,
        "Start a runtime's next call (the Horovod API's, torch.distributed's) while the "
        "running one's last window drains, each slot taking its first chunk as soon as "
        "its last result of the running call is back, where that call goes predicted "
        "(switch_predict): the uplink does not idle between calls (docs/protocol.md, "
        "Calls back to back). False: each call starts once the last returned.",
    )
    switch_predict_headroom: int = _internal(
        2,
        "The most bits a predicted exponent (switch_predict) adds to the one learned: "
        "each call identity starts at 0 (exact), a call of it that overflowed (a "
        "sub-block's largest value grew, its chunk sent again) adds one, 16 calls in a "
        "row without take one back. With h bits, the first window's quantization error "
        "is within 2^h times the bound of exact exponents (docs/quantization.md).",
    )
    switch_join_timeout: float = _setting(
        3.0, "Seconds each rank waits for the aggregator to accept the job at init.")
    switch_silence: float = _setting(
        3.0,
        "Seconds without any result after which a rank declares the aggregator dead; the "
        "ranks then agree, finish that call on the ring and take the ring until the "
        "aggregator serves again (switch_retry_seconds).",
    )
    quorum: int = _setting(
        0,
        "Quorum mode from the first call: a chunk the switch serves is complete when this "
        "many workers contributed, so a straggler does not set the pace (docs/quorum.md); "
        "a worker left out of a chunk has its values dropped for that step. 0 (or n and "
        "more): sync, every worker in every chunk. Changed while the job runs by "
        "ina_collectives.set_quorum or the control plane (python -m "
        "ina_collectives.control mode).",
    )
    quorum_max_steps: int = _setting(
        3,
        "The staleness bound of quorum mode, in training steps (Serene's window): a worker "
        "left out of some chunk of every call for this many steps in a row is waited for "
        "in the next call (it runs in sync), so every worker's gradient counts at least "
        "once every max_steps steps and a call. A step ends where a call repeats one of "
        "the step (every step repeats its tensors' calls), or after 64 calls. The default "
        "absorbs a worker late by twice the step time. 0: no bound.",
    )
    quorum_run_ahead: bool = _internal(
        True,
        "Horovod API, quorum mode: where the quorum acts. 1: in the runtime, which runs "
        "a tensor without the ranks late to submit it (quorum_grace, quorum_max_steps), "
        "the switch serving every call in sync among the ranks present, as fast as sync "
        "mode. 0: in the switch, which completes each chunk at k, so a rank whose packets "
        "are late is left out; each such call agrees its exponents and votes over the "
        "host network (docs/quorum.md).",
    )
    quorum_grace: float = _setting(
        0.02,
        "Horovod API, quorum mode: seconds a tensor every rank has reduced before waits, "
        "once quorum-many ranks have submitted it, for the others; then it runs without "
        "them, and each takes the result when it submits the tensor (its own input is "
        "dropped, or, for DistributedOptimizer's gradients, carried into its next "
        "contribution: docs/quorum.md, Running ahead). Bounded by "
        "quorum_max_steps. Only a late training loop is left out: the late rank's "
        "background thread takes part in every call.",
    )
    switch_standby: bool = _internal(
        True,
        "With several aggregators (INA_SWITCH names them): the unfinished share of one "
        "that fails mid-call is streamed again through a surviving one, which already "
        "serves the job, instead of going to the ring (MLfabric; docs/striping.md); the "
        "ring stays the last resort. 0: the failed share goes to the ring.",
    )
    switch_retry_seconds: float = _setting(
        1.0,
        "After the aggregator fails (or is absent at init), rank 0 probes it without "
        "waiting (at most every 0.05 s, at call boundaries), and at the first call after "
        "it answers, the ranks join it again (a restarted switch); a join that fails waits "
        "0.05, 0.1, 0.2 ... s of rank 0's clock, at most this many, before the next. 0: "
        "never; stay on the ring.",
    )
    job: int = _setting(
        0,
        "The job's id when a controller installed it (ina-run sets it): the ranks then "
        "check their entries with a probe instead of joining. 0: the ranks join the "
        "switch themselves (plain mpiexec).",
    )
    worker_ports: str = _setting(
        "",
        "With job: the UDP port of each rank, comma-separated in rank order, as the "
        "controller installed them (ina-run sets it); with several aggregators, n ports "
        "per aggregator, in INA_SWITCH's order.",
    )
    retransmit_timeout: float = _internal(
        0.02,
        "Retransmission timeout of a packet, in seconds, until the first round trip is "
        "measured; from then on it follows the measured round trips as TCP's does "
        "(RFC 6298), within retransmit_min .. retransmit_max, and doubles per resend.",
    )
    retransmit_min: float = _internal(
        0.005,
        "Smallest retransmission timeout, in seconds: a floor under the measured one, "
        "against spurious resends when queueing delay jumps.",
    )
    retransmit_max: float = _internal(0.5, "Largest retransmission timeout, in seconds.")
    fusion_threshold: int = _setting(
        128 * MiB,
        "Horovod API: ready allreduces of one dtype and op are packed into one buffer of "
        "up to this many bytes and reduced in one call (tensor fusion); 0 turns fusion "
        "off. HOROVOD_FUSION_THRESHOLD is read too.",
    )
    partition_bytes: int = _setting(
        16 * MiB,
        "Horovod API and torch.distributed: allreduces larger than this are cut into "
        "partitions of about this many bytes, and the background thread runs at most "
        "this many bytes of allreduce between two negotiation rounds, always the "
        "highest-priority ready partitions first (lowest priority value; by default a "
        "parameter's place in the model, so the first layers, which the next forward "
        "needs first, go first: ByteScheduler, P3; docs/ordering.md). 0: no partitions, "
        "every ready allreduce runs in its round, still in priority order.",
    )
    ordering: str = _setting(
        "priority",
        "Horovod API and torch.distributed: 'priority' runs ready allreduces lowest "
        "priority first (DistributedOptimizer: a parameter's place in the model), "
        "'fifo' in the order they were submitted, as Horovod does (docs/ordering.md).",
    )
    sparse_hot_rows: int = _setting(
        0,
        "Horovod API, sparse gradients (as in Libra): the most rows of a sparse tensor "
        "(one sparse dimension, by name) summed densely as an allreduce, through the "
        "switch where it serves, the rows touched most often over the ranks, where that "
        "pays by bytes, and kept only while their calls are measured faster than the "
        "exact gather's; the rest go by the exact gather. 0 (the default: measured on "
        "this project's 2-core machine it never paid, docs/netsim-workloads.md): every row by the "
        "gather.",
    )
    sparse_reelect_calls: int = _setting(
        20,
        "Horovod API, sparse gradients: the hot rows are elected again every this many "
        "calls of a tensor (a period; the first is exact), from every rank's touches so "
        "far, and a period with them that was slower than the exact gather sets them "
        "aside for 1, 2, 4 ... 32 periods (the same on every rank).",
    )
    cycle_time: float = _setting(
        0.001,
        "Horovod API: seconds between the background thread's negotiation rounds, in which "
        "the ranks agree on which named tensors are ready. HOROVOD_CYCLE_TIME (in ms) is "
        "read too.",
    )
    stall_warning_time: float = _setting(
        60.0,
        "Horovod API: seconds a tensor may wait for some ranks to submit it before a "
        "warning names the missing ranks. HOROVOD_STALL_CHECK_TIME_SECONDS is read too.",
    )
    stall_shutdown_time: float = _setting(
        300.0,
        "Horovod API: seconds after which a tensor that some ranks never submitted fails "
        "on the ranks that did, with an error naming the missing ranks and tensors. "
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS is read too.",
    )
    kernels: str = _internal(
        "",
        "The quantization and packet kernels: 'fast' (the compiled ones in _fast/; an "
        "error if they are not built), 'numpy' (the NumPy reference), or empty: the "
        "compiled ones when built, else the reference. Read at init, by each "
        "communicator's switch engine.",
    )
    run_dir: str = _internal(
        "",
        "Set by ina-run for each rank: the folder where it marks a rank that failed, so "
        "that a rank waiting on it gives up at once and names it instead of waiting out "
        "its timeout. Empty outside ina-run.",
    )

    def __post_init__(self) -> None:
        if self.ring_chunk_bytes < 1:
            raise ValueError(f"ring_chunk_bytes must be >= 1, got {self.ring_chunk_bytes}")
        if self.ring_min_bytes < 0:
            raise ValueError(f"ring_min_bytes must be >= 0, got {self.ring_min_bytes}")
        if not self.timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {self.timeout}")
        if not 1 <= self.switch_slots <= 65536:
            raise ValueError(f"switch_slots must be 1..65536, got {self.switch_slots}")
        if self.switch_value_bits not in P.VALUE_BITS:
            raise ValueError(f"switch_value_bits must be 32 or 16, got "
                             f"{self.switch_value_bits}")
        if self.switch_block not in P.BLOCK_SIZES:
            raise ValueError(f"switch_block must be one of {P.BLOCK_SIZES}, got "
                             f"{self.switch_block}")
        most = P.max_elements(P.MAX_DATAGRAM, self.switch_block, self.switch_value_bits)
        if not 0 <= self.switch_elements <= most:
            raise ValueError(f"switch_elements must be 0..{most} (a datagram of "
                             f"{self.switch_value_bits}-bit values in sub-blocks of "
                             f"{self.switch_block}), got {self.switch_elements}")
        if not 0 <= self.quorum <= P.MAX_WORKERS:
            raise ValueError(f"quorum must be 0 (sync) .. {P.MAX_WORKERS}, got {self.quorum}")
        if not 0 <= self.switch_predict_headroom <= 8:
            raise ValueError(f"switch_predict_headroom must be 0..8 bits, got "
                             f"{self.switch_predict_headroom}")
        if self.quorum_grace < 0:
            raise ValueError(f"quorum_grace must be >= 0 seconds, got {self.quorum_grace}")
        if self.quorum_max_steps < 0:
            raise ValueError(f"quorum_max_steps must be >= 0, got {self.quorum_max_steps}")
        if self.switch_retry_seconds < 0:
            raise ValueError(f"switch_retry_seconds must be >= 0, got "
                             f"{self.switch_retry_seconds}")
        if self.switch and self.topology:
            raise ValueError("switch and topology are both set: a job's aggregators come "
                             "from INA_SWITCH or from INA_TOPOLOGY's tree, not both")
        if not 0 <= self.job < 65536:
            raise ValueError(f"job must be 0..65535, got {self.job}")
        ports = self.worker_ports.replace(",", "").replace(" ", "")
        if ports and not ports.isdigit():
            raise ValueError(f"worker_ports must be comma-separated port numbers, got "
                             f"{self.worker_ports!r}")
        for name in ("switch_join_timeout", "switch_silence", "retransmit_timeout",
                     "retransmit_min", "retransmit_max"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.retransmit_min > self.retransmit_max:
            raise ValueError(f"retransmit_min ({self.retransmit_min}) must not exceed "
                             f"retransmit_max ({self.retransmit_max})")
        if self.sparse_hot_rows < 0:
            raise ValueError(f"sparse_hot_rows must be >= 0, got {self.sparse_hot_rows}")
        if self.sparse_reelect_calls < 1:
            raise ValueError(f"sparse_reelect_calls must be >= 1, got "
                             f"{self.sparse_reelect_calls}")
        if self.partition_bytes < 0:
            raise ValueError(f"partition_bytes must be >= 0, got {self.partition_bytes}")
        if self.fusion_threshold < 0:
            raise ValueError(f"fusion_threshold must be >= 0, got {self.fusion_threshold}")
        for name in ("cycle_time", "stall_warning_time", "stall_shutdown_time"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering must be one of {ORDERINGS}, got {self.ordering!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ValueError(f"log_level must be a logging level name, got {self.log_level!r}")

    @classmethod
    def load(cls, overrides: Mapping[str, Any] | None = None,
             environ: Mapping[str, str] | None = None) -> "Settings":
        """Settings from keyword overrides, then INA_* variables, then defaults."""
        environ = os.environ if environ is None else environ
        overrides = dict(overrides or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise TypeError(f"unknown setting(s) {', '.join(unknown)}; known: {', '.join(known)}")
        values: dict[str, Any] = {}
        from_env: dict[str, str] = {}
        for name, f in known.items():
            if name in overrides:
                values[name] = _coerce(f, overrides[name], f"setting {name}")
            elif env_name(name) in environ:
                values[name] = _coerce(f, environ[env_name(name)], env_name(name))
                from_env[name] = environ[env_name(name)]
        warn_unknown_variables(environ)
        try:
            return cls(**values)
        except ValueError as exc:
            # Name what the user set: the variable and its text, not the field alone.
            message = str(exc)
            name = next((n for n in sorted(from_env, key=len, reverse=True)
                         if message.startswith(n + " ") or message.startswith(n + ":")),
                        None)
            if name is None:
                raise
            raise ValueError(f"{env_name(name)}={from_env[name]!r}: {message}") from None

    @classmethod
    def value(cls, name: str, environ: Mapping[str, str] | None = None) -> Any:
        """One setting from its INA_* variable, else its default, without reading (or
        checking) the others: for what is read before any init, as the kernels are."""
        environ = os.environ if environ is None else environ
        f = {f.name: f for f in dataclasses.fields(cls)}[name]
        if env_name(name) not in environ:
            return f.default
        value = _coerce(f, environ[env_name(name)], env_name(name))
        try:
            cls(**{name: value})  # the same checks as a whole load (the others: defaults)
        except ValueError as exc:
            raise ValueError(f"{env_name(name)}: {exc}") from None
        return value


def horovod_environment(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Horovod's variables for the settings it shares (HOROVOD_VARIABLES), where no INA_*
    one is set: overrides for ``Settings.load`` under the Horovod API."""
    environ = os.environ if environ is None else environ
    found = {}
    for name, variable, parse in HOROVOD_VARIABLES:
        if env_name(name) not in environ and variable in environ:
            try:
                found[name] = parse(environ[variable])
            except ValueError:
                raise ValueError(f"{variable}: cannot read {environ[variable]!r}") from None
    return found


# The variables of the internal settings: INA_INTERNAL_<NAME> (docs/settings.md, last
# table). They may change from one release to the next.
INTERNAL_PREFIX = "INA_INTERNAL_"
INTERNAL = frozenset(f.name for f in dataclasses.fields(Settings) if f.metadata.get("internal"))
PUBLIC = tuple(f.name for f in dataclasses.fields(Settings) if f.name not in INTERNAL)


def env_name(name: str) -> str:
    """A setting's variable: INA_<NAME>, or INA_INTERNAL_<NAME> for an internal one."""
    return (INTERNAL_PREFIX if name in INTERNAL else "INA_") + name.upper()


# INA_* variables that are not settings: read by the launchers, the tests and benchmarks.
OTHER_VARIABLES = frozenset({
    "INA_P4_CACHE",            # ina_collectives/testing/bmv2.py: compiled P4 builds
    "INA_BENCH_STRAGGLER_MS", "INA_BENCH_SPARSE",
})
_warned: set[str] = set()


def warn_unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """Log, once per process and name, each INA_* variable that no setting reads (a
    misspelling is otherwise ignored), with the closest known name; the names. A
    launcher's rank other than 0 logs at debug level, and so does every rank under
    ina-run (INA_INTERNAL_RUN_DIR set), which says it itself: the job says it once."""
    import difflib
    import logging

    known = {env_name(f.name) for f in dataclasses.fields(Settings)} | OTHER_VARIABLES
    unknown = sorted(v for v in environ if v.startswith("INA_") and v not in known)
    # Job-wide (the launcher gives every rank the same environment): rank 0 says it.
    rank = next((environ[v] for v in ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK",
                                      "RANK") if environ.get(v, "").isdigit()), "0")
    level = (logging.WARNING if rank == "0" and not environ.get(env_name("run_dir"))
             else logging.DEBUG)
    for variable in unknown:
        if variable in _warned:
            continue
        _warned.add(variable)
        close = difflib.get_close_matches(variable, known, n=1, cutoff=0.6)
        logging.getLogger("ina_collectives").log(
            level,
            "%s is set but is no setting of ina_collectives: ignored%s", variable,
            f" (did you mean {close[0]}?)" if close else
            " (python -m ina_collectives.settings lists them)")
    return unknown


def _coerce(f: dataclasses.Field, value: Any, where: str) -> Any:
    kind = type(f.default)
    try:
        if kind is bool:
            if isinstance(value, str):
                lowered = value.strip().lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError(value)
            return bool(value)
        if kind is int and isinstance(value, str):
            return int(parse_size(value))
        return kind(value)
    except ValueError:
        raise ValueError(f"{where}: cannot read {value!r} as {kind.__name__}") from None


def parse_size(text: str) -> int:
    """'65536', '64K', '1M' or '2G' as a number of bytes."""
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    return int(digits) * scale


def table(internal: bool = False) -> str:
    """The public settings as a Markdown table (docs/settings.md holds the same), or,
    ``internal``, the internal ones."""
    rows = ["| setting | environment | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(Settings):
        if (f.name in INTERNAL) == internal:
            rows.append(f"| `{f.name}` | `{env_name(f.name)}` | `{f.default!r}` | "
                        f"{f.metadata['doc']} |")
    return "\n".join(rows)


def page() -> str:
    """docs/settings.md: the public table, then the internal one."""
    return (f"# Settings\n\nGenerated by `python -m ina_collectives.settings`; "
            f"tests/test_settings.py checks it is current.\n\n{table()}\n\n"
            f"## Internal settings\n\nWhat `ina-run` tells its ranks, and the A/B switches "
            f"of the tests and benchmarks. No user needs them; their variables start with "
            f"`{INTERNAL_PREFIX}` and may change from one release to the next, and "
            f"`init()` takes them by name as the others.\n\n{table(internal=True)}\n")


if __name__ == "__main__":
    print(page(), end="")
