"""CPU benchmark: polyattn against torch SDPA, naive NumPy and the machine's GEMM rate.

Run with ``nox -s bench`` or ``python benchmarks/cpu.py`` (``--help`` for options).
Every case times its contenders interleaved in one process (the order rotates
each round), takes the median of ``--reps`` rounds after a warm-up, and
reports ratios measured side by side, which stay meaningful on a shared
machine where absolute times do not. Each timed call follows a pause of
``SETTLE_S`` and one untimed call of the same contender: the libraries keep
worker threads busy-waiting after a call (OpenBLAS for about 0.1 s), and a
call timed right after another library's would share the cores with them (a
torch call right after a NumPy matmul took twice its time here); this way
every contender is timed in its own steady state.

FLOPs: forward attention is ``4·B·H·Tq·Tk·E`` (two matrix products), half of
that under a causal mask. The GEMM rate is a NumPy ``matmul`` of two n×n
matrices (n chosen so its FLOPs are comparable to the case, 512 ≤ n ≤ 2048)
in the same dtype, with NumPy's default BLAS threads, timed in the same
rounds. Peak extra memory is measured by tracemalloc (NumPy reports its
buffers to it) in a separate, untimed call: everything allocated during the
call above what was allocated before it, output included. torch's
allocations are not traced.

Results go to ``benchmarks/results/cpu-<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import tracemalloc
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import polyattn

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: (B, H, T, E), each run with and without a causal mask, in float32 and float64.
CASES = [(1, 8, 1024, 64), (1, 8, 4096, 64), (1, 4, 4096, 128), (4, 12, 512, 64)]
#: Long sequences whose (T, T) scores would not fit: float32, causal.
MEMORY_CASES = [(1, 1, 32768, 64), (1, 1, 65536, 64)]
#: Peak extra memory allowed at (1, 1, 32768, 64) float32 causal.
MEMORY_TARGET_MIB = 64
#: The naive implementation is skipped where its scores would exceed this.
NAIVE_MAX_SCORE_BYTES = 2 * 2**30


def flops(b: int, h: int, t: int, e: int, causal: bool) -> float:
    """Forward attention FLOPs: two (T×T×E) products, 2 FLOPs per multiply-add."""
    f = 4.0 * b * h * t * t * e
    return f / 2 if causal else f


# --- the contenders ---------------------------------------------------------------------

def naive_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """softmax(Q Kᵀ / √E) V with the whole score matrix materialised (no blocking)."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1]).astype(q.dtype)  # (B, H, T, T)
    if causal:
        t = q.shape[-2]
        s = np.where(np.tri(t, dtype=bool), s, -np.inf)
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    return s @ v


def numpy_products(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool) -> np.ndarray:
    """Only the two matrix products of blocked attention, on NumPy's BLAS: the floor.

    Per (batch, head, query block, key block) ``s = q @ kᵀ`` and ``s @ v``, with the block
    sizes of polyattn's NumPy path, the key blocks past the causal diagonal skipped in the
    same way, and the items run as the NumPy path runs them (``threading_mode()``: on its
    thread pool with one BLAS thread per call, or inline with BLAS's own threads):
    everything of polyattn's NumPy path except the softmax (no ``exp``, sums, rescaling or
    normalisation). Any exact attention built on NumPy's ``matmul`` computes these
    products, so this time is a lower bound for it on this machine.
    """
    from polyattn.backends.numpy import forward as numpy_chunked
    from polyattn.rules.visibility import Rules

    # the NumPy path's own block sizes and rectangles (query heads = key/value heads here)
    rules = Rules(q.shape[-2], k.shape[-2], causal=causal)
    p = numpy_chunked._Problem(q, k, v, None, 1.0, rules)
    b, h, t = q.shape[:3]
    out = np.empty_like(q)

    def item(i: int, j: int, q0: int) -> None:
        q1 = min(q0 + p.bq, t)
        scratch = np.empty(p.block_elems, dtype=q.dtype)
        pv = np.empty((q1 - q0, v.shape[-1]), dtype=q.dtype)
        for r0, r1, k0, k1 in numpy_chunked._tiles(p, q0, q1, p.key_block(q1 - q0)):
            sb = scratch[:(r1 - r0) * (k1 - k0)].reshape(r1 - r0, k1 - k0)
            np.matmul(q[i, j, q0 + r0:q0 + r1], k[i, j, k0:k1].T, out=sb)
            np.matmul(sb, v[i, j, k0:k1], out=pv[r0:r1])
        out[i, j, q0:q1] = pv

    jobs = [partial(item, i, j, q0) for i in range(b) for j in range(h)
            for q0 in range(0, t, p.bq)]
    if numpy_chunked.threading_mode() == "pool":
        numpy_chunked._run_jobs(jobs, numpy_chunked.num_threads())
    else:
        for job in jobs:
            job()
    return out


def gemm_operands(fl: float, dtype: Any, rng: np.random.Generator) -> tuple[np.ndarray, ...]:
    """Two n×n matrices with 2n³ close to ``fl`` (512 <= n <= 2048, a multiple of 64)."""
    n = round((fl / 2) ** (1 / 3) / 64) * 64
    n = min(2048, max(512, n))
    a = rng.standard_normal((n, n)).astype(dtype)
    b = rng.standard_normal((n, n)).astype(dtype)
    return a, b


# --- measurement --------------------------------------------------------------------------

#: Seconds of pause before each contender's untimed-then-timed pair of calls: longer than
#: the busy-wait of the previous contender's worker threads (OpenBLAS's lasts about 0.1 s).
SETTLE_S = 0.15


def time_interleaved(fns: dict[str, Any], reps: int, *, settle: float = SETTLE_S,
                     cold: tuple[str, ...] = ("naive",), min_sample: float = 0.0,
                     ) -> dict[str, list[float]]:
    """One warm-up call each, then ``reps`` rounds, rotating the order every round; in a
    round each contender is timed after a pause of ``settle`` seconds and one untimed call
    of its own (none for those in ``cold``: the long single-pass ones). With
    ``min_sample`` (seconds), a contender whose warm-up call took less is called that
    many times back to back in each timed sample (as many as fill ``min_sample``), and
    the sample is the mean per call: the steady-state time of a call made in a loop,
    rather than that of one call after the pause."""
    names = list(fns)
    calls = {}
    for name in names:
        t0 = time.perf_counter()
        fns[name]()
        took = time.perf_counter() - t0
        calls[name] = max(1, math.ceil(min_sample / took)) if min_sample > took else 1
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            gc.collect()
            time.sleep(settle)
            if name not in cold:
                fns[name]()
            t0 = time.perf_counter()
            for _ in range(calls[name]):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / calls[name])
    return times


def peak_extra_bytes(fn: Any) -> int:
    """Peak bytes allocated during ``fn()`` above what was allocated before (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        result = fn()
        _, peak = tracemalloc.get_traced_memory()
        del result
    finally:
        tracemalloc.stop()
    return peak - base


def environment() -> dict[str, Any]:
    """BLAS (threadpoolctl), thread counts, library versions, CPU and machine load."""
    import threadpoolctl
    import torch

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    pools = [
        {key: info.get(key) for key in ("user_api", "internal_api", "prefix", "version",
                                          "architecture", "threading_layer", "num_threads",
                                          "filepath")}
        for info in threadpoolctl.threadpool_info()
    ]
    blas = [p for p in pools if p["user_api"] == "blas"]
    return {
        "date": _dt.date.today().isoformat(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_identity": cpu_identity(),
        "cpu_count": os.cpu_count(),
        "load_average_start": list(os.getloadavg()),
        "versions": {"polyattn": polyattn.__version__, "numpy": np.__version__,
                     "torch": torch.__version__, "threadpoolctl": threadpoolctl.__version__},
        "numpy_blas": [{"library": f"{p['internal_api']} {p['version']}",
                        "kernel": p["architecture"], "threads": p["num_threads"],
                        "threading_layer": p["threading_layer"]} for p in blas],
        "threadpools": pools,
        "torch_threads": torch.get_num_threads(),
        "torch_parallel_info": torch.__config__.parallel_info().strip().splitlines()[:6],
        "polyattn_numpy_threads": _polyattn_threads(),
        "polyattn_numpy_threading": _polyattn_threading(),
        "numba_cpu_tiles": _numba_cpu_tiles(),
        "timing": (f"median of the rounds; each timed call after a {SETTLE_S} s pause and an "
                   "untimed call of the same contender (naive: the pause only)"),
        "simd": simd_level(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "env": {name: os.environ.get(name) for name in
                ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
                 "OMP_NUM_THREADS", "POLYATTN_SCORE_BUDGET", "NUMBA_THREADING_LAYER")},
    }


def cpu_identity() -> dict[str, str]:
    """The CPU's vendor, family, model and stepping from /proc/cpuinfo (a virtual machine may
    show only a generic model name, "AMD EPYC": the family and model tell the generation)."""
    found: dict[str, str] = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return found
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("vendor_id", "cpu family", "model", "stepping") and key not in found:
            found[key] = value.strip()
        if not line.strip() and found:
            break
    return found


def simd_level() -> str:
    """The widest x86 vector extension in /proc/cpuinfo's flags ("avx512f", "avx2", ...)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            flags = set(line.split(":", 1)[1].split())
            for level in ("avx512f", "avx2", "avx", "sse4_2", "asimd", "neon"):
                if level in flags:
                    return level
            return "none of avx512f, avx2, avx, sse4_2, asimd, neon"
    return "unknown"


def _numba_cpu_tiles() -> str:
    """The SIMD vectors and register tiles of the numba_cpu kernel on this CPU."""
    if not numba_cpu_usable():
        return "numba_cpu not usable"
    from polyattn.backends.numba_cpu import launch as numba_cpu

    return numba_cpu.tiles()


def numba_cpu_usable() -> bool:
    from polyattn.backends.numba_cpu import launch as numba_cpu

    return numba_cpu.availability()[0]


def _polyattn_threads() -> int:
    from polyattn.backends.numpy import forward as numpy_chunked

    return numpy_chunked.num_threads()


def _polyattn_threading() -> str:
    from polyattn.backends.numpy import forward as numpy_chunked

    return numpy_chunked.threading_mode()


def run_case(b: int, h: int, t: int, e: int, causal: bool, dtype: str, reps: int,
             rng: np.random.Generator, *, naive: bool = True, gemm: bool = True,
             ) -> dict[str, Any]:
    """Time one case; return its row of results."""
    import torch

    q, k, v = (rng.standard_normal((b, h, t, e)).astype(dtype) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    fl = flops(b, h, t, e, causal)
    score_bytes = b * h * t * t * np.dtype(dtype).itemsize
    run_naive = naive and score_bytes <= NAIVE_MAX_SCORE_BYTES

    def ours():
        return polyattn.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def theirs():
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                    is_causal=causal)

    def by_name(name: str) -> Any:
        return lambda: polyattn.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                             implementation=name)

    fns: dict[str, Any] = {"polyattn": ours, "torch": theirs,
                           "products": lambda: numpy_products(q, k, v, causal),
                           "numpy_path": by_name("chunked")}
    auto = polyattn.explain(q, k, v, is_causal=causal).implementation
    if numba_cpu_usable() and auto != "numba_cpu":
        fns["numba_cpu"] = by_name("numba_cpu")     # (where "auto" runs it, it is polyattn)
    if run_naive:
        fns["naive"] = lambda: naive_numpy(q, k, v, causal)
    if gemm:
        ga, gb = gemm_operands(fl, dtype, rng)
        fns["gemm"] = lambda: ga @ gb
    times = time_interleaved(fns, reps)
    if auto == "numba_cpu":
        times["numba_cpu"] = times["polyattn"]
    med = {name: statistics.median(ts) for name, ts in times.items()}

    # correctness guard: the contenders agree
    ref = theirs().numpy()
    got = ours()
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))

    row: dict[str, Any] = {
        "case": [b, h, t, e], "causal": causal, "dtype": dtype, "gflop": fl / 1e9,
        "implementation": auto,
        "rel_diff_vs_torch": err,
        "times_s": times,
        "median_s": med,
        "gflops": {name: fl / med[name] / 1e9 for name in med if name != "gemm"},
        "ratio_to_torch": {name: med[name] / med["torch"] for name in med
                           if name not in ("torch", "gemm")},
        "products_share_of_polyattn": med["products"] / med["polyattn"],
        "peak_extra_mib": {"polyattn": peak_extra_bytes(ours) / 2**20},
        "max_abs_err_vs_float64": {},
    }
    # every contender against the float64 oracle (torch SDPA in float64)
    with torch.no_grad():
        oracle = torch.nn.functional.scaled_dot_product_attention(
            tq.double(), tk.double(), tv.double(), is_causal=causal).numpy()
    for name in ("polyattn", "numpy_path", "numba_cpu"):
        if name in fns and name in med:
            row["max_abs_err_vs_float64"][name] = float(np.max(np.abs(fns[name]() - oracle)))
    if gemm:
        n = ga.shape[0]
        gemm_rate = 2.0 * n**3 / med["gemm"] / 1e9
        row["gemm"] = {"n": n, "gflops": gemm_rate}
        row["fraction_of_gemm"] = {name: row["gflops"][name] / gemm_rate
                                   for name in row["gflops"]}
    if run_naive:
        row["peak_extra_mib"]["naive"] = peak_extra_bytes(fns["naive"]) / 2**20
    else:
        row["naive_skipped"] = (f"its {score_bytes / 2**30:.1f} GiB score matrix (times the "
                                "temporaries) is not materialised")
    return row


# --- reporting ---------------------------------------------------------------------------

def _fmt_case(row: dict[str, Any]) -> str:
    b, h, t, e = row["case"]
    return f"({b}, {h}, {t}, {e})"


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    """The results as a Markdown report (environment, table, targets)."""
    blas = "; ".join(f"{x['library']}, kernel {x['kernel']}, {x['threads']} threads"
                     for x in env["numpy_blas"])
    identity = "".join(f"{key} {value}, " for key, value in env.get("cpu_identity", {}).items())
    lines = [
        f"# CPU benchmark, {env['date']}",
        "",
        f"- Command: `{command}`",
        f"- CPU: {env['cpu']} ({identity}{env['cpu_count']} logical CPUs), SIMD: "
        f"{env.get('simd', 'not recorded')} (torch dispatches to "
        f"{env.get('torch_cpu_capability', '?')}); load average at start "
        f"{env['load_average_start'][0]:.2f}, at end {env['load_average_end'][0]:.2f}",
        f"- NumPy {env['versions']['numpy']} BLAS: {blas}; polyattn NumPy path threads: "
        f"{env['polyattn_numpy_threads']}",
        f"- torch {env['versions']['torch']} with {env['torch_threads']} threads; "
        f"polyattn {env['versions']['polyattn']}; Python {env['python']}",
        f"- numba_cpu: {env.get('numba_cpu_tiles', 'not recorded')}",
        f"- Timing: {env.get('timing', 'median of the rounds, contenders interleaved')}",
        "- Environment variables: "
        + (", ".join(f"{k}={v}" for k, v in env["env"].items() if v) or "none of "
           + ", ".join(env["env"]) + " set"),
        "",
        "Median of the timed rounds; ratio = polyattn time / torch SDPA time (< 1: polyattn "
        "faster); products = the two matrix products of the same blocked computation alone, "
        "on NumPy's BLAS, with polyattn's blocks and threads and no softmax (a lower bound "
        "for any exact attention built on NumPy's matmul), and floor = products time / torch "
        "time; GEMM % = polyattn GFLOP/s as a share of the NumPy matmul rate measured in "
        "the same rounds; memory = peak extra memory of the call (tracemalloc, output "
        "included; torch is not traced).",
        "",
        "| case (B, H, T, E) | causal | dtype | impl | polyattn ms | torch ms | products ms "
        "| naive ms | ratio | floor | numpy_chunked ratio | numba_cpu ratio "
        "| polyattn GFLOP/s | torch GFLOP/s | GEMM GFLOP/s "
        "| GEMM % | polyattn MiB | naive MiB |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
        "|---:|---:|",
    ]
    for r in rows:
        med = r["median_s"]
        naive_ms = f"{med['naive'] * 1e3:.0f}" if "naive" in med else "—"
        naive_mib = f"{r['peak_extra_mib']['naive']:.0f}" if "naive" in r["peak_extra_mib"] \
            else "—"
        gemm = f"{r['gemm']['gflops']:.0f}" if "gemm" in r else "—"
        frac = f"{100 * r['fraction_of_gemm']['polyattn']:.0f}%" if "gemm" in r else "—"
        lines.append(
            f"| {_fmt_case(r)} | {'yes' if r['causal'] else 'no'} | {r['dtype']} "
            f"| {r['implementation']} | {med['polyattn'] * 1e3:.0f} | {med['torch'] * 1e3:.0f} "
            f"| {med['products'] * 1e3:.0f} "
            f"| {naive_ms} | **{r['ratio_to_torch']['polyattn']:.2f}** "
            f"| {r['ratio_to_torch']['products']:.2f} "
            f"| {_ratio(r, 'numpy_path')} | {_ratio(r, 'numba_cpu')} "
            f"| {r['gflops']['polyattn']:.0f} | {r['gflops']['torch']:.0f} | {gemm} | {frac} "
            f"| {r['peak_extra_mib']['polyattn']:.1f} | {naive_mib} |")
    lines += ["", "## Targets", ""] + [f"- {t}" for t in targets(rows)]
    return "\n".join(lines) + "\n"


def _ratio(row: dict[str, Any], name: str) -> str:
    value = row["ratio_to_torch"].get(name)
    return "—" if value is None else f"{value:.2f}"


def targets(rows: list[dict[str, Any]]) -> list[str]:
    """Each target of the CPU path, with whether it holds in these results."""
    out = []
    main = [r for r in rows if tuple(r["case"]) in map(tuple, CASES)]
    worst = max(main, key=lambda r: r["ratio_to_torch"]["polyattn"], default=None)
    if worst is not None:
        for dtype in ("float32", "float64"):
            these = [r for r in main if r["dtype"] == dtype]
            if not these:
                continue
            ratios = [r["ratio_to_torch"]["polyattn"] for r in these]
            n_ok = sum(x <= 1.1 for x in ratios)
            bad = max(these, key=lambda r: r["ratio_to_torch"]["polyattn"])
            out.append(f"{dtype}: polyattn auto / torch median "
                       f"{statistics.median(ratios):.2f}× (target ≤ 0.9×); ≤ 1.1× in "
                       f"{n_ok}/{len(these)} cases (target all); worst "
                       f"{bad['ratio_to_torch']['polyattn']:.2f}× at {_fmt_case(bad)} "
                       f"{'causal ' if bad['causal'] else ''}")
            for name in ("numpy_path", "numba_cpu"):
                got = [r["ratio_to_torch"][name] for r in these if name in r["ratio_to_torch"]]
                if got:
                    out.append(f"{dtype}: {name} / torch median {statistics.median(got):.2f}× "
                               f"(range {min(got):.2f}–{max(got):.2f})")
    if main:
        n_floor = sum(r["ratio_to_torch"]["products"] > 1.0 for r in main)
        lowest = min(main, key=lambda r: r["ratio_to_torch"]["products"])
        out.append(f"NumPy's BLAS products alone (no softmax) take longer than torch's whole "
                   f"SDPA in {n_floor}/{len(main)} cases; lowest floor "
                   f"{lowest['ratio_to_torch']['products']:.2f}× at {_fmt_case(lowest)} "
                   f"{'causal ' if lowest['causal'] else ''}{lowest['dtype']}; polyattn's time "
                   f"is {_share_range(main)} products")
    long = [r for r in main if r["case"][2] >= 4096 and "gemm" in r]
    for e, need in ((128, 0.6), (64, 0.5)):
        these = [r for r in long if r["case"][3] == e]
        if not these:
            continue
        low = min(these, key=lambda r: r["fraction_of_gemm"]["polyattn"])
        n_ok = sum(r["fraction_of_gemm"]["polyattn"] >= need for r in these)
        out.append(f"≥ {100 * need:.0f}% of the GEMM rate at T ≥ 4096, E = {e}: "
                   f"{n_ok}/{len(these)} cases; lowest "
                   f"{100 * low['fraction_of_gemm']['polyattn']:.0f}% at {_fmt_case(low)} "
                   f"{'causal ' if low['causal'] else ''}{low['dtype']}")
    for r in rows:
        if r["case"] == [1, 1, 32768, 64]:
            mib = r["peak_extra_mib"]["polyattn"]
            out.append(f"peak extra memory at (1, 1, 32768, 64) float32 causal: {mib:.1f} MiB "
                       f"({'≤' if mib <= MEMORY_TARGET_MIB else '>'} {MEMORY_TARGET_MIB} MiB; "
                       f"the score matrix would be "
                       f"{32768 * 32768 * 4 / 2**30:.0f} GiB)")
        if r["case"] == [1, 1, 65536, 64]:
            out.append(f"(1, 1, 65536, 64) float32 causal runs: "
                       f"{r['median_s']['polyattn']:.2f} s, "
                       f"{r['peak_extra_mib']['polyattn']:.1f} MiB extra")
    return out


def _share_range(rows: list[dict[str, Any]]) -> str:
    """"53–78% (median 64%)": the products' share of polyattn's time over ``rows``."""
    shares = sorted(100 * r["products_share_of_polyattn"] for r in rows)
    return (f"{shares[0]:.0f}–{shares[-1]:.0f}% (median {statistics.median(shares):.0f}%)"
            if shares else "—")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Time ratio polyattn / torch against T, one series per case shape, dtype and mask."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    for ax, dtype in zip(axes, ("float32", "float64"), strict=True):
        series: dict[str, list[tuple[int, float]]] = {}
        for r in rows:
            if r["dtype"] != dtype:
                continue
            b, h, t, e = r["case"]
            label = f"B={b} H={h} E={e}{' causal' if r['causal'] else ''}"
            series.setdefault(label, []).append((t, r["ratio_to_torch"]["polyattn"]))
        for label, pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    linestyle="--" if "causal" in label else "-", label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length T")
        ax.set_title(dtype)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("time polyattn / torch SDPA (lower is better)")
    fig.suptitle("polyattn on NumPy vs torch SDPA, CPU, same process")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed rounds per case (≥ 5)")
    parser.add_argument("--quick", action="store_true",
                        help="float32 only, no memory cases (a smoke run)")
    parser.add_argument("--no-memory", action="store_true", help="skip the long-sequence cases")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    env = environment()
    print(json.dumps({k: env[k] for k in ("cpu", "cpu_count", "numpy_blas", "torch_threads",
                                          "env", "load_average_start")}, indent=1))
    rng = np.random.default_rng(0)
    rows = []
    dtypes = ["float32"] if args.quick else ["float32", "float64"]
    started = time.perf_counter()
    for dtype in dtypes:
        for case in CASES:
            for causal in (False, True):
                row = run_case(*case, causal, dtype, args.reps, rng)
                rows.append(row)
                print(f"{dtype} {case} causal={causal}: polyattn "
                      f"{row['median_s']['polyattn'] * 1e3:.0f} ms, torch "
                      f"{row['median_s']['torch'] * 1e3:.0f} ms, ratio "
                      f"{row['ratio_to_torch']['polyattn']:.2f}, "
                      f"{100 * row['fraction_of_gemm']['polyattn']:.0f}% of GEMM, "
                      f"{row['peak_extra_mib']['polyattn']:.1f} MiB", flush=True)
    if not (args.quick or args.no_memory):
        for case in MEMORY_CASES:
            row = run_case(*case, True, "float32", args.reps, rng, naive=False, gemm=False)
            rows.append(row)
            print(f"float32 {case} causal=True: polyattn {row['median_s']['polyattn']:.2f} s, "
                  f"torch {row['median_s']['torch']:.2f} s, "
                  f"{row['peak_extra_mib']['polyattn']:.1f} MiB", flush=True)
    env["load_average_end"] = list(os.getloadavg())
    env["elapsed_s"] = time.perf_counter() - started
    if numba_cpu_usable():
        from polyattn.backends.numba_cpu import threads

        layer = threads.threading_layer() or "not run"
        env["numba_cpu_tiles"] += f"; Numba threading layer: {layer}"

    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"cpu-{env['date']}"
    command = "python benchmarks/cpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    unset = [n for n in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE") if os.environ.get(n) is None]
    if len(unset) == 2:
        command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + command
    report = {"environment": env, "command": command.strip(), "results": rows,
              "targets": targets(rows)}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(env, rows, command.strip()))
    plot(rows, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json, .md, .png in {env['elapsed_s']:.0f} s")
    print("\n".join(report["targets"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
