"""Contention benchmark: the NumPy path's thread strategies on an idle and on a busy machine.

The NumPy path (``implementation="chunked"`` on NumPy arrays) can run its work
items in three ways where NumPy's BLAS has several threads and no thread-local
setter (NumPy's own OpenBLAS):

- ``inline, BLAS threads``: the items one after another in the calling thread,
  each product split over BLAS's own threads (``SHARED_BLAS = "leave"``);
- ``inline, 1 BLAS thread``: the same under ``threadpool_limits(1, "blas")`` with
  ``NUM_THREADS = 1``: one core;
- ``pool, 1 BLAS thread``: the items on the path's own thread pool, BLAS held to
  one thread (the caller's ``threadpool_limits(1, "blas")``);

and ``default`` is what the path does when nothing is set. Each is timed side by
side with torch's ``scaled_dot_product_attention`` (its default threads), naive
NumPy (the score matrix materialised, BLAS's default threads) and, where Numba is
installed, the fused ``numba_cpu`` kernel, first with the machine as it is
("idle": nothing started by this script) and then with one busy-loop process per
CPU running ("busy"). Ratios to torch's time in the same condition are the
figures: absolute times on a shared machine are noise.

Run with ``env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python benchmarks/contention.py``
(``--help``); 3 to 7 minutes on 2 shared cores (the contenders that collapse take most of
it). Results go to ``benchmarks/results/contention-<date>-<cpu>.{json,md}``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from cpu import cpu_identity, environment, naive_numpy, time_interleaved

import polyattn
from polyattn.backends.numpy import forward as numpy_chunked

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"

#: (B, H, T, E, causal, dtype): shapes of ``nox -s bench`` that take tens of milliseconds.
CASES = [(1, 8, 1024, 64, False, "float32"), (1, 8, 1024, 64, True, "float32"),
         (4, 12, 512, 64, True, "float32"), (1, 8, 1024, 64, False, "float64")]
#: The NumPy path's strategies: (NUM_THREADS, SHARED_BLAS, hold BLAS at one thread).
STRATEGIES = {
    "default": (None, None, False),
    "inline, BLAS threads": (1, "leave", False),
    "inline, 1 BLAS thread": (1, "leave", True),
    "pool, 1 BLAS thread": (None, "leave", True),
}


def _spin(stop: Any) -> None:
    """A busy loop until ``stop`` is set (one CPU's worth of contention)."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


@contextlib.contextmanager
def hogs(n: int) -> Any:
    """``n`` busy-loop processes while the block runs."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(n)]
    for p in procs:
        p.start()
    time.sleep(1.0)                           # let them reach full speed
    try:
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def strategy(name: str, fn: Any) -> Any:
    """``fn`` run under the NumPy path's strategy ``name``."""
    import threadpoolctl

    threads, shared, hold = STRATEGIES[name]

    def run() -> Any:
        saved = numpy_chunked.NUM_THREADS, numpy_chunked.SHARED_BLAS
        numpy_chunked.NUM_THREADS = threads
        if shared is not None:
            numpy_chunked.SHARED_BLAS = shared
        try:
            with (threadpoolctl.threadpool_limits(1, user_api="blas") if hold
                  else contextlib.nullcontext()):
                return fn()
        finally:
            numpy_chunked.NUM_THREADS, numpy_chunked.SHARED_BLAS = saved

    return run


def contenders(b: int, h: int, t: int, e: int, causal: bool, dtype: str,
               rng: np.random.Generator, numba: bool) -> dict[str, Any]:
    """The functions timed for one case."""
    import torch

    q, k, v = (rng.standard_normal((b, h, t, e)).astype(dtype) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))

    def numpy_path() -> Any:
        return polyattn.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                     implementation="chunked")

    def theirs() -> Any:
        with torch.no_grad():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv,
                                                                    is_causal=causal)

    fns = {f"numpy path: {name}": strategy(name, numpy_path) for name in STRATEGIES}
    fns["torch"] = theirs
    fns["naive"] = lambda: naive_numpy(q, k, v, causal)
    if numba:
        fns["numba_cpu"] = lambda: polyattn.scaled_dot_product_attention(
            q, k, v, is_causal=causal, implementation="numba_cpu")
    want = theirs().numpy()
    for name, fn in fns.items():       # every contender computes the same thing
        got = np.asarray(fn())
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        assert err < (1e-4 if dtype == "float32" else 1e-10), (name, err)
    return fns


def run(reps: int, busy: int, numba: bool) -> list[dict[str, Any]]:
    """Every case, idle then busy; one row per (condition, case)."""
    rng = np.random.default_rng(0)
    rows = []
    for condition in ("idle", "busy"):
        with hogs(busy) if condition == "busy" else contextlib.nullcontext():
            for b, h, t, e, causal, dtype in CASES:
                fns = contenders(b, h, t, e, causal, dtype, rng, numba)
                load = os.getloadavg()[0]
                times = time_interleaved(fns, reps, cold=("naive",))
                med = {name: statistics.median(ts) for name, ts in times.items()}
                row = {"condition": condition, "case": [b, h, t, e], "causal": causal,
                       "dtype": dtype, "load_average_1min": load, "times_s": times,
                       "median_s": med,
                       "ratio_to_torch": {n: med[n] / med["torch"] for n in med},
                       "ratio_to_naive": {n: med[n] / med["naive"] for n in med}}
                rows.append(row)
                print(f"{condition} {(b, h, t, e)} causal={causal} {dtype}: " + ", ".join(
                    f"{n} {r:.2f}" for n, r in row["ratio_to_torch"].items()), flush=True)
    return rows


def cpu_slug(cpu: str, count: int | None) -> str:
    """A file-name part for the CPU: "amd-epyc-2cpu"."""
    words = re.sub(r"\(.*?\)|@.*|\b(cpu|processor|\d+-core)\b", " ", cpu.lower())
    slug = "-".join(re.findall(r"[a-z0-9]+", words)[:4]) or "cpu"
    return f"{slug}-{count}cpu" if count else slug


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    """The tables: each contender's time over torch's (and over naive NumPy's)."""
    names = list(rows[0]["median_s"])
    ident = ", ".join(f"{k} {v}" for k, v in env["cpu_identity"].items()) or "no /proc/cpuinfo"
    start, end = (f"{env[k][0]:.1f}" for k in ("load_average_start", "load_average_end"))
    blas = ", ".join(f"{b['library']} {b['kernel']} kernel, {b['threads']} threads "
                     f"({b['threading_layer']})" for b in env["numpy_blas"])
    lines = [
        f"# NumPy path under contention ({env['date']}, {env['cpu']}, "
        f"{env['cpu_count']} CPUs)", "",
        f"Run with `{command}`.", "",
        f"- CPU: {env['cpu']} ({ident}), {env['cpu_count']} CPUs, SIMD {env['simd']} "
        f"(torch: {env['torch_cpu_capability']}); load average {start} at the start, "
        f"{end} at the end",
        f"- NumPy BLAS: {blas}",
        f"- torch {env['versions']['torch']} on {env['torch_threads']} threads; NumPy "
        f"{env['versions']['numpy']}; the NumPy path's pool: {env['polyattn_numpy_threads']} "
        f"threads, default mode {env['polyattn_numpy_threading']!r} "
        f"(SHARED_BLAS={env['shared_blas']!r})",
        f"- numba_cpu: {env['numba_cpu_tiles']}; Numba threading layer: "
        f"{env.get('numba_threading_layer', 'not recorded')}",
        f"- busy: {env['busy_processes']} busy-loop processes; idle: nothing started by the "
        "script (other work on the machine continues: the load average is recorded)",
        f"- {env['timing']}; {env['reps']} rounds", "",
        "Each cell: the contender's median time over torch SDPA's median in the same "
        "condition (lower is faster); in brackets, over naive NumPy's.", "",
        "| condition | case (B, H, T, E) | causal | dtype | load | torch ms | "
        + " | ".join(names) + " |",
        "|---|---|---|---|---:|---:|" + "---:|" * len(names),
    ]
    for row in rows:
        b, h, t, e = row["case"]
        cells = [f"{row['ratio_to_torch'][n]:.2f} ({row['ratio_to_naive'][n]:.2f})"
                 for n in names]
        lines.append(f"| {row['condition']} | ({b}, {h}, {t}, {e}) | "
                     f"{'yes' if row['causal'] else 'no'} | {row['dtype']} | "
                     f"{row['load_average_1min']:.1f} | {row['median_s']['torch'] * 1e3:.0f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "## Medians over the cases (time over torch's)", "",
              "| contender | idle | busy |", "|---|---:|---:|"]
    for n in names:
        med = {c: statistics.median(r["ratio_to_torch"][n] for r in rows
                                    if r["condition"] == c) for c in ("idle", "busy")}
        lines.append(f"| {n} | {med['idle']:.2f} | {med['busy']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--busy", type=int, default=os.cpu_count() or 1,
                        help="busy-loop processes in the busy condition (default: one per CPU)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--date", default=_dt.date.today().isoformat(),
                        help="the date in the file names")
    args = parser.parse_args(argv)

    env = environment()
    env.update(date=args.date, busy_processes=args.busy, reps=args.reps,
               shared_blas=numpy_chunked.SHARED_BLAS, cpu_identity=cpu_identity())
    numba = env["numba_cpu_tiles"] != "numba_cpu not usable"
    print(json.dumps({k: env[k] for k in ("cpu", "cpu_count", "simd", "numpy_blas",
                                          "torch_threads", "polyattn_numpy_threading",
                                          "load_average_start")}, indent=1), flush=True)
    started = time.perf_counter()
    rows = run(args.reps, args.busy, numba)
    env["numba_threading_layer"] = "not run"
    if numba:
        from polyattn.backends.numba_cpu import launch as numba_cpu

        env["numba_threading_layer"] = numba_cpu.threading_layer() or "not run"
    env["load_average_end"] = list(os.getloadavg())
    env["elapsed_s"] = time.perf_counter() - started
    command = "python benchmarks/contention.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if all(os.environ.get(n) is None for n in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + command
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"contention-{args.date}-{cpu_slug(env['cpu'], env['cpu_count'])}"
    stem.with_suffix(".json").write_text(json.dumps(
        {"environment": env, "command": command.strip(), "strategies": {
            n: {"NUM_THREADS": t, "SHARED_BLAS": s, "threadpool_limits_1": hold}
            for n, (t, s, hold) in STRATEGIES.items()}, "results": rows}, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(env, rows, command.strip()))
    print(f"wrote {stem}.json and .md in {env['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
