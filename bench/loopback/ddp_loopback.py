"""DDP training steps on loopback: backend "ina" (no switch: its exact path) against
"gloo", the cost of the fallback path. Both as mpiexec jobs on this machine, in one run.

    python -m bench.loopback.ddp_loopback -n 2 --sizes 25M 100M --reps 5
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from bench.cluster.netsim_report import _size
from ina_collectives.launch.ranks import find_mpiexec
from ina_collectives.testing.jobs import child_env, mpiexec_line, run_group


def measure(system: str, n: int, sizes: list[int], reps: int, switch: str) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="ddp-loopback-") as tmp:
        out = Path(tmp, "records.json")
        env = child_env({"MASTER_ADDR": "127.0.0.1", "INA_SWITCH": switch},
                        keep_settings=True)
        command = [sys.executable, "-m", "bench.cluster.netsim_ranks", system,
                   ",".join(map(str, sizes)), str(reps), str(out)]
        code, output = run_group(mpiexec_line(find_mpiexec(), command, n=n), env, 1800)
        if code != 0 or not out.exists():
            raise SystemExit(f"{system} on {n} ranks failed "
                             f"({'no result in 1800 s' if code is None else code}):\n"
                             f"{output[-3000:]}")
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=2)
    parser.add_argument("--sizes", nargs="+", default=["25M", "100M"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--switch", default="",
                        help="INA_SWITCH for backend ina (default none: the exact path)")
    args = parser.parse_args()
    units = {"K": 1 << 10, "M": 1 << 20}
    sizes = [int(s[:-1]) * units[s[-1]] if s[-1] in units else int(s) for s in args.sizes]
    ina = measure("ddp-ina", args.n, sizes, args.reps, args.switch)
    gloo = measure("ddp-gloo", args.n, sizes, args.reps, "")
    print("| n | gradients | ina step ms | gloo step ms | ina / gloo | compute ms | engines |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for a, b in zip(ina, gloo):
        print(f"| {args.n} | {_size(a['bytes'])} | {a['seconds'] * 1e3:.0f} | "
              f"{b['seconds'] * 1e3:.0f} | {a['seconds'] / b['seconds']:.2f} | "
              f"{a['compute_seconds'] * 1e3:.0f} | {a['engines']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
