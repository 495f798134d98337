"""The help of the command-line programs (ina-switch, the controller's subcommands):
each option's default shown where it says something."""
from __future__ import annotations

import argparse

__all__ = ["DefaultsHelpFormatter"]


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's "(default: X)" after each option's help, except where it would
    mislead: a required option (it has none), a default of None, False or nothing (the
    option left out; its help says what that means), and help that states its default
    itself. A float reads as %g: 0, not 0.0."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (action.required or default is None or default is False or default == []
                or default == argparse.SUPPRESS or "default" in text.lower()):
            return action.help
        if isinstance(default, float):
            return text + " (default: %(default)g)"
        return super()._get_help_string(action)
