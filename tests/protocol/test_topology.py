"""Topology files (ina_collectives.protocol.topology): a two-level tree and a flat job
parse, each rank placed at its leaf and each leaf at its root; every file that cannot be
a job's tree is refused with a TopologyError naming the file, the aggregator and what is
wrong, and ``check`` refuses a tree that does not serve the job's ranks exactly."""
from __future__ import annotations

import re

import pytest

from ina_collectives.errors import TopologyError
from ina_collectives.protocol.topology import Aggregator, Topology

TWO_LEVELS = """
[[aggregator]]
name = "spine"
address = "127.0.0.1:47480"

[[aggregator]]
name = "rack0"
address = "127.0.0.2:47481"
parent = "spine"
ranks = [0, 1]

[[aggregator]]
name = "rack1"
address = "127.0.0.3:47482"
parent = "spine"
ranks = [3, 2]
"""

FLAT = """
[[aggregator]]
name = "tor"
address = "127.0.0.1:47474"
ranks = [0, 1, 2, 3]
"""


def entry(name: str, address: str, parent: str | None = None, ranks: str | None = None,
          extra: str = "") -> str:
    """One [[aggregator]] table of a topology file."""
    lines = ["[[aggregator]]", f'name = "{name}"', f'address = "{address}"']
    if parent is not None:
        lines.append(f'parent = "{parent}"')
    if ranks is not None:
        lines.append(f"ranks = {ranks}")
    return "\n".join(lines + ([extra] if extra else [])) + "\n\n"


def refused(tmp_path, text: str, *words: str) -> str:
    """Load ``text`` as a file: it must be refused, naming the file and each of ``words``;
    the message."""
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(TopologyError) as caught:
        Topology.load(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    for word in words:
        assert word in message, (word, message)
    return message


def test_a_two_level_tree_places_each_rank_at_its_leaf(tmp_path):
    path = tmp_path / "tree.toml"
    path.write_text(TWO_LEVELS)
    tree = Topology.load(path)
    assert tree.source == str(path) and tree.is_tree
    assert tree.root == Aggregator("spine", ("127.0.0.1", 47480))
    assert [a.name for a in tree.leaves] == ["rack0", "rack1"]
    assert tree["rack1"] == Aggregator("rack1", ("127.0.0.3", 47482), "spine", (3, 2))
    # A leaf's workers are its ranks in the file's order; the root's, its children.
    assert [(tree.place(r)[0].name, *tree.place(r)[1:]) for r in range(4)] == [
        ("rack0", 0, 2), ("rack0", 1, 2), ("rack1", 1, 2), ("rack1", 0, 2)]
    assert [tree.child_index(n) for n in ("rack0", "rack1")] == [0, 1]
    assert [c.name for c in tree.children("spine")] == ["rack0", "rack1"]
    assert tree.ranks() == [0, 1, 2, 3]
    tree.check(4)
    assert tree.describe() == "spine <- rack0 (ranks 0, 1), rack1 (ranks 3, 2)"
    with pytest.raises(TopologyError, match=r"aggregator 'spine' is the root"):
        tree.child_index("spine")
    with pytest.raises(TopologyError, match=r"no aggregator named 'rack9' \(it has 'spine', "
                                            r"'rack0', 'rack1'\)"):
        tree["rack9"]
    with pytest.raises(TopologyError, match="no aggregator serves rank 7"):
        tree.place(7)


def test_a_flat_file_is_one_aggregator_serving_every_rank():
    flat = Topology.parse(FLAT, "flat.toml")
    assert not flat.is_tree and flat.root.name == "tor" and flat.leaves == (flat.root,)
    assert flat.root.address == ("127.0.0.1", 47474)
    assert [flat.place(r)[1:] for r in range(4)] == [(r, 4) for r in range(4)]
    assert flat.place(2)[0] is flat.root
    flat.check(4)
    assert flat.describe() == "tor (4 ranks)"
    with pytest.raises(TopologyError, match=r"^flat.toml: aggregator 'tor' is the root"):
        flat.child_index("tor")


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(TopologyError, match=re.escape(f"topology file {tmp_path / 'gone'}: "
                                                      "No such file")):
        Topology.load(tmp_path / "gone")


def test_what_is_not_a_topology_is_refused(tmp_path):
    refused(tmp_path, "[[aggregator]\nname = 1", "not TOML")
    refused(tmp_path, "[switch]\nname = 'x'\n", "unknown table(s) ['switch']",
            "[[aggregator]] entries")
    refused(tmp_path, "", "no [[aggregator]] entries")
    refused(tmp_path, "aggregator = 5\n", "no [[aggregator]] entries")


@pytest.mark.parametrize("text, words", [
    (entry("tor", "127.0.0.1:47474", ranks="[0]", extra='port = 47475'),
     ["aggregator 1 ('tor')", "unknown key(s) ['port']"]),
    ('[[aggregator]]\naddress = "127.0.0.1:47474"\nranks = [0]\n',
     ["aggregator 1", "needs a name"]),
    (entry("spine", "127.0.0.1:1") + '[[aggregator]]\nname = "rack0"\nranks = [0]\n',
     ["aggregator 2 ('rack0')", "needs an address, 'host:port'"]),
    (entry("tor", "127.0.0.1:notaport", ranks="[0]"),
     ["aggregator 1 ('tor')", "the port 'notaport' is not a number"]),
    (entry("tor", "127.0.0.1:70000", ranks="[0]"),
     ["aggregator 1 ('tor')", "port 70000 is out of range"]),
    (entry("tor", "no-such-host.invalid:47474", ranks="[0]"),
     ["aggregator 1 ('tor')", "cannot resolve 'no-such-host.invalid'"]),
    (entry("tor", "127.0.0.1:1", ranks="[0, true]"),
     ["aggregator 1 ('tor')", "ranks must be a list of rank numbers"]),
    (entry("tor", "127.0.0.1:1", ranks="[0, -1]"),
     ["aggregator 1 ('tor')", "ranks must be a list of rank numbers"]),
    (entry("tor", "127.0.0.1:1", ranks='"0, 1"'),
     ["aggregator 1 ('tor')", "ranks must be a list of rank numbers"]),
    (entry("tor", "127.0.0.1:1", ranks="[0, 1, 0]"),
     ["aggregator 1 ('tor')", "a rank listed twice"]),
    (entry("tor", "127.0.0.1:1", ranks=str(list(range(65)))),
     ["aggregator 1 ('tor')", "65 ranks, at most 64"]),
    (entry("tor", "127.0.0.1:1", ranks="[0]", extra="mbit = 0"),
     ["aggregator 1 ('tor')", "mbit must be a positive number (Mbit/s), got 0"]),
    (entry("tor", "127.0.0.1:1", ranks="[0]", extra='mbit = "fast"'),
     ["aggregator 1 ('tor')", "mbit must be a positive number"]),
])
def test_an_aggregator_entry_that_cannot_be_one_is_named(tmp_path, text, words):
    refused(tmp_path, text, *words)


SPINE = entry("spine", "127.0.0.1:47480")


@pytest.mark.parametrize("text, words", [
    (SPINE + entry("rack0", "127.0.0.1:47481", "spin", "[0]"),
     ["aggregator 'rack0' names parent 'spin', which is not in the file"]),
    (entry("tor", "127.0.0.1:47480", "tor", "[0]"),
     ["aggregator 'tor' is its own parent"]),
    (SPINE + entry("a", "127.0.0.1:1", "b", "[0]") + entry("b", "127.0.0.1:2", "a", "[1]"),
     ["the parents form a cycle: a -> b -> a"]),
    (SPINE + entry("a", "127.0.0.1:1", "b", "[0]") + entry("b", "127.0.0.1:2", "c", "[1]")
     + entry("c", "127.0.0.1:3", "a", "[2]"),
     ["the parents form a cycle: a -> b -> c -> a"]),
    # Without a root: a cycle is still named as one, not as a missing root.
    (entry("a", "127.0.0.1:1", "b", "[0]") + entry("b", "127.0.0.1:2", "a", "[1]"),
     ["the parents form a cycle: a -> b -> a"]),
    (entry("east", "127.0.0.1:1", ranks="[0]") + entry("west", "127.0.0.1:2", ranks="[1]"),
     ["2 aggregators without a parent (['east', 'west']): a tree has one root"]),
    (SPINE + entry("rack0", "127.0.0.1:1", "spine", "[0, 1]")
     + entry("rack1", "127.0.0.1:2", "spine", "[1, 2]"),
     ["rank 1 is served by both 'rack0' and 'rack1'"]),
    (entry("spine", "127.0.0.1:47480", ranks="[2]")
     + entry("rack0", "127.0.0.1:1", "spine", "[0, 1]"),
     ["the root 'spine' lists ranks; in a tree the ranks are served by the leaves"]),
    (SPINE + entry("pod", "127.0.0.1:1", "spine") + entry("rack0", "127.0.0.1:2", "pod", "[0]"),
     ["aggregator 'rack0' is under 'pod', not under the root 'spine': trees have two "
      "levels"]),
    (SPINE + entry("pod", "127.0.0.1:1", "spine", "[1]")
     + entry("rack0", "127.0.0.1:2", "pod", "[0]"),
     ["aggregator 'rack0' is under 'pod', not under the root 'spine'"]),
    (SPINE + entry("rack0", "127.0.0.1:1", "spine", "[0]") + entry("rack1", "127.0.0.1:2",
                                                                     "spine"),
     ["leaf 'rack1' serves no ranks"]),
    (entry("tor", "127.0.0.1:1"), ["aggregator 'tor' serves no ranks"]),
    (SPINE + entry("rack0", "127.0.0.1:1", "spine", "[0]")
     + entry("rack0", "127.0.0.1:2", "spine", "[1]"),
     ["aggregator name(s) ['rack0'] used twice"]),
    (SPINE + entry("rack0", "127.0.0.1:1", "spine", "[0]")
     + entry("rack1", "localhost:1", "spine", "[1]"),
     ["address 127.0.0.1:1 is given to both 'rack0' and 'rack1'"]),
    (SPINE + "".join(entry(f"r{i}", f"127.0.0.1:{i + 1}", "spine", f"[{i}]")
                     for i in range(65)),
     ["the root 'spine' has 65 children, at most 64"]),
])
def test_a_file_that_is_no_two_level_tree_is_refused_naming_the_aggregator(tmp_path, text,
                                                                           words):
    refused(tmp_path, text, *words)


def test_check_refuses_a_tree_that_does_not_serve_the_jobs_ranks_exactly():
    tree = Topology.parse(TWO_LEVELS, "tree.toml")
    with pytest.raises(TopologyError) as missing:
        tree.check(6)
    assert str(missing.value) == "tree.toml: no aggregator serves rank(s) 4, 5 of the job's 6"
    with pytest.raises(TopologyError) as extra:
        tree.check(3)
    assert str(extra.value) == ("tree.toml: rank 3 (served by 'rack1') is not in the job: "
                                "it has 3 ranks (0..2)"), str(extra.value)
    with pytest.raises(TopologyError, match=r"rank\(s\) 0, 1, 2, 3 of the job's 5"):
        Topology.parse(FLAT.replace("[0, 1, 2, 3]", "[4]"), "flat.toml").check(5)
    with pytest.raises(TopologyError, match=r"ranks 2 \(served by 'rack1'\), 3 \(served by "
                                            r"'rack1'\) are not in the job: it has 2"):
        tree.check(2)


def test_without_a_toml_parser_the_need_is_named(monkeypatch):
    """Python 3.10 has no tomllib: tomli serves where installed, else the file is refused
    saying what it needs (the rest of the package imports without either)."""
    from ina_collectives.protocol import topology
    monkeypatch.setattr(topology, "tomllib", None)
    with pytest.raises(TopologyError, match=r"^flat.toml: reading a topology file needs "
                                            r"Python 3.11 or the tomli package"):
        Topology.parse(FLAT, "flat.toml")


TWO_ROOTS = (entry("spine0", "127.0.0.1:47480") + entry("spine1", "127.0.0.4:47480")
             + entry("rack0", "127.0.0.2:47490", ranks="[0, 1]",
                     extra='parent = ["spine0", "spine1"]')
             + entry("rack1", "127.0.0.3:47490", ranks="[2, 3]",
                     extra='parent = ["spine0", "spine1"]'))


def test_several_roots_make_one_tree_each_over_the_same_leaves():
    """A leaf under every root serves tree t at its port + t, the same worker id in each."""
    trees = Topology.parse(TWO_ROOTS, "trees.toml")
    assert [r.name for r in trees.roots] == ["spine0", "spine1"] and trees.root.name == "spine0"
    rack1 = trees["rack1"]
    assert rack1.parents == ("spine0", "spine1") and rack1.parent == "spine0"
    assert [trees.leaf_address(rack1, t) for t in range(2)] == [("127.0.0.3", 47490),
                                                                ("127.0.0.3", 47491)]
    assert trees.child_index("rack1") == 1
    assert [c.name for c in trees.children("spine1")] == ["rack0", "rack1"]
    trees.check(4)
    assert trees.describe() == "spine0, spine1 <- rack0 (ranks 0, 1), rack1 (ranks 2, 3)"


@pytest.mark.parametrize("text, words", [
    (entry("spine0", "127.0.0.1:1") + entry("spine1", "127.0.0.1:2")
     + entry("rack0", "127.0.0.1:3", ranks="[0]", extra='parent = ["spine0", "spine1"]')
     + entry("rack1", "127.0.0.1:5", "spine0", "[1]"),
     ["leaf 'rack1' is under 'spine0', but the roots are 'spine0', 'spine1': every leaf "
      "lists every root"]),
    (entry("spine0", "127.0.0.1:1") + entry("spine1", "127.0.0.1:2")
     + entry("rack0", "127.0.0.1:3", ranks="[0]", extra='parent = ["spine0", "spine1"]')
     + entry("rack1", "127.0.0.1:4", ranks="[1]", extra='parent = ["spine0", "spine1"]'),
     ["leaf 'rack0' serves tree 1 at 127.0.0.1:4, the address of 'rack1'"]),
    (entry("spine0", "127.0.0.1:1")
     + entry("rack0", "127.0.0.1:3", ranks="[0]", extra='parent = ["spine0", "spine0"]'),
     ["parent must be an aggregator's name, or a list of distinct roots' names"]),
])
def test_several_roots_that_are_no_set_of_trees_are_refused(tmp_path, text, words):
    refused(tmp_path, text, *words)


def test_the_roots_rates_are_each_trees_in_the_order_of_the_roots(tmp_path):
    """A root's mbit is its tree's rate (the call's first split); every root gives one or
    none does, and a leaf gives none."""
    rated = TWO_ROOTS.replace('name = "spine0"', 'name = "spine0"\nmbit = 400').replace(
        'name = "spine1"', 'name = "spine1"\nmbit = 100.5')
    assert Topology.parse(rated).tree_rates == (400.0, 100.5)
    assert Topology.parse(TWO_ROOTS).tree_rates is None
    refused(tmp_path, TWO_ROOTS.replace('name = "spine0"', 'name = "spine0"\nmbit = 400'),
            "mbit given for 'spine0' but not for every root")
    refused(tmp_path, TWO_LEVELS.replace('name = "rack0"', 'name = "rack0"\nmbit = 400'),
            "leaf 'rack0' gives mbit: a root's")


def test_an_installed_tree_names_every_target_and_its_links(tmp_path):
    """p4runtime on every aggregator makes the tree an installed one; a leaf's mac and
    ports are read; a target on some but not all, two roots, a root's link ports, or a
    malformed value are refused, named."""
    installed = (entry("spine", "10.0.0.254:47474", extra='p4runtime = "10.0.0.254:9559"\n'
                       'mac = "02:00:00:00:00:fe"')
                 + entry("rack0", "10.0.1.254:47474", "spine", "[0, 1]",
                         'p4runtime = "10.0.1.254:9559"\nuplink_port = 9\ndownlink_port = 3'))
    tree = Topology.parse(installed)
    assert tree.installed and not Topology.parse(TWO_LEVELS).installed
    rack0 = tree["rack0"]
    assert (rack0.p4runtime, rack0.uplink_port, rack0.downlink_port) == (
        "10.0.1.254:9559", 9, 3)
    assert tree["spine"].mac == "02:00:00:00:00:fe"
    refused(tmp_path, TWO_LEVELS.replace('name = "rack0"',
                                         'name = "rack0"\np4runtime = "127.0.0.1:9559"'),
            "p4runtime given for 'rack0' but not for every aggregator")
    two_roots = TWO_ROOTS
    for name in ("spine0", "spine1", "rack0", "rack1"):
        two_roots = two_roots.replace(f'name = "{name}"',
                                      f'name = "{name}"\np4runtime = "127.0.0.1:1"')
    refused(tmp_path, two_roots, "an installed tree (p4runtime) has one root")
    refused(tmp_path, installed.replace('mac = "02:00:00:00:00:fe"', "uplink_port = 1"),
            "the root 'spine' gives uplink_port or downlink_port: a leaf's")
    refused(tmp_path, installed.replace('"10.0.1.254:9559"', '"10.0.1.254"'),
            "p4runtime must be the P4Runtime target's 'host:port', got '10.0.1.254'")
    refused(tmp_path, installed.replace('"02:00:00:00:00:fe"', '"02:00"'),
            "mac must be 'aa:bb:cc:dd:ee:ff', got '02:00'")
    refused(tmp_path, installed.replace("uplink_port = 9", "uplink_port = 600"),
            "uplink_port must be a switch port, 0..511, got 600")
