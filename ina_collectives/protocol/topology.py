"""A job's aggregation tree: which aggregator serves which ranks, and which is its parent.

The file is TOML (docs/trees.md)::

    [[aggregator]]
    name = "spine"
    address = "127.0.0.1:47480"

    [[aggregator]]
    name = "rack0"
    address = "127.0.0.2:47481"
    parent = "spine"
    ranks = [0, 1]

A leaf aggregator serves the ranks it lists (its workers, numbered 0.. in that order)
and sends each chunk its workers completed up to its parent as one contribution; the
root completes the chunk among its children (numbered in the file's order) and its
result comes down. Two levels: leaves under one root, or one aggregator alone (a flat
job). Several trees: leaves whose ``parent`` lists several roots (``parent = ["spine0",
"spine1"]``, every leaf the same roots) serve one tree per root, tree t at the leaf's
port + t, and a job stripes its calls across the trees (docs/trees.md, Several roots).
A root may say ``mbit = 400``: the rate its tree gets through it (its slowest link, each
way); each call is split across the trees in proportion to these until the trees' rates
are measured (every root says one, or none does).

A tree of P4 switches is installed, not joined (docs/trees.md, A tree of P4 switches):
every aggregator then names its P4Runtime target (``p4runtime = "host:port"``), and may
give its MAC (``mac``) and, for a leaf, its switch port towards its parent
(``uplink_port``) and its parent's port towards it (``downlink_port``), for the P4
rewrites. One root (a P4 leaf's job has one parent).
``check`` refuses, naming the file and the aggregator, a cycle, a parent that is not in
the file, a rank served twice or by none, and a shape of more than two levels.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..errors import TopologyError
from .address import is_mac, parse_address

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: tomli is the same parser, where installed
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

MAX_CHILDREN = 64  # a parent's workers are its children: a bitmap's bits


@dataclass(frozen=True)
class Aggregator:
    """One aggregator of the tree: its name, address, parent (None: a root), the ranks
    it serves (a leaf's; none for the root of a tree), and the parents after the first
    of a leaf under several roots."""

    name: str
    address: tuple[str, int]
    parent: str | None = None
    ranks: tuple[int, ...] = ()
    more_parents: tuple[str, ...] = ()
    mbit: float | None = None  # a root's: the rate its tree gets through it
    # A tree a controller installs: the aggregator's P4Runtime target, its MAC, and a
    # leaf's switch port towards its parent and its parent's port towards it.
    p4runtime: str | None = None
    mac: str | None = None
    uplink_port: int | None = None
    downlink_port: int | None = None

    @property
    def parents(self) -> tuple[str, ...]:
        return (self.parent, *self.more_parents) if self.parent is not None else ()


@dataclass(frozen=True)
class Topology:
    """The aggregators of one job, in the file's order, checked as one tree."""

    aggregators: tuple[Aggregator, ...]
    source: str = "topology"

    @classmethod
    def load(cls, path: str | Path) -> "Topology":
        """Read and check a topology file (TopologyError names what is wrong)."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise TopologyError(f"topology file {path}: {exc.strerror or exc}") from None
        return cls.parse(text, str(path))

    @classmethod
    def parse(cls, text: str, source: str = "topology") -> "Topology":
        if tomllib is None:
            raise TopologyError(f"{source}: reading a topology file needs Python 3.11 or "
                                f"the tomli package (pip install tomli)")
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise TopologyError(f"{source}: not TOML: {exc}") from None
        unknown = set(data) - {"aggregator"}
        if unknown:
            raise TopologyError(f"{source}: unknown table(s) {sorted(unknown)}; a topology "
                                f"lists [[aggregator]] entries")
        entries = data.get("aggregator", [])
        if not isinstance(entries, list) or not entries:
            raise TopologyError(f"{source}: no [[aggregator]] entries")
        found = []
        for i, entry in enumerate(entries):
            found.append(_aggregator(entry, f"{source}: aggregator {i + 1}"))
        topology = cls(tuple(found), source)
        topology._check_shape()
        return topology

    # -- the tree -------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Aggregator:
        for a in self.aggregators:
            if a.name == name:
                return a
        raise TopologyError(f"{self.source}: no aggregator named {name!r} (it has "
                            f"{', '.join(repr(a.name) for a in self.aggregators)})")

    @property
    def root(self) -> Aggregator:
        """The (first) root."""
        return self.roots[0]

    @property
    def roots(self) -> tuple[Aggregator, ...]:
        """The roots, in the file's order: tree t is the one rooted at roots[t]."""
        return tuple(a for a in self.aggregators if a.parent is None)

    @property
    def tree_rates(self) -> tuple[float, ...] | None:
        """Each tree's rate through its root (Mbit/s, the file's ``mbit``), in the order
        of ``roots``; None where the file gives none."""
        rates = tuple(r.mbit for r in self.roots)
        return None if None in rates else rates  # type: ignore[return-value]

    @property
    def installed(self) -> bool:
        """Whether a controller installs this tree (its aggregators name P4Runtime
        targets) rather than the ranks joining it."""
        return self.aggregators[0].p4runtime is not None

    def leaf_address(self, leaf: Aggregator, tree: int) -> tuple[str, int]:
        """Where a leaf serves tree ``tree``: its address, the port + tree."""
        return leaf.address[0], leaf.address[1] + tree

    @property
    def is_tree(self) -> bool:
        """More than one level: leaves under a root."""
        return len(self.aggregators) > 1

    @property
    def leaves(self) -> tuple[Aggregator, ...]:
        return tuple(a for a in self.aggregators if a.ranks)

    def children(self, name: str) -> tuple[Aggregator, ...]:
        return tuple(a for a in self.aggregators if name in a.parents)

    def child_index(self, name: str) -> int:
        """The worker id an aggregator has at its parent (its place among the parent's
        children, in the file's order)."""
        a = self[name]
        if a.parent is None:
            raise TopologyError(f"{self.source}: aggregator {name!r} is the root")
        return [c.name for c in self.children(a.parent)].index(name)

    def leaf_of(self, rank: int) -> Aggregator:
        for a in self.aggregators:
            if rank in a.ranks:
                return a
        raise TopologyError(f"{self.source}: no aggregator serves rank {rank}")

    def place(self, rank: int) -> tuple[Aggregator, int, int]:
        """A rank's leaf, its worker id there and the leaf's number of workers."""
        leaf = self.leaf_of(rank)
        return leaf, leaf.ranks.index(rank), len(leaf.ranks)

    def ranks(self) -> list[int]:
        return sorted(r for a in self.aggregators for r in a.ranks)

    def check(self, size: int) -> None:
        """That the tree serves a job of ``size`` ranks: each of 0..size-1 by one leaf."""
        served = self.ranks()
        missing = sorted(set(range(size)) - set(served))
        if missing:
            raise TopologyError(f"{self.source}: no aggregator serves rank(s) "
                                f"{_listed(missing)} of the job's {size}")
        extra = sorted(r for r in set(served) if r >= size)
        if extra:
            named = ", ".join(f"{r} (served by {self.leaf_of(r).name!r})" for r in extra)
            raise TopologyError(f"{self.source}: rank{'s' if len(extra) > 1 else ''} "
                                f"{named} {'are' if len(extra) > 1 else 'is'} not in the "
                                f"job: it has {size} ranks (0..{size - 1})")

    def describe(self) -> str:
        """One line: the tree as name(ranks) under the root."""
        if not self.is_tree:
            a = self.aggregators[0]
            return f"{a.name} ({len(a.ranks)} ranks)"
        return (", ".join(r.name for r in self.roots) + " <- " + ", ".join(
            f"{c.name} (ranks {_listed(list(c.ranks))})"
            for c in self.children(self.root.name)))

    def _check_shape(self) -> None:
        src, names = self.source, [a.name for a in self.aggregators]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise TopologyError(f"{src}: aggregator name(s) {dup} used twice")
        for i, a in enumerate(self.aggregators):
            other = next((b for b in self.aggregators[:i] if b.address == a.address), None)
            if other is not None:
                raise TopologyError(f"{src}: address {a.address[0]}:{a.address[1]} is given "
                                    f"to both {other.name!r} and {a.name!r}")
        for a in self.aggregators:
            for parent in a.parents:
                if parent not in names:
                    raise TopologyError(f"{src}: aggregator {a.name!r} names parent "
                                        f"{parent!r}, which is not in the file")
                if parent == a.name:
                    raise TopologyError(f"{src}: aggregator {a.name!r} is its own parent")
        for a in self.aggregators:  # a cycle: following parents comes back
            seen, at = [a.name], a
            while at.parent is not None:
                at = self[at.parent]
                if at.name in seen:
                    raise TopologyError(f"{src}: the parents form a cycle: "
                                        f"{' -> '.join(seen[seen.index(at.name):] + [at.name])}")
                seen.append(at.name)
        roots = [a.name for a in self.aggregators if a.parent is None]
        several = any(a.more_parents for a in self.aggregators)
        if len(roots) != 1 and not (several and len(roots) > 1):
            raise TopologyError(f"{src}: {len(roots)} aggregators without a parent "
                                f"({roots}): a tree has one root (several trees: each "
                                f"leaf lists every root as its parent)")
        served: dict[int, str] = {}
        for a in self.aggregators:
            for r in a.ranks:
                if r in served:
                    raise TopologyError(f"{src}: rank {r} is served by both {served[r]!r} "
                                        f"and {a.name!r}")
                served[r] = a.name
        root = self.root
        if not self.is_tree:
            if not root.ranks:
                raise TopologyError(f"{src}: aggregator {root.name!r} serves no ranks")
            return
        if root.ranks:
            raise TopologyError(f"{src}: the root {root.name!r} lists ranks; in a tree the "
                                f"ranks are served by the leaves under it")
        for r in self.roots:
            if r.ranks:
                raise TopologyError(f"{src}: the root {r.name!r} lists ranks; in a tree "
                                    f"the ranks are served by the leaves under it")
        for a in self.aggregators:  # (the levels first: a middle level serves no ranks)
            for parent in a.parents:
                if parent not in roots:
                    where = (f"the root {root.name!r}" if len(roots) == 1
                             else f"a root ({', '.join(map(repr, roots))})")
                    raise TopologyError(f"{src}: aggregator {a.name!r} is under {parent!r}, "
                                        f"not under {where}: trees have two levels "
                                        f"(leaves under one root)")
        for a in self.aggregators:
            if a.parent is not None and not a.ranks:
                raise TopologyError(f"{src}: leaf {a.name!r} serves no ranks")
            if a.parent is not None and sorted(a.parents) != sorted(roots):
                raise TopologyError(f"{src}: leaf {a.name!r} is under "
                                    f"{', '.join(map(repr, a.parents))}, but the roots are "
                                    f"{', '.join(map(repr, roots))}: every leaf lists every "
                                    f"root (one tree per root)")
        if len(self.children(root.name)) > MAX_CHILDREN:
            raise TopologyError(f"{src}: the root {root.name!r} has "
                                f"{len(self.children(root.name))} children, at most "
                                f"{MAX_CHILDREN}")
        for a in self.aggregators:
            if a.mbit is not None and a.parent is not None:
                raise TopologyError(f"{src}: leaf {a.name!r} gives mbit: a root's, the rate "
                                    f"its tree gets through it")
        named = _all_or_none(src, "p4runtime", self.aggregators, "aggregator",
                             lambda a: a.p4runtime, "a tree is installed by a controller "
                             "whole, or joined by its ranks")
        if named and len(roots) > 1:
            raise TopologyError(f"{src}: an installed tree (p4runtime) has one root: a P4 "
                                f"leaf's job has one parent")
        for a in self.aggregators:
            if a.parent is None and (a.uplink_port, a.downlink_port) != (None, None):
                raise TopologyError(f"{src}: the root {a.name!r} gives uplink_port or "
                                    f"downlink_port: a leaf's, the ports between it and "
                                    f"its parent")
        _all_or_none(src, "mbit", self.roots, "root", lambda a: a.mbit,
                     "each call is split by them, so every root says one, or none does")
        taken = {a.address: a.name for a in self.aggregators}
        for leaf in self.leaves:  # a leaf of several trees takes port + 1, + 2 ... too
            for t in range(1, len(roots)):
                at = self.leaf_address(leaf, t)
                if at in taken or at[1] > 65535:
                    raise TopologyError(f"{src}: leaf {leaf.name!r} serves tree {t} at "
                                        f"{at[0]}:{at[1]}, "
                                        + (f"the address of {taken[at]!r}" if at in taken
                                           else "past the last port"))
                taken[at] = leaf.name


def _all_or_none(src: str, key: str, among: tuple[Aggregator, ...], kind: str,
                 value: Callable[[Aggregator], object], why: str) -> list[str]:
    """The names of the aggregators ``among`` that give ``key``: all of them or none
    (TopologyError naming those that do, and ``why``, otherwise)."""
    named = [a.name for a in among if value(a) is not None]
    if named and len(named) != len(among):
        raise TopologyError(f"{src}: {key} given for {', '.join(map(repr, named))} but not "
                            f"for every {kind}: {why}")
    return named


def _aggregator(entry: object, where: str) -> Aggregator:
    if not isinstance(entry, dict):
        raise TopologyError(f"{where}: not a table")
    name = entry.get("name")
    if isinstance(name, str) and name:
        where = f"{where} ({name!r})"
    unknown = set(entry) - {"name", "address", "parent", "ranks", "mbit", *_INSTALL_KEYS}
    if unknown:
        raise TopologyError(f"{where}: unknown key(s) {sorted(unknown)} (name, address, "
                            f"parent, ranks, mbit, {', '.join(_INSTALL_KEYS)})")
    if not isinstance(name, str) or not name:
        raise TopologyError(f"{where}: needs a name")
    address = entry.get("address")
    if not isinstance(address, str):
        raise TopologyError(f"{where}: needs an address, 'host:port'")
    try:
        resolved = parse_address(address)
    except ValueError as exc:
        raise TopologyError(f"{where}: {exc}") from None
    parent = entry.get("parent")
    more: tuple[str, ...] = ()
    if isinstance(parent, list):  # one tree per root: every leaf lists every root
        if (not parent or not all(isinstance(p, str) and p for p in parent)
                or len(set(parent)) != len(parent)):
            raise TopologyError(f"{where}: parent must be an aggregator's name, or a list "
                                f"of distinct roots' names")
        parent, more = parent[0], tuple(parent[1:])
    if parent is not None and not isinstance(parent, str):
        raise TopologyError(f"{where}: parent must be an aggregator's name")
    ranks = entry.get("ranks", [])
    if (not isinstance(ranks, list)
            or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0
                       for r in ranks)):
        raise TopologyError(f"{where}: ranks must be a list of rank numbers (0, 1, ...)")
    if len(set(ranks)) != len(ranks):
        raise TopologyError(f"{where}: a rank listed twice")
    if len(ranks) > MAX_CHILDREN:
        raise TopologyError(f"{where}: {len(ranks)} ranks, at most {MAX_CHILDREN}")
    mbit = entry.get("mbit")
    if mbit is not None and (isinstance(mbit, bool) or not isinstance(mbit, (int, float))
                             or not 0 < mbit < float("inf")):
        raise TopologyError(f"{where}: mbit must be a positive number (Mbit/s), got {mbit!r}")
    return Aggregator(name, resolved, parent, tuple(ranks), more,
                      None if mbit is None else float(mbit), **_install(entry, where))


_INSTALL_KEYS = ("p4runtime", "mac", "uplink_port", "downlink_port")


def _install(entry: dict, where: str) -> dict:
    """An installed tree's keys of one aggregator (p4runtime, mac, uplink_port,
    downlink_port), checked."""
    found = {key: entry.get(key) for key in _INSTALL_KEYS}
    target = found["p4runtime"]
    if target is not None:
        if not isinstance(target, str) or ":" not in target:
            raise TopologyError(f"{where}: p4runtime must be the P4Runtime target's "
                                f"'host:port', got {target!r}")
        try:
            parse_address(target)
        except ValueError as exc:
            raise TopologyError(f"{where}: p4runtime: {exc}") from None
    mac = found["mac"]
    if mac is not None and not is_mac(mac):
        raise TopologyError(f"{where}: mac must be 'aa:bb:cc:dd:ee:ff', got {mac!r}")
    for key in ("uplink_port", "downlink_port"):
        port = found[key]
        if port is not None and (isinstance(port, bool) or not isinstance(port, int)
                                 or not 0 <= port < 512):
            raise TopologyError(f"{where}: {key} must be a switch port, 0..511, got "
                                f"{port!r}")
    return found


def _listed(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)
