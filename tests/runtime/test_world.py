"""runtime/world.py at 3 ranks in one process (tests/threadcomm.py: ThreadPeers, whose
ranks are threads of one node): the world ``open`` makes (its topology, the global
set's runtime), process sets added and removed collectively with a runtime of their own
on their members alone, the ranks' checks that they agree (a mismatch is a ValueError on
every rank, naming each rank's values), the sets given at init, and a communicator
``start`` cannot take."""
from __future__ import annotations

import numpy as np
import pytest

from ina_collectives.runtime import world as world_module
from ina_collectives.runtime.world import ProcessSet, World, global_process_set
from ina_collectives.settings import Settings
from tests.runtime.test_background import allreduce
from tests.threadcomm import RankFailed, ThreadPeers, run_ranks

SETTINGS = Settings(switch="", timeout=5.0, cycle_time=0.001)


def on_world(n: int, body):
    """``body(world, rank)`` on n ranks, each with the World ``open`` made over its
    communicator (closed after, on every rank); the results by rank."""
    def rank(comm):
        world = World.open(comm, SETTINGS)
        try:
            return body(world, comm.Get_rank())
        finally:
            world.close()
    return run_ranks(n, rank, timeout=60, kind=ThreadPeers)


def value_error(call) -> str:
    with pytest.raises(ValueError) as refused:
        call()
    return str(refused.value)


def test_open_gives_one_nodes_topology_and_the_global_sets_runtime():
    def body(world, r):
        topology = (world.rank, world.size, world.local_rank, world.local_size,
                    world.cross_rank, world.cross_size, world.homogeneous)
        member = world.member(global_process_set, "allreduce")
        world.agree("a check", [1, 2])
        return topology, member.ranks, allreduce(member.runtime, "x",
                                                 np.full(3, r, np.int64)).tolist()

    for r, (topology, ranks, total) in enumerate(on_world(3, body)):
        assert topology == (r, 3, r, 3, 0, 1, True)
        assert ranks == (0, 1, 2) and total == [3] * 3


def test_a_set_added_runs_on_its_members_alone_and_is_removed_collectively():
    def body(world, r):
        ps = world.add([0, 2])
        out = {"id": ps.process_set_id, "ranks": ps.ranks}
        if r in (0, 2):
            member = world.member(ps, "allreduce")
            out["sum"] = allreduce(member.runtime, "in set", np.full(2, r + 1.0)).tolist()
            out["names"] = [member.next_name("allreduce") for _ in range(2)]
        else:
            out["outside"] = value_error(lambda: world.member(ps, "allreduce"))
        out["removed"] = world.remove(ps), ps.process_set_id, world.remove(ps)
        out["after"] = value_error(lambda: world.member(ps, "allreduce"))
        out["global"] = world.remove(global_process_set)
        return out

    results = on_world(3, body)
    for r, out in enumerate(results):
        assert (out["id"], out["ranks"]) == (1, [0, 2])
        assert out["removed"] == (True, None, False) and out["global"] is False
        assert "is not registered" in out["after"], out["after"]
        if r == 1:
            assert out["outside"] == ("allreduce: rank 1 is not in ProcessSet("
                                      "process_set_id=1, ranks=[0, 2], mpi_comm=None)")
        else:
            assert out["sum"] == [4.0, 4.0]
            assert out["names"] == ["allreduce.noname.0", "allreduce.noname.1"]


def test_ranks_that_add_different_sets_all_get_a_value_error_naming_each_ranks():
    def body(world, r):
        differ = value_error(lambda: world.add([0, 1] if r != 2 else [0, 2]))
        world.add([0, 1])
        again = value_error(lambda: world.add([1, 0]))
        return differ, again, world.sets.keys() == {0, 1}

    for differ, again, kept in on_world(3, body):
        assert differ == ("add_process_set: ranks disagree (rank 0: [0, 1], rank 1: "
                          "[0, 1], rank 2: [0, 2])")
        assert again.startswith("Attempted to add a duplicate process set"), again
        assert kept


def test_ranks_out_of_the_world_or_twice_and_a_set_of_another_type_are_refused():
    def body(world, r):
        with pytest.raises(TypeError, match="process_set must be a ProcessSet"):
            world.member([0, 1], "broadcast")
        return [value_error(lambda: world.add(ranks)) for ranks in ([0, 0], [1, 3], [])]

    for errors in on_world(2, body):
        assert errors == [f"add_process_set: ranks {ranks} must be distinct and in 0..1"
                          for ranks in ([0, 0], [1, 3], [])]


def test_sets_given_at_init_as_lists_are_registered_and_a_list_that_differs_is_named():
    def body(world, r):
        given = [ProcessSet([0, 1]), ProcessSet([1, 2])]
        world.register_at_init(given)
        ids = [ps.process_set_id for ps in given]
        differ = value_error(lambda: world.register_at_init(
            [ProcessSet([0, 2] if r == 1 else [1, 2])]))
        return ids, differ

    for ids, differ in on_world(3, body):
        assert ids == [1, 2]
        assert differ == ("init(process_sets=...): set 0 differs between ranks: rank 0: "
                          "[1, 2], rank 1: [0, 2], rank 2: [1, 2]")


def test_a_rank_that_stops_fails_the_others_check_within_the_runtimes_bound():
    """A collective check goes through the global runtime: a rank that stops makes the
    others' add_process_set fail (its negotiation timed out), not hang."""
    def rank(comm):
        world = World.open(comm, Settings(switch="", timeout=1.0, cycle_time=0.001))
        if comm.Get_rank() == 1:
            comm.stop()  # (and so every communicator made from it: the runtime's)
            return None
        try:
            world.add([0, 1])
        finally:
            world.runtime.shutdown(5)

    with pytest.raises(RankFailed, match="rank 0 raised CollectiveTimeout: waited 1 s "):
        run_ranks(2, rank, timeout=30, kind=ThreadPeers)


def test_start_refuses_what_is_not_a_communicator_and_leaves_nothing_open():
    with pytest.raises(TypeError, match="init\\(comm=...\\) takes None, a list of ranks"):
        world_module.start("world", settings=SETTINGS)
    with pytest.raises(ValueError, match="ranks must be distinct"):
        world_module.start([0, 0], settings=SETTINGS)
    assert world_module.current() is None
    with pytest.raises(ValueError, match="ProcessSet takes a list of int ranks"):
        ProcessSet([0, True])
    with pytest.raises(ValueError, match="or an mpi4py communicator, got str"):
        ProcessSet("0,1")
