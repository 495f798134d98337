"""What each rank of a test job of the array API and the mpi4py API runs: rank functions of
(comm, params), each run on every rank as a test names it
(``mpirun.run(3, rank_cases.ina_cases, params)``, tests/integration/mpirun.py); its return
value, or the exception it raised, is pickled for the test to check.
"""
from __future__ import annotations

import array
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

import ina_collectives as ina
from ina_collectives.mpi import Intracomm
from tests.inputs import make_input
from tests.integration.mpirun import error


def allreduce_cases(comm: MPI.Intracomm, p: dict) -> list[Any]:
    """Each of p["cases"] (dtype, op, count, seed) through ina.allreduce."""
    ina.init(comm, **p.get("settings", {}))
    results = []
    for dtype, op, count, seed in p["cases"]:
        x = make_input(dtype, op, count, seed, comm.rank)
        try:
            results.append(ina.allreduce(x, op=op))
        except Exception as exc:  # recorded for the test to judge
            results.append(error(exc))
    stats = ina.stats()
    ina.finalize()
    return {"results": results, "stats": stats}


def ina_cases(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """allreduce_cases through the aggregator (INA_SWITCH in the environment), repeated
    p["rounds"] times so that slot versions carry over between calls."""
    ina.init(comm, **p.get("settings", {}))
    results = []
    for _ in range(p.get("rounds", 1)):
        for dtype, op, count, seed in p["cases"]:
            x = make_input(dtype, op, count, seed, comm.rank)
            results.append(ina.allreduce(x, op=op))
    stats = ina.stats()
    ina.finalize()
    return {"results": results, "stats": stats}


def shares_before_and_after(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """Each aggregator's share of a call before any call measured them, then after
    p["cases"] through ina.allreduce."""
    ina.init(comm, **p.get("settings", {}))
    before = [a["share"] for a in ina.stats()["switch"]["aggregators"]]
    results = [ina.allreduce(make_input(dtype, op, count, seed, comm.rank), op=op)
               for dtype, op, count, seed in p["cases"]]
    stats = ina.stats()
    ina.finalize()
    return {"before": before, "results": results, "stats": stats}


def across_hosts(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """ina_cases' calls on ranks of several hosts, in two halves: between them rank 0
    writes p["dir"]/joined and every rank waits (bounded) for p["dir"]/stray (the test
    sends a stray packet to the job meanwhile). Also: this rank's network namespace."""
    ina.init(comm, **p.get("settings", {}))
    results = []
    for half in (0, 1):
        for dtype, op, count, seed in p["cases"]:
            x = make_input(dtype, op, count, seed, comm.rank)
            results.append(ina.allreduce(x, op=op))
        if half == 0:
            if comm.rank == 0:
                (Path(p["dir"]) / "joined").write_text("")
            deadline = time.monotonic() + 60
            while not (Path(p["dir"]) / "stray").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError("waited 60 s for the test's stray packet")
                time.sleep(0.05)
            comm.Barrier()
    stats = ina.stats()
    ina.finalize()
    return {"results": results, "stats": stats, "netns": os.readlink("/proc/self/ns/net")}


def quorum_calls(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """p["steps"]: [(quorum or None, dtype, op, count, seed)]: set_quorum(quorum) first
    unless None, then one allreduce; each call's result and stats()["switch"]["quorum"]
    ["last_call"]. p["until_quorum"]: repeat the steps until this many calls in a row ran
    in quorum mode (a mode the control plane asks for meanwhile), at most p["max_calls"]."""
    ina.init(comm, **p.get("settings", {}))
    results, calls = [], []
    in_a_row = 0
    while True:
        for k, dtype, op, count, seed in p["steps"]:
            if k is not None:
                ina.set_quorum(k)
            x = make_input(dtype, op, count, seed, comm.rank)
            results.append(ina.allreduce(x, op=op))
            last = ina.stats()["switch"]["quorum"]["last_call"]
            calls.append(dict(last, counted_flag=ina.last_call_counted()))
            in_a_row = in_a_row + 1 if last["quorum"] else 0
        if (not p.get("until_quorum") or in_a_row >= p["until_quorum"]
                or len(calls) >= p.get("max_calls", 0)):
            break
    stats = ina.stats()
    ina.finalize()
    return {"results": results, "calls": calls, "stats": stats}


def ina_nan(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """A NaN on one rank and an Inf on another (at p["at"] and 2 further, of p["size"]
    values of p["dtype"]): the exact path, chosen for this call; then a clean call."""
    ina.init(comm, switch_min_bytes=0)
    x = np.ones(p.get("size", 100_000), p.get("dtype", "float32"))
    x[p.get("at", 7) + 2 * comm.rank] = [np.nan, np.inf][comm.rank % 2]
    out = {"result": ina.allreduce(x), "stats": ina.stats()}
    out["after"] = ina.allreduce(np.ones(x.size, x.dtype))
    out["after_engine"] = ina.stats()["last_call"]["engine"]
    ina.finalize()
    return out


def ina_switch_dies_after_the_last_result(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """A sync call's results reach rank 0, which returns and SIGKILLs the switch; rank 1's
    never arrive (its socket takes datagrams from a dead address only, from the second
    call's stream on). Rank 1 must return the bits rank 0 returned, from rank 0's kept window,
    when rank 0 reaches its next gate: p["then"] "call" (a third allreduce) or
    "finalize". p["predicted"]: the first call's input is the second's, so that the
    second goes predicted (no opening: rank 1 hears nothing of it) and its prediction
    holds; else every call opens (switch_predict off)."""
    import signal
    ina.init(comm, switch_min_bytes=0, switch_silence=1.5, timeout=30,
             switch_predict=bool(p.get("predicted")))
    count = p["count"]
    x = np.arange(count, dtype=np.float32) * (comm.rank + 1)
    first = ina.allreduce(x.copy() if p.get("predicted")
                          else np.full(count, 1.0 + comm.rank, np.float32))
    served_first = ina.stats()["last_call"]["engine"]
    if comm.rank == 1:
        deaf_from_the_stream(ina._state.offload.link)
    comm.barrier()
    start = time.monotonic()
    second = ina.allreduce(x)
    seconds = time.monotonic() - start
    out: dict[str, Any] = {"first": first, "served_first": served_first, "second": second,
                           "second_engine": ina.stats()["last_call"]["engine"],
                           "seconds": seconds}
    if comm.rank == 0:
        os.kill(p["switch_pid"], signal.SIGKILL)
    if p["then"] == "call":
        out["third"] = ina.allreduce(np.full(count, 2.0, np.float32))
        out["third_engine"] = ina.stats()["last_call"]["engine"]
    out["switch"] = ina.stats()["switch"]
    start = time.monotonic()
    ina.finalize()
    out["finalize_seconds"] = time.monotonic() - start
    return out


def deaf_from_the_stream(link: Any) -> None:
    """From the link's next stream on, results no longer reach its socket (it takes
    datagrams from a dead address only); the call's opening, before the stream, still
    gets through."""
    plain = link.stream

    def deaf_stream(*args: Any, **kwargs: Any) -> Any:
        link.sock.connect(("127.0.0.1", _closed_udp_port()))
        return plain(*args, **kwargs)
    link.stream = deaf_stream


def _closed_udp_port() -> int:
    import socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ina_switch_dies(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """Rank 0 SIGKILLs the switch p["kill_after"] s into the second of three calls."""
    import signal
    import threading
    ina.init(comm, **p.get("settings", {}))
    out: dict[str, Any] = {"results": []}
    for i, (dtype, op, count, seed) in enumerate(p["cases"]):
        x = make_input(dtype, op, count, seed, comm.rank)
        if i == 1 and comm.rank == 0:
            threading.Timer(p["kill_after"], os.kill, (p["switch_pid"], signal.SIGKILL)).start()
        start = time.monotonic()
        out["results"].append(ina.allreduce(x, op=op))
        out.setdefault("seconds", []).append(time.monotonic() - start)
        out.setdefault("engines", []).append(ina.stats()["last_call"])
    out["stats"] = ina.stats()
    ina.finalize()
    return out


def ina_switch_restarts(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """One call through the switch; the test kills it; one call (handed to the ring) and
    p["outage"] more on the ring; the test starts a switch again at the same address;
    p["after"] more calls, which return to it, each after p["pause"] seconds (a training
    step's compute). Rank 0 and the test hand over through files in p["dir"]."""
    ina.init(comm, **p.get("settings", {}))
    flags = Path(p["dir"])

    def step(done: str, wait_for: str) -> None:
        if comm.rank == 0:
            (flags / done).touch()
            deadline = time.monotonic() + 60
            while not (flags / wait_for).exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the test never wrote {wait_for}")
                time.sleep(0.05)
        comm.barrier()

    dtype, op, count = p["case"]
    out: dict[str, Any] = {"results": [], "engines": []}
    outage = p.get("outage", 0)
    for i in range(2 + outage + p["after"]):
        if i == 1:
            step("served", "killed")
        elif i == 2 + outage:
            step("failed", "restarted")
        if i >= 2 + outage:
            time.sleep(p.get("pause", 0.0))
        x = make_input(dtype, op, count, 100 + i, comm.rank)
        out["results"].append(ina.allreduce(x, op=op))
        out["engines"].append(ina.stats()["last_call"]["engine"])
    out["stats"] = ina.stats()
    ina.finalize()
    return out


def restarts_among_mpi_calls(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """A training loop as the restart issue ran it, until the test writes "stop" in
    p["dir"]: before each library call the ranks run MPI's own Allreduce on the
    communicator, after it an allreduce of a flag (rank 0's "stop"); p["pause"] seconds
    of compute between calls. Rank 0 writes "served" after the first call the switch
    served. Each call: its start (time.monotonic(), one clock for every process here),
    its engine, and whether its result is right (within the bound through the switch,
    exact otherwise); the digest of every result, for the ranks to be compared."""
    import hashlib

    from tests.inputs import check_result, check_within_bound

    ina.init(comm, **p.get("settings", {}))
    flags = Path(p["dir"])
    dtype, op, count = p["case"]
    out: dict[str, Any] = {"starts": [], "engines": [], "wrong": [], "digest": []}
    own = np.empty(4, np.float64)
    i = 0
    while True:
        comm.Allreduce(np.full(4, comm.rank, np.float64), own, op=MPI.SUM)
        x = make_input(dtype, op, count, 100 + i % 50, comm.rank)
        out["starts"].append(time.monotonic())
        y = ina.allreduce(x, op=op)
        stats = ina.stats()
        engine = stats["last_call"]["engine"]
        out["engines"].append(engine)
        out["digest"].append(hashlib.sha1(y.tobytes()).hexdigest())
        try:
            if engine == "ina":  # (K: the packets' values, as the path's MTU sized them)
                check_within_bound(y, dtype, op, count, 100 + i % 50, comm.size,
                                   k=stats["switch"]["elements"])
            else:
                check_result(y, dtype, op, count, 100 + i % 50, comm.size)
        except AssertionError as exc:
            out["wrong"].append((i, engine, str(exc)[:200]))
        if comm.rank == 0 and engine == "ina" and not (flags / "served").exists():
            (flags / "served").touch()
        stop = comm.allreduce(int(comm.rank == 0 and (flags / "stop").exists()), op=MPI.MAX)
        i += 1
        if stop or i > 100_000:
            break
        time.sleep(p.get("pause", 0.0))
    out["stats"] = ina.stats()
    ina.finalize()
    return out


def stuck_in_a_wait(comm: MPI.Intracomm, p: dict) -> None:
    """Rank 0 waits (bounded, 600 s) for a message no rank sends; the others wait at a
    barrier for rank 0: a hang for the test to kill for time."""
    from ina_collectives.collectives.waiting import Deadline, dump_on_signal, wait

    dump_on_signal()
    if comm.rank == 0:
        wait(comm.Irecv(np.empty(1), source=1, tag=99), Deadline(600),
             lambda: "rank 1's message with tag 99 (never sent)")
    comm.Barrier()


def paced_calls(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """p["calls"] allreduces of p["case"] (dtype, op, count), call i with seed 100 + i.
    Before call i, for each p["pauses"][str(i)] = name: rank 0 writes ``name`` in p["dir"]
    and waits (bounded) for the test to write ``name.go``; then every rank goes on; p["pause"]
    seconds between calls (a step's compute). Each call's result and engine, the stats,
    and the library's log records."""
    import logging

    class Kept(logging.Handler):  # the library's warnings, for the test's messages
        def emit(self, record: logging.LogRecord) -> None:
            out["log"].append(record.getMessage())

    out: dict[str, Any] = {"results": [], "engines": [], "log": []}
    logging.getLogger("ina_collectives").addHandler(Kept(logging.INFO))
    ina.init(comm, **p.get("settings", {}))
    flags = Path(p.get("dir", "."))
    dtype, op, count = p["case"]
    for i in range(p["calls"]):
        name = p.get("pauses", {}).get(str(i))
        if name:
            if comm.rank == 0:
                (flags / name).touch()
                deadline = time.monotonic() + 60
                while not (flags / f"{name}.go").exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the test never wrote {name}.go")
                    time.sleep(0.02)
            comm.barrier()
        if i:
            time.sleep(p.get("pause", 0.0))  # a training step's compute
        x = make_input(dtype, op, count, 100 + i, comm.rank)
        out["results"].append(ina.allreduce(x, op=op))
        out["engines"].append(ina.stats()["last_call"]["engine"])
        switch = ina.stats().get("switch") or {}
        out.setdefault("quorum", []).append(
            (switch.get("quorum") or {}).get("last_call", {}).get("quorum"))
    out["stats"] = ina.stats()
    ina.finalize()
    return out


class CountingComm(MPI.Intracomm):
    """An intracommunicator that counts the MPI operations made on it and on its
    duplicates (every method but local queries), in ``calls`` shared by all of them."""
    LOCAL = frozenset({"Get_size", "Get_rank", "Get_group", "Get_name", "Get_topology",
                       "Is_inter", "Is_intra", "Get_attr", "Set_attr", "Get_errhandler",
                       "Set_errhandler", "Get_info", "Free", "Dup", "py2f", "f2py",
                       "size", "rank", "group", "name", "topology", "is_inter", "is_intra",
                       "info", "handle", "Set_name", "Free_keyval"})

    def __new__(cls, comm: MPI.Intracomm | None = None,
                calls: dict | None = None) -> "CountingComm":
        # (mpi4py makes a duplicate as type(comm)(), then fills its handle)
        self = super().__new__(cls) if comm is None else super().__new__(cls, comm)
        self.__dict__["calls"] = {} if calls is None else calls
        return self

    def Dup(self, *args: Any) -> "CountingComm":
        return CountingComm(MPI.Intracomm.Dup(self, *args), self.calls)

    def __getattribute__(self, name: str) -> Any:
        value = super().__getattribute__(name)
        if callable(value) and not name.startswith("_") and name not in CountingComm.LOCAL:
            calls = super().__getattribute__("__dict__")["calls"]
            calls[name] = calls.get(name, 0) + 1
        return value


def mpi_calls_per_call(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """p["calls"] allreduces of p["count"] float32 after one to start the job: the MPI
    operations each made on the library's communicator, its engine, and the stats."""
    counting = CountingComm(comm)
    ina.init(counting, **p.get("settings", {}))
    ina.allreduce(np.ones(p["count"], np.float32))
    per_call, engines, results = [], [], []
    for i in range(p["calls"]):
        before = dict(counting.calls)
        x = make_input("float32", "sum", p["count"], 200 + i, comm.rank)
        results.append(ina.allreduce(x))
        per_call.append({k: v - before.get(k, 0) for k, v in counting.calls.items()
                         if v != before.get(k, 0)})
        engines.append(ina.stats()["last_call"]["engine"])
    out = {"mpi": per_call, "engines": engines, "results": results, "stats": ina.stats()}
    ina.finalize()
    return out


def ina_interrupted(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """Rank 0 gets SIGINT (Ctrl-C) while a slow call streams through the switch: it must
    raise KeyboardInterrupt at once; the other ranks a clear error within the bound."""
    import signal
    import threading
    ina.init(comm, **p.get("settings", {}))
    ina.allreduce(np.ones(1000, np.float32))  # the job is live at the switch
    comm.barrier()
    x = np.ones(p["count"], np.float32)
    sent = {}
    if comm.rank == 0:
        def interrupt() -> None:
            sent["at"] = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)
        threading.Timer(p["interrupt_after"], interrupt).start()
    start = time.monotonic()
    try:
        ina.allreduce(x)
        result: Any = "no error"
    except BaseException as exc:  # KeyboardInterrupt here, CollectiveTimeout on the others
        result = error(exc)
    ended = time.monotonic()
    return {"abandoned": True, "error": result, "seconds": ended - start,
            "after_signal": ended - sent["at"] if "at" in sent else None}


def ina_worker_dies(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """The last rank freezes (SIGSTOP) during a stream of calls: to the switch and its
    peers it is dead. The others must raise within the bound, naming the wait; rank 0
    then SIGKILLs it. (A SIGKILLed rank makes MPICH's Hydra end the whole job itself.)"""
    import signal
    import threading
    ina.init(comm, **p.get("settings", {}))
    pids = comm.allgather(os.getpid())
    x = np.ones(p["count"], np.float32)
    ina.allreduce(x)  # one good call: the job is live at the switch
    if comm.rank == comm.size - 1:
        threading.Timer(p["stop_after"], os.kill, (os.getpid(), signal.SIGSTOP)).start()
    start = time.monotonic()
    try:
        for _ in range(100000):
            ina.allreduce(x)
        result: Any = "no error"
    except Exception as exc:
        result = error(exc)
    return {"abandoned": True, "error": result, "seconds": time.monotonic() - start,
            "ranks_alive": comm.size - 1, "kill": pids[-1] if comm.rank == 0 else None}


def layouts(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """In place, out=, non-contiguous and Fortran-ordered inputs and outputs; ranks use
    different layouts for the same logical array."""
    ina.init(comm, ring_min_bytes=0)
    rng = np.random.default_rng([7, comm.rank])
    base = rng.standard_normal((6, 10)).astype(np.float32)
    out: dict[str, Any] = {"base": base}
    out["new"] = ina.allreduce(base)
    same = base.copy()
    ina.allreduce(same, out=same)
    out["in_place"] = same
    fortran = np.asfortranarray(base) if comm.rank % 2 else base.copy()
    out["fortran"] = ina.allreduce(fortran, out=fortran).copy()
    strided_in = np.zeros((6, 20), np.float32)
    strided_in[:, ::2] = base
    out["strided_in"] = ina.allreduce(strided_in[:, ::2])
    target = np.zeros((12, 10), np.float32)
    ina.allreduce(base, out=target[::2])
    out["strided_out"] = target[::2].copy()
    out["strided_out_untouched"] = target[1::2].copy()
    out["scalar"] = ina.allreduce(np.float64(comm.rank))
    out["list"] = ina.allreduce([1, 2, 3])
    ina.finalize()
    return out


def intracomm_forms(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """Every buffer form of Allreduce, the object allreduce, and the calls handed to MPI,
    each beside MPI's own answer for the same input."""
    ic = Intracomm(comm, ring_min_bytes=0)
    r = comm.rank
    x = (np.arange(1000, dtype=np.float64) + 1) * (r + 1)
    out: dict[str, Any] = {}

    def both(name: str, run: Callable[[Any], Any]) -> None:
        out[name] = (run(ic), run(comm))

    def plain(c):
        y = np.empty_like(x); c.Allreduce(x, y); return y
    both("plain", plain)

    def typed(c):
        y = np.empty_like(x); c.Allreduce([x, MPI.DOUBLE], [y, MPI.DOUBLE], op=MPI.MAX); return y
    both("typed_max", typed)

    def counted(c):
        y = np.zeros_like(x); c.Allreduce([x, 100, MPI.DOUBLE], [y, 100, MPI.DOUBLE]); return y
    both("counted", counted)

    def displaced(c):
        y = np.zeros_like(x)
        c.Allreduce([x, (50, 10), MPI.DOUBLE], [y, (50, 20), MPI.DOUBLE], op=MPI.MIN)
        return y
    both("displaced", displaced)

    def in_place(c):
        y = x.copy(); c.Allreduce(MPI.IN_PLACE, y, op=MPI.PROD); return y
    both("in_place_prod", in_place)

    def bytearray_form(c):
        src = bytearray(np.arange(16, dtype=np.int32).tobytes())
        dst = bytearray(64)
        c.Allreduce([src, MPI.INT], [dst, MPI.INT])
        return np.frombuffer(dst, np.int32).copy()
    both("bytearray", bytearray_form)

    def array_form(c):
        src = array.array("d", [1.5, 2.5, r]); dst = array.array("d", [0, 0, 0])
        c.Allreduce(src, dst); return list(dst)
    both("array.array", array_form)

    def complex_form(c):  # handed to MPI by the engines (not the ring)
        y = np.empty(8, np.complex128); c.Allreduce(np.full(8, 1 + 2j * r), y); return y
    both("complex", complex_form)

    def longdouble(c):  # handed to MPI.Intracomm itself
        y = np.empty(4, np.longdouble); c.Allreduce(np.full(4, r, np.longdouble), y); return y
    both("longdouble", longdouble)

    def maxloc(c):
        return c.allreduce((float(r % 2), r), op=MPI.MAXLOC)  # (value, rank) pairs
    both("maxloc_objects", maxloc)

    def user_op(c):
        op = MPI.Op.Create(lambda a, b, dt: np.maximum(
            np.frombuffer(a, np.float64), np.frombuffer(b, np.float64),
            out=np.frombuffer(b, np.float64)), commute=True)
        try:
            y = np.empty(3); c.Allreduce(np.array([r, -r, 2.0 * r]), y, op=op); return y
        finally:
            op.Free()
    both("user_op", user_op)

    def objects(c):
        return c.allreduce(r + 1), c.allreduce([r]), c.allreduce(x[:5], op=MPI.SUM)
    both("objects", objects)

    out["bool_land"] = (lambda y: (ic.Allreduce(np.array([True, r == 0]), y, op=MPI.LAND),
                                   y)[1])(np.empty(2, bool))
    out["dup_type"] = type(ic.Dup()).__name__
    dup = ic.Dup()
    z = np.empty(3, np.float32)
    dup.Allreduce(np.full(3, 1.0, np.float32), z)
    out["dup_allreduce"] = z
    dup.Free()
    out["inherited_bcast"] = ic.bcast("hello" if r == 0 else None, root=0)
    out["stats"] = ic.ina_stats()
    out["summaries"] = (ic.ina_summary(), ina.summary())  # (no ina.init(): ic's)

    return out


def disagree(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """The last rank passes a different length, dtype or op; then a good call follows, which
    must still work (an agreement error leaves the communicator usable). p["known"]: the
    lengths every rank reduces first (float32 SUM), so that a call of such a length goes
    predicted (docs/protocol.md, One round trip): a rank's predicted packets then meet
    another's opening, or its predicted packets of another identity."""
    ina.init(comm, **{"ring_min_bytes": 0, "timeout": 30, **p.get("settings", {})})
    for known in p.get("known", []):
        ina.allreduce(np.ones(known, np.float32))
    last = comm.rank == comm.size - 1
    count, dtype, op = 100, "float32", "sum"
    if last:
        count = 101 if p["what"] == "length" else count
        dtype = {"dtype": "float64", "int": "int32"}.get(p["what"], dtype)
        op = "max" if p["what"] == "op" else op
    out: dict[str, Any] = {}
    try:
        ina.allreduce(np.ones(count, dtype), op=op)
        out["first"] = "no error"
    except Exception as exc:
        out["first"] = error(exc)
    out["second"] = ina.allreduce(np.ones(10, np.float32))
    out["second_engine"] = ina.stats()["last_call"]["engine"]
    out["switch"] = ina.stats().get("switch")
    out["transport"] = ina.stats().get("transport")
    ina.finalize()
    return out


def intracomm_disagree(comm: MPI.Intracomm, p: dict) -> Any:
    """Through the mpi4py API: one rank's buffer is longer."""
    ic = Intracomm(comm, timeout=30)
    n = 64 + (comm.rank == 0)
    try:
        ic.Allreduce(np.ones(n), np.empty(n))
        return "no error"
    except Exception as exc:
        return error(exc)


def rank_absent(comm: MPI.Intracomm, p: dict) -> Any:
    """The last rank never calls allreduce: the others must time out and say for what."""
    ina.init(comm, timeout=p["timeout"], **p.get("settings", {}))
    if comm.rank == comm.size - 1:
        return {"abandoned": True, "absent": True}
    try:
        ina.allreduce(np.ones(1 << 16, np.float32))
        result: Any = "no error"
    except Exception as exc:
        result = error(exc)
    try:
        ina.allreduce(np.ones(4, np.float32))
        after: Any = "no error"
    except Exception as exc:
        after = error(exc)
    return {"abandoned": True, "first": result, "after": after}


def local_errors(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """Errors every rank raises before any communication."""
    out: dict[str, Any] = {}
    try:
        ina.allreduce(np.ones(3))
    except Exception as exc:
        out["before_init"] = error(exc)
    ina.init(comm)
    attempts = {
        "average_int": lambda: ina.allreduce(np.ones(3, np.int32), op="average"),
        "bool_sum": lambda: ina.allreduce(np.ones(3, bool)),
        "complex_max": lambda: ina.allreduce(np.ones(3, np.complex64), op=ina.MAX),
        "object_dtype": lambda: ina.allreduce(np.array([object()] * 3)),
        "bad_op_name": lambda: ina.allreduce(np.ones(3), op="median"),
        "maxloc": lambda: ina.allreduce(np.ones(3), op=MPI.MAXLOC),
        "out_shape": lambda: ina.allreduce(np.ones(3), out=np.ones(4)),
        "out_dtype": lambda: ina.allreduce(np.ones(3), out=np.ones(3, np.float32)),
        "out_readonly": _readonly,
        "reinit": lambda: ina.init(comm, timeout=5),
        "bad_setting": lambda: Intracomm(comm, no_such_setting=1),
    }
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "no error"
        except Exception as exc:
            out[name] = error(exc)
    out["still_works"] = ina.allreduce(np.ones(2))
    ina.finalize()
    return out


def _readonly() -> np.ndarray:
    a = np.ones(3)
    a.setflags(write=False)
    return ina.allreduce(np.ones(3), out=a)


def runtime_priority(comm: MPI.Intracomm, p: dict) -> dict[str, Any]:
    """The background runtime's order (docs/ordering.md): six tensors each rank submits
    in an order of its own, ready together; then a large low-priority tensor cut into
    partitions and, just after it, small high-priority ones. The order handles finish
    in, and whether every sum is right."""
    from ina_collectives.runtime.background import BackgroundRuntime
    from ina_collectives.runtime.negotiation import OpRequest
    from ina_collectives.settings import Settings

    settings = Settings.load(p.get("settings", {}))
    runtime = BackgroundRuntime(comm.Dup(), settings)
    order: list[str] = []
    arrays: dict[str, np.ndarray] = {}
    tensors = [(f"t{i}", 1000 * (i + 1), 5 - i) for i in range(6)]
    mine = np.random.default_rng(comm.rank).permutation(len(tensors))

    def submit(name: str, count: int, priority: int, runtime: Any = runtime) -> Any:
        x = np.full(count, comm.rank + 1, np.float32)
        arrays[name] = x
        handle = runtime.submit(OpRequest("allreduce", name, "float32", "float32",
                                          (count,), "sum", priority=priority),
                                send=None, recv=x)
        handle.add_done_callback(lambda h: order.append(h.request.name))
        return handle

    # A process set: ranks 0 and 1 (rank 2 alone), each with a runtime of its own.
    subset = BackgroundRuntime(comm.Split(int(comm.rank >= 2), comm.rank), settings)
    try:
        with subset.together():
            handles = [submit(*tensors[i], runtime=subset) for i in mine]
        for h in handles:
            h.wait(60, "a tensor of the process set")
        in_subset = list(order)
        order.clear()
        arrays.clear()
    finally:
        subset.shutdown(30)
    try:
        with runtime.together():
            handles = [submit(*tensors[i]) for i in mine]
        for h in handles:
            h.wait(60, "a tensor of the first round")
        together = list(order)
        order.clear()
        handles = [submit("big", p["big"], 9)]
        handles += [submit(f"small{i}", 256, i) for i in range(3)]
        for h in handles:
            h.wait(60, "a tensor of the second round")
        n = comm.size
        right = all(bool((x == n * (n + 1) // 2).all()) for x in arrays.values())
        return {"together": together, "preempted": list(order), "right": right,
                "subset": in_subset, "mine": [tensors[i][0] for i in mine]}
    finally:
        runtime.shutdown(30)
