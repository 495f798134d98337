"""ina_collectives/mpi.py's Intracomm without a launcher.

One rank: an Intracomm over a duplicate of MPI.COMM_SELF (mpi4py starts MPI as a
singleton), constructed as a program does. Several ranks: mpi4py's communicators cannot
be made over tests/threadcomm.py's, so each thread's Intracomm is one of COMM_SELF's
duplicates whose library state (the ``Collectives`` it makes at its first call, as it
does for the communicators mpi4py makes of its type without ``__init__``) is made over
the thread's ThreadPeers: its own code (buffer specs, in place, the checks, the choice
of engine or MPI) then runs at 3 ranks over the library's engines. What it hands to MPI
itself goes to COMM_SELF there, so only its agreement with the other ranks is checked
at several ranks; tests/integration/test_mpi_intracomm.py runs the whole under mpiexec.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives import mpi
from ina_collectives.collectives.chooser import Collectives
from ina_collectives.collectives.ops import Op
from ina_collectives.errors import AgreementError
from ina_collectives.ina.offload import ABSENT
from ina_collectives.mpi import Intracomm
from ina_collectives.settings import Settings
from tests.threadcomm import ThreadPeers, run_ranks


@pytest.fixture(autouse=True)
def _no_settings(monkeypatch):
    """No INA_* setting of the caller's (no switch), and the module's list of
    Intracomms this test's own."""
    for key in list(os.environ):
        if key.startswith("INA_"):
            monkeypatch.delenv(key)
    monkeypatch.setattr(mpi, "_made", [])


@pytest.fixture
def comm():
    made = Intracomm(MPI.COMM_SELF.Dup())
    try:
        yield made
    finally:
        made.Free()


# -- one rank, as a program makes it ------------------------------------------------------------

def test_allreduce_with_buffers_in_place_and_buffer_specs(comm):
    x = np.arange(6, dtype=np.float32)
    y = np.full_like(x, -1)
    comm.Allreduce(x, y)
    assert y.tolist() == x.tolist()
    z = np.array([3, -2, 7], np.int64)
    comm.Allreduce(MPI.IN_PLACE, z, MPI.MAX)
    assert z.tolist() == [3, -2, 7]
    a, b = np.full(4, 2.5), np.zeros(4)
    comm.Allreduce([a, MPI.DOUBLE], [b, MPI.DOUBLE])
    assert b.tolist() == [2.5] * 4
    counted = np.zeros(10, np.float32)
    comm.Allreduce([np.ones(10, np.float32), 4, MPI.FLOAT], [counted, 4, MPI.FLOAT])
    assert counted.tolist() == [1.0] * 4 + [0.0] * 6  # the rest left alone, as MPI's
    assert comm.ina_stats()["calls"] == 4
    assert comm.ina_summary().startswith("ina served 0 of 4 calls"), comm.ina_summary()


def test_what_the_engines_cannot_do_goes_to_mpi_itself(comm):
    x = np.array([1.0, 2.0], np.longdouble)
    y = np.zeros_like(x)
    comm.Allreduce(x, y)
    assert y.tolist() == [1.0, 2.0]
    pairs = comm.allreduce((3.0, 1), MPI.MAXLOC)  # objects: MPI's own reduction
    assert pairs == (3.0, 1)
    assert comm.allreduce(np.array([1, 2], np.int32)).tolist() == [1, 2]
    stats = comm.ina_stats()
    assert stats["engines"].get("mpi", 0) >= 1, stats


def test_a_communicator_duplicated_from_it_is_one_too(comm):
    dup = comm.Dup()
    try:
        assert type(dup) is Intracomm
        y = np.zeros(3, np.float32)
        dup.Allreduce(np.full(3, 4.0, np.float32), y)
        assert y.tolist() == [4.0] * 3 and dup.ina_stats()["calls"] == 1
    finally:
        dup.Free()


def test_mismatched_buffers_and_our_own_ops_are_refused_naming_what_is_wrong(comm):
    with pytest.raises(ValueError, match="mismatch in send and receive datatypes: sendbuf "
                                         "holds float32, recvbuf float64"):
        comm.Allreduce(np.ones(3, np.float32), np.empty(3, np.float64))
    with pytest.raises(ValueError, match="mismatch in send count 3 and receive count 4"):
        comm.Allreduce(np.ones(3, np.float32), np.empty(4, np.float32))
    with pytest.raises(ValueError, match="op AVERAGE is not defined for dtype uint8: the "
                                         "mean of integers is not an integer"):
        comm.Allreduce(bytearray(8), bytearray(8), Op.AVERAGE)
    strided = np.zeros(8)[::2]  # (not contiguous: not ours to reduce, and MPI has no mean)
    with pytest.raises(ValueError, match="op AVERAGE needs plain contiguous CPU buffers"):
        comm.Allreduce(np.ones(4), strided, Op.AVERAGE)
    with pytest.raises(ValueError, match="op AVERAGE takes numpy arrays of a supported "
                                         "dtype, got list"):
        comm.allreduce([1, 2], Op.AVERAGE)
    y = np.empty(2, np.float32)
    comm.Allreduce(np.ones(2, np.float32), y)  # the communicator still serves
    assert y.tolist() == [1.0, 1.0]


# -- three ranks, over the threads' peers ----------------------------------------------------

def on_intracomms(n, body):
    """``body(comm, rank)`` on n thread ranks, ``comm`` an Intracomm whose library state
    is over the thread's ThreadPeers (see the module's docstring); freed after."""
    def rank(peers):
        comm = Intracomm.__new__(Intracomm, MPI.COMM_SELF.Dup())
        comm._ina_state = Collectives(peers, Settings(switch="", timeout=3.0), None,
                                      ABSENT)
        try:
            return body(comm, peers.Get_rank())
        finally:
            comm.Free()
    return run_ranks(n, rank, timeout=60, kind=ThreadPeers)


def test_allreduce_over_three_ranks_with_buffers_in_place_and_our_average():
    def body(comm, r):
        x = np.arange(6, dtype=np.float32) + r
        y = np.empty_like(x)
        comm.Allreduce(x, y)
        z = np.full(4, r + 1, np.int64)
        comm.Allreduce(MPI.IN_PLACE, z, MPI.MAX)
        a, b = np.full(3, 2.0 * r), np.empty(3)
        comm.Allreduce([a, MPI.DOUBLE], [b, MPI.DOUBLE], Op.AVERAGE)
        counted = np.zeros(5, np.int32)
        comm.Allreduce([np.full(5, r, np.int32), 2, MPI.INT], [counted, 2, MPI.INT],
                       MPI.MIN)
        objects = comm.allreduce(np.array([r, 10 * r], np.int32))
        return (y.tolist(), z.tolist(), b.tolist(), counted.tolist(), objects.tolist(),
                comm.ina_stats()["calls"])

    expected = ((np.arange(6) * 3 + 3).tolist(), [3] * 4, [2.0] * 3, [0, 0, 0, 0, 0],
                [3, 30], 5)
    assert on_intracomms(3, body) == [expected] * 3


def test_an_allreduce_of_another_length_fails_on_every_rank_naming_each():
    def body(comm, r):
        x = np.ones(3 + r, np.float32)
        with pytest.raises(AgreementError) as failed:
            comm.Allreduce(x, np.empty_like(x))
        y = np.empty(2, np.float32)
        comm.Allreduce(np.full(2, float(r), np.float32), y)  # the next call meets
        return str(failed.value), y.tolist()

    for message, y in on_intracomms(3, body):
        assert "ranks disagree on the length of allreduce #1: rank 0: 3 x float32 SUM; " \
               "rank 1: 4 x float32 SUM; rank 2: 5 x float32 SUM" in message, message
        assert y == [3.0, 3.0]


def test_a_call_handed_to_mpi_on_one_rank_alone_fails_on_every_rank():
    def body(comm, r):
        dtype = np.longdouble if r == 0 else np.float64  # (long double: MPI's alone)
        x = np.ones(3, dtype)
        with pytest.raises(AgreementError) as failed:
            comm.Allreduce(x, np.empty_like(x))
        return str(failed.value)

    for message in on_intracomms(3, body):
        assert "Allreduce handed to MPI" in message, message
        assert "rank 1: 3 x float64 SUM" in message, message
