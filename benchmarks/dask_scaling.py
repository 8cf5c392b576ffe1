"""Dask benchmark: the distributed plan's scaling over worker processes, and its cost per task.

Run with ``nox -s bench_dask`` or ``python benchmarks/dask_scaling.py`` (``--help``).
It measures, in one run on this machine:

scaling
    ``scaled_dot_product_attention(q, k, v, is_causal=causal)`` on Dask arrays of
    shape (1, H, 65536, 64) float32, chunked by 4096 along T (the
    ``implementation="distributed"`` plan, chosen by ``"auto"``), causal and not,
    on a ``distributed.LocalCluster`` of 1 and then 2 worker processes with one
    thread each. The inputs are generated on the workers
    (``da.random.default_rng(seed).standard_normal``) and persisted before the
    clock starts, so the time is that of ``client.compute(out).result()``:
    the attention tasks and gathering the output. Best of ``--reps`` rounds.
    The plan's tile and merge tasks come from ``polyattn.explain(...).plan``;
    the scheduler's task stream gives each round's compute and transfer time
    per worker; each worker's peak resident memory (``ru_maxrss``) is read after
    the cluster's last round, next to its memory limit.
overhead
    a plan of many tiny tiles, (1, 1, 4096, 64) float32 chunked by 64 (64 × 64
    tiles, non-causal), on the 2-worker cluster and on Dask's local threaded
    scheduler (2 threads, one BLAS thread): (wall time − the same attention as
    one NumPy call on one thread) / tasks, in ms per task; for the cluster also
    the scheduler's own figures from the task stream (mean compute time per task,
    and the workers' idle time per task).
NumPy baseline
    polyattn on NumPy arrays (``implementation="auto"``: the NumPy fast path, its
    thread pool under a one-thread BLAS limit, 2 threads) at the scaling shape,
    same inputs; the Dask output is checked against it.

The machine's own ceiling is measured too: the same tile work, one thread per
process, in one process and then in two processes at once, without Dask (on a
shared or hyperthreaded machine two processes do not run at twice the rate).

From the measured per-core rate and per-task overhead it also evaluates the cost
model of ``docs/distributed.rst`` (chunk size recommended at N machines).
``--graph PNG`` draws the task graph of a small causal plan instead (no timing).

Results go to ``benchmarks/results/dask-cpu-<date>.{json,md,png}``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from cpu import RESULTS, flops
from window import blas_mode, simd_level

import polyattn

#: (B, H, T, E) and chunk length along T of the scaling cases (H from ``--heads``).
SCALING = {"b": 1, "t": 65536, "e": 64, "chunk": 4096}
QUICK_SCALING = {"b": 1, "t": 4096, "e": 64, "chunk": 1024}
#: The many-tiny-tiles plan of the overhead measurement (non-causal).
OVERHEAD = {"b": 1, "h": 1, "t": 4096, "e": 64, "chunk": 64}
QUICK_OVERHEAD = {"b": 1, "h": 1, "t": 512, "e": 64, "chunk": 64}
#: Worker processes of the clusters, one thread each.
WORKERS = (1, 2)
#: The small causal plan drawn by ``--graph``: (B, H, T, E), chunk.
GRAPH_CASE = ((1, 1, 32, 8), 8)

# The cost model's assumptions (docs/distributed.rst, "A cost model").
#: Link bandwidth per worker, bytes/s (10 Gbit/s).
MODEL_BANDWIDTH = 10e9 / 8
#: The layer modelled: heads, key/value heads, features, bytes per element; causal.
MODEL_LAYER = {"h": 8, "hkv": 8, "e": 64, "itemsize": 4}
#: Worker memory assumed for the upper bound on the chunk size, bytes.
MODEL_WORKER_MEMORY = 4 * 2**30
MODEL_TS = (65536, 262144, 1048576)
MODEL_NS = (2, 8, 32)
#: Compute per task must be this many times the per-task overhead (times N: the
#: scheduler is one process) and the per-task transfer time.
MODEL_MARGIN = 10
#: At least this many tile tasks per worker (load balance: the last round of tiles, and the
#: half-cost diagonal tiles of a causal plan, leave workers idle).
MODEL_MIN_TASKS_PER_WORKER = 8


# --- environment ------------------------------------------------------------------------

def _blas(pools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"library": f"{p.get('internal_api')} {p.get('version')}",
             "kernel": p.get("architecture"), "threads": p.get("num_threads"),
             "threading_layer": p.get("threading_layer")}
            for p in pools if p.get("user_api") == "blas"]


def environment() -> dict[str, Any]:
    """CPU, SIMD level, BLAS (threadpoolctl), library versions and machine load.

    (``cpu.environment()`` also records torch, which this benchmark does not use.)
    """
    import dask
    import distributed
    import threadpoolctl

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import matplotlib
        mpl = matplotlib.__version__
    except ImportError:  # pragma: no cover - the plot is then skipped
        mpl = None
    return {
        "date": _dt.date.today().isoformat(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "simd": simd_level(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "load_average_start": list(os.getloadavg()),
        "versions": {"polyattn": polyattn.__version__, "numpy": np.__version__,
                     "dask": dask.__version__, "distributed": distributed.__version__,
                     "threadpoolctl": threadpoolctl.__version__, "matplotlib": mpl},
        "numpy_blas": _blas(threadpoolctl.threadpool_info()),
        "env": {name: os.environ.get(name) for name in
                ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS",
                 "OMP_NUM_THREADS", "POLYATTN_SCORE_BUDGET")},
    }


def _worker_blas() -> list[dict[str, Any]]:
    import threadpoolctl

    return _blas(threadpoolctl.threadpool_info())


def _worker_maxrss_mib() -> float:
    """This process's peak resident memory (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- inputs and plans ---------------------------------------------------------------------

def dask_inputs(b: int, h: int, t: int, e: int, chunk: int, seed: int = 0) -> tuple[Any, ...]:
    """q, k, v as lazy Dask arrays generated chunk by chunk where they are computed."""
    import dask.array as da

    return tuple(da.random.default_rng(seed + i).standard_normal(
        (b, h, t, e), chunks=(b, h, chunk, e), dtype=np.float32) for i in range(3))


def plan_counts(q: Any, k: Any, v: Any, causal: bool) -> dict[str, Any]:
    """The plan line of ``polyattn.explain`` and the task counts it states."""
    ex = polyattn.explain(q, k, v, is_causal=causal)
    plan = ex.plan
    tiles = int(re.search(r"(\d+) tile tasks", plan).group(1))
    merges = int(re.search(r"(\d+) merge tasks", plan).group(1))
    return {"implementation": ex.implementation, "plan": plan, "tile_tasks": tiles,
            "merge_tasks": merges}


def graph_tasks(out: Any) -> int:
    """Tasks of the attention layer of ``out``'s graph: tiles, merges and output chunks."""
    return len(out.__dask_graph__().layers[out.name])


def task_stream_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Tasks run, compute and transfer seconds in total and per worker, from a task stream."""
    compute: dict[str, float] = {}
    transfer = 0.0
    for rec in records:
        for ss in rec.get("startstops", ()):
            dt = ss["stop"] - ss["start"]
            if ss["action"] == "compute":
                compute[rec["worker"]] = compute.get(rec["worker"], 0.0) + dt
            elif ss["action"] == "transfer":
                transfer += dt
    return {"tasks": len(records), "compute_s": sum(compute.values()),
            "compute_s_per_worker": compute, "transfer_s": transfer}


def rel_diff(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want)
                 / np.linalg.norm(want.astype(np.float64)))


# --- the measurements -------------------------------------------------------------------

def numpy_baseline(shape: dict[str, int], h: int, reps: int) -> tuple[list[dict[str, Any]],
                                                                      dict[bool, np.ndarray]]:
    """polyattn on NumPy arrays at the scaling shape (its thread pool, one BLAS thread)."""
    import dask

    from polyattn.backends.numpy import forward as numpy_chunked

    q, k, v = dask.compute(*dask_inputs(shape["b"], h, shape["t"], shape["e"],
                                        shape["chunk"]), scheduler="threads")
    rows, outs = [], {}
    for causal in (False, True):
        times = []
        with blas_mode("pool"):
            mode = numpy_chunked.threading_mode()
            threads = numpy_chunked.num_threads()
            impl = polyattn.explain(q, k, v, is_causal=causal).implementation
            for _ in range(reps):
                gc.collect()
                t0 = time.perf_counter()
                out = polyattn.scaled_dot_product_attention(q, k, v, is_causal=causal)
                times.append(time.perf_counter() - t0)
        outs[causal] = out
        fl = flops(shape["b"], h, shape["t"], shape["e"], causal)
        rows.append({"causal": causal, "implementation": impl, "threading": mode,
                     "threads": threads, "times_s": times, "best_s": min(times),
                     "gflops": fl / min(times) / 1e9})
        print(f"NumPy causal={causal}: {min(times):.2f} s ({impl}, {threads} threads, {mode}), "
              f"{fl / min(times) / 1e9:.0f} GFLOP/s", flush=True)
    return rows, outs


def scaling_on_cluster(client: Any, shape: dict[str, int], h: int, reps: int,
                       reference: dict[bool, np.ndarray]) -> list[dict[str, Any]]:
    """Time the scaling cases on ``client``'s cluster."""
    from distributed import get_task_stream, wait

    rows = []
    n = len(client.scheduler_info()["workers"])
    for causal in (False, True):
        q, k, v = client.persist(list(dask_inputs(shape["b"], h, shape["t"], shape["e"],
                                                  shape["chunk"])))
        wait([q, k, v])
        counts = plan_counts(q, k, v, causal)
        out = polyattn.scaled_dot_product_attention(q, k, v, is_causal=causal)
        times, streams = [], []
        for _ in range(reps):
            with get_task_stream(client) as ts:
                t0 = time.perf_counter()
                got = client.compute(out).result()
                times.append(time.perf_counter() - t0)
            streams.append(task_stream_summary(ts.data))
        best = int(np.argmin(times))
        fl = flops(shape["b"], h, shape["t"], shape["e"], causal)
        row = {"workers": n, "causal": causal, **counts, "graph_tasks": graph_tasks(out),
               "times_s": times, "best_s": times[best], "gflops": fl / times[best] / 1e9,
               "task_stream": streams[best],
               "busy": streams[best]["compute_s"] / (n * times[best]),
               "rel_diff_vs_numpy": rel_diff(got, reference[causal])}
        rows.append(row)
        print(f"{n} worker(s) causal={causal}: {row['best_s']:.2f} s, "
              f"{row['gflops']:.0f} GFLOP/s, {counts['tile_tasks']} tiles + "
              f"{counts['merge_tasks']} merges, workers busy {100 * row['busy']:.0f}%, "
              f"diff vs NumPy {row['rel_diff_vs_numpy']:.1e}", flush=True)
        del q, k, v, out, got
    return rows


def overhead_on_cluster(client: Any, shape: dict[str, int], reps: int,
                        reference_s: float) -> dict[str, Any]:
    """Per-task cost of the tiny-tile plan on ``client``'s cluster."""
    from distributed import get_task_stream, wait

    n = len(client.scheduler_info()["workers"])
    q, k, v = client.persist(list(dask_inputs(shape["b"], shape["h"], shape["t"], shape["e"],
                                              shape["chunk"])))
    wait([q, k, v])
    counts = plan_counts(q, k, v, False)
    out = polyattn.scaled_dot_product_attention(q, k, v)
    tasks = graph_tasks(out)
    times, streams = [], []
    for _ in range(reps):
        with get_task_stream(client) as ts:
            t0 = time.perf_counter()
            client.compute(out).result()
            times.append(time.perf_counter() - t0)
        streams.append(task_stream_summary(ts.data))
    best = int(np.argmin(times))
    s = streams[best]
    return {"scheduler": f"distributed, {n} workers", **counts, "graph_tasks": tasks,
            "times_s": times, "best_s": times[best], "numpy_one_task_s": reference_s,
            "ms_per_task": (times[best] - reference_s) / tasks * 1e3,
            "task_stream": s,
            "mean_task_compute_ms": s["compute_s"] / max(s["tasks"], 1) * 1e3,
            "idle_ms_per_task": (n * times[best] - s["compute_s"]) / tasks * 1e3}


def overhead_threaded(shape: dict[str, int], reps: int, reference_s: float) -> dict[str, Any]:
    """Per-task cost of the tiny-tile plan on Dask's local threaded scheduler."""
    import dask

    q, k, v = dask.persist(*dask_inputs(shape["b"], shape["h"], shape["t"], shape["e"],
                                        shape["chunk"]), scheduler="threads")
    counts = plan_counts(q, k, v, False)
    out = polyattn.scaled_dot_product_attention(q, k, v)
    tasks = graph_tasks(out)
    times = []
    with blas_mode("pool"):
        for _ in range(reps):
            gc.collect()
            t0 = time.perf_counter()
            dask.compute(out, scheduler="threads")
            times.append(time.perf_counter() - t0)
    best = min(times)
    return {"scheduler": f"threads ({os.cpu_count()} threads)", **counts, "graph_tasks": tasks,
            "times_s": times, "best_s": best, "numpy_one_task_s": reference_s,
            "ms_per_task": (best - reference_s) / tasks * 1e3}


def numpy_one_task(shape: dict[str, int], reps: int) -> float:
    """The overhead plan's attention as one NumPy call on one thread (best of ``reps``)."""
    import dask

    from polyattn.backends.numpy import forward as numpy_chunked
    from polyattn.rules.visibility import Rules

    q, k, v = dask.compute(*dask_inputs(shape["b"], shape["h"], shape["t"], shape["e"],
                                        shape["chunk"]), scheduler="threads")
    times = []
    with blas_mode("pool"):
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            numpy_chunked.attention(q, k, v, mask=None, rules=Rules(q.shape[-2], k.shape[-2]),
                                    scale=1 / math.sqrt(shape["e"]), xp=np, threads=1)
            times.append(time.perf_counter() - t0)
    return min(times[1:])


def _tiles_on_one_thread(shape: tuple[int, ...], count: int) -> float:
    """Seconds for ``count`` tile-sized NumPy-path calls on one thread (after one warm-up)."""
    from threadpoolctl import threadpool_limits

    from polyattn.backends.numpy import forward as numpy_chunked
    from polyattn.rules.visibility import Rules

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape, dtype=np.float32) for _ in range(3))
    scale = 1 / math.sqrt(shape[-1])
    rules = Rules(shape[-2], shape[-2])
    with threadpool_limits(1, "blas"):
        numpy_chunked.attention(q, k, v, mask=None, rules=rules, scale=scale, xp=np, threads=1)
        t0 = time.perf_counter()
        for _ in range(count):
            numpy_chunked.attention(q, k, v, mask=None, rules=rules, scale=scale, xp=np,
                                    threads=1)
        return time.perf_counter() - t0


def machine_ceiling(shape: tuple[int, ...], count: int, reps: int) -> dict[str, Any]:
    """The machine's own 2-process scaling: the same tile work in one process, then in two
    processes at once (no Dask). Throughput ratio = 2 × one / the slower of the two."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ones, twos = [], []
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_tiles_on_one_thread, [shape] * 2, [0] * 2))      # start both
        for _ in range(reps):
            ones.append(pool.submit(_tiles_on_one_thread, shape, count).result())
            pair = [pool.submit(_tiles_on_one_thread, shape, count) for _ in range(2)]
            twos.append(max(f.result() for f in pair))
    one, two = min(ones), min(twos)
    fl = count * 4.0 * math.prod(shape[:-1]) * shape[-2] * shape[-1]
    return {"tile_shape": list(shape), "tiles": count, "one_process_s": ones,
            "two_processes_s": twos, "gflops_one_process": fl / one / 1e9,
            "throughput_ratio": 2 * one / two}


def run_cluster(n_workers: int, scaling: dict[str, int], h: int, reps: int,
                reference: dict[bool, np.ndarray], overhead: dict[str, int] | None,
                numpy_one_s: float) -> dict[str, Any]:
    """Start a LocalCluster of ``n_workers`` processes, run the cases, read worker memory."""
    from distributed import Client, LocalCluster

    started = time.perf_counter()
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True,
                      host="127.0.0.1", dashboard_address=None) as cluster, \
            Client(cluster) as client:
        startup = time.perf_counter() - started
        info = client.scheduler_info()["workers"]
        limits = {addr: w["memory_limit"] for addr, w in info.items()}
        blas = client.run(_worker_blas)
        rows = scaling_on_cluster(client, scaling, h, reps, reference)
        ovh = (overhead_on_cluster(client, overhead, reps, numpy_one_s)
               if overhead is not None else None)
        rss = client.run(_worker_maxrss_mib)
    workers = [{"address": addr, "memory_limit_mib": limits[addr] / 2**20,
                "peak_rss_mib": rss[addr], "blas": blas[addr]} for addr in sorted(limits)]
    for w in workers:
        print(f"  worker {w['address']}: peak RSS {w['peak_rss_mib']:.0f} MiB of "
              f"{w['memory_limit_mib']:.0f} MiB limit", flush=True)
    return {"workers": n_workers, "startup_s": startup, "scaling": rows, "overhead": ovh,
            "worker_processes": workers}


# --- the cost model -----------------------------------------------------------------------

def _merges(parts: int, split: int) -> int:
    count = 0
    while parts > 1:
        parts = -(-parts // split)
        count += parts
    return count


def model_row(t: int, n: int, chunk: int, rate: float, overhead_s: float,
              bandwidth: float = MODEL_BANDWIDTH) -> dict[str, Any]:
    """The cost model at one (T, N, chunk) for ``MODEL_LAYER``, causal, B = 1."""
    from polyattn.backends.dask.plan import SPLIT_EVERY

    h, hkv, e, s = (MODEL_LAYER[x] for x in ("h", "hkv", "e", "itemsize"))
    nq = -(-t // chunk)
    tiles = nq * (nq + 1) // 2
    merges = sum(_merges(i + 1, SPLIT_EVERY) for i in range(nq))
    task_flops = 4.0 * chunk * chunk * h * e          # a full tile; diagonal tiles are half
    compute_task = task_flops / rate
    # bytes a tile may fetch: its Q block, K and V blocks, and its (out, lse) sent to a merge
    task_bytes = chunk * h * e * s + 2 * chunk * hkv * e * s + chunk * h * e * s + chunk * h * 8
    total_compute = flops(1, h, t, e, True) / rate
    compute = total_compute / n
    transfer = tiles * task_bytes / (n * bandwidth)
    sched = (tiles + merges + nq) * overhead_s
    ring_bytes = 2 * (t / n) * hkv * e * s * (n - 1)
    return {
        "T": t, "N": n, "chunk": chunk, "query_chunks": nq, "tile_tasks": tiles,
        "merge_tasks": merges, "tiles_per_worker": tiles / n,
        "compute_per_task_ms": compute_task * 1e3,
        "transfer_per_task_ms": task_bytes / bandwidth * 1e3,
        "bytes_per_task_mib": task_bytes / 2**20,
        "working_set_mib": (task_bytes + chunk * h * e * s) / 2**20,
        "compute_s": compute, "transfer_s": transfer, "scheduler_s": sched,
        "time_s": max(compute, transfer, sched),
        "bound": max((("compute", compute), ("transfer", transfer), ("scheduler", sched)),
                     key=lambda x: x[1])[0],
        "plan_bytes_per_worker_mib": tiles * task_bytes / n / 2**20,
        "ring_bytes_per_device_mib": ring_bytes / 2**20,
        "ring_time_s": max(compute, ring_bytes / bandwidth),
    }


def recommend_chunk(t: int, n: int, rate: float, overhead_s: float,
                    bandwidth: float = MODEL_BANDWIDTH) -> dict[str, Any]:
    """The model's chunk for T and N workers: the largest power of two that leaves at least
    MODEL_MIN_TASKS_PER_WORKER tiles per worker and a tile working set of at most 1/8 of
    MODEL_WORKER_MEMORY, checked against the lower bound (tile compute ≥ MODEL_MARGIN ×
    N × the per-task overhead, the scheduler being one process, and ≥ MODEL_MARGIN × the
    tile's transfer time)."""
    h, hkv, e, s = (MODEL_LAYER[x] for x in ("h", "hkv", "e", "itemsize"))
    row_bytes = 2 * h * e * s + 2 * hkv * e * s + 8 * h      # q, out, k, v and lse, per row
    c_transfer = MODEL_MARGIN * row_bytes * rate / (4 * h * e * bandwidth)
    c_overhead = math.sqrt(MODEL_MARGIN * n * overhead_s * rate / (4 * h * e))
    lower = 2 ** math.ceil(math.log2(max(c_transfer, c_overhead, 1)))
    k = MODEL_MIN_TASKS_PER_WORKER * n                       # tiles wanted: nq (nq + 1) / 2 >= k
    nq = math.ceil((math.sqrt(1 + 8 * k) - 1) / 2)
    upper_memory = MODEL_WORKER_MEMORY / 8 / row_bytes
    upper = min(t / nq, upper_memory, t)
    chunk = 2 ** math.floor(math.log2(upper))
    note = ""
    if chunk < lower:
        note = (f"below the lower bound {lower}: overhead or transfers bound; fewer workers "
                "or more heads per task")
    row = model_row(t, n, chunk, rate, overhead_s, bandwidth)
    row.update({"lower_bound": lower, "lower_bound_transfer": c_transfer,
                "lower_bound_overhead": c_overhead, "upper_bound_tasks": t / nq,
                "upper_bound_memory": upper_memory, "note": note})
    return row


def cost_model(rate: float, overhead_s: float) -> dict[str, Any]:
    return {"assumptions": {"rate_gflops_per_core": rate / 1e9,
                            "overhead_ms_per_task": overhead_s * 1e3,
                            "bandwidth_gbit_s": MODEL_BANDWIDTH * 8 / 1e9,
                            "layer": MODEL_LAYER, "causal": True, "margin": MODEL_MARGIN,
                            "min_tiles_per_worker": MODEL_MIN_TASKS_PER_WORKER,
                            "worker_memory_gib": MODEL_WORKER_MEMORY / 2**30},
            "rows": [recommend_chunk(t, n, rate, overhead_s)
                     for t in MODEL_TS for n in MODEL_NS]}


# --- reporting ----------------------------------------------------------------------------

def _yn(causal: bool) -> str:
    return "yes" if causal else "no"


def speedups(clusters: list[dict[str, Any]]) -> dict[bool, float]:
    by = {(c["workers"], r["causal"]): r["best_s"] for c in clusters for r in c["scaling"]}
    return {causal: by[(1, causal)] / by[(2, causal)] for causal in (False, True)
            if (1, causal) in by and (2, causal) in by}


def markdown(report: dict[str, Any]) -> str:
    env, shape = report["environment"], report["scaling_shape"]
    blas = "; ".join(f"{x['library']}, kernel {x['kernel']}, {x['threads']} threads"
                     for x in env["numpy_blas"])
    worker_blas = report["clusters"][0]["worker_processes"][0]["blas"]
    wblas = "; ".join(f"{x['library']}, kernel {x['kernel']}, {x['threads']} threads"
                      for x in worker_blas)
    v = env["versions"]
    b, h, t, e = shape["b"], shape["h"], shape["t"], shape["e"]
    lines = [
        f"# Dask distributed plan (CPU), {env['date']}",
        "",
        f"- Command: `{report['command']}`",
        f"- CPU: {env['cpu']} ({env['cpu_count']} logical CPUs, {env['memory_gib']:.0f} GiB), "
        f"SIMD: {env['simd']}; load average at start {env['load_average_start'][0]:.2f}, "
        f"at end {env['load_average_end'][0]:.2f}",
        f"- NumPy {v['numpy']} BLAS in this process: {blas}; in the workers: {wblas}",
        f"- polyattn {v['polyattn']}, Dask {v['dask']}, distributed {v['distributed']}, "
        f"threadpoolctl {v['threadpoolctl']}; Python {env['python']}",
        "- Environment variables: "
        + (", ".join(f"{k}={x}" for k, x in env["env"].items() if x) or "none of "
           + ", ".join(env["env"]) + " set"),
        f"- Run time {env['elapsed_s']:.0f} s",
        "",
        "## Strong scaling",
        "",
        f"(B, H, T, E) = ({b}, {h}, {t}, {e}) float32 (H = {h}), chunks of {shape['chunk']} "
        "along T for queries and keys; `LocalCluster(n_workers=N, threads_per_worker=1, "
        "processes=True)`, inputs generated on the workers and persisted before timing; "
        f"time = `client.compute(out).result()`, best of {report['reps']}; busy = the "
        "workers' compute time (task stream) / (N × time); NumPy = polyattn on NumPy arrays "
        "in this process (the NumPy fast path, "
        f"{report['numpy'][0]['threads']} threads), same inputs; peak RSS = the largest "
        "`ru_maxrss` of the cluster's worker processes after its last round.",
        "",
        "| case | causal | workers | time s | GFLOP/s | speed-up | vs NumPy | tile tasks "
        "| merge tasks | busy | peak RSS MiB | memory limit MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    numpy_by = {r["causal"]: r for r in report["numpy"]}
    sp = speedups(report["clusters"])
    case = f"({b}, {h}, {t}, {e})"
    for causal in (False, True):
        r0 = numpy_by[causal]
        lines.append(f"| {case} | {_yn(causal)} | NumPy | {r0['best_s']:.2f} "
                     f"| {r0['gflops']:.0f} | — | 1.00 | — | — | — | — | — |")
        for c in report["clusters"]:
            for r in c["scaling"]:
                if r["causal"] != causal:
                    continue
                rss = max(w["peak_rss_mib"] for w in c["worker_processes"])
                lim = min(w["memory_limit_mib"] for w in c["worker_processes"])
                speed = f"**{sp[causal]:.2f}**" if c["workers"] == 2 and causal in sp else "1.00" \
                    if c["workers"] == 1 else "—"
                lines.append(
                    f"| {case} | {_yn(causal)} | {c['workers']} | {r['best_s']:.2f} "
                    f"| {r['gflops']:.0f} | {speed} | {r['best_s'] / r0['best_s']:.2f} "
                    f"| {r['tile_tasks']} | {r['merge_tasks']} | {100 * r['busy']:.0f}% "
                    f"| {rss:.0f} | {lim:.0f} |")
    mc = report["machine_ceiling"]
    lines += ["", f"The machine's own ceiling, without Dask: {mc['tiles']} NumPy-path calls on "
              f"one tile, {tuple(mc['tile_shape'])}, one thread each, ran in two processes at "
              f"once at **{mc['throughput_ratio']:.2f}×** the rate of one process alone "
              f"({mc['gflops_one_process']:.0f} GFLOP/s alone; best of {report['reps']})."]
    lines += ["", "Plans (`polyattn.explain(q, k, v, is_causal=...).plan`):", ""]
    for r in report["clusters"][0]["scaling"]:
        lines.append(f"- causal={r['causal']}: {r['plan']}")
    lines += ["", "## Per-task overhead", ""]
    o = report["overhead"]
    if o:
        ob, oh, ot, oe, oc = (report["overhead_shape"][x] for x in ("b", "h", "t", "e", "chunk"))
        lines += [
            f"({ob}, {oh}, {ot}, {oe}) float32, non-causal, chunks of {oc}: "
            f"{o[0]['tile_tasks']} tile tasks, {o[0]['merge_tasks']} merge tasks, "
            f"{o[0]['graph_tasks']} tasks with the output chunks. ms per task = (time − the "
            "same attention as one NumPy call on one thread) / tasks; the task stream gives "
            "the mean compute time of a task (inside the worker) and the workers' idle time "
            "per task, (N × time − compute) / tasks.",
            "",
            "| scheduler | time s | one NumPy call s | ms per task | task compute ms "
            "| idle ms per task |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for r in o:
            comp = f"{r['mean_task_compute_ms']:.2f}" if "mean_task_compute_ms" in r else "—"
            idle = f"{r['idle_ms_per_task']:.2f}" if "idle_ms_per_task" in r else "—"
            lines.append(f"| {r['scheduler']} | {r['best_s']:.2f} | {r['numpy_one_task_s']:.3f} "
                         f"| **{r['ms_per_task']:.2f}** | {comp} | {idle} |")
    m = report["cost_model"]
    a = m["assumptions"]
    lines += [
        "", "## Cost model", "",
        f"Causal, B = 1, H = Hkv = {a['layer']['h']}, E = {a['layer']['e']}, float32; "
        f"{a['rate_gflops_per_core']:.0f} GFLOP/s per worker (the 1-worker rate above), "
        f"{a['overhead_ms_per_task']:.2f} ms per task (the cluster's figure above), "
        f"{a['bandwidth_gbit_s']:.0f} Gbit/s per worker. Chunk = the largest power of two "
        f"leaving ≥ {a['min_tiles_per_worker']} tiles per worker (and a tile working set ≤ "
        f"1/8 of {a['worker_memory_gib']:.0f} GiB); smallest = the smallest power of two "
        f"with tile compute ≥ {a['margin']}× (N × overhead) and ≥ {a['margin']}× the tile's "
        "transfer time; time = max(compute / N, transfers / (N × bandwidth), tasks × "
        "overhead), every tile fetching its blocks (no reuse on a worker); ring = ring "
        "attention's K/V traffic per device, 2·(T/N)·Hkv·E·4·(N−1) bytes.",
        "",
        "| T | N | chunk | smallest | tiles | tiles per worker | compute per tile ms "
        "| transfer per tile ms | compute s | transfers s | scheduler s | bound "
        "| plan MiB per worker | ring MiB per device | note |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in m["rows"]:
        lines.append(
            f"| {r['T']} | {r['N']} | {r['chunk']} | {r['lower_bound']} | {r['tile_tasks']} "
            f"| {r['tiles_per_worker']:.0f} | {r['compute_per_task_ms']:.0f} "
            f"| {r['transfer_per_task_ms']:.1f} | {r['compute_s']:.1f} | {r['transfer_s']:.1f} "
            f"| {r['scheduler_s']:.2f} | {r['bound']} | {r['plan_bytes_per_worker_mib']:.0f} "
            f"| {r['ring_bytes_per_device_mib']:.0f} | {r['note']} |")
    lines += ["", "## Checks", ""]
    for c in report["clusters"]:
        for r in c["scaling"]:
            lines.append(f"- {c['workers']} worker(s), causal={r['causal']}: output vs the "
                         f"NumPy path {r['rel_diff_vs_numpy']:.1e} (relative); rounds "
                         + ", ".join(f"{x:.2f}" for x in r["times_s"]) + " s")
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> None:
    """Time per case at NumPy, 1 and 2 workers; speed-up over 1 worker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(10, 4), width_ratios=(3, 2))
    numpy_by = {r["causal"]: r["best_s"] for r in report["numpy"]}
    labels = ["non-causal", "causal"]
    x = np.arange(2)
    series = [("NumPy path, 1 process, 2 threads", [numpy_by[c] for c in (False, True)],
               "tab:gray")]
    for c, color in zip(report["clusters"], ("tab:blue", "tab:orange"), strict=False):
        by = {r["causal"]: r["best_s"] for r in c["scaling"]}
        series.append((f"Dask, {c['workers']} worker{'s' if c['workers'] > 1 else ''}",
                       [by[k] for k in (False, True)], color))
    width = 0.8 / len(series)
    for i, (name, ys, color) in enumerate(series):
        bars = ax_t.bar(x + (i - (len(series) - 1) / 2) * width, ys, width, label=name,
                        color=color)
        ax_t.bar_label(bars, fmt="%.1f", fontsize=8)
    ax_t.set_xticks(x, labels)
    ax_t.set_ylabel("time, s (best of rounds)")
    shape = report["scaling_shape"]
    ax_t.set_title(f"(1, {shape['h']}, {shape['t']}, {shape['e']}) float32, "
                   f"chunks of {shape['chunk']}")
    ax_t.legend(fontsize=8)
    sp = speedups(report["clusters"])
    bars = ax_s.bar(x, [sp.get(False, 0), sp.get(True, 0)], 0.5, color="tab:orange")
    ax_s.bar_label(bars, fmt="%.2f", fontsize=9)
    ax_s.axhline(2.0, color="black", linewidth=0.8, linestyle="--", label="ideal (2)")
    ax_s.axhline(report["machine_ceiling"]["throughput_ratio"], color="tab:gray",
                 linewidth=1.0, linestyle=":", label="2 NumPy processes, no Dask")
    ax_s.set_xticks(x, labels)
    ax_s.set_ylim(0, 2.3)
    ax_s.set_ylabel("speed-up, 2 workers over 1")
    ax_s.set_title("strong scaling")
    ax_s.legend(fontsize=8, loc="lower right")
    for ax in (ax_t, ax_s):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"polyattn on Dask, LocalCluster on {report['environment']['cpu_count']} cores")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- the task graph picture ---------------------------------------------------------------

def draw_graph(path: Path) -> str:
    """Draw the task graph of a small causal plan (inputs → tiles → merges → outputs)."""
    import dask.array as da
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from dask.core import get_dependencies
    from matplotlib.patches import FancyBboxPatch

    (b, h, t, e), chunk = GRAPH_CASE
    rng = np.random.default_rng(0)
    arrays = [da.from_array(rng.standard_normal((b, h, t, e)).astype(np.float32),
                            chunks=(b, h, chunk, e)) for _ in range(3)]
    q, k, v = arrays
    plan = polyattn.explain(q, k, v, is_causal=True).plan
    out = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True)
    graph = out.__dask_graph__()
    dsk = dict(graph)
    names = {x.name: label for x, label in zip(arrays, "qkv", strict=True)}

    def kind_label(key: Any) -> tuple[int, str, int]:
        """(column, label, query chunk) of a key."""
        name = key[0]
        if name in names:
            return 0, f"{names[name]}{key[-2]}", key[-2]
        if name == out.name:
            return 3, f"out q{key[-2]}", key[-2]
        if "merge" in key:
            i = key.index("merge")
            return 2, f"merge q{key[i - 1]}", key[i - 1]
        return 1, f"tile q{key[-2]}·k{key[-1]}", key[-2]

    nodes = {}
    for key in graph.layers[out.name]:
        nodes[key] = kind_label(key)
        for dep in get_dependencies(dsk, key):
            if dep[0] in names:
                nodes[dep] = kind_label(dep)
    edges = [(dep, key) for key in graph.layers[out.name] for dep in get_dependencies(dsk, key)]

    columns: dict[int, list[Any]] = {0: [], 1: [], 2: [], 3: []}
    for key, (col, _, _) in nodes.items():
        columns[col].append(key)
    order = {"q": 0, "k": 1, "v": 2}
    columns[0].sort(key=lambda key: (order[names[key[0]]], key[-2]))
    columns[1].sort(key=lambda key: (key[-2], key[-1]))
    ypos: dict[Any, float] = {}
    tiles = columns[1]
    for i, key in enumerate(tiles):
        ypos[key] = -i
    span = len(tiles) - 1
    for i, key in enumerate(columns[0]):
        ypos[key] = -i * span / max(len(columns[0]) - 1, 1)
    for col in (2, 3):     # merges and outputs: level with what they combine or take
        for key in columns[col]:
            deps = [d for d in get_dependencies(dsk, key) if d in ypos]
            ypos[key] = float(np.mean([ypos[d] for d in deps]))
    xpos = {0: 0.0, 1: 2.2, 2: 4.4, 3: 6.2}
    colors = {0: "#dbe9f6", 1: "#fde0c5", 2: "#d9f0d3", 3: "#e8e0f0"}
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(tiles) + 1.6))
    w, hgt = 1.25, 0.62
    edge_colors = {"q": "tab:blue", "k": "tab:red", "v": "tab:green"}
    for a, bkey in edges:
        (xa, ya), (xb, yb) = (xpos[nodes[a][0]], ypos[a]), (xpos[nodes[bkey][0]], ypos[bkey])
        color = edge_colors.get(names.get(a[0], ""), "0.4")
        ax.annotate("", xy=(xb - w / 2, yb), xytext=(xa + w / 2, ya),
                    arrowprops={"arrowstyle": "-|>", "color": color, "lw": 0.7, "alpha": 0.7,
                                "shrinkA": 0, "shrinkB": 0, "mutation_scale": 7})
    for key, (col, label, _) in nodes.items():
        x, y = xpos[col], ypos[key]
        ax.add_patch(FancyBboxPatch((x - w / 2, y - hgt / 2), w, hgt,
                                    boxstyle="round,pad=0.02,rounding_size=0.12",
                                    facecolor=colors[col], edgecolor="0.3", lw=0.8))
        ax.text(x, y, label, ha="center", va="center", fontsize=8.5)
    heads = ["input chunks", "tile tasks", "merge tasks", "output chunks"]
    for col, text in enumerate(heads):
        ax.text(xpos[col], 1.1, text, ha="center", va="bottom", fontsize=10,
                fontweight="bold")
    ax.set_xlim(-0.9, 7.0)
    ax.set_ylim(-span - 0.8, 1.8)
    ax.axis("off")
    ax.set_title(f"Causal attention on Dask, (B, H, T, E) = ({b}, {h}, {t}, {e}), chunks of "
                 f"{chunk}: {len(columns[1])} tiles, {len(columns[2])} merges",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return plan


# --- main -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="timed rounds per case (best of)")
    parser.add_argument("--heads", type=int, default=None,
                        help="H of the scaling cases (default 2; 1 with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: T = 4096 (chunks of 1024) and a 512-long "
                        "overhead plan")
    parser.add_argument("--no-overhead", action="store_true",
                        help="skip the per-task overhead measurement")
    parser.add_argument("--graph", type=Path, metavar="PNG",
                        help="only draw the task graph of a small causal plan to PNG")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)

    if args.graph is not None:
        plan = draw_graph(args.graph)
        print(f"wrote {args.graph}: {plan}")
        return 0

    scaling = dict(QUICK_SCALING if args.quick else SCALING)
    h = args.heads or (1 if args.quick else 2)
    scaling["h"] = h
    overhead = None if args.no_overhead else dict(QUICK_OVERHEAD if args.quick else OVERHEAD)
    env = environment()
    print(json.dumps({k: env[k] for k in ("cpu", "cpu_count", "simd", "numpy_blas", "env",
                                          "load_average_start")}, indent=1))
    print(f"scaling shape (B, H, T, E) = ({scaling['b']}, {h}, {scaling['t']}, {scaling['e']}), "
          f"H = {h}, chunks of {scaling['chunk']}", flush=True)
    started = time.perf_counter()
    numpy_rows, reference = numpy_baseline(scaling, h, args.reps)
    tile = (scaling["b"], h, scaling["chunk"], scaling["e"])
    ceiling = machine_ceiling(tile, 3 if args.quick else 20, args.reps)
    print(f"machine: {ceiling['tiles']} tiles {tuple(tile)} in two processes at once ran at "
          f"{ceiling['throughput_ratio']:.2f}x the rate of one process "
          f"({ceiling['gflops_one_process']:.0f} GFLOP/s alone)", flush=True)
    numpy_one_s = numpy_one_task(overhead, args.reps) if overhead else 0.0
    overhead_rows = []
    if overhead:
        overhead_rows.append(overhead_threaded(overhead, args.reps, numpy_one_s))
        r = overhead_rows[-1]
        print(f"overhead, threads: {r['best_s']:.2f} s for {r['graph_tasks']} tasks: "
              f"{r['ms_per_task']:.2f} ms per task", flush=True)
    clusters = []
    for n in WORKERS:
        clusters.append(run_cluster(n, scaling, h, args.reps, reference,
                                    overhead if n == max(WORKERS) else None, numpy_one_s))
        r = clusters[-1]["overhead"]
        if r:
            overhead_rows.append(r)
            print(f"overhead, {r['scheduler']}: {r['best_s']:.2f} s for {r['graph_tasks']} "
                  f"tasks: {r['ms_per_task']:.2f} ms per task (task compute "
                  f"{r['mean_task_compute_ms']:.2f} ms, idle {r['idle_ms_per_task']:.2f} ms "
                  "per task)", flush=True)
    env["load_average_end"] = list(os.getloadavg())
    env["elapsed_s"] = time.perf_counter() - started

    one = next(r for r in clusters[0]["scaling"] if not r["causal"])
    rate = one["gflops"] * 1e9
    cluster_overhead = [r for r in overhead_rows if "idle_ms_per_task" in r]
    overhead_s = (cluster_overhead[0]["ms_per_task"] / 1e3 if cluster_overhead else 1e-3)

    command = "python benchmarks/dask_scaling.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if all(os.environ.get(x) is None for x in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + command
    report = {"environment": env, "command": command.strip(), "reps": args.reps,
              "scaling_shape": scaling, "overhead_shape": overhead, "numpy": numpy_rows,
              "clusters": clusters, "overhead": overhead_rows, "machine_ceiling": ceiling,
              "speedup_2_over_1": {("causal" if c else "non-causal"): s
                                   for c, s in speedups(clusters).items()},
              "cost_model": cost_model(rate, max(overhead_s, 0.0))}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"dask-cpu-{env['date']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    plot(report, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json, .md and .png in {env['elapsed_s']:.0f} s")
    print("speed-up 2 workers over 1: " + ", ".join(
        f"{k} {x:.2f}" for k, x in report["speedup_2_over_1"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
