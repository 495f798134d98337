"""``ina-switch`` / ``python -m ina_collectives.switch``: the software aggregator as a
command, with fault injection, a status line and a clean stop on SIGINT/SIGTERM."""
from __future__ import annotations

import argparse
import logging
import signal
import sys

from .. import protocol as P
from .server import SoftwareSwitch

DESCRIPTION = "The software INA aggregator (the protocol of p4/ina_aggregator.p4)."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ina-switch", description=DESCRIPTION)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind")
    parser.add_argument("--port", type=int, default=P.UDP_PORT,
                        help=f"UDP port (default {P.UDP_PORT}; 0 picks a free one)")
    parser.add_argument("--idle", type=float, default=60.0,
                        help="free a job that sent nothing for this many seconds")
    parser.add_argument("--pool-slots", type=int, default=1024,
                        help="slots shared by all jobs (each has two versions); a job that "
                             "does not fit is refused")
    parser.add_argument("--max-elements", type=int, default=P.MAX_ELEMENTS,
                        help="largest K (int32 values per packet) a job may use")
    parser.add_argument("--p4runtime-port", type=int, default=None, metavar="PORT",
                        help="serve P4Runtime (gRPC) on --host:PORT so that a controller "
                             "(ina_collectives.control) installs jobs; 0 picks a free port. "
                             "Needs the p4 extra")
    parser.add_argument("--device-id", type=int, default=1,
                        help="the P4Runtime device id (default 1)")
    parser.add_argument("--stats-interval", type=float, default=0.0,
                        help="print a status line every so many seconds (0: never)")
    parser.add_argument("--log-level", default="INFO")
    for name in P.FAULT_FIELDS:
        flag = "--" + name.replace("_ms", "").replace("_", "-") + ("-ms" if "delay" in name else "")
        parser.add_argument(flag, dest=name, type=float, default=0.0,
                            help="fault injection: " + ("milliseconds added" if "delay" in name
                                                        else "probability per packet"))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="ina-switch %(levelname)s %(message)s")
    try:
        switch = SoftwareSwitch(args.host, args.port, args.idle, args.pool_slots,
                                args.max_elements, args.p4runtime_port, args.device_id)
    except OSError as exc:
        print(f"ina-switch: cannot bind {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"ina-switch: --p4runtime-port needs the p4 extra (pip install "
              f"'ina-collectives[p4]'): {exc}", file=sys.stderr)
        return 2
    try:
        switch.aggregator.set_faults(**{name: getattr(args, name) for name in P.FAULT_FIELDS})
    except ValueError as exc:
        parser.error(str(exc))
    signal.signal(signal.SIGTERM, switch.stop)
    signal.signal(signal.SIGINT, switch.stop)
    # The first line says where it listens (tests and launchers read it); with P4Runtime,
    # where that listens comes first.
    if switch.p4runtime is not None:
        print(f"ina-switch p4runtime on {switch.p4runtime.host}:{switch.p4runtime.port}",
              flush=True)
    print(f"ina-switch listening on {switch.address[0]}:{switch.address[1]}", flush=True)
    switch.serve(args.stats_interval)
    print(switch.status_line(), flush=True)
    return 0

