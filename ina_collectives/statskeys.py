"""Every key of ``ina_collectives.stats()`` (and of the Horovod API's ``hvd.stats()`` and
torch.distributed's ``stats(group)``, which add the runtime's counters), in one place:
its type, its meaning, which API has it and when it is there.

``python -m ina_collectives.statskeys`` prints docs/stats.md; tests/test_statskeys.py
checks that the page is current and that real stats() dicts have exactly these keys, of
these types. A key is a dotted path (``transport.sent``, ``switch.quorum.mode``); the
keys of a list's dicts are written ``switch.aggregators[].address``. A key whose value's
own keys are open-ended (an engine's name, a reason, a tensor's name) is one entry, its
value's shape in its type (``dict[str, int]``).
"""
from __future__ import annotations

from dataclasses import dataclass

# Which API's stats() has the key.
ALL = "all"          # every API: ina_collectives.stats(), Intracomm.ina_stats(), and both below
RUNTIME = "runtime"  # the runtime's: the Horovod API's hvd.stats() and torch.distributed's
HOROVOD = "Horovod"  # the Horovod API's hvd.stats() alone
APIS = {ALL: "every API: `ina_collectives.stats()`, `Intracomm.ina_stats()`, and both below",
        RUNTIME: "the background runtime's: the Horovod API's `hvd.stats()` and "
                 "`ina_collectives.torch.distributed.stats(group)`",
        HOROVOD: "the Horovod API's `hvd.stats()` alone"}

# When the key is there (its API's stats() has it otherwise always).
ALWAYS = "always"
SWITCH = "with a switch"          # INA_SWITCH names an aggregator (the INA engine exists)
NO_SWITCH = "without a switch"    # INA_SWITCH is unset: "switch" is ina/offload.py's ABSENT
JOINED = "once joined"            # the job joined an aggregator (a link was made)
RTT = "once timed"                # a stream through the switch measured a round trip
AFTER_CALL = "after a call"       # the first allreduce has run
AFTER_SWITCH_CALL = "after a switch call"  # the first call through the switch has ended
SERVING = "while it serves"       # that aggregator serves the job now
UNUSED = "while unused"           # that aggregator is not used now
TREE = "in a tree"                # INA_TOPOLOGY names a tree (docs/trees.md)
WHEN = {ALWAYS: "in every stats() of its API",
        SWITCH: "where `INA_SWITCH` names an aggregator (the switch engine exists)",
        NO_SWITCH: "where `INA_SWITCH` is unset",
        JOINED: "once the job joined an aggregator (with a switch that refused or never "
                "answered, `transport` is `{}`)",
        RTT: "once a stream through the switch measured a round trip",
        AFTER_CALL: "after the first allreduce (`last_call` is `None` before it)",
        AFTER_SWITCH_CALL: "after the first call through the switch (`switch.quorum.last_call` "
                           "is `{}` before it)",
        SERVING: "in the entry of an aggregator that serves the job now",
        UNUSED: "in the entry of an aggregator that is not used now",
        TREE: "where `INA_TOPOLOGY` names an aggregation tree (docs/trees.md)"}


@dataclass(frozen=True)
class Key:
    """One key of stats(): its dotted ``path``, its value's ``type`` (Python's notation:
    ``int``, ``str | None``, ``dict[str, int]``), what it means, the ``api`` that has it
    (ALL, RUNTIME, HOROVOD) and ``when`` it is there (a key of WHEN). ``open``: its
    value's own keys are open-ended (names, reasons), documented by its type and
    meaning, not as keys of their own."""

    path: str
    type: str
    meaning: str
    api: str = ALL
    when: str = ALWAYS
    open: bool = False


K = Key
KEYS: tuple[Key, ...] = (
    # -- the calls: collectives/stats.py (Stats.snapshot) ---------------------------------
    K("calls", "int",
      "Allreduce calls this rank made, whatever engine served them; a runtime's fused call "
      "counts once."),
    K("bytes", "int", "Bytes of those calls' arrays on this rank, all told."),
    K("engines", "dict[str, int]",
      "Calls by the engine that served them: `ina` (the switch), `ring`, `mpi`, or `gloo` "
      "(the peers' own allreduce without an MPI job).", open=True),
    K("bytes_by_engine", "dict[str, int]",
      "Bytes by the engine that served them, as `engines`: the share the switch summed is "
      "`bytes_by_engine[\"ina\"] / bytes`.", open=True),
    K("fallback_reasons", "dict[str, int]",
      "Each reason an engine gave for not serving a call (declined, or handed over mid-call), "
      "prefixed with its name (`ina: dtype int32 is not a float`), and how many calls it "
      "held for; docs/troubleshooting.md says what to do about each.", open=True),
    K("last_call", "dict | None", "The last allreduce: `None` before the first."),
    K("last_call.engine", "str", "The engine that served the last call.", when=AFTER_CALL),
    K("last_call.bytes", "int", "Bytes of the last call's array on this rank.",
      when=AFTER_CALL),
    K("last_call.passed_over", "list[str]",
      "Why the engines before the one that served the last call did not (empty when the "
      "first one served it).", when=AFTER_CALL),
    K("kernels", "str | None",
      "The quantization and packet kernels the switch engine runs: `fast` (compiled) or "
      "`numpy` (the reference: the switch then serves no call); `None` without a switch."),

    # -- this rank's packets: _fast/transport.pyx (Counts), over every link ----------------
    K("transport", "dict",
      "This rank's packet counters, over every call through the switch and every link it "
      "made (`{}` until the job joined an aggregator)."),
    K("transport.sent", "int",
      "Packets of values sent as new (a retransmission is not counted here).", when=JOINED),
    K("transport.open_sent", "int",
      "Packets sent for calls' openings through the switch (one per slot an opening uses).",
      when=JOINED),
    K("transport.send_calls", "int",
      "System calls that sent those packets: far fewer than packets where a batch leaves "
      "in one (`switch.send_path`).", when=JOINED),
    K("transport.send_refused", "int",
      "Datagrams the kernel refused for want of buffers (ENOBUFS from a shaping qdisc, "
      "EAGAIN from a full socket): lost here, as on a link, and sent again by their timers.",
      when=JOINED),
    K("transport.gro_buffers", "int",
      "Receive buffers that held several results the kernel coalesced (UDP GRO); 0 where "
      "`switch.receive_path` is `recvmmsg`.", when=JOINED),
    K("transport.retransmitted", "int",
      "Packets sent again whole after their retransmission timeout passed with no result: "
      "loss, or a switch or peer slow to answer.", when=JOINED),
    K("transport.nacks", "int",
      "NACKs received: the switch said it never saw some of this rank's packets "
      "(docs/protocol-recovery.md).", when=JOINED),
    K("transport.nack_resent", "int", "Packets sent again at once because a NACK named them.",
      when=JOINED),
    K("transport.result_requests", "int",
      "Header-only requests for a result, sent at a packet's first timeout to a switch that "
      "NACKs (the packet most likely arrived and its result was lost).", when=JOINED),
    K("transport.rtt_samples", "int",
      "Round trips measured (results of packets sent once), which set `srtt` and `rto`.",
      when=JOINED),
    K("transport.stale", "int",
      "Datagrams ignored as no longer wanted: another job's or epoch's, a result already "
      "applied, a late duplicate.", when=JOINED),
    K("transport.rejected", "int",
      "Datagrams dropped as malformed: shorter than a header, or a result of this job that "
      "did not parse.", when=JOINED),
    K("transport.left_out", "int",
      "Results of quorum-mode chunks that did not count this rank's values "
      "(docs/quorum.md).", when=JOINED),
    K("transport.skipped", "int",
      "Quorum-mode chunks this rank sent without values, since they did not fit the "
      "exponents agreed without it.", when=JOINED),
    K("transport.lost", "int",
      "Quorum-mode chunks this rank gave up waiting for after repeated timeouts (a peer or "
      "the ring then supplies them).", when=JOINED),
    K("transport.nonfinite", "int",
      "Streams in which this rank's own input held a NaN or an Inf (such a call takes the "
      "exact path).", when=JOINED),
    K("transport.nonfinite_seen", "int",
      "Streams in which a result said some rank's input held a NaN or an Inf.", when=JOINED),
    K("transport.predicted", "int",
      "Streams whose first window went with predicted exponents, with no opening "
      "(docs/protocol.md, One round trip).", when=JOINED),
    K("transport.overflows", "int",
      "Chunks of predicted calls sent again because some rank's values outgrew the "
      "predicted exponents.", when=JOINED),
    K("transport.adopted", "int",
      "Calls started in the previous call's drain (docs/protocol.md, Calls back to back).",
      when=JOINED),
    K("transport.seconds", "float", "Seconds spent streaming calls through the switch.",
      when=JOINED),
    K("transport.open_seconds", "float",
      "Seconds spent in calls' openings through the switch.", when=JOINED),
    K("transport.srtt", "float",
      "The streams' smoothed round-trip time to the switch, in seconds.", when=RTT),
    K("transport.rto", "float",
      "The streams' retransmission timeout derived from it, in seconds.", when=RTT),

    # -- the switch: ina/engine.py (InaEngine.switch_state), or ina/offload.py's ABSENT -----
    K("switch", "dict",
      "The switch's state as this rank sees it; without a switch, `configured`, `serving` "
      "and `reason` alone."),
    K("switch.configured", "bool", "Whether `INA_SWITCH` names an aggregator."),
    K("switch.serving", "bool",
      "Whether an aggregator serves the job now; False: every call takes the ring or the "
      "exact engine, and `fallback_reasons` says why."),
    K("switch.reason", "str", "Why no switch serves: none is configured.", when=NO_SWITCH),
    K("switch.outages", "int",
      "Times the job lost its last serving aggregator (calls then took the ring).",
      when=SWITCH),
    K("switch.returns", "int",
      "Times an aggregator served again after an outage.", when=SWITCH),
    K("switch.protocol", "int", "The version of the wire protocol the ranks speak.",
      when=SWITCH),
    K("switch.elements", "int",
      "K: values per packet, agreed by the ranks at the join from their path MTU (or "
      "`switch_elements`).", when=SWITCH),
    K("switch.path_mtu", "int",
      "The smallest MTU of any rank's path to the aggregators, agreed at the join (0 before "
      "it).", when=SWITCH),
    K("switch.value_bits", "int",
      "Width of the values the switch adds, 32 or 16 (`switch_value_bits`).", when=SWITCH),
    K("switch.block", "int",
      "B: values sharing one exponent (`switch_block`).", when=SWITCH),
    K("switch.calls_by_value_bits", "dict[int, int]",
      "Calls the switch served, by the width their values went at (32 or 16).",
      when=SWITCH, open=True),
    K("switch.send_path", "str",
      "How new packets leave: `UDP_SEGMENT` (segmentation offload, one system call per "
      "batch) or `sendmmsg`.", when=SWITCH),
    K("switch.receive_path", "str",
      "How results arrive: `UDP_GRO` (coalesced by the kernel) or `recvmmsg`.", when=SWITCH),
    K("switch.aggregators", "list[dict]",
      "One entry per aggregator `INA_SWITCH` names (their shards included), in order.",
      when=SWITCH),
    K("switch.aggregators[].address", "str", "Its address, as host:port.", when=SWITCH),
    K("switch.aggregators[].serving", "bool", "Whether it serves the job now.", when=SWITCH),
    K("switch.aggregators[].slots", "int",
      "S: the slots it granted the job (packets each rank keeps in flight there).",
      when=SERVING),
    K("switch.aggregators[].slots_asked", "int",
      "The slots asked (`switch_slots`); more than `slots` where its pool is shared with "
      "other jobs.", when=SERVING),
    K("switch.aggregators[].share", "float",
      "The fraction of each call's chunks it gets now (0 while it does not serve).",
      when=SWITCH),
    K("switch.aggregators[].elements_per_second", "float",
      "Its measured throughput, smoothed, which sets the shares (0 until a call that ends "
      "with the ranks' vote measures it).", when=SWITCH),
    K("switch.aggregators[].outages", "int",
      "Times it failed mid-call (with a topology: its tree, at any level), its shares "
      "then streamed by the others or by the ring.", when=SWITCH),
    K("switch.aggregators[].returns", "int",
      "Times it served again after such a failure.", when=SWITCH),
    K("switch.aggregators[].why_not", "str", "Why it is not used.", when=UNUSED),
    K("switch.tree", "dict", "The aggregation tree the job runs through (docs/trees.md).",
      when=TREE),
    K("switch.tree.root", "str", "The root aggregator's name in the topology file (the "
      "first, with several trees).", when=TREE),
    K("switch.tree.roots", "list[str]", "Every root's name: tree t is rooted at roots[t] and "
      "is `switch.aggregators[t]` (this rank's leaf, at its port + t).", when=TREE),
    K("switch.tree.root_address", "str", "The root's address, host:port.", when=TREE),
    K("switch.tree.leaf", "str", "The name of the leaf this rank sends to; its address is "
      "the one entry of `switch.aggregators`.", when=TREE),
    K("switch.tree.worker", "int", "This rank's worker id at its leaf.", when=TREE),
    K("switch.tree.workers", "int", "The ranks its leaf serves.", when=TREE),
    K("switch.tree.leaves", "dict[str, list[int]]", "Each leaf's name and the ranks it "
      "serves.", when=TREE, open=True),
    K("switch.tree.mbit", "list[float]", "Each tree's rate through its root as the "
      "topology file says it (`mbit`, in the order of `roots`), which splits each call "
      "across the trees until their rates are measured; empty where the file gives none.",
      when=TREE),
    K("switch.tree.described", "str", "The tree in one line, as the summary says it.",
      when=TREE),
    K("switch.striped_calls", "int",
      "Calls split across more than one aggregator (docs/striping.md).", when=SWITCH),
    K("switch.vote_free_calls", "int",
      "Calls through one aggregator that ended with no vote among the ranks, their results "
      "alone saying they were complete.", when=SWITCH),
    K("switch.opened_calls", "int",
      "Calls (of any engine) the ranks agreed on through the switch in an opening, with no "
      "host collective (docs/protocol.md, A call's opening).", when=SWITCH),
    K("switch.failed_openings", "int",
      "Openings that failed (the aggregator was then marked lost).", when=SWITCH),
    K("switch.predicted_calls", "int",
      "Calls whose first window went with predicted exponents, with no opening: one switch "
      "round trip a call.", when=SWITCH),
    K("switch.mismatched_predictions", "int",
      "Predicted calls the switch found the ranks made differently (each raised "
      "AgreementError on every rank).",
      when=SWITCH),
    K("switch.adopted_calls", "int",
      "Calls started in the previous call's drain, so the uplink did not idle between them.",
      when=SWITCH),
    K("switch.rescued_calls", "int",
      "Calls this rank could not finish alone, completed in the error path from the last "
      "window another rank kept.", when=SWITCH),
    K("switch.peer_completed_calls", "int",
      "Calls whose lost results this rank fetched directly from a peer that finished them, "
      "keeping the aggregator.", when=SWITCH),
    K("switch.windows_served", "int",
      "Answers this rank sent to peers asking for its kept last window.", when=SWITCH),
    K("switch.partial_handovers", "int",
      "Calls the switch served in part, the rest (a failed aggregator's shares, quorum chunks "
      "no rank had whole) taken by the ring.", when=SWITCH),
    K("switch.standby_takeovers", "int",
      "Times a serving aggregator streamed again the shares of one that failed mid-call "
      "(`switch_standby`).", when=SWITCH),
    K("switch.quorum", "dict", "Quorum mode (docs/quorum.md), the switch's side.",
      when=SWITCH),
    K("switch.quorum.mode", "str", "The mode in force: `sync` or `quorum k`.", when=SWITCH),
    K("switch.quorum.k", "int",
      "The k calls' chunks complete at (0: sync, every rank).", when=SWITCH),
    K("switch.quorum.generation", "int",
      "The control plane's mode generation last adopted (0: none yet).", when=SWITCH),
    K("switch.quorum.mode_changes", "int",
      "Times a new mode from the control plane was adopted.", when=SWITCH),
    K("switch.quorum.max_steps", "int",
      "The staleness bound: training steps in a row a rank may be left out of "
      "(`quorum_max_steps`).", when=SWITCH),
    K("switch.quorum.quorum_calls", "int", "Calls run in quorum mode.", when=SWITCH),
    K("switch.quorum.waited_calls", "int",
      "Calls that counted every rank present, not a quorum, because some rank had reached "
      "the staleness bound.",
      when=SWITCH),
    K("switch.quorum.calls_left_out", "int",
      "Quorum calls that left this rank's values out of some chunk.", when=SWITCH),
    K("switch.quorum.chunks_repaired", "int",
      "Quorum chunks some rank lost that a peer sent to every rank.", when=SWITCH),
    K("switch.quorum.last_call", "dict",
      "The last call through the switch, as quorum mode saw it.", when=SWITCH),
    K("switch.quorum.last_call.quorum", "int",
      "The k its packets were stamped with (0: sync).", when=AFTER_SWITCH_CALL),
    K("switch.quorum.last_call.counted", "bool",
      "False when some chunk of it left this rank's values out "
      "(`ina_collectives.last_call_counted()`).", when=AFTER_SWITCH_CALL),
    K("switch.quorum.last_call.ranks_left_out", "list[int]",
      "The ranks some chunk did not count.", when=AFTER_SWITCH_CALL),
    K("switch.quorum.last_call.ranks_never_counted", "list[int]",
      "The ranks no chunk counted.", when=AFTER_SWITCH_CALL),
    K("switch.quorum.last_call.chunks_left_out", "int",
      "This rank's chunks that were not counted.", when=AFTER_SWITCH_CALL),
    K("switch.quorum.last_call.chunks_skipped", "int",
      "This rank's chunks it sent no values for (they did not fit the exponents agreed "
      "without it).", when=AFTER_SWITCH_CALL),

    # -- the runtime: runtime/background.py, executor.py, negotiated.py, ordered.py,
    #    running_ahead.py; torch/basics.py and torch/sparse.py (table_stats) -------------
    K("fused calls", "int",
      "Calls that carried several tensors fused into one buffer (`fusion_threshold`).",
      api=RUNTIME),
    K("tensors fused", "int", "Tensors those fused calls carried.", api=RUNTIME),
    K("cycles", "int",
      "The Horovod API: negotiation rounds this rank took part in (at most one per "
      "`cycle_time`, with work or without); torch.distributed: operations run, in program "
      "order.",
      api=RUNTIME),
    K("tensors without some rank", "int",
      "Allreduces run in quorum mode ahead of a rank that had not submitted them yet "
      "(docs/quorum.md, Running ahead).", api=RUNTIME),
    K("tensors without this rank", "int",
      "Of those, the ones this rank was late for: its submission took the result the "
      "others made.", api=RUNTIME),
    K("late inputs carried", "int",
      "This rank's late inputs added to its next contribution of the same name "
      "(`carry_late_inputs`, a DistributedOptimizer's gradients) instead of dropped.",
      api=RUNTIME),
    K("run-ahead quorum", "int",
      "The k the runtime runs ahead of late ranks with (0: sync, or `quorum_run_ahead` 0, "
      "where k is the switch's).", api=RUNTIME),
    K("sparse", "dict[str, dict]",
      "Per sparse tensor reduced with hot rows (`hot_rows` > 0), by name: `calls`, "
      "`hot_rows` (the rows summed densely now), `hot_share_of_touched_rows`, "
      "`bytes_through_allreduce` and `bytes_gathered` (this rank's), `trials_declined` (hot "
      "sets set aside as slower than the exact gather) and `median_ms` (`exact`, `hot`: "
      "the slowest rank's median call time, or None).", api=HOROVOD, open=True),
)
del K

# The page's tables: (heading, what its keys are, which keys).
GROUPS = (
    ("Calls", "What the allreduces did, and which engine served them.",
     lambda key: key.api == ALL and key.path.split(".")[0] not in ("transport", "switch")),
    ("transport", "`stats()[\"transport\"]`: this rank's packets to and from the switch "
     "(`_fast/transport.pyx`), over every call and link; `{}` until the job joined one.",
     lambda key: key.path.split(".")[0] == "transport"),
    ("switch", "`stats()[\"switch\"]`: the switch engine's state and counts. Without a "
     "switch (`INA_SWITCH` unset) it is `{\"configured\": False, \"serving\": False, "
     "\"reason\": ...}` (`ina/offload.py`'s `ABSENT`), `transport` is `{}` and `kernels` "
     "is `None`.",
     lambda key: key.path.split(".")[0] == "switch"),
    ("The runtime", "The background runtime's counters, beside the ones above: the Horovod "
     "API's `hvd.stats()` and torch.distributed's `stats(group)` have them (and "
     "`ina_collectives.stats()`, where it reports one of those APIs' default groups).",
     lambda key: key.api != ALL),
)


def group_of(key: Key) -> str:
    """The heading of the table ``key`` is in."""
    return next(title for title, _, holds in GROUPS if holds(key))


def documented(api: str = ALL, when: frozenset[str] | set[str] = frozenset()
               ) -> dict[str, Key]:
    """The keys a stats() of ``api`` (ALL, RUNTIME or HOROVOD; each has the keys of
    those before it) has where the conditions ``when`` (keys of WHEN) hold, by path;
    ALWAYS holds in any."""
    apis = {ALL: {ALL}, RUNTIME: {ALL, RUNTIME}, HOROVOD: {ALL, RUNTIME, HOROVOD}}[api]
    holds = set(when) | {ALWAYS}
    return {k.path: k for k in KEYS if k.api in apis and k.when in holds}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def table(title: str) -> str:
    """The keys under heading ``title`` as a Markdown table."""
    rows = ["| key | type | API | present | meaning |", "| --- | --- | --- | --- | --- |"]
    for key in KEYS:
        if group_of(key) == title:
            rows.append(f"| `{key.path}` | `{_cell(key.type)}` | {key.api} | {key.when} | "
                        f"{_cell(key.meaning)} |")
    return "\n".join(rows)


def page() -> str:
    """docs/stats.md: what the columns say, then a table per group of keys."""
    apis = "\n".join(f"- **{name}**: {text}." for name, text in APIS.items())
    whens = "\n".join(f"- **{name}**: {text}." for name, text in WHEN.items())
    parts = [
        "# stats() reference\n\n"
        "Generated by `python -m ina_collectives.statskeys`; tests/test_statskeys.py checks "
        "it is current.\n\n"
        "Every key of `ina_collectives.stats()`, each a dotted path into the dict "
        "(`switch.quorum.mode` is `stats()[\"switch\"][\"quorum\"][\"mode\"]`; "
        "`switch.aggregators[].address` is the `address` of each entry of the list "
        "`switch.aggregators`). A key whose own keys are names or reasons is one entry, "
        "its value's shape in its type. The counts are this rank's, since its API "
        "started.\n\n"
        f"The API column says which stats() has the key:\n\n{apis}\n\n"
        f"The present column says when it is there:\n\n{whens}\n"]
    for title, intro, _ in GROUPS:
        parts.append(f"## {title}\n\n{intro}\n\n{table(title)}\n")
    return "\n".join(parts)


def main() -> None:
    """Print docs/stats.md."""
    print(page(), end="")


if __name__ == "__main__":
    main()
