"""ina_collectives.mpi.Intracomm is a drop-in for mpi4py's: same answers as MPI itself."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives.mpi import Intracomm
from tests.integration import mpirun, rank_cases


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 3, 4])
def test_every_buffer_form_matches_mpi(n):
    (first, *others) = results = mpirun.run(n, rank_cases.intracomm_forms)
    for r in results:
        for name in ("plain", "typed_max", "counted", "displaced", "in_place_prod",
                     "bytearray", "array.array", "complex", "longdouble", "maxloc_objects",
                     "user_op"):
            ours, mpis = r[name]
            np.testing.assert_allclose(np.asarray(ours), np.asarray(mpis), rtol=1e-12,
                                       err_msg=name)
        ours_objs, mpi_objs = r["objects"]
        assert ours_objs[0] == mpi_objs[0] == n * (n + 1) // 2
        assert ours_objs[1] == mpi_objs[1] == list(range(n))
        np.testing.assert_allclose(ours_objs[2], mpi_objs[2])
        assert isinstance(ours_objs[2], np.ndarray)
        np.testing.assert_array_equal(r["bool_land"], [True, n == 1])
        assert r["dup_type"] == "Intracomm"
        np.testing.assert_array_equal(r["dup_allreduce"], np.full(3, n, np.float32))
        assert r["inherited_bcast"] == "hello"
        # counted/displaced leave the rest of the receive buffer alone, like MPI
        assert (r["counted"][0][100:] == 0).all() and (r["displaced"][0][:20] == 0).all()
    stats = first["stats"]
    assert stats["engines"]["ring"] >= 6, stats
    assert stats["engines"].get("mpi", 0) >= 1, stats  # complex goes to MPI's reduction
    ours, package = first["summaries"]  # ic.ina_summary(), ina_collectives.summary()
    assert ours == package, (ours, package)
    assert ours.startswith(f"ina served 0 of {stats['calls']} calls (0% of "), ours
    assert f"{stats['engines']['ring']} took ring" in ours, ours
    assert "No switch configured" in ours, ours


@pytest.mark.mpi
def test_disagreeing_buffers_raise_on_every_rank():
    results = mpirun.run(2, rank_cases.intracomm_disagree)
    for r in results:
        assert r["error"] == "AgreementError", r
        assert "rank 0: 65 x float64" in r["message"] and "rank 1: 64 x float64" in r["message"]


@pytest.mark.parametrize("datatype", ["BYTE", "PACKED"])
def test_a_sum_of_untyped_bytes_is_refused_as_mpi_refuses_it(datatype):
    t = getattr(MPI, datatype)
    a, b = np.ones(8, np.uint8), np.zeros(8, np.uint8)
    with pytest.raises(MPI.Exception, match="not defined for this datatype"):
        MPI.COMM_SELF.Allreduce([a, t], [b, t], op=MPI.SUM)
    comm = Intracomm(MPI.COMM_SELF)  # a predefined communicator: never freed
    with pytest.raises(MPI.Exception, match="not defined for this datatype"):
        comm.Allreduce([a, t], [b, t], op=MPI.SUM)
    assert comm.ina_stats()["calls"] == 0  # handed to MPI, not reduced as bytes


def test_a_call_mpi_refuses_raises_its_error_and_the_communicator_goes_on():
    """MPI refuses a send buffer that is the receive buffer (not MPI.IN_PLACE) before
    anything starts: the caller gets MPI's own exception, as with mpi4py, and the next
    call works (mpi4py's test_cco_buf runs on after such a refusal)."""
    comm = Intracomm(MPI.COMM_SELF)
    a = np.arange(4, dtype=np.int32)
    with pytest.raises(MPI.Exception):
        comm.Allreduce([a, MPI.INT], [a, MPI.INT], MPI.SUM)
    out = np.empty_like(a)
    comm.Allreduce([a, MPI.INT], [out, MPI.INT], MPI.SUM)
    np.testing.assert_array_equal(out, a)
