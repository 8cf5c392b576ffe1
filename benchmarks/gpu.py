"""GPU benchmark: the fused Numba CUDA kernel against CuPy and torch SDPA.

For each shape (B, H, T, E), dtype and causal setting, this script times, side
by side in one run,

* ``numba_cuda``: ``scaled_dot_product_attention(..., implementation="numba_cuda")``
  (float16/bfloat16: the tensor-core kernel; float32/float64: the register-tiled
  exact kernel), beside ``numba_cuda_rows`` (``POLYATTN_CUDA_KERNEL=rows``, the 0.1
  kernel: one thread per query row), ``numba_cuda_3xtf32``
  (``POLYATTN_CUDA_FLOAT32=3xtf32``) for float32 and ``numba_cuda_exact_f32`` (the
  exact kernel on float32 copies) for float16/bfloat16; the report names each
  method's arithmetic,
* ``reference``: the same call with ``implementation="reference"`` on CuPy
  arrays (materialises the T×T scores; left out where they would not fit),
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on the same
  memory (through DLPack), with TF32 off, where torch has CUDA,

and reports the median time of CUDA-event-timed calls after warm-up, TFLOP/s
(FLOPs = 4·B·H·Tq·Tk·E, half of that when causal), the fraction of the GPU's
float32 peak, speed ratios, peak extra device memory, and the relative error
``‖out − ref‖ / ‖ref‖`` against a float64 reference on a sample of query rows.

A second table times forward and backward together (``fwd+bwd``): the kernel's
``numba_cuda.attention`` then ``numba_cuda.backward`` against torch SDPA's
forward and ``torch.autograd.grad``, at FLOPs = 3.5 × the forward's (the
backward's five matrix products, as FlashAttention counts them), with the
largest relative error of (dq, dk, dv) against torch autograd in float64.

Usage::

    python benchmarks/gpu.py [--out PATH] [--repeats N] [--quick] [--no-backward]

Results go to ``--out`` (JSON; default ``benchmarks/results/gpu-<gpu>-<date>.json``)
and a Markdown table next to it. Without CuPy, a CUDA GPU or a usable kernel,
the script says why and exits with status 0.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

# (B, H, T, E) with Tq = Tk = T, Hkv = H, Ev = E.
SHAPES = [(4, 16, 4096, 64), (2, 16, 8192, 128), (16, 16, 1024, 64), (1, 16, 16384, 128)]
FLOAT64_SHAPE = (16, 16, 1024, 64)
LONG_SHAPE = (1, 16, 65536, 64)  # float32; its T×T scores (256 GiB) fit nowhere
# Forward + backward: (shape, dtype) pairs, each causal and not.
BACKWARD_CASES = [((4, 16, 4096, 64), "float32"), ((16, 16, 1024, 64), "float32"),
                  ((16, 16, 1024, 64), "float64")]
BACKWARD_FLOPS = 3.5  # forward + backward FLOPs over forward FLOPs (2 + 5 matrix products)
FLOAT32_PEAK_TFLOPS = {"H100": 67.0, "H200": 67.0}  # non-tensor-core FP32, SXM
REFERENCE_BUDGET = 0.6  # the reference runs only if its scores fit this share of free memory
SAMPLE_ROWS = 64  # query rows checked against the float64 reference


def skip(reason: str) -> None:
    print(f"skipping: {reason}")
    sys.exit(0)


def flops(b: int, h: int, tq: int, tk: int, e: int, causal: bool) -> float:
    """Forward FLOPs: two matrix products of 2·Tq·Tk·E each, half when causal."""
    total = 4.0 * b * h * tq * tk * e
    return total / 2 if causal else total


# --------------------------------------------------------------------------- #
# Environment
# --------------------------------------------------------------------------- #

def gpu_info(cupy: Any) -> dict[str, Any]:
    props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    info: dict[str, Any] = {
        "name": name,
        "compute_capability": f"{props['major']}.{props['minor']}",
        "multiprocessors": props["multiProcessorCount"],
        "memory_gib": round(props["totalGlobalMem"] / 2**30, 1),
        "cuda_runtime": cupy.cuda.runtime.runtimeGetVersion(),
        "cuda_driver": cupy.cuda.runtime.driverGetVersion(),
    }
    if "clockRate" in props:
        info["sm_clock_max_mhz_props"] = props["clockRate"] // 1000
    if shutil.which("nvidia-smi"):
        query = "clocks.sm,clocks.max.sm,clocks.mem,power.limit,driver_version"
        run = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader",
             f"--id={cupy.cuda.Device().id}"],
            capture_output=True, text=True, check=False,
        )
        if run.returncode == 0:
            info["nvidia_smi"] = dict(zip(query.split(","),
                                          (f.strip() for f in run.stdout.split(",")),
                                          strict=False))
    return info


def versions() -> dict[str, str]:
    found = {"python": platform.python_version(), "numpy": np.__version__}
    for module in ("cupy", "numba", "numba_cuda", "torch", "polyattn"):
        try:
            found[module] = str(__import__(module).__version__)
        except Exception:  # not installed, or no version attribute
            continue
    return found


def peak_tflops(name: str, override: float | None) -> float | None:
    if override:
        return override
    for key, value in FLOAT32_PEAK_TFLOPS.items():
        if key in name:
            return value
    return None


# --------------------------------------------------------------------------- #
# Measurement
# --------------------------------------------------------------------------- #

class Memory:
    """Peak extra device memory of one call: CuPy's pool high-water and torch's counter."""

    def __init__(self, cupy: Any, torch: Any) -> None:
        self.pool = cupy.get_default_memory_pool()
        self.torch = torch

    def measure(self, fn: Any) -> int:
        self.pool.free_all_blocks()
        base = self.pool.total_bytes()
        torch_base = 0
        if self.torch is not None:
            self.torch.cuda.synchronize()
            self.torch.cuda.empty_cache()
            self.torch.cuda.reset_peak_memory_stats()
            torch_base = self.torch.cuda.memory_allocated()
        result = fn()
        del result
        extra = self.pool.total_bytes() - base
        if self.torch is not None:
            self.torch.cuda.synchronize()
            extra += self.torch.cuda.max_memory_allocated() - torch_base
        return int(extra)


def median_ms(cupy: Any, fn: Any, repeats: int, warmup: int) -> tuple[float, list[float]]:
    """Median of ``repeats`` CUDA-event timings after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    cupy.cuda.get_current_stream().synchronize()
    times = []
    for _ in range(repeats):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times), times


def reference_rows(cupy: Any, q: Any, k: Any, v: Any, rows: Any, causal: bool) -> Any:
    """float64 attention output for the query rows ``rows`` (all batches and heads)."""
    q64 = q[:, :, rows, :].astype(cupy.float64)  # (B, H, R, E)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = []
    for b in range(q.shape[0]):
        k64 = k[b].astype(cupy.float64)  # (H, Tk, E)
        v64 = v[b].astype(cupy.float64)  # (H, Tk, Ev)
        s = scale * (q64[b] @ cupy.swapaxes(k64, -1, -2))  # (H, R, Tk)
        if causal:
            visible = cupy.arange(k.shape[2])[None, :] <= rows[:, None]  # (R, Tk)
            s = cupy.where(visible, s, -cupy.inf)
        s = s - s.max(axis=-1, keepdims=True)
        p = cupy.exp(s)
        out.append((p @ v64) / p.sum(axis=-1, keepdims=True))  # (H, R, Ev)
    return cupy.stack(out)  # (B, H, R, Ev)


def rel_error(cupy: Any, out: Any, ref: Any, rows: Any) -> float:
    got = cupy.asarray(out)[:, :, rows, :].astype(cupy.float64)
    return float(cupy.linalg.norm(got - ref) / cupy.linalg.norm(ref))


# --------------------------------------------------------------------------- #
# One configuration
# --------------------------------------------------------------------------- #

def bench_case(ctx: dict[str, Any], shape: tuple[int, int, int, int], dtype: str,
               causal: bool) -> dict[str, Any]:
    cupy, torch, polyattn = ctx["cupy"], ctx["torch"], ctx["polyattn"]
    b, h, t, e = shape
    rng = cupy.random.default_rng(0)
    if dtype == "bfloat16":  # CuPy has no bfloat16: torch tensors, the reference on their values
        inputs = [torch.from_dlpack(rng.standard_normal((b, h, t, e), dtype=cupy.float32)).to(
            torch.bfloat16) for _ in range(3)]
        q, k, v = (cupy.from_dlpack(x.float()) for x in inputs)
    else:
        q, k, v = (rng.standard_normal((b, h, t, e), dtype=cupy.float32).astype(dtype)
                   for _ in range(3))
        inputs = [q, k, v]
    rows = cupy.asarray(np.unique(np.linspace(0, t - 1, SAMPLE_ROWS).astype(np.int64)))
    ref = reference_rows(cupy, q, k, v, rows, causal)
    n_flops = flops(b, h, t, t, e, causal)
    record: dict[str, Any] = {"shape": list(shape), "dtype": dtype, "causal": causal,
                              "gflop": n_flops / 1e9, "methods": {}}

    def run_kernel(*arrays: Any, **env: str) -> Any:
        """The kernel with POLYATTN_CUDA_* variables set for this call only."""
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            return polyattn.scaled_dot_product_attention(*arrays, is_causal=causal,
                                                         implementation="numba_cuda")
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def arithmetic(**env: str) -> str:
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)
        try:
            return polyattn.explain(*inputs, is_causal=causal,
                                    implementation="numba_cuda").arithmetic
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    methods: dict[str, Any] = {"numba_cuda": lambda: run_kernel(*inputs)}
    record["arithmetic"] = {"numba_cuda": arithmetic()}
    if dtype in ("float32", "float64"):  # the 0.1 kernel beside the register-tiled one
        rows = {"POLYATTN_CUDA_KERNEL": "rows"}
        methods["numba_cuda_rows"] = lambda: run_kernel(*inputs, **rows)
        record["arithmetic"]["numba_cuda_rows"] = arithmetic(**rows)
    if dtype == "float32":  # the opt-in tensor-core arithmetic
        tf32 = {"POLYATTN_CUDA_FLOAT32": "3xtf32"}
        methods["numba_cuda_3xtf32"] = lambda: run_kernel(*inputs, **tf32)
        record["arithmetic"]["numba_cuda_3xtf32"] = arithmetic(**tf32)
    elif dtype in ("float16", "bfloat16"):  # the exact kernel on float32 copies
        wide = [cupy.from_dlpack(x.float()) if dtype == "bfloat16" else x.astype(cupy.float32)
                for x in inputs]
        methods["numba_cuda_exact_f32"] = lambda: run_kernel(*wide)
    if torch is not None:
        tq, tk, tv = (x if dtype == "bfloat16" else torch.from_dlpack(x) for x in inputs)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        methods["torch"] = lambda: sdpa(tq, tk, tv, is_causal=causal)
        record["arithmetic"]["torch"] = (
            "torch SDPA's own choice of backend: FlashAttention (tensor cores) for "
            "float16/bfloat16; for float32 with TF32 off, memory-efficient or math "
            "attention in FFMA" if dtype != "float64" else "torch SDPA, float64")

    for name, fn in methods.items():
        try:
            out = fn()
            if name == "torch" or dtype == "bfloat16":
                torch.cuda.synchronize()
                out = cupy.from_dlpack(out.float() if dtype == "bfloat16" else out)
            err = rel_error(cupy, out, ref, rows)
            del out
            ms, times = median_ms(cupy, fn, ctx["repeats"], ctx["warmup"])
            peak = ctx["memory"].measure(fn)
        except Exception as exc:  # an out-of-memory or unsupported case is a result too
            record["methods"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            cupy.get_default_memory_pool().free_all_blocks()
            continue
        tflops = n_flops / (ms * 1e-3) / 1e12
        record["methods"][name] = {
            "ms": ms, "times_ms": times, "tflops": tflops,
            "pct_fp32_peak": 100 * tflops / ctx["peak"] if ctx["peak"] else None,
            "rel_error": err, "peak_extra_mib": peak / 2**20,
        }
    kernel = record["methods"].get("numba_cuda", {})
    for other in ("reference", "torch", "numba_cuda_rows", "numba_cuda_exact_f32",
                  "numba_cuda_3xtf32"):
        if "ms" in kernel and "ms" in record["methods"].get(other, {}):
            # > 1: the kernel is faster than ``other``.
            record[f"speedup_vs_{other}"] = record["methods"][other]["ms"] / kernel["ms"]
    return record


def bench_backward_case(ctx: dict[str, Any], shape: tuple[int, int, int, int], dtype: str,
                        causal: bool) -> dict[str, Any]:
    """Forward + backward: the kernel's two passes against torch SDPA with autograd."""
    cupy, torch = ctx["cupy"], ctx["torch"]
    import array_api_compat.cupy as xp

    from polyattn.backends.cuda import facade as numba_cuda
    from polyattn.rules.visibility import Rules

    b, h, t, e = shape
    rng = cupy.random.default_rng(1)
    q, k, v, grad_out = (rng.standard_normal((b, h, t, e), dtype=cupy.float32).astype(dtype)
                         for _ in range(4))
    scale = 1.0 / math.sqrt(e)
    offset = 0 if causal else None
    n_flops = BACKWARD_FLOPS * flops(b, h, t, t, e, causal)
    record: dict[str, Any] = {"shape": list(shape), "dtype": dtype, "causal": causal,
                              "pass": "fwd+bwd", "gflop": n_flops / 1e9, "methods": {}}

    def kernel() -> tuple[Any, Any, Any]:
        rules = Rules.from_causal_offset(offset, t, t)
        out, lse = numba_cuda.attention(q, k, v, mask=None, rules=rules, scale=scale, xp=xp)
        return numba_cuda.backward(q, k, v, out, lse, grad_out, mask=None, rules=rules,
                                   scale=scale, xp=xp)

    methods: dict[str, Any] = {"numba_cuda": kernel}
    ref = None
    if torch is not None:
        sdpa = torch.nn.functional.scaled_dot_product_attention
        leaves = [torch.from_dlpack(a).detach().requires_grad_(True) for a in (q, k, v)]
        t_grad_out = torch.from_dlpack(grad_out)

        def torch_fn() -> tuple[Any, ...]:
            out = sdpa(*leaves, is_causal=causal, scale=scale)
            return torch.autograd.grad(out, leaves, t_grad_out)

        methods["torch"] = torch_fn
        # float64 gradients from torch's math path (it materialises the scores)
        if 3 * b * h * t * t * 8 <= REFERENCE_BUDGET * cupy.cuda.runtime.memGetInfo()[0]:
            leaves64 = [x.detach().double().requires_grad_(True) for x in leaves]
            out64 = sdpa(*leaves64, is_causal=causal, scale=scale)
            ref = [cupy.from_dlpack(g.detach()) for g in
                   torch.autograd.grad(out64, leaves64, t_grad_out.double())]
            del out64, leaves64
            torch.cuda.synchronize()

    for name, fn in methods.items():
        try:
            grads = fn()
            if name == "torch":
                torch.cuda.synchronize()
                grads = [cupy.from_dlpack(g) for g in grads]
            err = None
            if ref is not None:
                err = max(float(cupy.linalg.norm(g.astype(cupy.float64) - r)
                                / cupy.linalg.norm(r)) for g, r in zip(grads, ref, strict=True))
            del grads
            ms, times = median_ms(cupy, fn, ctx["repeats"], ctx["warmup"])
            peak = ctx["memory"].measure(fn)
        except Exception as exc:  # an out-of-memory or unsupported case is a result too
            record["methods"][name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            cupy.get_default_memory_pool().free_all_blocks()
            continue
        tflops = n_flops / (ms * 1e-3) / 1e12
        record["methods"][name] = {
            "ms": ms, "times_ms": times, "tflops": tflops,
            "pct_fp32_peak": 100 * tflops / ctx["peak"] if ctx["peak"] else None,
            "rel_error": err, "peak_extra_mib": peak / 2**20,
        }
    kernel_ms = record["methods"]["numba_cuda"].get("ms")
    torch_ms = record["methods"].get("torch", {}).get("ms")
    if kernel_ms and torch_ms:
        record["speedup_vs_torch"] = torch_ms / kernel_ms  # > 1: the kernel is faster
    return record


# --------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------- #

def _fmt(x: Any, spec: str) -> str:
    return "–" if x is None else format(x, spec)


def markdown(results: list[dict[str, Any]], info: dict[str, Any]) -> str:
    lines = [
        f"# polyattn GPU benchmark — {info['gpu']['name']}, {info['date']}",
        "",
        "Median of CUDA-event timings after warm-up. FLOPs = 4·B·H·Tq·Tk·E (half when "
        "causal). Speedup = other method's time / kernel time. Error = ‖out − ref‖/‖ref‖ "
        "against float64 on sampled rows.",
        "",
        "| shape (B,H,T,E) | dtype | causal | method | ms | TFLOP/s | % fp32 peak "
        "| error | peak extra MiB | speedup of kernel |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    forward = [r for r in results if r.get("pass") != "fwd+bwd"]
    both = [r for r in results if r.get("pass") == "fwd+bwd"]
    lines += _table_rows(forward)
    arithmetic = {(r["dtype"], name): how for r in forward
                  for name, how in r.get("arithmetic", {}).items()}
    if arithmetic:
        lines += ["", "Arithmetic of each method:", ""]
        lines += [f"- {dtype}, {name}: {how}" for (dtype, name), how in arithmetic.items()]
    if both:
        lines += [
            "",
            "Forward + backward: FLOPs = 3.5 × the forward's; error = the largest of "
            "‖g − ref‖/‖ref‖ over (dq, dk, dv) against torch autograd in float64.",
            "",
            lines[4], lines[5],
            *_table_rows(both),
        ]
    return "\n".join(lines) + "\n"


def _table_rows(results: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in results:
        for name, m in r["methods"].items():
            label = f"({', '.join(map(str, r['shape']))})"
            if "ms" not in m:
                note = m.get("skipped") or m.get("error")
                lines.append(f"| {label} | {r['dtype']} | {r['causal']} | {name} | {note} "
                             "| | | | | |")
                continue
            speedup = r.get(f"speedup_vs_{name}")
            lines.append(
                f"| {label} | {r['dtype']} | {r['causal']} | {name} | {m['ms']:.3f} "
                f"| {m['tflops']:.2f} | {_fmt(m['pct_fp32_peak'], '.1f')} "
                f"| {_fmt(m['rel_error'], '.1e')} | {m['peak_extra_mib']:.0f} "
                f"| {_fmt(speedup, '.2f')} |"
            )
    return lines


def print_row(r: dict[str, Any]) -> None:
    parts = [f"{tuple(r['shape'])!s:<22} {r['dtype']:<8} causal={r['causal']!s:<5}"
             f"{' fwd+bwd' if r.get('pass') == 'fwd+bwd' else ''}"]
    for name, m in r["methods"].items():
        if "ms" in m:
            parts.append(f"{name} {m['ms']:8.2f} ms {m['tflops']:6.2f} TF/s "
                         f"err {_fmt(m['rel_error'], '.1e')}")
        else:
            parts.append(f"{name}: {m.get('skipped') or m.get('error')}")
    print(" | ".join(parts), flush=True)


# --------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------- #

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="JSON output path")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per method (>= 10)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed calls before timing (after the correctness call)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="float32 peak of this GPU, if not H100/H200")
    parser.add_argument("--quick", action="store_true",
                        help="one shape per dtype (a smoke test, not for the record)")
    parser.add_argument("--no-backward", action="store_true",
                        help="time the forward pass only")
    args = parser.parse_args(argv)

    try:
        import cupy
    except ImportError:
        skip("CuPy is not installed")
    try:
        if not cupy.cuda.is_available():
            skip("no CUDA GPU is visible to CuPy")
    except Exception as exc:  # driver problems
        skip(f"CUDA is not usable ({exc})")
    try:
        import polyattn
        from polyattn.backends.cuda import facade as numba_cuda
    except ImportError as exc:
        skip(f"polyattn or its kernel module cannot be imported ({exc})")
    probe = cupy.zeros((1, 1, 1, 8), dtype=cupy.float32)
    usable, reason = numba_cuda.availability(None, (probe,))
    if not usable:
        skip(f"the numba_cuda kernel cannot run: {reason}")
    torch = None
    try:
        import torch as _torch

        if _torch.cuda.is_available():
            torch = _torch
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
    except ImportError:
        pass

    info = {"date": _dt.datetime.now().isoformat(timespec="seconds"),
            "gpu": gpu_info(cupy), "versions": versions(),
            "flops_formula": "4*B*H*Tq*Tk*E, halved when causal",
            "repeats": max(10, args.repeats), "warmup": args.warmup,
            "torch_tf32": False if torch is not None else None}
    peak = peak_tflops(info["gpu"]["name"], args.peak_tflops)
    info["fp32_peak_tflops"] = peak
    print(f"GPU: {info['gpu']['name']}  peak fp32: {peak} TFLOP/s  "
          f"clocks: {info['gpu'].get('nvidia_smi', {})}")
    print(f"versions: {info['versions']}  torch SDPA: {'yes' if torch else 'no'}")

    ctx = {"cupy": cupy, "torch": torch, "polyattn": polyattn, "peak": peak,
           "repeats": max(10, args.repeats), "warmup": max(1, args.warmup),
           "memory": Memory(cupy, torch)}
    plan: list[tuple[tuple[int, int, int, int], str, bool]] = []
    shapes = SHAPES[2:3] if args.quick else SHAPES
    for dtype in ("float32", "float16", *(("bfloat16",) if torch is not None else ())):
        for shape in shapes:
            for causal in (False, True):
                plan.append((shape, dtype, causal))
    for causal in (False, True):
        plan.append((FLOAT64_SHAPE, "float64", causal))
    if not args.quick:
        plan.append((LONG_SHAPE, "float32", False))

    backward_plan = [] if args.no_backward else [
        (shape, dtype, causal) for shape, dtype in BACKWARD_CASES[1 if args.quick else 0:]
        for causal in (False, True)]

    started = time.perf_counter()
    results = []
    for shape, dtype, causal in plan:
        record = bench_case(ctx, shape, dtype, causal)
        print_row(record)
        results.append(record)
    for shape, dtype, causal in backward_plan:
        record = bench_backward_case(ctx, shape, dtype, causal)
        print_row(record)
        results.append(record)
    info["seconds"] = round(time.perf_counter() - started, 1)

    gpu_tag = re.sub(r"[^A-Za-z0-9]+", "-", info["gpu"]["name"]).strip("-").lower()
    out = args.out or Path(__file__).parent / "results" / (
        f"gpu-{gpu_tag}-{_dt.date.today().isoformat()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"info": info, "results": results}, indent=2) + "\n")
    md = out.with_suffix(".md")
    md.write_text(markdown(results, info))
    print(f"wrote {out} and {md} in {info['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
