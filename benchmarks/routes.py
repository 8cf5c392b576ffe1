"""torch CPU tensors and JAX CPU arrays: polyattn ``"auto"`` and ``"numba_cpu"`` against the
library's own attention, forward and forward + backward, side by side in one process.

Run with ``nox -s bench_routes`` or ``python benchmarks/routes.py`` (``--help``). For each
case and library the contenders are timed interleaved (:func:`cpu.time_interleaved`), and
ratios to the library's own attention are reported:

* torch: ``torch.nn.functional.scaled_dot_product_attention`` on the same tensors;
  forward under ``torch.no_grad()``, and forward + ``backward()`` of ``(out * g).sum()``;
* JAX: ``jax.nn.dot_product_attention`` under ``jax.jit``; forward, and ``jax.grad`` of
  ``(out * g).sum()`` with respect to query, key and value, both jitted.

The small cases locate the crossovers of ``polyattn._preferences``
(``TORCH_NUMBA_CPU_MIN_SCORES``, ``JAX_NUMBA_CPU_MIN_SCORES``): the score-matrix size from
which ``"numba_cpu"`` is faster than the library's own call. Results go to
``benchmarks/results/routes-cpu-<date>.{json,md}``.
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

import numpy as np
from cpu import CASES as CPU_CASES
from cpu import RESULTS, environment, time_interleaved

import polyattn

#: (B, H, T, E): small ones for the crossovers, then those of benchmarks/cpu.py.
CASES = [(1, 4, 64, 64), (1, 8, 128, 64), (1, 8, 256, 64), (1, 8, 512, 64),
         (1, 8, 1024, 64), (4, 12, 512, 64), (1, 8, 4096, 64), (1, 4, 4096, 128)]
#: Targets of "auto" against the library's own attention (medians over the cases at and
#: above the crossover): torch forward, torch forward + backward, JAX forward and grad.
TARGETS = {"torch forward": 0.95, "torch forward+backward": 1.0, "jax forward": 0.3,
           "jax grad": 0.3}


def torch_case(b: int, h: int, t: int, e: int, causal: bool, dtype: str, reps: int,
               rng: np.random.Generator) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    q, k, v, g = (torch.from_numpy(rng.standard_normal((b, h, t, e)).astype(dtype))
                  for _ in range(4))
    choice = polyattn.explain(q, k, v, is_causal=causal).implementation

    def forward(implementation: str | None) -> Any:
        def run() -> Any:
            with torch.no_grad():
                if implementation is None:
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                return polyattn.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, implementation=implementation)
        return run

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def both(implementation: str | None) -> Any:
        def run() -> Any:
            a, b_, c = leaves
            out = (F.scaled_dot_product_attention(a, b_, c, is_causal=causal)
                   if implementation is None else polyattn.scaled_dot_product_attention(
                       a, b_, c, is_causal=causal, implementation=implementation))
            (out * g).sum().backward()
            for x in leaves:
                x.grad = None
        return run

    fns = {"auto": forward("auto"), "numba_cpu": forward("numba_cpu"), "own": forward(None),
           "auto fb": both("auto"), "numba_cpu fb": both("numba_cpu"), "own fb": both(None)}
    err = float((forward("auto")() - forward(None)()).abs().max())
    row = _row("torch", (b, h, t, e), causal, dtype, choice, reps, fns, err)
    row["auto fb runs"] = polyattn.explain(*leaves, is_causal=causal).implementation
    return row


def jax_case(b: int, h: int, t: int, e: int, causal: bool, dtype: str, reps: int,
             rng: np.random.Generator) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp

    q, k, v, g = (jnp.asarray(rng.standard_normal((b, h, t, e)), dtype=dtype)
                  for _ in range(4))
    choice = polyattn.explain(q, k, v, is_causal=causal).implementation

    def own(q: Any, k: Any, v: Any) -> Any:     # jax.nn takes (B, T, H, E)
        out = jax.nn.dot_product_attention(*(jnp.swapaxes(x, 1, 2) for x in (q, k, v)),
                                           is_causal=causal)
        return jnp.swapaxes(out, 1, 2)

    def ours(implementation: str) -> Any:
        return lambda q, k, v: polyattn.scaled_dot_product_attention(
            q, k, v, is_causal=causal, implementation=implementation)

    def timed(fn: Any, grad: bool) -> Any:
        if grad:
            fn = jax.grad(lambda q, k, v, fn=fn: (fn(q, k, v) * g).sum(), argnums=(0, 1, 2))
        compiled = jax.jit(fn)
        return lambda: jax.block_until_ready(compiled(q, k, v))

    fns = {"auto": timed(ours("auto"), False), "numba_cpu": timed(ours("numba_cpu"), False),
           "own": timed(own, False), "auto fb": timed(ours("auto"), True),
           "numba_cpu fb": timed(ours("numba_cpu"), True), "own fb": timed(own, True)}
    err = float(jnp.abs(fns["auto"]() - fns["own"]()).max())
    return _row("jax", (b, h, t, e), causal, dtype, choice, reps, fns, err)


def _row(library: str, case: tuple[int, ...], causal: bool, dtype: str, choice: str,
         reps: int, fns: dict[str, Any], err: float) -> dict[str, Any]:
    times = time_interleaved(fns, reps, settle=0.02, cold=())
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = {name: med[name] / med["own" + (" fb" if name.endswith(" fb") else "")]
             for name in med if not name.startswith("own")}
    b, h, t, _ = case
    return {"library": library, "case": list(case), "causal": causal, "dtype": dtype,
            "scores": b * h * t * t, "auto runs": choice, "auto fb runs": choice,
            "median_s": med,
            "ratio_to_own": ratio, "max_abs_diff_auto_vs_own": err, "reps": reps}


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        f"# torch and JAX CPU arrays: polyattn against their own attention, {env['date']}",
        "",
        f"- Command: `{command}`",
        f"- CPU: {env['cpu']} ({env['cpu_count']} logical CPUs), SIMD {env['simd']}; "
        f"numba_cpu tiles: {env['numba_cpu_tiles']}; Numba threading layer: "
        f"{env.get('numba_threading_layer')}",
        f"- torch {env['versions']['torch']} ({env['torch_threads']} threads, "
        f"{env['torch_cpu_capability']}); JAX {env.get('jax_version')}",
        f"- load average at start {env['load_average_start'][0]:.2f}, at end "
        f"{env['load_average_end'][0]:.2f}",
        "",
        "Ratio = time / the library's own attention (torch SDPA; `jax.nn.dot_product_attention`"
        " under `jax.jit`); fb = forward + backward (torch `backward()`, `jax.grad` jitted). "
        "Median of the rounds, contenders interleaved.",
        "",
        "| library | case (B, H, T, E) | causal | dtype | scores | auto runs (fb) | auto | "
        "numba_cpu | auto fb | numba_cpu fb | own ms | own fb ms |",
        "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rat, med = r["ratio_to_own"], r["median_s"]
        lines.append(
            f"| {r['library']} | {tuple(r['case'])} | {'yes' if r['causal'] else 'no'} "
            f"| {r['dtype']} | {r['scores']} | {_runs(r)} | **{rat['auto']:.3f}** "
            f"| {rat['numba_cpu']:.3f} | **{rat['auto fb']:.3f}** | {rat['numba_cpu fb']:.3f} "
            f"| {med['own'] * 1e3:.2f} | {med['own fb'] * 1e3:.2f} |")
    lines += ["", *summary(rows), ""]
    return "\n".join(lines)


def _runs(row: dict[str, Any]) -> str:
    """What "auto" ran, forward (and under autograd where that differs)."""
    fb = row.get("auto fb runs", row["auto runs"])
    return row["auto runs"] if fb == row["auto runs"] else f"{row['auto runs']} ({fb})"


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Medians and worst cases of "auto" against the targets, per library and dtype, over
    the cases where it runs numba_cpu, forward and under autograd (the others run the
    library's own call); and over those of them that are benchmarks/cpu.py's cases."""
    out = []
    for library in ("torch", "jax"):
        for dtype in sorted({r["dtype"] for r in rows}):
            for key, label in (("auto", "forward"), ("auto fb", "forward+backward"
                                                     if library == "torch" else "grad")):
                runs = "auto runs" if key == "auto" else "auto fb runs"
                chosen = [r for r in rows if r["library"] == library and r["dtype"] == dtype
                          and r.get(runs, r["auto runs"]) == "numba_cpu"]
                if not chosen:
                    continue
                values = [r["ratio_to_own"][key] for r in chosen]
                target = TARGETS[f"{library} {label}"]
                out.append(f"- {library} {label} {dtype}, where auto runs numba_cpu "
                           f"({len(values)} cases): median {statistics.median(values):.3f}, "
                           f"worst {max(values):.3f} (target: median at most {target})")
                large = [r["ratio_to_own"][key] for r in chosen
                         if tuple(r["case"]) in CPU_CASES]
                if large and len(large) < len(values):
                    out.append(f"  - of which benchmarks/cpu.py's cases ({len(large)}): "
                               f"median {statistics.median(large):.3f}, worst "
                               f"{max(large):.3f}")
    return out


def _cases(text: str) -> list[tuple[int, int, int, int]]:
    """``--cases``: (B, H, T, E) tuples separated by ``;``."""
    cases = []
    for part in text.split(";"):
        numbers = tuple(int(x) for x in part.split(","))
        if len(numbers) != 4 or min(numbers) < 1:
            raise argparse.ArgumentTypeError(
                f"each case is four positive integers B,H,T,E; got {part!r}")
        cases.append(numbers)
    return cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="timed rounds per case")
    parser.add_argument("--libraries", default="torch,jax")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--max-t", type=int, default=4096, help="longest sequence")
    parser.add_argument("--cases", type=_cases, default=CASES,
                        help="(B, H, T, E) cases instead of the default ones, e.g. "
                             "'1,8,512,64;2,8,512,64'")
    parser.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    parser.add_argument("--name", default="",
                        help="appended to the results' file names (routes-cpu-<date>-<name>)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)

    import jax
    import torch

    jax.config.update("jax_enable_x64", True)
    torch.set_num_threads(os.cpu_count() or 1)
    env = environment()
    env["jax_version"] = jax.__version__
    from polyattn.backends.numba_cpu import launch

    launch.warmup()
    rng = np.random.default_rng(0)
    rows = []
    started = time.perf_counter()
    runners = {"torch": torch_case, "jax": jax_case}
    for library in args.libraries.split(","):
        for dtype in args.dtypes.split(","):
            for case in args.cases:
                if case[2] > args.max_t:
                    continue
                for causal in {"both": (False, True), "yes": (True,), "no": (False,)}[
                        args.causal]:
                    row = runners[library](*case, causal, dtype, args.reps, rng)
                    rows.append(row)
                    rat = row["ratio_to_own"]
                    print(f"{library} {dtype} {case} causal={causal}: auto -> "
                          f"{_runs(row)}; auto {rat['auto']:.3f}, numba_cpu "
                          f"{rat['numba_cpu']:.3f}, auto fb {rat['auto fb']:.3f}, numba_cpu fb "
                          f"{rat['numba_cpu fb']:.3f}", flush=True)
    env["load_average_end"] = list(os.getloadavg())
    env["numba_threading_layer"] = launch.threading_layer()
    env["elapsed_s"] = time.perf_counter() - started
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"routes-cpu-{env['date']}{'-' + args.name if args.name else ''}"
    command = "python benchmarks/routes.py " + shlex.join(
        argv if argv is not None else sys.argv[1:])
    if all(os.environ.get(n) is None for n in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + command
    report = {"environment": env, "command": command.strip(), "results": rows}
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(env, rows, command.strip()))
    print("\n".join(summary(rows)))
    print(f"wrote {stem}.json and .md in {env['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
