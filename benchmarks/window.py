"""Sliding-window benchmark: time and memory against T, window (1024, 0) next to full causal.

Run with ``nox -s bench_window`` or ``python benchmarks/window.py`` (``--help``).
For each T in ``TS`` it times, interleaved in one process (the order rotates
every round; median of the rounds after a warm-up), on float32 (B, H, T, E) =
(1, 4, T, 64):

``polyattn window``
    ``scaled_dot_product_attention(q, k, v, is_causal=True, window=(1024, 0),
    implementation="chunked")`` on NumPy arrays: the NumPy path, which computes
    only the key blocks of the visible band, so its cost grows with T·window;
``polyattn causal``
    the same without the window (full causal, cost T²/2);
``torch window mask``
    ``torch.nn.functional.scaled_dot_product_attention`` with the window as an
    explicit dense (T, T) boolean mask, skipped where that mask, as the float
    bias torch may turn it into, would exceed ``TORCH_MASK_MAX_BYTES``;
``torch causal``
    torch SDPA with ``is_causal=True`` (full causal).

The polyattn calls run inside ``threadpoolctl``'s one-thread BLAS limit by default
(``--threading pool``): the NumPy path then runs its items on its thread pool, one
BLAS thread each, as the README advises. ``--threading default`` leaves BLAS as it
is; with NumPy's own OpenBLAS (pthreads) the items then run inline with BLAS on its
own threads, which on a loaded machine spends most of its time waking BLAS threads
(measured on 2 cores at load average 13: 10× the time of the pool, for window and
full causal alike), so it shows the machine's load more than the work done.

Peak extra memory of the polyattn calls is measured by tracemalloc in a separate,
untimed call (output included); torch's allocations are not traced. A guard checks
the windowed output: its last query rows against polyattn's reference implementation
on the keys they see, and the whole output against torch's masked SDPA where it ran.

Results go to ``benchmarks/results/window-cpu-<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from cpu import RESULTS, environment, peak_extra_bytes, simd_level, time_interleaved

import polyattn
from polyattn.backends.numpy import forward as numpy_chunked

#: Sequence lengths.
TS = [2048, 4096, 8192, 16384, 32768]
#: (left, right) of the sliding window, with is_causal=True.
WINDOW = (1024, 0)
#: (B, H, E) of every case.
SHAPE = (1, 4, 64)
#: torch's dense-mask contender is skipped where a float (T, T) mask would exceed this.
TORCH_MASK_MAX_BYTES = 2 * 2**30
#: Query rows of the guard against the reference implementation.
GUARD_ROWS = 64


def visible_pairs(t: int, left: int | None) -> int:
    """(query, key) pairs a causal mask (and a window of ``left`` keys) leaves visible."""
    if left is None:
        return t * (t + 1) // 2
    full = min(t, left + 1)                          # rows before the window is full
    return full * (full + 1) // 2 + (t - full) * (left + 1)


def dense_window_mask(t: int, left: int, right: int) -> np.ndarray:
    """Bool (T, T): key j visible to query i iff i - left <= j <= i + right and j <= i."""
    i = np.arange(t)[:, None]
    j = np.arange(t)[None, :]
    return (j <= i + min(right, 0)) & (j >= i - left)   # (T, T)


def guard(q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray) -> float:
    """Relative difference of the last rows of ``out`` from the reference on their keys."""
    t = q.shape[-2]
    n = min(t, WINDOW[0] + GUARD_ROWS)               # keys the last GUARD_ROWS rows see
    rows = min(t, GUARD_ROWS)
    want = polyattn.scaled_dot_product_attention(
        *(np.asarray(x, dtype=np.float64) for x in (q[..., -rows:, :], k[..., -n:, :],
                                                    v[..., -n:, :])),
        is_causal=True, causal_alignment="bottom_right", window=WINDOW,
        implementation="reference")
    got = out[..., -rows:, :]
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def blas_mode(threading: str) -> Any:
    """A context for the polyattn calls: one BLAS thread ("pool") or BLAS as it is."""
    if threading == "default":
        return contextlib.nullcontext()
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController().limit(limits=1, user_api="blas")


def run_case(t: int, reps: int, rng: np.random.Generator, threading: str) -> dict[str, Any]:
    """Time one sequence length; return its row of results."""
    import torch
    import torch.nn.functional as F

    b, h, e = SHAPE
    q, k, v = (rng.standard_normal((b, h, t, e)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

    def window() -> Any:
        with blas_mode(threading):
            return polyattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         window=WINDOW, implementation="chunked")

    def causal() -> Any:
        with blas_mode(threading):
            return polyattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                         implementation="chunked")

    def torch_causal() -> Any:
        with torch.no_grad():
            return F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)

    fns: dict[str, Any] = {"polyattn window": window, "polyattn causal": causal,
                           "torch causal": torch_causal}
    mask_bytes = 4 * t * t
    with blas_mode(threading):
        items_run = numpy_chunked.threading_mode()
    row: dict[str, Any] = {"T": t, "case": [b, h, t, e], "dtype": "float32",
                           "threading": threading, "polyattn_items_run": items_run,
                           "window": list(WINDOW), "reps": reps,
                           "visible_pairs": {"window": visible_pairs(t, WINDOW[0]),
                                             "causal": visible_pairs(t, None)}}
    if mask_bytes <= TORCH_MASK_MAX_BYTES:
        tmask = torch.from_numpy(dense_window_mask(t, *WINDOW))   # (T, T) bool

        def torch_window() -> Any:
            with torch.no_grad():
                return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tmask)

        fns["torch window mask"] = torch_window
    else:
        tmask = None
        row["torch_window_mask_skipped"] = (
            f"the dense (T, T) window mask is {t * t / 2**30:.1f} GiB as bool and "
            f"{mask_bytes / 2**30:.0f} GiB as a float bias (limit "
            f"{TORCH_MASK_MAX_BYTES / 2**30:.0f} GiB)")
    times = time_interleaved(fns, reps)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    out = window()
    row.update({
        "implementation": polyattn.explain(q, k, v, is_causal=True, window=WINDOW,
                                           implementation="chunked").module,
        "times_s": times,
        "median_s": med,
        "causal_over_window": med["polyattn causal"] / med["polyattn window"],
        "peak_extra_mib": {"polyattn window": peak_extra_bytes(window) / 2**20,
                           "polyattn causal": peak_extra_bytes(causal) / 2**20},
        "score_matrix_mib": b * h * t * t * 4 / 2**20,
        "rel_diff_last_rows_vs_reference": guard(q, k, v, out),
    })
    if tmask is not None:
        ref = fns["torch window mask"]().numpy()
        row["rel_diff_vs_torch_window_mask"] = float(np.linalg.norm(out - ref)
                                                     / np.linalg.norm(ref))
        row["torch_window_mask_over_polyattn_window"] = (med["torch window mask"]
                                                         / med["polyattn window"])
    return row


# --- reporting ---------------------------------------------------------------------------

def growth(rows: list[dict[str, Any]], name: str) -> str:
    """"×a.b" per doubling of T, from the first to the last row where ``name`` ran."""
    pts = [(r["T"], r["median_s"][name]) for r in rows if name in r["median_s"]]
    if len(pts) < 2:
        return "—"
    (t0, s0), (t1, s1) = pts[0], pts[-1]
    doublings = np.log2(t1 / t0)
    return (f"×{s1 / s0:.1f} from T = {t0} to {t1} (×{(s1 / s0) ** (1 / doublings):.2f} "
            "per doubling)")


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    """The results as a Markdown report (environment, table, growth)."""
    blas = "; ".join(f"{x['library']}, kernel {x['kernel']}, {x['threads']} threads"
                     for x in env["numpy_blas"])
    b, h, e = SHAPE
    lines = [
        f"# Sliding-window benchmark (CPU), {env['date']}",
        "",
        f"- Command: `{command}`",
        f"- CPU: {env['cpu']} ({env['cpu_count']} logical CPUs), SIMD: {env['simd']} "
        f"(torch dispatches to {env['torch_cpu_capability']}); load average at start "
        f"{env['load_average_start'][0]:.2f}, at end {env['load_average_end'][0]:.2f}",
        f"- NumPy {env['versions']['numpy']} BLAS: {blas}; polyattn NumPy path: "
        f"{env['polyattn_numpy_threads']} threads; `--threading {env['threading']}`: its "
        f"items run {env['polyattn_numpy_threading_in_calls']} (outside the benchmark's "
        f"limit: {env['polyattn_numpy_threading']})",
        f"- torch {env['versions']['torch']} with {env['torch_threads']} threads; "
        f"polyattn {env['versions']['polyattn']}; Python {env['python']}",
        "- Environment variables: "
        + (", ".join(f"{k}={v}" for k, v in env["env"].items() if v) or "none of "
           + ", ".join(env["env"]) + " set"),
        "",
        f"(B, H, E) = ({b}, {h}, {e}), float32, causal; window = {WINDOW} (each query sees "
        f"itself and the {WINDOW[0]} keys before it). Median of the timed rounds; "
        "polyattn runs `implementation=\"chunked\"` (the NumPy path); torch window mask = "
        "torch SDPA with the window as a dense (T, T) boolean `attn_mask`; memory = peak "
        "extra memory of the polyattn call (tracemalloc, output included; torch is not "
        "traced); visible = (query, key) pairs the rules leave visible, full causal / window.",
        "",
        "| T | reps | polyattn window ms | polyattn causal ms | causal / window "
        "| visible causal / window | torch window mask ms | torch causal ms "
        "| window MiB | causal MiB | scores MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        med = r["median_s"]
        tw = (f"{med['torch window mask'] * 1e3:.0f}" if "torch window mask" in med
              else "skipped")
        vis = r["visible_pairs"]["causal"] / r["visible_pairs"]["window"]
        lines.append(
            f"| {r['T']} | {r['reps']} | {med['polyattn window'] * 1e3:.0f} "
            f"| {med['polyattn causal'] * 1e3:.0f} | **{r['causal_over_window']:.1f}** "
            f"| {vis:.1f} | {tw} | {med['torch causal'] * 1e3:.0f} "
            f"| {r['peak_extra_mib']['polyattn window']:.1f} "
            f"| {r['peak_extra_mib']['polyattn causal']:.1f} | {r['score_matrix_mib']:.0f} |")
    lines += ["", "## Growth with T", ""]
    for name in ("polyattn window", "polyattn causal", "torch window mask", "torch causal"):
        lines.append(f"- {name}: {growth(rows, name)}")
    per_k = [r["median_s"]["polyattn window"] * 1e3 / (r["T"] / 1024) for r in rows]
    lines.append("- polyattn window, time per 1024 queries: "
                 + ", ".join(f"{x:.1f} ms" for x in per_k)
                 + " (a constant would mean time linear in T)")
    lines += ["", "## Checks", ""]
    for r in rows:
        note = (f"vs torch window mask {r['rel_diff_vs_torch_window_mask']:.1e}"
                if "rel_diff_vs_torch_window_mask" in r
                else f"torch window mask skipped: {r['torch_window_mask_skipped']}")
        lines.append(f"- T = {r['T']}: last {GUARD_ROWS} rows vs the reference (float64) "
                     f"{r['rel_diff_last_rows_vs_reference']:.1e}; {note}")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Time and peak extra memory against T (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"polyattn window": ("tab:blue", "-"), "polyattn causal": ("tab:blue", "--"),
              "torch window mask": ("tab:orange", "-"), "torch causal": ("tab:orange", "--")}
    for name, (color, line) in styles.items():
        pts = [(r["T"], r["median_s"][name] * 1e3) for r in rows if name in r["median_s"]]
        if pts:
            ax_t.plot(*zip(*pts, strict=True), marker="o", color=color, linestyle=line,
                      label=name)
    ax_t.set_ylabel("time, ms (median)")
    ax_t.set_title(f"time, window {WINDOW} vs full causal")
    for name, color in (("polyattn window", "tab:blue"), ("polyattn causal", "tab:green")):
        ax_m.plot([r["T"] for r in rows], [r["peak_extra_mib"][name] for r in rows],
                  marker="o", color=color, label=name)
    ax_m.plot([r["T"] for r in rows], [r["score_matrix_mib"] for r in rows], color="gray",
              linestyle=":", label="(B, H, T, T) float32 scores")
    ax_m.set_ylabel("peak extra memory, MiB (tracemalloc)")
    ax_m.set_title("memory of the polyattn calls")
    for ax in (ax_t, ax_m):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length T")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    b, h, e = SHAPE
    fig.suptitle(f"Sliding window on NumPy float32, (B, H, E) = ({b}, {h}, {e}), CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7,
                        help="timed rounds per T up to 8192 (half, at least 3, above)")
    parser.add_argument("--max-t", type=int, default=max(TS), help="largest T to run")
    parser.add_argument("--threading", choices=["pool", "default"], default="pool",
                        help="polyattn calls under a one-thread BLAS limit (its thread pool), "
                        "or with BLAS as it is")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    env = environment()
    env["simd"] = simd_level()
    env["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    env["threading"] = args.threading
    with blas_mode(args.threading):
        env["polyattn_numpy_threading_in_calls"] = numpy_chunked.threading_mode()
    print(json.dumps({k: env[k] for k in ("cpu", "cpu_count", "simd", "numpy_blas",
                                          "torch_threads", "polyattn_numpy_threading",
                                          "env", "load_average_start")}, indent=1))
    rng = np.random.default_rng(0)
    rows = []
    started = time.perf_counter()
    for t in (t for t in TS if t <= args.max_t):
        reps = args.reps if t <= 8192 else max(3, args.reps // 2)
        row = run_case(t, reps, rng, args.threading)
        rows.append(row)
        med = row["median_s"]
        print(f"T={t}: window {med['polyattn window'] * 1e3:.0f} ms, causal "
              f"{med['polyattn causal'] * 1e3:.0f} ms (×{row['causal_over_window']:.1f}), "
              f"{row['peak_extra_mib']['polyattn window']:.1f} MiB", flush=True)
    env["load_average_end"] = list(os.getloadavg())
    env["elapsed_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"window-cpu-{env['date']}"
    command = "python benchmarks/window.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if all(os.environ.get(n) is None for n in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + command
    report = {"environment": env, "command": command.strip(), "results": rows}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(env, rows, command.strip()))
    plot(rows, stem.with_suffix(".png"))
    print(f"wrote {stem}.json, .md and .png in {env['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
