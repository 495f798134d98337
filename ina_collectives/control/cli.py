"""``python -m ina_collectives.control {show,configure,teardown,mode}``: what ina-run does
through the controller, by hand, and a running job's mode."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from .. import protocol as P
from ..errors import ControlError
from ..helpformat import DefaultsHelpFormatter
from . import schema as S
from .controller import Controller
from .job import JobSpec, Parent, load_workers
from .pipeline import TARGETS

DESCRIPTION = ("What ina-run does through the controller, by hand, for ranks started some "
               "other way: show a P4Runtime target, configure or tear down a job, ask a "
               "running job for sync or quorum k (docs/quorum.md).")


def _parser() -> argparse.ArgumentParser:
    defaults = DefaultsHelpFormatter
    target = argparse.ArgumentParser(add_help=False)
    common = target.add_argument_group("the target")
    common.add_argument("--target", required=True, metavar="HOST:PORT",
                        help="the P4Runtime target")
    common.add_argument("--device-id", type=int, default=1, help="its device id")
    common.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS",
                        help="bound on each wait for the target")
    pipeline = argparse.ArgumentParser(add_help=False)
    pipe = pipeline.add_argument_group("the pipeline")
    pipe.add_argument("--p4info", type=Path, help="the program's P4Info (text format)")
    pipe.add_argument("--device-config", type=Path,
                      help="the target's device config: BMv2, p4c-bm2-ss's JSON; Tofino, the "
                           "compiler's output folder (p4c-barefoot -o), packed as bf_switchd "
                           "reads it, its P4Info taken from there unless --p4info is given")
    pipe.add_argument("--p4-target", choices=TARGETS, default=None,
                      help="what --device-config is for (default: a folder is a Tofino "
                           "build, a file BMv2's); a build for another is refused")
    pipe.add_argument("--push", choices=("always", "if-needed", "never"), default="never",
                      help="set the pipeline first (needs --p4info and --device-config)")
    job = argparse.ArgumentParser(add_help=False)
    spec = job.add_argument_group("the job")
    spec.add_argument("--job-id", type=int, required=True, help="1..65535")
    spec.add_argument("--workers", type=Path, metavar="FILE", required=True,
                      help="JSON list, one object per rank: ip, udp_port, and optionally "
                           "mac, switch_port")
    spec.add_argument("--slots", type=int, default=8, help="S of the job")
    spec.add_argument("--slot-base", type=int, default=0,
                      help="its first slot in the target's register pool")
    spec.add_argument("--block", type=int, default=0,
                      help="B the ranks will use, checked against the build (0: the build's)")
    spec.add_argument("--value-bits", type=int, default=0,
                      help="the values' width the ranks will use, 32 or 16, checked against "
                           "the build (0: the build's)")
    leaf = argparse.ArgumentParser(add_help=False)
    tree = leaf.add_argument_group("a tree's leaf (docs/trees.md)")
    tree.add_argument("--parent", metavar="HOST:PORT",
                      help="the job is a tree's leaf here: its sums go up to the aggregator "
                           "at this address, which has this switch (its address, the INA "
                           "port) as a worker of the same job id")
    tree.add_argument("--parent-worker", type=int, default=0, metavar="ID",
                      help="this leaf's worker id at the parent")
    tree.add_argument("--parent-mac", default="00:00:00:00:00:00",
                      help="the MAC towards the parent (a P4 switch's rewrite)")
    tree.add_argument("--parent-switch-port", type=int, default=0, metavar="PORT",
                      help="the switch's egress port towards the parent (a P4 switch's)")

    parser = argparse.ArgumentParser(prog="python -m ina_collectives.control",
                                     description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    actions.add_parser("show", parents=[target, pipeline], formatter_class=defaults,
                       help="the build, the installed jobs, groups, drops and modes",
                       description="Show the target's build, installed jobs, multicast "
                                   "groups, drop counters and jobs' modes.")
    actions.add_parser("configure", parents=[target, pipeline, job, leaf],
                       formatter_class=defaults,
                       help="install a job; prints what its ranks must be told",
                       description="Install a job's workers, multicast group and rewrites; "
                                   "print the INA_* settings its ranks need.")
    actions.add_parser("teardown", parents=[target, job], formatter_class=defaults,
                       help="remove a job",
                       description="Remove a job's entries (already gone: not an error).")
    mode = actions.add_parser("mode", parents=[target], formatter_class=defaults,
                              help="show or ask a running job's mode",
                              description="Show a job's mode, or ask it for quorum K (0: "
                                          "sync); the ranks adopt it at one call boundary.")
    mode.add_argument("--job-id", type=int, required=True, help="1..65535")
    mode.add_argument("--quorum", type=int, default=None, metavar="K",
                      help="a chunk completes when K workers contributed (0: all, sync); "
                           "without it, show the job's mode")
    return parser


def _parent(args: argparse.Namespace) -> Parent | None:
    """--parent HOST:PORT and its companions; ValueError naming the option if malformed."""
    if args.parent is None:
        return None
    try:
        return Parent(*P.parse_address(args.parent), args.parent_worker, args.parent_mac,
                      args.parent_switch_port)
    except ValueError as exc:
        raise ValueError(f"--parent {args.parent}: {exc}") from None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("ina-collectives")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ina_collectives.control {show,configure,teardown,mode} ...``."""
    args = _parser().parse_args(argv)
    for name in ("p4info", "device_config", "p4_target", "push", "workers", "slots",
                 "slot_base", "value_bits", "block", "parent"):
        if not hasattr(args, name):
            setattr(args, name, None if name in ("p4info", "device_config", "p4_target",
                                                 "workers", "parent")
                    else "never" if name == "push" else 0)
    try:
        job = None
        if args.action in ("configure", "teardown"):
            job = JobSpec(args.job_id, load_workers(args.workers), args.slots,
                          args.slot_base, value_bits=args.value_bits, block=args.block,
                          parent=_parent(args))
        with Controller(args.target, args.p4info, args.device_config, push=args.push,
                        device_id=args.device_id, timeout=args.timeout,
                        target=args.p4_target) as controller:
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
                if S.LEAF_COUNTER_NAME in build.ids:  # a tree's leaf: its traffic up
                    leaf = {k: v for k, v in controller.read_leaf().items() if v}
                    if leaf:
                        print("leaf:", leaf)
                for w in {w["job_id"] for w in controller.read_workers()}:
                    quorum, generation = controller.read_mode(w)
                    if generation:
                        print(f"job {w}: {f'quorum {quorum}' if quorum else 'sync'} "
                              f"(generation {generation})")
        return 0
    except (ControlError, ValueError, OSError, KeyError, TypeError) as exc:
        print(f"ina_collectives.control: error: {exc}", file=sys.stderr)
        return 2

