"""The software aggregator: the same wire format and semantics as the P4 program, the
embedded default on one machine and in tests.

``server``: SoftwareSwitch, one UDP socket around the compiled data path
(_fast/switch_loop.pyx) and its control packets; ``p4runtime_service``: the P4Runtime
subset a controller uses, served in a thread that hands its work to the data-path loop;
``embedded``: an ``ina-switch`` process for a job;
``faults``: fault injection of a running switch; ``cli``: ``ina-switch``. Its status
line is ``key=value`` fields (``parse_status`` reads one).
"""
from .cli import main
from .faults import send_faults
from .server import SoftwareSwitch, parse_status, status_summary

__all__ = ["SoftwareSwitch", "send_faults", "parse_status", "status_summary", "main"]
