"""Edge cases of attention on every backend and implementation.

Empty query and key sets, one-element problems, huge logits, ``-inf`` in
additive masks, NaN confined to (and kept in) its row, mixed float dtypes, strided and
read-only inputs, and ``scale=0``. Cases already covered by
``test_attention.py`` (fully masked rows, basic empty shapes, read-only 3-d
inputs) are not repeated.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _support import CASES, NUMPY_CASES, check_vjp_refused, rounded, use_implementation
from helpers import (
    ONLY_ON,
    Backend,
    assert_close,
    assert_lse_close,
    assert_namespace_device,
    public_name,
    ref_attention,
    to_numpy,
    to_xp,
)

import polyattn


@pytest.fixture(params=CASES)
def implementation(request, backend, monkeypatch):
    """Each implementation, with blocks small enough that tiny shapes span several."""
    return use_implementation(request.param, backend, monkeypatch)


def arrays(xp, device, dtype_name, *host):
    return [to_xp(a, xp, dtype=dtype_name, device=device) for a in host]


def assert_ulps(got, expected, dtype_name, ulps=4):
    """Equal to within a few units in the last place (one weight of 1, up to rounding)."""
    np.testing.assert_allclose(to_numpy(got), expected,
                               rtol=ulps * np.finfo(dtype_name).eps, atol=0)


def lse_dtype(xp, dtype_name):
    return xp.float64 if dtype_name == "float64" else xp.float32


# --------------------------------------------------------------------------- #
# Empty problems
# --------------------------------------------------------------------------- #

EMPTY_CASES = {
    # name: (q shape, k shape, v shape, mask shape or None, options)
    "plain": ((2, 3, 0, 4), (2, 3, 6, 4), (2, 3, 6, 5), None, {}),
    "causal_bottom_right": ((2, 3, 0, 4), (2, 3, 6, 4), (2, 3, 6, 5), None,
                            {"is_causal": True, "causal_alignment": "bottom_right"}),
    "gqa": ((2, 4, 0, 4), (2, 2, 6, 4), (2, 2, 6, 5), None, {"enable_gqa": True}),
    "mask": ((2, 3, 0, 4), (2, 3, 6, 4), (2, 3, 6, 5), (2, 1, 0, 6), {"is_causal": True}),
    "matrix": ((0, 4), (6, 4), (6, 5), (0, 6), {}),
}


@pytest.mark.parametrize("case", sorted(EMPTY_CASES))
def test_no_queries_give_empty_output(xp, device, dtype_name, implementation, case):
    shape_q, shape_k, shape_v, shape_m, options = EMPTY_CASES[case]
    rng = np.random.default_rng(100)
    q, k, v = arrays(xp, device, dtype_name, *(rng.standard_normal(s)
                                               for s in (shape_q, shape_k, shape_v)))
    if shape_m is not None:
        options = {**options, "attn_mask": to_xp(np.ones(shape_m, dtype=bool), xp, device=device)}
    out, lse = polyattn.scaled_dot_product_attention(
        q, k, v, return_lse=True, implementation=implementation, **options)
    heads = shape_q[:-2]
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert_namespace_device(lse, xp, device, lse_dtype(xp, dtype_name))
    assert to_numpy(out).shape == (*heads, 0, shape_v[-1])    # computed, not just shaped
    assert to_numpy(lse).shape == (*heads, 0)
    w = polyattn.attention_weights(q, k, **options)
    assert_namespace_device(w, xp, device, getattr(xp, dtype_name))
    assert to_numpy(w).shape == (*heads, 0, shape_k[-2])


def test_empty_batch(xp, device, dtype_name, implementation):
    q, k, v = arrays(xp, device, dtype_name, np.zeros((0, 2, 3, 4)), np.zeros((0, 2, 5, 4)),
                     np.zeros((0, 2, 5, 6)))
    out, lse = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True,
                                                     implementation=implementation)
    assert to_numpy(out).shape == (0, 2, 3, 6) and to_numpy(lse).shape == (0, 2, 3)
    assert to_numpy(polyattn.attention_weights(q, k)).shape == (0, 2, 3, 5)


ZERO_VALUE_FEATURE_CASES = {
    # name: (q shape, k shape, options)
    "plain": ((2, 3, 5, 4), (2, 3, 6, 4), {}),
    "causal_bottom_right": ((2, 3, 5, 4), (2, 3, 7, 4),
                            {"is_causal": True, "causal_alignment": "bottom_right"}),
    "gqa_window": ((2, 4, 6, 4), (2, 2, 6, 4), {"enable_gqa": True, "is_causal": True,
                                                 "window": (2, 0)}),
    "key_lengths": ((2, 3, 5, 4), (2, 3, 6, 4), {"key_lengths": np.array([6, 3])}),
    "matrix": ((5, 4), (6, 4), {"is_causal": True}),
}


def _lse_gradients(q, k, g_lse, weights, scale):
    """float64 gradients of ⟨lse, g_lse⟩ for (…, Tq, E) queries and (…, Tk, E) keys
    (d lse_i / d q_i = scale·Σ_j α_ij k_j; d lse_i / d k_j = scale·α_ij q_i)."""
    dq = scale * g_lse[..., None] * np.einsum("...qk,...ke->...qe", weights, k)
    dk = scale * np.einsum("...qk,...q,...qe->...ke", weights, g_lse, q)
    return dq, dk


@pytest.mark.parametrize("case", sorted(ZERO_VALUE_FEATURE_CASES))
@pytest.mark.parametrize("return_lse", [False, True])
def test_values_without_features(xp, device, dtype_name, implementation, case, return_lse):
    """Ev = 0: the output is empty, (…, Tq, 0); the lse does not depend on the values and is
    that of the scores."""
    shape_q, shape_k, options = ZERO_VALUE_FEATURE_CASES[case]
    rng = np.random.default_rng(120)
    q, k = (rounded(rng.standard_normal(s), dtype_name) for s in (shape_q, shape_k))
    v = np.zeros((*shape_k[:-1], 0))
    lengths = options.get("key_lengths")
    given = dict(options)
    if lengths is not None:
        given["key_lengths"] = to_xp(lengths, xp, device=device)
    result = polyattn.scaled_dot_product_attention(
        *arrays(xp, device, dtype_name, q, k, v), return_lse=return_lse,
        implementation=implementation, **given)
    out = result[0] if return_lse else result
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert to_numpy(out).shape == (*shape_q[:-1], 0)
    if return_lse:
        _, ref_lse, _ = ref_attention(
            q, k, np.zeros((*shape_k[:-1], 1)), enable_gqa=options.get("enable_gqa", False),
            is_causal=options.get("is_causal", False), key_lengths=lengths,
            alignment=options.get("causal_alignment", "top_left"), window=options.get("window"))
        assert_lse_close(result[1], ref_lse, dtype_name)


@pytest.mark.parametrize("case", sorted(ZERO_VALUE_FEATURE_CASES))
def test_values_without_features_gradients(xp, device, implementation, case):
    """attention_vjp with Ev = 0: dv is (…, Tk, 0); dq and dk come from ``grad_lse`` alone."""
    check_vjp_refused(implementation, xp, device)
    shape_q, shape_k, options = ZERO_VALUE_FEATURE_CASES[case]
    rng = np.random.default_rng(121)
    q, k = rng.standard_normal(shape_q), rng.standard_normal(shape_k)
    v = np.zeros((*shape_k[:-1], 0))
    lengths = options.get("key_lengths")
    given = dict(options)
    if lengths is not None:
        given["key_lengths"] = to_xp(lengths, xp, device=device)
    (_, lse), pullback = polyattn.attention_vjp(
        *arrays(xp, device, "float64", q, k, v), return_lse=True,
        implementation=implementation, **given)
    g_lse = rng.standard_normal(tuple(to_numpy(lse).shape))
    dq, dk, dv = pullback(to_xp(np.zeros((*shape_q[:-1], 0)), xp, device=device),
                          to_xp(g_lse, xp, device=device))
    assert to_numpy(dv).shape == v.shape
    gqa = options.get("enable_gqa", False)
    kk = np.repeat(k, shape_q[-3] // shape_k[-3], axis=-3) if gqa else k
    _, _, weights = ref_attention(
        q, kk, np.zeros((*kk.shape[:-1], 1)), is_causal=options.get("is_causal", False),
        key_lengths=lengths, alignment=options.get("causal_alignment", "top_left"),
        window=options.get("window"))
    want_dq, want_dk = _lse_gradients(q, kk, g_lse, weights, 1 / math.sqrt(shape_q[-1]))
    if gqa:
        want_dk = want_dk.reshape(*shape_k[:-3], shape_k[-3], -1, *shape_k[-2:]).sum(axis=-3)
    assert_close(dq, want_dq, "float64", what="dq")
    assert_close(dk, want_dk, "float64", what="dk")


@pytest.mark.parametrize("shape", [(3, 0), (0, 3), (2, 0, 4)])
@pytest.mark.parametrize("axis", [-1, 0])
def test_softmax_and_logsumexp_of_empty_arrays(xp, device, dtype_name, shape, axis):
    """A sum over no terms is 0: softmax is empty, logsumexp is -inf (as for all -inf)."""
    x = to_xp(np.zeros(shape), xp, dtype=dtype_name, device=device)
    s = polyattn.softmax(x, axis=axis)
    assert_namespace_device(s, xp, device, getattr(xp, dtype_name))
    assert to_numpy(s).shape == shape
    for keepdims in (False, True):
        lse = polyattn.logsumexp(x, axis=axis, keepdims=keepdims)
        expected = np.logaddexp.reduce(np.full(shape, -np.inf), axis=axis, keepdims=keepdims)
        assert_namespace_device(lse, xp, device, getattr(xp, dtype_name))
        np.testing.assert_array_equal(to_numpy(lse), expected)


@pytest.mark.parametrize("case", ["plain", "causal_top_left", "causal_bottom_right", "gqa",
                                  "bool_mask", "float_mask", "no_queries"])
def test_no_keys_give_zeros_and_neg_inf_lse(xp, device, dtype_name, implementation, case):
    tq = 0 if case == "no_queries" else 3
    h, hkv = (4, 2) if case == "gqa" else (2, 2)
    rng = np.random.default_rng(101)
    q, k, v = arrays(xp, device, dtype_name, rng.standard_normal((2, h, tq, 4)),
                     np.zeros((2, hkv, 0, 4)), np.zeros((2, hkv, 0, 5)))
    options = {"enable_gqa": case == "gqa"}
    if case.startswith("causal"):
        options.update(is_causal=True, causal_alignment=case.removeprefix("causal_"))
    if case == "bool_mask":
        options["attn_mask"] = to_xp(np.ones((tq, 0), dtype=bool), xp, device=device)
    if case == "float_mask":
        options["attn_mask"] = to_xp(np.zeros((2, 1, tq, 0)), xp, dtype=dtype_name,
                                     device=device)
    out, lse = polyattn.scaled_dot_product_attention(
        q, k, v, return_lse=True, implementation=implementation, **options)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert_namespace_device(lse, xp, device, lse_dtype(xp, dtype_name))
    got, got_lse = to_numpy(out), to_numpy(lse)
    assert got.shape == (2, h, tq, 5) and got_lse.shape == (2, h, tq)
    assert np.all(got == 0) and np.all(np.isneginf(got_lse))
    w = polyattn.attention_weights(q, k, **options)
    assert_namespace_device(w, xp, device, getattr(xp, dtype_name))
    assert to_numpy(w).shape == (2, h, tq, 0)


def test_multi_head_attention_without_keys_returns_output_bias(xp, device, dtype_name,
                                                               implementation):
    mha = polyattn.MultiHeadAttention(8, 2, xp=xp, dtype=getattr(xp, dtype_name),
                                      device=device, seed=0)
    rng = np.random.default_rng(102)
    b_o = rng.standard_normal(8)
    mha.params["b_o"] = to_xp(b_o, xp, dtype=dtype_name, device=device)
    x, memory = arrays(xp, device, dtype_name, rng.standard_normal((2, 3, 8)),
                       np.zeros((2, 0, 8)))
    out = mha(x, memory, implementation=implementation)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    expected = np.broadcast_to(rounded(b_o, dtype_name), (2, 3, 8))
    np.testing.assert_array_equal(to_numpy(out), expected)


# --------------------------------------------------------------------------- #
# One query, one key, one feature
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("shape", [(1, 1), (1, 1, 1), (1, 1, 1, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_single_query_key_feature(xp, device, dtype_name, implementation, shape, is_causal):
    q, k, v = arrays(xp, device, dtype_name, np.full(shape, 0.5), np.full(shape, -3.0),
                     np.full(shape, 1.25))
    out, lse = polyattn.scaled_dot_product_attention(
        q, k, v, is_causal=is_causal, return_lse=True, implementation=implementation)
    assert tuple(out.shape) == shape and tuple(lse.shape) == shape[:-1]
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    # One visible key: its weight is 1, so out is v; lse = q·k·scale, with scale 1.
    assert_ulps(out, np.full(shape, 1.25), dtype_name)
    assert_ulps(lse, np.full(shape[:-1], -1.5), dtype_name)
    w = polyattn.attention_weights(q, k, is_causal=is_causal)
    np.testing.assert_array_equal(to_numpy(w), np.ones(shape))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_single_query_over_many_keys(xp, device, dtype_name, implementation, alignment):
    """One decoding step: top-left alignment sees key 0 only, bottom-right sees every key."""
    rng = np.random.default_rng(103)
    q, k, v = (rng.standard_normal((2, 2, t, 3)) for t in (1, 9, 9))
    out = polyattn.scaled_dot_product_attention(
        *arrays(xp, device, dtype_name, q, k, v), is_causal=True, causal_alignment=alignment,
        implementation=implementation)
    if alignment == "top_left":
        assert_ulps(out, rounded(v[:, :, :1], dtype_name), dtype_name)
    else:
        ref, _, _ = ref_attention(*(rounded(a, dtype_name) for a in (q, k, v)))
        assert_close(out, ref, dtype_name)


# --------------------------------------------------------------------------- #
# Huge logits
# --------------------------------------------------------------------------- #

def huge_logit_inputs(rng, sign_pattern):
    """Integer queries and keys whose scores are ±1e4 plus small integers, exactly.

    Scores are exact in float32 and float64, so any error comes from the
    softmax, not from rounding the inputs or the products.
    """
    tq, tk = 6, 11
    a = rng.integers(-3, 4, size=(2, 2, tq))
    b = rng.integers(-3, 4, size=(2, 2, tk))
    q = np.stack([np.full((2, 2, tq), 100.0), a.astype(float)], axis=-1)      # (2, 2, Tq, 2)
    signs = np.broadcast_to(sign_pattern(tk), (2, 2, tk))
    k = np.stack([100.0 * signs, b.astype(float)], axis=-1)                   # (2, 2, Tk, 2)
    v = rng.standard_normal((2, 2, tk, 3))
    return q, k, v


SIGN_PATTERNS = {
    "all_positive": lambda tk: np.ones(tk),
    "all_negative": lambda tk: -np.ones(tk),
    # The first key block is far below the rest: the running maximum jumps by 2e4.
    "negative_then_positive": lambda tk: np.where(np.arange(tk) < 4, -1.0, 1.0),
    "positive_then_negative": lambda tk: np.where(np.arange(tk) < 4, 1.0, -1.0),
}


@pytest.mark.parametrize("pattern", sorted(SIGN_PATTERNS))
@pytest.mark.parametrize("is_causal", [False, True])
def test_huge_logits_stay_finite_and_accurate(xp, device, dtype_name, implementation, pattern,
                                              is_causal):
    rng = np.random.default_rng(104)
    q, k, v = huge_logit_inputs(rng, SIGN_PATTERNS[pattern])
    v = rounded(v, dtype_name)
    out, lse = polyattn.scaled_dot_product_attention(
        *arrays(xp, device, dtype_name, q, k, v), scale=1.0, is_causal=is_causal,
        return_lse=True, implementation=implementation)
    ref, ref_lse, _ = ref_attention(q, k, v, scale=1.0, is_causal=is_causal)
    assert np.abs(ref_lse).max() > 9000  # the scores really are around ±1e4
    assert np.isfinite(to_numpy(out)).all() and np.isfinite(to_numpy(lse)).all()
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


def test_huge_logits_attention_weights(xp, device, dtype_name):
    rng = np.random.default_rng(105)
    q, k, _ = huge_logit_inputs(rng, SIGN_PATTERNS["negative_then_positive"])
    w = polyattn.attention_weights(*arrays(xp, device, dtype_name, q, k), scale=1.0)
    _, _, ref = ref_attention(q, k, k, scale=1.0)
    assert np.isfinite(to_numpy(w)).all()
    assert_close(w, ref, dtype_name)


@pytest.mark.parametrize("bias", [1e4, -1e4])
def test_huge_float_mask_is_a_row_constant(xp, device, dtype_name, implementation, bias):
    """A mask of ±1e4 everywhere shifts every score equally: out is unchanged, lse shifts.

    Scores are small integers, so ``score + bias`` is exact in float32 too.
    """
    rng = np.random.default_rng(106)
    q, k = (rng.integers(-2, 3, size=(2, 2, t, 4)).astype(float) for t in (5, 9))
    v = rounded(rng.standard_normal((2, 2, 9, 4)), dtype_name)
    xs = arrays(xp, device, dtype_name, q, k, v)
    mask = to_xp(np.full((5, 9), bias), xp, dtype=dtype_name, device=device)
    out, lse = polyattn.scaled_dot_product_attention(*xs, attn_mask=mask, scale=1.0,
                                                     return_lse=True,
                                                     implementation=implementation)
    ref, ref_lse, _ = ref_attention(q, k, v, scale=1.0)
    assert_close(out, ref, dtype_name)
    assert_close(lse, ref_lse + bias, dtype_name, what="lse")


# --------------------------------------------------------------------------- #
# -inf in additive masks
# --------------------------------------------------------------------------- #

def neg_inf_mask(kind, rng, tq, tk):
    mask = rng.standard_normal((tq, tk))
    if kind == "first_key_block":          # every row: the first 4 keys are forbidden
        mask[:, :4] = -np.inf
    elif kind == "last_key_block":
        mask[:, -4:] = -np.inf
    elif kind == "scattered":
        mask[rng.random((tq, tk)) < 0.4] = -np.inf
        mask[np.arange(tq), rng.integers(0, tk, tq)] = 0.5   # at least one key per row
    elif kind == "all_but_one":            # exactly one key per row, anywhere
        keep = rng.integers(0, tk, tq)
        mask = np.full((tq, tk), -np.inf)
        mask[np.arange(tq), keep] = rng.standard_normal(tq)
    elif kind == "rows_and_causal":        # some rows fully forbidden by mask and causality
        mask[1, :] = -np.inf
        mask[4, :5] = -np.inf
    return mask


@pytest.mark.parametrize("kind", ["first_key_block", "last_key_block", "scattered",
                                  "all_but_one", "rows_and_causal"])
def test_neg_inf_in_float_masks(xp, device, dtype_name, implementation, kind):
    rng = np.random.default_rng(107)
    tq, tk = 7, 10
    q, k, v = (rounded(rng.standard_normal((2, 2, t, 4)), dtype_name) for t in (tq, tk, tk))
    mask = neg_inf_mask(kind, rng, tq, tk)
    is_causal = kind == "rows_and_causal"
    out, lse = polyattn.scaled_dot_product_attention(
        *arrays(xp, device, dtype_name, q, k, v),
        attn_mask=to_xp(mask, xp, dtype=dtype_name, device=device), is_causal=is_causal,
        return_lse=True, implementation=implementation)
    ref, ref_lse, _ = ref_attention(q, k, v, mask=rounded(mask, dtype_name),
                                    is_causal=is_causal)
    got = to_numpy(out)
    assert not np.isnan(got).any()
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)
    if kind == "all_but_one":
        # The one allowed key gets weight 1: out is its value row.
        keep = np.argmax(np.isfinite(mask), axis=-1)
        assert_ulps(got, v[:, :, keep, :], dtype_name)


def test_neg_inf_float64_mask_with_float32_inputs(xp, device, implementation):
    """A float64 mask is brought to the compute dtype; -inf survives, the result stays float32."""
    rng = np.random.default_rng(108)
    q, k, v = (rounded(rng.standard_normal((2, 5, 3)), "float32") for _ in range(3))
    mask = rng.standard_normal((5, 5))
    mask[:, 0] = -np.inf
    mask[3] = -np.inf
    out = polyattn.scaled_dot_product_attention(
        *arrays(xp, device, "float32", q, k, v),
        attn_mask=to_xp(mask, xp, dtype="float64", device=device),
        implementation=implementation)
    assert_namespace_device(out, xp, device, xp.float32)
    ref, _, _ = ref_attention(q, k, v, mask=rounded(mask, "float32"))
    assert_close(out, ref, "float32")
    assert np.all(to_numpy(out)[:, 3] == 0)


# --------------------------------------------------------------------------- #
# NaN stays in its row
# --------------------------------------------------------------------------- #

def nan_row_case(xp, device, dtype_name, implementation, variant):
    """Attention with one NaN in query row ``bad``; returns (out, lse, ref, ref_lse, bad)."""
    rng = np.random.default_rng(109)
    h, hkv = (4, 2) if variant == "gqa" else (2, 2)
    q = rounded(rng.standard_normal((2, h, 7, 4)), dtype_name)
    k, v = (rounded(rng.standard_normal((2, hkv, 9, 4)), dtype_name) for _ in range(2))
    bad = (1, h - 1, 4)
    q_nan = q.copy()
    q_nan[(*bad, 2)] = np.nan
    options = {"enable_gqa": variant == "gqa", "is_causal": variant == "causal"}
    mask = None
    if variant == "bool_mask":
        mask = rng.random((7, 9)) < 0.7
        mask[:, 0] = True
        options["attn_mask"] = to_xp(mask, xp, device=device)
    out, lse = polyattn.scaled_dot_product_attention(
        *arrays(xp, device, dtype_name, q_nan, k, v), return_lse=True,
        implementation=implementation, **options)
    ref, ref_lse, _ = ref_attention(q, k, v, mask=mask, is_causal=variant == "causal",
                                    enable_gqa=variant == "gqa")
    return to_numpy(out), to_numpy(lse), ref, ref_lse, bad


NAN_VARIANTS = ["plain", "causal", "bool_mask", "gqa"]


@pytest.mark.parametrize("variant", NAN_VARIANTS)
def test_nan_query_row_is_confined(xp, device, dtype_name, implementation, variant):
    got, got_lse, ref, ref_lse, bad = nan_row_case(xp, device, dtype_name, implementation,
                                                   variant)
    others = np.ones(got_lse.shape, dtype=bool)
    others[bad] = False
    assert not np.isnan(got[others]).any() and not np.isnan(got_lse[others]).any()
    assert_close(got[others], ref[others], dtype_name)
    assert_close(got_lse[others], ref_lse[others], dtype_name, what="lse")


def test_nan_query_row_propagates(xp, device, implementation):
    """The row holding a NaN gives NaN (not the 0 / -inf of a fully masked row)."""
    got, got_lse, _, _, bad = nan_row_case(xp, device, "float64", implementation, "plain")
    assert np.isnan(got[bad]).all() and np.isnan(got_lse[bad])


def test_nan_query_row_in_attention_weights(xp, device, dtype_name):
    rng = np.random.default_rng(110)
    q, k = (rounded(rng.standard_normal((2, 6, 4)), dtype_name) for _ in range(2))
    q_nan = q.copy()
    q_nan[0, 3, 1] = np.nan
    w = to_numpy(polyattn.attention_weights(*arrays(xp, device, dtype_name, q_nan, k),
                                            is_causal=True))
    _, _, ref = ref_attention(q, k, k, is_causal=True)
    others = np.ones((2, 6), dtype=bool)
    others[0, 3] = False
    assert not np.isnan(w[others]).any()
    assert_close(w[others], ref[others], dtype_name)


# --------------------------------------------------------------------------- #
# Mixed float dtypes
# --------------------------------------------------------------------------- #

DTYPE_TRIPLES = [("float32", "float64", "float32"), ("float64", "float32", "float32"),
                 ("float32", "float32", "float64"), ("float64", "float64", "float32")]


@pytest.mark.parametrize("dtypes", DTYPE_TRIPLES, ids="-".join)
def test_mixed_float_dtypes_promote(xp, device, implementation, dtypes):
    rng = np.random.default_rng(111)
    host = [rounded(rng.standard_normal(s), d)
            for s, d in zip(((2, 5, 4), (2, 6, 4), (2, 6, 3)), dtypes, strict=True)]
    q, k, v = (to_xp(a, xp, dtype=d, device=device) for a, d in zip(host, dtypes, strict=True))
    out, lse = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True,
                                                     implementation=implementation)
    # Any float64 argument makes the result float64, and float64 is never downcast.
    assert_namespace_device(out, xp, device, xp.float64)
    assert_namespace_device(lse, xp, device, xp.float64)
    ref, ref_lse, _ = ref_attention(*host, is_causal=True)
    assert_close(out, ref, "float64")
    assert_lse_close(lse, ref_lse, "float64")
    w = polyattn.attention_weights(q, k)
    expected = xp.result_type(q.dtype, k.dtype)
    assert_namespace_device(w, xp, device, expected)
    _, _, ref_w = ref_attention(host[0], host[1], host[1])
    assert_close(w, ref_w, "float64" if expected == xp.float64 else "float32")


@pytest.mark.parametrize("position", ["query", "key", "value"])
def test_float16_promotes_with_float32(backend, xp, device, implementation, position):
    if not hasattr(xp, "float16"):
        pytest.skip(f"{backend.value} has no float16 dtype")
    rng = np.random.default_rng(112)
    names = ["float32"] * 3
    names[["query", "key", "value"].index(position)] = "float16"
    host = [rounded(rng.standard_normal(s), d)
            for s, d in zip(((2, 5, 4), (2, 6, 4), (2, 6, 3)), names, strict=True)]
    args = [to_xp(a, xp, dtype=d, device=device) for a, d in zip(host, names, strict=True)]
    out = polyattn.scaled_dot_product_attention(*args, implementation=implementation)
    assert_namespace_device(out, xp, device, xp.float32)
    ref, _, _ = ref_attention(*host)
    assert_close(out, ref, "float32")


def test_multi_head_attention_mixed_dtypes_promote(xp, device, implementation):
    """float32 parameters with float64 inputs give float64, computed in float64."""
    mha = polyattn.MultiHeadAttention(8, 2, xp=xp, dtype=xp.float32, device=device, seed=1)
    rng = np.random.default_rng(113)
    x = to_xp(rng.standard_normal((2, 5, 8)), xp, dtype="float64", device=device)
    out = mha(x, is_causal=True, implementation=implementation)
    assert_namespace_device(out, xp, device, xp.float64)
    params64 = {name: xp.astype(p, xp.float64) for name, p in mha.params.items()}
    expected = polyattn.multi_head_attention(x, x, x, params64, num_heads=2, is_causal=True,
                                             implementation="reference")
    assert_close(out, to_numpy(expected), "float64")


# --------------------------------------------------------------------------- #
# Strided, transposed, broadcast and read-only inputs
# --------------------------------------------------------------------------- #

def test_strided_and_transposed_views(xp, device, dtype_name, implementation):
    """Inputs made by permute_dims and step slicing (views where the library has views)."""
    rng = np.random.default_rng(114)
    base_q = rng.standard_normal((2, 4, 3, 14))      # (B, E, H, 2·Tq): permuted + strided
    base_k = rng.standard_normal((3, 2, 9, 4))       # (H, B, Tk, E): permuted
    base_v = rng.standard_normal((2, 3, 18, 5))      # every other key
    base_m = rng.standard_normal((9, 7))             # (Tk, Tq): transposed
    bq, bk, bv, bm = (to_xp(a, xp, dtype=dtype_name, device=device)
                      for a in (base_q, base_k, base_v, base_m))
    q = xp.permute_dims(bq, (0, 2, 3, 1))[:, :, ::2, :]   # (2, 3, 7, 4)
    k = xp.permute_dims(bk, (1, 0, 2, 3))                 # (2, 3, 9, 4)
    v = bv[:, :, 1::2, :]                                 # (2, 3, 9, 5)
    m = xp.permute_dims(bm, (1, 0))                       # (7, 9)
    out = polyattn.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True,
                                                causal_alignment="bottom_right",
                                                implementation=implementation)
    hq = rounded(base_q.transpose(0, 2, 3, 1)[:, :, ::2, :], dtype_name)
    hk = rounded(base_k.transpose(1, 0, 2, 3), dtype_name)
    hv = rounded(base_v[:, :, 1::2, :], dtype_name)
    ref, _, _ = ref_attention(hq, hk, hv, mask=rounded(base_m.T, dtype_name), is_causal=True,
                              alignment="bottom_right")
    assert_close(out, ref, dtype_name)


def test_numpy_exotic_layouts(monkeypatch, dtype_name):
    """Negative strides, Fortran order, zero strides (read-only broadcasts), unaligned rows."""
    rng = np.random.default_rng(115)
    for case in NUMPY_CASES:
        name = use_implementation(case, Backend.NUMPY, monkeypatch)
        q = np.asfortranarray(rng.standard_normal((2, 3, 7, 4)).astype(dtype_name))
        k = rng.standard_normal((2, 3, 9, 4)).astype(dtype_name)[:, :, ::-1, :]
        v = np.broadcast_to(rng.standard_normal((1, 1, 9, 5)).astype(dtype_name), (2, 3, 9, 5))
        mask = np.broadcast_to(rng.random((9,)) < 0.8, (7, 9))
        assert not v.flags.writeable and not mask.flags.writeable
        out, lse = polyattn.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                         return_lse=True, implementation=name)
        ref, ref_lse, _ = ref_attention(q, k, v, mask=mask)
        assert_close(out, ref, dtype_name, what=f"out ({name})")
        assert_lse_close(lse, ref_lse, dtype_name)


def test_torch_non_contiguous_tensors(dtype_name, monkeypatch):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(116)
    tq = torch.from_numpy(rng.standard_normal((2, 3, 4, 7)).astype(dtype_name))
    tk = torch.from_numpy(rng.standard_normal((3, 2, 9, 4)).astype(dtype_name))
    tv = torch.from_numpy(rng.standard_normal((1, 3, 9, 5)).astype(dtype_name))
    tm = torch.from_numpy(rng.random((9, 7)) < 0.8)
    q = tq.transpose(-1, -2)                  # (2, 3, 7, 4), not contiguous
    k = tk.permute(1, 0, 2, 3)                # (2, 3, 9, 4)
    v = tv.expand(2, 3, 9, 5)                 # stride 0 along the batch
    m = tm.t()                                # (7, 9)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    ref, ref_lse, _ = ref_attention(q.numpy(), k.numpy(), v.numpy(), mask=m.numpy(),
                                    is_causal=True)
    for case in (n for n in CASES
                 if public_name(n) != "numba_cuda" and public_name(n) not in ONLY_ON):
        name = use_implementation(case, Backend.TORCH, monkeypatch)
        out, lse = polyattn.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True,
                                                         return_lse=True, implementation=name)
        assert isinstance(out, torch.Tensor) and out.dtype == getattr(torch, dtype_name)
        assert_close(out, ref, dtype_name, what=f"out ({name})")
        assert_lse_close(lse, ref_lse, dtype_name)


@pytest.mark.parametrize("shapes", [((1, 2, 3, 4), (1, 2, 0, 4)), ((1, 2, 0, 4), (1, 2, 5, 4)),
                                    ((0, 2, 3, 4), (0, 2, 5, 4))], ids=["no_keys", "no_queries",
                                                                       "no_batch"])
def test_torch_autograd_runs_through_problems_without_scores(shapes, monkeypatch):
    """With no scores (Tk, Tq or B of 0) the output is still on torch's autograd graph:
    backward() runs and gives zero gradients shaped like the inputs, also for NaN inputs
    and a float mask that needs gradients (as a fully masked row does)."""
    torch = pytest.importorskip("torch")
    q_shape, k_shape = shapes
    for case in (n for n in CASES
                 if public_name(n) != "numba_cuda" and public_name(n) not in ONLY_ON):
        name = use_implementation(case, Backend.TORCH, monkeypatch)
        q = torch.full(q_shape, float("nan"), dtype=torch.float64, requires_grad=True)
        k, v = (torch.ones(k_shape, dtype=torch.float64, requires_grad=True) for _ in "kv")
        mask = torch.zeros((*q_shape[:-1], k_shape[-2]), dtype=torch.float64,
                           requires_grad=True)
        out, lse = polyattn.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, return_lse=True, implementation=name)
        assert out.requires_grad and lse.requires_grad, name
        assert not torch.isnan(out).any() and out.shape == (*q_shape[:-1], 4)
        (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
        for x in (q, k, v, mask):
            assert x.grad is not None and x.grad.shape == x.shape, name
            assert not x.grad.any(), name
        with torch.no_grad():
            assert not polyattn.scaled_dot_product_attention(
                q, k, v, implementation=name).requires_grad


def read_only(*arrays):
    out = []
    for a in arrays:
        a = np.array(a)
        a.flags.writeable = False
        out.append(a)
    return out


def test_read_only_numpy_everywhere(monkeypatch):
    """Every public function accepts read-only NumPy arrays (and leaves them alone)."""
    rng = np.random.default_rng(117)
    q, k, v = read_only(*(rng.standard_normal((2, 4, t, 3)) for t in (5, 7, 7)))
    fmask, bmask = read_only(rng.standard_normal((5, 7)), rng.random((2, 1, 5, 7)) < 0.7)
    for case in NUMPY_CASES:
        name = use_implementation(case, Backend.NUMPY, monkeypatch)
        for mask in (fmask, bmask):
            out, lse = polyattn.scaled_dot_product_attention(
                q, k[:, :2], v[:, :2], attn_mask=mask, is_causal=True, enable_gqa=True,
                return_lse=True, implementation=name)
            ref, ref_lse, _ = ref_attention(q, k[:, :2], v[:, :2], mask=mask, is_causal=True,
                                            enable_gqa=True)
            assert_close(out, ref, "float64", what=f"out ({name})")
            assert_lse_close(lse, ref_lse, "float64")
    w = polyattn.attention_weights(q, k, attn_mask=bmask)
    assert_close(w, ref_attention(q, k, k, mask=bmask)[2], "float64")
    x, = read_only(rng.standard_normal((3, 5)))
    assert_close(polyattn.softmax(x, axis=0), np.exp(x) / np.exp(x).sum(0), "float64")
    assert_close(polyattn.logsumexp(x), np.log(np.exp(x).sum(-1)), "float64")
    mha = polyattn.MultiHeadAttention(6, 3, seed=2)
    frozen = dict(zip(mha.params, read_only(*mha.params.values()), strict=True))
    seq, = read_only(rng.standard_normal((2, 4, 6)))
    out = polyattn.multi_head_attention(seq, seq, seq, frozen, num_heads=3, is_causal=True)
    expected = mha(np.array(seq), is_causal=True)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- #
# scale = 0: uniform weights over the visible keys
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("alignment", [None, "top_left", "bottom_right"])
def test_zero_scale_gives_uniform_weights(xp, device, dtype_name, implementation, alignment):
    rng = np.random.default_rng(118)
    tq, tk = 6, 9
    q, k, v = (rounded(rng.standard_normal((2, 2, t, 4)), dtype_name) for t in (tq, tk, tk))
    is_causal = alignment is not None
    options = {"is_causal": is_causal, "causal_alignment": alignment or "top_left",
               "scale": 0.0}
    out, lse = polyattn.scaled_dot_product_attention(
        *arrays(xp, device, dtype_name, q, k, v), return_lse=True,
        implementation=implementation, **options)
    offset = 0 if alignment != "bottom_right" else tk - tq
    visible = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + (offset if is_causal else tk)
    count = visible.sum(-1)                                             # (Tq,)
    expected = np.einsum("qk,bhkf->bhqf", visible / count[:, None], v)  # mean of visible values
    assert_close(out, expected, dtype_name)
    assert_close(lse, np.broadcast_to(np.log(count), (2, 2, tq)), dtype_name, what="lse")
    w = to_numpy(polyattn.attention_weights(*arrays(xp, device, dtype_name, q, k), **options))
    np.testing.assert_allclose(w, np.broadcast_to(visible / count[:, None], w.shape),
                               rtol=4 * np.finfo(dtype_name).eps, atol=0)
    assert math.isclose(float(w.sum(-1).min()), 1.0, rel_tol=1e-6)
