"""The help of ina-run, ina-switch and the controller's subcommands reads well: a
default is shown where it says something (never "default: None" for an option whose
absence means something else, nor for a required option) and as a number reads."""
from __future__ import annotations

import argparse
import re
from unittest import mock

import pytest


class _Parser(Exception):
    pass


def _caught(main) -> argparse.ArgumentParser:
    """The parser a program's main() builds, taken before it parses anything."""
    def catch(parser, *args, **kwargs):
        raise _Parser(parser)
    with mock.patch.object(argparse.ArgumentParser, "parse_args", catch), \
            pytest.raises(_Parser) as caught:
        main([])
    return caught.value.args[0]


def _helps() -> dict[str, str]:
    """Each program's (and each subcommand's) help text, as --help prints it, unwrapped."""
    from ina_collectives.control.cli import _parser
    from ina_collectives.launch.cli import parse_args
    from ina_collectives.switch.cli import main as switch_main
    parsers = {"ina-run": _caught(parse_args), "ina-switch": _caught(switch_main),
               "control": _parser()}
    for action in parsers["control"]._actions:
        if isinstance(action, argparse._SubParsersAction):
            parsers.update((f"control {name}", sub) for name, sub in action.choices.items())
    return {name: " ".join(p.format_help().split()) for name, p in parsers.items()}


def test_no_default_is_none_and_numbers_read_as_numbers():
    helps = _helps()
    assert {"control show", "control configure", "control teardown", "control mode"} <= \
        set(helps)
    for name, text in helps.items():
        assert "default: None" not in text and "default: False" not in text, name
        assert not re.search(r"default: \d+\.0\)", text), name


def test_the_options_people_met():
    helps = _helps()
    # A required option: no default to show.
    for name in ("control show", "control configure", "control mode"):
        assert "--target HOST:PORT the P4Runtime target the pipeline" in helps[name] or \
            "--target HOST:PORT the P4Runtime target --device-id" in helps[name], helps[name]
    assert "--job-id JOB_ID 1..65535 --workers FILE" in helps["control configure"]
    # ina-switch: --threads says its default in words; a worker id reads as one.
    switch = helps["ina-switch"]
    assert re.search(r"--threads N .* Default: one per core this process may use; 1 with "
                     r"--p4runtime-port, which serves one --send-path", switch), switch
    assert re.search(r"--straggler-worker STRAGGLER_WORKER fault injection: the worker id "
                     r"whose packets --straggler-delay-ms holds back \(in every job\) "
                     r"\(default: 0\)", switch), switch
    assert "--device-id DEVICE_ID the P4Runtime device id (default: 1)" in switch
    # ina-run: --elements as it now works.
    assert re.search(r"--elements K K, the values in each of the job's packets: every rank, "
                     r"on every host, gets INA_SWITCH_ELEMENTS=K\. Default: each rank sizes "
                     r"its packets to the MTU of its path", helps["ina-run"]), helps["ina-run"]
    assert "--no-rank-prefix" in helps["ina-run"]
