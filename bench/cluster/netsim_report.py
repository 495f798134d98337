"""Table and plots of netsim records: ``python -m bench.cluster.netsim_report RECORDS.json``.

algbw = bytes / time; busbw = algbw x 2(n-1)/n (what each link carries in a ring); the
speed-up of INA over a peer is the peer's time over INA's; "of link" is algbw over the
link rate, whose ideal is 1 for INA and n / (2(n-1)) for a ring. ina16 (16-bit values on
the wire) has the ideal 2; its row's speed-up is over the best peer.
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

PEERS = ("ring", "mpi", "gloo")
INAS = ("ina", "ina16", "ina-quorum", "ina-gate")  # 32, 16 bits; quorum n - 1; MPI gate


def _size(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _grouped(records: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[str, Any]]]:
    """(n, link, loss, bytes) -> system -> record."""
    groups: dict[tuple, dict[str, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        groups[(r["n"], r["link_mbit"], r["loss"], r["bytes"])][r["system"]] = r
    return dict(sorted(groups.items()))


def table(records: list[dict[str, Any]]) -> str:
    rows = ["| n | link Mbit/s | loss | size | system | time ms | algbw Mbit/s | busbw Mbit/s "
            "| of link | INA speed-up | CPU |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (n, link, loss, nbytes), systems in _grouped(records).items():
        ina = systems.get("ina")
        peers = [systems[p] for p in PEERS if p in systems]
        best = min(peers, key=lambda r: r["seconds"]) if peers else None
        for name in (*INAS, *PEERS):
            r = systems.get(name)
            if r is None:
                continue
            algbw = nbytes * 8 / r["seconds"] / 1e6
            busbw = algbw * 2 * (n - 1) / n
            speedup = (f"{r['seconds'] / ina['seconds']:.2f}x" if ina and name in PEERS
                       else f"{best['seconds'] / r['seconds']:.2f}x over {best['system']}"
                       if best and name == "ina16"
                       else f"{ina['seconds'] / r['seconds']:.2f}x over ina"
                       if ina and name == "ina-quorum" else "")
            rows.append(f"| {n} | {link:g} | {loss:g} | {_size(nbytes)} | {name} | "
                        f"{r['seconds'] * 1e3:.1f} | {algbw:.1f} | {busbw:.1f} | "
                        f"{algbw / link:.2f} | {speedup} | {r.get('cpu_utilisation', 0):.0%} |")
    return "\n".join(rows)


def ddp_table(records: list[dict[str, Any]], family: str = "ddp") -> str:
    """Training steps (``family`` "ddp" or "fsdp2"): backend ina against gloo, with each
    step's breakdown (compute alone, the rest communication not hidden behind it)."""
    rows = [f"| n | link Mbit/s | loss | gradients | {family} backend | step ms | "
            "compute ms | communication ms | ina speed-up | engines |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (n, link, loss, nbytes), systems in _grouped(records).items():
        ina = systems.get(f"{family}-ina")
        for name in (f"{family}-ina", f"{family}-gloo"):
            r = systems.get(name)
            if r is None:
                continue
            compute = r.get("compute_seconds", 0.0)
            speedup = (f"{r['seconds'] / ina['seconds']:.2f}x" if ina and ina is not r
                       else "")
            rows.append(f"| {n} | {link:g} | {loss:g} | {_size(nbytes)} | "
                        f"{name.removeprefix(family + '-')} | {r['seconds'] * 1e3:.0f} | "
                        f"{compute * 1e3:.0f} | {(r['seconds'] - compute) * 1e3:.0f} | "
                        f"{speedup} | {r['engines']} |")
    return "\n".join(rows) if len(rows) > 2 else ""


SPARSE = ("sparse-ina", "sparse-exact", "sparse-gloo", "sparse-dense")


def _sparse_groups(records: list[dict[str, Any]]) -> dict[tuple, dict[str, dict]]:
    groups: dict[tuple, dict[str, dict]] = {}
    for r in records:
        if r["system"] in SPARSE:
            key = (r["n"], r["link_mbit"], r["zipf"], r["lookups"], r["rows"], r["dim"])
            groups.setdefault(key, {})[r["system"]] = r
    return dict(sorted(groups.items()))


def sparse_table(records: list[dict[str, Any]]) -> str:
    """Embedding gradients (issue 33): one exchange per system and workload, and
    sparse-ina's speed-up over the best of the others."""
    rows = ["| n | link Mbit/s | zipf | lookups | table | system | ms | hot share | "
            "bytes through the switch | bytes gathered | hot / exact calls ms | "
            "sparse-ina speed-up |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (n, link, zipf, lookups, table_rows, dim), systems in _sparse_groups(records).items():
        ina = systems.get("sparse-ina")
        for name in SPARSE:
            r = systems.get(name)
            if r is None:
                continue
            up = (f"{r['seconds'] / ina['seconds']:.2f}x" if ina and r is not ina else "")
            rows.append(f"| {n} | {link:g} | {zipf:g} | {lookups} | {table_rows} x {dim} | "
                        f"{name} | {r['seconds'] * 1e3:.1f} | "
                        f"{r.get('hot_share', '')} | {r.get('bytes_through_allreduce', '')} | "
                        f"{r.get('bytes_gathered', '')} | {_hot_exact(r)} | {up} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def _hot_exact(record: dict[str, Any]) -> str:
    """sparse-ina's own medians of its calls with and without hot rows (the slowest
    rank's), and how often it set the hot rows aside."""
    if record.get("hot_ms") is None and record.get("exact_ms") is None:
        return ""
    return (f"{record.get('hot_ms')} / {record.get('exact_ms')} "
            f"({record.get('trials_declined', 0)} set aside)")


def sparse_plot(records: list[dict[str, Any]], directory: Path, stem: str) -> list[Path]:
    """sparse-ina's speed-up over the best of the others against lookups, a line per n
    and Zipf exponent: where the hot rows pay."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    points: dict[tuple, list[tuple[int, float]]] = {}
    for (n, link, zipf, lookups, _, _), systems in _sparse_groups(records).items():
        others = [r["seconds"] for name, r in systems.items() if name != "sparse-ina"]
        if "sparse-ina" in systems and others:
            points.setdefault((n, link, zipf), []).append(
                (lookups, min(others) / systems["sparse-ina"]["seconds"]))
    if not points:
        return []
    fig, ax = plt.subplots(figsize=(6, 4))
    for (n, link, zipf), line in sorted(points.items()):
        line.sort()
        ax.plot([p[0] for p in line], [p[1] for p in line], marker="o",
                label=f"n={n}, s={zipf:g}, {link:g} Mbit/s")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("lookups per rank and step")
    ax.set_ylabel("sparse-ina speed-up over the best other")
    ax.legend()
    return [_save(fig, directory / f"{stem}-sparse.png")]


def jobs_table(records: list[dict[str, Any]]) -> str:
    """--jobs N: each job's throughput while all ran at once, as a fraction of the first
    job's alone, and Jain's fairness index over the jobs' throughputs, (sum x)^2 / (N sum
    x^2): 1 when all get the same."""
    runs: dict[tuple, dict[Any, dict[str, Any]]] = defaultdict(dict)
    for r in records:
        if "job" in r:
            runs[(r["n"], r["link_mbit"], r["loss"], r["bytes"], r["system"])][r["job"]] = r
    rows = ["| n | link Mbit/s | loss | size | system | jobs | alone ms | each job ms | "
            "each / alone (throughput) | Jain's index |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (n, link, loss, nbytes, system), jobs in sorted(runs.items(), key=str):
        alone = jobs.get("alone")
        together = [r for j, r in sorted((j, r) for j, r in jobs.items() if j != "alone")]
        if alone is None or not together:
            continue
        rates = [nbytes / r["seconds"] for r in together]
        jain = sum(rates) ** 2 / (len(rates) * sum(x * x for x in rates))
        rows.append(f"| {n} | {link:g} | {loss:g} | {_size(nbytes)} | {system} | "
                    f"{len(together)} | {alone['seconds'] * 1e3:.1f} | "
                    + ", ".join(f"{r['seconds'] * 1e3:.1f}" for r in together) + " | "
                    + ", ".join(f"{alone['seconds'] / r['seconds']:.2f}" for r in together)
                    + f" | {jain:.3f} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def speedups(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """INA (each width measured) against the best peer, per (n, link, loss, size) with
    INA and a peer."""
    out = []
    for (n, link, loss, nbytes), systems in _grouped(records).items():
        peers = [systems[p] for p in PEERS if p in systems]
        for name in INAS:
            if name in systems and peers:
                best = min(peers, key=lambda r: r["seconds"])
                out.append({"n": n, "link_mbit": link, "loss": loss, "bytes": nbytes,
                            "system": name, "best_peer": best["system"],
                            "speedup": best["seconds"] / systems[name]["seconds"],
                            "ina_of_link": nbytes * 8 / systems[name]["seconds"] / 1e6 / link})
    return out


def plots(records: list[dict[str, Any]], directory: Path, stem: str) -> list[Path]:
    """algbw against size per system (one figure per n, link, loss), and INA's speed-up
    over the best peer against n beside the ideal 2(n-1)/n."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    configs = sorted({(r["n"], r["link_mbit"], r["loss"]) for r in records})
    if configs:
        fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4), squeeze=False)
        for ax, (n, link, loss) in zip(axes[0], configs):
            for system in (*INAS, *PEERS):
                points = sorted((r["bytes"], r["bytes"] * 8 / r["seconds"] / 1e6)
                                for r in records if (r["n"], r["link_mbit"], r["loss"],
                                                     r["system"]) == (n, link, loss, system))
                if points:
                    ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                            label=system)
            ax.axhline(link, color="grey", linestyle="--", label="link rate")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("bytes")
            ax.set_ylabel("algbw (Mbit/s)")
            ax.set_title(f"n={n}, {link:g} Mbit/s, loss {loss:g}")
            ax.legend()
        written.append(_save(fig, directory / f"{stem}-algbw.png"))
    ups = speedups(records)
    if ups:
        fig, ax = plt.subplots(figsize=(6, 4))
        largest = max(u["bytes"] for u in ups)
        for (name, link, loss) in sorted({(u["system"], u["link_mbit"], u["loss"])
                                          for u in ups}):
            points = sorted((u["n"], u["speedup"]) for u in ups if u["bytes"] == largest and
                            (u["system"], u["link_mbit"], u["loss"]) == (name, link, loss))
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                    label=f"{name}, {link:g} Mbit/s, loss {loss:g}")
        ideal_x = list(range(2, max(8, max(u["n"] for u in ups)) + 1))
        ax.plot(ideal_x, [2 * (n - 1) / n for n in ideal_x], color="grey", linestyle="--",
                marker=".", label="ideal 2(n-1)/n")
        if any(u["system"] == "ina16" for u in ups):
            ax.plot(ideal_x, [4 * (n - 1) / n for n in ideal_x], color="grey",
                    linestyle=":", marker=".", label="ideal of ina16, 4(n-1)/n")
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_ylim(bottom=0.5)
        ax.set_xlabel("workers n")
        ax.set_ylabel(f"INA speed-up over the best peer ({_size(largest)})")
        ax.legend()
        written.append(_save(fig, directory / f"{stem}-speedup.png"))
    return written


TIMELINE_COLORS = {"forward": "tab:blue", "backward": "tab:orange", "transfer": "tab:green",
                   "straggler": "tab:red"}
TIMELINE_ROWS = {"forward": 0.0, "backward": 0.3, "transfer": 0.6, "straggler": 0.0}


def timeline_panel(ax: Any, timeline: list[list[Any]], title: str) -> None:
    """One step of a training benchmark on ``ax``: each (what, layer, start, end) of
    ``timeline`` a bar on its layer's row (forward, backward, transfer, a straggler's
    wait), in ms from the step's start."""
    for what, layer, start, end in timeline:
        ax.barh(layer + TIMELINE_ROWS[what], (end - start) * 1e3, left=start * 1e3,
                height=0.28, color=TIMELINE_COLORS[what], label=what)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="lower right", fontsize=7)
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=9)


def _save(fig: Any, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def main() -> int:
    path = Path(sys.argv[1])
    records = json.loads(path.read_text())
    print(table([r for r in records
                 if not r["system"].startswith(("ddp-", "fsdp2-", "sparse-"))]))
    if sparse_table(records):
        print()
        print(sparse_table(records))
    for family in ("ddp", "fsdp2"):
        steps = ddp_table(records, family)
        if steps:
            print()
            print(steps)
    for p in plots([r for r in records
                    if not r["system"].startswith(("ddp-", "fsdp2-", "sparse-"))],
                   path.parent, path.stem) + sparse_plot(records, path.parent, path.stem):
        print("wrote", p)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# Racks (netsim --racks): the ideal time of each system on R racks of w workers, links
# at L, uplinks at U (bytes one link carries each way over its rate, the busiest link's;
# docs/trees.md, When a tree pays).
RACK_SYSTEMS = ("ina-tree", "ina", "ring", "mpi", "gloo", "hier")


def rack_ideal(system: str, nbytes: int, racks: int, w: int, link_mbit: float,
               uplink_mbit: float) -> float:
    n = racks * w
    L, U = link_mbit * 1e6 / 8, uplink_mbit * 1e6 / 8
    if system == "ina-tree":  # a worker link carries N, an uplink one partial sum: N
        return max(nbytes / L, nbytes / U)
    if system == "ina":  # one aggregator above the racks: w streams on each uplink
        return max(nbytes / L, w * nbytes / U)
    if system in ("hier", "mpi"):
        # Reduce-scatter in the rack, allreduce across, allgather, one after the other.
        # MPICH's large allreduce (recursive halving from distance 1, then doubling) is
        # this schedule where racks are consecutive ranks and R, w are powers of two.
        inside = (w - 1) / w * nbytes / L
        return 2 * inside + 2 * (racks - 1) / racks * nbytes / U
    ring = 2 * (n - 1) / n * nbytes  # ring, gloo: a ring's edges cross each uplink
    return max(ring / L, ring / U)


def racks_table(records: list[dict[str, Any]]) -> str:
    """The tree against flat INA, the best flat host peer and the hierarchical host
    allreduce, each ratio beside its ideal."""
    rows = ["| racks x w | link / uplink Mbit/s | size | system | time ms | ideal ms | "
            "tree's speed-up | ideal speed-up |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    groups: dict[tuple, dict[str, dict[str, Any]]] = {}
    for r in records:
        key = (r["racks"], r["n"] // r["racks"], r["link_mbit"], r["uplink_mbit"], r["bytes"])
        groups.setdefault(key, {})[r["system"]] = r
    for (racks, w, link, up, nbytes), systems in sorted(groups.items()):
        tree = systems.get("ina-tree")
        ideal_tree = rack_ideal("ina-tree", nbytes, racks, w, link, up)
        for name in RACK_SYSTEMS:
            r = systems.get(name)
            if r is None:
                continue
            ideal = rack_ideal(name, nbytes, racks, w, link, up)
            rows.append(
                f"| {racks} x {w} | {link:g} / {up:g} | {_size(nbytes)} | {name} | "
                f"{r['seconds'] * 1e3:.0f} | {ideal * 1e3:.0f} | "
                + (f"{r['seconds'] / tree['seconds']:.2f}x" if tree and r is not tree
                   else "") + " | "
                + (f"{ideal / ideal_tree:.2f}x" if r is not tree else "") + " |")
    return "\n".join(rows)
