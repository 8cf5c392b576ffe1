"""``segment_ids``: packed sequences (DESIGN §3.2).

Key ``j`` is visible to query ``i`` only if their segment ids are equal, combined
with every other rule. Checked on every backend and implementation against the
same call with the equivalent boolean ``attn_mask`` (and a float64 oracle),
forward, log-sum-exp and gradients; the key ranges that the blocked paths visit
(packed documents cost the sum of their squared lengths where the ids are at
hand and sorted); ``jax.jit`` with traced ids; Dask laziness; errors. ``numba_cpu``
and ``numba_cuda`` lower sorted ids as key ranges and refuse unsorted ones by name,
which is checked, and ``"auto"`` passes them over; the NumPy fast path lowers sorted
ids as key ranges and compares unsorted ones in each tile.
"""

from __future__ import annotations

import numpy as np
import pytest
from _support import CASES, NUMPY_SESSION_ONLY, cuda_family_ran, rounded, use_implementation
from helpers import (
    Backend,
    assert_close,
    assert_lse_close,
    ref_attention,
    rel_error,
    selected_backends,
    to_xp,
)

import polyattn
from polyattn._problem import prepare

sdpa = polyattn.scaled_dot_product_attention
#: Implementations that refuse segment ids by name (they do not lower them yet).
REFUSING: tuple[str, ...] = ()
#: Implementations that lower sorted ids only (as key ranges), refusing unsorted ones by name.
SORTED_ONLY = ("numba_cpu", "numba_cuda")


@pytest.fixture(params=CASES)
def implementation(request, backend, xp, device, monkeypatch):
    name = use_implementation(request.param, backend, monkeypatch)
    if name in REFUSING:
        q = to_xp(np.zeros((1, 1, 2, 2)), xp, device=device)
        ids = to_xp(np.zeros((1, 2), dtype=np.int64), xp, device=device)
        with pytest.raises(ValueError, match="does not apply segment_ids"):
            sdpa(q, q, q, segment_ids=ids, implementation=name)
        assert polyattn.explain(q, q, q, segment_ids=ids).implementation not in REFUSING
        pytest.skip(f"{name} refuses segment_ids (checked)")
    return name


#: Packed rows: three documents, and two (the second row), sorted.
SEGMENTS = np.array([[0] * 5 + [1] * 4 + [2] * 3, [4] * 2 + [7] * 10])


def same_segment(q_ids, k_ids):
    return q_ids[:, None, :, None] == k_ids[:, None, None, :]        # (B, 1, Tq, Tk)


CALLS = {
    "plain": {},
    "causal": {"is_causal": True},
    "window+alibi": {"is_causal": True, "window": (3, 0), "alibi_slopes": "slopes"},
    "lengths+softcap": {"key_lengths": np.array([12, 7]), "softcap": 2.0},
    "mask": {"attn_mask": "mask"},
}


def _options(call, rng, xp, device, dtype_name):
    """(polyattn keywords without the ids, the same as the oracle's, bool mask or None)."""
    ours, theirs, mask = {}, {}, None
    for name, value in CALLS[call].items():
        if isinstance(value, str) and value == "slopes":
            slopes = rng.random(4)
            ours[name], theirs[name] = to_xp(slopes, xp, dtype=dtype_name, device=device), \
                rounded(slopes, dtype_name)
        elif isinstance(value, str) and value == "mask":
            mask = rng.random((2, 4, 12, 12)) < 0.7
            ours[name] = to_xp(mask, xp, device=device)
        elif isinstance(value, np.ndarray):
            ours[name], theirs[name] = to_xp(value, xp, device=device), value
        else:
            ours[name] = theirs[name] = value
    return ours, theirs, mask


@pytest.mark.parametrize("call", sorted(CALLS))
def test_against_the_equivalent_mask(xp, device, dtype_name, implementation, call):
    rng = np.random.default_rng(31)
    q, k, v = (rng.standard_normal(s) for s in ((2, 4, 12, 8), (2, 2, 12, 8), (2, 2, 12, 5)))
    ours, theirs, mask = _options(call, rng, xp, device, dtype_name)
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, v)]
    ids = to_xp(SEGMENTS, xp, device=device)
    with_lse = implementation != "native"
    result = sdpa(*args, segment_ids=ids, enable_gqa=True, return_lse=with_lse,
                  implementation=implementation, **ours)
    out, lse = result if with_lse else (result, None)
    full = same_segment(SEGMENTS, SEGMENTS)
    full = full if mask is None else full & mask
    ref, ref_lse, _ = ref_attention(*(rounded(a, dtype_name) for a in (q, k, v)), mask=full,
                                    enable_gqa=True, **theirs)
    assert_close(out, ref, dtype_name)
    if with_lse:
        assert_lse_close(lse, ref_lse, dtype_name)


@pytest.mark.parametrize("ids", [[[0, 1, 0, 1, 2, 0], [5, 5, 0, 0, 0, 0]],
                                 [[0, 0, 1, 1, 2, 2], [0, 3, 3, 3, 3, 3]]],
                         ids=["unsorted", "sorted"])
def test_unsigned_ids(xp, device, dtype_name, implementation, ids):
    """uint8 ids, which a difference of neighbours would wrap: unsorted ones are told from
    sorted ones (then they act as a mask, where the implementation takes them)."""
    rng = np.random.default_rng(33)
    q, k, v = (rng.standard_normal((2, 2, 6, 4)) for _ in range(3))
    ids = np.array(ids, dtype=np.uint8)
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, v)]
    seg = to_xp(ids, xp, device=device)
    unsorted = bool((ids[:, 1:] < ids[:, :-1]).any())
    if unsorted and implementation in SORTED_ONLY:
        with pytest.raises(ValueError, match="these are not sorted"):
            sdpa(*args, segment_ids=seg, implementation=implementation)
        implementation = "auto"                 # which passes it over
    out = sdpa(*args, segment_ids=seg, implementation=implementation)
    ref, _, _ = ref_attention(*(rounded(a, dtype_name) for a in (q, k, v)),
                              mask=same_segment(ids, ids))
    assert_close(out, ref, dtype_name)


@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_a_pair_for_queries_and_keys(xp, device, dtype_name, implementation, order):
    """Cross-attention over packed keys: Tq != Tk, one id array each; ids need not be
    sorted (then they act as a mask, where the implementation takes them)."""
    rng = np.random.default_rng(32)
    q, k, v = (rng.standard_normal(s) for s in ((2, 2, 5, 4), (2, 2, 9, 4), (2, 2, 9, 4)))
    q_ids = np.array([[0, 0, 1, 1, 1], [1, 1, 3, 3, 3] if order == "sorted" else [3, 1, 3, 1, 3]])
    k_ids = np.array([[0, 0, 0, 1, 1, 1, 1, 2, 2], [1, 1, 3, 3, 3, 3, 3, 3, 3]])
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, v)]
    ids = (to_xp(q_ids, xp, device=device), to_xp(k_ids, xp, device=device))
    if order == "unsorted" and implementation in SORTED_ONLY:
        with pytest.raises(ValueError, match="these are not sorted"):
            sdpa(*args, segment_ids=ids, implementation=implementation)
        implementation = "auto"                 # which passes it over
    out = sdpa(*args, segment_ids=ids, implementation=implementation)
    ref, _, _ = ref_attention(*(rounded(a, dtype_name) for a in (q, k, v)),
                              mask=same_segment(q_ids, k_ids))
    assert_close(out, ref, dtype_name)


def test_attention_weights(xp, device, dtype_name):
    rng = np.random.default_rng(33)
    q, k = rng.standard_normal((2, 1, 12, 4)), rng.standard_normal((2, 1, 12, 4))
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k)]
    w = polyattn.attention_weights(*args, segment_ids=to_xp(SEGMENTS, xp, device=device),
                                   is_causal=True)
    _, _, ref = ref_attention(*(rounded(a, dtype_name) for a in (q, k, k)), is_causal=True,
                              mask=same_segment(SEGMENTS, SEGMENTS))
    assert_close(w, ref, dtype_name, what="weights")


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", ["reference", "chunked"])
@pytest.mark.parametrize("dtype_name", ["float32", "float64"])
def test_vjp_equals_the_vjp_of_the_equivalent_mask(name, dtype_name, monkeypatch):
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    rng = np.random.default_rng(34)
    q, k, v = (rng.standard_normal((2, 2, 12, 4)).astype(dtype_name) for _ in range(3))
    go = rng.standard_normal((2, 2, 12, 4)).astype(dtype_name)
    _, pullback = polyattn.attention_vjp(q, k, v, segment_ids=SEGMENTS, is_causal=True,
                                         implementation=implementation)
    _, masked = polyattn.attention_vjp(q, k, v, attn_mask=same_segment(SEGMENTS, SEGMENTS),
                                       is_causal=True, implementation="reference")
    for a, b in zip(pullback(go), masked(go), strict=True):
        assert rel_error(a, b) <= (1e-12 if dtype_name == "float64" else 1e-5)


@pytest.mark.skipif(Backend.TORCH not in selected_backends(), reason="torch session")
@pytest.mark.parametrize("name", ["reference", "chunked", "auto", "native"])
def test_torch_autograd(name, monkeypatch):
    import torch

    implementation = use_implementation(name, Backend.TORCH, monkeypatch)
    rng = np.random.default_rng(35)
    x = [torch.tensor(rng.standard_normal((2, 2, 12, 4)), requires_grad=True)
         for _ in range(3)]
    ids = torch.tensor(SEGMENTS)
    sdpa(*x, segment_ids=ids, is_causal=True, implementation=implementation).sum().backward()
    _, pullback = polyattn.attention_vjp(*(t.detach().numpy() for t in x),
                                         segment_ids=SEGMENTS, is_causal=True)
    for t, ref in zip(x, pullback(np.ones((2, 2, 12, 4))), strict=True):
        assert rel_error(t.grad.numpy(), ref) <= 1e-12


@pytest.mark.skipif(Backend.JAX not in selected_backends(), reason="JAX session")
@pytest.mark.parametrize("name", ["reference", "chunked"])
def test_jax_jit_with_traced_ids(name, monkeypatch):
    import jax
    import jax.numpy as jnp

    implementation = use_implementation(name, Backend.JAX, monkeypatch)
    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(36)
    q, k, v = (rng.standard_normal((2, 2, 12, 4)) for _ in range(3))

    kj, vj = jnp.asarray(k), jnp.asarray(v)

    @jax.jit
    def loss(q, ids):
        return jnp.sum(sdpa(q, kj, vj, segment_ids=ids, is_causal=True,
                            implementation=implementation) ** 2)

    got = jax.grad(loss)(jnp.asarray(q), jnp.asarray(SEGMENTS))
    out, pullback = polyattn.attention_vjp(q, k, v, segment_ids=SEGMENTS, is_causal=True)
    assert rel_error(np.asarray(got), pullback(2 * out)[0]) <= 1e-10


def test_dask_stays_lazy():
    if Backend.DASK not in selected_backends():
        pytest.skip("Dask session")
    import dask
    import dask.array as da

    rng = np.random.default_rng(37)
    q, k, v = (rng.standard_normal((2, 2, 12, 4)) for _ in range(3))
    calls = []

    def count(*args, **kwargs):
        calls.append(1)
        return dask.get(*args, **kwargs)

    x = [da.from_array(a, chunks=(1, 2, 4, 4)) for a in (q, k, v)]
    with dask.config.set(scheduler=count):
        out = sdpa(*x, segment_ids=SEGMENTS, is_causal=True)
        assert isinstance(out, da.Array) and not calls
    ref, _, _ = ref_attention(q, k, v, is_causal=True, mask=same_segment(SEGMENTS, SEGMENTS))
    np.testing.assert_allclose(out.compute(), ref, rtol=1e-12, atol=1e-13)


# --------------------------------------------------------------------------- #
# Cost: the key ranges visited
# --------------------------------------------------------------------------- #

def _visited(problem, block_q):
    """Score entries the blocked paths compute: Σ over query blocks of rows · key range."""
    rules, total = problem.rules, 0
    for q0 in range(0, rules.tq, block_q):
        q1 = min(q0 + block_q, rules.tq)
        lo, hi = rules.key_range(q0, q1)
        total += (q1 - q0) * max(0, hi - lo)
    return total


@NUMPY_SESSION_ONLY
def test_packed_documents_cost_the_sum_of_their_squared_lengths():
    lengths = [64, 128, 32, 32, 256, 64, 128, 320]                   # 8 documents, T = 1024
    ids = np.repeat(np.arange(8), lengths)[None]                     # (1, T), sorted
    q = np.zeros((1, 1, 1024, 4))
    problem = prepare(q, q, q, attn_mask=None, is_causal=False, causal_alignment="top_left",
                      scale=None, enable_gqa=False, segment_ids=ids)
    assert problem.rules.segment_keys is not None
    assert _visited(problem, 32) == sum(n * n for n in lengths)     # blocks of 32 divide them
    dense = prepare(q, q, q, attn_mask=None, is_causal=False, causal_alignment="top_left",
                    scale=None, enable_gqa=False)
    assert _visited(dense, 32) == 1024 * 1024
    unsorted = prepare(q, q, q, attn_mask=None, is_causal=False, causal_alignment="top_left",
                       scale=None, enable_gqa=False, segment_ids=ids[:, ::-1] % 3)
    assert unsorted.rules.segment_keys is None and _visited(unsorted, 32) == 1024 * 1024
    assert "skipped" in polyattn.explain(q, q, q, segment_ids=ids).features["segment_ids"]


@NUMPY_SESSION_ONLY
@pytest.mark.parametrize("name", ["numba_cuda-rows", "numba_cuda-tiled", "numba_cuda-tc"])
def test_every_cuda_kernel_family(name, monkeypatch):
    """Each CUDA kernel family (20 query rows: the register-tiled and tensor-core ones
    take the call; the latter's gradients are the register-tiled ones', checked once),
    forward, lse and gradients against the reference: documents that span kernel tiles
    (of 4 or 64 rows, 32 or 64 keys) and end inside them, with causality and a document
    without keys, so that some rows see nothing (0, lse -inf, no gradient) and some
    keys are seen by no row."""
    implementation = use_implementation(name, Backend.NUMPY, monkeypatch)
    dtype = "float32" if name == "numba_cuda-tc" else "float64"
    rng = np.random.default_rng(39)
    q, k, v = (rng.standard_normal(s).astype(dtype)
               for s in ((1, 2, 20, 8), (1, 1, 40, 8), (1, 1, 40, 5)))
    q_ids = np.array([[0] * 6 + [1] * 8 + [2] * 3 + [3] * 3])
    k_ids = np.array([[0] * 10 + [1] * 14 + [3] * 16])
    options = {"segment_ids": (q_ids, k_ids), "is_causal": True, "enable_gqa": True}
    cuda_family_ran(name, polyattn.explain(q, k, v, implementation=implementation, **options))
    out, lse = sdpa(q, k, v, return_lse=True, implementation=implementation, **options)
    seen = same_segment(q_ids, k_ids) & (np.arange(40)[None, :] <= np.arange(20)[:, None])
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    ref, ref_lse, _ = ref_attention(q64, k64, v64, mask=seen, enable_gqa=True)
    assert np.isneginf(np.asarray(lse)[0, :, 7]).all()      # id 1 from key 10: row 7 sees none
    assert_close(out, ref, dtype)
    assert_lse_close(lse, ref_lse, dtype)
    if name == "numba_cuda-tc":
        return                       # its gradients are the register-tiled kernels' (above)
    _, pullback = polyattn.attention_vjp(q, k, v, implementation=implementation, **options)
    _, reference = polyattn.attention_vjp(q64, k64, v64, implementation="reference",
                                          attn_mask=seen, enable_gqa=True)
    go = rng.standard_normal((1, 2, 20, 5))
    for a, b in zip(pullback(go.astype(dtype)), reference(go), strict=True):
        assert rel_error(a, b) <= 1e-12


# --------------------------------------------------------------------------- #
# Errors, multi-head attention
# --------------------------------------------------------------------------- #

@NUMPY_SESSION_ONLY
def test_errors_name_the_argument():
    q, k = np.zeros((2, 1, 4, 8)), np.zeros((2, 1, 6, 8))
    ids = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(TypeError, match="`segment_ids` must have an integer dtype"):
        sdpa(q, q, q, segment_ids=ids.astype(float))
    with pytest.raises(ValueError, match=r"Tq = 4 and Tk = 6.*pass a pair"):
        sdpa(q, k, k, segment_ids=ids)
    with pytest.raises(ValueError, match=r"`segment_ids` has shape \(2, 5\)"):
        sdpa(q, q, q, segment_ids=np.zeros((2, 5), dtype=np.int64))
    with pytest.raises(ValueError, match=r"keys' ids must be \(B…, Tk\) = \(2, 6\)"):
        sdpa(q, k, k, segment_ids=(ids, ids))
    with pytest.raises(TypeError, match="pair of them"):
        sdpa(q, q, q, segment_ids=(ids, ids, ids))
    with pytest.raises(TypeError, match="segment_ids"):
        sdpa(q, q, q, segment_ids=[[0, 0, 1, 1]])


@NUMPY_SESSION_ONLY
def test_multi_head_attention_passes_them_on():
    rng = np.random.default_rng(38)
    mha = polyattn.MultiHeadAttention(8, 2, seed=0, dtype=np.float64)
    x = rng.standard_normal((2, 12, 8))
    out = mha(x, is_causal=True, segment_ids=SEGMENTS)
    mask = same_segment(SEGMENTS, SEGMENTS)
    np.testing.assert_allclose(out, mha(x, is_causal=True, attn_mask=mask), rtol=1e-12)
    first = mha(x[:1, :5], is_causal=True)                  # document 0 of row 0 alone
    np.testing.assert_allclose(out[:1, :5], first, rtol=1e-12)
