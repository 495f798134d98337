"""``ina-switch`` / ``python -m ina_collectives.switch``: the software aggregator as a
command, with fault injection, a status line and a clean stop on SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from .. import protocol as P
from ..control import schema as S
from ..errors import TopologyError
from ..helpformat import DefaultsHelpFormatter
from ..protocol.topology import Topology
from .server import SoftwareSwitch
from .shards import Shards

DESCRIPTION = "The software INA aggregator (the protocol of p4/ina_aggregator.p4)."


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _port(text: str) -> int:
    """A UDP/TCP port number for argparse: 0 (a free one) .. 65535, or a clear error."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port {value} is out of range (0..65535)")
    return value


def _ipv4(text: str) -> str:
    """A dotted IPv4 address for argparse (the switch compares senders' addresses with
    it), or a clear error."""
    try:
        socket.inet_aton(text)
    except OSError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 address") from None
    return text


def _log_level(text: str) -> str:
    if text.upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"{text!r} is no log level (one of "
                                         f"{', '.join(LOG_LEVELS)})")
    return text.upper()


def main(argv: list[str] | None = None) -> int:
    """``ina-switch``: run the software switch until Ctrl-C or SIGTERM; the exit code."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        __version__ = version("ina-collectives")
    except PackageNotFoundError:  # a source tree that was never installed
        __version__ = "(not installed)"

    parser = argparse.ArgumentParser(prog="ina-switch", description=DESCRIPTION,
                                     formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {__version__} (wire format {P.PROTOCOL_VERSION})")
    parser.add_argument("--host", default=None,
                        help="address to bind: loopback by default, so only this machine "
                             "reaches it; 0.0.0.0 (or the address other hosts reach) serves "
                             "ranks on other machines; with --topology, the file's address "
                             "(default: 127.0.0.1)")
    parser.add_argument("--port", type=_port, default=None,
                        help=f"UDP port (0 picks a free one); {P.UDP_PORT} by default, or "
                             f"with --topology the file's")
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="shards: N aggregators, each its own thread, UDP port (--port, "
                             "--port + 1, ...; each a free one with --port 0) and slots; "
                             "jobs stripe their calls across all of them (INA_SWITCH lists "
                             "the ports the first line prints). Default: one per core this "
                             "process may use; 1 with --p4runtime-port, which serves one")
    parser.add_argument("--send-path", choices=("segment", "sendmmsg"), default="segment",
                        help="how results leave: UDP segmentation offload where the kernel "
                             "takes it, or sendmmsg (the fallback, forced)")
    parser.add_argument("--idle", type=float, default=60.0,
                        help="free a job that sent nothing for this many seconds")
    parser.add_argument("--pool-slots", type=int, default=1024,
                        help="slots shared by all jobs (each has two versions); a job is "
                             "granted what is free (see --job-share), refused if none is")
    parser.add_argument("--job-share", type=float, default=1.0, metavar="F",
                        help="the most of the pool one job is granted (0 < F <= 1; default "
                             "1); a job gets what it asks for, what is free or this, the "
                             "least, and asks again for the rest when slots free up")
    parser.add_argument("--max-elements", type=int, default=P.MAX_ELEMENTS,
                        help="largest K (int32 values per packet) a job may use")
    parser.add_argument("--like", choices=sorted(S.TOFINO), default=None,
                        help="serve as that Tofino build of the P4 program would (p4/README.md, "
                             "Tofino): announce its capabilities (none), drop the packets "
                             "they leave out (openings, predicted windows, quorum stamps, "
                             "result requests), send no NACKs, take jobs of its K, B, n and "
                             "32-bit values only")
    parser.add_argument("--p4runtime-port", type=_port, default=None, metavar="PORT",
                        help="serve P4Runtime (gRPC) on --p4runtime-host:PORT so that a "
                             "controller (ina_collectives.control) installs jobs; 0 picks a "
                             "free port. Needs the p4 extra")
    parser.add_argument("--p4runtime-host", default="127.0.0.1", metavar="ADDR",
                        help="address P4Runtime listens on: loopback, whatever --host is, "
                             "unless another machine's controller must reach it")
    parser.add_argument("--device-id", type=int, default=1,
                        help="the P4Runtime device id")
    tree = parser.add_argument_group("an aggregation tree (docs/trees.md)")
    tree.add_argument("--topology", type=Path, metavar="FILE",
                      help="the job's topology file (TOML): this switch serves as the "
                           "aggregator --name of it, at its address unless --host/--port "
                           "say otherwise; a leaf sends its workers' partial sums up to "
                           "its parent")
    tree.add_argument("--name", help="which aggregator of --topology this switch is")
    parser.add_argument("--stats-interval", type=float, default=0.0,
                        help="print a status line every so many seconds (0: never)")
    parser.add_argument("--log-level", type=_log_level, default="INFO",
                        help=f"one of {', '.join(LOG_LEVELS)}")
    faults = parser.add_argument_group(
        "fault injection (for tests; changeable while it runs: "
        "ina_collectives.switch.send_faults)")
    faults.add_argument("--faults-from", type=_ipv4, default="127.0.0.1", metavar="ADDR",
                        help="the only address fault settings are taken from")
    for name in P.FAULT_FIELDS:
        flag = "--" + name.replace("_ms", "").replace("_", "-") + ("-ms" if "delay" in name else "")
        faults.add_argument(flag, dest=name, type=float, default=0.0,
                            help="fault injection: " + (
                                "the worker id whose packets --straggler-delay-ms "
                                "holds back (in every job)"
                                if name == "straggler_worker" else
                                "nonzero: no answer to a PROBE of job 0 (as a P4 switch)"
                                if name == "probes_from_installed_only" else
                                "data packets served a second, at most (a slow target, "
                                "such as BMv2)" if name == "service_pps" else
                                "milliseconds added"
                                if "delay" in name else "probability per packet"))
    args = parser.parse_args(argv)

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="ina-switch %(levelname)s %(message)s")
    threads = args.threads or (1 if args.p4runtime_port is not None or args.topology
                               else len(os.sched_getaffinity(0)))
    if threads < 1:
        parser.error(f"--threads must be 1 or more, got {threads}")
    if threads > 1 and args.p4runtime_port is not None:
        parser.error("--p4runtime-port serves one shard: use --threads 1 with it")
    if not 0 < args.job_share <= 1:
        parser.error(f"--job-share must be in (0, 1], got {args.job_share}")
    tree_options: list[dict] = []
    if (args.topology is None) != (args.name is None):
        parser.error("--topology and --name go together")
    if args.topology is not None:
        try:
            topology = Topology.load(args.topology)
            me = topology[args.name]
        except TopologyError as exc:
            parser.error(str(exc))
        if (args.threads or 1) > 1 or args.p4runtime_port is not None:
            parser.error("a tree's aggregator runs without P4Runtime, one shard per tree: "
                         "no --threads")
        args.host = me.address[0] if args.host is None else args.host
        args.port = me.address[1] if args.port is None else args.port
        if me.parent is not None:  # a leaf: one shard per tree, shard t under root t
            tree_options = [dict(parent=root.address, up_worker=topology.child_index(me.name),
                                 up_n=len(topology.children(root.name)))
                            for root in topology.roots]
            threads = len(tree_options)
    args.host = "127.0.0.1" if args.host is None else args.host
    args.port = P.UDP_PORT if args.port is None else args.port
    options = dict(idle_seconds=args.idle, pool_slots=args.pool_slots,
                   max_elements=args.max_elements, job_share=args.job_share,
                   gso=args.send_path == "segment", like=args.like)
    try:
        if threads == 1:
            switch = SoftwareSwitch(args.host, args.port, p4runtime_port=args.p4runtime_port,
                                    device_id=args.device_id,
                                    p4runtime_host=args.p4runtime_host,
                                    faults_from=args.faults_from, **options,
                                    **(tree_options[0] if tree_options else {}))
        else:
            switch = Shards(threads, args.host, args.port, faults_from=args.faults_from,
                            each=tree_options or None, **options)
    except OSError as exc:
        print(f"ina-switch: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"ina-switch: --p4runtime-port needs the p4 extra (pip install "
              f"'ina-collectives[p4]'): {exc}", file=sys.stderr)
        return 2
    shards = switch.shards if threads > 1 else [switch]
    try:
        for shard in shards:
            shard.set_faults(**{name: getattr(args, name) for name in P.FAULT_FIELDS})
    except ValueError as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, switch.stop)
    signal.signal(signal.SIGINT, switch.stop)
    # The first line says where it listens, every shard's address (tests and launchers
    # read it; it is what INA_SWITCH says); with P4Runtime, where that listens comes first.
    if threads == 1 and switch.p4runtime is not None:
        print(f"ina-switch p4runtime on {switch.p4runtime.host}:{switch.p4runtime.port}",
              flush=True)
    listening = ",".join("%s:%d" % shard.address[:2] for shard in shards)
    print(f"ina-switch listening on {listening}", flush=True)
    switch.serve(args.stats_interval)
    print(switch.status_line(), flush=True)
    return 0

