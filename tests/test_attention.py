"""scaled_dot_product_attention and attention_weights on every backend and implementation."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    ONLY_ON,
    Backend,
    assert_close,
    assert_lse_close,
    assert_namespace_device,
    implementations_under_test,
    ref_attention,
    rel_error,
    skip_unless_kernel_runs_on,
    skip_unless_native_on,
    to_numpy,
    to_xp,
)

import polyattn
from polyattn.backends.array_api import blocked as chunked

#: Plain ``implementation=`` names (numba_cuda: its default kernels); numba_cpu, distributed
#: and each CUDA kernel family run every rule in test_rules.py.
IMPLEMENTATIONS = [n for n in implementations_under_test(cuda_families=("numba_cuda",))
                   if n not in ONLY_ON]


#: The cases whose chunked blocks are tiny on JAX as well, so that a few queries and keys
#: span several blocks: uneven last blocks both ways and the log-sum-exp merged across
#: key blocks; rows masked in every key block; causal key blocks skipped (4 queries,
#: 9 keys) and query blocks that see no key at all (9 queries, 4 keys, bottom-right).
#: On the other backends every case has tiny blocks. JAX compiles each eager operation
#: anew for every block shape, so its other cases take their problems in whole blocks
#: (test_properties.py draws block sizes on JAX too).
JAX_BOUNDARY_CASES = {
    "test_matches_reference": lambda params: True,
    "test_fully_masked_rows_give_zero_not_nan": lambda params: True,
    "test_causal": lambda params: params["tq"] != params["tk"],
}


def _tiny_blocks(request, backend) -> bool:
    if backend is not Backend.JAX:
        return True
    boundary = JAX_BOUNDARY_CASES.get(request.node.originalname)
    return boundary is not None and boundary(request.node.callspec.params)


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, monkeypatch):
    """Each implementation; small chunked blocks so test shapes span several (on JAX in
    :data:`JAX_BOUNDARY_CASES` only, whole blocks in the others)."""
    skip_unless_kernel_runs_on(request, request.param)
    params = getattr(request.node, "callspec", None)
    backend = params.params.get("backend") if params else None
    bq, bk = (3, 4) if _tiny_blocks(request, backend) else (16, 16)
    monkeypatch.setattr(chunked, "BLOCK_Q", bq)
    monkeypatch.setattr(chunked, "BLOCK_K", bk)
    skip_unless_native_on(backend, request.param, monkeypatch)
    return request.param


def skip_repeated_auto(xp, args, kw) -> None:
    """On JAX, skip an ``"auto"`` case that ``explain()`` shows running an implementation
    that has a case of its own (here every one: JAX compiles every test shape anew, so
    running the same implementation twice costs twice)."""
    if kw.get("implementation") != "auto" or not xp.__name__.startswith("jax"):
        return
    chosen = polyattn.explain(*args, **kw).implementation
    if chosen in IMPLEMENTATIONS and chosen != "auto":
        pytest.skip(f"on JAX auto runs {chosen!r} here (explain()), which its own case runs")


def sdpa(xp, device, dtype_name, q, k, v, mask=None, **kw):
    """Run polyattn on backend arrays built from NumPy inputs."""
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, k, v)]
    if mask is not None:
        mdt = None if mask.dtype == bool else dtype_name
        kw["attn_mask"] = to_xp(mask, xp, dtype=mdt, device=device)
    skip_repeated_auto(xp, args, kw)
    return polyattn.scaled_dot_product_attention(*args, **kw)


def test_matches_reference(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 3, 7, 5)), rng.standard_normal((2, 3, 9, 5)), \
        rng.standard_normal((2, 3, 9, 6))
    out, lse = sdpa(xp, device, dtype_name, q, k, v, implementation=implementation,
                    return_lse=True)
    ref, ref_lse, _ = ref_attention(q, k, v)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize(("tq", "tk"), [(6, 6), (4, 9), (9, 4)])
def test_causal(xp, device, dtype_name, implementation, alignment, tq, tk):
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 2, t, 4)) for t in (tq, tk, tk))
    out, lse = sdpa(xp, device, dtype_name, q, k, v, is_causal=True, causal_alignment=alignment,
                    implementation=implementation, return_lse=True)
    ref, ref_lse, _ = ref_attention(q, k, v, is_causal=True, alignment=alignment)
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


@pytest.mark.parametrize("mask_shape", [(7, 9), (1, 1, 7, 9), (2, 1, 1, 9), (3, 1, 9), (9,)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks_broadcast(xp, device, dtype_name, implementation, mask_shape, kind):
    rng = np.random.default_rng(3)
    q, k, v = rng.standard_normal((2, 3, 7, 4)), rng.standard_normal((2, 3, 9, 4)), \
        rng.standard_normal((2, 3, 9, 4))
    if kind == "bool":
        mask = rng.random(mask_shape) < 0.7
    else:
        mask = rng.standard_normal(mask_shape)
    out = sdpa(xp, device, dtype_name, q, k, v, mask, implementation=implementation)
    ref, _, _ = ref_attention(q, k, v, mask=mask)
    assert_close(out, ref, dtype_name)


def test_mask_combined_with_causal(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(4)
    q, k, v = (rng.standard_normal((1, 2, 8, 4)) for _ in range(3))
    mask = rng.random((8, 8)) < 0.6
    out = sdpa(xp, device, dtype_name, q, k, v, mask, is_causal=True,
               implementation=implementation)
    ref, _, _ = ref_attention(q, k, v, mask=mask, is_causal=True)
    assert_close(out, ref, dtype_name)


def test_fully_masked_rows_give_zero_not_nan(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 7, 4)), \
        rng.standard_normal((2, 7, 3))
    mask = rng.random((2, 6, 7)) < 0.5
    mask[0, 1] = False
    mask[1, 4] = False
    out, lse = sdpa(xp, device, dtype_name, q, k, v, mask, implementation=implementation,
                    return_lse=True)
    got, got_lse = to_numpy(out), to_numpy(lse)
    assert not np.isnan(got).any()
    assert np.all(got[0, 1] == 0) and np.all(got[1, 4] == 0)
    assert np.isneginf(got_lse[0, 1]) and np.isneginf(got_lse[1, 4])
    ref, ref_lse, _ = ref_attention(q, k, v, mask=mask)
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


def test_float_mask_with_neg_inf_rows(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((3, 5, 4)) for _ in range(3))
    mask = rng.standard_normal((3, 5, 5))
    mask[:, :, 2] = -np.inf
    mask[1, 3, :] = -np.inf
    out, lse = sdpa(xp, device, dtype_name, q, k, v, mask, implementation=implementation,
                    return_lse=True)
    ref, ref_lse, _ = ref_attention(q, k, v, mask=mask)
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


@pytest.mark.parametrize(("h", "hkv"), [(4, 2), (6, 1), (4, 4)])
def test_gqa(xp, device, dtype_name, implementation, h, hkv):
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, h, 5, 4))
    k, v = rng.standard_normal((2, hkv, 8, 4)), rng.standard_normal((2, hkv, 8, 3))
    mask = rng.random((h, 5, 8)) < 0.8
    out = sdpa(xp, device, dtype_name, q, k, v, mask, enable_gqa=True, is_causal=True,
               causal_alignment="bottom_right", implementation=implementation)
    ref, _, _ = ref_attention(q, k, v, mask=mask, enable_gqa=True, is_causal=True,
                              alignment="bottom_right")
    assert_close(out, ref, dtype_name)


def test_head_and_batch_broadcast(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 3, 5, 4))
    k = rng.standard_normal((1, 1, 6, 4))
    v = rng.standard_normal((3, 6, 2))
    out = sdpa(xp, device, dtype_name, q, k, v, implementation=implementation)
    kb, vb = np.broadcast_to(k, (2, 3, 6, 4)), np.broadcast_to(v, (2, 3, 6, 2))
    ref, _, _ = ref_attention(q, kb, vb)
    assert out.shape == (2, 3, 5, 2)
    assert_close(out, ref, dtype_name)


def test_matrix_inputs_and_scale(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(9)
    q, k, v = rng.standard_normal((5, 3)), rng.standard_normal((6, 3)), \
        rng.standard_normal((6, 2))
    out, lse = sdpa(xp, device, dtype_name, q, k, v, scale=0.3, implementation=implementation,
                    return_lse=True)
    ref, ref_lse, _ = ref_attention(q, k, v, scale=0.3)
    assert out.shape == (5, 2) and lse.shape == (5,)
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


def test_extra_batch_dims(xp, device, dtype_name, implementation):
    rng = np.random.default_rng(10)
    q, k, v = (rng.standard_normal((2, 2, 2, 5, 3)) for _ in range(3))
    out = sdpa(xp, device, dtype_name, q, k, v, is_causal=True, implementation=implementation)
    ref, _, _ = ref_attention(q, k, v, is_causal=True)
    assert_close(out, ref, dtype_name)


@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize("with_lse", [False, True])
def test_layout_bthe(xp, device, dtype_name, implementation, gqa, with_lse):
    """(B, T, H, E) arrays: out (B, Tq, H, Ev); mask (B, H, Tq, Tk) and lse (B, H, Tq) as ever."""
    rng = np.random.default_rng(12)
    hkv = 1 if gqa else 3
    q = rng.standard_normal((2, 3, 5, 4))                   # (B, H, Tq, E)
    k = rng.standard_normal((2, hkv, 7, 4))
    v = rng.standard_normal((2, hkv, 7, 2))
    mask = rng.random((2, 3, 5, 7)) < 0.6
    mask[0, 1, 2] = False                                   # a fully masked row
    bthe = [np.ascontiguousarray(np.swapaxes(a, 1, 2)) for a in (q, k, v)]
    result = sdpa(xp, device, dtype_name, *bthe, mask, is_causal=True,
                  causal_alignment="bottom_right", enable_gqa=gqa, layout="BTHE",
                  return_lse=with_lse, implementation=implementation)
    out, lse = result if with_lse else (result, None)
    ref, ref_lse, ref_w = ref_attention(q, k, v, mask=mask, is_causal=True,
                                        alignment="bottom_right", enable_gqa=gqa)
    assert out.shape == (2, 5, 3, 2)
    assert_close(out, np.swapaxes(ref, 1, 2), dtype_name)
    if hasattr(out, "is_contiguous"):                       # reshapes to (B, Tq, H·Ev) as is
        assert out.is_contiguous()
    elif isinstance(out, np.ndarray):
        assert out.flags.c_contiguous
    assert not to_numpy(out)[0, 2, 1].any()
    if with_lse:
        assert_lse_close(lse, ref_lse, dtype_name)
    w = polyattn.attention_weights(*[to_xp(a, xp, dtype=dtype_name, device=device)
                                     for a in bthe[:2]],
                                   attn_mask=to_xp(mask, xp, device=device), is_causal=True,
                                   causal_alignment="bottom_right", enable_gqa=gqa,
                                   layout="BTHE")
    assert_close(w, ref_w, dtype_name, what="weights")


def test_layout_errors():
    q = np.zeros((2, 5, 3, 4))
    with pytest.raises(ValueError, match="`layout` must be one of 'BHTE', 'BTHE'; got 'BSHD'"):
        polyattn.scaled_dot_product_attention(q, q, q, layout="BSHD")
    with pytest.raises(ValueError, match=r"`key` must have at least 3 dimensions \(B…, T, H, E\)"):
        polyattn.scaled_dot_product_attention(q, np.zeros((5, 4)), np.zeros((5, 4)),
                                              layout="BTHE")
    with pytest.raises(ValueError, match=r"`value` has 6 positions.*layout='BTHE'"):
        polyattn.scaled_dot_product_attention(q, q, np.zeros((2, 6, 3, 4)), layout="BTHE")
    e = polyattn.explain(q, q, q, layout="BTHE")
    assert e.layout == "BTHE" and "layout: BTHE" in str(e)


def test_native_refusals_name_the_reason(backend, xp, device):
    """An explicit "native" that cannot run the call raises ValueError with the reason."""
    q = to_xp(np.zeros((1, 2, 4, 3)), xp, dtype="float32", device=device)
    if backend not in (Backend.TORCH, Backend.JAX):
        with pytest.raises(ValueError, match="no native attention function"):
            polyattn.scaled_dot_product_attention(q, q, q, implementation="native")
        return
    with pytest.raises(ValueError, match="return_lse=True"):
        polyattn.scaled_dot_product_attention(q, q, q, implementation="native",
                                              return_lse=True)
    e = polyattn.explain(q, q, q, return_lse=True)
    assert e.implementation != "native" and "return_lse" in e.candidates["native"]
    q64 = to_xp(np.zeros((1, 2, 4, 3)), xp, dtype="float64", device=device)
    if backend is Backend.JAX:
        with pytest.raises(ValueError, match="float32, which would downcast float64"):
            polyattn.scaled_dot_product_attention(q64, q64, q64, implementation="native")
        v = to_xp(np.zeros((1, 2, 4, 5)), xp, dtype="float32", device=device)
        with pytest.raises(ValueError, match="as many features"):
            polyattn.scaled_dot_product_attention(q, q, v, implementation="native")
    else:
        assert polyattn.explain(q64, q64, q64).implementation == "native"


def test_attention_weights(xp, device, dtype_name):
    rng = np.random.default_rng(11)
    q, k = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 7, 4))
    mask = rng.random((5, 7)) < 0.5
    mask[2] = False
    w = polyattn.attention_weights(to_xp(q, xp, dtype=dtype_name, device=device),
                                   to_xp(k, xp, dtype=dtype_name, device=device),
                                   attn_mask=to_xp(mask, xp, device=device), is_causal=True,
                                   causal_alignment="bottom_right")
    _, _, ref = ref_attention(q, k, k, mask=mask, is_causal=True, alignment="bottom_right")
    assert_namespace_device(w, xp, device, getattr(xp, dtype_name))
    assert_close(w, ref, dtype_name)
    sums = to_numpy(w).sum(-1)
    expected = np.where(ref.sum(-1) > 0.5, 1.0, 0.0)
    np.testing.assert_allclose(sums, expected, atol=1e-5)


def test_inputs_not_modified(xp, device, implementation):
    rng = np.random.default_rng(12)
    arrays = [rng.standard_normal((2, 4, 6)) for _ in range(3)]
    mask = rng.standard_normal((4, 4))
    xs = [to_xp(a, xp, device=device) for a in arrays]
    m = to_xp(mask, xp, device=device)
    polyattn.scaled_dot_product_attention(*xs, attn_mask=m, is_causal=True,
                                          implementation=implementation)
    for a, x in zip([*arrays, mask], [*xs, m], strict=True):
        np.testing.assert_array_equal(to_numpy(x), a)


def test_read_only_numpy_inputs(implementation):
    rng = np.random.default_rng(13)
    arrays = [rng.standard_normal((2, 5, 4)) for _ in range(3)]
    for a in arrays:
        a.flags.writeable = False
    out = polyattn.scaled_dot_product_attention(*arrays, is_causal=True,
                                                implementation=implementation)
    ref, _, _ = ref_attention(*arrays, is_causal=True)
    assert_close(out, ref, "float64")


def test_float16_numpy(implementation):
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((2, 2, 9, 8)) for _ in range(3))
    args = [a.astype(np.float16) for a in (q, k, v)]
    out, lse = polyattn.scaled_dot_product_attention(*args, is_causal=True, return_lse=True,
                                                     implementation=implementation)
    assert out.dtype == np.float16
    assert lse.dtype == np.float32
    ref, _, _ = ref_attention(*[a.astype(np.float64) for a in args], is_causal=True)
    assert_close(out, ref, "float16")


@pytest.mark.parametrize(("a", "b", "expected"), [("float32", "float64", "float64"),
                                                   ("float16", "float32", "float32")])
def test_mixed_dtypes_promote(a, b, expected):
    rng = np.random.default_rng(15)
    q = rng.standard_normal((3, 4)).astype(a)
    k = rng.standard_normal((5, 4)).astype(b)
    v = rng.standard_normal((5, 2)).astype(a)
    out = polyattn.scaled_dot_product_attention(q, k, v)
    assert out.dtype == np.dtype(expected)


def test_empty_keys_and_queries(xp, device, implementation):
    q = to_xp(np.ones((2, 3, 4)), xp, device=device)
    k = to_xp(np.ones((2, 0, 4)), xp, device=device)
    v = to_xp(np.ones((2, 0, 5)), xp, device=device)
    out, lse = polyattn.scaled_dot_product_attention(q, k, v, return_lse=True,
                                                     implementation=implementation)
    assert out.shape == (2, 3, 5) and np.all(to_numpy(out) == 0)
    assert np.all(np.isneginf(to_numpy(lse)))
    q0 = to_xp(np.ones((2, 0, 4)), xp, device=device)
    kk = to_xp(np.ones((2, 3, 4)), xp, device=device)
    out0 = polyattn.scaled_dot_product_attention(q0, kk, kk, implementation=implementation)
    assert out0.shape == (2, 0, 4)


def test_jax_jit(implementation):
    if implementation == "numba_cuda":
        pytest.skip("the numba_cuda kernel takes CUDA arrays, not traced JAX arrays")
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    rng = np.random.default_rng(16)
    q, k, v = (rng.standard_normal((2, 6, 4)) for _ in range(3))

    @jax.jit
    def f(q, k, v):
        return polyattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                     implementation=implementation)

    out = f(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v))
    ref, _, _ = ref_attention(q, k, v, is_causal=True)
    assert_close(out, ref, "float64")


def test_dask_stays_lazy(implementation):
    if implementation == "numba_cuda":
        pytest.skip("the numba_cuda kernel takes CUDA arrays, not Dask arrays")
    da = pytest.importorskip("dask.array")
    import dask

    rng = np.random.default_rng(17)
    arrays = [rng.standard_normal((2, 6, 4)) for _ in range(3)]
    calls = {"n": 0}

    def counting_scheduler(dsk, keys, **kwargs):
        calls["n"] += 1
        return dask.get(dsk, keys, **kwargs)

    xs = [da.from_array(a, chunks=(1, 6, 4)) for a in arrays]
    with dask.config.set(scheduler=counting_scheduler):
        out = polyattn.scaled_dot_product_attention(*xs, is_causal=True,
                                                    implementation=implementation)
        assert calls["n"] == 0, "the graph was computed before .compute()"
        assert isinstance(out, da.Array)
        result = out.compute()
    ref, _, _ = ref_attention(*arrays, is_causal=True)
    assert_close(result, ref, "float64")


@pytest.mark.parametrize("is_causal", [False, True])
def test_against_torch_sdpa(implementation, is_causal):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(18)
    q, k, v = rng.standard_normal((2, 4, 6, 8)), rng.standard_normal((2, 2, 6, 8)), \
        rng.standard_normal((2, 2, 6, 5))
    mask = rng.random((1, 1, 6, 6)) < 0.8
    mask[..., 0] = True
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=None if is_causal else torch.from_numpy(mask),
        is_causal=is_causal, enable_gqa=True).numpy()
    out = polyattn.scaled_dot_product_attention(
        q, k, v, attn_mask=None if is_causal else mask, is_causal=is_causal, enable_gqa=True,
        implementation=implementation)
    assert_close(out, expected, "float64")


def test_backends_agree_bitwise_with_themselves(xp, device, implementation):
    rng = np.random.default_rng(19)
    args = [to_xp(rng.standard_normal((2, 5, 4)), xp, device=device) for _ in range(3)]
    a = to_numpy(polyattn.scaled_dot_product_attention(*args, implementation=implementation))
    b = to_numpy(polyattn.scaled_dot_product_attention(*args, implementation=implementation))
    np.testing.assert_array_equal(a, b)


def test_explain_reports_choice(xp, device, backend):
    q = to_xp(np.zeros((1, 2, 8, 4)), xp, dtype="float32", device=device)
    # with return_lse=True the native functions are out of the running on every library
    e = polyattn.explain(q, q, q, return_lse=True)
    expected = "distributed" if backend is Backend.DASK else "reference"
    assert e.implementation == expected
    assert ("Dask arrays" if backend is Backend.DASK else "budget") in e.reason
    assert expected in str(e)
    assert e.candidates[expected] == ""
    assert "return_lse" in e.candidates["native"] or "no native" in e.candidates["native"]
    native = polyattn.explain(q, q, q).implementation == "native"
    assert native == (backend in (Backend.TORCH, Backend.JAX))


def test_explain_chunked_over_budget(monkeypatch):
    monkeypatch.setenv("POLYATTN_SCORE_BUDGET", "100")
    monkeypatch.setenv("POLYATTN_NUMBA_CPU", "0")
    q = np.zeros((1, 2, 8, 4), dtype=np.float32)
    e = polyattn.explain(q, q, q)
    assert e.implementation == "chunked"
    assert e.score_bytes == 2 * 8 * 8 * 4 and e.score_budget == 100


def test_numba_cuda_on_cpu_arrays_names_cuda(monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    q = np.zeros((1, 2, 8, 4))
    with pytest.raises(RuntimeError, match="CUDA"):
        polyattn.scaled_dot_product_attention(q, q, q, implementation="numba_cuda")


def test_strict_backend_marker(backend):
    # Sanity check that the backend fixture carries the enum.
    assert isinstance(backend, Backend)


def test_kernel_writes_bthe_outputs_in_their_order():
    """The kernel's output follows a (B, Tq, H, E) query's memory order (no copy after)."""
    from polyattn.backends.cuda import launch as numba_cuda

    assert numba_cuda._time_major(np.zeros((2, 5, 3, 4)).transpose(0, 2, 1, 3))
    assert not numba_cuda._time_major(np.zeros((2, 3, 5, 4)))
    assert not numba_cuda._time_major(np.zeros((2, 1, 5, 4)))


def test_bfloat16_is_computed_in_float32(backend, xp, device):
    """bfloat16 (torch, JAX) is computed like float16: float32 statistics, cast back."""
    if backend not in (Backend.TORCH, Backend.JAX):
        pytest.skip(f"{backend.value} has no bfloat16")
    rng = np.random.default_rng(13)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)) for _ in range(3))
    args = [xp.asarray(to_xp(a, xp, dtype="float32", device=device), dtype=xp.bfloat16)
            if hasattr(xp, "bfloat16") else None for a in (q, k, v)]
    if args[0] is None:
        pytest.skip(f"{backend.value}'s namespace exposes no bfloat16")
    out = polyattn.scaled_dot_product_attention(*args, is_causal=True)
    assert out.dtype == args[0].dtype
    seen = [to_numpy(xp.astype(a, xp.float32)).astype(np.float64) for a in args]
    ref, _, _ = ref_attention(*seen, is_causal=True)
    assert rel_error(to_numpy(xp.astype(out, xp.float32)), ref) < 1e-2   # bfloat16's 8 bits
