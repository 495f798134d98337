"""``python -m ina_collectives.control {show,configure,teardown,mode}``: what ina-run does
through the controller, by hand, and a running job's mode."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from ..errors import ControlError
from .controller import Controller
from .job import JobSpec, load_workers


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ina_collectives.control {show,configure,teardown,mode}``: what ina-run
    does, by hand (for ranks started some other way); ``mode`` asks a running job for sync
    or quorum k (docs/quorum.md)."""
    parser = argparse.ArgumentParser(prog="python -m ina_collectives.control",
                                     description=main.__doc__.splitlines()[0])
    parser.add_argument("action", choices=("show", "configure", "teardown", "mode"))
    parser.add_argument("--target", required=True, metavar="HOST:PORT",
                        help="the P4Runtime target")
    parser.add_argument("--p4info", type=Path)
    parser.add_argument("--device-config", type=Path)
    parser.add_argument("--push", choices=("always", "if-needed", "never"), default="never",
                        help="set the pipeline first (default never)")
    parser.add_argument("--device-id", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--job-id", type=int, default=0)
    parser.add_argument("--workers", type=Path, metavar="FILE",
                        help="JSON list, one object per rank: ip, udp_port, and optionally "
                             "mac, switch_port")
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--slot-base", type=int, default=0)
    parser.add_argument("--block", type=int, default=0,
                        help="B the ranks will use (checked against the build; default: "
                             "the build's)")
    parser.add_argument("--value-bits", type=int, default=0,
                        help="the values' width the ranks will use, 32 or 16 (checked "
                             "against the build; default: the build's)")
    parser.add_argument("--quorum", type=int, default=None, metavar="K",
                        help="mode: a chunk completes when K workers contributed (0: all, "
                             "sync); without it, mode shows the job's mode")
    args = parser.parse_args(argv)
    try:
        job = None
        if args.action == "mode" and not args.job_id:
            parser.error("mode needs --job-id")
        if args.action not in ("show", "mode"):
            if not args.job_id or args.workers is None:
                parser.error(f"{args.action} needs --job-id and --workers")
            job = JobSpec(args.job_id, load_workers(args.workers), args.slots,
                          args.slot_base, value_bits=args.value_bits, block=args.block)
        with Controller(args.target, args.p4info, args.device_config, push=args.push,
                        device_id=args.device_id, timeout=args.timeout) as controller:
            if args.action == "configure":
                controller.configure(job)
                print(f"INA_JOB={job.job_id} INA_WORKER_PORTS="
                      f"{','.join(str(w.udp_port) for w in job.workers)} "
                      f"INA_SWITCH_ELEMENTS={controller.build.k} "
                      f"INA_SWITCH_BLOCK={controller.build.block} "
                      f"INA_SWITCH_VALUE_BITS={controller.build.value_bits} "
                      f"INA_SWITCH_SLOTS={job.slots}")
            elif args.action == "teardown":
                controller.teardown(job)
            elif args.action == "mode":
                if args.quorum is not None:
                    controller.set_mode(args.job_id, args.quorum)
                quorum, generation = controller.read_mode(args.job_id)
                print(f"job {args.job_id}: {f'quorum {quorum}' if quorum else 'sync'} "
                      f"(generation {generation})")
            else:
                build = controller.build
                print(f"K {build.k}, S {build.slots}, B {build.block}, "
                      f"{build.value_bits}-bit values")
                for w in controller.read_workers():
                    print(f"job {w['job_id']} worker {w['worker_id']}/{w['num_workers']} at "
                          f"{w['ip']}:{w['udp_port']}, group {w['mcast_grp']}, slots "
                          f"{w['slot_base']}+{w['slot_count']}")
                for group, replicas in sorted(controller.read_groups().items()):
                    print(f"group {group}: replicas {replicas}")
                print("drops:", {k: v for k, v in controller.read_drops().items() if v})
                for w in {w["job_id"] for w in controller.read_workers()}:
                    quorum, generation = controller.read_mode(w)
                    if generation:
                        print(f"job {w}: {f'quorum {quorum}' if quorum else 'sync'} "
                              f"(generation {generation})")
        return 0
    except (ControlError, ValueError, OSError, KeyError, TypeError) as exc:
        print(f"ina_collectives.control: error: {exc}", file=sys.stderr)
        return 2

