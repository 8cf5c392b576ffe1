"""Attention sinks (DESIGN §3.2): a virtual key per head with a learned logit and value 0.

Checked on every backend and implementation against a float64 oracle that
appends the sink as one more column of the score matrix (as transformers'
gpt-oss eager attention does); gradients (query, key, value and the sinks')
against torch autograd of that formula and central differences; against
transformers' own ``eager_attention_forward`` of gpt-oss where it is installed;
under ``jax.grad``/``jax.jit`` and torch autograd through every path they reach;
``merge_attention`` with the sink in one part; ``attention_weights``,
``explain``, the errors and ``multi_head_attention`` parameters.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from _support import CASES, NO_VJP, NUMPY_CASES, NUMPY_SESSION_ONLY, rounded, use_implementation
from helpers import (
    Backend,
    assert_close,
    assert_lse_close,
    assert_namespace_device,
    ref_scores,
    rel_error,
    selected_backends,
    to_numpy,
    to_xp,
)

import polyattn

sdpa = polyattn.scaled_dot_product_attention
HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
GRAD_TOL = {"float64": 1e-10, "float32": 1e-4}


@pytest.fixture(params=CASES)
def implementation(request, backend, monkeypatch):
    return use_implementation(request.param, backend, monkeypatch)


def oracle(q, k, v, sinks, **rules):
    """float64 (out, lse, weights of the keys) with the sink as one more column of scores."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    if q.shape[-3] != k.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    s = ref_scores(q, k, **rules)
    sink = np.broadcast_to(np.asarray(sinks, dtype=np.float64)[..., None, None],
                           (*s.shape[:-1], 1))
    full = np.concatenate([s, sink], axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.max(full, axis=-1, keepdims=True)
        m = np.where(np.isneginf(m), 0.0, m)
        p = np.exp(full - m)
        total = p.sum(-1, keepdims=True)
        w = np.where(total > 0, p / np.where(total > 0, total, 1.0), 0.0)[..., :-1]
        lse = np.where(total > 0, m + np.log(np.where(total > 0, total, 1.0)), -np.inf)[..., 0]
    return np.einsum("...qk,...kf->...qf", w, v), lse, w


def inputs(rng, *, b=2, h=4, hkv=2, tq=5, tk=7, e=4, ev=3):
    return (rng.standard_normal((b, h, tq, e)), rng.standard_normal((b, hkv, tk, e)),
            rng.standard_normal((b, hkv, tk, ev)), rng.standard_normal(h))


CALLS = {
    "plain": {},
    "causal+lengths": {"is_causal": True, "causal_alignment": "bottom_right",
                       "key_lengths": np.array([7, 0])},       # row 1 sees no key at all
    "window+softcap": {"window": (2, 1), "softcap": 3.0},
    "mask": {"attn_mask": "bool"},
}


def _rules(call, rng, xp, device, dtype_name, shape):
    """(polyattn keywords on ``xp``, oracle keywords) of a case of :data:`CALLS`."""
    ours, theirs = {}, {}
    for name, value in CALLS[call].items():
        if name == "attn_mask":
            mask = rng.random(shape) < 0.6
            mask[0, 0, 1] = False                                # one fully masked row
            ours[name], theirs["mask"] = to_xp(mask, xp, device=device), mask
        elif name == "key_lengths":
            ours[name], theirs[name] = to_xp(value, xp, device=device), value
        elif name == "causal_alignment":
            ours[name], theirs["alignment"] = value, value
        else:
            ours[name] = theirs[name] = value
    return ours, theirs


@pytest.mark.parametrize("call", sorted(CALLS))
def test_against_the_oracle(xp, device, dtype_name, implementation, call):
    rng = np.random.default_rng(11)
    q, k, v, s = inputs(rng)
    ours, theirs = _rules(call, rng, xp, device, dtype_name, (2, 4, 5, 7))
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, v, s)]
    out, lse = sdpa(*args[:3], sinks=args[3], enable_gqa=True, return_lse=True,
                    implementation=implementation, **ours)
    ref, ref_lse, _ = oracle(*(rounded(a, dtype_name) for a in (q, k, v, s)), **theirs)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)
    if call == "causal+lengths":            # no visible key: output 0, lse the sink
        np.testing.assert_array_equal(to_numpy(out)[1], 0.0)
        np.testing.assert_allclose(to_numpy(lse)[1], np.broadcast_to(
            rounded(s, dtype_name)[:, None], (4, 5)), rtol=1e-6)


def test_layout_bthe_and_per_batch_sinks(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(12)
    q, k, v, _ = inputs(rng, hkv=4)
    s = rng.standard_normal((2, 4))                                 # (B, H)
    bthe = [to_xp(np.ascontiguousarray(np.swapaxes(a, 1, 2)), xp, dtype=dtype_name,
                  device=device) for a in (q, k, v)]
    out = sdpa(*bthe, layout="BTHE", is_causal=True, implementation=implementation,
               sinks=to_xp(s, xp, dtype=dtype_name, device=device))
    ref, _, _ = oracle(*(rounded(a, dtype_name) for a in (q, k, v, s)), is_causal=True)
    assert_close(out, np.swapaxes(ref, 1, 2), dtype_name)


def test_a_sink_of_minus_infinity_is_no_sink_and_nan_stays_nan(xp, device, implementation):
    rng = np.random.default_rng(13)
    q, k, v, _ = inputs(rng, hkv=4)
    args = [to_xp(a, xp, device=device) for a in (q, k, v)]
    none = sdpa(*args, implementation=implementation, return_lse=True)
    s = np.array([-np.inf, 0.0, np.nan, 1.0])
    out, lse = sdpa(*args, implementation=implementation, return_lse=True,
                    sinks=to_xp(s, xp, device=device))
    out, lse = to_numpy(out), to_numpy(lse)
    np.testing.assert_allclose(out[:, 0], to_numpy(none[0])[:, 0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse[:, 0], to_numpy(none[1])[:, 0], rtol=1e-12)
    assert np.isnan(out[:, 2]).all() and np.isnan(lse[:, 2]).all()
    assert np.isfinite(out[:, [0, 1, 3]]).all()


def test_fully_masked_rows_with_and_without_sinks(xp, device, implementation):
    """key_lengths 0 everywhere: out 0; lse -inf without sinks (and with -inf ones), else
    the sink; never NaN."""
    q = to_xp(np.ones((1, 2, 3, 4)), xp, device=device)
    s = to_xp(np.array([0.5, -np.inf]), xp, device=device)
    out, lse = sdpa(q, q, q, implementation=implementation, return_lse=True, sinks=s,
                    key_lengths=0)
    np.testing.assert_array_equal(to_numpy(out), 0.0)
    np.testing.assert_array_equal(to_numpy(lse)[0], [[0.5] * 3, [-np.inf] * 3])


def test_attention_weights_leave_the_sink_out(xp, device, dtype_name):
    rng = np.random.default_rng(14)
    q, k, v, s = inputs(rng, hkv=4)
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, s)]
    w = polyattn.attention_weights(args[0], args[1], sinks=args[2], is_causal=True)
    _, _, ref = oracle(*(rounded(a, dtype_name) for a in (q, k, v, s)), is_causal=True)
    assert_close(w, ref, dtype_name, what="weights")
    assert (to_numpy(w).sum(-1) < 1).all()


def test_merge_with_the_sink_in_one_part(xp, device, dtype_name, implementation):
    """The sink belongs to one part: merging it with the other keys' part is the whole."""
    rng = np.random.default_rng(15)
    q, k, v, s = inputs(rng, hkv=4)
    x = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, v, s)]
    whole = sdpa(*x[:3], sinks=x[3], return_lse=True, implementation=implementation)
    first = sdpa(x[0], x[1][..., :3, :], x[2][..., :3, :], sinks=x[3], return_lse=True,
                 implementation=implementation)
    rest = sdpa(x[0], x[1][..., 3:, :], x[2][..., 3:, :], return_lse=True,
                implementation=implementation)
    out, lse = polyattn.merge_attention([first[0], rest[0]], [first[1], rest[1]])
    ref, ref_lse, _ = oracle(*(rounded(a, dtype_name) for a in (q, k, v, s)))
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)
    assert_close(whole[0], ref, dtype_name)


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", NUMPY_CASES)
def test_inputs_are_not_modified(name, monkeypatch):
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    rng = np.random.default_rng(16)
    arrays = inputs(rng, hkv=4)
    copies = [a.copy() for a in arrays]
    for a in arrays:
        a.flags.writeable = False
    sdpa(*arrays[:3], sinks=arrays[3], implementation=implementation)
    for a, c in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(a, c)


# --------------------------------------------------------------------------- #
# Gradients
# --------------------------------------------------------------------------- #

def torch_formula(q, k, v, s, grad_out, grad_lse, **rules):
    """Gradients (q, k, v, sinks) of the sink formula by torch autograd, float64."""
    import torch

    t = [torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v, s)]
    scores = torch.tensor(ref_scores(q, np.repeat(k, q.shape[1] // k.shape[1], axis=1),
                                     scale=1.0, **rules))
    visible = torch.isfinite(scores)
    kk = t[1].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    vv = t[2].repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    raw = t[0] @ kk.transpose(-1, -2) / np.sqrt(q.shape[-1])
    raw = torch.where(visible, raw, -torch.inf)
    sink = t[3].reshape(1, -1, 1, 1).expand(*raw.shape[:-1], 1)
    full = torch.cat([raw, sink], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    out = torch.softmax(full, dim=-1)[..., :-1] @ vv
    loss = (out * torch.tensor(grad_out)).sum() + (lse * torch.tensor(grad_lse)).sum()
    loss.backward()
    return [x.grad.numpy() for x in t]


VJP_CALLS = {"plain": {}, "causal": {"is_causal": True},
             "lengths": {"key_lengths": np.array([7, 0])}}


@NUMPY_SESSION_ONLY
@pytest.mark.skipif(not HAS_TORCH, reason="the oracle is torch autograd of the formula")
@pytest.mark.parametrize("name", [n for n in NUMPY_CASES if n not in NO_VJP])
@pytest.mark.parametrize("call", sorted(VJP_CALLS))
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_vjp_against_torch_autograd(name, call, dtype_name, monkeypatch):
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    rng = np.random.default_rng(17)
    q, k, v, s = (rounded(a, dtype_name) for a in inputs(rng))
    x = [a.astype(dtype_name) for a in (q, k, v, s)]
    (out, lse), pullback = polyattn.attention_vjp(
        *x[:3], sinks=x[3], enable_gqa=True, return_lse=True, implementation=implementation,
        **VJP_CALLS[call])
    go = rng.standard_normal(out.shape).astype(dtype_name)
    gl = rng.standard_normal(lse.shape).astype(dtype_name)
    grads = pullback(go, gl)
    assert len(grads) == 4
    expected = torch_formula(q, k, v, s, go.astype(np.float64), gl.astype(np.float64),
                             **VJP_CALLS[call])
    for what, g, ref, a in zip(("dq", "dk", "dv", "dsinks"), grads, expected, x, strict=True):
        assert g.shape == a.shape and g.dtype == a.dtype, what
        assert rel_error(g, ref) <= GRAD_TOL[dtype_name], (what, rel_error(g, ref))
    three = polyattn.attention_vjp(*x[:3], enable_gqa=True, implementation=implementation)[1]
    assert len(three(go)) == 3                  # without sinks: (dq, dk, dv)


@NUMPY_SESSION_ONLY
def test_sink_gradient_by_central_differences():
    rng = np.random.default_rng(18)
    q, k, v, s = inputs(rng, hkv=4)
    go = rng.standard_normal((2, 4, 5, 3))

    def loss(sinks):
        return float((sdpa(q, k, v, sinks=sinks, is_causal=True) * go).sum())

    _, pullback = polyattn.attention_vjp(q, k, v, sinks=s, is_causal=True)
    ds = pullback(go)[3]
    eps = 1e-6
    numeric = np.array([(loss(s + eps * e) - loss(s - eps * e)) / (2 * eps)
                        for e in np.eye(4)])
    np.testing.assert_allclose(ds, numeric, rtol=1e-7, atol=1e-9)


@pytest.mark.skipif(Backend.TORCH not in selected_backends(), reason="torch session")
@pytest.mark.parametrize("name", ["reference", "chunked", "auto"])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_torch_autograd_through_every_path(name, dtype_name, monkeypatch):
    import torch

    implementation = use_implementation(name, Backend.TORCH, monkeypatch)
    rng = np.random.default_rng(19)
    q, k, v, s = (rounded(a, dtype_name) for a in inputs(rng))
    t = [torch.tensor(a, dtype=getattr(torch, dtype_name), requires_grad=True)
         for a in (q, k, v, s)]
    out = sdpa(*t[:3], sinks=t[3], enable_gqa=True, is_causal=True,
               implementation=implementation)
    go = rng.standard_normal(tuple(out.shape))
    (out * torch.tensor(go, dtype=out.dtype)).sum().backward()
    expected = torch_formula(q, k, v, s, go, np.zeros((2, 4, 5)), is_causal=True)
    for x, ref in zip(t, expected, strict=True):
        assert rel_error(x.grad.numpy(), ref) <= GRAD_TOL[dtype_name]


@pytest.mark.skipif(Backend.TORCH not in selected_backends() or not HAS_TRANSFORMERS,
                    reason="transformers' gpt-oss attention, in the torch session")
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_against_transformers_gpt_oss_eager(dtype_name):
    """transformers' gpt-oss eager attention (its sinks, GQA and causal mask), forward and
    gradients of query, key, value and sinks, on random inputs."""
    import torch
    from transformers.models.gpt_oss import modeling_gpt_oss

    dtype = getattr(torch, dtype_name)
    rng = np.random.default_rng(20)
    q, k, v, s = inputs(rng, b=2, h=4, hkv=2, tq=6, tk=6, e=8, ev=8)

    class Module(torch.nn.Module):
        num_key_value_groups = 2
        training = False

    def leaves():
        return [torch.tensor(a, dtype=dtype, requires_grad=True) for a in (q, k, v, s)]

    theirs, ours = leaves(), leaves()
    module = Module()
    module.sinks = theirs[3]
    causal = torch.full((6, 6), -torch.inf, dtype=dtype).triu(1)[None, None]
    ref, _ = modeling_gpt_oss.eager_attention_forward(
        module, theirs[0], theirs[1], theirs[2], causal, scaling=8 ** -0.5)
    out = sdpa(*ours[:3], sinks=ours[3], is_causal=True, enable_gqa=True)
    out = out.transpose(1, 2)                              # (B, T, H, E), as theirs
    tol = 1e-5 if dtype_name == "float32" else 1e-12
    assert rel_error(out.detach().numpy(), ref.detach().numpy()) <= tol
    go = torch.tensor(rng.standard_normal(tuple(out.shape)), dtype=dtype)
    (ref * go).sum().backward()
    (out * go).sum().backward()
    for a, b in zip(ours, theirs, strict=True):
        assert rel_error(a.grad.numpy(), b.grad.numpy()) <= GRAD_TOL[dtype_name]


@pytest.mark.skipif(Backend.JAX not in selected_backends(), reason="JAX session")
@pytest.mark.parametrize("name", ["reference", "chunked"])
def test_jax_grad_under_jit(name, monkeypatch):
    import jax
    import jax.numpy as jnp

    implementation = use_implementation(name, Backend.JAX, monkeypatch)
    rng = np.random.default_rng(21)
    q, k, v, s = inputs(rng, hkv=4)
    go = rng.standard_normal((2, 4, 5, 3))

    @jax.jit
    def loss(q, k, v, s):
        return jnp.sum(sdpa(q, k, v, sinks=s, is_causal=True,
                            implementation=implementation) * go)

    jax.config.update("jax_enable_x64", True)
    got = jax.grad(loss, argnums=(0, 1, 2, 3))(*(jnp.asarray(a) for a in (q, k, v, s)))
    _, pullback = polyattn.attention_vjp(q, k, v, sinks=s, is_causal=True)
    for a, b in zip(got, pullback(go), strict=True):
        assert a.dtype == jnp.float64
        assert rel_error(np.asarray(a), b) <= 1e-10


def test_dask_stays_lazy_with_sinks():
    if Backend.DASK not in selected_backends():
        pytest.skip("Dask session")
    import dask
    import dask.array as da

    rng = np.random.default_rng(22)
    q, k, v, s = inputs(rng, hkv=4, tq=12, tk=12)
    calls = []

    def count(*args, **kwargs):
        calls.append(1)
        return dask.get(*args, **kwargs)

    x = [da.from_array(a, chunks=(2, 4, 4, a.shape[-1])) for a in (q, k, v)]
    with dask.config.set(scheduler=count):
        out = sdpa(*x, sinks=s, is_causal=True)
        assert isinstance(out, da.Array) and not calls
    ref, _, _ = oracle(q, k, v, s, is_causal=True)
    np.testing.assert_allclose(out.compute(), ref, rtol=1e-12, atol=1e-13)


# --------------------------------------------------------------------------- #
# explain, errors, multi-head attention
# --------------------------------------------------------------------------- #

def test_explain_says_native_cannot_and_shows_the_sinks(backend, xp, device):
    q = to_xp(np.zeros((1, 2, 4, 8)), xp, dtype="float32", device=device)
    s = to_xp(np.zeros(2), xp, dtype="float32", device=device)
    e = polyattn.explain(q, q, q, sinks=s)
    assert e.implementation != "native"
    assert "sinks" in e.features
    if backend in (Backend.TORCH, Backend.JAX):
        assert "no attention sinks" in e.candidates["native"]
        with pytest.raises(ValueError, match="sinks"):
            sdpa(q, q, q, sinks=s, implementation="native")


@NUMPY_SESSION_ONLY
def test_errors_name_the_argument():
    q = np.zeros((2, 4, 3, 8))
    with pytest.raises(ValueError, match=r"`sinks` must be one value, \(H,\) or \(B…, H\)"
                                         r".*\(2, 4\).*\(3,\)"):
        sdpa(q, q, q, sinks=np.zeros(3))
    # one sink logit for every head: the same as that value per head
    np.testing.assert_array_equal(sdpa(q, q, q, sinks=np.array(0.5)),
                                  sdpa(q, q, q, sinks=np.full(4, 0.5)))
    with pytest.raises(TypeError, match="sinks"):
        sdpa(q, q, q, sinks=np.zeros(4, dtype=np.int64))
    with pytest.raises(TypeError, match="explain"):
        polyattn.explain(q, q, q, sink=np.zeros(4))


@NUMPY_SESSION_ONLY
def test_multi_head_attention_takes_sinks_as_a_parameter():
    rng = np.random.default_rng(23)
    mha = polyattn.MultiHeadAttention(16, 4, num_kv_heads=2, seed=0, sinks=True, dtype=np.float64)
    assert mha.params["sinks"].shape == (4,)
    mha.params["sinks"] = rng.standard_normal(4)
    x = rng.standard_normal((2, 5, 16))
    out, w = mha(x, is_causal=True, need_weights=True, average_attn_weights=False)
    p = mha.params
    q = (x @ p["w_q"] + p["b_q"]).reshape(2, 5, 4, 4).transpose(0, 2, 1, 3)
    k = (x @ p["w_k"] + p["b_k"]).reshape(2, 5, 2, 4).transpose(0, 2, 1, 3)
    v = (x @ p["w_v"] + p["b_v"]).reshape(2, 5, 2, 4).transpose(0, 2, 1, 3)
    heads, _, weights = oracle(q, k, v, p["sinks"], is_causal=True)
    ref = heads.transpose(0, 2, 1, 3).reshape(2, 5, 16) @ p["w_o"] + p["b_o"]
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(w, weights, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(mha(x, is_causal=True), ref, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"`sinks` has shape \(3,\); expected \(4,\)"):
        polyattn.multi_head_attention(x, x, x, {**p, "sinks": np.zeros(3)}, num_heads=4,
                                      num_kv_heads=2)
