"""User rules compiled into kernels (polyattn.rules.scalar, the numba_cpu family).

The traced source, run as plain Python over a span of scores, gives what the rule gives
on NumPy tiles, and its derivative what ``ops.Dual`` gives; the constructs that cannot
become scalar code are refused naming the function and the construct; ``mod_args``
buffers hold every kind of array, an index outside a table is clamped to it; on
``numba_cpu``: a block mask with empty tiles between visible ones, rows a ``mask_mod``
hides entirely, a block mask's rows (solid ones and ones with holes), integer and
boolean tables, and a rule the kernel cannot take (``"auto"`` runs the NumPy fast path
instead, ``implementation="numba_cpu"`` refuses naming it); a rule seen before is not
traced again unless a value it reads changed (:func:`polyattn.rules.tracing.fingerprint`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from _support import NUMPY_SESSION_ONLY, use_implementation
from helpers import Backend, rel_error

import polyattn
from polyattn import ops
from polyattn.rules import scalar, tracing
from polyattn.rules.user import UserRules, modified, modified_grad

pytestmark = NUMPY_SESSION_ONLY
sdpa = polyattn.scaled_dot_product_attention


def _rules():
    """score_mods whose value and derivative the traced source must reproduce, with the
    mod_args they read."""
    table = np.linspace(-1.0, 1.0, 4 * 9).reshape(4, 9)
    steps = np.array([3, -1, 4, 1, -5], dtype=np.int32)
    return {
        "softcap": (lambda s, b, h, q, kv: 2.5 * ops.tanh(s / 2.5), ()),
        "relu-below-diagonal": (lambda s, b, h, q, kv: ops.where(
            q >= kv, s, ops.maximum(s, 0.0)), ()),
        "quotient": (lambda s, b, h, q, kv: s / (1.0 + s * s) - 2.0 / (3.0 + ops.abs(s)), ()),
        "powers-and-roots": (lambda s, b, h, q, kv: s ** 3 / 7.0 + ops.sqrt(s * s + 1.0)
                             - ops.log(ops.exp(-s) + 2.0), ()),
        "trigonometry": (lambda s, b, h, q, kv: ops.sin(s) * ops.cos(0.5 * s) - s, ()),
        "integer-maths": (lambda s, b, h, q, kv: s + ((q - kv) // 3) % 4 - (b + h) * 0.25
                          + (q ^ kv) - (kv << 1) + (q >> 1), ()),
        "tables": (lambda s, b, h, q, kv, tb, st: s * tb[h, (q - kv) % 9] + st[kv % 5 - 2]
                   + ops.minimum(s, tb[h, -1]), (table, steps)),
        "constant": (lambda s, b, h, q, kv: 1.5 + 0 * q, ()),
    }


def _run_source(traced, form, scores, b, h, q, key0, arrays):
    """The generated ``form`` run as Python on a panel of one query row (``ld = w = 1``)."""
    width = scalar.meta_width(traced)
    fb, ib, meta = scalar.pack(arrays, np.float64, width)
    names = {"T": float, "math": math, "np": np, "clamp": scalar.clamp, "tanh": math.tanh}
    exec(scalar.source(traced, form), names)
    s = list(scores)
    panel = (s, 1, len(s), 1, key0, [q], [h], b)
    if form == "score_grad":
        d = [1.0] * len(s)
        names[form](*panel, d, fb, ib, meta)
        return np.array(s), np.array(d)
    if form == "mask":
        names[form](*panel, [1], fb, ib, meta)
    else:
        names[form](*panel, fb, ib, meta)
    return np.array(s), None


@pytest.mark.parametrize("name", sorted(_rules()))
def test_source_matches_the_rule_on_tiles_value_and_derivative(name):
    fn, arrays = _rules()[name]
    traced = tracing.trace(fn, "score_mod", arrays)
    rng = np.random.default_rng(7)
    import array_api_compat.numpy as xp

    user = UserRules(score_mod=fn, mod_args=arrays)
    for b, h, q in ((0, 0, 2), (1, 3, 5)):
        scores = rng.standard_normal(9) * 3
        tile = np.broadcast_to(scores, (2, 2, 2, 1, 9)).copy()       # (B, Hkv, G, bq, bk)
        want = modified(user, tile, q, q + 1, 0, 9, xp, None)[b, h // 2, h % 2, 0]
        grad = modified_grad(user, tile, q, q + 1, 0, 9, xp, None)[b, h // 2, h % 2, 0]
        got, _ = _run_source(traced, "score", scores, b, h, q, 0, arrays)
        got2, d = _run_source(traced, "score_grad", scores, b, h, q, 0, arrays)
        np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(got2, want, rtol=1e-13, atol=1e-13)
        np.testing.assert_allclose(d, grad, rtol=1e-12, atol=1e-12)


def test_mask_source_and_clamped_indices():
    allowed = np.array([True, False, True])
    traced = tracing.trace(lambda b, h, q, kv, ok: ops.logical_and(ok[kv - 1], q >= kv),
                          "mask_mod", (allowed,))
    got, _ = _run_source(traced, "mask", np.zeros(6), 0, 0, 3, 0, (allowed,))
    # kv - 1 = -1 reads from the end (True); 3, 4 clamp to the last entry; q >= kv hides 4, 5
    want = [0.0, 0.0, -np.inf, 0.0, -np.inf, -np.inf]
    np.testing.assert_array_equal(got, want)


def test_panel_source_computes_row_and_key_values_once_each():
    """In a panel, what depends on the query row alone is computed once per row (here
    the query's document), what depends on the key alone once per key (the key's), each
    row then reading its own: a panel of 3 rows by 7 keys against the rule itself."""
    doc = np.array([0, 0, 0, 1, 1, 2, 2, 2, 3])
    fn = lambda b, h, q, kv, d: ops.logical_and(d[q] == d[kv], q >= kv)  # noqa: E731
    traced = tracing.trace(fn, "mask_mod", (doc,))
    text = scalar.source(traced, "mask")
    body = text.split("for j in range(n):")
    assert "clamp(q," in body[0] and "clamp(q," not in body[1], text
    assert "clamp(kv," in body[1].split("for c in range(w):")[0], text
    fb, ib, meta = scalar.pack((doc,), np.float64, scalar.meta_width(traced))
    names = {"T": float, "math": math, "np": np, "clamp": scalar.clamp, "tanh": math.tanh}
    exec(text, names)
    rows, key0, n = [2, 4, 7], 1, 7
    s = [0.0] * (n * len(rows))                        # s[j·ld + c], ld = 3
    names["mask"](s, len(rows), n, len(rows), key0, rows, [0, 1, 2], 0, [1, 1, 1], fb, ib,
                  meta)
    got = np.array(s).reshape(n, len(rows))
    for j in range(n):
        for c, q in enumerate(rows):
            kv = key0 + j
            visible = doc[q] == doc[kv] and q >= kv
            assert got[j, c] == (0.0 if visible else -np.inf), (q, kv)


@pytest.mark.parametrize("fn, what, construct", [
    (lambda s, b, h, q, kv: s if s > 0 else 0.0 * s, "score_mod", "ops.where"),
    (lambda s, b, h, q, kv: math.tanh(s), "score_mod", "Python float"),
    (lambda s, b, h, q, kv: np.tanh(s), "score_mod", "NumPy function"),
    (lambda s, b, h, q, kv: s + np.ones(3), "score_mod", "through mod_args"),
    (lambda s, b, h, q, kv: s ** q, "score_mod", "ops.exp and ops.log"),
    (lambda s, b, h, q, kv, t: s + t[h, s], "score_mod", "indexed by a floating value"),
    (lambda s, b, h, q, kv, t: s + t[h], "score_mod", "a kernel indexes every axis"),
    (lambda s, b, h, q, kv: s + sum(range(q)), "score_mod", "Python int"),
    (lambda b, h, q, kv: q - kv, "mask_mod", "must return a condition"),
    (lambda b, h, q, kv: ops.where(q > kv, 1.0, 0.0), "mask_mod", "must return a condition"),
])
def test_constructs_that_cannot_be_compiled_are_named(fn, what, construct):
    with pytest.raises(TypeError, match=rf"{what} .*lambda.* cannot be compiled into a "
                                        rf"kernel: .*{construct}"):
        tracing.trace(fn, what, (np.zeros((2, 3)),) if "t" in fn.__code__.co_varnames else ())


# --------------------------------------------------------------------------- #
# numba_cpu
# --------------------------------------------------------------------------- #

def test_numba_cpu_tanh32_within_6_ulp_of_tanh():
    """The kernels' float32 tanh (soft-capping, ops.tanh) against float64's, never past
    ±1, with inf, NaN and -0."""
    pytest.importorskip("numba", reason="numba_cpu's own tanh needs Numba (numba_cpu session)")
    from numba import njit

    from polyattn.backends.numba_cpu.tanh import tanh32

    @njit
    def apply(x, out):
        for i in range(x.shape[0]):
            out[i] = tanh32(x[i])

    x = np.concatenate([np.linspace(-12, 12, 400001), np.geomspace(1e-30, 12, 20001),
                        -np.geomspace(1e-30, 12, 20001)]).astype(np.float32)
    out = np.empty_like(x)
    apply(x, out)
    ref = np.tanh(x.astype(np.float64))
    ulp = np.abs(out - ref) / np.spacing(np.abs(ref).astype(np.float32))
    assert ulp.max() <= 6.0
    assert np.abs(out).max() <= 1.0
    special = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], dtype=np.float32)
    got = np.empty_like(special)
    apply(special, got)
    np.testing.assert_array_equal(got, [1.0, -1.0, np.nan, 0.0, -0.0])
    assert np.signbit(got[-1]) and not np.signbit(got[-2])


@pytest.fixture
def numba_cpu(monkeypatch):
    return use_implementation("numba_cpu", Backend.NUMPY, monkeypatch)


def _qkv(rng, tq=40, tk=40, dtype=np.float64):
    return (rng.standard_normal((2, 4, tq, 8)).astype(dtype),
            rng.standard_normal((2, 2, tk, 8)).astype(dtype),
            rng.standard_normal((2, 2, tk, 8)).astype(dtype))


def document(b, h, q_idx, kv_idx, doc):
    return doc[b, q_idx] == doc[b, kv_idx]


def test_numba_cpu_block_mask_with_empty_tiles_between_visible_ones(numba_cpu):
    """Packed documents: the tiles between a row's document and the diagonal are empty
    and skipped, partial ones run the mask_mod; a row of a document whose keys a second
    rule hides entirely is fully masked (out 0, lse -inf)."""
    rng = np.random.default_rng(8)
    q, k, v = _qkv(rng)
    doc = np.repeat(np.array([[0] * 13 + [1] * 7 + [2] * 20, [0] * 30 + [1] * 10]), 1, axis=0)
    bm = polyattn.block_mask(document, (2,), None, 40, 40, mod_args=(doc,), block=(8, 8))
    assert bm.counts["empty"] > 0 and bm.counts["full"] > 0

    def hide_second(b, h, q_idx, kv_idx, doc):
        return ops.logical_and(doc[b, q_idx] == doc[b, kv_idx], doc[b, q_idx] != 1)

    for mask_mod in (document, hide_second):
        kw = dict(enable_gqa=True, mask_mod=mask_mod, mod_args=(doc,), return_lse=True)
        out, lse = sdpa(q, k, v, implementation=numba_cpu,
                        block_mask=bm if mask_mod is document else None, **kw)
        ref, ref_lse = sdpa(q, k, v, implementation="reference", **kw)
        assert rel_error(out, ref) <= 1e-12
        finite = np.isfinite(ref_lse)
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        assert rel_error(lse[finite], ref_lse[finite]) <= 1e-12
    assert (~finite).any() and (out[~finite] == 0).all()


def test_numba_cpu_block_mask_rows_solid_and_with_holes(numba_cpu):
    """Packed documents, causal inside each, per head: rows whose visible keys are one
    solid run (the block mask's rows) need no mask_mod, the rows of a document with holes
    take it, the rows of a hidden document give 0 and lse -inf; forward, lse and
    gradients against the reference without a block mask, in float32 and float64."""
    rng = np.random.default_rng(12)
    lengths = ([9, 30, 5, 26], [40, 3, 27])
    doc = np.stack([np.repeat(np.arange(len(n)), n) for n in lengths])       # (2, 70)

    def documents(b, h, q_idx, kv_idx, doc):
        inside = ops.logical_and(doc[b, q_idx] == doc[b, kv_idx], q_idx >= kv_idx)
        holes = ops.logical_or(doc[b, q_idx] != 1, (q_idx - kv_idx + h) % 3 != 1)
        return ops.logical_and(ops.logical_and(inside, holes), doc[b, q_idx] != 2)

    bm = polyattn.block_mask(documents, (2,), 4, 70, 70, mod_args=(doc,), block=(16, 8))
    solid = bm.rows[..., 2].astype(bool) & (bm.rows[..., 0] < bm.rows[..., 1])
    assert solid.any() and not bm.rows[..., 2].all()
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 2e-5)):
        q, k, v = _qkv(rng, 70, 70, dtype)
        kw = dict(enable_gqa=True, mask_mod=documents, mod_args=(doc,))
        out, lse = sdpa(q, k, v, implementation=numba_cpu, block_mask=bm, return_lse=True,
                        **kw)
        ref, ref_lse = sdpa(q, k, v, implementation="reference", return_lse=True, **kw)
        assert rel_error(out, ref) <= tol
        finite = np.isfinite(ref_lse)
        np.testing.assert_array_equal(np.isfinite(lse), finite)
        assert (~finite).any() and (out[~finite] == 0).all()
        assert rel_error(lse[finite], ref_lse[finite]) <= tol
        _, pullback = polyattn.attention_vjp(q, k, v, implementation=numba_cpu, block_mask=bm,
                                             **kw)
        _, ref_pullback = polyattn.attention_vjp(q, k, v, implementation="reference", **kw)
        go = rng.standard_normal(out.shape).astype(dtype)
        for a, b in zip(pullback(go), ref_pullback(go), strict=True):
            assert rel_error(a, b) <= 20 * tol


def test_numba_cpu_with_every_other_rule(numba_cpu):
    """User rules between the built-in ones (docs/semantics.rst's order): soft-capping and
    ALiBi before score_mod, a float mask after it, key lengths, a window, segment ids and
    dropout beside a mask_mod; forward and gradients in float32 and float64."""
    rng = np.random.default_rng(9)
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 2e-5)):
        q, k, v = _qkv(rng, 33, 37, dtype)
        table = rng.standard_normal((4, 9)).astype(dtype)

        def t5(s, b, h, q_idx, kv_idx, tb):
            return s + tb[h, ops.minimum(ops.maximum(q_idx - kv_idx, -4), 4) + 4]

        def stripes(b, h, q_idx, kv_idx, tb):
            return (q_idx + kv_idx + h) % 5 != 0

        kw = dict(enable_gqa=True, softcap=4.0, alibi_slopes=rng.random(4),
                  attn_mask=rng.standard_normal((33, 37)).astype(dtype),
                  key_lengths=np.array([30, 37]), window=(20, 3), score_mod=t5,
                  mask_mod=stripes, mod_args=(table,),
                  segment_ids=(np.sort(rng.integers(0, 3, (2, 33))),
                               np.sort(rng.integers(0, 3, (2, 37)))))
        out, pullback = polyattn.attention_vjp(q, k, v, implementation=numba_cpu, **kw)
        ref, ref_pullback = polyattn.attention_vjp(q, k, v, implementation="reference", **kw)
        assert rel_error(out, ref) <= tol
        go = rng.standard_normal(out.shape).astype(dtype)
        for a, b in zip(pullback(go), ref_pullback(go), strict=True):
            assert rel_error(a, b) <= 20 * tol
        drop = dict(kw, dropout_p=0.3, dropout_seed=5)
        assert rel_error(sdpa(q, k, v, implementation=numba_cpu, **drop),
                         sdpa(q, k, v, implementation="reference", **drop)) <= tol


def test_numba_cpu_integer_and_boolean_tables(numba_cpu):
    rng = np.random.default_rng(10)
    q, k, v = _qkv(rng, 20, 24)
    buckets = rng.integers(-8, 8, size=30).astype(np.int16)       # negative: from the end
    visible = rng.random((4, 24)) > 0.3
    bias = rng.standard_normal(8)

    def score_mod(s, b, h, q_idx, kv_idx, bk, vis, bias):
        return s + bias[bk[q_idx + kv_idx // 4]]

    def mask_mod(b, h, q_idx, kv_idx, bk, vis, bias):
        return ops.logical_or(vis[h, kv_idx], q_idx == kv_idx)

    kw = dict(enable_gqa=True, score_mod=score_mod, mask_mod=mask_mod,
              mod_args=(buckets, visible, bias))
    out = sdpa(q, k, v, implementation=numba_cpu, **kw)
    index = np.arange(20)[:, None] + np.arange(24)[None, :] // 4
    b_ = buckets[index].astype(np.int64)
    b_ = np.where(b_ < 0, b_ + 8, b_)
    allowed = visible[:, None, :] | (np.arange(20)[:, None] == np.arange(24))[None]
    ref = sdpa(q, k, v, enable_gqa=True, attn_mask=np.where(allowed, bias[b_][None], -np.inf),
               implementation="reference")
    assert rel_error(out, ref) <= 1e-12


def test_numba_cpu_refuses_a_rule_it_cannot_compile_and_auto_runs_it_elsewhere(numba_cpu):
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, 64, 64)

    def numpy_inside(b, h, q_idx, kv_idx):
        return np.logical_and(q_idx >= kv_idx, kv_idx >= 0)    # NumPy tiles, not a kernel

    with pytest.raises(ValueError, match=r"numba_cpu.*numpy_inside.*NumPy function"):
        sdpa(q, k, v, enable_gqa=True, mask_mod=numpy_inside, implementation=numba_cpu)
    explanation = polyattn.explain(q, k, v, enable_gqa=True, mask_mod=numpy_inside)
    assert explanation.implementation == "chunked"
    assert explanation.module == "polyattn.backends.numpy.forward"
    assert "numpy_inside" in str(explanation)
    out = sdpa(q, k, v, enable_gqa=True, mask_mod=numpy_inside)
    ref = sdpa(q, k, v, enable_gqa=True, is_causal=True, implementation="reference")
    assert rel_error(out, ref) <= 1e-12


# --------------------------------------------------------------------------- #
# Rules written in ways that cannot work, and the forms that do
# --------------------------------------------------------------------------- #

def test_a_rule_that_loses_the_derivative_or_returns_no_scores_is_refused():
    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, 8, 8)
    cases = [
        (lambda s, b, h, qi, ki: np.where(qi >= ki, s * 2, -1.0), "loses the score's derivative"),
        (lambda s, b, h, qi, ki: None, "must return scores"),
        (lambda s, b, h, qi, ki: qi >= ki, "must return scores"),
        (lambda s, b, h, qi, ki: math.tanh(s), "use the functions of polyattn.ops"),
        (lambda s, b, h, qi, ki, t: s + t[h, (qi - ki) * 0.5], "indices are integers"),
    ]
    for rule, words in cases:
        args = (np.zeros((4, 9)),) if rule.__code__.co_argcount == 6 else ()
        with pytest.raises(TypeError, match=words):
            sdpa(q, k, v, enable_gqa=True, score_mod=rule, mod_args=args,
                 implementation="reference")
    with pytest.raises(TypeError, match=r"`mod_args\[0\]` must have a real floating"):
        sdpa(q, k, v, enable_gqa=True, score_mod=lambda s, b, h, qi, ki, t: s + t[h],
             mod_args=(np.zeros(4, dtype=complex),))


def _every_path(monkeypatch):
    """The implementations that take user rules on NumPy arrays here."""
    names = ["reference", "chunked"]
    try:
        import numba  # noqa: F401
        names.append(use_implementation("numba_cpu", Backend.NUMPY, monkeypatch))
    except ImportError:
        pass
    return names


def test_outside_indices_powers_of_numbers_and_0d_tables_agree_everywhere(monkeypatch):
    """Indices outside an axis clamp to it on every path (never into the next row), a
    power of a number by the score, a 0-d table read as t[()] with its gradient, and a
    mask_mod returning a Python bool."""
    rng = np.random.default_rng(13)
    q, k, v = _qkv(rng, 9, 9)
    table, temp = rng.standard_normal((4, 9)), np.array(0.7)

    def rule(s, b, h, qi, ki, t, c):
        return s * c[()] + t[0 * h, qi - ki + 6] + 2.0 ** (0.1 * s)

    distance = np.arange(9)[:, None] - np.arange(9)[None, :] + 6       # -2 ..= 14
    distance = np.clip(np.where(distance < 0, distance + 9, distance), 0, 8)

    def formula(s):
        return s * 0.7 + table[0, distance] + 2.0 ** (0.1 * s)

    scale = 1 / np.sqrt(8)
    kk, vv = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    w = formula(q @ np.swapaxes(kk, -1, -2) * scale)
    w = np.exp(w - w.max(-1, keepdims=True))
    ref = (w / w.sum(-1, keepdims=True)) @ vv
    for name in _every_path(monkeypatch):
        out = sdpa(q, k, v, enable_gqa=True, score_mod=rule, mod_args=(table, temp),
                   mask_mod=lambda b, h, qi, ki, t, c: True, implementation=name)
        assert rel_error(out, ref) <= 1e-12, name
        _, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True, score_mod=rule,
                                             mod_args=(table, temp), implementation=name)
        dtemp = pullback(np.ones_like(out))[4]
        eps = 1e-6
        loss = [float(sdpa(q, k, v, enable_gqa=True, score_mod=rule,
                           mod_args=(table, temp + d)).sum()) for d in (eps, -eps)]
        assert dtemp.shape == () and abs((loss[0] - loss[1]) / (2 * eps) - dtemp) < 1e-7


def test_a_block_mask_must_fit_the_call_s_mask_mod():
    docs = np.array([[0] * 8 + [1] * 8, [0] * 16])
    rng = np.random.default_rng(14)
    q, k, v = (rng.standard_normal((2, 4, 16, 8)) for _ in range(3))

    def document(b, h, qi, ki, ids):
        return ids[b, qi] == ids[b, ki]

    def causal(b, h, qi, ki, ids):
        return qi >= ki

    unbatched = polyattn.block_mask(document, None, None, 16, 16, mod_args=(docs,),
                                    block=(4, 4))
    with pytest.raises(ValueError, match=r"batch_shape=None, but its mask_mod .*document "
                                         "reads `b`"):
        sdpa(q, k, v, block_mask=unbatched, mod_args=(docs,))
    other = polyattn.block_mask(causal, None, None, 16, 16, mod_args=(docs,), block=(4, 4))
    with pytest.raises(ValueError, match=r"built for mask_mod .*causal, not for this "
                                         r"call's .*document"):
        sdpa(q, k, v, block_mask=other, mask_mod=document, mod_args=(docs,))
    same = polyattn.block_mask(lambda b, h, qi, ki, ids: qi >= ki, None, None, 16, 16,
                               mod_args=(docs,), block=(4, 4))
    out = sdpa(q, k, v, block_mask=same, mask_mod=causal, mod_args=(docs,))  # same rule
    assert rel_error(out, sdpa(q, k, v, is_causal=True, implementation="reference")) <= 1e-12


#: Read by ``_capped`` below: rebinding it must change the compiled rule.
CAP = 2.0


def _capped(s, b, h, q_idx, kv_idx):
    return CAP * ops.tanh(s / CAP)


def test_fingerprint_tells_rules_apart_by_what_they_read():
    """Equal code reading equal values gives equal keys; a rebound global, another
    closure value or default gives another key; a rule reading a mutable object (an
    array in its closure) gets none, so that it is traced at every call."""
    global CAP
    fp = tracing.fingerprint

    def make(cap, offset=0):
        return lambda s, b, h, q_idx, kv_idx, o=offset: cap * ops.tanh(s / cap) + o

    assert fp(make(3.0)) == fp(make(3.0)) is not None
    assert fp(make(3.0)) != fp(make(4.0))
    assert fp(make(3.0)) != fp(make(3.0, offset=1))
    before = fp(_capped)
    try:
        CAP = 5.0
        assert fp(_capped) != before
    finally:
        CAP = 2.0
    assert fp(_capped) == before
    table = np.ones(3)
    assert fp(lambda s, b, h, q_idx, kv_idx: s * table[0]) is None
    helper = make(3.0)
    assert fp(lambda s, b, h, q_idx, kv_idx: helper(s, b, h, q_idx, kv_idx)) is not None


def test_numba_cpu_recompiles_a_rule_whose_global_changed(numba_cpu, monkeypatch):
    """A rule seen before runs without being traced again; rebinding a global it reads
    gives the new rule's result, not the cached one's."""
    global CAP
    rng = np.random.default_rng(11)
    q, k, v = _qkv(rng, tq=24, tk=24)
    kw = dict(enable_gqa=True, score_mod=_capped)
    sdpa(q, k, v, implementation=numba_cpu, **kw)
    calls = []
    real = tracing.trace
    monkeypatch.setattr(tracing, "trace", lambda *a: calls.append(a[1]) or real(*a))
    out = sdpa(q, k, v, implementation=numba_cpu, **kw)
    assert calls == []                                    # neither checked nor compiled again
    try:
        CAP = 0.5
        changed = sdpa(q, k, v, implementation=numba_cpu, **kw)
        want = sdpa(q, k, v, implementation="reference", **kw)
    finally:
        CAP = 2.0
    assert calls                                          # the new value was traced
    assert rel_error(changed, want) <= 1e-12
    assert rel_error(out, changed) > 1e-3


def test_numba_cpu_rules_with_infinite_and_nan_constants(numba_cpu):
    """Constants inf, -inf and nan in a rule become source the kernel compiles (their
    repr is no literal), giving the reference's result."""
    rng = np.random.default_rng(12)
    q, k, v = _qkv(rng, tq=24, tk=24)
    rules = {
        "where -inf": lambda s, b, h, q_idx, kv_idx: ops.where(q_idx >= kv_idx, s,
                                                               -float("inf")),
        "plus -inf": lambda s, b, h, q_idx, kv_idx: s + ops.where(
            (q_idx - kv_idx) % 3 == 0, 0.0, -math.inf),
        "nan far": lambda s, b, h, q_idx, kv_idx: ops.where(q_idx - kv_idx > 20,
                                                            float("nan"), s),
    }
    for name, rule in rules.items():
        out = sdpa(q, k, v, enable_gqa=True, score_mod=rule, implementation=numba_cpu)
        want = sdpa(q, k, v, enable_gqa=True, score_mod=rule, implementation="reference")
        np.testing.assert_array_equal(np.isnan(out), np.isnan(want), err_msg=name)
        finite = ~np.isnan(want)
        assert rel_error(out[finite], want[finite]) <= 1e-12, name
    assert np.isnan(want).any()


#: Read by ``_windowed`` below: changing it after building a block mask must be caught.
WIN = 2


def _windowed(b, h, q_idx, kv_idx):
    return ops.logical_and(q_idx >= kv_idx, q_idx - kv_idx <= WIN)


@pytest.mark.parametrize("implementation", ["reference", "chunked", "auto"])
def test_a_block_mask_whose_rule_changed_since_it_was_built_is_refused(implementation):
    """A global or closure value the mask_mod reads, changed after the block mask was
    built, makes its tiles wrong for the rule: every implementation refuses the call
    (the tiles are checked against the rule as it was when built), and accepts it again
    once the value is back."""
    global WIN
    rng = np.random.default_rng(15)
    q, k, v = (rng.standard_normal((1, 2, 16, 4)) for _ in range(3))
    bm = polyattn.block_mask(_windowed, None, None, 16, 16, block=(4, 4))
    want = sdpa(q, k, v, window=(2, 0), implementation="reference")
    try:
        WIN = 9
        for kw in ({"mask_mod": _windowed}, {}):
            with pytest.raises(ValueError, match=r"value it reads .* has changed since"):
                sdpa(q, k, v, block_mask=bm, implementation=implementation, **kw)
    finally:
        WIN = 2
    assert rel_error(sdpa(q, k, v, block_mask=bm, implementation=implementation),
                     want) <= 1e-12
    width = [3]
    captured = polyattn.block_mask(lambda b, h, qi, ki, w=None: qi - ki <= width[0] - 1,
                                   None, None, 16, 16, block=(4, 4))
    assert captured.rule_key is None and captured.rule is not None   # a list: no key
    width[0] = 9
    with pytest.raises(ValueError, match="has changed since"):
        sdpa(q, k, v, block_mask=captured, implementation=implementation)
