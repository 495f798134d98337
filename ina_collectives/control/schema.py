"""The P4 program's control-plane surface, written once: names, ids, widths, sizes.

``p4/gen.py`` writes ``p4/ina_aggregator.p4`` (with these ids as ``@id`` annotations, so
that p4c's P4Info carries the same ids) and ``p4/ina_aggregator.p4info.txt`` from this
module; the controller (``ina_collectives.control``) and the software switch's
P4Runtime service (``ina_collectives.switch.p4runtime_service``) name the same entities from here.

K (int32 values per packet) and S (slots, each with two versions) are compile-time
constants of a P4 build. The P4Info says both: one value register per element
(``value_0`` .. ``value_<K-1>``), each with 2 S cells. The software switch reads K and S
from the P4Info it is given, so ``p4info(k, slots)`` describes any build.

Register cells: slot ``s`` of a job whose range starts at ``slot_base``, version ``v``, is
cell ``v * S + slot_base + s``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import protocol as P

DEFAULT_ELEMENTS = 64     # K of the committed build
DEFAULT_SLOTS = 4096      # S of the committed build (2 S register cells)
MAX_TABLE_ENTRIES = 4096  # worker entries and replica rewrites (64 jobs x 64 workers)

INGRESS, EGRESS = "IngressImpl", "EgressImpl"

# P4Runtime id prefixes (p4/config/v1/p4info.proto, P4Ids.Prefix).
_ACTION, _TABLE, _COUNTER, _REGISTER = 0x01, 0x02, 0x12, 0x16


def _id(prefix: int, n: int) -> int:
    return prefix << 24 | n


@dataclass(frozen=True)
class Field:
    name: str       # the @name of the key, or the action parameter
    bits: int
    expr: str = ""  # the P4 expression a key matches on


@dataclass(frozen=True)
class Action:
    name: str
    id: int
    params: tuple[Field, ...] = ()


@dataclass(frozen=True)
class Table:
    name: str
    id: int
    keys: tuple[Field, ...]
    actions: tuple[Action, ...]     # entry actions
    default: Action                 # the const default action (default only)
    size: int


# -- the worker admission table: (job, source address) -> worker ---------------------

ADMIT = Action(f"{INGRESS}.admit", _id(_ACTION, 1), (
    Field("worker_id", 16), Field("worker_bit", P.MAX_WORKERS), Field("num_workers", 16),
    Field("mcast_grp", 16), Field("slot_base", 32), Field("slot_count", 32)))
REJECT = Action(f"{INGRESS}.reject", _id(_ACTION, 2))
WORKERS = Table(f"{INGRESS}.ina_workers", _id(_TABLE, 1), (
    Field("job_id", 16, "hdr.ina.job_id"), Field("src_addr", 32, "hdr.ipv4.src_addr"),
    Field("src_port", 16, "hdr.udp.src_port")), (ADMIT,), REJECT, MAX_TABLE_ENTRIES)

# -- plain L2 forwarding for everything that is not INA -------------------------------

FORWARD = Action(f"{INGRESS}.forward", _id(_ACTION, 3), (Field("port", 9),))
DROP = Action(f"{INGRESS}.drop", _id(_ACTION, 4))
L2 = Table(f"{INGRESS}.l2_forward", _id(_TABLE, 2), (
    Field("dst_addr", 48, "hdr.ethernet.dst_addr"),), (FORWARD,), DROP, 1024)

# -- the per-replica rewrite of a multicast result: (group, replica id) -> worker ------

REWRITE = Action(f"{EGRESS}.rewrite_result", _id(_ACTION, 5), (
    Field("dst_mac", 48), Field("dst_addr", 32), Field("dst_port", 16)))
DROP_REPLICA = Action(f"{EGRESS}.drop_replica", _id(_ACTION, 6))
REPLICAS = Table(f"{EGRESS}.ina_replicas", _id(_TABLE, 3), (
    Field("mcast_grp", 16, "meta.mcast_grp"), Field("rid", 16, "standard_metadata.egress_rid")),
    (REWRITE,), DROP_REPLICA, MAX_TABLE_ENTRIES)

# -- a helper action the program calls itself (no table): p4c lists it in the P4Info too

ANSWER = Action(f"{INGRESS}.answer_from_switch", _id(_ACTION, 7))

TABLES = (WORKERS, L2, REPLICAS)
ACTIONS = (ADMIT, REJECT, FORWARD, DROP, REWRITE, DROP_REPLICA, ANSWER)

# -- registers: per cell (2 S of them) ------------------------------------------------


@dataclass(frozen=True)
class Register:
    name: str
    id: int
    bits: int
    state: str = ""  # the software switch's name of the cell field (Aggregator.get_cell)


BITMAP = Register(f"{INGRESS}.slot_bitmap", _id(_REGISTER, 1), P.MAX_WORKERS, "bitmap")
COUNT = Register(f"{INGRESS}.slot_packets", _id(_REGISTER, 2), 16, "count")
PROPOSAL = Register(f"{INGRESS}.slot_proposal", _id(_REGISTER, 3), 16, "proposal")
CHUNK = Register(f"{INGRESS}.slot_chunk", _id(_REGISTER, 4), 64,  # offset ++ count ++ exponent
                 "chunk")
EPOCH = Register(f"{INGRESS}.slot_epoch", _id(_REGISTER, 5), 16, "epoch")  # of its last run
STATE_REGISTERS = (BITMAP, COUNT, PROPOSAL, CHUNK, EPOCH)  # what a job reset clears
VALUE_PREFIX = f"{INGRESS}.value_"
VALUE_ID_BASE = 0x100


def value_register(i: int) -> Register:
    return Register(f"{VALUE_PREFIX}{i}", _id(_REGISTER, VALUE_ID_BASE + i), 32)


# -- the drop counter, indexed like the software switch's DROP_REASONS ----------------

DROP_REASONS = P.DROP_REASONS
DROPS_COUNTER_NAME, DROPS_COUNTER_ID = f"{INGRESS}.ina_drops", _id(_COUNTER, 1)

# What the controller writes or reads (the software switch serves exactly these).
ENTITIES_USED = (WORKERS.name, ADMIT.name, REPLICAS.name, REWRITE.name,
                 *(r.name for r in STATE_REGISTERS), f"{VALUE_PREFIX}0", DROPS_COUNTER_NAME)


def canonical(value: bytes) -> bytes:
    """A P4Runtime bytestring without leading zero bytes (zero is one zero byte)."""
    stripped = value.lstrip(b"\0")
    return stripped or b"\0"


def cell(version: int, slot_base: int, slot: int, slots_total: int) -> int:
    return version * slots_total + slot_base + slot


def p4info(k: int = DEFAULT_ELEMENTS, slots: int = DEFAULT_SLOTS) -> Any:
    """The P4Info message of a build with K = k and S = slots (needs the p4 extra)."""
    from p4.config.v1 import p4info_pb2

    info = p4info_pb2.P4Info()
    info.pkg_info.arch = "v1model"
    for table in TABLES:
        t = info.tables.add()
        t.preamble.id, t.preamble.name = table.id, table.name
        t.preamble.alias = table.name.split(".")[-1]
        for i, key in enumerate(table.keys, 1):
            t.match_fields.add(id=i, name=key.name, bitwidth=key.bits,
                               match_type=p4info_pb2.MatchField.EXACT)
        for action in table.actions:
            t.action_refs.add(id=action.id)
        t.action_refs.add(id=table.default.id, scope=p4info_pb2.ActionRef.DEFAULT_ONLY)
        t.const_default_action_id = table.default.id
        t.size = table.size
    for action in ACTIONS:
        a = info.actions.add()
        a.preamble.id, a.preamble.name = action.id, action.name
        a.preamble.alias = action.name.split(".")[-1]
        for i, param in enumerate(action.params, 1):
            a.params.add(id=i, name=param.name, bitwidth=param.bits)
    c = info.counters.add()
    c.preamble.id, c.preamble.name = DROPS_COUNTER_ID, DROPS_COUNTER_NAME
    c.preamble.alias = DROPS_COUNTER_NAME.split(".")[-1]
    c.spec.unit = p4info_pb2.CounterSpec.PACKETS
    c.size = len(DROP_REASONS)
    for reg in STATE_REGISTERS + tuple(value_register(i) for i in range(k)):
        r = info.registers.add()
        r.preamble.id, r.preamble.name = reg.id, reg.name
        r.preamble.alias = reg.name.split(".")[-1]
        r.type_spec.bitstring.bit.bitwidth = reg.bits
        r.size = 2 * slots
    return info


def p4info_text(k: int = DEFAULT_ELEMENTS, slots: int = DEFAULT_SLOTS) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(p4info(k, slots))


@dataclass(frozen=True)
class Build:
    """What a P4Info says of the build: K, S and the ids of the entities used."""
    k: int
    slots: int
    ids: dict[str, int]


def read_build(info: Any) -> Build:
    """Check that a P4Info has every entity the controller and the switch use, with the
    widths they expect; K and S from its value registers. ValueError names what is wrong."""
    tables = {t.preamble.name: t for t in info.tables}
    actions = {a.preamble.name: a for a in info.actions}
    registers = {r.preamble.name: r for r in info.registers}
    ids: dict[str, int] = {}
    for table in (WORKERS, REPLICAS):
        t = tables.get(table.name)
        if t is None:
            raise ValueError(f"the P4Info has no table {table.name}")
        ids[table.name] = t.preamble.id
        have = [(m.name, m.bitwidth) for m in t.match_fields]
        want = [(f.name, f.bits) for f in table.keys]
        if have != want:
            raise ValueError(f"table {table.name}: match fields {have}, expected {want}")
        for action in table.actions:
            a = actions.get(action.name)
            if a is None or a.preamble.id not in {r.id for r in t.action_refs}:
                raise ValueError(f"table {table.name} has no action {action.name}")
            have = [(p.name, p.bitwidth) for p in a.params]
            want = [(p.name, p.bits) for p in action.params]
            if have != want:
                raise ValueError(f"action {action.name}: parameters {have}, expected {want}")
            ids[action.name] = a.preamble.id
    sizes = set()
    for reg in STATE_REGISTERS:
        r = registers.get(reg.name)
        if r is None or r.type_spec.bitstring.bit.bitwidth != reg.bits:
            raise ValueError(f"the P4Info has no register {reg.name} of {reg.bits} bits")
        ids[reg.name] = r.preamble.id
        sizes.add(r.size)
    k = 0
    while f"{VALUE_PREFIX}{k}" in registers:
        r = registers[f"{VALUE_PREFIX}{k}"]
        ids[r.preamble.name] = r.preamble.id
        sizes.add(r.size)
        k += 1
    if k == 0:
        raise ValueError(f"the P4Info has no value registers ({VALUE_PREFIX}0 ...)")
    if len(sizes) != 1 or min(sizes) % 2:
        raise ValueError(f"the slot registers differ in size or are odd: {sorted(sizes)}")
    for counter in info.counters:
        if counter.preamble.name == DROPS_COUNTER_NAME:
            ids[DROPS_COUNTER_NAME] = counter.preamble.id
    return Build(k, min(sizes) // 2, ids)
