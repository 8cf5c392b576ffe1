"""multi_head_attention and MultiHeadAttention, against a NumPy oracle and torch."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import assert_close, assert_namespace_device, ref_attention, to_numpy, to_xp

import polyattn
from polyattn import KVCache, MultiHeadAttention, multi_head_attention


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


# --- 0.2: window, softcap, ALiBi, key lengths, rotary embeddings, a KV cache -----------------

def np_mha_rope(x, p, h, hkv, positions, *, interleaved=False, rotary_dim=None, base=10000.0,
                is_causal=True):
    """float64 self-attention with RoPE on the projected queries and keys, written out."""
    from test_positional import rope_gptj, rope_llama

    rope = rope_gptj if interleaved else rope_llama

    def proj(w, b, heads):
        y = x @ p[w] + p.get(b, 0)
        return np.moveaxis(y.reshape(*y.shape[:-1], heads, -1), -2, -3)   # (B, heads, T, F)

    pos = np.asarray(positions)
    pos = pos[:, None, :] if pos.ndim == 2 else pos                       # (B, 1, T) or (T,)
    q = rope(proj("w_q", "b_q", h), pos, base=base, rotary_dim=rotary_dim)
    k = rope(proj("w_k", "b_k", hkv), pos, base=base, rotary_dim=rotary_dim)
    v = proj("w_v", "b_v", hkv)
    out, _, _ = ref_attention(q, k, v, is_causal=is_causal, enable_gqa=hkv != h)
    out = np.moveaxis(out, -3, -2)
    return out.reshape(*out.shape[:-2], -1) @ p["w_o"] + p.get("b_o", 0)


def _module(xp, device, dtype_name="float64", h=4, hkv=2, d=16):
    mha = MultiHeadAttention(d, h, num_kv_heads=hkv, xp=xp, dtype=getattr(xp, dtype_name),
                             device=device, seed=11)
    rng = np.random.default_rng(12)     # non-zero biases, so that they are rotated too
    mha.params.update({k: to_xp(rng.standard_normal(tuple(v.shape)), xp, dtype=dtype_name,
                                device=device)
                       for k, v in mha.params.items() if k.startswith("b_")})
    return mha


@pytest.mark.parametrize(("interleaved", "rotary_dim", "given_positions"),
                         [(False, None, False), (True, None, True), (False, 2, True),
                          (True, 2, False)])
def test_rotary_matches_numpy(xp, device, dtype_name, interleaved, rotary_dim, given_positions):
    mha = _module(xp, device, dtype_name)
    x = np.random.default_rng(13).standard_normal((2, 6, 16))
    rotary = {"base": 50.0, "interleaved": interleaved, "rotary_dim": rotary_dim}
    positions = np.arange(6) + np.array([[0], [9]]) if given_positions else np.arange(6)
    extra = {"positions": to_xp(positions, xp, device=device)} if given_positions else {}
    out = mha(to_xp(x, xp, dtype=dtype_name, device=device), is_causal=True, rotary=rotary,
              **extra)
    ref = np_mha_rope(x, host_params(mha), 4, 2, positions, interleaved=interleaved,
                      rotary_dim=rotary_dim, base=50.0)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert_close(out, ref, dtype_name)
    plain, _ = np_mha(x, x, x, host_params(mha), 4, 2, is_causal=True)
    assert not np.allclose(ref, plain), "the rotation changed nothing"


def test_new_keywords_pass_through(xp, device):
    """window, softcap, alibi_slopes and key_lengths reach the attention of the heads."""
    mha = _module(xp, device)
    x = np.random.default_rng(14).standard_normal((2, 7, 16))
    xx = to_xp(x, xp, device=device)
    p = host_params(mha)
    slopes = polyattn.alibi_slopes(4)
    options = {"window": (2, 1), "softcap": 3.0, "key_lengths": np.array([7, 4])}

    def heads(w, b, n):
        y = x @ p[w] + p[b]
        return np.moveaxis(y.reshape(2, 7, n, -1), -2, -3)

    for name, value in [*options.items(), ("alibi_slopes", slopes)]:
        arg = to_xp(value, xp, device=device) if isinstance(value, np.ndarray) else value
        out = mha(xx, is_causal=name != "window", **{name: arg})
        o = polyattn.scaled_dot_product_attention(
            heads("w_q", "b_q", 4), heads("w_k", "b_k", 2), heads("w_v", "b_v", 2),
            is_causal=name != "window", enable_gqa=True, **{name: value})   # (B, H, T, Ev)
        ref = np.moveaxis(o, 1, 2).reshape(2, 7, 16) @ p["w_o"] + p["b_o"]
        assert_close(out, ref, "float64", what=name)
        without = to_numpy(mha(xx, is_causal=name != "window"))
        assert not np.allclose(without, ref), f"{name} changed nothing"
    w = mha(xx, is_causal=True, window=(1, 0), need_weights=True, average_attn_weights=False)[1]
    band = np.tril(np.triu(np.ones((7, 7)), -1))
    np.testing.assert_array_equal(to_numpy(w) > 0, np.broadcast_to(band > 0, (2, 4, 7, 7)))


@pytest.mark.parametrize(("case", "dtype_name"), [
    # rotary alone and float32 take the paths of rotary_alibi_window in float64
    pytest.param("rotary", "float64", marks=pytest.mark.exhaustive),
    ("rotary_alibi_window", "float64"),
    pytest.param("rotary_alibi_window", "float32", marks=pytest.mark.exhaustive),
    ("plain_mqa", "float64")])
def test_cached_decoding_equals_full_causal_call(xp, device, dtype_name, case):
    hkv = 1 if case == "plain_mqa" else 2
    mha = _module(xp, device, dtype_name, hkv=hkv)
    x = np.random.default_rng(15).standard_normal((2, 9, 16))
    conv = lambda a: to_xp(a, xp, dtype=dtype_name, device=device)       # noqa: E731
    options = {"is_causal": True}
    if case != "plain_mqa":
        options["rotary"] = {"base": 1000.0}
    if case == "rotary_alibi_window":
        options.update(window=(3, 0), alibi_slopes=to_xp(polyattn.alibi_slopes(4), xp,
                                                          dtype=dtype_name, device=device))
    full = to_numpy(mha(conv(x), **options))
    cache = KVCache((2,), hkv, 12, 4, xp=xp, dtype=getattr(xp, dtype_name), device=device)
    outs = []
    for lo, hi in [(0, 4), *((s, s + 1) for s in range(4, 9))]:
        out, cache = mha(conv(x[:, lo:hi]), cache=cache, **options)
        outs.append(to_numpy(out))
    assert_close(np.concatenate(outs, axis=-2), full, dtype_name)
    np.testing.assert_array_equal(to_numpy(cache.lengths), [9, 9])
    assert_namespace_device(cache.keys, xp, device, getattr(xp, dtype_name))


def test_cached_ragged_prompts_then_decode(xp, device):
    """Right-padded prompts (key_lengths) enter an empty cache top-left, then decode."""
    mha = _module(xp, device)
    x = np.random.default_rng(16).standard_normal((2, 8, 16))
    conv = lambda a: to_xp(a, xp, device=device)                         # noqa: E731
    options = {"is_causal": True, "rotary": {}}
    full = to_numpy(mha(conv(x), **options))
    prompt = np.array([5, 3])
    cache = KVCache((2,), 2, 10, 4, xp=xp, dtype=xp.float64, device=device)
    out, cache = mha(conv(x[:, :5]), key_lengths=conv(prompt), causal_alignment="top_left",
                     cache=cache, **options)
    out = to_numpy(out)
    for row, n in enumerate(prompt):
        assert_close(out[row, :n], full[row, :n], "float64")
    for step in range(3):
        token = np.stack([x[r, n + step:n + step + 1] for r, n in enumerate(prompt)])
        out, cache = mha(conv(token), cache=cache, **options)
        want = np.stack([full[r, n + step:n + step + 1] for r, n in enumerate(prompt)])
        assert_close(out, want, "float64")


@pytest.mark.parametrize("extra", [
    pytest.param({}, marks=pytest.mark.exhaustive, id="plain"),   # window+alibi's paths
    pytest.param({"window": (2, 0), "alibi_slopes": "slopes"}, id="window+alibi")])
def test_cached_ragged_appends_with_the_default_alignment(xp, device, extra):
    """Ragged appends (key_lengths < Tq) into an empty, then a non-empty cache, bottom-right.

    Each row's real queries must sit right after that row's past, where the
    rotary embedding puts them, whatever the other rows append.
    """
    mha = _module(xp, device)
    conv = lambda a: to_xp(a, xp, device=device)                         # noqa: E731
    options = {"is_causal": True, "rotary": {}, **extra}
    if "alibi_slopes" in extra:
        options["alibi_slopes"] = conv(np.array([0.5, 0.25, 0.125, 0.0625]))
    x = np.random.default_rng(19).standard_normal((2, 9, 16))
    cache = KVCache((2,), 2, 12, 4, xp=xp, dtype=xp.float64, device=device)
    done = [0, 0]
    for chunk, counts in ((5, [5, 3]), (3, [1, 3]), (2, [2, 1])):
        token = np.stack([x[r, done[r]:done[r] + chunk] if done[r] + chunk <= 9 else
                          np.pad(x[r, done[r]:], ((0, done[r] + chunk - 9), (0, 0)))
                          for r in range(2)])
        out, cache = mha(conv(token), key_lengths=conv(np.array(counts)), cache=cache,
                         **options)
        out = to_numpy(out)
        for r, n in enumerate(counts):
            full = to_numpy(mha(conv(x[r:r + 1, :done[r] + n]), **options))
            assert_close(out[r, :n], full[0, done[r]:done[r] + n], "float64")
            done[r] += n
    assert list(to_numpy(cache.lengths)) == done


def test_cached_ragged_append_needs_room_for_every_token():
    mha = MultiHeadAttention(8, 2, dtype=np.float64, seed=0)
    cache = KVCache((2,), 2, 6, 4)
    x = np.random.default_rng(20).standard_normal((2, 4, 8))
    mha(x, key_lengths=np.array([4, 2]), is_causal=True, cache=cache)
    keys = cache.keys.copy()
    with pytest.raises(ValueError, match="capacity 6 needs room for all 4"):
        mha(x, key_lengths=np.array([0, 2]), is_causal=True, cache=cache)
    assert list(cache.lengths) == [4, 2] and np.array_equal(cache.keys, keys)  # untouched
    with pytest.raises(ValueError, match="without is_causal=True"):
        mha(x[:, :1], key_lengths=np.array([1, 0]), window=(1, 1), cache=cache)


def test_cache_with_weights_time_first_and_the_module():
    mha = MultiHeadAttention(8, 2, batch_first=False, dtype=np.float64, seed=0)
    x = np.random.default_rng(17).standard_normal((3, 2, 8))           # (T, B, d_model)
    cache = KVCache((2,), 2, 6, 4)
    out, w, c = mha(x, is_causal=True, cache=cache, need_weights=True)
    assert c is cache and out.shape == (3, 2, 8) and w.shape == (2, 3, 6)
    assert not w[..., 3:].any()
    full = np.moveaxis(mha(x, is_causal=True), 1, 0)
    np.testing.assert_allclose(np.moveaxis(out, 1, 0), full, rtol=1e-12, atol=1e-12)


def test_jax_jitted_decoder_step():
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)
    mha = _module(jnp, None)
    x = np.random.default_rng(18).standard_normal((2, 6, 16))
    full = np.asarray(mha(jnp.asarray(x), is_causal=True, rotary={}))

    @jax.jit
    def step(params, cache, token):
        return multi_head_attention(token, token, token, params, num_heads=4, num_kv_heads=2,
                                    is_causal=True, rotary={}, cache=cache)

    cache = KVCache((2,), 2, 8, 4, xp=jnp, dtype=jnp.float64)
    outs = []
    for s in range(6):
        out, cache = step(mha.params, cache, jnp.asarray(x[:, s:s + 1]))
        outs.append(np.asarray(out))
    assert_close(np.concatenate(outs, axis=1), full, "float64")


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"positions": np.arange(3)}, ValueError, r"`positions` are the positions of the rotary"),
    ({"rotary": 10000.0}, TypeError, r"`rotary` must be a mapping.*got float"),
    ({"rotary": {"theta": 1.0}}, ValueError, r"`rotary` has unknown options \['theta'\]"),
    ({"rotary": {}, "positions": np.arange(4)}, ValueError,
     r"`positions` must broadcast to \(B…, Tq\) = \(2, 3\).*got shape \(4,\)"),
    ({"rotary": {}, "positions": np.arange(3.0)}, TypeError, r"`positions` must have an integer"),
    ({"rotary": {}, "_key": np.zeros((2, 5, 8))}, ValueError, r"Tq = 3, Tk = 5"),
    ({"cache": "cache"}, TypeError, r"`cache` must be a polyattn.KVCache; got str"),
    ({"cache": KVCache((3,), 2, 8, 4)}, ValueError,
     r"`cache` holds batch dimensions \(3,\).*KVCache\(\(2,\), 2, capacity, 4\)"),
    ({"cache": KVCache((2,), 2, 8, 4), "key_padding_mask": np.zeros((2, 3), dtype=bool)},
     ValueError, r"`key_padding_mask` cannot be combined with `cache`"),
    ({"cache": KVCache((2,), 2, 8, 4, dtype=np.float32)}, TypeError,
     r"`key` is float64 but the cache holds float32"),
])
def test_rotary_and_cache_errors(kwargs, error, match):
    mha = MultiHeadAttention(8, 2, dtype=np.float64, seed=0)
    x = np.zeros((2, 3, 8))
    key = kwargs.pop("_key", x)
    with pytest.raises(error, match=match):
        mha(x, key, key, **kwargs)
