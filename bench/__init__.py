"""The benchmarks, by kind (docs/benchmarks.md):

* ``micro/``: pytest-benchmark modules (``test_*.py``), each run at the rank counts it
  declares (``RANKS``) by ``python -m bench.micro``;
* ``ceilings/``: what this machine allows, beside what the library reaches: UDP's and
  the switch's packet rates, the host path, the number formats' error;
* ``loopback/``: multi-rank jobs of the library on this machine (the call's breakdown,
  striping, an aggregator's standby, the soak, DDP);
* ``cluster/``: the emulated cluster's scenarios (root: ranks in network namespaces on
  shaped, lossy links): ``netsim`` and ``training``;
* ``gpu/``: what only a GPU runs (``make gpu-check``).

``make bench`` runs micro/, every command of ceilings/ and loopback/ but the chaos soak
(root, ten minutes: ``python -m bench.loopback.chaos``); ``make netsim`` the
cluster's quick sweep. What runs them (the launcher, the namespace fabric, BMv2, the
children's environment) is ina_collectives/testing/, which the tests share. Results go
to ``RESULTS``.
"""
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
