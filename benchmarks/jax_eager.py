"""Eager calls on JAX CPU arrays: polyattn's Array-API paths run as one compiled
computation per call template (:mod:`polyattn._jax_eager`) against the same paths run
operation by operation, and against ``jax.nn.dot_product_attention`` called eagerly.

Run with ``nox -s bench_jax_eager`` or ``python benchmarks/jax_eager.py`` (``--help``).
For each case, in one process:

* the first call of each contender on a new shape (compiles included: JAX's persistent
  compilation cache is not used), and
* the steady state: later calls on new arrays of the same shapes, timed interleaved
  (:func:`cpu.time_interleaved`), as medians; ratios are to the operation-by-operation
  run of the same implementation.

Results go to ``benchmarks/results/jax-eager-cpu-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from typing import Any

import numpy as np
from cpu import RESULTS, environment, time_interleaved

import polyattn

#: (B, H, T, E), causal: a decoding-sized call, then prefill-sized ones.
CASES = [(1, 8, 128, 64), (1, 8, 1024, 64), (4, 12, 512, 64)]
IMPLEMENTATIONS = ("reference", "chunked")


def run_case(b: int, h: int, t: int, e: int, dtype: str, reps: int,
             rng: np.random.Generator, *, cold: bool = True) -> dict[str, Any]:
    """First-call and steady-state seconds of each contender at (b, h, t, e), causal;
    ``cold``: JAX's caches are cleared before each first call (``False``: the first calls
    may reuse what the process compiled before)."""
    import jax
    import jax.numpy as jnp

    from polyattn import _jax_eager

    def arrays() -> tuple[Any, Any, Any]:
        return tuple(jnp.asarray(rng.standard_normal((b, h, t, e)), dtype=dtype)
                     for _ in range(3))  # type: ignore[return-value]

    def polyattn_call(implementation: str, compiled: bool) -> Any:
        def call(q: Any, k: Any, v: Any) -> Any:
            passes = _jax_eager.passes
            if not compiled:
                _jax_eager.passes = lambda backend, problem: None   # type: ignore[assignment]
            try:
                return polyattn.scaled_dot_product_attention(
                    q, k, v, is_causal=True, implementation=implementation)
            finally:
                _jax_eager.passes = passes                          # type: ignore[assignment]
        return call

    def jax_nn(q: Any, k: Any, v: Any) -> Any:           # (B, T, N, H) for JAX
        swap = (0, 2, 1, 3)
        out = jax.nn.dot_product_attention(q.transpose(swap), k.transpose(swap),
                                           v.transpose(swap), is_causal=True)
        return out.transpose(swap)

    contenders = {"jax.nn.dot_product_attention": jax_nn}
    for impl in IMPLEMENTATIONS:
        contenders[f"{impl} compiled"] = polyattn_call(impl, True)
        contenders[f"{impl} op by op"] = polyattn_call(impl, False)
    first, outs = {}, {}
    q, k, v = arrays()
    for name, fn in contenders.items():                 # a new shape for every contender
        if cold:
            jax.clear_caches()
            _jax_eager._COMPILED.clear()
        t0 = time.perf_counter()
        outs[name] = np.asarray(fn(q, k, v).block_until_ready())
        first[name] = time.perf_counter() - t0
    want = outs["reference op by op"]
    diff = {name: float(np.max(np.abs(out - want))) for name, out in outs.items()}
    q, k, v = arrays()
    times = time_interleaved(
        {name: (lambda fn=fn: fn(q, k, v).block_until_ready())
         for name, fn in contenders.items()}, reps, settle=0.02, cold=(), min_sample=0.2)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = {name: median[name] / median[f"{name.split()[0]} op by op"]
             for name in median if name.endswith("compiled")}
    return {"shape": [b, h, t, e], "dtype": dtype, "causal": True, "first_call_s": first,
            "median_s": median, "compiled_over_op_by_op": ratio,
            "max_abs_diff_vs_reference_op_by_op": diff}


def table(rows: list[dict[str, Any]]) -> list[str]:
    names = list(rows[0]["median_s"])
    lines = ["| shape | dtype | contender | first call (ms) | steady state (ms) "
             "| compiled / op by op |", "|---|---|---|---:|---:|---:|"]
    for row in rows:
        for name in names:
            ratio = row["compiled_over_op_by_op"].get(name)
            lines.append(
                f"| {tuple(row['shape'])} | {row['dtype']} | {name} "
                f"| {row['first_call_s'][name] * 1e3:.0f} | {row['median_s'][name] * 1e3:.2f} "
                f"| {'' if ratio is None else f'{ratio:.2f}'} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--tag", default="", help="appended to the results' file names")
    args = parser.parse_args(argv)
    import jax

    if args.dtype == "float64":
        jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(0)
    rows = []
    for b, h, t, e in CASES:
        rows.append(run_case(b, h, t, e, args.dtype, args.reps, rng))
        print(json.dumps(rows[-1]["median_s"]), flush=True)
    env = environment()
    env["versions"]["jax"] = jax.__version__
    stem = f"jax-eager-cpu-{env['date']}{'-' + args.tag if args.tag else ''}"
    command = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{stem}.json").write_text(json.dumps(
        {"command": command, "environment": env, "rows": rows}, indent=2) + "\n")
    lines = [f"# Eager JAX calls, compiled per template vs op by op ({env['date']})", "",
             f"`{command}` on {env['cpu']} ({env['simd']}, {env['cpu_count']} cores), "
             f"JAX {jax.__version__}; causal; first call: a new shape with JAX's caches "
             "cleared; steady state: median of interleaved rounds on new arrays.", "",
             *table(rows)]
    (RESULTS / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
