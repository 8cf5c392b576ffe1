"""window, softcap, alibi_slopes and key_lengths on every backend and implementation.

Three kinds of check (DESIGN §3.1, §4.1):

* against the float64 oracle :func:`helpers.ref_attention`, which applies §4.1
  element by element: each keyword alone and with the others, with boolean
  and float masks, GQA, both causal alignments with Tq < Tk, Tq = Tk and
  Tq > Tk, the log-sum-exp, ``layout="BTHE"``;
* against ``torch.nn.functional.scaled_dot_product_attention`` given the
  dense mask and bias that FlashAttention's ``flash_attn_func`` docstring
  describes (where torch is installed);
* properties that need no oracle: a window wider than the keys is no window,
  a huge softcap is none, full key lengths are none, zero slopes are no ALiBi,
  parts over disjoint key sets merge into the whole (that keys past the lengths
  are never read is ``test_rules.py::test_keys_past_key_lengths_are_never_read``).

Implementations are the case ids of :data:`_support.CASES` (``numba_cpu`` on NumPy,
``distributed`` on Dask, ``numba_cuda-rows`` on the simulator or a GPU), so that
``-k numba_cpu``, ``-k distributed`` or ``-k numba_cuda`` picks one.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from _support import CASES, CPU_IMPLEMENTATIONS, rounded, use_implementation
from helpers import (
    NATIVE_BACKENDS,
    Backend,
    assert_close,
    assert_lse_close,
    assert_namespace_device,
    ref_attention,
    to_numpy,
    to_xp,
)

import polyattn
from polyattn.backends.array_api import blocked as chunked

sdpa = polyattn.scaled_dot_product_attention


def prepared(name, backend, monkeypatch):
    """``name`` made ready by :func:`use_implementation` (small blocks, native fallbacks).

    Dask builds a task per block operation, so there (as on JAX) the blocks
    hold these small problems whole; block boundaries are exercised on the
    other backends, and on Dask by :func:`test_dask_stays_lazy`.
    """
    name = use_implementation(name, backend, monkeypatch)
    if backend is Backend.DASK:
        monkeypatch.setattr(chunked, "BLOCK_Q", 16)
        monkeypatch.setattr(chunked, "BLOCK_K", 16)
    return name


@pytest.fixture(params=[n for n in CASES if n != "auto"])
def implementation(request, backend, monkeypatch):
    """Each implementation by name; "auto", which picks among them, runs in
    :func:`test_features_and_combinations` and :func:`test_explain_native_refuses_softcap`."""
    return prepared(request.param, backend, monkeypatch)


@pytest.fixture(params=CASES)
def implementation_or_auto(request, backend, monkeypatch):
    """Each implementation, and "auto"."""
    return prepared(request.param, backend, monkeypatch)


# --------------------------------------------------------------------------- #
# Inputs, options and the comparison with the oracle
# --------------------------------------------------------------------------- #

FEATURES = ("window", "softcap", "alibi", "key_lengths")
#: Each keyword alone, every pair, and all four.
COMBOS = [c for r in (1, 2, 4) for c in itertools.combinations(FEATURES, r)]
ALIGNMENTS = ("top_left", "bottom_right")
#: Tq < Tk, Tq = Tk, Tq > Tk.
LENGTHS = [(5, 9), (7, 7), (9, 5)]


def inputs(rng, *, tq, tk, batch=2, h=4, hkv=2, e=4, ev=4):
    """query (batch, h, tq, e), key (batch, hkv, tk, e), value (batch, hkv, tk, ev)."""
    return (rng.standard_normal((batch, h, tq, e)), rng.standard_normal((batch, hkv, tk, e)),
            rng.standard_normal((batch, hkv, tk, ev)))


def feature_options(names, rng, *, batch, h, tk):
    """NumPy-side keyword arguments turning on the features ``names``.

    The window is narrow on both sides, the softcap small enough to bend the
    scores, the slopes differ per batch row and head, and the second batch
    row has 4 keys fewer than the first.
    """
    options = {}
    if "window" in names:
        options["window"] = (2, 1)
    if "softcap" in names:
        options["softcap"] = 1.5
    if "alibi" in names:
        options["alibi_slopes"] = rng.uniform(0.1, 1.0, (batch, h))
    if "key_lengths" in names:
        options["key_lengths"] = np.array([tk, tk - 4][:batch], dtype=np.int32)
    return options


def on_backend(options, xp, device, dtype_name):
    """``options`` with their NumPy arrays in ``xp``: slopes and float masks in ``dtype_name``."""
    moved = {}
    for name, value in options.items():
        if not isinstance(value, np.ndarray):
            moved[name] = value
        elif value.dtype.kind == "f":
            moved[name] = to_xp(value, xp, dtype=dtype_name, device=device)
        else:                                              # key lengths, boolean masks
            moved[name] = to_xp(value, xp, device=device)
    return moved


def oracle(q, k, v, dtype_name, *, attn_mask=None, causal_alignment="top_left", **options):
    """:func:`ref_attention` of the values the library sees (inputs rounded to ``dtype_name``)."""
    q, k, v = (rounded(a, dtype_name) for a in (q, k, v))
    if attn_mask is not None and attn_mask.dtype != bool:
        attn_mask = rounded(attn_mask, dtype_name)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = rounded(options["alibi_slopes"], dtype_name)
    return ref_attention(q, k, v, mask=attn_mask, alignment=causal_alignment, **options)


def bthe(a):
    """(B, H, T, F) -> (B, T, H, F), row-major."""
    return np.ascontiguousarray(np.swapaxes(a, 1, 2))


def compare(xp, device, dtype_name, implementation, q, k, v, *, layout="BHTE", **options):
    """Run polyattn on ``xp`` arrays made from NumPy ones and check it against the oracle.

    out always, lse too except for ``"native"`` (which never returns it, and
    would fall back). Returns the NumPy out and lse (``None`` without it).
    """
    with_lse = implementation != "native"
    args = [to_xp(bthe(a) if layout == "BTHE" else a, xp, dtype=dtype_name, device=device)
            for a in (q, k, v)]
    result = sdpa(*args, return_lse=with_lse, implementation=implementation, layout=layout,
                  **on_backend(options, xp, device, dtype_name))
    out, lse = result if with_lse else (result, None)
    ref, ref_lse, _ = oracle(q, k, v, dtype_name, **options)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert_close(out, bthe(ref) if layout == "BTHE" else ref, dtype_name)
    if with_lse:
        assert_lse_close(lse, ref_lse, dtype_name)
    return to_numpy(out), None if lse is None else to_numpy(lse)


def random_mask(rng, kind, shape):
    """A boolean mask (True = attend) or a float one with some ``-inf`` entries."""
    if kind == "bool":
        return rng.random(shape) < 0.75
    mask = rng.standard_normal(shape)
    return np.where(rng.random(shape) < 0.15, -np.inf, mask)


# --------------------------------------------------------------------------- #
# Against the oracle
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize(("dtype_name", "mask_kind", "is_causal"),
                         [("float32", "bool", False), ("float64", "float", True)],
                         ids=["float32-bool_mask", "float64-float_mask_causal"])
@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
def test_features_and_combinations(xp, device, dtype_name, implementation_or_auto, combo,
                                   mask_kind, is_causal):
    """Each keyword alone and with the others, over a mask, with GQA (H 4, Hkv 2).

    Each combination runs once in float32 over a boolean mask and once in
    float64 over a float mask (with ``-inf`` entries) and causal masking.
    """
    rng = np.random.default_rng(1)
    q, k, v = inputs(rng, tq=6, tk=9)
    options = feature_options(combo, rng, batch=2, h=4, tk=9)
    mask = random_mask(rng, mask_kind, (2, 1, 6, 9) if mask_kind == "bool" else (4, 6, 9))
    compare(xp, device, dtype_name, implementation_or_auto, q, k, v, attn_mask=mask,
            enable_gqa=True, is_causal=is_causal, causal_alignment="bottom_right", **options)


@pytest.mark.parametrize(("dtype_name", "is_causal"), [("float32", True), ("float64", False)],
                         ids=["float32-causal", "float64-not_causal"])
@pytest.mark.parametrize("alignment", ALIGNMENTS)
@pytest.mark.parametrize(("tq", "tk"), LENGTHS, ids=["tq<tk", "tq=tk", "tq>tk"])
def test_positions_follow_the_alignment(xp, device, dtype_name, implementation, alignment, tq,
                                        tk, is_causal):
    """Window, ALiBi and key lengths share one position p_i per alignment, whatever Tq and Tk.

    The second row is shorter than the queries when Tq > Tk, so with
    bottom-right alignment its first queries sit before key 0 and see nothing.
    """
    rng = np.random.default_rng(2)
    q, k, v = inputs(rng, tq=tq, tk=tk)
    slopes = rng.uniform(0.1, 1.0, 4)                     # (H,): one slope per head
    lengths = np.array([tk, tk - 3], dtype=np.int64)
    compare(xp, device, dtype_name, implementation, q, k, v, enable_gqa=True,
            is_causal=is_causal, causal_alignment=alignment, window=(3, 2),
            alibi_slopes=slopes, key_lengths=lengths)


@pytest.mark.parametrize(("window", "alignment", "dtype_name"), [
    ((None, 0), "bottom_right", "float32"), ((0, None), "top_left", "float64"),
    ((1, None), "bottom_right", "float64"), ((None, 2), "top_left", "float32"),
    ((0, 0), "bottom_right", "float32")], ids=str)
def test_window_sides(xp, device, dtype_name, implementation, window, alignment):
    """A ``None`` side is unbounded; (0, 0) sees only the key at p_i."""
    rng = np.random.default_rng(3)
    q, k, v = inputs(rng, tq=6, tk=9)
    compare(xp, device, dtype_name, implementation, q, k, v, window=window,
            causal_alignment=alignment, enable_gqa=True)


def test_layout_bthe(xp, device, dtype_name, implementation):
    """(B, T, H, E) arrays with every keyword, a boolean mask and GQA: out (B, Tq, H, Ev)."""
    rng = np.random.default_rng(4)
    q, k, v = inputs(rng, tq=6, tk=9)
    options = feature_options(FEATURES, rng, batch=2, h=4, tk=9)
    mask = random_mask(rng, "bool", (2, 4, 6, 9))
    out, _ = compare(xp, device, dtype_name, implementation, q, k, v, layout="BTHE",
                     attn_mask=mask, enable_gqa=True, is_causal=True,
                     causal_alignment="bottom_right", **options)
    assert out.shape == (2, 6, 4, 4)


@pytest.mark.parametrize(("dtype_name", "layout"), [("float32", "BHTE"), ("float64", "BTHE")],
                         ids=["float32-BHTE", "float64-BTHE"])
@pytest.mark.parametrize("combo", COMBOS, ids="+".join)
def test_attention_weights(xp, device, dtype_name, combo, layout):
    """The weights follow the same rules; rows sum to 1, or to 0 where no key is visible."""
    rng = np.random.default_rng(5)
    q, k, _ = inputs(rng, tq=6, tk=9)
    options = feature_options(combo, rng, batch=2, h=4, tk=9)
    mask = random_mask(rng, "float", (6, 9))
    args = [to_xp(bthe(a) if layout == "BTHE" else a, xp, dtype=dtype_name, device=device)
            for a in (q, k)]
    w = polyattn.attention_weights(*args, attn_mask=to_xp(mask, xp, dtype=dtype_name,
                                                          device=device),
                                   enable_gqa=True, is_causal=True,
                                   causal_alignment="bottom_right", layout=layout,
                                   **on_backend(options, xp, device, dtype_name))
    _, _, ref = oracle(q, k, k, dtype_name, attn_mask=mask, enable_gqa=True, is_causal=True,
                       causal_alignment="bottom_right", **options)
    assert_namespace_device(w, xp, device, getattr(xp, dtype_name))
    assert_close(w, ref, dtype_name, what="weights")
    sums = to_numpy(w).sum(-1)
    np.testing.assert_allclose(sums, np.where(ref.sum(-1) > 0.5, 1.0, 0.0), atol=1e-5)


# --------------------------------------------------------------------------- #
# Against torch SDPA with FlashAttention's documented rules
# --------------------------------------------------------------------------- #

def flash_rules_attention(q, k, v, *, window=None, alibi_slopes=None, softcap=None,
                          key_lengths=None, causal=False):
    """torch attention with the rules of FlashAttention's ``flash_attn_func`` docstring.

    (B, H, Tq, E) float64 NumPy in, NumPy out; GQA by ``enable_gqa``. With
    ``window=(left, right)`` query i attends keys in
    ``[i + Tk - Tq - left, i + Tk - Tq + right]``; ``causal`` is
    ``j <= i + Tk - Tq``; ALiBi adds ``-slope · |i + Tk - Tq - j|``; softcap
    applies ``softcap · tanh(s / softcap)`` before masking. Key lengths
    (``flash_attn_with_kvcache``'s ``cache_seqlens``) replace Tk by each row's
    length. Without softcap the mask and bias go to torch's SDPA as one dense
    float mask; soft-capping is not additive, so with it the scores are
    computed explicitly in torch.
    """
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F

    tq, e = q.shape[-2:]
    tk = k.shape[-2]
    batch = q.shape[0]
    tq_, tk_, tv_ = (torch.from_numpy(a) for a in (q, k, v))
    lengths = torch.as_tensor(np.broadcast_to(tk if key_lengths is None else key_lengths,
                                              (batch,)).copy())
    length = lengths.reshape(batch, 1, 1, 1)                    # (B, 1, 1, 1)
    i = torch.arange(tq).reshape(tq, 1)                         # (Tq, 1)
    j = torch.arange(tk).reshape(1, tk)                         # (1, Tk)
    diagonal = i + length - tq                                  # (B, 1, Tq, 1): key under query i
    allowed = j < length                                        # (B, 1, 1, Tk)
    if window is not None:
        left, right = window
        if left is not None:
            allowed = allowed & (j >= diagonal - left)
        if right is not None:
            allowed = allowed & (j <= diagonal + right)
    if causal:
        allowed = allowed & (j <= diagonal)
    bias = torch.zeros((), dtype=torch.float64)
    if alibi_slopes is not None:
        slopes = torch.from_numpy(np.asarray(alibi_slopes, dtype=np.float64))
        slopes = slopes.reshape(*slopes.shape, 1, 1)            # (…, H, 1, 1)
        bias = -slopes * (diagonal - j).abs()                    # (B, H, Tq, Tk)
    allowed = allowed.expand(batch, 1, tq, tk)
    if softcap is None:
        mask = torch.where(allowed, bias, -torch.inf)
        return F.scaled_dot_product_attention(tq_, tk_, tv_, attn_mask=mask,
                                              enable_gqa=True).numpy()
    g = q.shape[1] // k.shape[1]
    tk_, tv_ = tk_.repeat_interleave(g, dim=1), tv_.repeat_interleave(g, dim=1)
    s = tq_ @ tk_.transpose(-1, -2) / e ** 0.5
    s = softcap * torch.tanh(s / softcap) + bias
    s = s.masked_fill(~allowed, -torch.inf)
    weights = torch.softmax(s, dim=-1).nan_to_num(0.0)         # fully masked rows: 0
    return (weights @ tv_).numpy()


TORCH_CASES = {
    "window": {"window": (2, 1)},
    "causal_window": {"window": (3, 0), "causal": True},
    "left_unbounded+alibi": {"window": (None, 1), "alibi": True},
    "alibi_causal": {"alibi": True, "causal": True},
    "softcap+window": {"softcap": 2.0, "window": (1, 2)},
    "lengths+window+alibi": {"key_lengths": True, "window": (2, 0), "alibi": True,
                             "causal": True},
    "all": {"key_lengths": True, "window": (2, 1), "alibi": True, "softcap": 1.5},
}


@pytest.mark.parametrize(("tq", "tk"), [(4, 9), (9, 6)], ids=["tq<tk", "tq>tk"])
@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_against_torch_with_flash_attention_rules(xp, device, implementation, case, tq, tk):
    pytest.importorskip("torch")
    spec = TORCH_CASES[case]
    rng = np.random.default_rng(6)
    q, k, v = inputs(rng, tq=tq, tk=tk)
    slopes = rng.uniform(0.1, 1.0, (2, 4)) if spec.get("alibi") else None
    lengths = np.array([tk - 1, tk - 3]) if spec.get("key_lengths") else None
    expected = flash_rules_attention(q, k, v, window=spec.get("window"), alibi_slopes=slopes,
                                     softcap=spec.get("softcap"), key_lengths=lengths,
                                     causal=spec.get("causal", False))
    options = {"window": spec.get("window"), "softcap": spec.get("softcap"),
               "alibi_slopes": slopes, "key_lengths": lengths}
    options = on_backend({n: o for n, o in options.items() if o is not None}, xp, device,
                         "float64")
    out = sdpa(*(to_xp(a, xp, device=device) for a in (q, k, v)), enable_gqa=True,
               is_causal=spec.get("causal", False), causal_alignment="bottom_right",
               implementation=implementation, **options)
    assert_close(out, expected, "float64")


# --------------------------------------------------------------------------- #
# Properties
# --------------------------------------------------------------------------- #

def run(xp, device, dtype_name, implementation, q, k, v, **options):
    """(out, lse) as NumPy arrays (lse ``None`` for "native")."""
    with_lse = implementation != "native"
    result = sdpa(*(to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, v)),
                  return_lse=with_lse, implementation=implementation,
                  **on_backend(options, xp, device, dtype_name))
    out, lse = result if with_lse else (result, None)
    return to_numpy(out), None if lse is None else to_numpy(lse)


def assert_same(a, b, dtype_name):
    """Two runs' (out, lse) agree within the dtype's tolerance."""
    assert_close(a[0], b[0], dtype_name)
    if a[1] is not None:
        assert_lse_close(a[1], b[1], dtype_name)


@pytest.mark.parametrize(("window", "dtype_name"), [
    ((9, 9), "float32"), ((None, None), "float64"), ((12, None), "float64"),
    ((None, 9), "float32")], ids=str)
def test_window_as_wide_as_the_keys_is_no_window(xp, device, dtype_name, implementation,
                                                  window):
    rng = np.random.default_rng(7)
    q, k, v = inputs(rng, tq=6, tk=9)
    common = {"enable_gqa": True, "causal_alignment": "bottom_right"}
    wide = run(xp, device, dtype_name, implementation, q, k, v, window=window, **common)
    plain = run(xp, device, dtype_name, implementation, q, k, v, **common)
    assert_same(wide, plain, dtype_name)


@pytest.mark.parametrize("window", [(2**70, 0), (2**63, 2**64), (None, 2**100)])
def test_window_beyond_any_integer_is_no_window(xp, device, dtype_name, implementation,
                                                window):
    rng = np.random.default_rng(7)
    q, k, v = inputs(rng, tq=6, tk=9)
    common = {"enable_gqa": True, "causal_alignment": "bottom_right"}
    wide = run(xp, device, dtype_name, implementation, q, k, v, window=window, **common)
    plain = run(xp, device, dtype_name, implementation, q, k, v,
                window=tuple(w if w is None or w < 9 else 9 for w in window), **common)
    assert_same(wide, plain, dtype_name)


def test_huge_softcap_is_no_softcap(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(8)
    q, k, v = inputs(rng, tq=6, tk=9)
    capped = run(xp, device, dtype_name, implementation, q, k, v, softcap=1e8, is_causal=True,
                 enable_gqa=True)
    plain = run(xp, device, dtype_name, implementation, q, k, v, is_causal=True,
                enable_gqa=True)
    assert_same(capped, plain, dtype_name)


@pytest.mark.parametrize(("as_int", "alignment"), [(False, "top_left"), (True, "bottom_right")],
                         ids=["array-top_left", "int-bottom_right"])
def test_full_key_lengths_are_no_key_lengths(xp, device, dtype_name, implementation, as_int,
                                             alignment):
    rng = np.random.default_rng(9)
    q, k, v = inputs(rng, tq=6, tk=9)
    lengths = 9 if as_int else np.array([9, 9])
    common = {"enable_gqa": True, "is_causal": True, "causal_alignment": alignment,
              "window": (3, 0)}
    full = run(xp, device, dtype_name, implementation, q, k, v, key_lengths=lengths, **common)
    plain = run(xp, device, dtype_name, implementation, q, k, v, **common)
    assert_same(full, plain, dtype_name)


@pytest.mark.parametrize("alignment", ALIGNMENTS)
def test_zero_key_lengths_mask_whole_rows(xp, device, dtype_name, implementation, alignment):
    """A row with no keys gives out 0 and lse -inf, never NaN; the other row is unaffected."""
    rng = np.random.default_rng(10)
    q, k, v = inputs(rng, tq=6, tk=9)
    lengths = np.array([0, 7])
    out, lse = compare(xp, device, dtype_name, implementation, q, k, v, key_lengths=lengths,
                       enable_gqa=True, is_causal=True, causal_alignment=alignment,
                       window=(4, 0), alibi_slopes=rng.uniform(0.1, 1.0, 4))
    assert not np.isnan(out).any()
    assert np.all(out[0] == 0)
    if lse is not None:
        assert np.all(np.isneginf(lse[0])) and not np.isneginf(lse[1]).all()
    none = run(xp, device, dtype_name, implementation, q, k, v, key_lengths=0, enable_gqa=True)
    assert np.all(none[0] == 0)
    if none[1] is not None:
        assert np.all(np.isneginf(none[1]))


def test_zero_slopes_are_no_alibi(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(11)
    q, k, v = inputs(rng, tq=6, tk=9)
    common = {"enable_gqa": True, "is_causal": True, "causal_alignment": "bottom_right",
              "window": (4, 0)}
    zero = run(xp, device, dtype_name, implementation, q, k, v, alibi_slopes=np.zeros(4),
               **common)
    plain = run(xp, device, dtype_name, implementation, q, k, v, **common)
    assert_same(zero, plain, dtype_name)


@pytest.mark.parametrize("features", [("window", "key_lengths"), FEATURES],
                         ids=["window+key_lengths", "all_features"])
def test_parts_over_disjoint_key_sets_merge_into_the_whole(xp, device, dtype_name,
                                                           implementation, features):
    """Two calls, over the keys a boolean mask selects and the rest, merge into one call."""
    if implementation == "native":
        pytest.skip("native attention returns no lse to merge with")
    rng = np.random.default_rng(13)
    q, k, v = inputs(rng, tq=6, tk=9)
    options = feature_options(features, rng, batch=2, h=4, tk=9)
    common = {"enable_gqa": True, "is_causal": True, "causal_alignment": "bottom_right",
              **options}
    selected = rng.random((2, 4, 6, 9)) < 0.5
    parts = [run(xp, device, dtype_name, implementation, q, k, v, attn_mask=m, **common)
             for m in (selected, ~selected)]
    outs = [to_xp(p[0], xp, dtype=dtype_name, device=device) for p in parts]
    lses = [to_xp(p[1], xp, dtype=dtype_name, device=device) for p in parts]
    out, lse = polyattn.merge_attention(outs, lses)
    whole = run(xp, device, dtype_name, implementation, q, k, v, **common)
    assert_same((to_numpy(out), to_numpy(lse)), whole, dtype_name)
    ref, ref_lse, _ = oracle(q, k, v, dtype_name, **common)
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


# --------------------------------------------------------------------------- #
# JAX tracing, Dask laziness, explain()
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("name", [n for n in CPU_IMPLEMENTATIONS if n != "auto"])
def test_jax_jit_with_traced_key_lengths_and_slopes(name, dtype_name, monkeypatch):
    """Key lengths and slopes are traced arguments: new values reuse the compiled function."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    implementation = use_implementation(name, Backend.JAX, monkeypatch)
    rng = np.random.default_rng(14)
    q, k, v = inputs(rng, tq=5, tk=9)
    with_lse = implementation != "native"
    traces = []

    @jax.jit
    def f(q, k, v, lengths, slopes):
        traces.append(1)
        return sdpa(q, k, v, key_lengths=lengths, alibi_slopes=slopes, window=(3, 0),
                    softcap=4.0, is_causal=True, causal_alignment="bottom_right",
                    enable_gqa=True, return_lse=with_lse, implementation=implementation)

    args = [jnp.asarray(a, dtype=getattr(jnp, dtype_name)) for a in (q, k, v)]
    for lengths, slopes in (([9, 4], [0.5, 0.25, 0.125, 1.0]), ([2, 9], [1.0, 0.0, 0.3, 0.7])):
        result = f(*args, jnp.asarray(lengths, dtype=jnp.int32),
                   jnp.asarray(slopes, dtype=getattr(jnp, dtype_name)))
        out, lse = result if with_lse else (result, None)
        ref, ref_lse, _ = oracle(q, k, v, dtype_name, key_lengths=np.array(lengths),
                                 alibi_slopes=np.array(slopes), window=(3, 0), softcap=4.0,
                                 is_causal=True, causal_alignment="bottom_right",
                                 enable_gqa=True)
        assert_close(out, ref, dtype_name)
        if with_lse:
            assert_lse_close(lse, ref_lse, dtype_name)
    assert len(traces) == 1, "new key lengths or slopes retraced the function"


@pytest.mark.parametrize("name", [*CPU_IMPLEMENTATIONS,
                                  *(n for n in CASES if n == "distributed")])
def test_dask_stays_lazy(name, monkeypatch):
    """Dask inputs, key lengths and slopes: nothing is computed before ``.compute()``."""
    da = pytest.importorskip("dask.array")
    import dask

    implementation = use_implementation(name, Backend.DASK, monkeypatch)
    rng = np.random.default_rng(15)
    q, k, v = inputs(rng, tq=5, tk=9)
    lengths, slopes = np.array([9, 4]), rng.uniform(0.1, 1.0, (2, 4))
    calls = []

    def counting_scheduler(dsk, keys, **kwargs):
        calls.append(1)
        return dask.get(dsk, keys, **kwargs)

    lazy = [da.from_array(a, chunks=(1, *a.shape[1:])) for a in (q, k, v, lengths, slopes)]
    options = {"window": (3, 1), "softcap": 2.0, "is_causal": True,
               "causal_alignment": "bottom_right", "enable_gqa": True}
    with dask.config.set(scheduler=counting_scheduler):
        out, lse = sdpa(*lazy[:3], key_lengths=lazy[3], alibi_slopes=lazy[4], return_lse=True,
                        implementation=implementation, **options)
        assert not calls, "the graph was computed before .compute()"
        assert isinstance(out, da.Array) and isinstance(lse, da.Array)
        got, got_lse = dask.compute(out, lse)
    ref, ref_lse, _ = oracle(q, k, v, "float64", key_lengths=lengths, alibi_slopes=slopes,
                             **options)
    assert_close(got, ref, "float64")
    assert_lse_close(got_lse, ref_lse, "float64")


def test_explain_native_refuses_softcap(backend, xp, device):
    """softcap rules out the native attention, naming softcap; "auto" falls back and is right."""
    rng = np.random.default_rng(16)
    q, k, v = inputs(rng, tq=4, tk=6)
    args = [to_xp(a, xp, dtype="float32", device=device) for a in (q, k, v)]
    e = polyattn.explain(*args, softcap=3.0, enable_gqa=True)
    assert e.implementation in (("distributed",) if backend is Backend.DASK
                                else ("reference", "chunked"))
    if backend in NATIVE_BACKENDS:
        assert "softcap" in e.candidates["native"]
        with pytest.raises(ValueError, match="softcap"):
            sdpa(*args, softcap=3.0, enable_gqa=True, implementation="native")
        # the other keywords fold into one mask the native function takes
        others = {"window": (2, 0), "is_causal": True, "causal_alignment": "bottom_right",
                  "alibi_slopes": to_xp(rng.uniform(0.1, 1.0, 4), xp, dtype="float32",
                                        device=device),
                  "key_lengths": to_xp(np.array([6, 3]), xp, device=device)}
        assert polyattn.explain(*args, enable_gqa=True, **others).implementation == "native"
        assert "softcap" in str(polyattn.explain(*args, enable_gqa=True, softcap=3.0,
                                                 **others))
    else:
        assert "no native attention" in e.candidates["native"]
    out = sdpa(*args, softcap=3.0, enable_gqa=True)
    ref, _, _ = oracle(q, k, v, "float32", softcap=3.0, enable_gqa=True)
    assert_close(out, ref, "float32")


def test_auto_passes_over_a_native_dense_mask_past_the_budget(backend, xp, device,
                                                             monkeypatch):
    """A window past the score budget runs blocked (invisible blocks skipped), not native."""
    if backend not in NATIVE_BACKENDS:
        pytest.skip("only torch and JAX have a native attention")
    rng = np.random.default_rng(17)
    q, k, v = inputs(rng, tq=8, tk=8)
    args = [to_xp(a, xp, dtype="float32", device=device) for a in (q, k, v)]
    options = {"is_causal": True, "window": (2, 0), "enable_gqa": True}
    assert polyattn.explain(*args, **options).implementation == "native"
    monkeypatch.setenv("POLYATTN_SCORE_BUDGET", "64")
    e = polyattn.explain(*args, **options)
    assert e.implementation == "chunked"
    assert "window would become a dense mask" in e.candidates["native"]
    assert polyattn.explain(*args, is_causal=True, enable_gqa=True).implementation == "native"
    ref, _, _ = oracle(q, k, v, "float32", **options)
    assert_close(sdpa(*args, **options), ref, "float32")


def test_key_lengths_out_of_range_on_every_backend(backend, xp, device):
    """Lengths outside [0, Tk] are refused wherever their values are at hand."""
    if backend is Backend.DASK:
        pytest.skip("a Dask array's values exist only once its graph runs, so they are "
                    "not checked")
    q, k, v = (to_xp(a, xp, device=device) for a in inputs(np.random.default_rng(17), tq=4,
                                                             tk=6, h=2, hkv=2))
    for lengths, shown in (([7, 2], "from 2 to 7"), ([-1, 3], "from -1 to 3")):
        with pytest.raises(ValueError, match=rf"`key_lengths`.*\[0, 6\].*{shown}"):
            sdpa(q, k, v, key_lengths=to_xp(np.array(lengths), xp, device=device))
