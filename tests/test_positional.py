"""Positional encodings against their formulas: sinusoidal, rotary (RoPE), ALiBi slopes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import Backend, assert_close, assert_namespace_device, to_numpy, to_xp

import polyattn


def formula(n, d, base=10000.0, offset=0):
    pe = np.zeros((n, d))
    for pos in range(n):
        for col in range(d):
            i2 = col - col % 2
            angle = (pos + offset) / base ** (i2 / d)
            pe[pos, col] = np.sin(angle) if col % 2 == 0 else np.cos(angle)
    return pe


@pytest.mark.parametrize(("n", "d"), [(5, 8), (7, 5), (1, 1), (0, 4), (50, 16)])
def test_matches_formula(xp, device, dtype_name, n, d):
    pe = polyattn.sinusoidal_positional_encoding(n, d, xp=xp, dtype=getattr(xp, dtype_name),
                                                 device=device)
    assert pe.dtype == getattr(xp, dtype_name) and tuple(pe.shape) == (n, d)
    tol = 1e-6 if dtype_name == "float32" else 1e-12
    np.testing.assert_allclose(to_numpy(pe), formula(n, d), atol=tol)


def test_offset_and_base():
    pe = polyattn.sinusoidal_positional_encoding(4, 6, base=100.0, offset=10)
    np.testing.assert_allclose(pe, formula(4, 6, base=100.0, offset=10), atol=1e-12)
    full = polyattn.sinusoidal_positional_encoding(14, 6, base=100.0)
    np.testing.assert_allclose(pe, full[10:], atol=1e-12)


def test_default_dtype_follows_library():
    assert polyattn.sinusoidal_positional_encoding(2, 4).dtype == np.float64
    torch = pytest.importorskip("torch")
    pe = polyattn.sinusoidal_positional_encoding(2, 4, xp=torch)
    assert pe.dtype == torch.get_default_dtype()


def test_relative_position_is_linear():
    # PE[pos + k] is a fixed rotation of PE[pos] for each frequency pair.
    pe = polyattn.sinusoidal_positional_encoding(40, 8)
    k = 3
    for i in range(4):
        w = 1.0 / 10000 ** (2 * i / 8)
        rot = np.array([[np.cos(k * w), -np.sin(k * w)], [np.sin(k * w), np.cos(k * w)]])
        np.testing.assert_allclose(pe[:-k, 2 * i:2 * i + 2] @ rot, pe[k:, 2 * i:2 * i + 2],
                                   atol=1e-12)


# --------------------------------------------------------------------------- #
# Rotary position embedding
# --------------------------------------------------------------------------- #

def rope_llama(x, positions, base=10000.0, rotary_dim=None):
    """transformers' Llama RoPE written out in float64 NumPy: x·cos + rotate_half(x)·sin."""
    x = np.asarray(x, dtype=np.float64)
    rd = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (base ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    freqs = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq
    emb = np.concatenate([freqs, freqs], axis=-1)
    cos, sin = np.cos(emb), np.sin(emb)

    def rotate_half(t):
        t1, t2 = t[..., : t.shape[-1] // 2], t[..., t.shape[-1] // 2:]
        return np.concatenate([-t2, t1], axis=-1)

    rot, rest = x[..., :rd], x[..., rd:]
    return np.concatenate([rot * cos + rotate_half(rot) * sin, rest], axis=-1)


def rope_gptj(x, positions, base=10000.0, rotary_dim=None):
    """GPT-J's RoPE (transformers' ``rotate_every_two``) in float64 NumPy."""
    x = np.asarray(x, dtype=np.float64)
    rd = x.shape[-1] if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (base ** (np.arange(0, rd, 2, dtype=np.float64) / rd))
    freqs = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq
    sin = np.repeat(np.sin(freqs), 2, axis=-1)        # duplicate_interleave
    cos = np.repeat(np.cos(freqs), 2, axis=-1)

    def rotate_every_two(t):
        t1, t2 = t[..., ::2], t[..., 1::2]
        return np.stack([-t2, t1], axis=-1).reshape(t.shape)

    rot, rest = x[..., :rd], x[..., rd:]
    return np.concatenate([rot * cos + rotate_every_two(rot) * sin, rest], axis=-1)


def ragged_positions(b, t, offsets=(0, 7)):
    """(B, 1, T): row b starts at offsets[b] (for (B, H, T, E) inputs)."""
    return (np.asarray(offsets)[:b, None] + np.arange(t))[:, None, :]


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim", [None, 4, 6])
@pytest.mark.parametrize("pos_shape", ["T", "B1T"])
def test_rope_matches_transformers_formulas(xp, device, dtype_name, interleaved, rotary_dim,
                                            pos_shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 3, 5, 8))                              # (B, H, T, E)
    pos = np.arange(5) + 3 if pos_shape == "T" else ragged_positions(2, 5)
    formula = rope_gptj if interleaved else rope_llama
    ref = formula(x, pos, base=500.0, rotary_dim=rotary_dim)
    out = polyattn.apply_rotary_embedding(
        to_xp(x, xp, dtype=dtype_name, device=device), to_xp(pos, xp, device=device),
        base=500.0, interleaved=interleaved, rotary_dim=rotary_dim)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert_close(out, ref, dtype_name)
    assert not np.allclose(ref[..., :4], x[..., :4]), "the oracle rotated nothing"


def test_rope_layouts_differ_and_default_base():
    x = np.random.default_rng(1).standard_normal((4, 6))
    pos = np.arange(4)
    halves = polyattn.apply_rotary_embedding(x, pos)
    pairs = polyattn.apply_rotary_embedding(x, pos, interleaved=True)
    np.testing.assert_allclose(halves, rope_llama(x, pos), rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(pairs, rope_gptj(x, pos), rtol=1e-13, atol=1e-13)
    assert not np.allclose(halves, pairs)


def test_rope_matches_torch_rotate_half():
    """transformers' Llama code, run in torch (float32, as transformers computes it)."""
    torch = pytest.importorskip("torch")

    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    def llama_cos_sin(position_ids, dim, base):
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        inv_freq_expanded = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 16, generator=gen)                        # (B, H, T, E)
    k = torch.randn(2, 2, 6, 16, generator=gen)                        # (B, Hkv, T, E)
    position_ids = torch.stack([torch.arange(6), torch.arange(6) + 11])  # (B, T)
    cos, sin = llama_cos_sin(position_ids, 16, 100000.0)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    pos = position_ids[:, None, :]                                     # (B, 1, T)
    q_out = polyattn.apply_rotary_embedding(q, pos, base=100000.0)
    k_out = polyattn.apply_rotary_embedding(k, pos, base=100000.0)
    assert q_out.dtype == torch.float32 and isinstance(q_out, torch.Tensor)
    torch.testing.assert_close(q_out, q_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k_out, k_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_scores_depend_on_position_difference(xp, device, interleaved):
    rng = np.random.default_rng(2)
    q, k = rng.standard_normal((2, 10))
    qx, kx = to_xp(q, xp, device=device), to_xp(k, xp, device=device)

    def score(m, n):
        pm, pn = (to_xp(np.array([p]), xp, device=device) for p in (m, n))
        a = to_numpy(polyattn.apply_rotary_embedding(qx[None, :], pm, interleaved=interleaved))
        b = to_numpy(polyattn.apply_rotary_embedding(kx[None, :], pn, interleaved=interleaved))
        return float(a[0] @ b[0])

    for m, n in ((5, 2), (2, 5), (9, 9)):
        base_score = score(m, n)
        for shift in (1, 40, 1000):
            np.testing.assert_allclose(score(m + shift, n + shift), base_score, rtol=1e-9,
                                       atol=1e-12)
    assert not np.isclose(score(5, 2), score(5, 3)), "the score ignores the distance"


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_decoding_offset_equals_row_of_full(xp, device, interleaved):
    """Rotating the token at position p alone gives row p of the whole sequence's rotation."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 3, 7, 8))                              # (B, H, T, E)
    full = to_numpy(polyattn.apply_rotary_embedding(
        to_xp(x, xp, device=device), to_xp(np.arange(7), xp, device=device),
        interleaved=interleaved))
    for p in (0, 3, 6):
        one = polyattn.apply_rotary_embedding(
            to_xp(x[..., p:p + 1, :], xp, device=device), to_xp(np.array([p]), xp, device=device),
            interleaved=interleaved)
        assert_close(one, full[..., p:p + 1, :], "float64")


def test_rope_passes_features_past_rotary_dim_unchanged(xp, device):
    x = np.random.default_rng(4).standard_normal((5, 10))
    out = to_numpy(polyattn.apply_rotary_embedding(
        to_xp(x, xp, device=device), to_xp(np.arange(5), xp, device=device), rotary_dim=4))
    np.testing.assert_array_equal(out[:, 4:], x[:, 4:])
    assert not np.allclose(out[1:, :4], x[1:, :4])


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_rope_half_precision_keeps_dtype(name):
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(5).standard_normal((3, 6, 8))
    xt = torch.asarray(x).to(getattr(torch, name))
    out = polyattn.apply_rotary_embedding(xt, torch.arange(6))
    assert out.dtype == getattr(torch, name)
    ref = rope_llama(xt.double().numpy(), np.arange(6))               # of the rounded inputs
    rounding = {"float16": 1e-3, "bfloat16": 8e-3}[name]
    np.testing.assert_allclose(out.double().numpy(), ref, atol=4 * rounding * np.abs(ref).max())


def test_rope_float64_angles_at_large_positions():
    """float64 inputs get float64 angles: exact far beyond float32's 2^24 integers."""
    x = np.random.default_rng(6).standard_normal((2, 8))
    pos = np.array([2**30 + 1, 2**40 + 3])
    np.testing.assert_allclose(polyattn.apply_rotary_embedding(x, pos), rope_llama(x, pos),
                               rtol=1e-9, atol=1e-9)


def test_rope_under_jax_jit_and_lazy_on_dask(backend, xp, device):
    x = np.random.default_rng(7).standard_normal((2, 3, 5, 8))
    pos = ragged_positions(2, 5)
    ref = rope_llama(x, pos)
    if backend is Backend.JAX:
        import jax

        f = jax.jit(lambda x, p: polyattn.apply_rotary_embedding(x, p))
        assert_close(f(to_xp(x, xp), to_xp(pos, xp)), ref, "float64")
    elif backend is Backend.DASK:
        import dask

        calls = []

        def counting_scheduler(dsk, keys, **kwargs):
            calls.append(1)
            return dask.get(dsk, keys, **kwargs)

        with dask.config.set(scheduler=counting_scheduler):
            out = polyattn.apply_rotary_embedding(to_xp(x, xp), to_xp(pos, xp))
            assert not calls, "apply_rotary_embedding computed a Dask array"
        assert_close(out, ref, "float64")
    else:
        pytest.skip("JAX and Dask only")


def test_rope_does_not_modify_its_input():
    x = np.random.default_rng(8).standard_normal((4, 6))
    x.flags.writeable = False
    before = x.copy()
    polyattn.apply_rotary_embedding(x, np.arange(4), interleaved=True)
    np.testing.assert_array_equal(x, before)


@pytest.mark.parametrize(("kwargs", "shape", "pos", "error", "match"), [
    ({}, (4, 6), np.arange(4.0), TypeError, r"`positions` must have an integer dtype.*float64"),
    ({}, (4, 6), np.arange(4) > 1, TypeError, r"`positions`.*bool"),
    ({"rotary_dim": 3}, (4, 6), np.arange(4), ValueError, r"`rotary_dim` must be even.*got 3"),
    ({"rotary_dim": 8}, (4, 6), np.arange(4), ValueError, r"at most the 6 features.*got 8"),
    ({"rotary_dim": 0}, (4, 6), np.arange(4), ValueError, r"`rotary_dim` must be at least 1"),
    ({"rotary_dim": -2}, (4, 6), np.arange(4), ValueError, r"`rotary_dim`"),
    ({"rotary_dim": 2.0}, (4, 6), np.arange(4), TypeError, r"`rotary_dim` must be an integer"),
    ({}, (4, 5), np.arange(4), ValueError, r"odd number of features, 5.*rotary_dim"),
    ({}, (4, 6), np.arange(5), ValueError,
     r"`positions` of shape \(5,\) does not broadcast to x.shape\[:-1\] = \(4,\)"),
    ({}, (2, 3, 4, 6), np.zeros((2, 4), dtype=int), ValueError,
     r"\(2, 4\) does not broadcast.*\(2, 3, 4\).*\(B, 1, T\)"),
    ({"base": 0.0}, (4, 6), np.arange(4), ValueError, r"`base` must be a positive"),
    ({"interleaved": 1}, (4, 6), np.arange(4), TypeError, r"`interleaved` must be True or False"),
])
def test_rope_errors(kwargs, shape, pos, error, match):
    with pytest.raises(error, match=match):
        polyattn.apply_rotary_embedding(np.ones(shape), pos, **kwargs)


def test_rope_integer_x_is_refused():
    with pytest.raises(TypeError, match="`x` must have a real floating dtype"):
        polyattn.apply_rotary_embedding(np.ones((4, 6), dtype=int), np.arange(4))


# --------------------------------------------------------------------------- #
# ALiBi slopes
# --------------------------------------------------------------------------- #

def get_slopes(n):
    """The ALiBi reference implementation's ``get_slopes`` (Press et al.)."""
    def get_slopes_power_of_2(n):
        start = 2 ** (-2 ** -(math.log2(n) - 3))
        ratio = start
        return [start * ratio**i for i in range(n)]

    if math.log2(n).is_integer():
        return get_slopes_power_of_2(n)
    closest_power_of_2 = 2 ** math.floor(math.log2(n))
    return (get_slopes_power_of_2(closest_power_of_2)
            + get_slopes(2 * closest_power_of_2)[0::2][: n - closest_power_of_2])


def test_alibi_slopes_eight_heads(xp, device, dtype_name):
    s = polyattn.alibi_slopes(8, xp=xp, dtype=getattr(xp, dtype_name), device=device)
    assert_namespace_device(s, xp, device, getattr(xp, dtype_name))
    np.testing.assert_array_equal(to_numpy(s), [1 / 2**k for k in range(1, 9)])


def test_alibi_slopes_twelve_heads_by_the_rule():
    # n' = 8: 2^-1 … 2^-8; then every other slope of 16 heads (2^-0.5 … 2^-8): 2^-0.5, 2^-1.5, …
    expected = [2.0 ** -k for k in range(1, 9)] + [2.0 ** -(k + 0.5) for k in range(4)]
    s = polyattn.alibi_slopes(12)
    np.testing.assert_allclose(s, expected, rtol=1e-15)
    np.testing.assert_allclose(s, get_slopes(12), rtol=1e-14)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6, 7, 16, 20, 24, 32, 40, 64, 96])
def test_alibi_slopes_reference_get_slopes(n):
    s = polyattn.alibi_slopes(n)
    assert s.shape == (n,) and s.dtype == np.float64
    np.testing.assert_allclose(s, get_slopes(n), rtol=1e-14)


def test_alibi_slopes_defaults_and_errors():
    with pytest.raises(ValueError, match="`num_heads` must be at least 1; got 0"):
        polyattn.alibi_slopes(0)
    with pytest.raises(TypeError, match="`num_heads` must be an integer"):
        polyattn.alibi_slopes(4.0)
    with pytest.raises(TypeError, match="`dtype` must be a real floating dtype of numpy"):
        polyattn.alibi_slopes(4, dtype=np.int32)
    torch = pytest.importorskip("torch")
    assert polyattn.alibi_slopes(4, xp=torch).dtype == torch.get_default_dtype()


# --------------------------------------------------------------------------- #
# Scaled rotary frequencies (rotary_frequencies, inv_freq, attention_factor)
# --------------------------------------------------------------------------- #

def test_rotary_frequencies_on_every_backend(xp, device, dtype_name):
    theta, factor = polyattn.rotary_frequencies(
        8, base=500.0, scaling={"rope_type": "linear", "factor": 2.0}, xp=xp,
        dtype=getattr(xp, dtype_name), device=device)
    assert_namespace_device(theta, xp, device, getattr(xp, dtype_name))
    assert_close(theta, 0.5 / 500.0 ** (np.arange(0, 8, 2) / 8), dtype_name)
    assert factor == 1.0


@pytest.mark.parametrize("rotary_dim", [None, 6])
def test_rope_with_inv_freq_and_attention_factor(xp, device, dtype_name, rotary_dim):
    """``inv_freq`` of the plain frequencies is ``base``; ``attention_factor`` multiplies the
    rotated features only."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 5, 8))                              # (B, H, T, E)
    pos = ragged_positions(2, 5)
    rd = 8 if rotary_dim is None else rotary_dim
    theta, _ = polyattn.rotary_frequencies(rd, base=500.0, xp=xp,
                                           dtype=getattr(xp, dtype_name), device=device)
    out = polyattn.apply_rotary_embedding(
        to_xp(x, xp, dtype=dtype_name, device=device), to_xp(pos, xp, device=device),
        inv_freq=theta, attention_factor=1.5, rotary_dim=rotary_dim)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    ref = rope_llama(x, pos, base=500.0, rotary_dim=rotary_dim)
    ref = np.concatenate([1.5 * ref[..., :rd], ref[..., rd:]], axis=-1)
    assert_close(out, ref, dtype_name)


def test_scaled_frequencies_by_formula():
    """llama3 keeps high frequencies, divides low ones by the factor, mixes between; YaRN's
    attention factor is 0.1 ln(factor) + 1."""
    theta, _ = polyattn.rotary_frequencies(128, base=500000.0)
    scaled, factor = polyattn.rotary_frequencies(128, base=500000.0, scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    wavelen = 2 * np.pi / theta
    np.testing.assert_array_equal(scaled[wavelen < 2048], theta[wavelen < 2048])
    np.testing.assert_allclose(scaled[wavelen > 8192], theta[wavelen > 8192] / 8, rtol=1e-15)
    between = (wavelen >= 2048) & (wavelen <= 8192)
    assert between.any() and np.all(scaled[between] <= theta[between])
    assert factor == 1.0
    yarn, factor = polyattn.rotary_frequencies(64, base=150000.0, scaling={
        "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096})
    assert math.isclose(factor, 0.1 * math.log(32.0) + 1.0)
    base, _ = polyattn.rotary_frequencies(64, base=150000.0)
    assert yarn[0] == base[0] and math.isclose(yarn[-1], base[-1] / 32.0)
