"""Packed documents: ``segment_ids`` against the dense call, on the CPU.

Run with ``python benchmarks/packed.py`` (``--help``), in an environment with
torch==2.13.0, threadpoolctl and Numba; unset ``OPENBLAS_CORETYPE`` and
``OPENBLAS_L2_SIZE`` for the run only. For float32 (B, H, T, E) = (1, 8, T, 64)
with 8 documents packed into each row, of equal lengths and of random ones (causal
within each document, as a packed training batch is), it times, interleaved in one process
(median of the rounds after a warm-up):

``<impl> packed``
    ``scaled_dot_product_attention(q, k, v, is_causal=True, segment_ids=ids,
    implementation=impl)``: keys outside each query's document are skipped;
``<impl> dense``
    the same call without ``segment_ids`` (full causal over T), the cost that
    packing avoids;
``torch mask``
    ``torch.nn.functional.scaled_dot_product_attention`` with the documents and
    causality as one dense (T, T) boolean mask;
``torch dense``
    torch SDPA with ``is_causal=True`` over T.

``impl`` is ``numba_cpu`` (the fused kernel) and ``chunked`` (the NumPy fast path).
The ratio ``packed / dense`` is the figure to read: the visible area of 8
documents is ``Σ n_d² / T²`` of the dense one (about 1/8 for equal lengths). A guard
checks the packed output against torch's masked SDPA.

Results go to ``benchmarks/results/packed-cpu-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np
from cpu import RESULTS, environment, time_interleaved

import polyattn

#: Sequence lengths.
TS = [4096, 8192]
#: Documents per row.
DOCUMENTS = 8
#: (B, H, E) of every case.
SHAPE = (1, 8, 64)
IMPLEMENTATIONS = ("numba_cpu", "chunked")


def document_lengths(t: int, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` lengths summing to ``t``, each at least ``t / (4 n)``."""
    floor = t // (4 * n)
    cuts = np.sort(rng.choice(np.arange(1, t - n * floor), n - 1, replace=False))
    lengths = np.diff(np.concatenate([[0], cuts, [t - n * floor]])) + floor
    assert lengths.sum() == t and (lengths > 0).all()
    return lengths


def run_case(t: int, kind: str, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    import torch

    b, h, e = SHAPE
    q, k, v = (rng.standard_normal((b, h, t, e)).astype(np.float32) for _ in range(3))
    lengths = (np.full(DOCUMENTS, t // DOCUMENTS) if kind == "equal"
               else document_lengths(t, DOCUMENTS, rng))
    ids = np.repeat(np.arange(DOCUMENTS), lengths)[None]               # (1, T), sorted
    mask = torch.from_numpy((ids[0][:, None] == ids[0][None, :]) & np.tri(t, dtype=bool))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    sdpa = polyattn.scaled_dot_product_attention
    fns: dict[str, Any] = {}
    for impl in IMPLEMENTATIONS:
        fns[f"{impl} packed"] = (lambda impl=impl: sdpa(q, k, v, is_causal=True,
                                                        segment_ids=ids, implementation=impl))
        fns[f"{impl} dense"] = (lambda impl=impl: sdpa(q, k, v, is_causal=True,
                                                       implementation=impl))
    fns["torch mask"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=mask)
    fns["torch dense"] = lambda: torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, is_causal=True)
    with torch.no_grad():
        ref = fns["torch mask"]().numpy()
        guard = {impl: float(np.abs(fns[f"{impl} packed"]() - ref).max())
                 for impl in IMPLEMENTATIONS}
        times = time_interleaved(fns, reps, cold=())
    median = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    row: dict[str, Any] = {"t": t, "lengths": kind, "documents": lengths.tolist(),
                           "visible_fraction": float((lengths ** 2).sum() / t ** 2),
                           "ms": median, "times_s": times, "guard_max_abs_error": guard}
    for impl in IMPLEMENTATIONS:
        row[f"{impl} packed/dense"] = median[f"{impl} packed"] / median[f"{impl} dense"]
        row[f"{impl} packed/torch mask"] = median[f"{impl} packed"] / median["torch mask"]
    return row


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    blas = ", ".join(f"{p['library']} {p['kernel']} ({p['threading_layer']})"
                     for p in env["numpy_blas"])
    lines = [f"# Packed documents on the CPU ({env['date']})", "",
             f"- command: `{command}`",
             f"- CPU: {env['cpu']} ({env['cpu_count']} CPUs), SIMD {env['simd']}, "
             f"numba_cpu tiles: {env['numba_cpu_tiles']}",
             f"- Numba threading layer: {env.get('numba_threading_layer')}",
             f"- NumPy BLAS: {blas}; torch {env['versions']['torch']} "
             f"({env['torch_threads']} threads)",
             f"- load average at start: {env['load_average_start']}",
             f"- float32 (B, H, E) = {SHAPE}, {DOCUMENTS} documents per row, causal within "
             "each; median ms of the rounds", "",
             "| T | lengths | Σn²/T² | impl | packed ms | dense ms | **packed / dense** | "
             "torch mask ms | torch dense ms | packed / torch mask | guard |",
             "|---:|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms = r["ms"]
        for impl in IMPLEMENTATIONS:
            lines.append(
                f"| {r['t']} | {r['lengths']} | {r['visible_fraction']:.3f} | {impl} | "
                f"{ms[impl + ' packed']:.1f} | {ms[impl + ' dense']:.1f} | "
                f"**{r[impl + ' packed/dense']:.3f}** | {ms['torch mask']:.1f} | "
                f"{ms['torch dense']:.1f} | {r[impl + ' packed/torch mask']:.3f} | "
                f"{r['guard_max_abs_error'][impl]:.1e} |")
    lines += ["", "Random lengths: " + "; ".join(
        f"T = {r['t']}: {r['documents']}" for r in rows if r["lengths"] == "random"), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--quick", action="store_true", help="T = 1024 only, 2 rounds")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    ts, reps = ([1024], 2) if args.quick else (TS, args.reps)
    rng = np.random.default_rng(0)
    rows = [run_case(t, kind, reps, rng) for t in ts for kind in ("equal", "random")]
    env = environment()
    from polyattn.backends.numba_cpu import launch as numba_cpu

    env["numba_threading_layer"] = numba_cpu.threading_layer() or "not run"
    command = "python benchmarks/packed.py " + " ".join(argv if argv is not None
                                                        else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"packed-cpu-{env['date']}"
    stem.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows},
                                                    indent=1, default=str))
    text = markdown(env, rows, command.strip())
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
