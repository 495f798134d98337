"""``ina-run``: start (or reach) the aggregator, configure the job, run the ranks, clean up.

    ina-run -np 4 -- python train.py                  # embedded software switch
    ina-run -np 4 --p4runtime 10.0.0.1:9559 --p4info build/ina.p4info.txt \\
        --device-config build/ina.json --workers workers.json -- python train.py
    ina-run -np 4 --switch 10.0.0.1:47474 -- python train.py   # ranks join it themselves
    ina-run -np 4 --switch none -- python train.py    # ring only
    ina-run -np 2 -H localhost:2 --verbose --fusion-threshold-mb 32 python train.py
    ina-run -np 8 -H node1:4,node2:4 --address 10.0.0.1 -- python train.py  # two hosts
    ina-run -np 4 --topology tree.toml -- python train.py   # a switch per aggregator
    ina-run -np 8 -H node1:4,node2:4 --topology tree.toml --switch running -- python train.py
    ina-run -np 8 -H node1:4,node2:4 --topology p4tree.toml --p4info build/ina.p4info.txt \
        --device-config build/ina.json --workers workers.json -- python train.py  # P4 tree

horovodrun's command line works where it applies (``ina-run --help`` lists the options
taken and refused): the setting options (--fusion-threshold-mb, --cycle-time-ms, ...)
become HOROVOD_* and INA_* variables of the ranks; options for other controllers
(--gloo, --ssh-port, --network-interface, ...) exit 2 naming the option.

-H/--hostfile naming other machines runs their ranks through mpiexec's own bootstrap
(Hydra: ssh by default, --bootstrap and --bootstrap-exec choose another), which passes
the environment on. The embedded switch then binds --address, this machine's address
as the hosts reach it (mpiexec's proxies call back to it too), or --switch names a
running one; the ranks join the switch themselves from their own addresses, and the
switch takes a job's packets only from those.

With the embedded switch (the default) or a P4Runtime target, ina-run configures the
job through the controller (ina_collectives.control): it pushes the pipeline, installs
one worker entry per rank (worker id = rank, at a UDP port it chose), the multicast
group and the result rewrites, and resets the job's registers; the ranks get the job id
and their ports (INA_JOB, INA_WORKER_PORTS), K and S, and check their entries with a
probe. Afterwards it removes the job and stops the embedded switch, whatever happened.
Without the p4 extra, the embedded switch is started without P4Runtime and the ranks
join it themselves (the plain-mpiexec path; said with --verbose). --elements K is every
rank's INA_SWITCH_ELEMENTS on every path; without it each rank sizes its packets to its
path's MTU when it joins. An exported INA_SWITCH gives way to the switch ina-run starts,
with a warning (--switch HOST:PORT uses a running one).

--topology FILE runs the job on an aggregation tree (docs/trees.md): the file is read
and checked for -np ranks before anything starts. ina-run then starts one ina-switch per
aggregator at the file's address, with ``--topology FILE --name NAME``, root first
(each address must be on loopback, 127.0.0.0/8), or with --switch running probes the
file's switches, started beforehand on their hosts, and names each that does not answer.
The ranks get INA_TOPOLOGY (the file's absolute path, which every host must read at
that path) and no INA_SWITCH, and join their leaf aggregators themselves. It takes no
--aggregators, --address (for the switches) or --p4runtime. Where every aggregator of
the file names its P4Runtime target (``p4runtime = "host:port"``: a tree of P4 switches),
ina-run starts nothing and installs the tree instead: the root's job with the leaves as
its workers, each leaf's with its ranks (--workers, as with --p4runtime) and its parent;
the ranks get INA_TOPOLOGY with INA_JOB and their ports, join nothing, and each probes its
leaf; every job is torn down afterwards.

Each rank starts through rank.py, which records its pid and how it ended in a
temporary folder (a Python rank that initialises the library also records an exception
that ends it, as it is raised: its exit may wait in MPI_Finalize for the ranks that fail
because of it), and Hydra runs with -disable-auto-cleanup: ina-run does the cleanup.
When a rank fails (an exception, a non-zero exit or a signal), ina-run names the first
by the moment it failed, e.g. ``ina-run: rank 1 (pid 1234) raised ValueError: ... at
train.py:12 in step`` or ``... was killed by signal 9 (SIGKILL)``; the others' bounded
waits raise CollectiveTimeout at once, naming that rank; they get GRACE_SECONDS (5) to
end, then SIGTERM, then SIGKILL 3 s later, so no rank is left and ina-run never waits
unbounded; the job is then removed from the switch as after any run. (A rank that ends
with sys.exit(code) while the others still call runs mpi4py's MPI_Finalize at exit,
which waits for them: it has not ended, and the others see it only at INA_TIMEOUT.)

Each line a rank writes starts with its rank, ``[1] Traceback ...`` (--no-rank-prefix:
as written). mpiexec, torchrun and the embedded switch run in sessions of their own, so
a terminal's Ctrl-C (or SIGTERM, SIGHUP) reaches ina-run alone, which passes it to each
rank once (a second one stops them at once), with the same bounds, tears the job down on
the switch and stops the switch, and says in one line per rank where it stopped.

Exit code: the failed rank's code (1 for an exception), or 128 + N when signal N
killed it; 128 + N when ina-run itself got signal N (Ctrl-C: 130); else the job's (0).
2 when the launcher or the target is missing, the topology file is refused, the
embedded switch cannot start, an aggregator of the tree does not answer, the target
refuses the job, (with --require-switch) a given switch does not answer, the
command cannot run here, or (with --start-timeout) the switch or a rank did not start
in time; without --require-switch a silent --switch HOST:PORT is a warning and the
ranks take the ring.
"""
from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from ..control.pipeline import TARGETS as P4_TARGETS
from ..errors import AggregatorUnavailable, LaunchError
from ..settings import env_name
from . import horovodrun
from .ranks import (
    detached,
    find_mpiexec,
    run_ranks,
    run_torchrun,
    say,
)

if TYPE_CHECKING:
    from ..protocol.topology import Aggregator, Topology

# K of the embedded switch's pipeline. Its P4Info lists one register per element, which
# p4runtime-shell's pure-Python protobuf loads slowly (docs/control.md has the numbers).
EMBEDDED_ELEMENTS = 4096


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="ina-run", description="Run an MPI job whose allreduces go through an "
        "in-network aggregator (by default an embedded software switch), configured "
        "through P4Runtime.")
    parser.add_argument("-np", "-n", dest="np", type=int, required=True,
                        help="number of ranks")
    parser.add_argument("--switch", default="embedded",
                        help="'embedded' (start a software switch on loopback), HOST:PORT "
                             "of a running aggregator's UDP port (or several, comma-"
                             "separated: the job stripes across them), or 'none' (ring "
                             "only). With --p4runtime: each target's INA address (default: "
                             "its host, port 47474). With --topology: 'embedded' or "
                             "'running' (the file's switches run already)")
    parser.add_argument("--aggregators", type=int, default=1, metavar="N",
                        help="with --switch embedded: start N software switches and stripe "
                             "the job across them (default 1)")
    parser.add_argument("--topology", metavar="FILE",
                        help="run the job on an aggregation tree (TOML, docs/trees.md): "
                             "ina-run starts one software switch per aggregator at its "
                             "address (loopback only) with --topology FILE --name NAME, "
                             "root first, or with --switch running probes the switches "
                             "already started there; the ranks get INA_TOPOLOGY (the file's "
                             "absolute path) instead of INA_SWITCH. A file whose aggregators "
                             "name their P4Runtime targets (p4runtime = ...): the tree is "
                             "installed through them (--p4info, --device-config, --workers)")
    parser.add_argument("--switch-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for the embedded ina-switch (repeatable), "
                             "e.g. --switch-arg=--drop-in=0.01")
    parser.add_argument("--require-switch", action="store_true",
                        help="with --switch HOST:PORT: fail (exit 2) if no switch answers "
                             "there, instead of warning and letting the ranks take the ring")
    p4 = parser.add_argument_group("P4Runtime (BMv2, a Tofino switch's bf_switchd, or "
                                   "another P4 target)")
    p4.add_argument("--p4runtime", metavar="HOST:PORT",
                    help="configure the job on this P4Runtime target, or on each of several "
                         "(comma-separated: the job stripes across them); needs --p4info "
                         "and --device-config, one build for all")
    p4.add_argument("--p4info", type=Path,
                    help="the program's P4Info (text format; a Tofino build's folder "
                         "holds it as p4info.txt)")
    p4.add_argument("--device-config", type=Path,
                    help="the target's device config: BMv2, p4c-bm2-ss's JSON; Tofino, the "
                         "compiler's output folder (p4c-barefoot -o), packed as bf_switchd "
                         "reads it")
    p4.add_argument("--target", "--p4-target", dest="p4_target", choices=P4_TARGETS,
                    default=None,
                    help="what --device-config is for (default: a folder is a Tofino build, "
                         "its chip from the binary's name; a file is BMv2's); a build for "
                         "another is refused")
    p4.add_argument("--device-id", type=int, default=1)
    p4.add_argument("--control-timeout", type=float, default=10.0, metavar="SECONDS",
                    help="bound on each wait for the target (connect, arbitration, every "
                         "request); default 10")
    p4.add_argument("--push", choices=("always", "if-needed", "never"), default="if-needed",
                    help="set the target's pipeline: always, only if its P4Info differs "
                         "(default), or never")
    p4.add_argument("--workers", type=Path, metavar="FILE",
                    help="JSON list, one object per rank: ip, and optionally udp_port, mac, "
                         "switch_port (the rank's address as the switch sees it); default: "
                         "every rank on 127.0.0.1")
    job = parser.add_argument_group("the job")
    job.add_argument("--job-id", type=int, default=0, help="default: a random id")
    job.add_argument("--slots", type=int, default=0,
                     help="S of the job (default INA_SWITCH_SLOTS or 8)")
    job.add_argument("--slot-base", type=int, default=0,
                     help="first slot of the job in the target's register pool")
    job.add_argument("--elements", type=int, default=0, metavar="K",
                     help="K, the values in each of the job's packets: every rank, on "
                          "every host, gets INA_SWITCH_ELEMENTS=K. Default: each rank sizes "
                          "its packets to the MTU of its path to the switch when it joins, "
                          "and the job takes the smallest (the embedded switch's P4Runtime "
                          f"pipeline holds {EMBEDDED_ELEMENTS}). A P4 target's K is its "
                          "build's")
    hosts = parser.add_argument_group("several hosts (-H or --hostfile naming other machines)")
    hosts.add_argument("--address", metavar="ADDR",
                       help="this machine's address as the other hosts reach it: the "
                            "embedded switch binds it, and mpiexec's proxies call back to it")
    hosts.add_argument("--bootstrap", default="ssh",
                       choices=("ssh", "rsh", "slurm", "ll", "lsf", "sge", "manual"),
                       help="how mpiexec starts its proxies on the other hosts (Hydra's "
                            "-launcher)")
    hosts.add_argument("--bootstrap-exec", metavar="COMMAND",
                       help="the command that does it (Hydra's -launcher-exec), e.g. "
                            "'ssh -p 2222' or a script taking HOST COMMAND...")
    horovodrun.add_options(parser)
    parser.add_argument("--launcher", choices=("mpiexec", "torchrun"), default="mpiexec",
                        help="what starts the ranks: mpiexec (default: MPI ranks, for the "
                             "Horovod API and mpi4py) or torchrun (torch.distributed's "
                             "ranks, for backend 'ina' without MPI)")
    parser.add_argument("--no-rank-prefix", dest="rank_prefix", action="store_false",
                        help="leave the ranks' output lines as they write them; by default "
                             "each line starts with its rank, '[1] Traceback ...' (as "
                             "mpiexec -prepend-rank, but whole lines)")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the program each rank runs (after an optional --)")
    args = parser.parse_args(argv)
    if args.command and args.command[0] == "--":
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command to run: ina-run -np N -- python train.py")
    if args.np < 1:
        parser.error(f"-np must be at least 1, got {args.np}")
    if args.topology:
        if args.switch not in ("embedded", "running"):
            parser.error(f"--topology and --switch {args.switch}: the file names the "
                         f"aggregators; --switch is 'embedded' (ina-run starts them, the "
                         f"default) or 'running' (they run already)")
        if args.aggregators != 1:
            parser.error("--topology and --aggregators: the file names the aggregators, "
                         "one switch each; leave --aggregators out")
        if args.p4runtime:
            parser.error("--topology and --p4runtime: a tree of P4 targets names them in "
                         "the file (p4runtime = \"host:port\" for every aggregator; "
                         "docs/trees.md); leave --p4runtime out")
        if args.address and args.switch == "embedded":
            parser.error("--topology and --address: the embedded switches bind the file's "
                         "addresses; leave --address out")
    elif args.switch == "running":
        parser.error("--switch running is for --topology (the file's switches run "
                     "already); name a running switch as --switch HOST:PORT")
    if args.p4runtime and (args.device_config is None
                           or (args.p4info is None and not args.device_config.is_dir())):
        parser.error("--p4runtime needs --device-config and --p4info (a Tofino build's "
                     "folder holds its P4Info)")
    if args.p4runtime and args.switch == "none":
        parser.error("--p4runtime and --switch none contradict each other")
    if args.elements < 0:
        parser.error(f"--elements must be 1 or more (K of each packet), got {args.elements}")
    if args.elements and args.p4runtime:
        parser.error("--elements: a P4 target's K is its build's (the ranks are told it); "
                     "leave --elements out with --p4runtime")
    if args.aggregators < 1 or (args.aggregators > 1 and args.switch != "embedded"):
        parser.error("--aggregators N (1 or more) is for --switch embedded; name running "
                     "aggregators in --switch, or targets in --p4runtime, instead")
    if args.p4runtime and args.switch not in ("embedded", "none") and (
            len(args.switch.split(",")) != len(args.p4runtime.split(","))):
        parser.error(f"--switch names {len(args.switch.split(','))} address(es) for "
                     f"{len(args.p4runtime.split(','))} --p4runtime target(s)")
    horovodrun.check_options(parser, args)
    if args.remote_hosts:
        where = f"-H names other hosts ({', '.join(args.remote_hosts)})"
        if args.topology and args.switch == "embedded":
            parser.error(f"{where}: --topology's embedded switches listen on loopback, "
                         f"which they cannot reach; start each of the file's switches on "
                         f"its host (ina-switch --topology FILE --name NAME) and give "
                         f"--switch running")
        if args.launcher == "torchrun":
            parser.error(f"{where}: --launcher torchrun starts ranks on this machine; run "
                         f"torchrun on each host with INA_SWITCH set (README: several hosts)")
        if args.switch == "embedded" and not args.p4runtime and not args.address:
            parser.error(f"{where}: give --address (this machine's address as they reach "
                         f"it: the embedded switch binds it) or --switch HOST:PORT")
        if args.p4runtime and not args.workers:
            parser.error(f"{where}: --p4runtime installs each rank's address: give them "
                         f"in --workers")
    return args


def free_udp_ports(n: int) -> list[int]:
    """n UDP ports free on this machine now (the ranks bind them moments later)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.bind(("0.0.0.0", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def job_workers(args: argparse.Namespace, aggregators: int = 1) -> list[list[Any]]:
    """The ranks as each aggregator's controller installs them: a UDP port per rank per
    aggregator, all distinct (a rank binds one socket per aggregator)."""
    from ..control import Worker, load_workers

    ports = free_udp_ports(args.np * aggregators)
    shares = [ports[a * args.np:(a + 1) * args.np] for a in range(aggregators)]
    if args.workers is None:
        return [[Worker("127.0.0.1", port) for port in share] for share in shares]
    try:
        return [load_workers(args.workers, args.np, share) for share in shares]
    except ValueError as exc:
        raise LaunchError(f"--workers: {exc}") from None


def p4_extra_installed() -> bool:
    try:
        import grpc  # noqa: F401
        import p4runtime_sh  # noqa: F401
    except ImportError:
        return False
    return True


def run_configured(args: argparse.Namespace, env: dict[str, str], mpiexec: str,
                   targets: list[str], p4info: Path, device_config: Path,
                   switch_addresses: list[str], push: str,
                   alive: Callable[[], bool] | None = None) -> int:
    """Configure the job through a controller on each target (one job id, the ranks'
    ports of each), run the ranks striped across them, tear the job down on each.
    p4runtime-shell holds one session per process, so each target is configured, and
    later torn down, in a session of its own (a target keeps its entries when the
    controller disconnects). ``alive``: whether the targets still run (the embedded
    switches): a job on a stopped one went with it, and its teardown is skipped."""
    from ..control import Controller, JobSpec
    from ..settings import Settings

    settings = Settings.load()
    job_id = args.job_id or random.SystemRandom().randrange(1, 65536)
    workers = job_workers(args, len(targets))

    def session(target: str, push_now: str, known: Any = None) -> Any:
        return Controller(target, p4info, device_config, device_id=args.device_id,
                          push=push_now, timeout=args.control_timeout, known_p4info=known,
                          target=args.p4_target)

    with ExitStack() as stack:
        jobs, builds = [], []
        for target, ranks in zip(targets, workers):
            job = JobSpec(job_id, ranks, args.slots or settings.switch_slots, args.slot_base)
            with session(target, push) as controller:
                controller.configure(job)
                build, known = controller.build, controller.p4info_message
            jobs.append(job)
            builds.append(build)
            # (The target's P4Info as this session left it: not read back again.)
            stack.callback(_teardown_in_session, session, target, job, known, alive)
            print(f"ina-run: job {job.job_id} configured on {target} (K {build.k}, "
                  f"S {job.slots}, {len(job.workers)} workers): the target's P4Runtime "
                  f"address; K values a packet (its pipeline's), S packets in "
                  f"flight a worker (--slots)", file=sys.stderr, flush=True)
        kinds = {(b.k, b.block, b.value_bits) for b in builds}
        if len(kinds) > 1:
            raise LaunchError(f"the targets {', '.join(targets)} run different builds "
                              f"(K, B, value bits: {sorted(kinds)}); a job striped across "
                              "them needs one")
        build = builds[0]
        if bmv2_config(device_config) and "INA_INTERNAL_SWITCH_GSO" not in env:
            env["INA_INTERNAL_SWITCH_GSO"] = "0"
            print("ina-run: the device config is BMv2's: the ranks send each packet as a "
                  "datagram of its own (INA_INTERNAL_SWITCH_GSO=0), since a software target on "
                  "veths would take a segmented batch as one frame and drop it",
                  file=sys.stderr, flush=True)
        env.update({"INA_SWITCH": ",".join(switch_addresses), "INA_JOB": str(job_id),
                    "INA_WORKER_PORTS": ",".join(str(w.udp_port) for job in jobs
                                                 for w in job.workers),
                    "INA_SWITCH_ELEMENTS": str(build.k),
                    "INA_SWITCH_BLOCK": str(build.block),
                    "INA_SWITCH_VALUE_BITS": str(build.value_bits),
                    "INA_SWITCH_SLOTS": str(jobs[0].slots)})
        return start_ranks(args, env, mpiexec)


def bmv2_config(device_config: Path) -> bool:
    """Whether ``device_config`` is BMv2's (the JSON p4c-bm2-ss writes). BMv2 is a
    software target: on a veth a UDP_SEGMENT batch reaches it as one frame of several
    datagrams, which it drops as malformed, where a NIC would have cut it into packets."""

    try:
        with open(device_config, "rb") as f:
            if f.read(1).strip() not in (b"{", b""):
                return False
            f.seek(0)
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and {"parsers", "pipelines"} <= config.keys()


def _teardown_in_session(session: Any, target: str, job: Any, known: Any,
                         alive: Callable[[], bool] | None = None) -> None:
    from ..control import ControlError

    if alive is not None and not alive():
        print(f"ina-run: the switch at {target} stopped, and job {job.job_id} with it",
              file=sys.stderr, flush=True)
        return
    try:
        with session(target, "never", known) as controller:
            controller.teardown(job)
    except ControlError as exc:
        print(f"ina-run: warning: {exc}", file=sys.stderr)


def check_switch(address: str, timeout: float) -> None:
    """A running software switch answers a probe for job 0 within ``timeout`` seconds;
    LaunchError if none does."""
    from .. import protocol as P

    why = silent_aggregator(P.parse_address(address), timeout)  # (a malformed one: named)
    if why is not None:
        raise LaunchError(f"{why} (start one with ina-switch, or leave --switch out for "
                          f"the embedded one)")


def silent_aggregator(where: tuple[str, int], timeout: float) -> str | None:
    """Why the aggregator at ``where`` did not answer a probe for job 0 within
    ``timeout`` seconds; None when it answered."""
    from .. import protocol as P

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            P.control_exchange(s, where, 0, 0, [P.CTRL_PROBE], timeout, "probe")
        except AggregatorUnavailable as exc:
            return str(exc)
    return None


def start_left(args: argparse.Namespace, default: float | None) -> float | None:
    """Seconds left of --start-timeout (counted from ina-run's start), or ``default``."""
    if args.start_by is None:
        return default
    return max(0.0, args.start_by - time.monotonic())


def start_ranks(args: argparse.Namespace, env: dict[str, str], mpiexec: str) -> int:
    """run_ranks with what the command line says: the start bound, --verbose."""
    if args.verbose:
        given = {k: v for k, v in env.items() if os.environ.get(k) != v and
                 k.startswith(("INA_", "HOROVOD_"))}
        say(f"{args.np} rank(s), environment for them: "
            + (" ".join(f"{k}={v}" for k, v in sorted(given.items())) or "unchanged"))
    if args.launcher == "torchrun":
        return run_torchrun(args.np, args.command, env, verbose=args.verbose,
                            prefix=args.rank_prefix)
    return run_ranks(args.np, args.command, env, mpiexec,
                     start_timeout=start_left(args, None), verbose=args.verbose,
                     hosts=hydra_hosts(args), prefix=args.rank_prefix)


def hydra_hosts(args: argparse.Namespace) -> list[str]:
    """mpiexec's options that place the ranks on -H's hosts (none while they are all this
    machine): the hosts and slots, the bootstrap, and the address the proxies call."""
    if not args.remote_hosts:
        return []
    line = ["-hosts", ",".join(f"{name}:{slots}" for name, slots in args.host_list),
            "-launcher", args.bootstrap]
    if args.bootstrap_exec:
        line += ["-launcher-exec", args.bootstrap_exec]
    if args.address:
        line += ["-localhost", args.address]
    return line


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.start_by = (None if args.start_timeout is None
                     else time.monotonic() + args.start_timeout)
    from ..control import ControlError
    from ..settings import warn_unknown_variables

    try:
        # A misspelt INA_* variable is said once, here: the ranks leave it to ina-run.
        warn_unknown_variables(os.environ)
        topology = load_topology(args) if args.topology else None
        mpiexec = find_mpiexec() if args.launcher == "mpiexec" else ""
        env = ranks_environment(args, os.environ)
        if not args.remote_hosts:  # (other hosts may hold what this one lacks)
            args.command = runnable(args.command, args.launcher)
        warn_overridden_switch(args, os.environ)
        if args.verbose:
            say(f"{args.launcher} {mpiexec or 'torch.distributed.run'}; hosts: "
                + (", ".join(f"{name} ({slots} slot(s))" for name, slots in args.host_list)
                   if args.host_list else "this machine"))
        if topology is not None:
            return run_topology(args, topology, env, mpiexec)
        if args.switch == "none":
            env["INA_SWITCH"] = ""
            if args.verbose:
                say("no switch (--switch none): the ranks take the ring")
            return start_ranks(args, env, mpiexec)
        if args.p4runtime:
            from ..protocol import parse_address, parse_addresses
            if not p4_extra_installed():
                raise LaunchError("--p4runtime needs the p4 extra: pip install "
                                  "'ina-collectives[p4]'")
            targets = [t.strip() for t in args.p4runtime.split(",") if t.strip()]
            if args.switch == "embedded":  # each target's own address, the INA port
                addresses = ["%s:%d" % parse_address(parse_address(t)[0]) for t in targets]
            else:
                addresses = ["%s:%d" % a for a in parse_addresses(args.switch)]
            return run_configured(args, env, mpiexec, targets, args.p4info,
                                  args.device_config, addresses, args.push)
        if args.switch != "embedded":
            for address in args.switch.split(","):
                try:
                    check_switch(address, start_left(args, min(args.control_timeout, 3.0)))
                    if args.verbose:
                        say(f"the switch at {address} answered its probe")
                except LaunchError as exc:
                    if args.require_switch:
                        raise
                    print(f"ina-run: warning: {exc}; the ranks will "
                          + ("take the ring" if "," not in args.switch
                             else "use the other aggregators"), file=sys.stderr, flush=True)
            env["INA_SWITCH"] = args.switch
            return start_ranks(args, env, mpiexec)
        return run_embedded(args, env, mpiexec)
    except (LaunchError, ControlError, ValueError, RuntimeError, OSError) as exc:
        print(f"ina-run: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the ranks started (they pass it on themselves)
        print("ina-run: interrupted (Ctrl-C) before the ranks started", file=sys.stderr)
        return 128 + signal.SIGINT


def ranks_environment(args: argparse.Namespace, environ: Mapping[str, str]
                      ) -> dict[str, str]:
    """The ranks' environment before the switch's settings: ``environ``, the variables
    of horovodrun's setting options, and INA_SWITCH_ELEMENTS with --elements (mpiexec
    passes the environment on to the ranks of every host, which then use that K).
    Without --topology an exported INA_TOPOLOGY is left out (the ranks get INA_SWITCH,
    and the settings refuse both)."""
    env = dict(environ, **horovodrun.environment(args))
    if args.elements:
        env[env_name("switch_elements")] = str(args.elements)
    if not args.topology:
        env.pop(env_name("topology"), None)
    return env


def runnable(command: list[str], launcher: str) -> list[str]:
    """``command`` as each rank runs it: a Python script named first runs with this
    Python where it is not executable (as torchrun runs one); LaunchError, before
    anything starts, for a first word that cannot be run here."""
    first = command[0]
    if first.endswith(".py") and os.path.isfile(first) and (
            launcher == "torchrun" or not os.access(first, os.X_OK)):
        return [sys.executable, *command]
    if os.sep in first:
        if not os.path.exists(first):
            raise LaunchError(f"cannot run {first!r}: no such file")
        if os.path.isdir(first) or not os.access(first, os.X_OK):
            raise LaunchError(f"cannot run {first!r}: it is not an executable file "
                              f"(chmod +x it, or name its interpreter: -- bash {first})")
    elif shutil.which(first, path=os.environ.get("PATH")) is None:
        raise LaunchError(f"cannot run {first!r}: no such command on PATH")
    return command


def warn_overridden_switch(args: argparse.Namespace, environ: Mapping[str, str]) -> None:
    """One line when an exported INA_SWITCH gives way to the switch ina-run starts (or
    its P4 targets' addresses): the ranks get ina-run's, and --switch takes that one.
    Likewise an exported INA_TOPOLOGY that --topology (or its absence) overrides, and an
    INA_SWITCH that --topology leaves out."""
    given, tree = environ.get("INA_SWITCH"), environ.get("INA_TOPOLOGY")
    if args.topology:
        if given:
            print(f"ina-run: warning: INA_SWITCH={given} is left out: the ranks take their "
                  f"aggregators from --topology {args.topology}", file=sys.stderr, flush=True)
        elif tree and os.path.abspath(tree) != os.path.abspath(args.topology):
            print(f"ina-run: warning: INA_TOPOLOGY={tree} is overridden by --topology "
                  f"{args.topology}", file=sys.stderr, flush=True)
        return
    if tree:
        print(f"ina-run: warning: INA_TOPOLOGY={tree} is left out: the ranks get "
              f"{'no switch' if args.switch == 'none' else 'INA_SWITCH'} from ina-run; to "
              f"use its tree: --topology {tree}", file=sys.stderr, flush=True)
    if given is None or args.switch != "embedded":
        return
    print(f"ina-run: warning: INA_SWITCH={given} is overridden: the ranks get the address "
          f"of the {'P4 target' if args.p4runtime else 'switch ina-run starts'}; to use "
          + (f"the one at {given}: --switch {given}" if given.strip() else
             "no switch: --switch none"), file=sys.stderr, flush=True)


def run_embedded(args: argparse.Namespace, env: dict[str, str], mpiexec: str) -> int:
    from ..control import schema, write_p4info
    from ..settings import Settings
    from ..switch import status_summary
    from ..switch.embedded import embedded_switch

    configured = p4_extra_installed() and not args.remote_hosts
    if args.remote_hosts:
        say("the ranks of several hosts join the embedded switch themselves")
    elif not configured and args.verbose:  # (the usual case: said only when asked)
        say("the p4 extra is not installed: the ranks join the embedded switch themselves "
            "(no P4Runtime)")
    with ExitStack() as stack:
        try:
            switches = [stack.enter_context(embedded_switch(
                *args.switch_arg, host=args.address or "127.0.0.1", p4runtime=configured,
                start_timeout=start_left(args, 15.0), launcher=detached()))
                for _ in range(args.aggregators)]
        except RuntimeError as exc:
            if args.start_timeout is None:
                raise
            raise LaunchError(f"{exc} (--start-timeout {args.start_timeout:g} s)") from None
        addresses = [switch.address_text for switch in switches]
        print(f"ina-run: embedded ina-switch on {', '.join(addresses)} (its data port: "
              f"the ranks' INA_SWITCH)", file=sys.stderr, flush=True)
        if configured:
            settings = Settings.load()
            k = args.elements or settings.switch_elements or EMBEDDED_ELEMENTS
            files = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ina-run-")))
            write_p4info(files / "ina_aggregator.p4info.txt", schema.p4info(
                k, max(1, args.slot_base + (args.slots or settings.switch_slots)),
                settings.switch_block, settings.switch_value_bits))
            (files / "device_config").write_text("ina-switch: the software pipeline\n")
            code = run_configured(args, env, mpiexec,
                                  [switch.p4runtime_address for switch in switches],
                                  files / "ina_aggregator.p4info.txt",
                                  files / "device_config", addresses, "always",
                                  alive=lambda: all(s.process.poll() is None
                                                    for s in switches))
        else:
            env["INA_SWITCH"] = ",".join(addresses)
            code = start_ranks(args, env, mpiexec)
        for switch in switches:
            switch.stop()
            print(f"ina-run: {switch.final_status}" if args.verbose else
                  f"ina-run: {status_summary(switch.final_status)} (--verbose: its "
                  f"counters)", file=sys.stderr, flush=True)
        return code



def run_installed_tree(args: argparse.Namespace, topology: Topology, env: dict[str, str],
                       mpiexec: str) -> int:
    """The job on a tree of P4 targets (every aggregator of the file names its P4Runtime
    target; docs/trees.md, A tree of P4 switches): the root's job installed with the
    leaves as its workers (each at its address, its MAC and the root's port towards it),
    each leaf's with its ranks (--workers, or loopback) and a parent entry; the ranks get
    INA_TOPOLOGY with INA_JOB and their ports, join nothing, and each probes its leaf.
    Every target's job is torn down afterwards, whatever happened."""
    from ..control import ControlError, Controller, JobSpec, Parent, Worker
    from ..settings import Settings

    if not p4_extra_installed():
        raise LaunchError("an installed tree (the topology file's p4runtime targets) needs "
                          "the p4 extra: pip install 'ina-collectives[p4]'")
    if args.remote_hosts and not args.workers:
        raise LaunchError(f"-H names other hosts ({', '.join(args.remote_hosts)}): the "
                          f"leaves install each rank's address: give them in --workers")
    slots = args.slots or Settings.load().switch_slots
    job_id = args.job_id or random.SystemRandom().randrange(1, 65536)
    ranks = job_workers(args)[0]
    root = topology.root
    zero_mac = "00:00:00:00:00:00"
    jobs = [(root, JobSpec(job_id, [Worker(*leaf.address, leaf.mac or zero_mac,
                                           leaf.downlink_port or 0)
                                    for leaf in topology.children(root.name)], slots))]
    jobs += [(leaf, JobSpec(job_id, [ranks[r] for r in leaf.ranks], slots, parent=Parent(
        *root.address, topology.child_index(leaf.name), root.mac or zero_mac,
        leaf.uplink_port or 0))) for leaf in topology.leaves]
    push = args.push if args.p4info is not None or args.device_config is not None else "never"

    def session(target: str, push_now: str, known: Any = None) -> Any:
        return Controller(target, args.p4info, args.device_config, device_id=args.device_id,
                          push=push_now, timeout=args.control_timeout, known_p4info=known,
                          target=args.p4_target)

    with ExitStack() as stack:
        builds = []
        for a, job in jobs:
            try:
                with session(a.p4runtime, push) as controller:
                    controller.configure(job)
                    builds.append(controller.build)
                    known = controller.p4info_message
            except ControlError as exc:
                raise LaunchError(f"aggregator {a.name!r} ({aggregator_role(topology, a)}) "
                                  f"at {a.p4runtime}: {exc}") from None
            stack.callback(_teardown_in_session, session, a.p4runtime, job, known)
        kinds = {(b.k, b.block, b.value_bits) for b in builds}
        if len(kinds) > 1:
            raise LaunchError(f"the tree's targets run different builds (K, B, value "
                              f"bits: {sorted(kinds)}); a tree needs one")
        build = builds[0]
        print(f"ina-run: job {job_id} installed on the tree of {args.topology}: "
              + ", ".join(f"{a.name} at {a.p4runtime}" for a, _ in jobs)
              + f" (K {build.k}, S {slots}); the ranks join nothing", file=sys.stderr,
              flush=True)
        if (args.device_config is not None and bmv2_config(args.device_config)
                and "INA_INTERNAL_SWITCH_GSO" not in env):
            env["INA_INTERNAL_SWITCH_GSO"] = "0"
        env.update({"INA_JOB": str(job_id),
                    "INA_WORKER_PORTS": ",".join(str(w.udp_port) for w in ranks),
                    "INA_SWITCH_ELEMENTS": str(build.k), "INA_SWITCH_BLOCK": str(build.block),
                    "INA_SWITCH_VALUE_BITS": str(build.value_bits),
                    "INA_SWITCH_SLOTS": str(slots)})
        return start_ranks(args, env, mpiexec)


def load_topology(args: argparse.Namespace) -> Topology:
    """--topology's file, read and checked for -np ranks before anything starts (and,
    for the switches ina-run starts, every address on loopback); args.topology becomes
    its absolute path, as the switches and the ranks get it. TopologyError or
    LaunchError says what is wrong."""
    from ..protocol.topology import Topology

    args.topology = os.path.abspath(args.topology)
    topology = Topology.load(args.topology)
    topology.check(args.np)
    if args.switch == "embedded" and not topology.installed:
        elsewhere = [a for a in topology.aggregators
                     if not ipaddress.ip_address(a.address[0]).is_loopback]
        if elsewhere:
            raise LaunchError(
                f"{args.topology}: " + ", ".join(f"aggregator {a.name!r} at "
                                                 f"{a.address[0]}:{a.address[1]}"
                                                 for a in elsewhere)
                + f" {'is' if len(elsewhere) == 1 else 'are'} not on loopback (127.0.0.0/8), "
                "where ina-run starts the embedded switches; a switch on another host must "
                "be started there (ina-switch --topology FILE --name NAME), and then every "
                "switch of the file by you: give --switch running")
    return topology


def aggregator_role(topology: Topology, a: Aggregator) -> str:
    """An aggregator's place in the tree, in words: 'parent of rack0, rack1' or
    'serving ranks 0, 1, under spine'."""
    children = topology.children(a.name)
    if children:
        return "parent of " + ", ".join(c.name for c in children)
    ranks = ", ".join(str(r) for r in a.ranks)
    return (f"serving rank{'s' if len(a.ranks) > 1 else ''} {ranks}"
            + (f", under {a.parent}" if a.parent else ""))


def probe_aggregators(topology: Topology, timeout: float) -> None:
    """Every aggregator of the tree answers a probe for job 0 within ``timeout`` seconds
    (all probed at once); LaunchError naming each one that does not, and its place."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(topology.aggregators)) as pool:
        why = list(pool.map(lambda a: silent_aggregator(a.address, timeout),
                            topology.aggregators))
    silent = [f"aggregator {a.name!r} at {a.address[0]}:{a.address[1]} "
              f"({aggregator_role(topology, a)}) does not answer ({reason})"
              for a, reason in zip(topology.aggregators, why) if reason is not None]
    if silent:
        raise LaunchError("; ".join(silent) + f". With --switch running the switches of "
                          f"{topology.source} run already, each started on its host with "
                          f"ina-switch --topology FILE --name NAME")


def run_topology(args: argparse.Namespace, topology: Topology, env: dict[str, str],
                 mpiexec: str) -> int:
    """The job on --topology's tree: its switches started here, one ina-switch per
    aggregator at the file's address with --topology FILE --name NAME, root first (or,
    with --switch running, each probed); the ranks get INA_TOPOLOGY and no INA_SWITCH,
    and join their leaves themselves. The switches are stopped afterwards, whatever
    happened."""
    from ..switch import status_summary
    from ..switch.embedded import embedded_switch

    env.pop(env_name("switch"), None)
    env[env_name("topology")] = args.topology
    if topology.installed:
        return run_installed_tree(args, topology, env, mpiexec)
    if args.verbose:
        say(f"the tree of {args.topology}: {topology.describe()}; the ranks join their "
            f"leaves themselves")
    if args.switch == "running":
        probe_aggregators(topology, start_left(args, min(args.control_timeout, 3.0)))
        if args.verbose:
            say(f"all {len(topology.aggregators)} aggregators of the tree answered their "
                f"probes")
        return start_ranks(args, env, mpiexec)
    started = [topology.root, *(a for a in topology.aggregators if a is not topology.root)]
    with ExitStack() as stack:
        switches = []
        for a in started:
            host, port = a.address
            try:
                switch = stack.enter_context(embedded_switch(
                    *args.switch_arg, "--port", str(port), "--topology", args.topology,
                    "--name", a.name, host=host, start_timeout=start_left(args, 15.0),
                    launcher=detached()))
            except RuntimeError as exc:
                bound = ("" if args.start_timeout is None else
                         f" (--start-timeout {args.start_timeout:g} s)")
                raise LaunchError(f"aggregator {a.name!r} at {host}:{port} "
                                  f"({aggregator_role(topology, a)}): "
                                  f"{str(exc).strip()}{bound}") from None
            if switch.addresses != [a.address]:
                raise LaunchError(f"aggregator {a.name!r}: its ina-switch listens on "
                                  f"{switch.address_text}, not at the file's {host}:{port}")
            switches.append((a, switch))
        print(f"ina-run: embedded ina-switch per aggregator of {args.topology}: "
              + ", ".join(f"{a.name} on {switch.address_text}" for a, switch in switches)
              + " (the ranks' INA_TOPOLOGY)", file=sys.stderr, flush=True)
        code = start_ranks(args, env, mpiexec)
        for a, switch in switches:
            switch.stop()
            print(f"ina-run: {a.name}: {switch.final_status}" if args.verbose else
                  f"ina-run: {a.name}: {status_summary(switch.final_status)} (--verbose: "
                  f"its counters)", file=sys.stderr, flush=True)
        return code
