"""User rules on the CPU: polyattn's ``score_mod``/``mask_mod`` against its built-in
keywords and against torch's FlexAttention under ``torch.compile``.

Run with ``python benchmarks/flex.py`` (``--help``), in an environment with
torch==2.13.0 (its inductor needs a C++ compiler), threadpoolctl and Numba; unset
``OPENBLAS_CORETYPE`` and ``OPENBLAS_L2_SIZE`` for the run only. float32
(B, H, T, E) = (1, 8, T, 64); every case times its contenders interleaved in one
process (median of the rounds after a warm-up, as ``cpu.py``):

soft-capping (30) and causality
    ``polyattn rules``: ``score_mod`` = ``30·tanh(score/30)``, ``mask_mod`` = causal,
    with a block mask built once; ``polyattn keywords``: ``softcap=30.0,
    is_causal=True``; ``flex``: ``torch.compile(flex_attention)`` with the same two
    functions (written with torch) and ``create_block_mask``; ``polyattn causal``:
    ``is_causal=True`` alone (what the score rule adds to); ``torch sdpa causal``:
    torch SDPA with ``is_causal=True`` and no soft-capping (a floor: the products alone).
ALiBi and causality
    the same contenders with ``score_mod`` = ``score - slopes[h]·|q_idx - kv_idx|``
    (slopes ``2^(-8(h+1)/H)`` as ``mod_args``) and ``alibi_slopes=slopes``.
8 packed documents (causal within each)
    ``polyattn rules``: a document ``mask_mod`` on a (T,) table of document ids with
    its block mask; ``polyattn segment_ids``: ``segment_ids=ids, is_causal=True``;
    ``polyattn dense``: ``is_causal=True`` over all of T (what packing avoids);
    ``flex``: the same ``mask_mod`` and its block mask.

Each timed sample lasts 50 ms at least: a contender whose call is shorter is called
back to back within the sample and the mean per call taken, the steady-state time of a
call made in a loop (as in training). A single short call after the pause between
contenders also pays for waking the threads of its library, which weighs more the
shorter the call.

The figures to read are the ratios: rules / keywords (target at most 1.15), polyattn
rules / flex (target at most 0.7), documents / dense (target at most 0.2), and
keywords / causal, what soft-capping or ALiBi adds to the causal call (target at most
1.15). A guard
checks every polyattn output against flex's. The block masks' build times are reported
apart (built once, reused).

Results go to ``benchmarks/results/flex-cpu-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from cpu import RESULTS, environment, time_interleaved

import polyattn
from polyattn import ops

TS = [2048, 4096]
SHAPE = (1, 8, 64)
DOCUMENTS = 8
CAP = 30.0
#: A timed sample lasts this long at least: a shorter call is repeated within it, back to
#: back, and the sample is the mean per call (:func:`cpu.time_interleaved`).
MIN_SAMPLE_S = 0.05


def softcap(score, b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return CAP * ops.tanh(score / CAP)


def causal(b, h, q_idx, kv_idx, *mod_args):  # type: ignore[no-untyped-def]
    return q_idx >= kv_idx


def alibi(score, b, h, q_idx, kv_idx, slopes):  # type: ignore[no-untyped-def]
    return score - slopes[h] * ops.abs(q_idx - kv_idx)


def document(b, h, q_idx, kv_idx, doc):  # type: ignore[no-untyped-def]
    return ops.logical_and(doc[q_idx] == doc[kv_idx], q_idx >= kv_idx)


def _flex() -> tuple[Any, Any]:
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    return torch.compile(flex_attention), create_block_mask


def softcap_case(t: int, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    import torch

    flex, create_block_mask = _flex()
    b, h, e = SHAPE
    q, k, v = (rng.standard_normal((b, h, t, e)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    start = time.perf_counter()
    bm = polyattn.block_mask(causal, None, None, t, t)
    build = {"polyattn": time.perf_counter() - start}
    start = time.perf_counter()
    fbm = create_block_mask(lambda b, h, i, j: i >= j, None, None, t, t, device="cpu")
    build["flex"] = time.perf_counter() - start

    def t_softcap(score, b, h, i, j):  # type: ignore[no-untyped-def]
        return CAP * torch.tanh(score / CAP)

    sdpa = polyattn.scaled_dot_product_attention
    fns = {
        "polyattn rules": lambda: sdpa(q, k, v, score_mod=softcap, mask_mod=causal,
                                       block_mask=bm),
        "polyattn keywords": lambda: sdpa(q, k, v, softcap=CAP, is_causal=True),
        "polyattn causal": lambda: sdpa(q, k, v, is_causal=True),
        "flex": lambda: flex(tq, tk, tv, score_mod=t_softcap, block_mask=fbm),
        "torch sdpa causal": lambda: torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, is_causal=True),
    }
    return _timed("soft-capping + causal", t, fns, reps, build,
                  ("polyattn rules", "polyattn keywords"))


def alibi_case(t: int, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    import torch

    flex, create_block_mask = _flex()
    b, h, e = SHAPE
    q, k, v = (rng.standard_normal((b, h, t, e)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    slopes = (2.0 ** (-8.0 * np.arange(1, h + 1) / h)).astype(np.float32)
    tslopes = torch.from_numpy(slopes)
    start = time.perf_counter()
    bm = polyattn.block_mask(causal, None, None, t, t)
    build = {"polyattn": time.perf_counter() - start}
    start = time.perf_counter()
    fbm = create_block_mask(lambda b, h, i, j: i >= j, None, None, t, t, device="cpu")
    build["flex"] = time.perf_counter() - start

    def t_alibi(score, b, h, i, j):  # type: ignore[no-untyped-def]
        return score - tslopes[h] * (i - j).abs()

    sdpa = polyattn.scaled_dot_product_attention
    fns = {
        "polyattn rules": lambda: sdpa(q, k, v, score_mod=alibi, mod_args=(slopes,),
                                       mask_mod=causal, block_mask=bm),
        "polyattn keywords": lambda: sdpa(q, k, v, alibi_slopes=slopes, is_causal=True),
        "polyattn causal": lambda: sdpa(q, k, v, is_causal=True),
        "flex": lambda: flex(tq, tk, tv, score_mod=t_alibi, block_mask=fbm),
    }
    return _timed("ALiBi + causal", t, fns, reps, build,
                  ("polyattn rules", "polyattn keywords"))


def documents_case(t: int, reps: int, rng: np.random.Generator) -> dict[str, Any]:
    import torch

    flex, create_block_mask = _flex()
    b, h, e = SHAPE
    q, k, v = (rng.standard_normal((b, h, t, e)).astype(np.float32) for _ in range(3))
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    ids = np.repeat(np.arange(DOCUMENTS), t // DOCUMENTS)
    tids = torch.from_numpy(ids)
    start = time.perf_counter()
    bm = polyattn.block_mask(document, None, None, t, t, mod_args=(ids,))
    build = {"polyattn": time.perf_counter() - start}

    def t_document(b, h, i, j):  # type: ignore[no-untyped-def]
        return (tids[i] == tids[j]) & (i >= j)

    start = time.perf_counter()
    fbm = create_block_mask(t_document, None, None, t, t, device="cpu")
    build["flex"] = time.perf_counter() - start
    sdpa = polyattn.scaled_dot_product_attention
    fns = {
        "polyattn rules": lambda: sdpa(q, k, v, mask_mod=document, mod_args=(ids,),
                                       block_mask=bm),
        "polyattn segment_ids": lambda: sdpa(q, k, v, is_causal=True,
                                             segment_ids=ids[None]),
        "polyattn dense": lambda: sdpa(q, k, v, is_causal=True),
        "flex": lambda: flex(tq, tk, tv, block_mask=fbm),
    }
    return _timed(f"{DOCUMENTS} packed documents", t, fns, reps, build,
                  ("polyattn rules", "polyattn segment_ids"))


def _timed(case: str, t: int, fns: dict[str, Any], reps: int, build: dict[str, float],
           guarded: tuple[str, ...]) -> dict[str, Any]:
    import torch

    flex_error = None
    with torch.no_grad():
        start = time.perf_counter()
        try:
            ref = fns["flex"]().numpy()                  # compiles flex for this shape
        except Exception as exc:   # torch's inductor fails on some shapes: say so, go on
            flex_error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            del fns["flex"]
            ref = np.asarray(fns[guarded[1]]())
        compile_s = time.perf_counter() - start
        guard = {n: float(np.abs(np.asarray(fns[n]()) - ref).max()) for n in guarded}
        times = time_interleaved(fns, reps, cold=(), min_sample=MIN_SAMPLE_S)
    ms = {n: statistics.median(ts) * 1e3 for n, ts in times.items()}
    row: dict[str, Any] = {"case": case, "t": t, "ms": ms, "times_s": times,
                           "guard_max_abs_error": guard, "block_mask_build_s": build,
                           "flex_first_call_s": compile_s, "flex_error": flex_error}
    if "flex" in ms:
        row["rules / flex"] = ms["polyattn rules"] / ms["flex"]
    if "polyattn keywords" in ms:
        row["rules / keywords"] = ms["polyattn rules"] / ms["polyattn keywords"]
    if "polyattn causal" in ms:
        row["keywords / causal"] = ms["polyattn keywords"] / ms["polyattn causal"]
    if "polyattn dense" in ms:
        row["rules / dense"] = ms["polyattn rules"] / ms["polyattn dense"]
        row["segment_ids / dense"] = ms["polyattn segment_ids"] / ms["polyattn dense"]
    return row


def guarded_name(row: dict[str, Any]) -> str:
    """What the guard compared with where flex did not run: the built-in keyword's call."""
    return [n for n in row["guard_max_abs_error"]][-1]


def markdown(env: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    blas = ", ".join(f"{p['library']} {p['kernel']} ({p['threading_layer']})"
                     for p in env["numpy_blas"])
    lines = [f"# User rules on the CPU: polyattn against FlexAttention ({env['date']})", "",
             f"- command: `{command}`",
             f"- CPU: {env['cpu']} ({env['cpu_count']} CPUs), SIMD {env['simd']}, "
             f"numba_cpu tiles: {env['numba_cpu_tiles']}",
             f"- Numba threading layer: {env.get('numba_threading_layer')}",
             f"- NumPy BLAS: {blas}; torch {env['versions']['torch']} "
             f"({env['torch_threads']} threads)",
             f"- load average at start: {env['load_average_start']}",
             f"- float32 (B, H, E) = {SHAPE}; median ms of the rounds (samples of 50 ms at least: "
             "shorter calls repeated back to back, mean per call); polyattn runs "
             "implementation='auto' (numba_cpu here)", ""]
    for r in rows:
        lines += [f"## {r['case']}, T = {r['t']}", "",
                  "| contender | ms |", "|---|---:|"]
        lines += [f"| {n} | {v:.1f} |" for n, v in r["ms"].items()]
        ratios = [k for k in r if " / " in k]
        lines += ["", "| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | **{r[k]:.3f}** |" for k in ratios]
        against = "flex" if r["flex_error"] is None else guarded_name(r)
        lines += ["", f"Guard (max |polyattn - {against}|): {r['guard_max_abs_error']}; "
                  f"block masks built once in {r['block_mask_build_s']} s; flex's first "
                  f"call (compiling) {r['flex_first_call_s']:.1f} s."
                  + ("" if r["flex_error"] is None else
                     f" flex did not run: torch.compile failed ({r['flex_error']})."), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--quick", action="store_true", help="T = 512 only, 2 rounds")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results folder")
    args = parser.parse_args(argv)
    ts, reps = ([512], 2) if args.quick else (TS, args.reps)
    rng = np.random.default_rng(0)
    rows = [case(t, reps, rng) for t in ts
            for case in (softcap_case, alibi_case, documents_case)]
    env = environment()
    from polyattn.backends.numba_cpu import launch as numba_cpu

    env["numba_threading_layer"] = numba_cpu.threading_layer() or "not run"
    command = "python benchmarks/flex.py " + " ".join(argv if argv is not None
                                                      else sys.argv[1:])
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"flex-cpu-{env['date']}"
    stem.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows},
                                                    indent=1, default=str))
    text = markdown(env, rows, command.strip())
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
