"""Backward benchmark: forward+backward time and memory on NumPy against torch CPU SDPA.

Run with ``nox -s bench_backward`` or ``python benchmarks/backward.py`` (``--help``).
At the cases of ``nox -s bench`` (``cpu.CASES``, causal and not, float32 and
float64) it times, interleaved in one process (the order rotates every round;
median of ``--reps`` rounds after a warm-up; each timed call after a pause and
an untimed call of its own, as in ``cpu.py``):

``polyattn``
    ``out, pullback = polyattn.attention_vjp(q, k, v, is_causal=causal)`` then
    ``pullback(grad_out)`` on NumPy arrays (``implementation="auto"``: above a
    small score budget the fused ``numba_cpu`` kernel where Numba is installed,
    else the NumPy fast path, ``numpy_chunked``, and its blocked backward pass
    ``numpy_vjp``; the choice is recorded per case; the other of the two is
    timed beside it);
``polyattn forward``
    the ``attention_vjp`` call alone (the forward pass that keeps ``lse``);
``torch``
    ``torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)``
    on leaf tensors that require grad, then ``(out * grad_out).sum().backward()``,
    with as many torch threads as logical CPUs (the SDPA backend that ran is
    recorded from the autograd node, e.g. ``ScaledDotProductFlashAttentionForCpu``);
``torch forward``
    the SDPA call alone, with autograd recording;
``naive``
    the forward and backward formulas in NumPy with every (B, H, T, T) matrix
    materialised (scores/weights, ``dP``/``dS``), skipped where one such matrix
    would exceed ``NAIVE_MAX_SCORE_BYTES`` (a naive backward holds two or three).

The ratio polyattn / torch of the medians is the figure to read (target: at
most ``TARGET_RATIO``); backward-only ratios are the forward medians
subtracted from the totals, so they are estimates.

Threads: as in ``benchmarks/window.py``, the NumPy contenders (polyattn and
naive) run inside ``threadpoolctl``'s one-thread BLAS limit by default
(``--threading pool``), so the NumPy path runs its work items on its own
thread pool, one BLAS thread each (the naive formulas then run on one core).
``--threading default`` leaves BLAS as it is: with NumPy's OpenBLAS (pthreads)
polyattn's items then run inline with BLAS's own threads, which on a loaded
2-core machine (load average 5–6) took 5–18× the pool's time for
forward+backward, and the naive products slowed 10× in the same way.

Peak extra memory of the polyattn and naive forward+backward is measured by
tracemalloc in a separate, untimed call (everything allocated during the call
above what was allocated before it: ``out``, ``lse``, the three gradients and
the working memory; torch's allocations are not traced), plus the memory case
``MEMORY_CASE`` (float32, causal), whose target is ``MEMORY_TARGET_MIB``. The
gradients of that untimed call are checked against torch's.

Results go to ``benchmarks/results/backward-cpu-<date>.{json,md,png}``.
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
from cpu import CASES, RESULTS, environment, peak_extra_bytes, time_interleaved
from window import blas_mode, simd_level

import polyattn
from polyattn.backends.numpy import forward as numpy_chunked

#: polyattn forward+backward time / torch's that the NumPy path should not exceed.
TARGET_RATIO = 1.5
#: The long causal float32 case whose peak extra memory must stay O(T·block).
MEMORY_CASE = (1, 1, 32768, 64)
#: Peak extra memory allowed at MEMORY_CASE (forward+backward, gradients included).
MEMORY_TARGET_MIB = 128
#: The naive contender is skipped where one (B, H, T, T) matrix would exceed this.
NAIVE_MAX_SCORE_BYTES = 2**30
#: The cases of ``--quick``: float32, the two smallest shapes.
QUICK_CASES = [(1, 8, 1024, 64), (4, 12, 512, 64)]


def flops(b: int, h: int, t: int, e: int, causal: bool) -> float:
    """Forward+backward FLOPs: two (T×T×E) products forward, five backward (one recomputes s)."""
    f = 7 * 2.0 * b * h * t * t * e
    return f / 2 if causal else f


# --- the contenders ---------------------------------------------------------------------

def naive_forward_backward(q: np.ndarray, k: np.ndarray, v: np.ndarray, grad_out: np.ndarray,
                           causal: bool) -> tuple[np.ndarray, ...]:
    """``out`` and (dq, dk, dv) of softmax(Q Kᵀ/√E) V with every (T, T) matrix in memory."""
    scale = (1 / np.sqrt(q.shape[-1])).astype(q.dtype)
    p = q @ np.swapaxes(k, -1, -2)                              # (B, H, T, T) scores
    p *= scale
    if causal:
        t = q.shape[-2]
        np.copyto(p, -np.inf, where=~np.tri(t, dtype=bool))   # keys after the query
    p -= p.max(axis=-1, keepdims=True)
    np.exp(p, out=p)
    p /= p.sum(axis=-1, keepdims=True)                          # P, the weights
    out = p @ v                                                 # (B, H, T, Ev)
    dv = np.swapaxes(p, -1, -2) @ grad_out                      # Pᵀ dO
    ds = grad_out @ np.swapaxes(v, -1, -2)                      # (B, H, T, T) dP
    ds -= np.sum(grad_out * out, axis=-1, keepdims=True)        # dP - D
    ds *= p                                                     # dS = P ∘ (dP - D)
    dq = ds @ k
    dq *= scale
    dk = np.swapaxes(ds, -1, -2) @ q
    dk *= scale
    return out, dq, dk, dv


def torch_backend(out: Any) -> str:
    """The SDPA kernel torch ran, from the autograd node of its output."""
    node = out.grad_fn.name() if out.grad_fn is not None else "none"
    return node.removesuffix("Backward0")


def rel_diff(got: tuple[Any, ...], want: tuple[Any, ...]) -> float:
    """The largest relative 2-norm difference over matching arrays (float64 arithmetic)."""
    return max(float(np.linalg.norm(np.asarray(g, dtype=np.float64)
                                    - np.asarray(w, dtype=np.float64))
                     / np.linalg.norm(np.asarray(w, dtype=np.float64)))
               for g, w in zip(got, want, strict=True))


def run_case(b: int, h: int, t: int, e: int, causal: bool, dtype: str, reps: int,
             rng: np.random.Generator, threading: str, *, naive: bool = True,
             ) -> dict[str, Any]:
    """Time one case and measure its memory; return its row of results."""
    import torch
    import torch.nn.functional as F

    q, k, v, go = (rng.standard_normal((b, h, t, e)).astype(dtype) for _ in range(4))
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tgo = torch.from_numpy(go)
    itemsize = np.dtype(dtype).itemsize
    score_bytes = b * h * t * t * itemsize
    run_naive = naive and score_bytes <= NAIVE_MAX_SCORE_BYTES

    def ours() -> tuple[np.ndarray, ...]:
        with blas_mode(threading):
            out, pullback = polyattn.attention_vjp(q, k, v, is_causal=causal)
            return (out, *pullback(go))

    def ours_forward() -> Any:
        with blas_mode(threading):
            return polyattn.attention_vjp(q, k, v, is_causal=causal)

    def theirs() -> tuple[Any, ...]:
        for x in (tq, tk, tv):
            x.grad = None
        out = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        (out * tgo).sum().backward()
        return out, tq.grad, tk.grad, tv.grad

    def theirs_forward() -> Any:
        return F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

    def numba_cpu() -> tuple[np.ndarray, ...]:
        with blas_mode(threading):
            out, pullback = polyattn.attention_vjp(q, k, v, is_causal=causal,
                                                   implementation="numba_cpu")
            return (out, *pullback(go))

    def numpy_path() -> tuple[np.ndarray, ...]:
        with blas_mode(threading):
            out, pullback = polyattn.attention_vjp(q, k, v, is_causal=causal,
                                                   implementation="chunked")
            return (out, *pullback(go))

    auto = polyattn.explain(q, k, v, is_causal=causal, return_lse=True).implementation
    fns: dict[str, Any] = {"polyattn": ours, "polyattn forward": ours_forward,
                           "torch": theirs, "torch forward": theirs_forward}
    if auto != "chunked":
        fns["numpy_path"] = numpy_path        # the NumPy fast path, side by side
    if numba_cpu_usable() and auto != "numba_cpu":
        fns["numba_cpu"] = numba_cpu          # the fused Numba kernel, side by side
    if run_naive:
        def naive_fb() -> tuple[np.ndarray, ...]:
            with blas_mode(threading):
                return naive_forward_backward(q, k, v, go, causal)

        fns["naive"] = naive_fb
    times = time_interleaved(fns, reps)
    for name, same in (("numba_cpu", "numba_cpu"), ("numpy_path", "chunked")):
        if auto == same:
            times[name] = times["polyattn"]
    med = {name: statistics.median(ts) for name, ts in times.items()}

    # memory, in separate untimed calls whose results are kept for the checks below
    kept: dict[str, tuple[np.ndarray, ...]] = {}

    def keep(name: str) -> Any:
        return lambda: kept.setdefault(name, fns[name]())

    score_mib = score_bytes / 2**20
    io_mib = 4 * b * h * t * e * itemsize / 2**20            # out, dq, dk, dv
    memory = {"polyattn": peak_extra_bytes(keep("polyattn")) / 2**20}
    if run_naive:
        memory["naive"] = peak_extra_bytes(keep("naive")) / 2**20
    want = tuple(x.detach().numpy() for x in theirs())
    with blas_mode(threading):
        items_run = numpy_chunked.threading_mode()
    explained = polyattn.explain(q, k, v, is_causal=causal, return_lse=True)
    fl = flops(b, h, t, e, causal)
    row: dict[str, Any] = {
        "case": [b, h, t, e], "causal": causal, "dtype": dtype, "reps": reps,
        "gflop": fl / 1e9,
        "implementation": explained.implementation, "module": explained.module,
        "polyattn_items_run": items_run,
        "torch_backend": torch_backend(theirs_forward()),
        "times_s": times,
        "median_s": med,
        "ratio_to_torch": {"polyattn": med["polyattn"] / med["torch"],
                           "polyattn forward": med["polyattn forward"] / med["torch forward"],
                           "polyattn backward": _backward(med, "polyattn")
                           / _backward(med, "torch")},
        "backward_s": {"polyattn": _backward(med, "polyattn"),
                       "torch": _backward(med, "torch")},
        "gflops": {name: fl / med[name] / 1e9 for name in ("polyattn", "torch", "naive")
                   if name in med},
        # by pass: the forward's two products, the backward's five (total minus forward)
        "gflops_by_pass": {"forward": fl * 2 / 7 / med["polyattn forward"] / 1e9,
                           "backward": fl * 5 / 7 / _backward(med, "polyattn") / 1e9},
        "peak_extra_mib": memory,
        "io_mib": io_mib,
        "working_mib": {name: mib - io_mib for name, mib in memory.items()},
        "score_matrix_mib": score_mib,
        "rel_diff_vs_torch": {name: rel_diff(kept[name], want) for name in kept},
    }
    for name in ("numba_cpu", "numpy_path"):
        if name in med:
            row["ratio_to_torch"][name] = med[name] / med["torch"]
    if run_naive:
        row["ratio_to_torch"]["naive"] = med["naive"] / med["torch"]
    else:
        row["naive_skipped"] = (f"one (B, H, T, T) matrix is {score_mib / 1024:.1f} GiB "
                                f"(limit {NAIVE_MAX_SCORE_BYTES / 2**30:.0f} GiB)")
    return row


def _backward(med: dict[str, float], name: str) -> float:
    """Backward-pass time estimated as forward+backward minus forward (medians)."""
    return med[name] - med[f"{name} forward"]


# --- reporting ---------------------------------------------------------------------------

def _case(row: dict[str, Any]) -> str:
    """"(1, 8, 4096, 64) causal float32"."""
    return f"{tuple(row['case'])} {'causal ' if row['causal'] else ''}{row['dtype']}"


def numba_cpu_usable() -> bool:
    from polyattn.backends.numba_cpu import launch as numba_cpu

    return numba_cpu.availability()[0]


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Each target of the backward pass on NumPy, with whether it holds in these results."""
    out = []
    main = [r for r in rows if list(r["case"]) != list(MEMORY_CASE)]
    if main:
        ratios = [r["ratio_to_torch"]["polyattn"] for r in main]
        worst = max(main, key=lambda r: r["ratio_to_torch"]["polyattn"])
        best = min(main, key=lambda r: r["ratio_to_torch"]["polyattn"])
        n_ok = sum(x <= TARGET_RATIO for x in ratios)
        out.append(f"NumPy forward+backward ≤ {TARGET_RATIO}× torch's time: {n_ok}/{len(main)} "
                   f"cases; median ratio {statistics.median(ratios):.2f}, best "
                   f"{best['ratio_to_torch']['polyattn']:.2f} at {_case(best)}, worst "
                   f"{worst['ratio_to_torch']['polyattn']:.2f} at {_case(worst)}")
        bwd = [r["ratio_to_torch"]["polyattn backward"] for r in main]
        fwd = [r["ratio_to_torch"]["polyattn forward"] for r in main]
        for name in ("numba_cpu", "numpy_path"):
            nb = [r["ratio_to_torch"][name] for r in main if name in r["ratio_to_torch"]]
            if nb:
                out.append(f"{name} forward+backward / torch: median "
                           f"{statistics.median(nb):.2f}× (range {min(nb):.2f}–{max(nb):.2f})")
        out.append(f"by pass (medians over the cases): forward {statistics.median(fwd):.2f}× "
                   f"torch's forward, backward ≈ {statistics.median(bwd):.2f}× torch's "
                   "backward (total minus forward)")
        for dtype in ("float32", "float64"):
            passes = [r["gflops_by_pass"] for r in main
                      if r["dtype"] == dtype and "gflops_by_pass" in r]
            if passes:
                f_rate = [p["forward"] for p in passes]
                b_rate = [p["backward"] for p in passes]
                out.append(f"polyattn GFLOP/s by pass, {dtype} (two products forward, five "
                           f"backward): forward median {statistics.median(f_rate):.0f} "
                           f"({min(f_rate):.0f}–{max(f_rate):.0f}), backward median "
                           f"{statistics.median(b_rate):.0f} "
                           f"({min(b_rate):.0f}–{max(b_rate):.0f})")
    for r in rows:
        if list(r["case"]) == list(MEMORY_CASE) and r["causal"] and r["dtype"] == "float32":
            mib = r["peak_extra_mib"]["polyattn"]
            out.append(f"peak extra memory of forward+backward at {tuple(MEMORY_CASE)} float32 "
                       f"causal: {mib:.1f} MiB ({'<' if mib < MEMORY_TARGET_MIB else '≥'} "
                       f"{MEMORY_TARGET_MIB} MiB; of it {r['io_mib']:.0f} MiB are out, dq, dk "
                       f"and dv; the score matrix alone would be "
                       f"{r['score_matrix_mib'] / 1024:.0f} GiB); time "
                       f"{r['median_s']['polyattn']:.2f} s, "
                       f"{r['ratio_to_torch']['polyattn']:.2f}× torch")
    diffs = [(r["rel_diff_vs_torch"]["polyattn"], r) for r in rows]
    if diffs:
        worst_f32 = max((d for d in diffs if d[1]["dtype"] == "float32"), default=None,
                        key=lambda d: d[0])
        worst_f64 = max((d for d in diffs if d[1]["dtype"] == "float64"), default=None,
                        key=lambda d: d[0])
        parts = [f"{dt} ≤ {d[0]:.1e}" for dt, d in (("float32", worst_f32),
                                                      ("float64", worst_f64)) if d]
        out.append("polyattn's (out, dq, dk, dv) against torch's, largest relative "
                   "difference: " + ", ".join(parts))
    return out


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    """The results as a Markdown report (environment, table, targets)."""
    blas = "; ".join(f"{x['library']}, kernel {x['kernel']}, {x['threads']} threads"
                     for x in env["numpy_blas"])
    backends = sorted({r["torch_backend"] for r in rows})
    impls = sorted({f"{r['implementation']} ({r['module']})" for r in rows})
    lines = [
        f"# Forward+backward benchmark (CPU), {env['date']}",
        "",
        f"- Command: `{command}`",
        f"- CPU: {env['cpu']} ({env['cpu_count']} logical CPUs), SIMD: {env['simd']} "
        f"(torch dispatches to {env['torch_cpu_capability']}); load average at start "
        f"{env['load_average_start'][0]:.2f}, at end {env['load_average_end'][0]:.2f}",
        f"- NumPy {env['versions']['numpy']} BLAS: {blas}; polyattn NumPy path: "
        f"{env['polyattn_numpy_threads']} threads; `--threading {env['threading']}`: its "
        f"items run {env['polyattn_numpy_threading_in_calls']}",
        f"- torch {env['versions']['torch']} with {env['torch_threads']} threads, SDPA "
        f"backend: {', '.join(backends)}; polyattn {env['versions']['polyattn']} "
        f"(`attention_vjp`, \"auto\" ran {', '.join(impls)}); Python {env['python']}",
        f"- numba_cpu: {env.get('numba_cpu_tiles', 'not recorded')}",
        "- Environment variables: "
        + (", ".join(f"{k}={v}" for k, v in env["env"].items() if v) or "none of "
           + ", ".join(env["env"]) + " set"),
        "",
        "Median of the timed rounds, interleaved. polyattn = `out, pullback = "
        "attention_vjp(q, k, v, is_causal=…)` then `pullback(grad_out)` on NumPy arrays; "
        "torch = SDPA then `(out * grad_out).sum().backward()`; naive = the forward and "
        "backward formulas in NumPy with the (T, T) matrices materialised. fwd = the "
        "forward call alone (`attention_vjp`; torch SDPA with autograd recording). ratio = "
        "polyattn / torch forward+backward time (< 1: polyattn faster); bwd ratio = the same "
        "for (forward+backward − forward), an estimate. Memory = peak extra memory of "
        "the forward+backward call (tracemalloc: out, lse, gradients and working memory; "
        "torch is not traced); work = that minus out, dq, dk and dv; scores = one "
        "(B, H, T, T) matrix in the case's dtype.",
        "",
        "| case (B, H, T, E) | causal | dtype | polyattn ms | fwd ms | torch ms | fwd ms "
        "| naive ms | ratio | fwd ratio | bwd ratio | numba_cpu ratio | NumPy path ratio "
        "| polyattn MiB | work MiB | naive MiB | scores MiB | diff vs torch |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
        "|---:|---:|",
    ]
    for r in rows:
        med, rat, mem = r["median_s"], r["ratio_to_torch"], r["peak_extra_mib"]
        naive_ms = f"{med['naive'] * 1e3:.0f}" if "naive" in med else "—"
        naive_mib = f"{mem['naive']:.0f}" if "naive" in mem else "—"
        numba = f"{rat['numba_cpu']:.2f}" if "numba_cpu" in rat else "—"
        numpy_path = f"{rat['numpy_path']:.2f}" if "numpy_path" in rat else "—"
        lines.append(
            f"| {tuple(r['case'])} | {'yes' if r['causal'] else 'no'} | {r['dtype']} "
            f"| {med['polyattn'] * 1e3:.0f} | {med['polyattn forward'] * 1e3:.0f} "
            f"| {med['torch'] * 1e3:.0f} | {med['torch forward'] * 1e3:.0f} | {naive_ms} "
            f"| **{rat['polyattn']:.2f}** | {rat['polyattn forward']:.2f} "
            f"| {rat['polyattn backward']:.2f} | {numba} | {numpy_path} "
            f"| {mem['polyattn']:.1f} "
            f"| {r['working_mib']['polyattn']:.1f} | {naive_mib} "
            f"| {r['score_matrix_mib']:.0f} | {r['rel_diff_vs_torch']['polyattn']:.1e} |")
    lines += ["", "## Targets", ""] + [f"- {t}" for t in targets(rows)]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Ratio polyattn / torch per case (both dtypes), and peak extra memory against scores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_m) = plt.subplots(1, 2, figsize=(12, 5.4),
                                     gridspec_kw={"width_ratios": [3, 2]})
    shapes = [list(c) for c in dict.fromkeys(tuple(r["case"]) for r in rows)]
    labels = [f"{tuple(s)}" for s in shapes]
    series = [(dt, causal) for dt in ("float32", "float64") for causal in (False, True)]
    width = 0.8 / len(series)
    for n, (dt, causal) in enumerate(series):
        xs, ys = [], []
        for i, s in enumerate(shapes):
            for r in rows:
                if r["case"] == s and r["dtype"] == dt and r["causal"] == causal:
                    xs.append(i + (n - (len(series) - 1) / 2) * width)
                    ys.append(r["ratio_to_torch"]["polyattn"])
        if xs:
            ax_r.bar(xs, ys, width, label=f"{dt}{' causal' if causal else ''}",
                     hatch="//" if causal else None,
                     color="tab:blue" if dt == "float32" else "tab:green",
                     alpha=0.6 if causal else 0.9)
    ax_r.axhline(1.0, color="black", linewidth=0.8)
    ax_r.axhline(TARGET_RATIO, color="tab:red", linestyle="--", linewidth=1,
                 label=f"target {TARGET_RATIO}×")
    ax_r.set_xticks(range(len(shapes)), labels, fontsize=8)
    ax_r.set_xlabel("case (B, H, T, E)")
    ax_r.set_ylabel("forward+backward time, polyattn / torch")
    ax_r.set_title("time ratio (lower is better)")
    ax_r.grid(True, axis="y", alpha=0.3)
    ax_r.legend(fontsize=7)

    mem = [r for r in rows if r["dtype"] == "float32" and r["causal"]]
    ys = range(len(mem))
    ax_m.barh([y + 0.2 for y in ys], [r["peak_extra_mib"]["polyattn"] for r in mem], 0.4,
              color="tab:blue", label="polyattn forward+backward, peak extra")
    ax_m.barh([y - 0.2 for y in ys], [r["score_matrix_mib"] for r in mem], 0.4,
              color="tab:gray", label="one (B, H, T, T) score matrix")
    naive = [(y, r["peak_extra_mib"]["naive"]) for y, r in zip(ys, mem, strict=True)
             if "naive" in r["peak_extra_mib"]]
    if naive:
        ax_m.plot([m for _, m in naive], [y - 0.2 for y, _ in naive], "o", color="tab:orange",
                  label="naive forward+backward, peak extra")
    ax_m.axvline(MEMORY_TARGET_MIB, color="tab:red", linestyle="--", linewidth=1,
                 label=f"{MEMORY_TARGET_MIB} MiB target at T = {MEMORY_CASE[2]}")
    ax_m.set_yticks(list(ys), [f"{tuple(r['case'])}" for r in mem], fontsize=8)
    ax_m.set_xscale("log")
    ax_m.set_xlim(left=1)
    ax_m.set_xlabel("MiB (tracemalloc)")
    ax_m.set_title("memory, float32 causal")
    ax_m.grid(True, axis="x", alpha=0.3)
    ax_m.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    fig.suptitle("attention_vjp forward+backward on NumPy vs torch SDPA + backward(), CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5,
                        help="timed rounds per case (the memory case: half, at least 3)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: float32, the two smallest shapes, 3 rounds, no "
                        "memory case")
    parser.add_argument("--no-memory", action="store_true", help="skip the memory case")
    parser.add_argument("--threading", choices=["pool", "default"], default="pool",
                        help="polyattn calls under a one-thread BLAS limit (its thread pool), "
                        "or with BLAS as it is")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    reps = 3 if args.quick else args.reps

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    env = environment()
    env["simd"] = simd_level()
    env["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    env["threading"] = args.threading
    with blas_mode(args.threading):
        env["polyattn_numpy_threading_in_calls"] = numpy_chunked.threading_mode()
    print(json.dumps({k: env[k] for k in ("cpu", "cpu_count", "simd", "numpy_blas",
                                          "torch_threads", "polyattn_numpy_threading_in_calls",
                                          "env", "load_average_start")}, indent=1))
    rng = np.random.default_rng(0)
    plan = [(case, causal, dtype, reps, True)
            for dtype in (["float32"] if args.quick else ["float32", "float64"])
            for case in (QUICK_CASES if args.quick else CASES) for causal in (False, True)]
    if not (args.quick or args.no_memory):
        plan.append((MEMORY_CASE, True, "float32", max(3, reps // 2), False))
    rows = []
    started = time.perf_counter()
    for case, causal, dtype, n, naive in plan:
        row = run_case(*case, causal, dtype, n, rng, args.threading, naive=naive)
        rows.append(row)
        med = row["median_s"]
        print(f"{dtype} {case} causal={causal}: polyattn {med['polyattn'] * 1e3:.0f} ms, "
              f"torch {med['torch'] * 1e3:.0f} ms ({row['torch_backend']}), ratio "
              f"{row['ratio_to_torch']['polyattn']:.2f}, "
              f"{row['peak_extra_mib']['polyattn']:.1f} MiB, diff "
              f"{row['rel_diff_vs_torch']['polyattn']:.1e}", flush=True)
    env["load_average_end"] = list(os.getloadavg())
    env["elapsed_s"] = time.perf_counter() - started

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"backward-cpu-{env['date']}"
    command = "python benchmarks/backward.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if all(os.environ.get(n) is None for n in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + command
    report = {"environment": env, "command": command.strip(), "results": rows,
              "targets": targets(rows)}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(env, rows, command.strip()))
    plot(rows, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json, .md and .png in {env['elapsed_s']:.0f} s")
    print("\n".join(report["targets"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
