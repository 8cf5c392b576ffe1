"""Rules users write: ``score_mod``, ``mask_mod`` and ``mod_args`` (docs/rules.rst).

Every built-in rule re-expressed as a ``score_mod`` or ``mask_mod`` gives the
built-in's result, forward, log-sum-exp and gradients, on every backend, on the
implementations that take user rules (``reference``, ``chunked``, which on NumPy
arrays is the NumPy fast path, ``numba_cpu``, ``distributed``, ``numba_cuda``: its
register-tiled and tensor-core families on shapes of more than 16 query rows); a T5-style
relative bias table in ``mod_args`` against the same bias as a float ``attn_mask``;
torch autograd and ``jax.grad`` through the functions and their floating
``mod_args``; Dask laziness; the errors (Python control flow, a bad ``mod_args``)
at the call, naming the function. The implementations that do not take user rules
yet refuse them by name, which is checked, and ``"auto"`` passes them over.
"""

from __future__ import annotations

import numpy as np
import pytest
from _support import (
    CASES,
    NUMPY_SESSION_ONLY,
    SIMULATOR,
    cuda_family_ran,
    rounded,
    use_implementation,
)
from helpers import (
    Backend,
    assert_close,
    assert_lse_close,
    numba_installed,
    rel_error,
    selected_backends,
    to_numpy,
    to_xp,
)

import polyattn
from polyattn import ops

sdpa = polyattn.scaled_dot_product_attention
TAKING = ("reference", "chunked", "auto", "numba_cpu", "distributed", "numba_cuda")


@pytest.fixture(params=CASES)
def implementation(request, backend, xp, device, monkeypatch):
    name = use_implementation(request.param, backend, monkeypatch)
    if name not in (*TAKING, "native"):        # native checks its refusal as it falls back
        q = to_xp(np.zeros((1, 1, 2, 2)), xp, device=device)
        with pytest.raises(ValueError, match="does not apply mask_mod"):
            sdpa(q, q, q, mask_mod=causal, implementation=name)
        assert polyattn.explain(q, q, q, mask_mod=causal).implementation in TAKING
        pytest.skip(f"{name} refuses user rules (checked)")
    return name


def causal(b, h, q_idx, kv_idx, *mod_args):
    """Causal; it takes the call's mod_args too (both functions receive them)."""
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):
    return ops.logical_and(kv_idx >= q_idx - 2, kv_idx <= q_idx + 1)


def key_lengths(b, h, q_idx, kv_idx, lengths):
    return kv_idx < lengths[b]


def softcap(score, b, h, q_idx, kv_idx):
    return 3.0 * ops.tanh(score / 3.0)


def alibi(score, b, h, q_idx, kv_idx, slopes):
    slope = slopes[h]
    return score - slope * ops.cast(ops.abs(q_idx - kv_idx), slope)


#: (user keywords, built-in keywords) with NumPy arrays.
CALLS = {
    "causal": ({"mask_mod": causal}, {"is_causal": True}),
    "window": ({"mask_mod": window}, {"window": (2, 1)}),
    "key_lengths": ({"mask_mod": key_lengths, "mod_args": (np.array([9, 4]),)},
                    {"key_lengths": np.array([9, 4])}),
    "softcap": ({"score_mod": softcap}, {"softcap": 3.0}),
    "alibi": ({"score_mod": alibi, "mod_args": ("slopes",)}, {"alibi_slopes": "slopes"}),
    "softcap+causal+alibi": ({"score_mod": lambda s, b, h, i, j, sl: alibi(
        softcap(s, b, h, i, j), b, h, i, j, sl),
        "mask_mod": lambda b, h, i, j, sl: causal(b, h, i, j), "mod_args": ("slopes",)},
        {"softcap": 3.0, "is_causal": True, "alibi_slopes": "slopes"}),
}


def _on(options, xp, device, dtype_name, slopes):
    out = {}
    for name, value in options.items():
        if name == "mod_args":
            out[name] = tuple(to_xp(slopes, xp, dtype=dtype_name, device=device)
                              if isinstance(a, str) else to_xp(a, xp, device=device)
                              for a in value)
        elif isinstance(value, str):
            out[name] = to_xp(slopes, xp, dtype=dtype_name, device=device)
        elif isinstance(value, np.ndarray):
            out[name] = to_xp(value, xp, device=device)
        else:
            out[name] = value
    return out


def _inputs(rng):
    return (rng.standard_normal((2, 4, 7, 8)), rng.standard_normal((2, 2, 9, 8)),
            rng.standard_normal((2, 2, 9, 5)))


@pytest.mark.parametrize("call", sorted(CALLS))
def test_built_in_rules_as_user_rules(xp, device, dtype_name, implementation, call):
    rng = np.random.default_rng(41)
    slopes = rng.random(4)
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in _inputs(rng)]
    user, built_in = (_on(o, xp, device, dtype_name, slopes) for o in CALLS[call])
    out, lse = sdpa(*args, enable_gqa=True, return_lse=True, implementation=implementation,
                    **user)
    ref, ref_lse = sdpa(*args, enable_gqa=True, return_lse=True, implementation="reference",
                        **built_in)
    assert_close(out, to_numpy(ref).astype(np.float64), dtype_name)
    assert_lse_close(lse, to_numpy(ref_lse).astype(np.float64), dtype_name)
    w = polyattn.attention_weights(args[0], args[1], enable_gqa=True, **user)
    w_ref = polyattn.attention_weights(args[0], args[1], enable_gqa=True, **built_in)
    assert_close(w, to_numpy(w_ref).astype(np.float64), dtype_name, what="weights")


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("call", sorted(CALLS))
def test_chunked_on_numpy_arrays_is_the_numpy_path(call, monkeypatch):
    """"chunked" on NumPy arrays runs the rules on the NumPy fast path, and so does "auto"
    above the score budget where numba_cpu is left out (else numba_cpu, where it runs)."""
    rng = np.random.default_rng(41)
    q, k, v = _inputs(rng)
    import array_api_compat.numpy as np_xp

    user, _ = (_on(o, np_xp, None, "float64", rng.random(4)) for o in CALLS[call])
    chunked = polyattn.explain(q, k, v, enable_gqa=True, implementation="chunked", **user)
    assert chunked.module == "polyattn.backends.numpy.forward"
    assert "numpy_chunked rules" in chunked.details
    monkeypatch.setenv("POLYATTN_SCORE_BUDGET", "0")
    auto = polyattn.explain(q, k, v, enable_gqa=True, **user)
    assert auto.implementation == ("numba_cpu" if numba_installed() else "chunked")
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "0")
    auto = polyattn.explain(q, k, v, enable_gqa=True, **user)
    assert (auto.implementation, auto.module) == ("chunked", chunked.module)


def t5_bias(score, b, h, q_idx, kv_idx, table):
    """A learned relative bias per head and distance (clipped to ±4), as in T5."""
    return score + table[h, ops.minimum(ops.maximum(q_idx - kv_idx, -4), 4) + 4]


def test_relative_bias_table_against_the_float_mask(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(42)
    q, k, v = _inputs(rng)
    table = rng.standard_normal((4, 9))
    distance = np.clip(np.arange(7)[:, None] - np.arange(9)[None, :], -4, 4) + 4
    bias = table[:, distance][None]                                   # (1, H, Tq, Tk)
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, v)]
    out = sdpa(*args, enable_gqa=True, score_mod=t5_bias, implementation=implementation,
               mod_args=(to_xp(table, xp, dtype=dtype_name, device=device),))
    ref = sdpa(*(rounded(a, dtype_name) for a in (q, k, v)), enable_gqa=True,
               attn_mask=rounded(bias, dtype_name), implementation="reference")
    assert_close(out, ref, dtype_name)


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", ["reference", "chunked", "numba_cpu", "numba_cuda-rows"])
@pytest.mark.parametrize("call", sorted(CALLS))
def test_vjp_equals_the_built_in_vjp(name, call, monkeypatch):
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    rng = np.random.default_rng(43)
    slopes = rng.random(4)
    q, k, v = _inputs(rng)
    import array_api_compat.numpy as np_xp

    user, built_in = (_on(o, np_xp, None, "float64", slopes) for o in CALLS[call])
    _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True,
                                         implementation=implementation, **user)
    _, reference = polyattn.attention_vjp(q, k, v, enable_gqa=True, implementation="reference",
                                          **built_in)
    go = rng.standard_normal((2, 4, 7, 5))
    # a score_mod reading floating mod_args (the ALiBi slopes) adds their gradient last
    for a, b in zip(pullback(go)[:3], reference(go), strict=True):
        assert rel_error(a, b) <= 1e-12


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", ["reference", "chunked", "numba_cpu"])
def test_vjp_by_central_differences(name, monkeypatch):
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    rng = np.random.default_rng(44)
    q, k, v = _inputs(rng)
    table = rng.standard_normal((4, 9))
    go = rng.standard_normal((2, 4, 7, 5))

    def loss(q):
        return float((sdpa(q, k, v, enable_gqa=True, score_mod=t5_bias, mod_args=(table,),
                           mask_mod=causal) * go).sum())

    _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True, score_mod=t5_bias,
                                         mod_args=(table,), mask_mod=causal,
                                         implementation=implementation)
    dq = pullback(go)[0]
    eps = 1e-6
    for index in [(0, 0, 0, 0), (1, 3, 6, 7), (0, 2, 3, 1)]:
        e = np.zeros_like(q)
        e[index] = eps
        assert abs((loss(q + e) - loss(q - e)) / (2 * eps) - dq[index]) < 1e-7


def test_mod_args_gradients_on_every_library(xp, device):
    """The pullback's gradient of a floating table is the same on every library (the
    score on the left of its operators: array-api-strict's arrays refuse the right)."""
    rng = np.random.default_rng(52)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    table, go = rng.random(2), rng.standard_normal((1, 2, 6, 4))
    rules = (lambda s, b, h, i, j, t: s * t[h] + t[h] * 0.5,
             lambda s, b, h, i, j, t: s * t[h] * t[h])
    for rule in rules:
        want = polyattn.attention_vjp(q, k, v, score_mod=rule, mod_args=(table,),
                                      mask_mod=causal)[1](go)[-1]
        args = [to_xp(a, xp, dtype="float64", device=device) for a in (q, k, v, table, go)]
        _, pullback = polyattn.attention_vjp(*args[:3], score_mod=rule, mod_args=(args[3],),
                                             mask_mod=causal)
        assert rel_error(to_numpy(pullback(args[4])[-1]), want) <= 1e-12


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", ["reference", "chunked", "numba_cpu"])
def test_vjp_gives_the_floating_mod_args_gradients(name, monkeypatch):
    """The pullback returns (dq, dk, dv, dsinks, then each floating mod_args array's
    gradient): learned ALiBi slopes and a T5 table against central differences; an
    integer table gets none."""
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    rng = np.random.default_rng(49)
    q, k, v = _inputs(rng)
    slopes, table, sinks = rng.random(4), rng.standard_normal((4, 9)), rng.standard_normal(4)
    offsets = np.array([0, 1, 0, 2, 1, 0, 0, 1, 2])              # integer: no gradient
    go = rng.standard_normal((2, 4, 7, 5))

    def rule(s, b, h, i, j, sl, tb, off):
        return t5_bias(alibi(s, b, h, i, j, sl), b, h, i + off[j], j, tb)

    def loss(sl, tb):
        return float((sdpa(q, k, v, enable_gqa=True, score_mod=rule, mask_mod=causal,
                           sinks=sinks, mod_args=(sl, tb, offsets),
                           implementation="reference") * go).sum())

    _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True, score_mod=rule,
                                         mask_mod=causal, sinks=sinks,
                                         mod_args=(slopes, table, offsets),
                                         implementation=implementation)
    grads = pullback(go)
    assert len(grads) == 6
    dslopes, dtable = grads[4:]
    assert dslopes.shape == slopes.shape and dtable.shape == table.shape
    eps = 1e-6
    for which, x, got in ((0, slopes, dslopes), (1, table, dtable)):
        for index in np.ndindex(x.shape) if x.ndim == 1 else [(0, 4), (3, 0), (2, 8)]:
            e = np.zeros_like(x)
            e[index] = eps
            args = [slopes, table]
            plus, minus = list(args), list(args)
            plus[which], minus[which] = x + e, x - e
            want = (loss(*plus) - loss(*minus)) / (2 * eps)
            assert abs(want - got[index]) < 1e-7 * max(1.0, abs(want))


@pytest.mark.skipif(Backend.TORCH not in selected_backends(), reason="torch session")
@pytest.mark.parametrize("name", ["reference", "chunked", "auto"])
def test_torch_autograd_through_the_functions_and_mod_args(name, monkeypatch):
    """Learned ALiBi slopes and a learned T5 table get their gradients, equal to those of
    the explicit formula."""
    import torch

    implementation = use_implementation(name, Backend.TORCH, monkeypatch)
    rng = np.random.default_rng(45)
    q, k, v = _inputs(rng)
    slopes, table = rng.random(4), rng.standard_normal((4, 9))

    def leaves():
        return [torch.tensor(a, requires_grad=True) for a in (q, k, v, slopes, table)]

    ours, theirs = leaves(), leaves()

    def both(s, b, h, i, j, sl, tb):
        return t5_bias(alibi(s, b, h, i, j, sl), b, h, i, j, tb)

    out = sdpa(*ours[:3], enable_gqa=True, score_mod=both, mask_mod=causal,
               mod_args=tuple(ours[3:]), implementation=implementation)
    qt, kt, vt, st, tt = theirs
    kk, vv = kt.repeat_interleave(2, dim=1), vt.repeat_interleave(2, dim=1)
    i, j = torch.arange(7)[:, None], torch.arange(9)[None, :]
    s = qt @ kk.transpose(-1, -2) / np.sqrt(8)
    s = s - st[:, None, None] * (i - j).abs() + tt[:, (i - j).clamp(-4, 4) + 4]
    s = s.masked_fill(i < j, -torch.inf)
    ref = torch.softmax(s, -1) @ vv
    go = torch.tensor(rng.standard_normal((2, 4, 7, 5)))
    (out * go).sum().backward()
    (ref * go).sum().backward()
    assert rel_error(out.detach().numpy(), ref.detach().numpy()) <= 1e-12
    for a, b in zip(ours, theirs, strict=True):
        assert rel_error(a.grad.numpy(), b.grad.numpy()) <= 1e-10


@pytest.mark.skipif(Backend.TORCH not in selected_backends(), reason="torch session")
def test_torch_cpu_tensors_keep_user_rules_in_torch():
    """On torch CPU tensors, "chunked" with user rules is the Array-API blocked path (autograd
    differentiates the rules and their mod_args there), not the NumPy fast path's views."""
    import torch

    q = torch.zeros((1, 2, 6, 4))
    e = polyattn.explain(q, q, q, mask_mod=causal, implementation="chunked")
    assert e.module == "polyattn.backends.array_api.blocked"
    assert polyattn.explain(q, q, q, is_causal=True,
                            implementation="chunked").module.endswith("numpy.forward")


@pytest.mark.skipif(Backend.JAX not in selected_backends(), reason="JAX session")
@pytest.mark.parametrize("name", ["reference", "chunked"])
def test_jax_grad_under_jit(name, monkeypatch):
    import jax
    import jax.numpy as jnp

    implementation = use_implementation(name, Backend.JAX, monkeypatch)
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(46)
    q, k, v = _inputs(rng)
    table = rng.standard_normal((4, 9))
    go = rng.standard_normal((2, 4, 7, 5))
    kj, vj = jnp.asarray(k), jnp.asarray(v)

    @jax.jit
    def loss(q, table):
        return jnp.sum(sdpa(q, kj, vj, enable_gqa=True, score_mod=t5_bias, mask_mod=causal,
                            mod_args=(table,), implementation=implementation) * go)

    dq, dtable = jax.grad(loss, argnums=(0, 1))(jnp.asarray(q), jnp.asarray(table))
    _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True, score_mod=t5_bias,
                                         mask_mod=causal, mod_args=(table,))
    assert rel_error(np.asarray(dq), pullback(go)[0]) <= 1e-10
    assert np.abs(np.asarray(dtable)).sum() > 0


def test_dask_stays_lazy():
    if Backend.DASK not in selected_backends():
        pytest.skip("Dask session")
    import dask
    import dask.array as da

    rng = np.random.default_rng(47)
    q, k, v = _inputs(rng)
    table = rng.standard_normal((4, 9))
    calls = []

    def count(*args, **kwargs):
        calls.append(1)
        return dask.get(*args, **kwargs)

    x = [da.from_array(a, chunks=(1, 2, 4, a.shape[-1])) for a in (q, k, v)]
    with dask.config.set(scheduler=count):
        out = sdpa(*x, enable_gqa=True, score_mod=t5_bias, mask_mod=causal, mod_args=(table,))
        assert isinstance(out, da.Array) and not calls
    ref = sdpa(q, k, v, enable_gqa=True, score_mod=t5_bias, mask_mod=causal,
               mod_args=(table,))
    np.testing.assert_allclose(out.compute(), ref, rtol=1e-12, atol=1e-13)


@NUMPY_SESSION_ONLY
def test_errors_name_the_function_at_the_call():
    q = np.zeros((1, 2, 4, 8))

    def branchy(score, b, h, q_idx, kv_idx):
        if score > 0:
            return score
        return 0.0 * score

    def unknown(score, b, h, q_idx, kv_idx):
        return np.frobnicate(score)

    with pytest.raises(TypeError, match=r"score_mod .*branchy.*ops\.where"):
        sdpa(q, q, q, score_mod=branchy)
    with pytest.raises(TypeError, match=r"score_mod .*unknown.*frobnicate"):
        sdpa(q, q, q, score_mod=unknown)
    with pytest.raises(TypeError, match=r"mask_mod .* must return a boolean array"):
        sdpa(q, q, q, mask_mod=lambda b, h, i, j: i - j)
    with pytest.raises(TypeError, match="`score_mod` must be a function"):
        sdpa(q, q, q, score_mod=3.0)
    with pytest.raises(TypeError, match=r"`mod_args` must be a tuple.*\(array,\)"):
        sdpa(q, q, q, score_mod=softcap, mod_args=np.zeros(3))
    with pytest.raises(ValueError, match="pass one of"):
        sdpa(q, q, q, mod_args=(np.zeros(3),))
    with pytest.raises(ValueError, match="not Dask arrays"):
        sdpa(q, q, q, score_mod=softcap, implementation="distributed")


def test_ops_on_numbers_and_derivatives():
    from polyattn.ops import Dual

    assert ops.where(True, 1.0, 2.0) == 1.0 and ops.maximum(1.0, 3.0) == 3.0
    x = Dual(np.array([-1.0, 0.5, 2.0]), np.ones(3))
    y = ops.where(x > 0, ops.exp(x) * 2.0, ops.tanh(x)) + ops.abs(x) / 4
    expected = np.where(x.x > 0, 2 * np.exp(x.x), 1 - np.tanh(x.x) ** 2) + np.sign(x.x) / 4
    np.testing.assert_allclose(y.d, expected)
    with pytest.raises(TypeError, match=r"ops\.where"):
        bool(x)


# --------------------------------------------------------------------------- #
# Block masks
# --------------------------------------------------------------------------- #

def test_block_mask_kinds_and_repr():
    bm = polyattn.block_mask(causal, None, None, 512, 640, block=(128, 128))
    assert bm.kinds.shape == (1, 4, 5)
    assert bm.counts == {"empty": 10, "partial": 4, "full": 6}
    assert "10 empty" in repr(bm)
    docs = np.repeat(np.arange(4), 64)[None]                         # (1, 256), 4 documents
    bd = polyattn.block_mask(lambda b, h, i, j, ids: ids[b, i] == ids[b, j], (1,), None,
                             256, 256, mod_args=(docs,), block=(64, 64))
    assert bd.counts == {"empty": 12, "partial": 0, "full": 4}


def test_block_mask_rows():
    """Per query row: the first visible key, one past the last, and whether every key
    between them is visible (a causal or document row is; a row with holes is not; a row
    seeing nothing is (0, 0), solid)."""
    bm = polyattn.block_mask(causal, None, None, 5, 7, block=(2, 3))
    assert bm.rows.shape == (1, 5, 3)
    np.testing.assert_array_equal(bm.rows[0], [[0, i + 1, 1] for i in range(5)])

    def holes(b, h, q_idx, kv_idx, ids):
        same = ids[b, q_idx] == ids[b, kv_idx]
        return ops.logical_and(same, ops.logical_and(q_idx >= kv_idx,
                                                     (q_idx - kv_idx + h) % 3 != 1))

    ids = np.array([[0, 0, 0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0, 0]])
    bd = polyattn.block_mask(holes, (2,), 2, 8, 8, mod_args=(ids,), block=(4, 4))
    assert bd.rows.shape == (2, 2, 8, 3)
    seen = np.stack([[[(ids[b, i] == ids[b, j]) and i >= j and (i - j + h) % 3 != 1
                       for j in range(8)] for i in range(8)] for b in range(2)
                     for h in range(2)]).reshape(2, 2, 8, 8)
    for b, h, i in np.ndindex(2, 2, 8):
        keys = np.flatnonzero(seen[b, h, i])
        want = ([keys[0], keys[-1] + 1, int(len(keys) == keys[-1] + 1 - keys[0])]
                if len(keys) else [0, 0, 1])
        assert bd.rows[b, h, i].tolist() == want, (b, h, i)
    assert bd.rows[..., 2].min() == 0 and bd.rows[..., 2].max() == 1


def _count_tiles(path, monkeypatch):
    """Record the tiles of scores ``path`` ("array_api": the blocked path, "numpy": the
    NumPy fast path) computes, as ((first row, end), (first key, end)) of each; and make
    ``"chunked"`` on NumPy arrays run that path."""
    tiles = []
    if path == "array_api":
        from polyattn.backends import numpy as numpy_family
        from polyattn.backends.array_api import blocked

        # the NumPy path not lowering mask_mod, "chunked" runs the blocked path
        monkeypatch.setattr(numpy_family.FastPath, "RULES",
                            numpy_family.FastPath.RULES - {"mask_mod"})
        monkeypatch.setattr(blocked, "BLOCK_Q", 64)
        monkeypatch.setattr(blocked, "BLOCK_K", 64)
        real = blocked.score_transform

        def spy(s, rules, mask, q0, q1, k0, k1, *a, **kw):
            tiles.append(((q0, q1), (k0, k1)))
            return real(s, rules, mask, q0, q1, k0, k1, *a, **kw)

        monkeypatch.setattr(blocked, "score_transform", spy)
        return tiles
    from polyattn.backends.numpy import backward, forward, plan

    monkeypatch.setattr(plan, "BLOCK_Q", 128)          # 64 float64 rows
    monkeypatch.setattr(plan, "BLOCK_K", 64)
    monkeypatch.setattr(backward, "FUSED_MIN_PAIRS", 1)   # one pass: each tile once
    for module in (forward, backward):
        real_scores = module._scores

        def spy_scores(p, it, qe, ke, m, r0, r1, k0, k1, *a, real=real_scores, **kw):
            tiles.append(((it.q0 + r0, it.q0 + r1), (k0, k1)))
            return real(p, it, qe, ke, m, r0, r1, k0, k1, *a, **kw)

        monkeypatch.setattr(module, "_scores", spy_scores)
    return tiles


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("path", ["array_api", "numpy"])
def test_chunked_skips_empty_tiles_and_the_mask_inside_full_ones(path, monkeypatch):
    """Both paths behind "chunked" compute only the 4 diagonal tiles of 16 of a block
    mask of 4 documents (per key/value head on the NumPy path, which computes heads
    apart), forward and backward, and never call the mask_mod: every such tile is full."""
    rng = np.random.default_rng(48)
    q, k, v = (rng.standard_normal((1, 2, 256, 8)) for _ in range(3))
    docs = np.repeat(np.arange(4), 64)[None]
    evaluated = []

    def document(b, h, q_idx, kv_idx, ids):
        evaluated.append(np.broadcast_shapes(np.shape(q_idx), np.shape(kv_idx)))
        return ids[b, q_idx] == ids[b, kv_idx]

    bm = polyattn.block_mask(document, (1,), None, 256, 256, mod_args=(docs,), block=(64, 64))
    tiles = _count_tiles(path, monkeypatch)
    module = polyattn.explain(q, k, v, block_mask=bm, implementation="chunked").module
    assert module.endswith("array_api.blocked" if path == "array_api" else "numpy.forward")
    evaluated.clear()
    out = sdpa(q, k, v, block_mask=bm, implementation="chunked")
    per_pass = 4 if path == "array_api" else 8    # the NumPy path: each of the 2 heads
    diagonal = {((i, i + 64), (i, i + 64)) for i in range(0, 256, 64)}
    assert len(tiles) == per_pass and set(tiles) == diagonal
    assert evaluated == [(2, 2)]                  # the call's probe only: all 4 are full
    ref = sdpa(q, k, v, segment_ids=docs, implementation="reference")
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)
    tiles.clear()
    _, pullback = polyattn.attention_vjp(q, k, v, block_mask=bm, implementation="chunked")
    grads = pullback(np.ones_like(out))
    assert len(tiles) == 2 * per_pass and set(tiles) == diagonal   # forward, backward
    assert evaluated == [(2, 2), (2, 2)]
    _, reference = polyattn.attention_vjp(q, k, v, segment_ids=docs, implementation="reference")
    for a, b in zip(grads, reference(np.ones_like(out)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


@NUMPY_SESSION_ONLY
def test_block_mask_errors():
    q = np.zeros((1, 2, 8, 4))
    bm = polyattn.block_mask(causal, None, None, 16, 16)
    with pytest.raises(ValueError, match=r"built for Tq = 16, Tk = 16; this call has Tq = 8"):
        sdpa(q, q, q, block_mask=bm)
    with pytest.raises(TypeError, match="`block_mask` must be a BlockMask"):
        sdpa(q, q, q, block_mask=np.zeros((1, 1)))
    with pytest.raises(ValueError, match=r"built for batch \(3,\)"):
        sdpa(q, q, q, block_mask=polyattn.block_mask(causal, (3,), 2, 8, 8))
    with pytest.raises(ValueError, match="`block` must be"):
        polyattn.block_mask(causal, None, None, 8, 8, block=(0, 4))
    with pytest.raises(TypeError, match="`mask_mod` must be a function"):
        polyattn.block_mask(None, None, None, 8, 8)


@pytest.mark.skipif(Backend.JAX not in selected_backends(), reason="JAX session")
def test_jax_vmap_over_the_batch():
    import jax
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(49)
    q, k, v = (jnp.asarray(rng.standard_normal((3, 2, 6, 4))) for _ in range(3))
    table = jnp.asarray(rng.standard_normal((2, 9)))

    def f(q, k, v):
        return sdpa(q, k, v, score_mod=t5_bias, mod_args=(table,), mask_mod=causal,
                    sinks=jnp.zeros(2))

    np.testing.assert_allclose(np.asarray(jax.vmap(f)(q, k, v)), np.asarray(f(q, k, v)),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(Backend.JAX not in selected_backends(), reason="JAX session")
def test_jax_without_64_bit_types_rules_run_without_warnings():
    """With JAX's default 32-bit types, a rule's indices are int32 (asking for int64 would
    warn at every call) and the results are the rule's."""
    import warnings

    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(50)
    q, k, v = (rng.standard_normal((1, 2, 12, 4)).astype(np.float32) for _ in range(3))
    table = rng.standard_normal((2, 9)).astype(np.float32)
    kw = dict(score_mod=t5_bias, mask_mod=causal)
    want = sdpa(q, k, v, mod_args=(table,), implementation="reference", **kw)
    with jax.enable_x64(False), warnings.catch_warnings():
        warnings.simplefilter("error")
        jq, jk, jv, jt = (jnp.asarray(x) for x in (q, k, v, table))
        for implementation in ("reference", "chunked", "auto"):
            got = sdpa(jq, jk, jv, mod_args=(jt,), implementation=implementation, **kw)
            assert_close(got, want, "float32")
        grad = jax.grad(lambda t: sdpa(jq, jk, jv, mod_args=(t,), **kw).sum())(jt)
        assert grad.dtype == jnp.float32 and bool(jnp.isfinite(grad).all())


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", ["chunked", "numba_cpu", "numba_cuda-rows"])
def test_a_mask_mod_hiding_every_key_of_some_rows(name, monkeypatch):
    """Rows whose every key the mask_mod hides give 0 and lse -inf, gradients 0."""
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    rng = np.random.default_rng(48)
    q, k, v = _inputs(rng)

    def odd_rows_see_nothing(b, h, q_idx, kv_idx):
        return ops.logical_and(q_idx % 2 == 0, kv_idx <= q_idx + 1)

    out, lse = sdpa(q, k, v, enable_gqa=True, return_lse=True, implementation=implementation,
                    mask_mod=odd_rows_see_nothing)
    ref, ref_lse = sdpa(q, k, v, enable_gqa=True, return_lse=True, implementation="reference",
                        mask_mod=odd_rows_see_nothing)
    assert np.all(np.asarray(out)[..., 1::2, :] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[..., 1::2]))
    assert_close(out, ref, "float64")
    assert_lse_close(lse, ref_lse, "float64")
    _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True, implementation=implementation,
                                         mask_mod=odd_rows_see_nothing)
    _, reference = polyattn.attention_vjp(q, k, v, enable_gqa=True, implementation="reference",
                                          mask_mod=odd_rows_see_nothing)
    go = rng.standard_normal((2, 4, 7, 5))
    for a, b in zip(pullback(go)[:3], reference(go), strict=True):
        assert rel_error(a, b) <= 1e-12


#: The CUDA kernel families that take more than 16 query rows (and apply user rules).
LONG_FAMILIES = ["numba_cuda-tiled", "numba_cuda-tc"]


def _long_inputs(rng):
    """Inputs the register-tiled and tensor-core kernels take (more than 16 query rows)."""
    return (rng.standard_normal((1, 2, 20, 8)), rng.standard_normal((1, 1, 23, 8)),
            rng.standard_normal((1, 1, 23, 5)))


def _long_dtype(name):
    return "float32" if name == "numba_cuda-tc" else "float64"


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", LONG_FAMILIES)
@pytest.mark.parametrize("call", [
    "softcap+causal+alibi",
    # a table lookup and index arithmetic in a mask_mod: the kernels take them as they take
    # the case above (and test_long_families_t5_table_and_rows_seeing_nothing reads a table)
    pytest.param("key_lengths", marks=pytest.mark.exhaustive),
    pytest.param("window", marks=pytest.mark.exhaustive)])
def test_long_families_apply_user_rules(name, call, monkeypatch):
    """The register-tiled (and tensor-core) kernels: forward, lse and gradients of a
    user rule equal the built-in rule's, on the reference."""
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    import array_api_compat.numpy as np_xp

    dtype = _long_dtype(name)
    rng = np.random.default_rng(50)
    slopes = rng.random(2)
    q, k, v = (a.astype(dtype) for a in _long_inputs(rng))
    user, built_in = (_on(o, np_xp, None, dtype, slopes) for o in CALLS[call])
    if call == "key_lengths":
        user["mod_args"] = (np.array([17]),)
        built_in["key_lengths"] = np.array([17])
    cuda_family_ran(name, polyattn.explain(q, k, v, enable_gqa=True,
                                           implementation=implementation, **user))
    out, lse = sdpa(q, k, v, enable_gqa=True, return_lse=True, implementation=implementation,
                    **user)
    ref, ref_lse = sdpa(*(a.astype(np.float64) for a in (q, k, v)), enable_gqa=True,
                        return_lse=True, implementation="reference", **built_in)
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    if name == "numba_cuda-tc" and SIMULATOR:
        return      # its backward pass is the register-tiled one, which numba_cuda-tiled runs
    _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True,
                                         implementation=implementation, **user)
    _, reference = polyattn.attention_vjp(*(a.astype(np.float64) for a in (q, k, v)),
                                          enable_gqa=True, implementation="reference",
                                          **built_in)
    go = rng.standard_normal((1, 2, 20, 5))
    for a, b in zip(pullback(go.astype(dtype))[:3], reference(go)[:3], strict=True):
        assert rel_error(a, b) <= (1e-12 if dtype == "float64" else 1e-4)


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", LONG_FAMILIES)
def test_long_families_t5_table_and_rows_seeing_nothing(name, monkeypatch):
    """A T5 relative-bias table (against the same bias as a float mask) with a mask_mod
    that hides every key of the odd rows: 0 and lse -inf there, gradients against the
    float64 reference."""
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    dtype = _long_dtype(name)
    rng = np.random.default_rng(51)
    q, k, v = (a.astype(dtype) for a in _long_inputs(rng))
    table = rng.standard_normal((2, 9)).astype(dtype)

    def odd_rows_see_nothing(b, h, q_idx, kv_idx, table):
        return ops.logical_and(q_idx % 2 == 0, kv_idx <= q_idx + 1)

    user = {"score_mod": t5_bias, "mask_mod": odd_rows_see_nothing, "mod_args": (table,)}
    cuda_family_ran(name, polyattn.explain(q, k, v, enable_gqa=True,
                                           implementation=implementation, **user))
    out, lse = sdpa(q, k, v, enable_gqa=True, return_lse=True, implementation=implementation,
                    **user)
    distance = np.clip(np.arange(20)[:, None] - np.arange(23)[None, :], -4, 4) + 4
    bias = table.astype(np.float64)[:, distance][None]                # (1, H, Tq, Tk)
    seen = (np.arange(20)[:, None] % 2 == 0) & (np.arange(23)[None, :]
                                               <= np.arange(20)[:, None] + 1)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    ref, ref_lse = sdpa(q64, k64, v64, enable_gqa=True, return_lse=True,
                        attn_mask=np.where(seen, bias, -np.inf), implementation="reference")
    assert np.all(np.asarray(out)[..., 1::2, :] == 0)
    assert np.all(np.isneginf(np.asarray(lse)[..., 1::2]))
    assert_close(out, np.nan_to_num(ref), dtype)
    assert_lse_close(lse, ref_lse, dtype)
    if name == "numba_cuda-tc" and SIMULATOR:
        return      # its backward pass is the register-tiled one, which numba_cuda-tiled runs
    _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True, implementation=implementation,
                                         **user)
    _, reference = polyattn.attention_vjp(q64, k64, v64, enable_gqa=True,
                                          implementation="reference",
                                          **{**user, "mod_args": (table.astype(np.float64),)})
    go = rng.standard_normal((1, 2, 20, 5))
    for a, b in zip(pullback(go.astype(dtype))[:3], reference(go)[:3], strict=True):
        assert rel_error(a, b) <= (1e-12 if dtype == "float64" else 1e-4)


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", ["numba_cuda-rows", *LONG_FAMILIES])
def test_cuda_kernels_skip_empty_tiles_and_the_mask_inside_full_ones(name, monkeypatch):
    """Each CUDA kernel family reads the block mask: built for one table of a mask_mod
    (keys 0-63 full, 64-127 empty, 128-139 partial, in blocks of 12 rows × 16 keys,
    unlike any kernel's tiles), it is passed with another table that shows every key
    of the empty blocks and hides some of the full ones. Kernels that never compute
    an empty tile and never evaluate the mask_mod in a full one give the first table's
    result, forward, lse and gradients; tiles that touch a partial block evaluate it
    (the tables agree there)."""
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    dtype = _long_dtype(name)
    rng = np.random.default_rng(52)
    tq, tk = 20, 140
    q, k, v = (rng.standard_normal(s).astype(dtype)
               for s in ((1, 2, tq, 8), (1, 1, tk, 8), (1, 1, tk, 5)))
    i, j = np.arange(tq)[:, None], np.arange(tk)[None, :]
    honest = (j < 64) | ((j >= 128) & (j <= i + 128))
    other = (honest | ((j >= 64) & (j < 128))) & ~((j < 64) & ((i + j) % 3 == 0))

    def by_table(b, h, q_idx, kv_idx, table):
        return table[q_idx, kv_idx] > 0

    bm = polyattn.block_mask(by_table, None, None, tq, tk, mod_args=(honest.astype(np.int64),),
                             block=(12, 16))
    assert all(bm.counts.values())                     # empty, partial and full blocks
    user = {"mask_mod": by_table, "mod_args": (other.astype(np.int64),), "block_mask": bm}
    cuda_family_ran(name, polyattn.explain(q, k, v, enable_gqa=True,
                                           implementation=implementation, **user))
    out, lse = sdpa(q, k, v, enable_gqa=True, return_lse=True, implementation=implementation,
                    **user)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    ref, ref_lse = sdpa(q64, k64, v64, enable_gqa=True, return_lse=True, attn_mask=honest,
                        implementation="reference")
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    if name == "numba_cuda-tc":
        return                       # its gradients are the register-tiled kernels' (above)
    _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True,
                                         implementation=implementation, **user)
    _, reference = polyattn.attention_vjp(q64, k64, v64, enable_gqa=True, attn_mask=honest,
                                          implementation="reference")
    go = rng.standard_normal((1, 2, tq, 5))
    for a, b in zip(pullback(go.astype(dtype))[:3], reference(go), strict=True):
        assert rel_error(a, b) <= 1e-12


#: The recipes of docs/rules.rst, each as (polyattn's score_mod, mask_mod, mod_args as NumPy
#: arrays) and FlexAttention's (score_mod, mask_mod) over the same tables as torch tensors.
def _recipes():
    docs = np.array([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])
    prefix, slopes = np.array([3, 6]), polyattn.alibi_slopes(4)
    table = np.random.default_rng(53).standard_normal((4, 9))

    def t5(s, b, h, i, j, tb):
        return s + tb[h, ops.minimum(ops.maximum(i - j, -4), 4) + 4]

    return {
        "causal": (None, causal, (), None, lambda t: lambda b, h, i, j: i >= j),
        "sliding_window": (None, lambda b, h, i, j: ops.logical_and(i >= j, i - j <= 3), (),
                           None, lambda t: lambda b, h, i, j: (i >= j) & (i - j <= 3)),
        "document": (None, lambda b, h, i, j, ids: ids[b, i] == ids[b, j], (docs,), None,
                     lambda t: lambda b, h, i, j: t[0][b, i] == t[0][b, j]),
        "prefix_lm": (None, lambda b, h, i, j, p: ops.logical_or(j < p[b], i >= j), (prefix,),
                      None, lambda t: lambda b, h, i, j: (j < t[0][b]) | (i >= j)),
        "softcap": (lambda s, b, h, i, j: 30.0 * ops.tanh(s / 30.0), None, (),
                    lambda t: lambda s, b, h, i, j: 30.0 * (s / 30.0).tanh(), None),
        "alibi": (lambda s, b, h, i, j, sl: s - sl[h] * ops.abs(i - j), None, (slopes,),
                  lambda t: lambda s, b, h, i, j: s - t[0][h] * (i - j).abs(), None),
        "t5": (t5, None, (table,),
               lambda t: lambda s, b, h, i, j: s + t[0][h, (i - j).clamp(-4, 4) + 4], None),
    }


@pytest.mark.skipif(Backend.TORCH not in selected_backends(), reason="torch session")
@pytest.mark.parametrize("recipe", sorted(_recipes()))
def test_recipes_against_flex_attention(recipe):
    """Each recipe of docs/rules.rst on torch tensors equals torch's own flex_attention
    (eager, float64) with the same functions written in torch."""
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    score_mod, mask_mod, mod_args, flex_score, flex_mask = _recipes()[recipe]
    rng = np.random.default_rng(54)
    q, k, v = (torch.tensor(rng.standard_normal((2, 4, 12, 8))) for _ in range(3))
    tables = tuple(torch.tensor(a) for a in mod_args)
    ours = sdpa(q, k, v, score_mod=score_mod, mask_mod=mask_mod, mod_args=tables)
    block = None if flex_mask is None else flex.create_block_mask(
        flex_mask(tables), 2, 4, 12, 12, device="cpu")
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        theirs = flex.flex_attention(q, k, v, score_mod=None if flex_score is None
                                     else flex_score(tables), block_mask=block)
    assert rel_error(ours.numpy(), theirs.numpy()) <= 1e-12
