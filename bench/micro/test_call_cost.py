"""The fixed cost of one small allreduce (4 KiB of float32, loopback), and where it goes.

    python -m bench.micro bench/micro/test_call_cost.py        # at 2 and 4 ranks
    python -m bench.micro -n 2 bench/micro/test_call_cost.py   # at 2: call_cost-2.json

Rows (microseconds per call, the median of fixed rounds; bench.micro starts the switch):

* ``ina``: the array API's allreduce through the switch (switch_min_bytes 0), everything
  a call does: one switch round trip (the call repeats the last, so its first window
  goes predicted, with no opening: docs/protocol.md, One round trip), no vote (its
  outcome is in the results), and the Python around them; no host collective;
* ``ina-opened``: the same with every call opened through the switch first (which agrees
  on the call and on the first window's exponents: INA_INTERNAL_SWITCH_PREDICT=0);
* ``ina-gate``: the same with the opening's agreement made by MPI instead (the gate:
  INA_INTERNAL_SWITCH_OPENING=0, as with a switch that takes no openings);
* ``opening``: the opening alone, with the first window's exponents as the engine
  passes them;
* ``ina-unchecked``: the same without the agreement (check_agreement off): with no gate
  after it, the call makes its own exponent round and ends with the outcome vote;
* ``gate``: the agreement alone, with the first window's exponents as the engine passes
  them; ``agreement``: the same without them;
* ``exponent-round``, ``outcome-vote``: the two collectives an ungated call makes, alone;
* ``mpi``: MPI's own Allreduce of the same array; ``gloo``: torch.distributed's gloo
  all_reduce of the same tensor (skipped, saying why, without torch).

Before issue 30 a checked call made three blocking collectives (agreement, exponent
round, vote); then one, the gate; now none: the opening goes through the switch. The
rest of ``ina`` is the stream's round trip through the switch and the host's per-call
work.
"""
from __future__ import annotations

import socket

import numpy as np
import pytest
from mpi4py import MPI

from ina_collectives import protocol as P
from ina_collectives.collectives import Collectives
from ina_collectives.collectives.agreement import CallSignature, agree, identity
from ina_collectives.collectives.engine import AllreduceCall
from ina_collectives.collectives.ops import Op, dtype_code
from ina_collectives.collectives.waiting import Deadline, wait
from ina_collectives.ina.engine import InaEngine
from ina_collectives.settings import Settings

RANKS = (2, 4)  # the rank counts python -m bench.micro runs it at

COMM = MPI.COMM_WORLD
NBYTES = 4 << 10
ROUNDS = 400
pytestmark = pytest.mark.skipif(COMM.Get_size() < 2,
                                reason="needs several ranks: python -m bench.micro -n 2 "
                                       "bench/micro/test_call_cost.py")

_ina = Collectives(COMM, Settings.load({"switch_min_bytes": 0}), InaEngine)
_unchecked = Collectives(COMM, Settings.load({"switch_min_bytes": 0,
                                              "check_agreement": False}), InaEngine)
_gated = Collectives(COMM, Settings.load({"switch_min_bytes": 0, "switch_opening": False}),
                     InaEngine)
_opened = Collectives(COMM, Settings.load({"switch_min_bytes": 0, "switch_predict": False}),
                      InaEngine)
_peers = COMM.Dup()


def _sizes() -> tuple[int, int]:
    """The exponent round's int16 count and the vote's float64 count for this call, as
    the engine makes them (1 + the first window's exponents; 4 per aggregator + 1)."""
    x = np.ones(NBYTES // 4, np.float32)
    proposal = _ina.offload.prepare(AllreduceCall(x, np.empty_like(x), Op.SUM)).proposal
    return proposal.size, 4 * len(_ina.offload.aggregators.addresses) + 1


def _gloo():
    torch = pytest.importorskip("torch", reason="gloo needs torch: pip install "
                                                "'ina-collectives[torch]'")
    import torch.distributed as dist
    if not dist.is_initialized():
        port = 0
        if COMM.Get_rank() == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        port = COMM.bcast(port)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=COMM.Get_rank(), world_size=COMM.Get_size())
    tensor = torch.ones(NBYTES // 4)
    return lambda: dist.all_reduce(tensor)


@pytest.mark.parametrize("system", ["ina", "ina-opened", "ina-gate", "ina-unchecked",
                                    "opening", "gate",
                                    "agreement", "exponent-round", "outcome-vote", "mpi",
                                    "gloo"])
def test_call_cost(benchmark, system):
    n = COMM.Get_size()
    send = np.ones(NBYTES // 4, np.float32)
    recv = np.empty_like(send)
    exponents, votes = _sizes()
    proposal, agreed = np.zeros(exponents, np.int16), np.empty(exponents, np.int16)
    mine, voted = np.zeros(votes), np.empty(votes)
    signature = CallSignature(CallSignature.ARRAYS, send.size, dtype_code(send.dtype), 0,
                              "bench")
    seq = iter(range(1, 1 << 30))
    width, window = _ina.offload.window_size(), np.zeros(exponents, np.int16)

    def collective(request_of):
        return lambda: wait(request_of(), Deadline(60), lambda: system)

    call = AllreduceCall(send, recv, Op.SUM)
    ident = identity(signature)

    def opening():
        opened = _ina.offload.opening(ident, _ina.offload.prepare(call), Deadline(60))
        assert opened.outcome == "agreed", opened

    run = {
        "ina": lambda: _ina.allreduce(send, out=recv),
        "ina-opened": lambda: _opened.allreduce(send, out=recv),
        "ina-gate": lambda: _gated.allreduce(send, out=recv),
        "opening": opening,
        "ina-unchecked": lambda: _unchecked.allreduce(send, out=recv),
        "gate": lambda: agree(_peers, signature, next(seq), Deadline(60), 0, window, width),
        "agreement": lambda: agree(_peers, signature, next(seq), Deadline(60)),
        "exponent-round": collective(lambda: _peers.Iallreduce(proposal, agreed, MPI.MAX)),
        "outcome-vote": collective(lambda: _peers.Iallreduce(mine, voted, MPI.MAX)),
        "mpi": lambda: COMM.Allreduce(send, recv),
    }.get(system) or _gloo()
    benchmark.group = f"call-cost-{n}-ranks"
    COMM.Barrier()
    benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=20)
    if system in ("ina", "ina-opened", "ina-gate", "ina-unchecked", "mpi"):
        assert recv[0] == n and recv[-1] == n
    if system.startswith("ina"):
        done = {"ina": _ina, "ina-opened": _opened, "ina-gate": _gated,
                "ina-unchecked": _unchecked}[system].stats.last
        assert done["engine"] == "ina", done
    if system == "ina":  # every call but the first predicted, none with a vote
        assert _ina.offload.vote_free_calls >= ROUNDS, _ina.offload.switch_state()
        assert _ina.offload.predicted_calls >= ROUNDS, _ina.offload.switch_state()
    if system == "ina-opened":  # every call opened through the switch
        assert _opened.offload.opened_calls >= ROUNDS, _opened.offload.switch_state()
    benchmark.extra_info.update(ranks=n, bytes=NBYTES, exponent_values=exponents,
                                vote_values=votes, protocol=P.PROTOCOL_VERSION)
