"""The numba_cpu kernel's register tiles and vector width on this machine: the same kernel
compiled for several targets and tile shapes, each timed against torch SDPA's forward pass
in the same process.

Run with ``python benchmarks/tiles.py`` (``--help``). Each configuration runs in a child
process of its own (Numba reads ``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES`` once, and the
tile shape is fixed when the kernel is compiled), with its own Numba cache, so the first
round also compiles. The configurations:

* ``host``: as compiled for this CPU (the default choice of
  :mod:`polyattn.backends.numba_cpu.tiles`: 12 × 2 tiles of 64-byte vectors with AVX-512,
  6 × 2 of 32-byte vectors without);
* ``host, 8 x 2 tiles``: the same vectors, fewer rows per tile (AVX-512 hosts);
* ``host without AVX-512``: this CPU's scheduling model with AVX-512 switched off
  (32-byte vectors, 6 × 2 tiles): what an AMD Zen 4, whose AVX-512 units are two 256-bit
  halves, would get from 256-bit code;
* ``haswell`` and ``haswell, 4 x 2 tiles``: code for an AVX2-only x86-64 CPU.

Every child times the forward and backward kernels (:mod:`.launch`, NumPy arrays) and
torch's ``scaled_dot_product_attention`` forward on the same arrays, interleaved
(:func:`cpu.time_interleaved`), and reports the kernels' times as ratios to torch's, which
cancels much of a shared machine's noise between processes. The rounds alternate the
configurations; the medians over rounds are reported. Results go to
``benchmarks/results/tiles-cpu-<date>.{json,md}``.

Only the host's own code measures the host: the other targets say how their code runs on
this CPU, not how it runs on theirs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from cpu import RESULTS, environment, time_interleaved

#: (B, H, T, E), causal: the shapes timed in every configuration.
CASES = [((1, 8, 2048, 64), True), ((1, 8, 2048, 64), False), ((1, 4, 2048, 128), True)]
DTYPES = ("float32", "float64")


def configurations(avx512: bool) -> list[tuple[str, dict[str, str], int | None]]:
    """(label, environment, tile rows or None for the default) of each configuration."""
    configs: list[tuple[str, dict[str, str], int | None]] = [("host", {}, None)]
    if avx512:
        configs += [("host, 8 x 2 tiles", {}, 8),
                    ("host without AVX-512", {"NUMBA_CPU_FEATURES": _host_features(False)},
                     None)]
    configs += [("haswell", {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": ""}, None),
                ("haswell, 4 x 2 tiles", {"NUMBA_CPU_NAME": "haswell",
                                          "NUMBA_CPU_FEATURES": ""}, 4)]
    return configs


def _host_features(avx512: bool) -> str:
    """The host's LLVM features, the AVX-512 ones switched off unless ``avx512``."""
    from llvmlite import binding

    flags = binding.get_host_cpu_features().flatten().split(",")
    if avx512:
        return ",".join(flags)
    return ",".join("-" + f[1:] if f.startswith("+avx512") else f for f in flags)


def child(rows: int | None, reps: int) -> dict[str, Any]:
    """Time the kernels of this process's configuration (see the module docstring)."""
    import numpy as np

    from polyattn.backends.numba_cpu import tiles

    if rows is not None:            # before the kernels are defined: they read these
        tiles.TILE_ROWS = rows
        tiles.tile_rows = tiles._tile(rows, tiles.TILE_VECTORS)
        tiles.half_rows = tiles._tile(rows, 1)
    import torch
    import torch.nn.functional as F

    from polyattn.backends.numba_cpu import compiler, launch
    from polyattn.rules.visibility import Rules

    torch.set_num_threads(os.cpu_count() or 1)
    compiler.warmup()
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {"vector_bytes": tiles.VECTOR_BYTES, "tile_rows": tiles.TILE_ROWS,
                              "cases": []}
    for dtype in DTYPES:
        for shape, causal in CASES:
            q, k, v, g = (rng.standard_normal(shape).astype(dtype) for _ in range(4))
            kw = {"mask": None, "rules": Rules(shape[2], shape[2], causal=causal),
                  "scale": shape[3] ** -0.5, "xp": np}
            out, lse = launch.attention(q, k, v, **kw)
            tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

            def sdpa(tq: Any = tq, tk: Any = tk, tv: Any = tv, causal: bool = causal) -> None:
                with torch.no_grad():
                    F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)

            times = time_interleaved({
                "forward": lambda q=q, k=k, v=v, kw=kw: launch.attention(q, k, v, **kw),
                "backward": lambda q=q, k=k, v=v, out=out, lse=lse, g=g, kw=kw:
                    launch.backward(q, k, v, out, lse, g, **kw),
                "torch": sdpa}, reps, settle=0.05)
            med = {name: statistics.median(x) for name, x in times.items()}
            result["cases"].append({
                "shape": list(shape), "causal": causal, "dtype": dtype,
                "ms": {name: round(t * 1e3, 3) for name, t in med.items()},
                "forward/torch": med["forward"] / med["torch"],
                "backward/torch": med["backward"] / med["torch"]})
    return result


def _case_name(case: dict[str, Any]) -> str:
    return f"{case['dtype']} {tuple(case['shape'])}{' causal' if case['causal'] else ''}"


def markdown(env: dict[str, Any], runs: dict[str, list[dict[str, Any]]], command: str) -> str:
    labels = list(runs)
    first = runs[labels[0]][0]["cases"]
    lines = [f"# numba_cpu tiles and vector width, {env['date']}", "",
             f"- Command: `{command}`",
             f"- CPU: {env['cpu']} ({env['cpu_count']} logical CPUs), SIMD {env['simd']}; "
             f"Numba threading layer: {env.get('numba_threading_layer', '?')}",
             f"- torch {env['versions']['torch']} ({env['torch_threads']} threads)",
             f"- load average at start {env['load_average_start'][0]:.2f}, at end "
             f"{os.getloadavg()[0]:.2f}", "",
             "Each cell: the kernel's time / torch SDPA forward's time on the same arrays, "
             "in the same process (median over rounds of each round's median); forward, "
             "then backward. Lower is faster.", "",
             "| case | " + " | ".join(
                 f"{label} ({runs[label][0]['vector_bytes']} B, "
                 f"{runs[label][0]['tile_rows']} x 2)" for label in labels) + " |",
             "|---|" + "---:|" * len(labels)]
    for i, case in enumerate(first):
        cells = []
        for label in labels:
            f = statistics.median(r["cases"][i]["forward/torch"] for r in runs[label])
            b = statistics.median(r["cases"][i]["backward/torch"] for r in runs[label])
            cells.append(f"{f:.3f} / {b:.3f}")
        lines.append(f"| {_case_name(case)} | " + " | ".join(cells) + " |")
    lines += ["", "Geometric mean over the cases, relative to `host` (below 1: faster than "
              "the default here):", ""]
    base = labels[0]
    for label in labels[1:]:
        for kind in ("forward/torch", "backward/torch"):
            ratios = [statistics.median(r["cases"][i][kind] for r in runs[label]) /
                      statistics.median(r["cases"][i][kind] for r in runs[base])
                      for i in range(len(first))]
            gm = float(statistics.geometric_mean(ratios))
            lines.append(f"- {label}, {kind.split('/')[0]}: {gm:.3f}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds over the configurations")
    parser.add_argument("--reps", type=int, default=7, help="timed calls per round and case")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--child", type=int, nargs="?", const=0, default=None,
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(args.child or None, args.reps)))
        return 0
    from polyattn.backends.numba_cpu import tiles

    env = environment()
    env["numba_threading_layer"] = os.environ.get("NUMBA_THREADING_LAYER", "default (tbb)")
    configs = configurations(tiles.vector_bytes() == 64)
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _, _ in configs}
    with tempfile.TemporaryDirectory() as caches:
        for r in range(args.rounds):
            for n, (label, extra, rows) in enumerate(configs):
                child_env = dict(os.environ, **extra,
                                 NUMBA_CACHE_DIR=str(Path(caches) / f"config{n}"))
                proc = subprocess.run(
                    [sys.executable, __file__, "--reps", str(args.reps), "--child",
                     str(rows or 0)], env=child_env, capture_output=True, text=True,
                    check=False)
                if proc.returncode != 0:
                    raise SystemExit(f"{label}: {proc.stderr[-2000:]}")
                runs[label].append(json.loads(proc.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1}, {label}: done", flush=True)
    command = "python benchmarks/tiles.py " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(env, runs, command.strip())
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"tiles-cpu-{env['date']}"
    stem.with_suffix(".json").write_text(json.dumps({"environment": env, "runs": runs},
                                                    indent=1))
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
