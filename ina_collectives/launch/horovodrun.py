"""horovodrun's command line in ina-run: the options people type, taken or refused.

-H/--hostfile name the hosts and their slots (other machines' ranks start through the
MPI launcher's bootstrap, ssh by default: cli.py); the setting options become HOROVOD_*
and INA_* variables of the ranks; options for other controllers exit 2 naming the
option.
"""
from __future__ import annotations

import argparse
import socket
from pathlib import Path
from typing import Any

MiB = 1 << 20

# horovodrun options that set a setting the ranks read: option -> (value type, metavar,
# [(variable, value from the option's)]). Both Horovod's variable (for scripts that read
# it) and ours (which wins over one already in the environment) are set.
HOROVOD_SETTINGS: dict[str, tuple[Any, str, list[tuple[str, Any]]]] = {
    "--fusion-threshold-mb": (float, "MB", [
        ("HOROVOD_FUSION_THRESHOLD", lambda mb: str(int(mb * MiB))),
        ("INA_FUSION_THRESHOLD", lambda mb: str(int(mb * MiB)))]),
    "--cycle-time-ms": (float, "MS", [
        ("HOROVOD_CYCLE_TIME", lambda ms: f"{ms:g}"),
        ("INA_CYCLE_TIME", lambda ms: f"{ms / 1000:g}")]),
    "--stall-check-warning-time-seconds": (float, "SECONDS", [
        ("HOROVOD_STALL_CHECK_TIME_SECONDS", lambda v: f"{v:g}"),
        ("INA_STALL_WARNING_TIME", lambda v: f"{v:g}")]),
    "--stall-check-shutdown-time-seconds": (float, "SECONDS", [
        ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", lambda v: f"{v:g}"),
        ("INA_STALL_SHUTDOWN_TIME", lambda v: f"{v:g}")]),
    "--log-level": (str.upper, "LEVEL", [
        ("HOROVOD_LOG_LEVEL", lambda v: v),
        ("INA_LOG_LEVEL", lambda v: {"TRACE": "DEBUG", "FATAL": "CRITICAL"}.get(v, v))]),
}
HOROVOD_LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")

# horovodrun options ina-run refuses, naming them: (option strings, takes a value, why).
NO_SSH = ("ina-run reaches other hosts through mpiexec's bootstrap: give its command "
          "with --bootstrap-exec (e.g. 'ssh -p 2222')")
HOROVOD_UNSUPPORTED: list[tuple[tuple[str, ...], bool, str]] = [
    (("--gloo",), False, "ina-run runs the ranks under MPI (mpiexec); leave it out"),
    (("--jsm",), False, "ina-run runs the ranks under MPI's mpiexec"),
    (("--mpi-args",), True, "ina-run builds the mpiexec command itself"),
    (("-p", "--ssh-port"), True, NO_SSH),
    (("-i", "--ssh-identity-file"), True, NO_SSH),
    (("--network-interfaces", "--network-interface", "--nics"), True,
     "the ranks reach the switch at the address it is given (the embedded one: loopback)"),
    (("--tcp",), False, "the ranks talk to the switch over UDP and to each other over MPI"),
    (("--timeline-filename",), True, "ina_collectives.torch writes no timeline"),
    (("--timeline-mark-cycles",), False, "ina_collectives.torch writes no timeline"),
    (("--autotune",), False, "there is no autotuner: set --fusion-threshold-mb and "
                             "--cycle-time-ms"),
    (("--autotune-log-file",), True, "there is no autotuner"),
    (("--hierarchical-allreduce", "--hierarchical-allgather"), False,
     "the switch aggregates every rank's tensor itself; there is no hierarchy"),
    (("--cache-capacity",), True, "ina_collectives.torch has no response cache"),
    (("--disable-cache",), False, "ina_collectives.torch has no response cache"),
    (("--no-stall-check",), False, "give --stall-check-shutdown-time-seconds a large "
                                   "bound instead"),
    (("--output-filename",), True, "the ranks' output goes to ina-run's own"),
    (("--config-file",), True, "give the options on the command line"),
    (("--min-np", "--max-np", "--slots-per-host", "--host-discovery-script",
      "--elastic-timeout", "--reset-limit", "--blacklist-cooldown-range"), True,
     "elastic jobs are not supported"),
]


class _Unsupported(argparse.Action):
    """A horovodrun option ina-run refuses: exit 2 naming it and why."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        parser.error(f"{option_string} (a horovodrun option) is not supported by ina-run: "
                     f"{self.const}")


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """-H's ``host:slots[,host:slots...]``; a host without ``:slots`` has one slot."""
    hosts = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        name, _, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        if name.startswith("[") and name.endswith("]"):  # [::1]:2
            name = name[1:-1]
        hosts.append((name, _slot_count(slots, item)))
    if not hosts:
        raise ValueError(f"no host in {text!r}")
    return hosts


def read_hostfile(path: Path) -> list[tuple[str, int]]:
    """A hostfile as horovodrun reads it: one ``host slots=N`` (or ``host:N``) a line;
    blank lines and ``#`` comments are skipped; a host alone has one slot."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror}") from None
    hosts = []
    for number, raw in enumerate(lines, 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if "=" in line:
            key, _, value = "".join(fields[1:]).partition("=")
            if len(fields) < 2 or key != "slots":
                raise ValueError(f"{path}:{number}: expected 'host slots=N', got {raw!r}")
            hosts.append((fields[0], _slot_count(value, raw)))
        elif len(fields) == 1:
            hosts.extend(parse_hosts(fields[0]))
        else:
            raise ValueError(f"{path}:{number}: expected 'host slots=N', got {raw!r}")
    if not hosts:
        raise ValueError(f"{path} names no host")
    return hosts


def _slot_count(text: str, item: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"{item!r}: slots must be a whole number of at least 1")
    return int(text)


def is_local_host(name: str) -> bool:
    """localhost, a loopback address, this machine's name, or an address of one of its
    interfaces (one a socket can bind). Names are not looked up in DNS (no waits)."""
    lowered = name.lower()
    if lowered in ("localhost", "localhost.localdomain", "ip6-localhost", "::1"):
        return True
    if lowered.startswith("127.") and lowered.replace(".", "").isdigit():
        return True
    mine = {socket.gethostname().lower(), socket.getfqdn().lower()}
    if lowered in mine | {m.split(".", 1)[0] for m in mine}:
        return True
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, name)
        except OSError:
            continue
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.bind((name, 0))
            except OSError:
                return False
            return True
    return False


HOROVODRUN_HELP = (
    "ina-run takes horovodrun's command line where it can: -np, -H/--hosts and "
    "--hostfile (other machines' ranks start through mpiexec's bootstrap), "
    "--verbose, --start-timeout, --mpi (the ranks are MPI ranks anyway), and "
    + ", ".join(HOROVOD_SETTINGS) + " (passed to the ranks as HOROVOD_* and INA_* "
    "variables). It refuses, naming them: " + ", ".join(
        "/".join(names) for names, _, _ in HOROVOD_UNSUPPORTED) + ".")


def add_options(parser: argparse.ArgumentParser) -> None:
    """horovodrun's options, in their own group of ina-run's help."""
    hv = parser.add_argument_group("horovodrun's options", HOROVODRUN_HELP)
    where = hv.add_mutually_exclusive_group()
    where.add_argument("-H", "--hosts", metavar="HOST:SLOTS[,HOST:SLOTS...]",
                       help="hosts and their slots, as horovodrun's -H; the slots at least "
                            "-np. Other machines need --address (or --switch HOST:PORT)")
    where.add_argument("--hostfile", type=Path, metavar="FILE",
                       help="hosts as horovodrun's --hostfile: 'host slots=N' (or host:N) "
                            "a line; the same rules as -H")
    hv.add_argument("--verbose", action="store_true",
                    help="say what ina-run does on stderr: the hosts, the switch's address, "
                         "the job, the variables set for the ranks, the mpiexec command")
    hv.add_argument("--start-timeout", type=float, metavar="SECONDS",
                    help="bound on the job's start: the switch starting (embedded) or "
                         "answering its probe (--switch HOST:PORT), and every rank "
                         "starting; exit 2 if not. Default: the embedded switch gets 15 s, "
                         "a given one 3 s, the ranks unbounded")
    hv.add_argument("--mpi", action="store_true",
                    help="accepted and ignored: the ranks run under mpiexec anyway")
    for option, (kind, metavar, variables) in HOROVOD_SETTINGS.items():
        hv.add_argument(option, type=kind, metavar=metavar,
                        help="sets " + " and ".join(name for name, _ in variables))
    for names, takes_value, why in HOROVOD_UNSUPPORTED:
        hv.add_argument(*names, action=_Unsupported, nargs=1 if takes_value else 0,
                        const=why, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the values parse_args took; sets args.host_slots (None without hosts)."""
    if args.start_timeout is not None and not args.start_timeout > 0:
        parser.error(f"--start-timeout must be > 0 seconds, got {args.start_timeout:g}")
    if args.log_level is not None and args.log_level not in HOROVOD_LOG_LEVELS:
        parser.error(f"--log-level must be one of {', '.join(HOROVOD_LOG_LEVELS)}, got "
                     f"{args.log_level}")
    for option in HOROVOD_SETTINGS:
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if isinstance(value, float) and not (value > 0 or option == "--fusion-threshold-mb"
                                             and value == 0):
            parser.error(f"{option} must be > 0, got {value:g}")
    args.host_slots, args.host_list, args.remote_hosts = None, [], []
    if args.hosts is not None or args.hostfile is not None:
        try:
            hosts = (parse_hosts(args.hosts) if args.hosts is not None
                     else read_hostfile(args.hostfile))
        except ValueError as exc:
            parser.error(f"{'-H' if args.hosts is not None else '--hostfile'}: {exc}")
        args.host_list = hosts
        args.remote_hosts = sorted({name for name, _ in hosts if not is_local_host(name)})
        args.host_slots = sum(slots for _, slots in hosts)
        if args.host_slots < args.np:
            parser.error(f"-np {args.np} asks for more ranks than the hosts' "
                         f"{args.host_slots} slot(s)")


def environment(args: argparse.Namespace) -> dict[str, str]:
    """The variables horovodrun's setting options give the ranks."""
    env = {}
    for option, (_, _, variables) in HOROVOD_SETTINGS.items():
        value = getattr(args, option.lstrip("-").replace("-", "_"))
        if value is not None:
            env.update((name, convert(value)) for name, convert in variables)
    return env


