"""What an aggregator killed mid-call costs a running job (issue 34, MLfabric): its share
streamed again through the surviving aggregator (switch_standby, the default) against
handed to the ring (INA_INTERNAL_SWITCH_STANDBY=0), and the calls after it against the survivor
alone.

    python -m bench.loopback.standby                  # 2 ranks, 2 switches, 10 calls of 32 MiB
    python -m bench.loopback.standby --calls 6 --count 4000000

On loopback: two ina-switch processes (one shard each); every call is striped across
both until rank 0 SIGKILLs the second one --kill-after seconds into the second call.
Prints each run's call times; as its last line, the calls after the kill as a fraction
of the survivor's throughput alone (``after the kill: N.NN of one aggregator's
throughput``). The JSON goes to bench/results/standby.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench import RESULTS
from ina_collectives.launch.ranks import find_mpiexec
from ina_collectives.switch.embedded import embedded_switch
from ina_collectives.testing.jobs import child_env, mpiexec_line, run_group


def run(args: argparse.Namespace, standby: bool | None) -> dict[str, Any]:
    """standby None: the survivor alone (no kill); else both switches, one killed."""
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="standby-") as tmp:
        a = stack.enter_context(embedded_switch("--threads", "1"))
        switches = [a]
        if standby is not None:
            switches.append(stack.enter_context(embedded_switch("--threads", "1")))
        env = child_env(dict(INA_SWITCH=",".join(s.address_text for s in switches),
                             INA_SWITCH_MIN_BYTES="0", INA_RING_MIN_BYTES="0",
                             INA_SWITCH_SILENCE=str(args.silence), INA_SWITCH_RETRY_SECONDS="0",
                             INA_INTERNAL_SWITCH_STANDBY="1" if standby is not False else "0"),
                        keep_settings=True)
        out = Path(tmp, "record.json")
        pid = switches[1].pid if standby is not None else 0
        command = mpiexec_line(find_mpiexec(), [
            sys.executable, "-m", "bench.loopback.standby_ranks", str(args.calls),
            str(args.count), str(pid), str(args.kill_after), str(out)], n=args.np)
        code, output = run_group(command, env, 600)
        if code != 0 or not out.exists():
            raise SystemExit(f"{' '.join(command)} failed "
                             f"({'no result in 600 s' if code is None else code}):\n"
                             f"{output[-4000:]}")
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loopback.standby",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--count", type=int, default=8_000_000, help="float32 per call")
    parser.add_argument("--kill-after", type=float, default=0.02, metavar="SECONDS")
    parser.add_argument("--silence", type=float, default=0.5,
                        help="INA_SWITCH_SILENCE: how soon a rank declares the dead one dead")
    parser.add_argument("--out", type=Path, default=RESULTS / "standby.json")
    args = parser.parse_args(argv)
    if args.np < 2 or args.calls < 3 or args.count < 1:
        parser.error("--np 2 or more, --calls 3 or more, --count positive")
    runs = {"standby": run(args, True), "ring": run(args, False), "alone": run(args, None)}
    for name, rec in runs.items():
        print(f"{name:8s} " + " ".join(f"{t * 1e3:7.1f}" for t in rec["times"])
              + f"  ms; engines {rec['engines']}; takeovers {rec['standby_takeovers']}, "
                f"handovers {rec['partial_handovers']}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "runs": runs}, indent=1))
    alone = statistics.median(runs["alone"]["times"][2:])
    for name in ("standby", "ring"):
        rec = runs[name]
        killed = max(range(1, 3), key=lambda i: rec["times"][i])  # the call it died in
        print(f"{name}: the call the aggregator died in took {rec['times'][killed] * 1e3:.0f}"
              f" ms, {rec['times'][killed] / alone:.2f}x a call on the survivor alone")
    after = statistics.median(runs["standby"]["times"][3:])
    print(f"after the kill: {alone / after:.2f} of one aggregator's throughput")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
