"""Property-based tests: random attention problems on every backend and implementation.

Each example draws shapes (batch dimensions, heads with GQA or broadcasting,
Tq, Tk, E, Ev, zeros included), a mask (none, boolean, floating with
``-inf``, broadcast along any axis), a causal alignment, a scale, a dtype and,
for the chunked path, block sizes. Checked against the float64 oracle and
for invariants: permuting keys and values together, adding a per-row
constant through a float mask, weight rows summing to 1 (0 when fully
masked), and causal outputs that do not depend, bit for bit, on keys beyond
each query's window.

Hypothesis profiles live in ``_hypothesis_profiles.py``; on JAX, where every
new shape compiles each operation anew, a quarter of the examples run.
"""

from __future__ import annotations

import math
from contextlib import ExitStack
from dataclasses import dataclass, replace
from unittest import mock

import _hypothesis_profiles  # noqa: F401  (registers and loads the profiles)
import numpy as np
import pytest
from _support import IMPLEMENTATIONS, assert_bitwise_equal, rounded, use_implementation
from helpers import TOLERANCE, Backend, ref_attention, to_numpy, to_xp
from hypothesis import given, settings
from hypothesis import strategies as st

import polyattn
from polyattn.backends.array_api import blocked as chunked
from polyattn.backends.numpy import plan as numpy_plan

#: The modules whose block sizes each example draws (the NumPy fast path's are its plan's).
BLOCKED = [chunked, numpy_plan]

#: Share of the profile's examples each backend runs.
EXAMPLE_SHARE = {Backend.JAX: 0.25}


@pytest.fixture(params=IMPLEMENTATIONS)
def implementation(request, backend, monkeypatch):
    return use_implementation(request.param, backend, monkeypatch)


def run_examples(backend, test, strategy):
    """Run ``test(problem)`` over ``strategy`` with this backend's share of the examples."""
    share = EXAMPLE_SHARE.get(backend, 1.0)
    n = max(3, math.ceil(settings().max_examples * share))
    settings(max_examples=n)(given(strategy)(test))()


# --------------------------------------------------------------------------- #
# Random problems
# --------------------------------------------------------------------------- #

@dataclass(frozen=True)
class Problem:
    q: np.ndarray                  # float64 values, already rounded to ``dtype``
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None        # bool, or float64 rounded to ``dtype``
    causal: str | None             # None, "top_left" or "bottom_right"
    scale: float | None
    gqa: bool
    dtype: str
    block_q: int
    block_k: int

    @property
    def tq(self) -> int:
        return self.q.shape[-2]

    @property
    def tk(self) -> int:
        return self.k.shape[-2]

    @property
    def offset(self) -> int:
        return 0 if self.causal != "bottom_right" else self.tk - self.tq

    def oracle(self):
        """(out, lse, weights) in float64, and Σ α |v| (the scale of out's rounding errors)."""
        out, lse, w = ref_attention(self.q, self.k, self.v, mask=self.mask,
                                    is_causal=self.causal is not None,
                                    alignment=self.causal or "top_left", scale=self.scale,
                                    enable_gqa=self.gqa)
        v = np.repeat(self.v, self.q.shape[-3] // self.v.shape[-3], axis=-3) \
            if self.gqa else self.v
        return out, lse, w, np.abs(w) @ np.abs(v)

    def args(self, xp, device):
        return [to_xp(a, xp, dtype=self.dtype, device=device) for a in (self.q, self.k, self.v)]

    def options(self, xp, device):
        options = {"is_causal": self.causal is not None,
                   "causal_alignment": self.causal or "top_left",
                   "scale": self.scale, "enable_gqa": self.gqa}
        if self.mask is not None:
            dtype = None if self.mask.dtype == bool else self.dtype
            options["attn_mask"] = to_xp(self.mask, xp, dtype=dtype, device=device)
        return options

    def blocks(self):
        """Context: the blocked paths' block sizes set to this example's."""
        stack = ExitStack()
        for module in BLOCKED:
            stack.enter_context(mock.patch.object(module, "BLOCK_Q", self.block_q))
            stack.enter_context(mock.patch.object(module, "BLOCK_K", self.block_k))
        return stack


@st.composite
def problems(draw, *, causal=None, mask_kinds=("none", "bool", "float", "float_inf"),
             dtypes=("float32", "float64"), min_tk=0):
    """A random attention problem; ``causal`` forces an alignment (True: any)."""
    batch = tuple(draw(st.lists(st.integers(1, 2), max_size=2)))
    heads = draw(st.sampled_from(["same", "gqa", "broadcast"]))
    hkv = draw(st.integers(1, 2))
    h = hkv * draw(st.integers(2, 3)) if heads == "gqa" else hkv
    if heads == "broadcast":
        h, hkv = draw(st.integers(2, 3)), 1
    tq, tk = draw(st.integers(0, 9)), draw(st.integers(min_tk, 11))
    e, ev = draw(st.integers(1, 6)), draw(st.integers(1, 5))
    dtype = draw(st.sampled_from(dtypes))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rounded(rng.standard_normal((*batch, h, tq, e)), dtype)
    k = rounded(rng.standard_normal((*batch, hkv, tk, e)), dtype)
    v = rounded(rng.standard_normal((*batch, hkv, tk, ev)), dtype)
    kind = draw(st.sampled_from(mask_kinds))
    mask = None
    if kind != "none":
        full = (*batch, h, tq, tk)
        shape = tuple(n if draw(st.booleans()) else 1 for n in full)
        shape = shape[draw(st.integers(0, len(batch) + 1)):]        # drop leading axes
        if kind == "bool":
            mask = rng.random(shape) < draw(st.sampled_from([0.3, 0.7, 1.0]))
        else:
            mask = rounded(rng.standard_normal(shape), dtype)
            if kind == "float_inf":
                mask = np.where(rng.random(shape) < 0.3, -np.inf, mask)
    if causal is None:
        alignment = draw(st.sampled_from([None, "top_left", "bottom_right"]))
    elif causal is True:
        alignment = draw(st.sampled_from(["top_left", "bottom_right"]))
    else:
        alignment = causal or None
    scale = draw(st.one_of(st.none(), st.floats(0.0, 2.0)))
    return Problem(q=q, k=k, v=v, mask=mask, causal=alignment, scale=scale,
                   gqa=heads == "gqa", dtype=dtype, block_q=draw(st.integers(1, 5)),
                   block_k=draw(st.integers(1, 6)))


# --------------------------------------------------------------------------- #
# Comparisons
# --------------------------------------------------------------------------- #

def assert_out_close(got, ref, magnitude, dtype, what="out"):
    """‖got − ref‖ ≤ tol · ‖Σ α |v|‖: relative to the size of the terms summed.

    Plain relative error is ill-conditioned when a row's weighted values
    cancel; the rounding error of a weighted sum scales with Σ α |v| instead.
    """
    got = to_numpy(got)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert not np.isnan(got).any(), f"{what}: NaN"
    err = np.linalg.norm(got - ref)
    assert err <= TOLERANCE[dtype] * np.linalg.norm(magnitude), (
        f"{what}: error {err:.3g} > {TOLERANCE[dtype]} × {np.linalg.norm(magnitude):.3g}")


def assert_lse_matches(got, ref, dtype, what="lse"):
    """-inf exactly where the oracle has it; elsewhere within tol · (1 + |lse|)."""
    got = to_numpy(got)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    inf = np.isneginf(ref)
    assert np.array_equal(np.isneginf(got), inf), f"{what}: -inf pattern differs"
    diff = np.abs(np.where(inf, 0, got) - np.where(inf, 0, ref))
    bound = TOLERANCE[dtype] * (1 + np.abs(np.where(inf, 0, ref)))
    assert np.all(diff <= bound), f"{what}: max error {np.max(diff / bound, initial=0):.3g}×tol"


# --------------------------------------------------------------------------- #
# Against the oracle
# --------------------------------------------------------------------------- #

def test_matches_oracle(backend, xp, device, implementation):
    def check(p):
        with p.blocks():
            out, lse = polyattn.scaled_dot_product_attention(
                *p.args(xp, device), return_lse=True, implementation=implementation,
                **p.options(xp, device))
        ref, ref_lse, _, magnitude = p.oracle()
        assert out.dtype == getattr(xp, p.dtype)
        assert_out_close(out, ref, magnitude, p.dtype)
        assert_lse_matches(lse, ref_lse, p.dtype)

    run_examples(backend, check, problems())


def test_weights_match_oracle_and_rows_sum_to_one(backend, xp, device):
    def check(p):
        w = polyattn.attention_weights(*p.args(xp, device)[:2], **p.options(xp, device))
        _, _, ref, _ = p.oracle()
        got = to_numpy(w)
        assert got.shape == ref.shape and w.dtype == getattr(xp, p.dtype)
        assert np.all(got >= 0)
        tol = TOLERANCE[p.dtype]
        assert np.all(np.abs(got - ref) <= tol), "weights differ from the oracle"
        sums, masked = got.sum(-1), ref.sum(-1) == 0
        assert np.all(got[masked] == 0), "a fully masked row has non-zero weights"
        assert np.all(np.abs(sums[~masked] - 1) <= tol * max(1, p.tk) ** 0.5)

    run_examples(backend, check, problems())


# --------------------------------------------------------------------------- #
# Invariants
# --------------------------------------------------------------------------- #

def test_permuting_keys_and_values_together(backend, xp, device, implementation):
    def check(data):
        p = data.draw(problems(causal=False))
        perm = np.asarray(data.draw(st.permutations(range(p.tk))), dtype=int)
        mask = p.mask
        if mask is not None and mask.shape[-1] == p.tk:
            mask = mask[..., perm]
        shuffled = replace(p, k=p.k[..., perm, :], v=p.v[..., perm, :], mask=mask)
        with p.blocks():
            out, lse = polyattn.scaled_dot_product_attention(
                *p.args(xp, device), return_lse=True, implementation=implementation,
                **p.options(xp, device))
            out2, lse2 = polyattn.scaled_dot_product_attention(
                *shuffled.args(xp, device), return_lse=True, implementation=implementation,
                **shuffled.options(xp, device))
        _, _, _, magnitude = p.oracle()
        assert_out_close(out2, to_numpy(out), 2 * magnitude, p.dtype)
        assert_lse_matches(lse2, to_numpy(lse), p.dtype)

    run_examples(backend, check, st.data())


def test_row_constant_in_float_mask(backend, xp, device, implementation):
    def check(data):
        p = data.draw(problems())
        shift = np.asarray(data.draw(st.lists(st.floats(-20, 20), min_size=p.tq,
                                              max_size=p.tq)), dtype=np.float64)
        shift = rounded(shift, p.dtype)[:, None]                     # (Tq, 1)
        base = p.mask
        if base is None:
            base = np.zeros((1, 1))
        elif base.dtype == bool:
            base = np.where(base, 0.0, -np.inf)
        shifted = replace(p, mask=base + shift)
        plain = replace(p, mask=base)
        with p.blocks():
            out, lse = polyattn.scaled_dot_product_attention(
                *plain.args(xp, device), return_lse=True, implementation=implementation,
                **plain.options(xp, device))
            out2, lse2 = polyattn.scaled_dot_product_attention(
                *shifted.args(xp, device), return_lse=True, implementation=implementation,
                **shifted.options(xp, device))
        _, _, _, magnitude = plain.oracle()
        assert_out_close(out2, to_numpy(out), 2 * magnitude, p.dtype)
        expected = to_numpy(lse) + np.broadcast_to(shift[:, 0], to_numpy(lse).shape)
        assert_lse_matches(lse2, expected, p.dtype)

    run_examples(backend, check, st.data())


def test_causal_output_ignores_keys_beyond_the_window(backend, xp, device, implementation):
    """Queries whose window ends before key ``cut`` are bitwise unchanged when keys ≥ cut change.

    Keys outside the window get weight exactly 0: their scores become -inf,
    ``exp(-inf) = 0`` adds nothing to any sum, and the running maximum of the
    chunked path never sees them, so the same operations run on the same
    visible values in the same order.
    """
    def check(data):
        p = data.draw(problems(causal=True, min_tk=1))
        cut = data.draw(st.integers(0, p.tk))
        rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
        k2, v2 = p.k.copy(), p.v.copy()
        k2[..., cut:, :] = rounded(10 * rng.standard_normal(k2[..., cut:, :].shape), p.dtype)
        v2[..., cut:, :] = rounded(10 * rng.standard_normal(v2[..., cut:, :].shape), p.dtype)
        perturbed = replace(p, k=k2, v=v2)
        with p.blocks():
            out, lse = polyattn.scaled_dot_product_attention(
                *p.args(xp, device), return_lse=True, implementation=implementation,
                **p.options(xp, device))
            out2, lse2 = polyattn.scaled_dot_product_attention(
                *perturbed.args(xp, device), return_lse=True, implementation=implementation,
                **perturbed.options(xp, device))
        rows = np.arange(p.tq) + p.offset < cut     # the window j <= i + offset ends before cut
        assert_bitwise_equal(to_numpy(out)[..., rows, :], to_numpy(out2)[..., rows, :])
        assert_bitwise_equal(to_numpy(lse)[..., rows], to_numpy(lse2)[..., rows], "lse")

    run_examples(backend, check, st.data())


# --------------------------------------------------------------------------- #
# softmax and logsumexp
# --------------------------------------------------------------------------- #

@st.composite
def logits(draw):
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=1, max_size=3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = draw(st.sampled_from([1.0, 30.0, 1e4])) * rng.standard_normal(shape)
    x = np.where(rng.random(shape) < draw(st.sampled_from([0.0, 0.3, 1.0])), -np.inf, x)
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    return x, axis, draw(st.sampled_from(["float32", "float64"]))


def test_softmax_and_logsumexp_match_numpy(backend, xp, device):
    def check(case):
        x, axis, dtype = case
        x = rounded(x, dtype)
        xx = to_xp(x, xp, dtype=dtype, device=device)
        with np.errstate(invalid="ignore", divide="ignore"):
            m = np.max(x, axis=axis, keepdims=True, initial=-np.inf)
            m = np.where(np.isneginf(m), 0, m)
            e = np.exp(x - m)
            total = e.sum(axis=axis, keepdims=True)
            expected = np.where(total > 0, e / np.where(total > 0, total, 1), 0)
            lse = np.squeeze(np.where(total > 0, m + np.log(total), -np.inf), axis=axis)
        got = to_numpy(polyattn.softmax(xx, axis=axis))
        assert got.dtype == np.dtype(dtype)
        assert np.all(np.abs(got - expected) <= TOLERANCE[dtype])
        assert_lse_matches(polyattn.logsumexp(xx, axis=axis), lse, dtype)

    run_examples(backend, check, logits())


def test_causal_window_bitwise_when_later_keys_dominate(xp, device, dtype_name, implementation):
    """A targeted case of the property above: keys beyond row 0's window get huge scores.

    The perturbed keys give the rows that see them scores of 50, so any
    rescaling decision shared by a block of rows (rather than made per row)
    changes row 0's bits.
    """
    rng = np.random.default_rng(200)
    q = rounded(rng.standard_normal((1, 2, 8, 4)), dtype_name)
    k = rounded(rng.standard_normal((1, 2, 8, 4)), dtype_name)
    v = rounded(rng.standard_normal((1, 2, 8, 3)), dtype_name)
    k2 = k.copy()
    k2[..., 1:, :] = rounded(50 * q[..., 1:, :] / np.sum(q[..., 1:, :] ** 2, -1, keepdims=True),
                             dtype_name)                           # q_i · k_i = 50 for i ≥ 1
    v2 = v.copy()
    v2[..., 1:, :] = -v[..., 1:, :]
    results = []
    for kk, vv in ((k, v), (k2, v2)):
        results.append(polyattn.scaled_dot_product_attention(
            *(to_xp(a, xp, dtype=dtype_name, device=device) for a in (q, kk, vv)),
            is_causal=True, return_lse=True, implementation=implementation))
    (out, lse), (out2, lse2) = results
    assert_bitwise_equal(to_numpy(out)[..., :1, :], to_numpy(out2)[..., :1, :])
    assert_bitwise_equal(to_numpy(lse)[..., :1], to_numpy(lse2)[..., :1], "lse")
