"""multi_head_attention and MultiHeadAttention, against a NumPy oracle and torch."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_namespace_device, ref_attention, to_numpy, to_xp

import polyattn
from polyattn import MultiHeadAttention, multi_head_attention


def np_mha(query, key, value, p, h, hkv, mask=None, is_causal=False, alignment="top_left"):
    """float64 multi-head attention from the parameter layout (x @ w)."""
    def proj(x, w, b, heads):
        y = x @ w + (0 if b is None else b)
        y = y.reshape(*y.shape[:-1], heads, -1)
        return np.moveaxis(y, -2, -3)

    q = proj(query, p["w_q"], p.get("b_q"), h)
    k = proj(key, p["w_k"], p.get("b_k"), hkv)
    v = proj(value, p["w_v"], p.get("b_v"), hkv)
    out, _, w = ref_attention(q, k, v, mask=mask, is_causal=is_causal, alignment=alignment,
                              enable_gqa=hkv != h)
    out = np.moveaxis(out, -3, -2)
    out = out.reshape(*out.shape[:-2], -1) @ p["w_o"] + p.get("b_o", 0)
    return out, w.mean(axis=-3)


def host_params(mha):
    return {k: to_numpy(v) for k, v in mha.params.items()}


@pytest.mark.parametrize(("h", "hkv"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("need_weights", [False, True])
def test_matches_oracle(xp, device, dtype_name, h, hkv, need_weights):
    mha = MultiHeadAttention(16, h, num_kv_heads=hkv, kdim=12, vdim=10, xp=xp,
                             dtype=getattr(xp, dtype_name), device=device, seed=3)
    rng = np.random.default_rng(0)
    query, key, value = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 7, 12)), \
        rng.standard_normal((2, 7, 10))
    mask = rng.random((2, 1, 1, 7)) < 0.8
    mask[..., 0] = True
    args = [to_xp(a, xp, dtype=dtype_name, device=device) for a in (query, key, value)]
    res = mha(*args, attn_mask=to_xp(mask, xp, device=device), need_weights=need_weights)
    ref_out, ref_w = np_mha(query, key, value, host_params(mha), h, hkv, mask=mask)
    out = res[0] if need_weights else res
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert out.shape == (2, 5, 16)
    assert_close(out, ref_out, dtype_name)
    if need_weights:
        assert_close(res[1], ref_w, dtype_name, what="weights")


def test_self_attention_defaults_and_causal(xp, device):
    mha = MultiHeadAttention(8, 2, xp=xp, dtype=xp.float64, device=device, seed=0)
    x = np.random.default_rng(1).standard_normal((3, 8))
    out = mha(to_xp(x, xp, device=device), is_causal=True)
    ref, _ = np_mha(x, x, x, host_params(mha), 2, 2, is_causal=True)
    assert_close(out, ref, "float64")


def test_functional_without_biases():
    mha = MultiHeadAttention(8, 2, bias=False, seed=0)
    assert set(mha.params) == {"w_q", "w_k", "w_v", "w_o"}
    x = np.random.default_rng(2).standard_normal((2, 4, 8))
    out = multi_head_attention(x, x, x, mha.params, num_heads=2)
    ref, _ = np_mha(x, x, x, mha.params, 2, 2)
    assert_close(out, ref, "float64")


def test_seeded_initialisation():
    a, b = MultiHeadAttention(16, 4, seed=7), MultiHeadAttention(16, 4, seed=7)
    c = MultiHeadAttention(16, 4, seed=8)
    for name in a.params:
        np.testing.assert_array_equal(a.params[name], b.params[name])
    assert not np.array_equal(a.params["w_q"], c.params["w_q"])
    bound = np.sqrt(6 / 32)
    assert np.abs(a.params["w_q"]).max() <= bound
    assert a.params["w_q"].std() == pytest.approx(bound / np.sqrt(3), rel=0.2)
    assert np.all(a.params["b_q"] == 0)


def test_params_dtype_follows_request(xp, device):
    mha = MultiHeadAttention(8, 2, xp=xp, dtype=xp.float32, device=device)
    for arr in mha.params.values():
        assert_namespace_device(arr, xp, device, xp.float32)


def test_wrong_param_shape_names_key():
    mha = MultiHeadAttention(8, 2, seed=0)
    params = dict(mha.params, w_k=np.zeros((8, 6)))
    x = np.zeros((3, 8))
    with pytest.raises(ValueError, match=r"`w_k` has shape \(8, 6\); expected \(8, 8\)"):
        multi_head_attention(x, x, x, params, num_heads=2)


# --- torch interop ------------------------------------------------------------------------

def _torch_case(kdim=None, vdim=None, bias=True, num_heads=4, embed=16):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m = torch.nn.MultiheadAttention(embed, num_heads, kdim=kdim, vdim=vdim, bias=bias,
                                    batch_first=True, dtype=torch.float64)
    with torch.no_grad():  # non-zero biases so that they are checked too
        for name, p in m.named_parameters():
            if "bias" in name:
                p.copy_(torch.randn_like(p))
    return torch, m


@pytest.mark.parametrize(("kdim", "vdim"), [(None, None), (12, 10)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_from_torch_matches_torch(kdim, vdim, bias, masked):
    torch, m = _torch_case(kdim, vdim, bias)
    rng = np.random.default_rng(4)
    query = rng.standard_normal((2, 5, 16))
    key = rng.standard_normal((2, 7, kdim or 16))
    value = rng.standard_normal((2, 7, vdim or 16))
    keep = rng.random((5, 7)) < 0.7
    keep[:, 0] = True
    t_mask = torch.from_numpy(~keep) if masked else None     # torch: True = masked out
    with torch.no_grad():
        t_out, t_w = m(torch.from_numpy(query), torch.from_numpy(key), torch.from_numpy(value),
                       attn_mask=t_mask, need_weights=True)
    mha = MultiHeadAttention.from_torch(m)
    assert mha.params["w_q"].dtype == np.float64
    out, w = mha(query, key, value, attn_mask=keep if masked else None, need_weights=True)
    assert_close(out, t_out.numpy(), "float64")
    assert_close(w, t_w.numpy(), "float64", what="weights")


def test_from_torch_into_other_namespace(xp, device):
    torch, m = _torch_case()
    mha = MultiHeadAttention.from_torch(m, xp=xp, dtype=xp.float64, device=device)
    x = np.random.default_rng(5).standard_normal((1, 3, 16))
    with torch.no_grad():
        expected = m(*(torch.from_numpy(x),) * 3, need_weights=False)[0].numpy()
    out = mha(to_xp(x, xp, device=device))
    assert_close(out, expected, "float64")


def test_gqa_module_shapes():
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, seed=0)
    assert mha.params["w_k"].shape == (16, 8) and mha.params["w_v"].shape == (16, 8)
    out = mha(np.ones((2, 3, 16)), is_causal=True)
    assert out.shape == (2, 3, 16)
    assert "num_kv_heads=2" in repr(mha)


def test_public_names():
    for name in polyattn.__all__:
        assert hasattr(polyattn, name)


# --- torch's conventions: key_padding_mask, per-head weights, batch_first --------------------

@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("with_attn_mask", [False, True])
def test_key_padding_mask_as_torch(kind, with_attn_mask):
    torch, m = _torch_case()
    rng = np.random.default_rng(6)
    query, key = rng.standard_normal((2, 5, 16)), rng.standard_normal((2, 7, 16))
    pad = np.zeros((2, 7), dtype=bool)
    pad[1, 4:] = True                                          # torch: True = ignore this key
    kpm = pad if kind == "bool" else np.where(pad, -np.inf, rng.standard_normal((2, 7)) * 0.1)
    keep = rng.random((5, 7)) < 0.7
    keep[:, 0] = True
    # torch wants both masks of one type; polyattn combines a bool with a float one too
    t_attn = ~keep if kind == "bool" else np.where(keep, 0.0, -np.inf)
    with torch.no_grad():
        t_out, t_w = m(torch.from_numpy(query), torch.from_numpy(key), torch.from_numpy(key),
                       key_padding_mask=torch.from_numpy(kpm),
                       attn_mask=torch.from_numpy(t_attn) if with_attn_mask else None,
                       need_weights=True, average_attn_weights=False)
    mha = MultiHeadAttention.from_torch(m)
    out, w = mha(query, key, key_padding_mask=kpm, attn_mask=keep if with_attn_mask else None,
                 need_weights=True, average_attn_weights=False)
    assert w.shape == (2, 4, 5, 7)
    assert_close(out, t_out.numpy(), "float64")
    assert_close(w, t_w.numpy(), "float64", what="weights")
    assert not w[1, ..., 4:].any()
    # without weights the same numbers come from scaled_dot_product_attention
    assert_close(mha(query, key, key_padding_mask=kpm,
                     attn_mask=keep if with_attn_mask else None), t_out.numpy(), "float64")


def test_key_padding_mask_on_every_backend(xp, device):
    mha = MultiHeadAttention(8, 2, xp=xp, dtype=xp.float64, device=device, seed=1)
    x = np.random.default_rng(7).standard_normal((2, 4, 8))
    pad = np.array([[False, False, False, False], [False, False, True, True]])
    out = mha(to_xp(x, xp, device=device), key_padding_mask=to_xp(pad, xp, device=device))
    expected, _ = np_mha(x, x, x, host_params(mha), 2, 2, mask=~pad[:, None, None, :])
    assert_close(out, expected, "float64")


def test_key_padding_mask_errors():
    mha = MultiHeadAttention(8, 2, seed=0)
    x = np.zeros((2, 3, 8))
    with pytest.raises(ValueError, match=r"`key_padding_mask` must be \(B…, Tk\) with Tk = 3"):
        mha(x, key_padding_mask=np.zeros((2, 4), dtype=bool))
    with pytest.raises(TypeError, match="`key_padding_mask` must be boolean"):
        mha(x, key_padding_mask=np.zeros((2, 3), dtype=np.int64))
    with pytest.raises(TypeError, match="average_attn_weights"):
        mha(x, need_weights=True, average_attn_weights=None)


@pytest.mark.parametrize("batch_first", [False, True])
def test_from_torch_honours_batch_first(batch_first):
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    m = torch.nn.MultiheadAttention(8, 2, batch_first=batch_first, dtype=torch.float64)
    x = np.random.default_rng(8).standard_normal((5, 3, 8))   # (T, B, E) or (B, T, E)
    with torch.no_grad():
        t_out, t_w = m(*(torch.from_numpy(x),) * 3, need_weights=True)
    mha = MultiHeadAttention.from_torch(m)
    assert mha.batch_first is batch_first
    out, w = mha(x, need_weights=True)
    assert out.shape == t_out.shape and w.shape == t_w.shape
    assert_close(out, t_out.numpy(), "float64")
    assert_close(w, t_w.numpy(), "float64", what="weights")
    assert_close(mha(x[:, 0]), m(*(torch.from_numpy(x[:, 0]),) * 3)[0].detach().numpy(),
                 "float64")                                     # unbatched (T, E)


def test_time_first_inputs_must_agree():
    mha = MultiHeadAttention(8, 2, batch_first=False, seed=0)
    with pytest.raises(ValueError, match="batch_first=False"):
        mha(np.zeros((3, 2, 8)), np.zeros((3, 8)))


def test_default_parameters_are_float32_and_never_downcast():
    """As torch's modules: float32 parameters unless asked; float64 inputs stay float64."""
    mha = MultiHeadAttention(8, 2, seed=0)
    assert {p.dtype for p in mha.params.values()} == {np.dtype(np.float32)}
    x32 = np.random.default_rng(9).standard_normal((2, 3, 8)).astype(np.float32)
    assert mha(x32).dtype == np.float32
    x64 = x32.astype(np.float64)
    out64 = mha(x64)
    assert out64.dtype == np.float64
    expected, _ = np_mha(x64, x64, x64, {k: v.astype(np.float64) for k, v in mha.params.items()},
                         2, 2)
    assert_close(out64, expected, "float64")
    assert MultiHeadAttention(8, 2, dtype=np.float64).params["w_q"].dtype == np.float64


# --- input screening ---------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["masked", "matrix"])
@pytest.mark.parametrize("position", [0, 1, 2])
def test_masked_arrays_and_matrices_are_refused(kind, position):
    rng = np.random.default_rng(10)
    args = [rng.standard_normal((4, 3)) for _ in range(3)]
    if kind == "masked":
        args[position] = np.ma.masked_array(args[position], mask=args[position] > 1)
    else:
        with pytest.warns(PendingDeprecationWarning):
            args[position] = np.asmatrix(args[position])
    name = ("query", "key", "value")[position]
    what = "masked array" if kind == "masked" else "np.matrix"
    with pytest.raises(TypeError, match=rf"`{name}` is a (NumPy )?{what}"):
        polyattn.scaled_dot_product_attention(*args)
    mha = MultiHeadAttention(3, 1, seed=0)
    with pytest.raises(TypeError, match=rf"`{name}` is a (NumPy )?{what}"):
        multi_head_attention(*args, mha.params, num_heads=1)


def test_dtype_that_is_not_the_librarys_names_dtype():
    for bad in ("float64", object):
        with pytest.raises(TypeError, match="`dtype` must be a real floating dtype of numpy"):
            MultiHeadAttention(8, 2, dtype=bad)


def test_inputs_of_another_library_say_how_to_load_the_parameters():
    torch = pytest.importorskip("torch")
    mha = MultiHeadAttention(8, 2, seed=0)                       # NumPy parameters
    with pytest.raises(TypeError, match=r"xp=torch"):
        mha(torch.zeros(2, 3, 8))
