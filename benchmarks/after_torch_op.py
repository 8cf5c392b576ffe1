"""numba_cpu on torch CPU tensors right after another torch operation, as in a model.

torch's CPU operations run on its OpenMP threads, which keep spinning for a while after
each operation (OpenMP's wait policy). A call of the kernel made in that window shares
the cores with them, unless the kernel runs on the same OpenMP runtime or torch's threads
are told to sleep (``OMP_WAIT_POLICY=PASSIVE`` before torch starts). This benchmark times
``scaled_dot_product_attention`` forward on float32 tensors, per implementation (torch's
own, ``"numba_cpu"``), two ways in turns: right after a (1024 × 512) · (512 × 512) torch
matrix product, and back to back with nothing between; median of the rounds.

Run it once per setting to compare, e.g.::

    python benchmarks/after_torch_op.py                              # Numba's TBB layer
    NUMBA_THREADING_LAYER=omp python benchmarks/after_torch_op.py --name omp
    OMP_WAIT_POLICY=PASSIVE python benchmarks/after_torch_op.py --name passive

Results go to ``benchmarks/results/after-torch-op-cpu-<date>[-name].{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from cpu import RESULTS, environment

import polyattn

CASES = [(1, 8, 512, 64), (1, 4, 1024, 64), (1, 4, 2048, 64), (1, 8, 2048, 64)]


def time_case(shape: tuple[int, ...], causal: bool, rounds: int) -> dict[str, Any]:
    import torch

    torch.manual_seed(0)
    w, a = torch.randn(512, 512), torch.randn(1024, 512)
    q, k, v = (torch.randn(*shape) for _ in range(3))
    row: dict[str, Any] = {"case": list(shape), "causal": causal}
    for impl in ("native", "numba_cpu"):
        def call(impl: str = impl) -> Any:
            with torch.no_grad():
                return polyattn.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                             implementation=impl)
        for _ in range(3):
            call()
        after, alone = [], []
        for _ in range(rounds):
            a @ w                                   # other torch work just before
            t0 = time.perf_counter()
            call()
            after.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            call()
            alone.append(time.perf_counter() - t0)
        row[impl] = {"after_op_ms": statistics.median(after) * 1e3,
                     "back_to_back_ms": statistics.median(alone) * 1e3}
    row["ratio_after_op"] = row["numba_cpu"]["after_op_ms"] / row["native"]["after_op_ms"]
    row["ratio_back_to_back"] = (row["numba_cpu"]["back_to_back_ms"]
                                 / row["native"]["back_to_back_ms"])
    return row


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    lines = [f"# numba_cpu right after a torch operation, {env['date']}", "",
             f"- Command: `{command}`",
             f"- CPU: {env['cpu']} ({env['cpu_count']} logical CPUs), SIMD {env['simd']}; "
             f"Numba threading layer: {env['numba_threading_layer']}; OMP_WAIT_POLICY: "
             f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}",
             f"- torch {env['versions']['torch']} ({env['torch_threads']} threads)", "",
             "float32 forward, median ms; ratio = numba_cpu / torch SDPA in the same setting.",
             "", "| case (B, H, T, E) | causal | torch after op | numba_cpu after op | ratio "
             "after op | torch back to back | numba_cpu back to back | ratio back to back |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        n, c = r["native"], r["numba_cpu"]
        lines.append(f"| {tuple(r['case'])} | {'yes' if r['causal'] else 'no'} "
                     f"| {n['after_op_ms']:.2f} | {c['after_op_ms']:.2f} "
                     f"| **{r['ratio_after_op']:.3f}** | {n['back_to_back_ms']:.2f} "
                     f"| {c['back_to_back_ms']:.2f} | {r['ratio_back_to_back']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--name", default="", help="appended to the results' file names")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    import torch

    from polyattn.backends.numba_cpu import launch

    torch.set_num_threads(os.cpu_count() or 1)
    env = environment()
    rows = []
    for shape in CASES:
        for causal in (False, True):
            rows.append(time_case(shape, causal, args.rounds))
            r = rows[-1]
            print(f"{shape} causal={causal}: after op {r['ratio_after_op']:.3f}, back to back "
                  f"{r['ratio_back_to_back']:.3f}", flush=True)
    env["numba_threading_layer"] = launch.threading_layer()
    command = "python benchmarks/after_torch_op.py " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    for var in ("OMP_WAIT_POLICY", "NUMBA_THREADING_LAYER"):
        if os.environ.get(var):
            command = f"{var}={os.environ[var]} {command}"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"after-torch-op-cpu-{env['date']}{'-' + args.name if args.name else ''}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "command": command.strip(), "results": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(env, rows, command.strip()))
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
