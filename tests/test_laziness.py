"""Traced and lazy arrays: every public function works under ``jax.jit`` and stays lazy on Dask.

The Array-API paths have no value-dependent Python control flow, so JAX can
trace them and Dask can build a graph without computing anything. The Dask
tests install a scheduler that counts computations: none may happen before
``.compute()``. (``test_attention.py`` checks the plain causal call of
``scaled_dot_product_attention``; the cases here add masks, GQA, ``lse`` and
the other functions.)
"""

from __future__ import annotations

import numpy as np
import pytest
from _support import CPU_IMPLEMENTATIONS, use_implementation
from helpers import assert_close, assert_lse_close, ref_attention

import polyattn

#: The implementations that take JAX and Dask arrays (the kernel takes CUDA arrays).
ARRAY_API_IMPLEMENTATIONS = CPU_IMPLEMENTATIONS


@pytest.fixture(params=ARRAY_API_IMPLEMENTATIONS)
def implementation(request, monkeypatch):
    return use_implementation(request.param, None, monkeypatch)


def gqa_case(seed=0):
    """query (2, 4, 5, 3), key/value with 2 heads, a boolean mask broadcast over heads."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, 5, 3))
    k = rng.standard_normal((2, 2, 7, 3))
    v = rng.standard_normal((2, 2, 7, 6))
    mask = rng.random((2, 1, 5, 7)) < 0.7
    mask[..., 0] = True
    return q, k, v, mask


# --------------------------------------------------------------------------- #
# JAX: jit
# --------------------------------------------------------------------------- #

@pytest.fixture
def jax():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    return jax


def test_jit_sdpa_with_mask_gqa_and_lse(jax, implementation):
    jnp = jax.numpy
    q, k, v, mask = gqa_case()

    @jax.jit
    def f(q, k, v, mask):
        return polyattn.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=True, causal_alignment="bottom_right",
            enable_gqa=True, return_lse=True, implementation=implementation)

    out, lse = f(*(jnp.asarray(a) for a in (q, k, v, mask)))
    ref, ref_lse, _ = ref_attention(q, k, v, mask=mask, is_causal=True,
                                    alignment="bottom_right", enable_gqa=True)
    assert isinstance(out, jax.Array)
    assert_close(out, ref, "float64")
    assert_lse_close(lse, ref_lse, "float64")


def test_jit_float_mask_and_float32(jax, implementation):
    jnp = jax.numpy
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((3, 6, 4)).astype(np.float32) for _ in range(3))
    mask = rng.standard_normal((6, 6)).astype(np.float32)
    mask[2] = -np.inf

    @jax.jit
    def f(q, k, v, mask):
        return polyattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.7,
                                                     implementation=implementation)

    out = f(*(jnp.asarray(a) for a in (q, k, v, mask)))
    assert out.dtype == jnp.float32
    ref, _, _ = ref_attention(q, k, v, mask=mask, scale=0.7)
    assert_close(out, ref, "float32")


def test_vmap_over_the_batch(jax, implementation):
    jnp = jax.numpy
    q, k, v, _ = gqa_case(2)

    def one(q, k, v):  # (H, T, E) each
        return polyattn.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                     implementation=implementation)

    out = jax.jit(jax.vmap(one))(*(jnp.asarray(a) for a in (q, k, v)))
    ref, _, _ = ref_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_close(out, ref, "float64")


def test_jit_attention_weights(jax):
    jnp = jax.numpy
    q, k, _, mask = gqa_case(3)
    f = jax.jit(lambda q, k, m: polyattn.attention_weights(q, k, attn_mask=m, is_causal=True,
                                                           enable_gqa=True))
    w = f(*(jnp.asarray(a) for a in (q, k, mask)))
    _, _, ref = ref_attention(q, k, k, mask=mask, is_causal=True, enable_gqa=True)
    assert_close(w, ref, "float64")


def test_jit_multi_head_attention(jax, implementation):
    jnp = jax.numpy
    mha = polyattn.MultiHeadAttention(8, 4, num_kv_heads=2, xp=jnp, dtype=jnp.float64, seed=4)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((2, 6, 8)))

    @jax.jit
    def f(x, params):
        return polyattn.multi_head_attention(x, x, x, params, num_heads=4, num_kv_heads=2,
                                             is_causal=True, implementation=implementation)

    out = f(x, mha.params)
    host = {name: np.asarray(p) for name, p in mha.params.items()}
    expected = polyattn.multi_head_attention(np.asarray(x), np.asarray(x), np.asarray(x), host,
                                             num_heads=4, num_kv_heads=2, is_causal=True)
    assert_close(out, expected, "float64")

    g = jax.jit(lambda x, params: polyattn.multi_head_attention(
        x, x, x, params, num_heads=4, num_kv_heads=2, need_weights=True)[1])
    weights = g(x, mha.params)
    assert weights.shape == (2, 6, 6)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-12)


def test_jit_softmax_and_logsumexp(jax):
    jnp = jax.numpy
    x = np.random.default_rng(5).standard_normal((3, 4, 5))
    x[1, 2] = -np.inf
    s, l = jax.jit(lambda x: (polyattn.softmax(x, axis=-1),
                              polyattn.logsumexp(x, axis=-1, keepdims=True)))(jnp.asarray(x))
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.exp(x - np.where(np.isneginf(x.max(-1, keepdims=True)), 0,
                                x.max(-1, keepdims=True)))
        expected = np.nan_to_num(e / e.sum(-1, keepdims=True))
        expected_l = np.log(np.exp(x).sum(-1, keepdims=True))
    np.testing.assert_allclose(np.asarray(s), expected, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(np.asarray(l), expected_l, rtol=1e-12)


def test_jit_positional_encoding(jax):
    jnp = jax.numpy

    @jax.jit
    def add_positions(x):
        pe = polyattn.sinusoidal_positional_encoding(x.shape[-2], x.shape[-1], xp=jnp,
                                                     dtype=x.dtype, offset=3)
        return x + pe

    x = jnp.zeros((2, 7, 6), dtype=jnp.float32)
    got = np.asarray(add_positions(x))
    expected = polyattn.sinusoidal_positional_encoding(7, 6, offset=3, dtype=np.float32)
    np.testing.assert_allclose(got, np.broadcast_to(expected, (2, 7, 6)), rtol=1e-6)


# --------------------------------------------------------------------------- #
# Dask: nothing is computed before .compute()
# --------------------------------------------------------------------------- #

@pytest.fixture
def lazy():
    """(dask.array, computations) with a scheduler that counts its calls."""
    da = pytest.importorskip("dask.array")
    import dask

    count = {"n": 0}

    def counting_scheduler(dsk, keys, **kwargs):
        count["n"] += 1
        return dask.get(dsk, keys, **kwargs)

    with dask.config.set(scheduler=counting_scheduler):
        yield da, count


def compute(da, count, *results):
    """Check that nothing ran yet and that every result is a Dask array; compute them."""
    assert count["n"] == 0, "the graph was computed before .compute()"
    for r in results:
        assert isinstance(r, da.Array), f"expected a lazy Dask array, got {type(r).__name__}"
    return [np.asarray(r.compute()) for r in results]


def test_dask_sdpa_with_mask_gqa_and_lse(lazy, implementation):
    da, count = lazy
    q, k, v, mask = gqa_case(6)
    xs = [da.from_array(a, chunks=(1, *a.shape[1:])) for a in (q, k, v, mask)]
    out, lse = polyattn.scaled_dot_product_attention(
        *xs[:3], attn_mask=xs[3], is_causal=True, causal_alignment="bottom_right",
        enable_gqa=True, return_lse=True, implementation=implementation)
    out, lse = compute(da, count, out, lse)
    ref, ref_lse, _ = ref_attention(q, k, v, mask=mask, is_causal=True,
                                    alignment="bottom_right", enable_gqa=True)
    assert_close(out, ref, "float64")
    assert_lse_close(lse, ref_lse, "float64")


def test_dask_attention_weights_and_explain(lazy):
    da, count = lazy
    q, k, _, mask = gqa_case(7)
    xs = [da.from_array(a, chunks=2) for a in (q, k, mask)]
    w = polyattn.attention_weights(*xs[:2], attn_mask=xs[2], enable_gqa=True)
    explanation = polyattn.explain(xs[0], xs[1], xs[1], enable_gqa=True)
    assert explanation.library == "dask"
    (w,) = compute(da, count, w)
    _, _, ref = ref_attention(q, k, k, mask=mask, enable_gqa=True)
    assert_close(w, ref, "float64")


def test_dask_multi_head_attention(lazy, implementation):
    da, count = lazy
    mha = polyattn.MultiHeadAttention(8, 2, xp=da, dtype=da.float64, seed=8)
    host = polyattn.MultiHeadAttention(8, 2, dtype=np.float64, seed=8)
    x = np.random.default_rng(8).standard_normal((2, 5, 8))
    out, weights = mha(da.from_array(x, chunks=1), is_causal=True, need_weights=True,
                       implementation=implementation)
    plain = mha(da.from_array(x, chunks=1), implementation=implementation)
    out, weights, plain = compute(da, count, out, weights, plain)
    expected, expected_w = host(x, is_causal=True, need_weights=True)
    assert_close(out, expected, "float64")
    assert_close(weights, expected_w, "float64")
    assert_close(plain, host(x), "float64")


def test_dask_softmax_logsumexp_and_creation(lazy):
    da, count = lazy
    x = np.random.default_rng(9).standard_normal((4, 6))
    x[2] = -np.inf
    xd = da.from_array(x, chunks=(2, 3))
    s = polyattn.softmax(xd, axis=0)
    l = polyattn.logsumexp(xd, axis=-1)
    pe = polyattn.sinusoidal_positional_encoding(5, 6, xp=da, offset=2)
    cm = polyattn.causal_mask(3, 5, alignment="bottom_right", xp=da)
    s, l, pe, cm = compute(da, count, s, l, pe, cm)
    with np.errstate(divide="ignore"):
        np.testing.assert_allclose(s, np.exp(x) / np.exp(x).sum(0), rtol=1e-12)
        np.testing.assert_allclose(l, np.log(np.exp(x).sum(-1)), rtol=1e-12)
    np.testing.assert_allclose(pe, polyattn.sinusoidal_positional_encoding(5, 6, offset=2),
                               rtol=1e-12)
    np.testing.assert_array_equal(cm, polyattn.causal_mask(3, 5, alignment="bottom_right"))
