"""The training demo with one straggler, in sync and in quorum n - 1 of n: the loss
against wall time of both runs in one PNG (issue 17's target: quorum reaches the sync
run's final loss within 1% in less wall time). Quorum drops most of the straggler's
gradients, so it needs more epochs for the same loss: it runs --quorum-epochs (default
twice --epochs), and the figure says when it first reaches sync's final loss.

    python -m bench.quorum_training                 # 4 ranks, the last one's packets 10 ms late
    python -m bench.quorum_training --delay-ms 20 --epochs 3
    python -m bench.quorum_training --compute-delay-ms 50   # the last rank computes longer

The PNG and JSON go to bench/results/; docs/quorum_training.png is one run's figure.

The straggler is a slow path: the embedded switch holds each packet of the last rank
back (ina-switch --straggler-worker, --straggler-delay-ms). A rank that starts its steps
late instead holds every rank back in either mode, at the call's agreement
(docs/quorum.md, Limits).
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
EPOCH_LINE = re.compile(r"^\s*(\d+)\s+([0-9.]+)(?:\s+([0-9.]+))?")


def train(n: int, delay_ms: float, compute_delay_ms: float, epochs: int,
          quorum: int) -> dict:
    """One run of examples/train_mlp.py under ina-run: its epochs' losses and times."""
    straggler = [f"--switch-arg={a}" for a in ("--straggler-worker", str(n - 1),
                                                "--straggler-delay-ms", str(delay_ms))
                 ] if delay_ms else []
    command = [str(Path(sys.executable).with_name("ina-run")), "-np", str(n), *straggler,
               "--", sys.executable, str(ROOT / "examples" / "train_mlp.py"),
               "--epochs", str(epochs), "--quorum", str(quorum),
               "--compute-delay-ms", str(compute_delay_ms)]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    losses, seconds = [], [0.0]
    for line in proc.stdout.splitlines():
        m = EPOCH_LINE.match(line)
        if m and int(m.group(1)) == len(losses):
            losses.append(float(m.group(2)))
            if m.group(3):
                seconds.append(seconds[-1] + float(m.group(3)))
    if len(losses) != epochs + 1 or len(seconds) != epochs + 1:
        raise SystemExit(f"could not read the epochs from:\n{proc.stdout}")
    return {"quorum": quorum, "loss": losses, "seconds": seconds, "output": proc.stdout}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=4)
    parser.add_argument("--delay-ms", type=float, default=None,
                        help="how long the switch holds each packet of the last rank "
                             "(default 10, or 0 with --compute-delay-ms)")
    parser.add_argument("--compute-delay-ms", type=float, default=0.0,
                        help="the last rank computes each step this much longer (a worker "
                             "late to every call; no other delay, no barrier between steps)")
    parser.add_argument("--epochs", type=int, default=5, help="epochs of the sync run")
    parser.add_argument("--quorum-epochs", type=int, default=0,
                        help="epochs of the quorum run (default twice --epochs)")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "quorum_training")
    args = parser.parse_args(argv)
    if args.np < 2:
        parser.error("--np must be 2 or more")
    if args.delay_ms is None:
        args.delay_ms = 0.0 if args.compute_delay_ms else 10.0
    if not 0 <= args.delay_ms <= 10_000 or not 0 <= args.compute_delay_ms <= 10_000:
        parser.error("--delay-ms and --compute-delay-ms must be in [0, 10000]")
    if not args.delay_ms and not args.compute_delay_ms:
        parser.error("give a straggler: --delay-ms or --compute-delay-ms")
    if args.epochs < 1 or args.quorum_epochs < 0:
        parser.error("--epochs must be 1 or more, --quorum-epochs 0 (twice --epochs) or more")
    runs = [train(args.np, args.delay_ms, args.compute_delay_ms, args.epochs, 0),
            train(args.np, args.delay_ms, args.compute_delay_ms,
                  args.quorum_epochs or 2 * args.epochs, args.np - 1)]
    sync, quorum = runs
    difference = (quorum["loss"][-1] - sync["loss"][-1]) / sync["loss"][-1]
    seconds_per_epoch = [r["seconds"][-1] / (len(r["loss"]) - 1) for r in runs]
    # When quorum first reaches the sync run's final loss (within 1%), if it does.
    reached = next((t for t, loss in zip(quorum["seconds"], quorum["loss"])
                    if loss <= sync["loss"][-1] * 1.01), None)
    summary = {"np": args.np, "delay_ms": args.delay_ms,
               "compute_delay_ms": args.compute_delay_ms, "epochs": args.epochs,
               "quorum_epochs": len(quorum["loss"]) - 1,
               "sync_final_loss": sync["loss"][-1], "quorum_final_loss": quorum["loss"][-1],
               "final_relative_difference": difference,
               "sync_seconds": sync["seconds"][-1],
               "quorum_seconds": quorum["seconds"][-1],
               "epoch_speedup": seconds_per_epoch[0] / seconds_per_epoch[1],
               "quorum_reaches_sync_loss_at": reached,
               "time_to_sync_loss_speedup": (sync["seconds"][-1] / reached
                                             if reached else None)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(
        {"summary": summary, "runs": [{k: v for k, v in r.items() if k != "output"}
                                      for r in runs]}, indent=1))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for run, label in ((sync, "sync (every worker)"),
                       (quorum, f"quorum {args.np - 1} of {args.np}")):
        ax.plot(run["seconds"], run["loss"], marker="o", label=label)
    ax.axhline(sync["loss"][-1] * 1.01, color="grey", linestyle=":",
               label="sync's final loss + 1%")
    ax.set_xlabel("wall time of the epochs (s)")
    ax.set_ylabel("loss over the data set")
    ax.set_title(f"{args.np} ranks, the last one's packets {args.delay_ms:g} ms late"
                 if args.delay_ms else
                 f"{args.np} ranks, the last one computes each step "
                 f"{args.compute_delay_ms:g} ms longer")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out.with_suffix(".png"), dpi=120)
    for run in runs:
        print(run["output"])
    print(json.dumps(summary, indent=1))
    if reached:
        print(f"quorum {args.np - 1} of {args.np} reached sync's final loss (within 1%) in "
              f"{summary['time_to_sync_loss_speedup']:.2f}x less wall time")
    else:  # an upper bound: its whole run did not reach it
        print(f"quorum {args.np - 1} of {args.np} did not reach sync's final loss in "
              f"{summary['quorum_epochs']} epochs: at most "
              f"{sync['seconds'][-1] / quorum['seconds'][-1]:.2f}x less wall time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
