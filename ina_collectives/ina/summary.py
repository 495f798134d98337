"""``summarize``: stats() in one paragraph, the one ina_collectives.summary() (and each
API's) prints at the end of training. The counts are the chooser's, worded by
collectives/stats.py; the sentences about the switch (why it did not serve, its state,
this rank's packets, the kernels) are the INA engine's, from what its report put in the
snapshot (``InaEngine.report``, or ``offload.ABSENT`` without one)."""
from __future__ import annotations

from typing import Any

from ..collectives.stats import paragraph
from .engine import InaEngine

# What the kernels setting's values are, in the summary's words.
KERNELS = {"fast": "compiled", "numpy": "the NumPy reference (the switch does not serve "
                                        "with it)"}


def summarize(snapshot: dict[str, Any]) -> str:
    """One paragraph a user can print at the end of training, from a stats() snapshot:
    what the switch served (calls and share of the bytes), what took which other engine
    (ring, mpi, or gloo: the peers' own allreduce without an MPI job), why the switch did
    not serve (its most frequent reasons), the switch's state, the packets this rank
    sent, and the kernels that ran."""
    return paragraph(snapshot, InaEngine.name, _about_the_switch)


def _about_the_switch(snapshot: dict[str, Any], reasons: list[tuple[str, int]]) -> str:
    """The summary's sentences about the INA engine: its reasons (the three most
    frequent), the switch's state, this rank's packets and the kernels."""
    text = ""
    if reasons:
        shown = "; ".join(f"{why} ({n})" for why, n in reasons[:3])
        more = f"; and {len(reasons) - 3} more" if len(reasons) > 3 else ""
        text += f" Why not the switch: {shown}{more}."
    switch = snapshot.get("switch") or {}
    if switch.get("configured") is False:
        text += " No switch configured (INA_SWITCH is unset)."
    elif switch:
        state = "serving" if switch.get("serving") else "not serving"
        tree = switch.get("tree")
        where = (f" through the tree {tree['described']} (this rank under {tree['leaf']})"
                 if tree else "")
        text += (f" Switch: {state}{where}, {switch.get('outages', 0)} outage(s), "
                 f"{switch.get('returns', 0)} return(s).")
    transport = snapshot.get("transport") or {}
    if transport.get("sent"):
        sent, again = int(transport["sent"]), int(transport.get("retransmitted", 0))
        text += (f" This rank sent {sent} packets, {again} of them again after a timeout "
                 f"({100.0 * again / sent:.1f}%).")
    kernels = snapshot.get("kernels")
    if kernels:
        text += f" Kernels: {KERNELS.get(kernels, kernels)}."
    return text
