"""Decoders read from transformers checkpoints, against transformers itself.

For each architecture a tiny random model (hidden 64, 2–4 layers, 4 query
heads over 2 key/value heads, a vocabulary of 128) is built with
transformers, with every attention feature its architecture has (both layer
kinds where there are two, rotary scaling, softcaps, QK-norm, sinks,
biases, the mixture of experts), saved with ``save_pretrained`` in a
temporary folder (no network), and read by
:func:`polyattn.models.from_pretrained` on every library under test.
Checked: the logits of a batch of prompts of different lengths against
transformers' eager attention on each prompt alone, 16 greedy tokens,
decoding with the cache against recomputing, a prompt longer than the
sliding window, bfloat16 and sharded checkpoints, and the errors.

Errors are relative norms, ``‖ours − theirs‖ / ‖theirs‖`` over the real
(unpadded) positions: at most 1e-4 in float32 and 1e-10 in float64.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest
from helpers import to_numpy

import polyattn
from polyattn.models import from_pretrained

for _module in ("torch", "transformers", "safetensors", "tokenizers"):
    if importlib.util.find_spec(_module) is None:  # pragma: no cover - environment
        pytest.skip(f"{_module} is not installed: the checkpoints are built with transformers "
                    "(`nox -s model` installs it)", allow_module_level=True)

import torch  # noqa: E402

TOLERANCE = {"float32": 1e-4, "float64": 1e-10}
#: Prompt lengths of the ragged batch: shorter and longer than the sliding windows (8).
LENGTHS = (5, 12, 19)
NEW_TOKENS = 16
VOCAB = 128
#: The sliding windows; gpt-oss keeps its real 128 tokens (see the long-prompt test).
WINDOW = {"qwen3": 8, "gemma2": 8, "gemma3": 8, "gpt_oss": 128}
COMMON = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
          "max_position_embeddings": 512, "bos_token_id": 2, "eos_token_id": 1,
          "pad_token_id": 0}


def _configs():
    """A transformers configuration per architecture, each feature switched on."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        GptOssConfig,
        LlamaConfig,
        Qwen3Config,
    )

    return {
        # Llama 3.1's rope scaling (its original context short enough to matter), biases
        "llama": LlamaConfig(**COMMON, num_hidden_layers=2, attention_bias=True,
                             mlp_bias=True, rope_parameters={
                                 "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                 "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                 "original_max_position_embeddings": 64}),
        # QK-norm, sliding layers from the second on, YaRN
        "qwen3": Qwen3Config(**COMMON, num_hidden_layers=3, use_sliding_window=True,
                             sliding_window=WINDOW["qwen3"], max_window_layers=1,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                              "factor": 4.0,
                                              "original_max_position_embeddings": 128}),
        # softcaps on scores and logits, sliding/full alternating, query_pre_attn_scalar
        "gemma2": Gemma2Config(**COMMON, num_hidden_layers=2, sliding_window=WINDOW["gemma2"],
                               attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                               query_pre_attn_scalar=24),
        # QK-norm, a local rotary base for sliding layers, linear scaling for full ones
        "gemma3": Gemma3TextConfig(**COMMON, num_hidden_layers=3,
                                   sliding_window=WINDOW["gemma3"], query_pre_attn_scalar=24,
                                   final_logit_softcapping=3.0,
                                   layer_types=["sliding_attention", "sliding_attention",
                                                "full_attention"],
                                   rope_parameters={
                                       "sliding_attention": {"rope_type": "default",
                                                             "rope_theta": 100.0},
                                       "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                          "rope_theta": 10000.0}}),
        # sinks, banded/full alternating, YaRN, biases, 4 experts (top 2)
        "gpt_oss": GptOssConfig(**COMMON, num_hidden_layers=2,
                                sliding_window=WINDOW["gpt_oss"], num_local_experts=4,
                                num_experts_per_tok=2, rope_parameters={
                                    "rope_type": "yarn", "rope_theta": 150000.0,
                                    "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 64}),
    }


ARCHS = ("llama", "qwen3", "gemma2", "gemma3", "gpt_oss")


def _randomize(model, seed: int) -> None:
    """Weights large enough that every feature moves the logits (the initialisers'
    0.02 would leave the softcaps, sinks and router all but idle)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            if "norm" in name:
                gemma = "gemma" in type(model).__name__.lower()
                p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            elif "sinks" in name:
                p.copy_(noise)
            else:
                p.copy_(0.15 * noise)


def _tokenizer_json(folder) -> None:
    """A word-level tokenizer of the 128 ids: ``<pad> <eos> <bos> w3 … w127``."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2} | {f"w{i}": i for i in range(3, VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<pad>", "<eos>", "<bos>"])
    tok.save(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Folder per architecture (and a bfloat16 one, a sharded one, one without tokenizer)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("checkpoints")
    folders = {}
    for seed, (arch, config) in enumerate(_configs().items()):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        _randomize(model, seed)
        folders[arch] = root / arch
        model.save_pretrained(folders[arch])
        _tokenizer_json(folders[arch])
        if arch == "llama":
            model.save_pretrained(root / "sharded", max_shard_size="40KB")
            model.to(torch.bfloat16).save_pretrained(root / "bf16")
            folders["sharded"], folders["bf16"] = root / "sharded", root / "bf16"
    return folders


# --------------------------------------------------------------------------
# transformers, as the reference
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _float64_reference(ours):
    """transformers in float64 without its float32 steps, for the 1e-10 comparison.

    transformers computes rotary angles in float32 (its rotary modules cast
    the positions and frequencies with ``.float()``), normalises in float32
    (``RMSNorm``) and takes the attention softmax in float32 even in a
    float64 model: each alone leaves about 1e-7. Here, for the float64
    tests only, its rotary modules compute ``cos`` and ``sin`` in float64
    from the frequencies polyattn uses (checked against transformers' own
    formulas by ``test_rotary_frequencies_match_transformers``), its RMSNorms
    run in the input's dtype, and ``softmax`` keeps float64. Everything else
    is transformers' code.
    """
    from transformers.models.gemma2 import modeling_gemma2
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.gpt_oss import modeling_gpt_oss
    from transformers.models.llama import modeling_llama
    from transformers.models.qwen3 import modeling_qwen3

    spec = ours.spec

    def inv_freq(name):
        rope = spec.rope(name)
        if rope.inv_freq is not None:
            return torch.tensor(rope.inv_freq, dtype=torch.float64), rope.attention_factor
        e = spec.head_dim
        return (torch.tensor([1.0 / rope.base ** (i / e) for i in range(0, e, 2)],
                             dtype=torch.float64), 1.0)

    def rotary(halves):
        def forward(self, x, position_ids, layer_type=None):
            theta, factor = inv_freq(layer_type if layer_type in spec.ropes else "default")
            freqs = position_ids[..., None].to(torch.float64) * theta
            emb = torch.cat((freqs, freqs), dim=-1) if halves else freqs
            return (emb.cos() * factor).to(x.dtype), (emb.sin() * factor).to(x.dtype)
        return forward

    def rms(gemma):
        def forward(self, x):
            eps = getattr(self, "eps", getattr(self, "variance_epsilon", None))
            h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return h * (1.0 + self.weight) if gemma else self.weight * h
        return forward

    softmax = torch.nn.functional.softmax

    def softmax64(x, dim=None, dtype=None, **kwargs):
        return softmax(x, dim=dim, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)

    patches = [(modeling_llama.LlamaRotaryEmbedding, True, modeling_llama.LlamaRMSNorm, False),
               (modeling_qwen3.Qwen3RotaryEmbedding, True, modeling_qwen3.Qwen3RMSNorm, False),
               (modeling_gemma2.Gemma2RotaryEmbedding, True, modeling_gemma2.Gemma2RMSNorm,
                True),
               (modeling_gemma3.Gemma3RotaryEmbedding, True, modeling_gemma3.Gemma3RMSNorm,
                True),
               (modeling_gpt_oss.GptOssRotaryEmbedding, False, modeling_gpt_oss.GptOssRMSNorm,
                False)]
    saved = [(r, r.forward, n, n.forward) for r, _, n, _ in patches]
    try:
        for r, halves, n, gemma in patches:
            r.forward = rotary(halves)
            n.forward = rms(gemma)
        torch.nn.functional.softmax = softmax64
        yield
    finally:
        torch.nn.functional.softmax = softmax
        for r, rf, n, nf in saved:
            r.forward, n.forward = rf, nf


_HF_CACHE: dict = {}


def _hf(folder, dtype_name):
    from transformers import AutoModelForCausalLM

    key = (str(folder), dtype_name)
    if key not in _HF_CACHE:
        # eager attention is the reference; eager experts (the loop over experts written
        # in modeling_gpt_oss.py) also run in float64, which the grouped GEMM does not
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(
            folder, dtype=getattr(torch, dtype_name), attn_implementation="eager",
            experts_implementation="eager").eval()
    return _HF_CACHE[key]


def _reference(folder, ours, dtype_name, prompts):
    """transformers' logits of each prompt alone: a list of (T_b, V)."""
    hf = _hf(folder, dtype_name)
    context = _float64_reference(ours) if dtype_name == "float64" else contextlib.nullcontext()
    with torch.no_grad(), context:
        return [hf(torch.tensor([p])).logits[0].double().numpy() for p in prompts]


def _hf_greedy(folder, prompt, n):
    """transformers' greedy continuation with its own cache (sliding layers included)."""
    hf = _hf(folder, "float32")
    tokens = []
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
    return tokens


def _prompts(seed=0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB, n).tolist() for n in lengths]


def _padded(prompts):
    ids = np.zeros((len(prompts), max(len(p) for p in prompts)), dtype=np.int64)
    for row, p in enumerate(prompts):
        ids[row, :len(p)] = p
    return ids, [len(p) for p in prompts]


def _relative(ours, ref) -> float:
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def _load(folder, xp, device, dtype_name):
    return from_pretrained(folder, xp=xp, dtype=getattr(xp, dtype_name), device=device)


# --------------------------------------------------------------------------
# Logits, generation, the cache
# --------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_of_a_ragged_batch_match_transformers(checkpoints, arch, xp, device, dtype_name):
    model = _load(checkpoints[arch], xp, device, dtype_name)
    prompts = _prompts()
    ids, lengths = _padded(prompts)
    logits = to_numpy(model(ids, lengths=lengths))                     # (B, T, V)
    assert logits.dtype == np.dtype(dtype_name)
    refs = _reference(checkpoints[arch], model, dtype_name, prompts)
    for row, ref in enumerate(refs):
        err = _relative(logits[row, :lengths[row]], ref)
        assert err <= TOLERANCE[dtype_name], (arch, row, err)


@pytest.mark.parametrize("arch", ARCHS)
def test_sixteen_greedy_tokens_match_transformers(checkpoints, arch, xp, device):
    model = _load(checkpoints[arch], xp, device, "float32")
    prompts = _prompts(1)
    ours = model.generate(prompts, NEW_TOKENS, stop_at_eos=False)
    theirs = [_hf_greedy(checkpoints[arch], p, NEW_TOKENS) for p in prompts]
    assert ours == theirs


@pytest.mark.parametrize("arch", ARCHS)
def test_cached_decoding_equals_recomputing(checkpoints, arch, xp, device):
    """A ragged batch's prompt, then token by token with the cache: the logits of
    recomputing each whole sequence (float64, to 1e-10)."""
    model = _load(checkpoints[arch], xp, device, "float64")
    prompts = _prompts(2)
    ids, lengths = _padded(prompts)
    cache = model.new_cache(len(prompts), ids.shape[1] + 4)
    steps = [to_numpy(model(ids, cache, lengths=lengths))]
    rng = np.random.default_rng(3)
    added = rng.integers(3, VOCAB, (len(prompts), 4))
    for j in range(4):
        steps.append(to_numpy(model(added[:, j:j + 1], cache)))        # (B, 1, V)
    assert to_numpy(cache.lengths).tolist() == [n + 4 for n in lengths]
    for row, p in enumerate(prompts):
        whole = to_numpy(model([p + added[row].tolist()]))[0]          # (T + 4, V)
        cached = np.concatenate([steps[0][row, :lengths[row]]] + [s[row] for s in steps[1:]])
        assert _relative(cached, whole) <= 1e-10, (arch, row)


@pytest.mark.parametrize("arch", ["qwen3", "gemma2", "gemma3", "gpt_oss"])
def test_past_the_sliding_window(checkpoints, arch, xp, device):
    """150 tokens (gpt-oss: past its 128-token band): the prompt's logits, then 6 steps
    decoded with the cache (bottom-right alignment), against transformers on the whole."""
    model = _load(checkpoints[arch], xp, device, "float32")
    seq = _prompts(4, (150,))[0]
    cache = model.new_cache(1, len(seq))
    head = to_numpy(model([seq[:-6]], cache))[0]
    tail = [to_numpy(model([[tok]], cache))[0] for tok in seq[-6:]]
    ours = np.concatenate([head, *tail])
    ref = _reference(checkpoints[arch], model, "float32", [seq])[0]
    assert _relative(ours, ref) <= TOLERANCE["float32"]
    assert _relative(ours[-6:], ref[-6:]) <= TOLERANCE["float32"]


def test_layers_are_described_as_transformers_builds_them(checkpoints):
    """Each layer's window and rotary embedding, as the configuration says."""
    spec = {arch: from_pretrained(checkpoints[arch]).config for arch in ARCHS}
    assert [s.window for s in spec["llama"].layers] == [None, None]
    assert [s.window for s in spec["qwen3"].layers] == [None, 7, 7]
    assert [s.window for s in spec["gemma2"].layers] == [7, None]
    assert [(s.window, s.rope) for s in spec["gemma3"].layers] == [
        (7, "sliding_attention"), (7, "sliding_attention"), (None, "full_attention")]
    assert [s.window for s in spec["gpt_oss"].layers] == [127, None]
    assert spec["gemma2"].attn_softcap == 5.0 and spec["gemma2"].final_softcap == 3.0
    assert spec["gemma2"].attn_scale == 24 ** -0.5 and spec["gemma2"].embed_scale == 8.0
    assert spec["gpt_oss"].num_experts == 4 and spec["gpt_oss"].experts_per_token == 2


def test_multimodal_gemma3_checkpoint_runs_its_text_model(tmp_path):
    """A ``gemma3`` checkpoint (vision tower, projector and language model): its text model,
    from ``text_config`` and the ``language_model.`` tensors."""
    from transformers import (
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        Gemma3TextConfig,
        SiglipVisionConfig,
    )

    text = Gemma3TextConfig(**{**COMMON, "vocab_size": 300}, num_hidden_layers=2,
                            sliding_window=8, query_pre_attn_scalar=24,
                            layer_types=["sliding_attention", "full_attention"])
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=299, boi_token_index=297,
                          eoi_token_index=298)
    torch.manual_seed(5)
    hf = Gemma3ForConditionalGeneration(config).eval()
    _randomize(hf, 5)
    hf.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path)
    assert model.config.model_type == "gemma3"
    ids = np.random.default_rng(6).integers(3, 296, (1, 20))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(ids)).logits.numpy()
    assert _relative(model(ids), ref) <= TOLERANCE["float32"]


@pytest.mark.parametrize(("arch", "change", "windows"), [
    # transformers' Qwen3 attention slides only with use_sliding_window (its config then
    # sets sliding_window to None), whatever layer_types says
    ("qwen3", lambda c: c.update(use_sliding_window=False), [None, None, None]),
    # and its Llama reads no layer_types at all
    ("llama", lambda c: c.update(layer_types=["sliding_attention"] * 2, sliding_window=4),
     [None, None]),
    # Gemma 3 without layer_types: five sliding layers to one full one
    ("gemma3", lambda c: c.pop("layer_types"), [7, 7, 7]),
])
def test_layer_kinds_follow_transformers(checkpoints, tmp_path, arch, change, windows):
    folder = _edited(checkpoints, tmp_path, arch, change)
    assert [s.window for s in from_pretrained(folder).config.layers] == windows


# --------------------------------------------------------------------------
# Rotary scaling against transformers' formulas
# --------------------------------------------------------------------------

ROPES = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
     "truncate": False, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707,
     "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.5,
     "original_max_position_embeddings": 512},
]


@pytest.mark.parametrize("scaling", ROPES, ids=lambda s: "-".join(str(v) for v in s.values()))
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_frequencies_match_transformers(scaling, head_dim):
    """transformers' ROPE_INIT_FUNCTIONS (float32) and ours (float64) agree to float32."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    base = 500000.0
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4,
                         max_position_embeddings=131072,
                         rope_parameters={**scaling, "rope_theta": base})
    kind = scaling["rope_type"]
    if kind == "default":
        theirs = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
        their_factor = 1.0
    else:
        t, their_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        theirs = t.double().numpy()
    ours, factor = polyattn.rotary_frequencies(head_dim, base=base, scaling=scaling)
    np.testing.assert_allclose(ours, theirs, rtol=2e-6, atol=0)
    assert math.isclose(factor, their_factor, rel_tol=1e-12)


# --------------------------------------------------------------------------
# Files: bfloat16, shards, the tokenizer, the dtype
# --------------------------------------------------------------------------


def test_bfloat16_checkpoint_is_widened_exactly(checkpoints):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(checkpoints["bf16"], dtype=torch.bfloat16)
    model = from_pretrained(checkpoints["bf16"])
    assert model.dtype == np.float32                    # NumPy has no bfloat16
    embed = hf.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(model.params["embed"], embed)
    q = hf.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()
    np.testing.assert_array_equal(model.params["layers"][1]["w_qkv"][:, :64], q.T)
    on_torch = from_pretrained(checkpoints["bf16"], xp=torch)
    assert on_torch.dtype == torch.bfloat16
    assert torch.equal(on_torch.params["embed"], hf.model.embed_tokens.weight.detach())
    assert tuple(on_torch([[3, 4, 5]]).shape) == (1, 3, VOCAB)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2", "gemma3"])
def test_bfloat16_is_as_close_as_transformers_bfloat16(checkpoints, arch):
    """In bfloat16 (torch), polyattn's logits are as close to float32 transformers as
    transformers' own bfloat16 ones (norms in float32, Gemma's ``1 + w`` in float32).

    Not gpt-oss: its router's top-k choice flips for some tokens in bfloat16 (both
    libraries' errors are about 0.1 there), so the comparison measures which flip.
    """
    prompt = _prompts(7, (24,))[0]
    ref = _reference(checkpoints[arch], None, "float32", [prompt])[0]
    theirs = _reference(checkpoints[arch], None, "bfloat16", [prompt])[0]
    model = from_pretrained(checkpoints[arch], xp=torch, dtype=torch.bfloat16)
    ours = model([prompt]).double().numpy()[0]
    assert _relative(ours, ref) <= 1.25 * _relative(theirs, ref) + 1e-3


def test_sharded_checkpoint_equals_one_file(checkpoints):
    assert (checkpoints["sharded"] / "model.safetensors.index.json").is_file()
    assert len(list(checkpoints["sharded"].glob("*.safetensors"))) > 1
    ids = _padded(_prompts())[0]
    np.testing.assert_array_equal(from_pretrained(checkpoints["sharded"])(ids),
                                  from_pretrained(checkpoints["llama"])(ids))


def test_reader_agrees_with_safetensors(checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    from polyattn.models._safetensors import Checkpoint

    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float16),
               "b": rng.standard_normal((2,)), "c": np.arange(6, dtype=np.int32).reshape(2, 3)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    ours = Checkpoint(tmp_path)
    for name, a in load_file(str(tmp_path / "model.safetensors")).items():
        assert ours[name].dtype == a.dtype
        np.testing.assert_array_equal(ours[name], a)
    llama = Checkpoint(checkpoints["llama"])
    theirs = load_file(str(checkpoints["llama"] / "model.safetensors"))
    assert set(llama) == set(theirs)
    np.testing.assert_array_equal(llama["lm_head.weight"], theirs["lm_head.weight"])


def test_damaged_safetensors_files_are_named(checkpoints, tmp_path):
    import shutil

    folder = tmp_path / "damaged"
    shutil.copytree(checkpoints["llama"], folder)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[:-100])                                       # truncated
    with pytest.raises(ValueError, match=r"model\.safetensors: tensor .* beyond the file's "
                                         r"\d+ bytes of data: the file is truncated"):
        from_pretrained(folder)
    file.write_bytes(b"\xff" * 64)                                      # not one at all
    with pytest.raises(ValueError, match=r"model\.safetensors: not a safetensors file"):
        from_pretrained(folder)
    file.unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ValueError, match=r"lists model-00001-of-00002\.safetensors, which is "
                                         r"not in"):
        from_pretrained(folder)


def test_tokenizer_and_special_ids(checkpoints):
    model = from_pretrained(checkpoints["gemma2"])
    tok = model.tokenizer
    assert tok.encode("w5 w17 w100") == [5, 17, 100]
    assert tok.decode([5, 17, 100]) == "w5 w17 w100"
    assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (2, (1,), 0)
    out = model.generate(tok.encode("w5 w6 w7"), 3, stop_at_eos=False)
    assert len(out) == 3


def test_checkpoint_without_tokenizer_generates_from_ids(checkpoints, tmp_path):
    import shutil

    folder = tmp_path / "no-tokenizer"
    shutil.copytree(checkpoints["qwen3"], folder)
    (folder / "tokenizer.json").unlink()
    model = from_pretrained(folder)
    assert len(model.generate([3, 4, 5], 2, stop_at_eos=False)) == 2
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json.*token ids"):
        model.tokenizer.encode("w3")


def test_dtype_default_and_cast(checkpoints):
    assert from_pretrained(checkpoints["llama"]).dtype == np.float32
    assert from_pretrained(checkpoints["llama"], dtype="float64").dtype == np.float64
    model = from_pretrained(checkpoints["llama"], xp=torch, dtype=torch.float64)
    assert model.params["embed"].dtype == torch.float64


def _float64_checkpoint(checkpoints, tmp_path):
    """The Llama checkpoint with its weights stored in float64 (config.json says so too)."""
    import shutil

    from safetensors.numpy import load_file, save_file

    folder = tmp_path / "f64"
    shutil.copytree(checkpoints["llama"], folder)
    file = folder / "model.safetensors"
    save_file({k: v.astype(np.float64) for k, v in load_file(str(file)).items()}, str(file),
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "float64"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_jax_float64_however_it_is_asked_for(checkpoints, tmp_path):
    """A dtype object, a module for ``xp`` or a float64 checkpoint: 64-bit mode is switched
    on as for ``xp="jax", dtype="float64"``, never a silent float32."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    f64 = _float64_checkpoint(checkpoints, tmp_path)
    calls = [lambda: from_pretrained(checkpoints["llama"], xp="jax", dtype=jnp.float64),
             lambda: from_pretrained(checkpoints["llama"], xp=jnp, dtype="float64"),
             lambda: from_pretrained(checkpoints["llama"], xp=jnp, dtype=np.float64),
             lambda: from_pretrained(f64, xp=jnp)]
    before = jax.config.jax_enable_x64
    try:
        for k, call in enumerate(calls):
            jax.config.update("jax_enable_x64", False)
            model = call()
            assert model.dtype == jnp.float64, k
            assert model.params["embed"].dtype == jnp.float64, k
            assert to_numpy(model([[5, 6, 7]])).dtype == np.float64, k
    finally:
        jax.config.update("jax_enable_x64", before)


def test_dtype_given_by_numpy_or_another_library(checkpoints):
    """NumPy dtypes name one dtype and are taken by name anywhere; another library's dtype
    and Python's float are refused with the module's TypeError."""
    folder = checkpoints["llama"]
    assert from_pretrained(folder, xp="torch", dtype=np.float32).dtype == torch.float32
    assert from_pretrained(folder, xp=torch, dtype=np.dtype("float64")).dtype == torch.float64
    assert from_pretrained(folder, dtype=np.dtype("float64")).dtype == np.float64
    with pytest.raises(TypeError, match=r"`dtype` must be a real floating dtype of numpy .*"
                                        r"got torch\.float64, a torch dtype"):
        from_pretrained(folder, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"`dtype` must be a real floating dtype; got Python's "
                                        r"float"):
        from_pretrained(folder, dtype=float)
    with pytest.raises(TypeError, match=r"`dtype` must be a real floating dtype: one of "
                                        r"float16, bfloat16, float32, float64 for torch; got "
                                        r"'int32'"):
        from_pretrained(folder, xp="torch", dtype="int32")
    with pytest.raises(TypeError, match=r"real floating dtype.*got torch\.int64"):
        from_pretrained(folder, xp=torch, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"`dtype` must be one of float16, float32, float64 "
                                         r"for numpy; got 'bfloat16'"):
        from_pretrained(folder, dtype="bfloat16")


def test_jax_device_by_name_and_a_library_not_installed(checkpoints):
    folder = checkpoints["llama"]
    if importlib.util.find_spec("jax") is not None:
        import jax

        model = from_pretrained(folder, xp="jax", device="cpu")
        assert model.params["embed"].devices() == {jax.devices("cpu")[0]}
        with pytest.raises(ValueError, match=r"`device` 'cpu:99' is not a JAX device here; "
                                             r"JAX has cpu:0"):
            from_pretrained(folder, xp="jax", device="cpu:99")
    if importlib.util.find_spec("cupy") is None:
        with pytest.raises(ModuleNotFoundError, match=r"`xp` 'cupy' needs cupy, which cannot "
                                                      r"be imported .*install it with pip "
                                                      r"install 'polyattn\[cuda\]'"):
            from_pretrained(folder, xp="cupy")


def test_home_folder_is_expanded(checkpoints, monkeypatch):
    monkeypatch.setenv("HOME", str(checkpoints["llama"].parent))
    model = from_pretrained("~/llama")
    assert model.path == checkpoints["llama"]


def test_special_tokens_and_decoding_checks(checkpoints):
    """<pad>, <eos> and <bos> are special in tokenizer.json; ids are checked as SmolLM2's
    tokenizer checks them."""
    tok = from_pretrained(checkpoints["llama"]).tokenizer
    assert [tok.is_special(i) for i in (0, 1, 2, 3, 100)] == [True, True, True, False, False]
    assert tok.decode([2, 5, 1]) == "<bos> w5 <eos>"
    assert tok.decode([2, 5, 1], skip_special_tokens=True) == "w5"
    with pytest.raises(ValueError, match=r"`token_ids` must lie in \[0, 128\) \(the "
                                         r"vocabulary\); got -1"):
        tok.decode([-1])
    with pytest.raises(ValueError, match=r"must lie in \[0, 128\).*got 128"):
        tok.decode([5, 128])
    with pytest.raises(TypeError, match=r"`token_ids` must hold ints; got float 1\.5 at "
                                        r"index 0"):
        tok.decode([1.5])
    with pytest.raises(ValueError, match=r"`token_id` must lie in \[0, 128\)"):
        tok.is_special(-1)


def test_padding_may_be_any_integer(checkpoints, xp, device):
    """Only the first lengths[b] ids of each row are checked; the padding (-1 here, or past
    the vocabulary) never reaches the embedding, and the caller's array is left as it was."""
    model = _load(checkpoints["llama"], xp, device, "float64")
    for padded in (np.array([[5, 6, 7], [8, -1, -1]]), [[5, 6, 7], [8, 999, 999]],
                   xp.asarray(np.array([[5, 6, 7], [8, -1, -1]]), device=device)):
        kept = to_numpy(padded).copy() if not isinstance(padded, list) else None
        logits = to_numpy(model(padded, lengths=[3, 1]))
        np.testing.assert_allclose(logits[0], to_numpy(model([5, 6, 7])), rtol=1e-12,
                                   atol=1e-12)
        np.testing.assert_allclose(logits[1, 0], to_numpy(model([8]))[0], rtol=1e-12,
                                   atol=1e-12)
        if kept is not None:
            np.testing.assert_array_equal(to_numpy(padded), kept)
    with pytest.raises(ValueError, match=r"`token_ids` must lie in \[0, 128\).*got -1"):
        model(np.array([[5, 6, 7], [8, -1, -1]]), lengths=[3, 2])
    with pytest.raises(ValueError, match=r"`token_ids` must lie in \[0, 128\).*got -1"):
        model(np.array([[5, 6, 7], [8, -1, -1]]))


def test_token_ids_of_any_library_and_integer_dtype(checkpoints, xp, device):
    """Ids of another library are read on the host (as generate() reads them); integer
    dtypes other than the model's index dtype (uint8) are converted."""
    model = _load(checkpoints["llama"], xp, device, "float64")
    want = to_numpy(model([[5, 6, 7]]))
    for ids in (torch.tensor([[5, 6, 7]]), torch.tensor([[5, 6, 7]], dtype=torch.uint8),
                np.array([[5, 6, 7]], dtype=np.uint8), np.array([[5, 6, 7]], dtype=np.int16),
                xp.asarray(np.array([[5, 6, 7]], dtype=np.uint8), device=device)):
        np.testing.assert_array_equal(to_numpy(model(ids)), want)
    assert model.generate(torch.tensor([5, 6, 7]), 2, stop_at_eos=False) == \
        model.generate([5, 6, 7], 2, stop_at_eos=False)
    with pytest.raises(TypeError, match=r"`token_ids` must be integers; got dtype"):
        model(torch.tensor([[5.0, 6.0]]))


def test_overlapping_tensors_and_inconsistent_headers_are_named(checkpoints, tmp_path):
    """Two tensors sharing bytes are refused (as the safetensors library refuses them); a
    shape that disagrees with its offsets is told apart from a truncated file."""
    import shutil

    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    folder = tmp_path / "overlap"
    shutil.copytree(checkpoints["llama"], folder)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])

    def write(edited):
        head = json.dumps(edited).encode()
        head += b" " * (-len(head) % 8)
        file.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n:])

    edited = json.loads(json.dumps(header))
    start = edited["lm_head.weight"]["data_offsets"][0]
    size = 4 * int(np.prod(edited["model.norm.weight"]["shape"]))
    edited["model.norm.weight"]["data_offsets"] = [start + 4, start + 4 + size]
    write(edited)
    with pytest.raises(SafetensorError):
        load_file(str(file))
    with pytest.raises(ValueError, match=r"model\.safetensors: tensors 'lm_head\.weight' and "
                                         r"'model\.norm\.weight' overlap"):
        from_pretrained(folder)
    edited = json.loads(json.dumps(header))
    edited["model.norm.weight"]["shape"] = [3]
    write(edited)
    with pytest.raises(ValueError, match=r"tensor 'model\.norm\.weight' \(F32 \[3\]\) has "
                                         r"bytes \[\d+, \d+\), 256 bytes, but its dtype and "
                                         r"shape take 12: the header is inconsistent"):
        from_pretrained(folder)


# --------------------------------------------------------------------------
# Errors: one each, naming the file, the field and its value
# --------------------------------------------------------------------------


def _edited(checkpoints, tmp_path, arch, change):
    import shutil

    folder = tmp_path / f"{arch}-edited"
    shutil.copytree(checkpoints[arch], folder)
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(("arch", "change", "pattern"), [
    ("llama", lambda c: c.update(model_type="mistral"),
     r"config.json: `model_type` 'mistral' is not supported; supported: gemma2, gemma3, "
     r"gemma3_text, gpt_oss, llama, qwen3"),
    ("llama", lambda c: c["rope_parameters"].update(rope_type="dynamic"),
     r"config.json: `rope_parameters` .* is not supported: `rope_parameters` has rope_type "
     r"'dynamic', which is not implemented"),
    ("llama", lambda c: c.update(rope_scaling=c.pop("rope_parameters") | {"rope_type": "dynamic"}),
     r"config.json: `rope_scaling` .* is not supported: `rope_scaling` has rope_type "
     r"'dynamic'"),
    ("llama", lambda c: c.pop("model_type"),
     r"config.json: has no `model_type`, which names the architecture; supported: gemma2, "),
    ("llama", lambda c: c.update(hidden_act="gelu"),
     r"config.json: `hidden_act` 'gelu' is not supported"),
    ("gpt_oss", lambda c: c.update(quantization_config={"quant_method": "mxfp4"}),
     r"config.json: `quantization_config` \(quant_method 'mxfp4'\) is not supported"),
    ("qwen3", lambda c: c.update(num_key_value_heads=3),
     r"`num_key_value_heads` \(3\) must divide `num_attention_heads` \(4\)"),
    ("gemma3", lambda c: c.update(layer_types=["sliding_attention", "chunked_attention",
                                                "full_attention"]),
     r"`layer_types` has 'chunked_attention', which is not supported"),
    ("llama", lambda c: c.update(num_hidden_layers=1),
     r"the tensors `model.layers.1.input_layernorm.weight`.* are not read"),
    ("llama", lambda c: c.update(intermediate_size=95),
     r"the tensor `model.layers.0.mlp.gate_proj.weight` has shape \[96, 64\]; expected "
     r"\[95, 64\]"),
    ("gemma2", lambda c: c.update(use_bidirectional_attention=True),
     r"`use_bidirectional_attention` is true, which is not supported"),
])
def test_unsupported_configuration_is_one_clear_error(checkpoints, tmp_path, arch, change,
                                                      pattern):
    folder = _edited(checkpoints, tmp_path, arch, change)
    with pytest.raises(ValueError, match=pattern):
        from_pretrained(folder)


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match=r"`hidden_size` is missing"):
        from_pretrained(tmp_path)


# --------------------------------------------------------------------------
# python -m polyattn generate --model PATH
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_command_line_generates_from_a_checkpoint(checkpoints, capsys, backend):
    from polyattn import cli

    folder = checkpoints["gemma3"]
    assert cli.main(["generate", "w5 w6 w7", "--model", str(folder), "--max-new-tokens", "5",
                     "--backend", backend]) == 0
    out, err = capsys.readouterr()
    model = from_pretrained(folder)
    ids = model.tokenizer.encode("w5 w6 w7")
    new = model.generate(ids, 5)
    whole = model.tokenizer.decode(ids + new, skip_special_tokens=True)   # "w5 w6 w7 w… …"
    assert out == whole + "\n" and whole.startswith("w5 w6 w7 ")
    assert f"{len(new)} token" in err and f"({backend}, float32;" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "/nowhere/at/all"], "--model /nowhere/at/all: not a folder"),
    (["--chat"], "--chat puts the prompt in SmolLM2's chat template"),
])
def test_command_line_refuses_a_bad_model_in_one_line(checkpoints, capsys, argv, message):
    from polyattn import cli

    if "--chat" in argv:
        argv = [*argv, "--model", str(checkpoints["llama"])]
    assert cli.main(["generate", "w5", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert message in err


def test_command_line_names_an_unsupported_checkpoint(checkpoints, capsys, tmp_path):
    from polyattn import cli

    folder = _edited(checkpoints, tmp_path, "llama", lambda c: c.update(model_type="mistral"))
    assert cli.main(["generate", "w5", "--model", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "`model_type` 'mistral' is not supported" in err and len(err.splitlines()) == 1
