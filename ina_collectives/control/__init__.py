"""The control plane: configures an INA job on any aggregator over P4Runtime.

``schema``: names, ids and widths of the P4 program's entities (and the P4Info of any K
and S), shared with the software switch's P4Runtime service and p4/gen.py; ``job``: what
is installed for one job and the workers file; ``pipeline``: the device config a push
carries (BMv2's JSON, or a Tofino build packed as bf_switchd reads it); ``controller``:
the Controller (p4runtime-shell, the ``[p4]`` extra, imported when it connects); ``cli``:
``python -m ina_collectives.control``.
"""
from __future__ import annotations

from ..errors import ControlError, TargetUnavailable
from .cli import main
from .controller import Controller, write_p4info
from .job import JobSpec, Parent, Worker, load_workers

__all__ = ["Controller", "JobSpec", "Parent", "Worker", "load_workers", "ControlError",
           "TargetUnavailable", "main", "write_p4info"]
