"""merge_attention: partial results over disjoint key sets combine into the one-shot result."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from helpers import (
    assert_close,
    assert_lse_close,
    assert_namespace_device,
    ref_attention,
    to_numpy,
    to_xp,
)

import polyattn


def parts(xp, device, dtype_name, q, k, v, cuts, mask=None, **kw):
    """Attention of q over each key slice between consecutive cuts, as backend arrays."""
    outs, lses = [], []
    qx = to_xp(q, xp, dtype=dtype_name, device=device)
    bounds = [0, *cuts, k.shape[-2]]
    for a, b in itertools.pairwise(bounds):
        kx = to_xp(k[..., a:b, :], xp, dtype=dtype_name, device=device)
        vx = to_xp(v[..., a:b, :], xp, dtype=dtype_name, device=device)
        mx = None if mask is None else to_xp(mask[..., a:b], xp, device=device)
        out, lse = polyattn.scaled_dot_product_attention(qx, kx, vx, attn_mask=mx,
                                                         return_lse=True, **kw)
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("cuts", [(5,), (3, 11), (1, 6, 13)], ids=["2", "3", "4"])
def test_merge_equals_one_shot(xp, device, dtype_name, cuts):
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((2, 3, 7, 4)), rng.standard_normal((2, 3, 16, 4)), \
        rng.standard_normal((2, 3, 16, 5))
    outs, lses = parts(xp, device, dtype_name, q, k, v, cuts)
    out, lse = polyattn.merge_attention(outs, lses)
    ref, ref_lse, _ = ref_attention(q, k, v)
    assert_namespace_device(out, xp, device, getattr(xp, dtype_name))
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


def test_merge_fully_masked_parts(xp, device, dtype_name):
    rng = np.random.default_rng(2)
    q, k, v = rng.standard_normal((2, 6, 4)), rng.standard_normal((2, 12, 4)), \
        rng.standard_normal((2, 12, 3))
    mask = rng.random((2, 6, 12)) < 0.6
    mask[:, :, 4:8] = False          # the middle part is hidden from every row
    mask[0, 2, :4] = False           # row (0, 2) sees only the last part
    mask[1, 5] = False               # row (1, 5) sees no key in any part
    outs, lses = parts(xp, device, dtype_name, q, k, v, (4, 8), mask=mask)
    assert np.all(np.isneginf(to_numpy(lses[1])))
    out, lse = polyattn.merge_attention(outs, lses)
    got, got_lse = to_numpy(out), to_numpy(lse)
    assert not np.isnan(got).any() and not np.isnan(got_lse).any()
    assert np.all(got[1, 5] == 0) and np.isneginf(got_lse[1, 5])
    ref, ref_lse, _ = ref_attention(q, k, v, mask=mask)
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


def test_merge_single_part_is_identity(xp, device, dtype_name):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((3, 5, 4)) for _ in range(3))
    outs, lses = parts(xp, device, dtype_name, q, k, v, ())
    out, lse = polyattn.merge_attention(outs, lses)
    assert_close(out, to_numpy(outs[0]), dtype_name)
    assert_lse_close(lse, to_numpy(lses[0]), dtype_name)


def test_merge_causal_kv_cache_split(xp, device, dtype_name):
    """A cached prefix and the new keys, merged, equal bottom-right causal attention."""
    rng = np.random.default_rng(4)
    q, k, v = rng.standard_normal((1, 2, 4, 8)), rng.standard_normal((1, 2, 10, 8)), \
        rng.standard_normal((1, 2, 10, 8))
    outs, lses = parts(xp, device, dtype_name, q[..., :, :], k[..., :6, :], v[..., :6, :], ())
    new, new_lse = parts(xp, device, dtype_name, q, k[..., 6:, :], v[..., 6:, :], (),
                         is_causal=True, causal_alignment="bottom_right")
    out, lse = polyattn.merge_attention([*outs, *new], [*lses, *new_lse])
    ref, ref_lse, _ = ref_attention(q, k, v, is_causal=True, alignment="bottom_right")
    assert_close(out, ref, dtype_name)
    assert_lse_close(lse, ref_lse, dtype_name)


def test_merge_float16_outs_float32_lses():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 6, 8)).astype(np.float16) for _ in range(3))
    a = polyattn.scaled_dot_product_attention(q, k[:, :3], v[:, :3], return_lse=True)
    b = polyattn.scaled_dot_product_attention(q, k[:, 3:], v[:, 3:], return_lse=True)
    assert a[0].dtype == np.float16 and a[1].dtype == np.float32
    out, lse = polyattn.merge_attention([a[0], b[0]], [a[1], b[1]])
    assert out.dtype == np.float16 and lse.dtype == np.float32
    ref, ref_lse, _ = ref_attention(*(x.astype(np.float64) for x in (q, k, v)))
    assert_close(out, ref, "float16")
    assert_lse_close(lse, ref_lse, "float16")


def test_merge_errors():
    out = np.zeros((2, 3, 4))
    lse = np.zeros((2, 3))
    with pytest.raises(ValueError, match="at least one"):
        polyattn.merge_attention([], [])
    with pytest.raises(ValueError, match=r"`outs` has 2 parts but `lses` has 1"):
        polyattn.merge_attention([out, out], [lse])
    with pytest.raises(ValueError, match=r"`outs\[1\]` has shape \(2, 3, 5\)"):
        polyattn.merge_attention([out, np.zeros((2, 3, 5))], [lse, lse])
    with pytest.raises(ValueError, match=r"`lses\[0\]` has shape \(2, 4\).*\(2, 3, 4\)"):
        polyattn.merge_attention([out], [np.zeros((2, 4))])
    with pytest.raises(TypeError, match=r"`lses\[0\]`.*floating"):
        polyattn.merge_attention([out], [np.zeros((2, 3), dtype=np.int64)])
    with pytest.raises(TypeError, match="sequence"):
        polyattn.merge_attention(out, lse)
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match=r"numpy.*torch"):
        polyattn.merge_attention([out, torch.zeros(2, 3, 4)], [lse, torch.zeros(2, 3)])


def test_merge_in_bthe_layout(xp, device):
    """Outputs computed with layout="BTHE" merge with layout="BTHE" (lse is (B, H, Tq) in both)."""
    rng = np.random.default_rng(21)
    q = to_xp(rng.standard_normal((1, 4, 4, 8)), xp, device=device)      # (B, Tq, H=Tq, E)
    k = to_xp(rng.standard_normal((1, 12, 4, 8)), xp, device=device)
    v = to_xp(rng.standard_normal((1, 12, 4, 3)), xp, device=device)
    parts = [polyattn.scaled_dot_product_attention(q, k[:, a:b, ...], v[:, a:b, ...], layout="BTHE",
                                                   return_lse=True) for a, b in ((0, 7), (7, 12))]
    out, lse = polyattn.merge_attention([p[0] for p in parts], [p[1] for p in parts],
                                        layout="BTHE")
    full, full_lse = polyattn.scaled_dot_product_attention(q, k, v, layout="BTHE",
                                                           return_lse=True)
    assert out.shape == (1, 4, 4, 3) and lse.shape == (1, 4, 4)
    assert_close(out, to_numpy(full), "float64")
    assert_close(lse, to_numpy(full_lse), "float64", what="lse")
