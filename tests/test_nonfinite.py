"""Non-finite inputs (DESIGN §4.2) on every backend and implementation.

- NaN never disappears: a query row holding NaN or inf gives a NaN output row,
  native implementations included (torch's fused CPU kernel used to report it
  as 0, like a fully masked row), even where every score of the row is -inf.
- A NaN key or value that a row sees makes that row NaN; one hidden from it
  may make it NaN, but never a finite wrong number; other rows stay right.
- Keys past ``key_lengths`` have zero gradients even beside a NaN query row (that they
  are never read is ``test_rules.py::test_keys_past_key_lengths_are_never_read``).
- NaN and inf in ``grad_out`` stay within their (batch, head).
- No floating-point warning escapes a call (warnings are errors here), on
  every public function that computes.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
from _support import CASES, check_vjp_refused, use_implementation
from helpers import Backend, ref_attention, to_numpy, to_xp

import polyattn


@pytest.fixture(params=CASES)
def implementation(request, backend, monkeypatch):
    """Each implementation case (``numba_cpu`` on NumPy, ``distributed`` on Dask), with
    blocks small enough that tiny shapes span several."""
    return use_implementation(request.param, backend, monkeypatch)


@pytest.fixture
def vjp_implementation(implementation, xp, device):
    """The implementations attention_vjp runs; for those it refuses ("native", whose
    library differentiates it, tested through torch autograd below; "distributed") the
    refusal is checked and the test skipped."""
    check_vjp_refused(implementation, xp, device)
    return implementation


def on(xp, device, *arrays):
    """NumPy arrays in ``xp`` on ``device`` (floats stay float64)."""
    return [None if a is None else to_xp(a, xp, device=device) for a in arrays]


def as_numpy(x):
    """``x`` as a NumPy array. Dask arrays are computed with NumPy's floating-point
    warnings ignored: their tasks run when the graph is computed, in Dask's threads, after
    the call has returned; what a call promises (no warning escapes it) ends there."""
    if type(x).__module__.startswith("dask"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return to_numpy(x)
    return to_numpy(x)


def attend(xp, device, implementation, q, k, v, **options):
    """polyattn's output (as NumPy) for float64 NumPy inputs."""
    arrays = on(xp, device, q, k, v)
    for name in ("attn_mask", "key_lengths", "alibi_slopes"):
        if isinstance(options.get(name), np.ndarray):
            options[name] = to_xp(options[name], xp, device=device)
    return as_numpy(polyattn.scaled_dot_product_attention(
        *arrays, implementation=implementation, **options))


def inputs(seed=0, h=2, hkv=2, tq=6, tk=7, e=8, ev=8):
    """Queries, keys and values (2, H|Hkv, T, E|Ev); with Ev = E torch runs its fused CPU
    kernel (the one that lost NaN rows), with Ev != E its math path."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((2, h, tq, e)), rng.standard_normal((2, hkv, tk, e)),
            rng.standard_normal((2, hkv, tk, ev)))


def assert_right(got, ref, where, what="out"):
    """Finite and within the float64 contract at ``where``."""
    assert np.isfinite(got[where]).all(), f"{what}: not finite where it must be"
    np.testing.assert_allclose(got[where], ref[where], rtol=1e-9, atol=1e-12, err_msg=what)


def assert_nan_or_right(got, ref, where, what="out"):
    """Each entry at ``where`` NaN or right: never a finite wrong number."""
    g, r = got[where], ref[where]
    finite = ~np.isnan(g)
    np.testing.assert_allclose(g[finite], r[finite], rtol=1e-9, atol=1e-12, err_msg=what)


# --------------------------------------------------------------------------- #
# NaN and inf in a query row
# --------------------------------------------------------------------------- #

QUERY_VARIANTS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bottom_right": {"is_causal": True, "causal_alignment": "bottom_right"},
    "gqa": {"enable_gqa": True},
    "bool_mask": {"attn_mask": "bool"},
    "window": {"is_causal": True, "window": (2, 0)},
    "key_lengths": {"key_lengths": np.array([7, 5])},
    # soft-capping saturates an infinite score to a finite one: the row is NaN all the same
    "softcap": {"softcap": 5.0},
    "softcap_alibi": {"softcap": 5.0, "alibi_slopes": np.array([0.5, 0.25])},
}


@pytest.mark.parametrize("bad_value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("variant", sorted(QUERY_VARIANTS))
def test_non_finite_query_row_gives_a_nan_row(backend, xp, device, implementation,
                                              variant, bad_value):
    """The row holding the value is NaN in every feature; every other row is finite and
    right (return_lse=False, so that "native" runs the libraries' own functions)."""
    h, hkv = (4, 2) if variant == "gqa" else (2, 2)
    q, k, v = inputs(1, h=h, hkv=hkv)
    options = dict(QUERY_VARIANTS[variant])
    mask = None
    if options.get("attn_mask") == "bool":
        mask = np.random.default_rng(2).random((6, 7)) < 0.6
        mask[:, 0] = True
        options["attn_mask"] = mask
    bad = (1, h - 1, 4)
    q_bad = q.copy()
    q_bad[(*bad, 2)] = bad_value
    rules = {"mask": mask, "is_causal": options.get("is_causal", False),
             "alignment": options.get("causal_alignment", "top_left"),
             "window": options.get("window"), "key_lengths": options.get("key_lengths"),
             "softcap": options.get("softcap"), "alibi_slopes": options.get("alibi_slopes")}
    kk = np.repeat(k, h // hkv, axis=-3)
    got = attend(xp, device, implementation, q_bad, k, v, **options)
    ref, _, _ = ref_attention(q, kk, np.repeat(v, h // hkv, axis=-3), **rules)
    assert np.isnan(got[bad]).all(), f"row {bad}: {got[bad]}"
    others = np.ones(got.shape[:-1], dtype=bool)
    others[bad] = False
    assert_right(got, ref, others)


@pytest.mark.parametrize("bad_value", [math.nan, math.inf], ids=["nan", "inf"])
def test_native_float32_query_row(backend, xp, device, monkeypatch, bad_value):
    """float32, which JAX's native function computes (float64 it refuses): the row is NaN,
    the others right, with and without a causal mask."""
    if backend not in (Backend.TORCH, Backend.JAX):
        pytest.skip("torch and JAX have a native attention")
    use_implementation("native", backend, monkeypatch)
    q, k, v = inputs(19)
    q_bad = q.copy()
    q_bad[0, 1, 3, 0] = bad_value
    for causal in (False, True):
        arrays = [to_xp(a, xp, dtype="float32", device=device) for a in (q_bad, k, v)]
        got = as_numpy(polyattn.scaled_dot_product_attention(
            *arrays, is_causal=causal, implementation="native"))
        ref, _, _ = ref_attention(*(a.astype(np.float32) for a in (q, k, v)), is_causal=causal)
        assert np.isnan(got[0, 1, 3]).all()
        others = np.ones(got.shape[:-1], dtype=bool)
        others[0, 1, 3] = False
        np.testing.assert_allclose(got[others], ref[others], rtol=1e-4, atol=1e-5)


def test_query_row_whose_scores_all_overflow_to_minus_inf_is_nan(backend, xp, device,
                                                                 implementation):
    """A row whose scores are all -inf because its query holds -inf (every key positive
    there) sees every key: it is not a fully masked row, and must not read 0."""
    q, k, v = inputs(3)
    k[..., 0] = np.abs(k[..., 0]) + 0.5
    q_bad = q.copy()
    q_bad[0, 1, 2] = 0.0
    q_bad[0, 1, 2, 0] = -np.inf
    got = attend(xp, device, implementation, q_bad, k, v)
    ref, _, _ = ref_attention(q, k, v)
    assert np.isnan(got[0, 1, 2]).all(), got[0, 1, 2]
    others = np.ones(got.shape[:-1], dtype=bool)
    others[0, 1, 2] = False
    assert_right(got, ref, others)


def test_nan_query_row_lse_and_weights_are_nan(xp, device, implementation):
    """With return_lse=True the row's lse is NaN too, and attention_weights' row is NaN."""
    q, k, v = inputs(4)
    q_bad = q.copy()
    q_bad[1, 0, 3, 1] = np.nan
    out, lse = polyattn.scaled_dot_product_attention(
        *on(xp, device, q_bad, k, v), return_lse=True, is_causal=True,
        implementation=implementation)
    w = as_numpy(polyattn.attention_weights(*on(xp, device, q_bad, k), is_causal=True))
    ref, ref_lse, ref_w = ref_attention(q, k, v, is_causal=True)
    out, lse = as_numpy(out), as_numpy(lse)
    assert np.isnan(out[1, 0, 3]).all() and np.isnan(lse[1, 0, 3]) and np.isnan(w[1, 0, 3]).all()
    others = np.ones(lse.shape, dtype=bool)
    others[1, 0, 3] = False
    assert_right(out, ref, others)
    assert_right(lse, ref_lse, others, "lse")
    assert_right(w, ref_w, others, "weights")


def test_fully_masked_rows_stay_zero(xp, device, implementation):
    """What keeps a NaN query row NaN adds exactly 0 to other rows: a fully masked row
    with a finite query is still 0 (not NaN), its neighbours unchanged."""
    q, k, v = inputs(5)
    mask = np.ones((6, 7), dtype=bool)
    mask[2] = False
    got = attend(xp, device, implementation, q, k, v, attn_mask=mask)
    ref, _, _ = ref_attention(q, k, v, mask=mask)
    assert np.all(got[:, :, 2] == 0)
    assert_right(got, ref, np.ones(got.shape[:-1], dtype=bool))


def test_fully_masked_row_holding_nan_is_nan_or_zero(xp, device, implementation):
    """A fully masked row does not depend on its query: 0 (its value) or NaN (the NaN
    kept); never anything else. Its neighbours are right."""
    q, k, v = inputs(6)
    mask = np.ones((6, 7), dtype=bool)
    mask[2] = False
    q_bad = q.copy()
    q_bad[0, 1, 2, 0] = np.nan
    got = attend(xp, device, implementation, q_bad, k, v, attn_mask=mask)
    ref, _, _ = ref_attention(q, k, v, mask=mask)
    row = got[0, 1, 2]
    assert np.isnan(row).all() or np.all(row == 0), row
    others = np.ones(got.shape[:-1], dtype=bool)
    others[0, 1, 2] = False
    assert_right(got, ref, others)


def test_nan_query_gradients_through_torch_autograd(backend, implementation):
    """torch autograd through each implementation: the NaN query row's output is NaN and
    the gradients of the other batch rows are finite and those of the clean inputs."""
    if backend is not Backend.TORCH:
        pytest.skip("torch autograd")
    import torch

    q, k, v = inputs(7)
    q_bad = q.copy()
    q_bad[1, 0, 2, 3] = np.nan
    grads = []
    for query in (q, q_bad):
        xs = [torch.tensor(a, requires_grad=True) for a in (query, k, v)]
        out = polyattn.scaled_dot_product_attention(*xs, is_causal=True,
                                                    implementation=implementation)
        out.backward(torch.ones_like(out))
        grads.append([x.grad.numpy() for x in xs])
    assert torch.isnan(out[1, 0, 2]).all()
    for clean, dirty in zip(*grads, strict=True):
        assert_right(dirty, clean, (0,), "gradient of the clean batch row")


# --------------------------------------------------------------------------- #
# NaN in keys and values
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("where", ["key", "value"])
def test_nan_in_a_visible_key_or_value(xp, device, implementation, where):
    """NaN at key position 3 (causal): rows 3… see it and are NaN (in the NaN feature, for a
    value); rows 0…2 do not see it and are NaN or right; other heads are right."""
    q, k, v = inputs(8)
    k_bad, v_bad = k.copy(), v.copy()
    if where == "key":
        k_bad[0, 1, 3, 2] = np.nan
    else:
        v_bad[0, 1, 3, 1] = np.nan
    got = attend(xp, device, implementation, q, k_bad, v_bad, is_causal=True)
    ref, _, _ = ref_attention(q, k, v, is_causal=True)
    seen = got[0, 1, 3:] if where == "key" else got[0, 1, 3:, 1]
    assert np.isnan(seen).all(), seen
    assert_nan_or_right(got, ref, (0, 1, slice(0, 3)), "rows that do not see the NaN")
    if where == "value":        # the value's other features are right
        assert_nan_or_right(got, ref, (0, 1, slice(3, None), [0, 2]), "other features")
    others = np.ones(got.shape[:2], dtype=bool)
    others[0, 1] = False
    assert_right(got, ref, others)


@pytest.mark.parametrize("bad_value", [math.nan, math.inf], ids=["nan", "inf"])
def test_padding_gradients_stay_zero_beside_a_non_finite_query(xp, device, vjp_implementation,
                                                                bad_value):
    """Keys past ``key_lengths`` do not exist: their gradients are 0 even where a query
    row holding NaN or inf makes the gradients of the keys it sees NaN."""
    q, k, v = inputs(12, tq=4, tk=6)
    q[0, 1, 0, 0] = bad_value
    lengths = np.array([3, 6])
    _, pullback = polyattn.attention_vjp(*on(xp, device, q, k, v),
                                         key_lengths=to_xp(lengths, xp, device=device),
                                         implementation=vjp_implementation)
    _, dk, dv = (as_numpy(x) for x in pullback(on(xp, device, np.ones((2, 2, 4, 8)))[0]))
    for grad in (dk, dv):
        assert np.all(grad[0, :, 3:] == 0), grad[0, :, 3:]
        assert np.isnan(grad[0, 1, :3]).any()          # the row's NaN reaches what it sees
        assert np.isfinite(grad[1]).all()


# --------------------------------------------------------------------------- #
# NaN and inf in grad_out
# --------------------------------------------------------------------------- #

GRAD_VARIANTS = {"plain": {}, "causal": {"is_causal": True},
                 "key_lengths": {"key_lengths": np.array([7, 4]), "is_causal": True,
                                 "causal_alignment": "bottom_right"}}


@pytest.mark.parametrize("bad_value", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("variant", sorted(GRAD_VARIANTS))
def test_non_finite_grad_out_stays_in_its_batch_and_head(xp, device, vjp_implementation,
                                                         variant, bad_value):
    """One non-finite entry of ``grad_out`` at (batch 1, head 0): the gradients of every
    other (batch, head) are finite and those of a clean ``grad_out``."""
    q, k, v = inputs(12)
    options = dict(GRAD_VARIANTS[variant])
    if "key_lengths" in options:
        options["key_lengths"] = to_xp(options["key_lengths"], xp, device=device)
    g = np.random.default_rng(13).standard_normal((2, 2, 6, 8))
    g_bad = g.copy()
    g_bad[1, 0, 3, 1] = bad_value
    _, pullback = polyattn.attention_vjp(*on(xp, device, q, k, v),
                                         implementation=vjp_implementation, **options)
    clean = [as_numpy(x) for x in pullback(to_xp(g, xp, device=device))]
    dirty = [as_numpy(x) for x in pullback(to_xp(g_bad, xp, device=device))]
    others = np.ones((2, 2), dtype=bool)
    others[1, 0] = False
    for name, c, d in zip(("dq", "dk", "dv"), clean, dirty, strict=True):
        assert_right(d, c, others, name)
    assert not np.isfinite(dirty[2][1, 0]).all()      # dV of the row's keys: not lost


def test_non_finite_grad_out_through_torch_autograd(backend, implementation):
    """The same through torch autograd (native included)."""
    if backend is not Backend.TORCH:
        pytest.skip("torch autograd")
    import torch

    q, k, v = inputs(14)
    g = np.random.default_rng(15).standard_normal((2, 2, 6, 8))
    g_bad = g.copy()
    g_bad[0, 1, 2, 0] = np.nan
    grads = []
    for cot in (g, g_bad):
        xs = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
        out = polyattn.scaled_dot_product_attention(*xs, is_causal=True,
                                                    implementation=implementation)
        out.backward(torch.tensor(cot))
        grads.append([x.grad.numpy() for x in xs])
    others = np.ones((2, 2), dtype=bool)
    others[0, 1] = False
    for name, c, d in zip(("dq", "dk", "dv"), *grads, strict=True):
        assert_right(d, c, others, name)


# --------------------------------------------------------------------------- #
# No floating-point warning escapes
# --------------------------------------------------------------------------- #

def _dirty(seed=16):
    """Inputs holding inf, -inf and NaN in query, key and value, and a cotangent likewise."""
    q, k, v = inputs(seed)
    q[0, 0, 1, 0], q[0, 1, 2, 1], q[1, 0, 3, 2] = np.inf, -np.inf, np.nan
    k[0, 0, 4, 0], k[1, 1, 5, 3] = np.inf, np.nan
    v[0, 1, 0, 0], v[1, 0, 6, 2] = -np.inf, np.nan
    g = np.ones((2, 2, 6, 8))
    g[1, 1, 0, 0], g[0, 0, 5, 2] = np.inf, np.nan
    return q, k, v, g


def _quietly(f, *args, **kwargs):
    """``f(*args, **kwargs)``, every warning an error (whatever pytest's own filters say)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return f(*args, **kwargs)


def _computed(x):
    """``x`` as NumPy (:func:`as_numpy`)."""
    return as_numpy(x)


@pytest.mark.parametrize("return_lse", [False, True])
def test_no_warning_from_attention(xp, device, implementation, return_lse):
    q, k, v, _ = _dirty()
    mask = np.where(np.arange(7) < 6, 0.0, 1e300)                      # overflows float32
    arrays = on(xp, device, q, k, v)
    for options in ({}, {"is_causal": True, "window": (3, 0), "softcap": 20.0},
                    {"attn_mask": to_xp(mask, xp, device=device)}):
        if implementation == "native" and "softcap" in options:
            continue                          # refused by name: not what this test is about
        result = _quietly(polyattn.scaled_dot_product_attention, *arrays,
                          return_lse=return_lse, implementation=implementation, **options)
        for x in result if return_lse else (result,):
            _computed(x)
    _computed(_quietly(polyattn.attention_weights, *arrays[:2], is_causal=True))


def test_no_warning_from_attention_in_float32(xp, device, implementation):
    """float32 inputs (float64 mask and slopes cast down, which may overflow)."""
    q, k, v, _ = _dirty()
    arrays = [to_xp(a, xp, dtype="float32", device=device) for a in (q, k, v)]
    mask = to_xp(np.full((6, 7), -1e300), xp, device=device)
    out = _quietly(polyattn.scaled_dot_product_attention, *arrays, attn_mask=mask,
                   implementation=implementation)
    assert np.isnan(_computed(out)[1, 0, 3]).all()


def test_no_warning_from_attention_vjp(xp, device, vjp_implementation):
    q, k, v, g = _dirty()
    arrays = on(xp, device, q, k, v)
    (out, lse), pullback = _quietly(polyattn.attention_vjp, *arrays, return_lse=True,
                                    is_causal=True, implementation=vjp_implementation)
    _computed(out), _computed(lse)
    g_lse = np.ones((2, 2, 6))
    g_lse[0, 1, 1] = -np.inf
    grads = _quietly(pullback, to_xp(g, xp, device=device), to_xp(g_lse, xp, device=device))
    for x in grads:
        _computed(x)


def test_no_warning_from_softmax_and_logsumexp(xp, device):
    x = to_xp(np.array([[np.inf, 1.0, -np.inf], [np.nan, 0.0, 1.0], [-np.inf, -np.inf, -np.inf],
                        [np.inf, np.inf, 0.0], [1e308, -1e308, 0.0]]), xp, device=device)
    for f in (polyattn.softmax, polyattn.logsumexp):
        for axis in (0, -1):
            _computed(_quietly(f, x, axis=axis))
    x16 = to_xp(np.array([[7e4, 1.0, np.inf]]), xp, dtype="float32", device=device)
    _computed(_quietly(polyattn.softmax, x16))


def test_no_warning_from_merge_attention(xp, device):
    rng = np.random.default_rng(17)
    outs = [rng.standard_normal((2, 3, 4)) for _ in range(3)]
    lses = [rng.standard_normal((2, 3)) for _ in range(3)]
    outs[0][0, 1, 2], outs[1][1, 0, 0] = np.nan, np.inf
    lses[0][0, 0], lses[1][0, 0], lses[2][0, 0] = np.inf, np.inf, -np.inf
    lses[0][1, 1], lses[1][1, 1], lses[2][1, 1] = -np.inf, -np.inf, -np.inf
    lses[2][1, 2] = np.nan
    out, lse = _quietly(polyattn.merge_attention, on(xp, device, *outs), on(xp, device, *lses))
    _computed(out), _computed(lse)
    bthe = [np.swapaxes(o, -2, -3) if o.ndim > 2 else o for o in outs]
    out, _ = _quietly(polyattn.merge_attention, on(xp, device, *bthe), on(xp, device, *lses),
                      layout="BTHE")
    _computed(out)


def test_no_warning_from_multi_head_attention(xp, device, implementation):
    mha = polyattn.MultiHeadAttention(8, 2, xp=xp, dtype=xp.float64, device=device, seed=0)
    x = np.random.default_rng(18).standard_normal((2, 5, 8))
    x[0, 1, 3], x[1, 2, 0] = np.inf, np.nan
    xx = to_xp(x, xp, device=device)
    _computed(_quietly(mha, xx, is_causal=True, implementation=implementation))
    out, w = _quietly(mha, xx, need_weights=True)
    _computed(out), _computed(w)
    cache = polyattn.KVCache((2,), 2, 8, 4, xp=xp, dtype=xp.float64, device=device)
    out, cache = _quietly(mha, xx, is_causal=True, rotary={}, cache=cache,
                          implementation=implementation)
    _computed(out)
    assert np.isnan(_computed(out)[1, 2]).all()


def test_no_warning_from_kv_cache(xp, device, implementation):
    q, k, v, _ = _dirty()
    cache = polyattn.KVCache((2,), 2, 10, 8, xp=xp, dtype=xp.float64, device=device)
    cache = _quietly(cache.update, *on(xp, device, k, v), lengths=to_xp(np.array([7, 4]), xp,
                                                                         device=device))
    out = _quietly(polyattn.scaled_dot_product_attention, on(xp, device, q)[0], cache.keys,
                   cache.values, key_lengths=cache.lengths, is_causal=True,
                   causal_alignment="bottom_right", implementation=implementation)
    _computed(out), _computed(cache.keys)

