"""torch CPU benchmark: polyattn ``"auto"`` on torch tensors against torch SDPA and naive torch.

Run with ``nox -s bench_torch`` or ``python benchmarks/torch_cpu.py``. On torch
tensors ``"auto"`` picks the native implementation, so this measures what
polyattn adds on top of ``torch.nn.functional.scaled_dot_product_attention``:
validation, dispatch and the mask handling that keeps polyattn's semantics.
The cases are those of ``benchmarks/cpu.py`` (``nox -s bench``). Each case
times its contenders interleaved in one process (the order rotates every
round) and reports the ratio of medians; on a shared machine only the ratios
mean something.

Contenders: ``polyattn`` (``scaled_dot_product_attention``, ``"auto"``),
``torch`` (its SDPA called directly) and ``naive`` (the formula in torch
operations, materialising the scores; skipped where they would exceed 2 GiB).
Results go to ``benchmarks/results/torch-cpu-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from cpu import (
    CASES,
    MEMORY_CASES,
    NAIVE_MAX_SCORE_BYTES,
    RESULTS,
    environment,
    flops,
    time_interleaved,
)

import polyattn

#: The ratio polyattn / torch SDPA that "auto" on torch tensors must not exceed.
TARGET_RATIO = 1.05


def run_case(b: int, h: int, t: int, e: int, causal: bool, dtype: str, reps: int,
             rng: np.random.Generator) -> dict[str, Any]:
    """Time one case; returns medians, ratios and the implementation ``"auto"`` chose."""
    import torch
    import torch.nn.functional as F

    q, k, v = (torch.from_numpy(rng.standard_normal((b, h, t, e)).astype(dtype))
               for _ in range(3))
    choice = polyattn.explain(q, k, v, is_causal=causal).implementation

    def ours() -> Any:
        with torch.no_grad():
            return polyattn.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def theirs() -> Any:
        with torch.no_grad():
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def naive() -> Any:
        with torch.no_grad():
            s = (q @ k.transpose(-1, -2)) / e ** 0.5
            if causal:
                s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -torch.inf)
            return torch.softmax(s, dim=-1) @ v

    fns: dict[str, Any] = {"polyattn": ours, "torch": theirs}
    if b * h * t * t * q.element_size() <= NAIVE_MAX_SCORE_BYTES:
        fns["naive"] = naive
    err = float((ours() - theirs()).abs().max() / theirs().abs().max())
    times = time_interleaved(fns, reps)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    fl = flops(b, h, t, e, causal)
    return {
        "case": [b, h, t, e], "causal": causal, "dtype": dtype, "implementation": choice,
        "reps": reps, "median_s": med, "times_s": times,
        "ratio_to_torch": {name: med[name] / med["torch"] for name in med if name != "torch"},
        "gflops": {name: fl / med[name] / 1e9 for name in med},
        "max_rel_diff_vs_torch": err,
    }


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    blas = "; ".join(f"{p['library']}, kernel {p['kernel']}, {p['threads']} threads"
                     for p in env["numpy_blas"])
    ratios = [r["ratio_to_torch"]["polyattn"] for r in rows]
    within = sum(x <= TARGET_RATIO for x in ratios)
    lines = [
        f"# torch CPU benchmark, {env['date']}",
        "",
        f"- Command: `{command}`",
        f"- CPU: {env['cpu']} ({env['cpu_count']} logical CPUs); load average at start "
        f"{env['load_average_start'][0]:.2f}, at end {env['load_average_end'][0]:.2f}",
        f"- SIMD level torch dispatched to: {env.get('torch_cpu_capability', 'unknown')}",
        f"- torch {env['versions']['torch']} with {env['torch_threads']} threads; NumPy BLAS "
        f"(not used here): {blas}; polyattn {env['versions']['polyattn']}",
        "",
        "polyattn = `scaled_dot_product_attention(q, k, v, is_causal=…)` with "
        "`implementation=\"auto\"` on torch CPU tensors; torch = "
        "`torch.nn.functional.scaled_dot_product_attention` on the same tensors; naive = "
        "softmax(q kᵀ/√E) v in torch operations. Median of the timed rounds, interleaved; "
        "ratio = time / torch SDPA time (< 1: faster than torch).",
        "",
        "| case (B, H, T, E) | causal | dtype | auto runs | polyattn ms | torch ms | naive ms "
        "| polyattn / torch | naive / torch |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        med, rat = r["median_s"], r["ratio_to_torch"]
        naive_ms = f"{med['naive'] * 1e3:.1f}" if "naive" in med else "—"
        naive_ratio = f"{rat['naive']:.2f}" if "naive" in rat else "—"
        lines.append(
            f"| {tuple(r['case'])} | {'yes' if r['causal'] else 'no'} | {r['dtype']} "
            f"| {r['implementation']} | {med['polyattn'] * 1e3:.1f} | {med['torch'] * 1e3:.1f} "
            f"| {naive_ms} | **{rat['polyattn']:.3f}** | {naive_ratio} |")
    lines += ["", f"polyattn ≤ {TARGET_RATIO}× torch SDPA's time: {within}/{len(rows)} cases; "
              f"median {statistics.median(ratios):.3f}, worst {max(ratios):.3f}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed rounds per case")
    parser.add_argument("--no-memory", action="store_true", help="skip the long-sequence cases")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    env = environment()
    env["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    rng = np.random.default_rng(0)
    rows = []
    started = time.perf_counter()
    plan = [(case, causal, dtype) for dtype in ("float32", "float64") for case in CASES
            for causal in (False, True)]
    if not args.no_memory:
        plan += [(case, True, "float32") for case in MEMORY_CASES]
    for case, causal, dtype in plan:
        reps = args.reps if case[2] <= 4096 else max(3, args.reps // 2)
        row = run_case(*case, causal, dtype, reps, rng)
        rows.append(row)
        print(f"{dtype} {case} causal={causal}: auto -> {row['implementation']}, "
              f"polyattn/torch {row['ratio_to_torch']['polyattn']:.3f}", flush=True)
    env["load_average_end"] = list(os.getloadavg())
    env["elapsed_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"torch-cpu-{env['date']}"
    command = "python benchmarks/torch_cpu.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if all(os.environ.get(n) is None for n in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + command
    report = {"environment": env, "command": command.strip(), "results": rows}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(env, rows, command.strip()))
    print(f"wrote {stem}.json and .md in {env['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
