"""The P4 program's control-plane surface, written once: names, ids, widths, sizes.

``p4/gen.py`` writes ``p4/ina_aggregator.p4`` (with these ids as ``@id`` annotations, so
that p4c's P4Info carries the same ids) and ``p4/ina_aggregator.p4info.txt`` from this
module; the controller (``ina_collectives.control``) and the software switch's
P4Runtime service (``ina_collectives.switch.p4runtime_service``) name the same entities from here.

K (values per packet), S (slots, each with two versions), B (values per sub-block, a
power of two 1..64) and V (the values' width, 32 or 16) are compile-time constants of a
P4 build. The P4Info says all four: one value register of V bits per element
(``value_0`` .. ``value_<K-1>``), and per sub-block g = 0 .. G-1 (G = ceil(K / B)) an
``exponent_<g>`` and a ``proposal_<g>`` register of 16 bits, each with 2 S cells; B is
the smallest power of two with ceil(K / B) = G (a B >= K is that build: one sub-block per
packet). The software switch reads K, S, B and V from the P4Info it is given, so
``p4info(k, slots, block, value_bits)`` describes any build.

Register cells: slot ``s`` of a job whose range starts at ``slot_base``, version ``v``, is
cell ``v * S + slot_base + s``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import protocol as P

DEFAULT_ELEMENTS = 64     # K of the committed build
DEFAULT_SLOTS = 4096      # S of the committed build (2 S register cells)
DEFAULT_BLOCK = P.DEFAULT_BLOCK  # B of the committed build (32)
DEFAULT_VALUE_BITS = 32   # V of the committed build
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

# -- a job's mode (docs/quorum.md): job -> (quorum k, generation), announced in results --
SET_MODE = Action(f"{INGRESS}.set_mode", _id(_ACTION, 8), (
    Field("quorum", 8), Field("generation", 32)))
SYNC_MODE = Action(f"{INGRESS}.sync_mode", _id(_ACTION, 9))
MODES = Table(f"{INGRESS}.ina_modes", _id(_TABLE, 4), (
    Field("job_id", 16, "hdr.ina.job_id"),), (SET_MODE,), SYNC_MODE, 1024)

# -- a tree's leaf (docs/trees.md): job -> its parent, where a completed cell's sum goes up
# as worker up_worker's packet (from this switch's address and the INA port, out of `port`
# to `parent_mac`), and the job's group and slots, for the results that come down --------
SET_PARENT = Action(f"{INGRESS}.set_parent", _id(_ACTION, 10), (
    Field("parent_addr", 32), Field("parent_port", 16), Field("parent_mac", 48),
    Field("port", 9), Field("up_worker", 16), Field("mcast_grp", 16), Field("slot_base", 32),
    Field("slot_count", 32)))
NO_PARENT = Action(f"{INGRESS}.no_parent", _id(_ACTION, 11))
PARENTS = Table(f"{INGRESS}.ina_parents", _id(_TABLE, 5), (
    Field("job_id", 16, "hdr.ina.job_id"),), (SET_PARENT,), NO_PARENT, 1024)

TABLES = (WORKERS, L2, REPLICAS, MODES, PARENTS)
ACTIONS = (ADMIT, REJECT, FORWARD, DROP, REWRITE, DROP_REPLICA, ANSWER, SET_MODE, SYNC_MODE,
           SET_PARENT, NO_PARENT)
# The leaf role's, the v1model program's alone: the Tofino programs have no leaf role.
LEAF_ONLY = (PARENTS, SET_PARENT, NO_PARENT)

# -- registers: per cell (2 S of them) ------------------------------------------------


@dataclass(frozen=True)
class Register:
    name: str
    id: int
    bits: int
    # The software switch's name of the cell field (Aggregator.get_cell/set_cell):
    # "bitmap", "count", "chunk", "epoch", "call", "contributors", "ident", "marks",
    # ("exponent", g),
    # ("proposal", g), or the element index i of a value register.
    state: str | tuple[str, int] | int = ""


BITMAP = Register(f"{INGRESS}.slot_bitmap", _id(_REGISTER, 1), P.MAX_WORKERS, "bitmap")
COUNT = Register(f"{INGRESS}.slot_packets", _id(_REGISTER, 2), 16, "count")
CHUNK = Register(f"{INGRESS}.slot_chunk", _id(_REGISTER, 4), 64,  # offset ++ count ++ blocks
                 "chunk")
EPOCH = Register(f"{INGRESS}.slot_epoch", _id(_REGISTER, 5), 16, "epoch")  # of its last run
CALL = Register(f"{INGRESS}.slot_call", _id(_REGISTER, 6), 24,  # call ++ quorum k
                "call")
CONTRIBUTORS = Register(f"{INGRESS}.slot_contributors", _id(_REGISTER, 7), P.MAX_WORKERS,
                        "contributors")  # the workers its result counted
# A predicted use (docs/protocol.md, One round trip): the call's identity its first
# packet carried, and the use's marks (MARK_*).
IDENT = Register(f"{INGRESS}.slot_ident", _id(_REGISTER, 8), 64, "ident")
MARKS = Register(f"{INGRESS}.slot_marks", _id(_REGISTER, 9), 8, "marks")
MARK_PREDICTED = 1   # the use is a predicted chunk's
MARK_MISMATCH = 2    # a packet of it differed in call, offset, count, width, identity or kind
MARK_OVERFLOW = 4    # only the exponents differed: the cell keeps their max
# Per cell; with the pairs', what a job reset zeroes.
STATE_REGISTERS = (BITMAP, COUNT, CHUNK, EPOCH, CALL, CONTRIBUTORS, IDENT, MARKS)
# A tree's leaf, the program's own (no controller reads or writes them): per cell, whether
# its sum went up and waits for the parent's result (bit 8) and the packet number it went
# up with (bits 0-7, the same in a resend); per job id, the number of its next packet up.
UP = Register(f"{INGRESS}.slot_up", _id(_REGISTER, 10), 16)
UP_SEQ = Register(f"{INGRESS}.job_up_seq", _id(_REGISTER, 11), 8)
EXPONENT_PREFIX = f"{INGRESS}.exponent_"
PROPOSAL_PREFIX = f"{INGRESS}.proposal_"
VALUE_PREFIX = f"{INGRESS}.value_"
VALUE_ID_BASE = 0x100         # value_i: 0x100 + i
EXPONENT_ID_BASE = 0x10000    # exponent_g: 0x10000 + g
PROPOSAL_ID_BASE = 0x20000    # proposal_g: 0x20000 + g
MAX_IDS = EXPONENT_ID_BASE - VALUE_ID_BASE  # K and G below this: the ranges stay apart
MAX_BUILD_ELEMENTS = 1024     # the largest K p4/gen.py writes a program for
TOFINO_PIPE = "pipe."         # the Tofino compiler's prefix of every entity's name


@dataclass(frozen=True)
class TofinoBuild:
    """A Tofino build of the program (p4/gen.py --arch tna|t2na; p4/README.md, Tofino):
    its chip (the compiler's --target), architecture, K, S and B as fitted, its largest
    n (the bitmap's width) and the capabilities its probe answer states (protocol.CAP_*:
    none, so the ranks agree each call over MPI, stamp every call sync and time their
    resends alone)."""
    chip: str
    arch: str
    k: int
    slots: int
    stages: int          # the chip's match-action stages per pipe (4 stateful ALUs each)
    max_workers: int = 32
    capabilities: int = 0

    @property
    def block(self) -> int:
        """B: one sub-block per packet (the power of two K fits in)."""
        return effective_block(self.k, 64)

    @property
    def value_bits(self) -> int:
        return 32


# K as fitted (p4/README.md, Tofino): 5 stages before the values (the header's checks and
# admission, the epoch, the bitmaps, the cell's op), then 4 registers a stage (the count,
# the pair, K values), and the drop counter last.
TOFINO = {build.chip: build for build in (TofinoBuild("tofino", "tna", 20, 4096, 12),
                                          TofinoBuild("tofino2", "t2na", 48, 4096, 20))}


def exponent_register(g: int) -> Register:
    """Sub-block g's exponent of the chunk being summed (int16 as 16 bits)."""
    return Register(f"{EXPONENT_PREFIX}{g}", _id(_REGISTER, EXPONENT_ID_BASE + g), 16,
                    ("exponent", g))


def proposal_register(g: int) -> Register:
    """Sub-block g's max exponent proposal for the slot's next chunk (int16 as 16 bits)."""
    return Register(f"{PROPOSAL_PREFIX}{g}", _id(_REGISTER, PROPOSAL_ID_BASE + g), 16,
                    ("proposal", g))


def pair_registers(groups: int) -> tuple[Register, ...]:
    return tuple(r for g in range(groups) for r in (exponent_register(g),
                                                    proposal_register(g)))


def value_register(i: int, bits: int = DEFAULT_VALUE_BITS) -> Register:
    return Register(f"{VALUE_PREFIX}{i}", _id(_REGISTER, VALUE_ID_BASE + i), bits, i)


def sub_blocks(k: int, block: int) -> int:
    """G: the sub-blocks of a full packet, ceil(K / B)."""
    return -(-k // block)


def build_block(k: int, groups: int) -> int:
    """B of a build with K values and G sub-blocks: the smallest power of two with
    ceil(K / B) = G. ValueError if there is none up to 64."""
    for block in P.BLOCK_SIZES:
        if sub_blocks(k, block) == groups:
            return block
    raise ValueError(f"no sub-block size B in {P.BLOCK_SIZES} gives K {k} "
                     f"{groups} sub-blocks")


def effective_block(k: int, block: int) -> int:
    """The B a build of K values with sub-blocks of ``block`` says (and checks): B itself,
    or the smallest power of two >= K when B is larger (one sub-block per packet)."""
    P.check_format(block, DEFAULT_VALUE_BITS)
    return build_block(k, sub_blocks(k, block))


# -- the drop counter, indexed like the software switch's DROP_REASONS ----------------

DROP_REASONS = P.DROP_REASONS
DROPS_COUNTER_NAME, DROPS_COUNTER_ID = f"{INGRESS}.ina_drops", _id(_COUNTER, 1)
# -- results multicast per job, indexed by job id (the per-job counter of issue 18) --------
JOB_RESULTS_COUNTER_NAME = f"{INGRESS}.ina_job_results"
JOB_RESULTS_COUNTER_ID = _id(_COUNTER, 2)
JOB_IDS = 65536
# -- a tree leaf's traffic with its parent, by event (the software leaf's status counts) --
LEAF_COUNTER_NAME, LEAF_COUNTER_ID = f"{INGRESS}.ina_leaf", _id(_COUNTER, 3)
LEAF_EVENTS = ("sent_up", "resent_up", "came_down", "stale_down", "parent_held",
               "parent_nacks")

# What the controller writes or reads (the software switch serves exactly these).
ENTITIES_USED = (WORKERS.name, ADMIT.name, REPLICAS.name, REWRITE.name, MODES.name,
                 SET_MODE.name,
                 *(r.name for r in STATE_REGISTERS), f"{EXPONENT_PREFIX}0",
                 f"{PROPOSAL_PREFIX}0", f"{VALUE_PREFIX}0", DROPS_COUNTER_NAME,
                 JOB_RESULTS_COUNTER_NAME)


def canonical(value: bytes) -> bytes:
    """A P4Runtime bytestring without leading zero bytes (zero is one zero byte)."""
    stripped = value.lstrip(b"\0")
    return stripped or b"\0"


def cell(version: int, slot_base: int, slot: int, slots_total: int) -> int:
    return version * slots_total + slot_base + slot


def build_registers(k: int, block: int, value_bits: int) -> tuple[Register, ...]:
    """Every register of a build, in the P4Info's order: per cell, the pairs', values."""
    return (STATE_REGISTERS + pair_registers(sub_blocks(k, block))
            + tuple(value_register(i, value_bits) for i in range(k)))


def p4info(k: int = DEFAULT_ELEMENTS, slots: int = DEFAULT_SLOTS,
           block: int = DEFAULT_BLOCK, value_bits: int = DEFAULT_VALUE_BITS) -> Any:
    """The P4Info message of a build with K = k, S = slots, B = block (a B >= K is taken
    as the smallest power of two >= K: see effective_block) and V = value_bits (needs the
    p4 extra)."""
    from p4.config.v1 import p4info_pb2

    P.check_format(block, value_bits)
    if not 1 <= k < MAX_IDS:
        raise ValueError(f"K must be 1..{MAX_IDS - 1}, got {k}")
    block = effective_block(k, block)

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
    c = info.counters.add()
    c.preamble.id, c.preamble.name = JOB_RESULTS_COUNTER_ID, JOB_RESULTS_COUNTER_NAME
    c.preamble.alias = JOB_RESULTS_COUNTER_NAME.split(".")[-1]
    c.spec.unit = p4info_pb2.CounterSpec.PACKETS
    c.size = JOB_IDS
    c = info.counters.add()
    c.preamble.id, c.preamble.name = LEAF_COUNTER_ID, LEAF_COUNTER_NAME
    c.preamble.alias = LEAF_COUNTER_NAME.split(".")[-1]
    c.spec.unit = p4info_pb2.CounterSpec.PACKETS
    c.size = len(LEAF_EVENTS)
    for reg, size in ((*((r, 2 * slots) for r in build_registers(k, block, value_bits)),
                       (UP, 2 * slots), (UP_SEQ, JOB_IDS))):
        r = info.registers.add()
        r.preamble.id, r.preamble.name = reg.id, reg.name
        r.preamble.alias = reg.name.split(".")[-1]
        r.type_spec.bitstring.bit.bitwidth = reg.bits
        r.size = size
    return info


def p4info_text(k: int = DEFAULT_ELEMENTS, slots: int = DEFAULT_SLOTS,
                block: int = DEFAULT_BLOCK, value_bits: int = DEFAULT_VALUE_BITS) -> str:
    from google.protobuf import text_format

    return text_format.MessageToString(p4info(k, slots, block, value_bits))


@dataclass(frozen=True)
class Build:
    """What a P4Info says of the build: K, S, B, V and the ids of the entities used."""
    k: int
    slots: int
    ids: dict[str, int]
    block: int = DEFAULT_BLOCK
    value_bits: int = DEFAULT_VALUE_BITS
    chip: str = ""  # a Tofino build's chip (TOFINO's key); "": the v1model program

    @property
    def groups(self) -> int:
        """G: sub-blocks per full packet, one exponent and one proposal register each."""
        return sub_blocks(self.k, self.block)

    @property
    def registers(self) -> tuple[Register, ...]:
        """Every register of the build the software switch serves: a Tofino build's, its
        per-slot epoch, the pairs and the values (its bitmaps and count, which no
        controller writes, are the aggregator's own)."""
        if self.chip:
            return ((EPOCH, *pair_registers(self.groups),
                     *(value_register(i, 32) for i in range(self.k))))
        return build_registers(self.k, self.block, self.value_bits)

    def per_slot(self, register: Register) -> bool:
        """Whether ``register`` holds one entry per slot (a Tofino build's epoch and
        bitmaps), not one per cell (slot and version)."""
        return bool(self.chip) and register in (EPOCH, BITMAP)

    @property
    def state_registers(self) -> tuple[Register, ...]:
        """The per-cell state a job reset zeroes: the slot registers and the pairs'. A
        Tofino build's: its per-slot epoch alone (epochs are never 0, so each slot's
        next packet finds it another run's, and its bitmaps, count, pairs and values
        start again there)."""
        if self.chip:
            return (EPOCH,)
        return STATE_REGISTERS + pair_registers(self.groups)

    def index(self, register: Register, version: int, slot_base: int, slot: int) -> int:
        """Where ``register`` holds a job's slot ``slot`` of ``version``: its cell
        (``cell``), or, for a Tofino build's per-slot registers (epoch, bitmaps), its
        slot alone."""
        if self.per_slot(register):
            return slot_base + slot
        return cell(version, slot_base, slot, self.slots)


def local_name(name: str) -> str:
    """An entity's name as this schema writes it: the Tofino compiler prefixes its
    pipeline's, ``pipe.``."""
    return name.removeprefix(TOFINO_PIPE)


def with_local_names(info: Any) -> Any:
    """A copy of a P4Info with every entity's name as this schema writes it (local_name):
    what p4runtime-shell looks names up in. The target knows entities by id, so the
    P4Info pushed stays the compiler's."""
    copy = type(info)()
    copy.CopyFrom(info)
    for group in (copy.tables, copy.actions, copy.counters, copy.registers):
        for entity in group:
            entity.preamble.name = local_name(entity.preamble.name)
    return copy


def read_build(info: Any) -> Build:
    """Check that a P4Info has every entity the controller and the switch use, with the
    widths they expect; K and S from its value registers. ValueError names what is wrong.
    A Tofino build's (no slot_call: p4/README.md, Tofino) is read by ``_tofino_build``."""
    tables = {local_name(t.preamble.name): t for t in info.tables}
    actions = {local_name(a.preamble.name): a for a in info.actions}
    registers = {local_name(r.preamble.name): r for r in info.registers}
    ids: dict[str, int] = {}
    for table in (WORKERS, REPLICAS, MODES):
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
    if CALL.name not in registers and BITMAP.name in registers:
        return _tofino_build(info, ids, registers)
    _leaf_ids(tables, actions, ids)
    sizes = set()
    for reg in STATE_REGISTERS:
        r = registers.get(reg.name)
        if r is None or r.type_spec.bitstring.bit.bitwidth != reg.bits:
            raise ValueError(f"the P4Info has no register {reg.name} of {reg.bits} bits")
        ids[reg.name] = r.preamble.id
        sizes.add(r.size)
    k = 0
    widths = set()
    while f"{VALUE_PREFIX}{k}" in registers:
        r = registers[f"{VALUE_PREFIX}{k}"]
        ids[r.preamble.name] = r.preamble.id
        sizes.add(r.size)
        widths.add(r.type_spec.bitstring.bit.bitwidth)
        k += 1
    if k == 0:
        raise ValueError(f"the P4Info has no value registers ({VALUE_PREFIX}0 ...)")
    if len(widths) != 1 or min(widths) not in P.VALUE_BITS:
        raise ValueError(f"the value registers are of {sorted(widths)} bits; a build's "
                         f"are all 32 or all 16")
    value_bits = min(widths)
    groups = 0
    while f"{PROPOSAL_PREFIX}{groups}" in registers:
        groups += 1
    if groups == 0:
        raise ValueError(f"the P4Info has no proposal registers ({PROPOSAL_PREFIX}0 ...)")
    for reg in pair_registers(groups):
        r = registers.get(reg.name)
        if r is None or r.type_spec.bitstring.bit.bitwidth != reg.bits:
            raise ValueError(f"the P4Info has no register {reg.name} of {reg.bits} bits")
        ids[reg.name] = r.preamble.id
        sizes.add(r.size)
    block = build_block(k, groups)
    if len(sizes) != 1 or min(sizes) % 2:
        raise ValueError(f"the slot registers differ in size or are odd: {sorted(sizes)}")
    _counter_ids(info, ids)
    return Build(k, min(sizes) // 2, ids, block, value_bits)


def _leaf_ids(tables: dict[str, Any], actions: dict[str, Any], ids: dict[str, int]) -> None:
    """The leaf table's ids, where the build has it (a build older than trees, or a
    Tofino one, has none: the controller then refuses a job with a parent)."""
    t, a = tables.get(PARENTS.name), actions.get(SET_PARENT.name)
    if t is None or a is None:
        return
    have = [(p.name, p.bitwidth) for p in a.params]
    want = [(p.name, p.bits) for p in SET_PARENT.params]
    if have != want:
        raise ValueError(f"action {SET_PARENT.name}: parameters {have}, expected {want}")
    ids[PARENTS.name], ids[SET_PARENT.name] = t.preamble.id, a.preamble.id


def _counter_ids(info: Any, ids: dict[str, int]) -> None:
    for counter in info.counters:
        name = local_name(counter.preamble.name)
        if name in (DROPS_COUNTER_NAME, JOB_RESULTS_COUNTER_NAME, LEAF_COUNTER_NAME):
            ids[name] = counter.preamble.id


def _tofino_build(info: Any, ids: dict[str, int], registers: dict[str, Any]) -> Build:
    """A Tofino build's P4Info (compiled with --p4runtime-force-std-externs): per slot the
    epoch (16 bits) and the bitmap pair; per cell the count and the values (32 bits) and
    the pairs (16 bits); its chip from TOFINO, by K."""
    def bits(r: Any) -> int:
        return r.type_spec.bitstring.bit.bitwidth

    epoch, bitmap = registers.get(EPOCH.name), registers[BITMAP.name]
    count = registers.get(COUNT.name)
    if epoch is None or bits(epoch) != 16 or count is None or bits(count) != 32:
        raise ValueError(f"a Tofino build's P4Info needs {EPOCH.name} of 16 bits and "
                         f"{COUNT.name} of 32")
    slots = epoch.size
    if bitmap.size != slots or count.size != 2 * slots:
        raise ValueError(f"the slot registers' sizes differ: epoch {slots}, bitmap "
                         f"{bitmap.size}, count {count.size} (2 x S)")
    for reg in (epoch, bitmap, count):
        ids[local_name(reg.preamble.name)] = reg.preamble.id
    k = 0
    while f"{VALUE_PREFIX}{k}" in registers:
        r = registers[f"{VALUE_PREFIX}{k}"]
        if bits(r) != 32 or r.size != 2 * slots:
            raise ValueError(f"{VALUE_PREFIX}{k}: {bits(r)} bits, {r.size} cells; a Tofino "
                             f"build's values are 32 bits, 2 x S cells")
        ids[f"{VALUE_PREFIX}{k}"] = r.preamble.id
        k += 1
    groups = 0
    while f"{PROPOSAL_PREFIX}{groups}" in registers:
        groups += 1
    for reg in pair_registers(groups):
        r = registers.get(reg.name)
        if r is None or bits(r) != 16:
            raise ValueError(f"the P4Info has no register {reg.name} of 16 bits")
        ids[reg.name] = r.preamble.id
    chips = [b.chip for b in TOFINO.values() if b.k == k]
    if not k or not groups or not chips:
        raise ValueError(f"a Tofino build of K {k} and {groups} sub-blocks: no such build "
                         f"in {sorted(TOFINO)}")
    _counter_ids(info, ids)
    return Build(k, slots, ids, build_block(k, groups), 32, chips[0])
