"""causal_mask, padding masks, and mask semantics."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import to_numpy, to_xp

import polyattn
from polyattn.masks import padding_mask


@pytest.mark.parametrize(("tq", "tk"), [(4, 4), (3, 6), (6, 3), (0, 3), (3, 0)])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_mask(xp, device, tq, tk, alignment):
    m = polyattn.causal_mask(tq, tk, alignment=alignment, xp=xp, device=device)
    assert m.dtype == xp.bool and tuple(m.shape) == (tq, tk)
    off = 0 if alignment == "top_left" else tk - tq
    expected = np.array([[j <= i + off for j in range(tk)] for i in range(tq)],
                        dtype=bool).reshape(tq, tk)
    np.testing.assert_array_equal(to_numpy(m), expected)


def test_alignments_agree_for_square():
    np.testing.assert_array_equal(polyattn.causal_mask(5, 5),
                                  polyattn.causal_mask(5, 5, alignment="bottom_right"))


def test_causal_mask_equals_is_causal(xp, device):
    rng = np.random.default_rng(0)
    q, k, v = (to_xp(rng.standard_normal((2, n, 4)), xp, device=device) for n in (3, 5, 5))
    for alignment in ("top_left", "bottom_right"):
        m = polyattn.causal_mask(3, 5, alignment=alignment, xp=xp, device=device)
        a = polyattn.scaled_dot_product_attention(q, k, v, attn_mask=m)
        b = polyattn.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  causal_alignment=alignment)
        np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-12, atol=1e-12)


def test_padding_mask(xp, device):
    lengths = to_xp(np.array([1, 3, 0]), xp, device=device)
    m = to_numpy(padding_mask(lengths, 3))
    assert m.shape == (3, 1, 1, 3)
    np.testing.assert_array_equal(m[:, 0, 0], [[1, 0, 0], [1, 1, 1], [0, 0, 0]])


def test_bool_and_float_masks_equivalent(xp, device):
    rng = np.random.default_rng(1)
    q, k, v = (to_xp(rng.standard_normal((2, 4, 3)), xp, device=device) for _ in range(3))
    keep = rng.random((4, 4)) < 0.6
    keep[:, 0] = True
    additive = np.where(keep, 0.0, -np.inf)
    a = polyattn.scaled_dot_product_attention(q, k, v, attn_mask=to_xp(keep, xp, device=device))
    b = polyattn.scaled_dot_product_attention(q, k, v,
                                              attn_mask=to_xp(additive, xp, device=device))
    np.testing.assert_allclose(to_numpy(a), to_numpy(b), rtol=1e-12, atol=1e-12)
