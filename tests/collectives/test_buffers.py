"""mpi4py buffer specifications as 1-D NumPy views (ina_collectives.collectives.buffers):
every form mpi4py accepts, and what is left to MPI (None)."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives.collectives import buffers


def same_memory(view, array, start=0):
    return view.ctypes.data == array.ctypes.data + start * array.itemsize


def test_a_plain_array_is_all_its_elements():
    a = np.arange(6, dtype=np.float32)
    view = buffers.parse(a, writable=True)
    assert view.dtype == np.float32 and view.size == 6 and same_memory(view, a)


def test_in_place_and_none_mean_in_place():
    assert buffers.parse(MPI.IN_PLACE, writable=False) is buffers.IN_PLACE
    assert buffers.parse(None, writable=False) is buffers.IN_PLACE


@pytest.mark.parametrize("spec_of, dtype, count, start", [
    (lambda a: [a, MPI.INT32_T], np.int32, 8, 0),            # [buf, datatype]
    (lambda a: [a, "f"], np.float32, 8, 0),                  # datatype as a typecode
    (lambda a: [a, 3, MPI.INT32_T], np.int32, 3, 0),         # [buf, count, datatype]
    (lambda a: [a, (3, 2), MPI.INT32_T], np.int32, 3, 2),    # [buf, (count, displ), dt]
    (lambda a: [a, 3, 2, MPI.INT32_T], np.int32, 3, 2),      # [buf, count, displ, dt]
    (lambda a: [a, 5], np.int32, 5, 0),                      # [buf, count]
    (lambda a: (a, (2, 1)), np.int32, 2, 1),                 # [buf, (count, displ)]
    (lambda a: [a, MPI.FLOAT], np.float32, 8, 0),            # a reinterpretation
])
def test_every_spec_form(spec_of, dtype, count, start):
    a = np.arange(8, dtype=np.int32)
    view = buffers.parse(spec_of(a), writable=True)
    assert view.dtype == np.dtype(dtype) and view.size == count
    assert same_memory(view, a, start)


def test_bytes_and_memoryviews_are_read_by_their_format():
    view = buffers.parse(memoryview(np.ones(4, np.float64)), writable=False)
    assert view.dtype == np.float64 and view.size == 4
    raw = buffers.parse([bytearray(12), MPI.INT32_T], writable=True)
    assert raw.dtype == np.int32 and raw.size == 3


@pytest.mark.parametrize("why, spec_of, writable", [
    ("not contiguous", lambda: np.arange(10.0)[::2], False),
    ("read-only but written", lambda: np.frombuffer(b"\0" * 16, np.float32), True),
    ("a derived datatype", lambda: [np.zeros(8, np.int32), MPI.INT32_T.Create_contiguous(2)],
     True),
    ("more elements than the buffer holds", lambda: [np.zeros(4, np.int32), 5,
                                                     MPI.INT32_T], True),
    ("a negative displacement", lambda: [np.zeros(4, np.int32), (2, -1), MPI.INT32_T],
     True),
    ("bytes that are no whole element", lambda: [bytearray(10), MPI.INT32_T], True),
    ("a structured dtype", lambda: np.zeros(3, [("a", "i4"), ("b", "f8")]), True),
    ("a spec of five items", lambda: [np.zeros(4), 1, 2, 3, MPI.DOUBLE], True),
    ("count and displacement past the end", lambda: [np.zeros(8, np.int32), (3, 6),
                                                     MPI.INT32_T], True),
    ("a negative count", lambda: [np.zeros(4, np.int32), -1, MPI.INT32_T], True),
    ("bytes (read-only) to be written", lambda: bytes(16), True),
    ("a datatype NumPy lacks", lambda: [np.zeros(4, np.int32), MPI.DATATYPE_NULL], True),
    ("an unknown typecode", lambda: [np.zeros(4, np.int32), "not a type"], True),
    ("not a buffer at all", lambda: [object(), MPI.INT32_T], False),
])
def test_what_only_mpi_can_take_is_left_to_it(why, spec_of, writable):
    spec = spec_of()
    try:
        assert buffers.parse(spec, writable=writable) is None, why
    finally:
        if isinstance(spec, list) and isinstance(spec[-1], MPI.Datatype) \
                and not spec[-1].is_predefined:
            spec[-1].Free()


def test_read_only_input_is_fine_when_only_read():
    ro = np.frombuffer(b"\0" * 16, np.float32)
    assert buffers.parse(ro, writable=False).size == 4


def test_the_view_is_the_callers_memory_up_to_the_last_element():
    a = np.zeros(8, np.int32)
    view = buffers.parse([a, 2, 6, MPI.INT32_T], writable=True)  # exactly to the end
    view[:] = [7, 9]
    assert a.tolist() == [0, 0, 0, 0, 0, 0, 7, 9]
    assert buffers.parse((a, 3, MPI.INT32_T), writable=True).size == 3  # a tuple spec
    assert buffers.parse([a, 0, MPI.INT32_T], writable=True).size == 0  # nothing: fine
    assert buffers.parse(bytes(16), writable=False).dtype == np.uint8
