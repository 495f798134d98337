"""Relative error of the switch's number formats on realistic gradients, beside float16.

    python -m bench.ceilings.quantization_error [--size 1048576] [--json F] [--markdown]

For n = 4 and 8 workers, each with its own draw of a gradient-like tensor (normal,
heavy-tailed, sparse with outliers), the float32 AVERAGE computed four ways, against the
exact average (float64 of the float32 inputs):

* ``int32 per packet``: version 2's format, one exponent per packet of K values
  (K 2237 at a 9000-byte MTU; also 64, a P4 build's), emulated here with NumPy;
* ``int32 B32``, ``int16 B32`` and ``int16 B8``: this version's sub-blocks of 32 (and
  8), through the compiled kernels (K plays no part);
* ``fp16``: Horovod's ``Compression.fp16``: each worker's tensor cast to float16, summed
  in float16 (a ring adds in the wire's type), divided by n in float32.

Errors: ``rel_l2`` = ||r - exact|| / ||exact||, and ``p99_rel`` = the 99th percentile of
|r - exact| / |exact| over the elements whose exact value is at least 1e-3 of the
tensor's largest (the ones an optimizer step moves visibly). docs/quantization.md quotes
the table.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bench import RESULTS
from ina_collectives.ina import kernels


def gradients(kind: str, n: int, size: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "normal":
        xs = rng.standard_normal((n, size)) * 1e-3
    elif kind == "heavy-tailed":  # Student's t with 2 degrees of freedom: infinite variance
        xs = rng.standard_t(2, (n, size)) * 1e-3
    elif kind == "sparse+outliers":  # half exact zeros, 0.1% outliers 1000x the rest
        xs = rng.standard_normal((n, size)) * 1e-4
        xs[rng.random((n, size)) < 0.5] = 0
        hot = rng.random((n, size)) < 1e-3
        xs[hot] = rng.standard_normal(int(hot.sum())) * 1e-1
    else:
        raise ValueError(kind)
    return xs.astype(np.float32)


def per_packet(xs: np.ndarray, k: int) -> np.ndarray:
    """Version 2: one exponent per packet of k, int32 (docs/quantization.md's old rule)."""
    n, size = xs.shape
    pad = -size % k
    blocks = np.pad(xs.astype(np.float64), ((0, 0), (0, pad))).reshape(n, -1, k)
    peak = np.abs(blocks).max(axis=(0, 2))
    _, e = np.frexp(peak)
    e = np.maximum(np.where(peak > 0, e, -126), -126)
    shift = (30 - e - (n.bit_length() - 1))[None, :, None]
    q = np.rint(np.ldexp(blocks, shift)).astype(np.int64).sum(axis=0)
    return (np.ldexp(q.astype(np.float64), -shift[0]) / n).reshape(-1)[:size].astype(np.float32)


def sub_blocks(xs: np.ndarray, bits: int, block: int = 32) -> np.ndarray:
    """This version: sub-blocks of ``block``, through the compiled kernels."""
    fast = kernels.load("fast")
    n, size = xs.shape
    k = 4096  # any: sub-blocks make K irrelevant
    agreed = np.max([fast.block_exponents(x, k, block)[0] for x in xs], axis=0)
    total = sum(fast.quantize(x, agreed, n, k, block, bits).astype(np.int64) for x in xs)
    out = np.empty(size, np.float32)
    fast.dequantize(total.astype(">i4" if bits == 32 else ">i2"), agreed, n, k, out, True,
                    block)
    return out


def fp16(xs: np.ndarray) -> np.ndarray:
    acc = xs[0].astype(np.float16)
    for x in xs[1:]:
        acc = (acc + x.astype(np.float16)).astype(np.float16)
    return acc.astype(np.float32) / xs.shape[0]


def errors(result: np.ndarray, exact: np.ndarray) -> dict[str, float]:
    diff = result.astype(np.float64) - exact
    rel_l2 = float(np.linalg.norm(diff) / np.linalg.norm(exact))
    big = np.abs(exact) >= 1e-3 * np.abs(exact).max()
    p99 = float(np.percentile(np.abs(diff[big]) / np.abs(exact[big]), 99))
    return {"rel_l2": rel_l2, "p99_rel": p99}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1 << 20)
    parser.add_argument("--json", default=str(RESULTS /
                                              "quantization_error.json"))
    parser.add_argument("--markdown", action="store_true", help="print the docs' table")
    args = parser.parse_args(argv)
    methods = {"int32 per packet K 2237": lambda xs: per_packet(xs, 2237),
               "int32 per packet K 64": lambda xs: per_packet(xs, 64),
               "int32 B32": lambda xs: sub_blocks(xs, 32),
               "int16 B32": lambda xs: sub_blocks(xs, 16),
               "int16 B8": lambda xs: sub_blocks(xs, 16, 8),
               "fp16 (Horovod)": fp16}
    records = []
    for kind in ("normal", "heavy-tailed", "sparse+outliers"):
        for n in (4, 8):
            xs = gradients(kind, n, args.size, seed=n)
            exact = xs.astype(np.float64).sum(axis=0) / n
            for name, method in methods.items():
                records.append({"distribution": kind, "n": n, "method": name,
                                **errors(method(xs), exact)})
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(records, indent=1))
    names = list(methods)
    if args.markdown:
        print("| distribution | n | " + " | ".join(names) + " |")
        print("| --- | ---: |" + " ---: |" * len(names))
    for kind in ("normal", "heavy-tailed", "sparse+outliers"):
        for n in (4, 8):
            row = {r["method"]: r for r in records if r["distribution"] == kind and r["n"] == n}
            cells = [f"{row[m]['rel_l2']:.1e} / {row[m]['p99_rel']:.1e}" for m in names]
            if args.markdown:
                print(f"| {kind} | {n} | " + " | ".join(cells) + " |")
            else:
                print(f"{kind:>16} n={n}: " + ", ".join(f"{m} {c}" for m, c in zip(names, cells)))
    print(f"saved {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
