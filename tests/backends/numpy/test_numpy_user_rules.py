"""The NumPy fast path with the rules users write: ``score_mod``, ``mask_mod``, block masks.

Out, lse and gradients against the float64 reference (which applies the same rules in
Array-API calls), each ``mask_mod`` with a block mask of small tiles that the path's
tiles do not line up with: causal, prefix-LM, unsorted documents (whose key ranges do
not grow with the row), a window per head (tiles that differ between the heads of a
work item) and rows that see nothing; with the built-in rules and dropout. The
mechanics: the ``mask_mod`` is called on partial block-mask tiles only, and no rows of
a key block are computed where all their block-mask tiles are empty; unsorted segment
ids; read-only inputs left as they are; ``explain()``.
"""

from __future__ import annotations

import numpy as np
import pytest
from _support import NUMPY_SESSION_ONLY
from test_numpy_backward import check, problem, tiles  # noqa: F401 (tiles: a fixture)

import polyattn
from polyattn import ops
from polyattn.backends.numpy import backward as numpy_vjp
from polyattn.backends.numpy import forward as numpy_chunked

pytestmark = NUMPY_SESSION_ONLY

B, H, HKV, TQ, TK = 2, 4, 2, 13, 17
#: mod_args of every rule here: a T5 table (H, 9), a prefix per batch row, unsorted
#: document ids (B, Tk), a window per head
TABLE = np.random.default_rng(7).standard_normal((H, 9))
PREFIX = np.array([3, 9])
DOCS = np.array([[0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 2, 2, 2, 2, 1],
                 [1, 1, 0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0, 1, 1, 2, 2]])
WIDTH = np.array([0, 2, 5, 1])
MOD_ARGS = (TABLE, PREFIX, DOCS, WIDTH)
#: block-mask tiles (rows, keys) that the path's tiles line up with only in part (its key
#: blocks of 4 hold two, where they start at an even key)
BLOCK = (4, 2)


def causal(b, h, q_idx, kv_idx, table, prefix, docs, width):
    return q_idx >= kv_idx


def prefix_lm(b, h, q_idx, kv_idx, table, prefix, docs, width):
    return ops.logical_or(kv_idx < prefix[b], q_idx >= kv_idx)


def documents(b, h, q_idx, kv_idx, table, prefix, docs, width):
    return docs[b, q_idx] == docs[b, kv_idx]


def window_per_head(b, h, q_idx, kv_idx, table, prefix, docs, width):
    return ops.abs(q_idx - kv_idx) <= width[h]


def odd_rows_see_nothing(b, h, q_idx, kv_idx, table, prefix, docs, width):
    return ops.logical_and(q_idx % 2 == 0, kv_idx <= q_idx + 1)


def t5(score, b, h, q_idx, kv_idx, table, prefix, docs, width):
    return score + table[h, ops.minimum(ops.maximum(q_idx - kv_idx, -4), 4) + 4]


def capped_t5(score, b, h, q_idx, kv_idx, table, prefix, docs, width):
    return 3.0 * ops.tanh(t5(score, b, h, q_idx, kv_idx, table, prefix, docs, width) / 3.0)


MASKS = {f.__name__: f for f in (causal, prefix_lm, documents, window_per_head,
                                 odd_rows_see_nothing)}
SCORES = {"none": None, "t5": t5, "capped_t5": capped_t5}


def block_mask(mask_mod):
    return polyattn.block_mask(mask_mod, (B,), H, TQ, TK, mod_args=MOD_ARGS, block=BLOCK)


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("score", sorted(SCORES))
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_against_the_reference(tiles, mask, score, dtype_name):  # noqa: F811
    q, k, v = problem(1, tq=TQ, tk=TK)
    check(q, k, v, dtype_name, mod_args=MOD_ARGS, score_mod=SCORES[score],
          block_mask=block_mask(MASKS[mask]), grad_lse=True)


@pytest.mark.parametrize("score", ["none", "capped_t5"])
def test_without_a_block_mask(tiles, score):  # noqa: F811
    """A mask_mod evaluated on every tile, as where its block mask could not be built."""
    from polyattn import _problem

    q, k, v = problem(2, tq=TQ, tk=TK)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_problem, "call_block_mask", lambda *a, **kw: None)
        check(q, k, v, "float64", mod_args=MOD_ARGS, score_mod=SCORES[score],
              mask_mod=documents)


BUILT_IN = {
    "softcap+alibi": {"softcap": 2.0, "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
    "causal+window": {"is_causal": True, "window": (4, 1)},
    "lengths, bottom right": {"is_causal": True, "causal_alignment": "bottom_right",
                              "key_lengths": np.array([17, 9])},
    "dropout": {"dropout_p": 0.3, "dropout_seed": 5},
    "float mask": {"mask": np.random.default_rng(3).standard_normal((B, 1, TQ, TK))},
    "bool mask": {"mask": np.random.default_rng(4).random((1, H, TQ, TK)) < 0.8},
}


@pytest.mark.parametrize("dtype_name", ["float64", "float32"])
@pytest.mark.parametrize("built_in", sorted(BUILT_IN))
def test_with_the_built_in_rules(tiles, built_in, dtype_name):  # noqa: F811
    """In the order of operations: scale, soft-cap, ALiBi, score_mod, float mask, hidden."""
    q, k, v = problem(3, tq=TQ, tk=TK)
    check(q, k, v, dtype_name, mod_args=MOD_ARGS, score_mod=capped_t5,
          block_mask=block_mask(prefix_lm), **BUILT_IN[built_in])


def test_batch_axes_and_block_masks_for_them(tiles):  # noqa: F811
    """Two batch axes: ``b`` counts over both (a prefix per flat batch row), the block mask
    built for them; and one built without batch or heads, broadcast over both."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((3, 2, h, t, 5)) for h, t in ((H, TQ), (HKV, TK), (HKV, TK)))
    prefix = np.array([0, 3, 5, 9, 12, 16])

    def prefix_per_row(b, h, q_idx, kv_idx, prefix):
        return ops.logical_or(kv_idx < prefix[b], q_idx >= kv_idx)

    bm = polyattn.block_mask(prefix_per_row, (3, 2), H, TQ, TK, mod_args=(prefix,),
                             block=BLOCK)
    check(q, k, v, "float64", block_mask=bm, score_mod=lambda s, b, h, i, j, p: s * 0.5)
    anywhere = polyattn.block_mask(lambda b, h, i, j: i + 2 >= j, None, None, TQ, TK,
                                   block=BLOCK)
    check(q, k, v, "float32", block_mask=anywhere)


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_mask_mod_only_on_partial_tiles_and_no_empty_rows_computed(tiles, mask,  # noqa: F811
                                                                   monkeypatch):
    """Every call of the mask_mod covers partial block-mask tiles only (of its heads, rows
    and keys), forward and backward; every rectangle of scores computed gives each of its
    rows a non-empty block-mask tile among its keys (for some head of its work item)."""
    rule = MASKS[mask]
    bm = block_mask(rule)
    kinds = bm.kinds                                         # (B, H, nq, nk)
    bq, bk = BLOCK
    calls, rectangles = [], []

    def recorded(b, h, q_idx, kv_idx, *tables):
        if np.ndim(h) == 3:                                  # a tile of the NumPy path
            calls.append((int(np.ravel(b)[0]), np.ravel(h), np.ravel(q_idx), np.ravel(kv_idx)))
        return rule(b, h, q_idx, kv_idx, *tables)

    for module in (numpy_chunked, numpy_vjp):
        real = module._scores

        def spy(p, it, qe, ke, m, r0, r1, k0, k1, *a, real=real, **kw):
            rectangles.append((it.b[0], it.hk, it.q0 + r0, it.q0 + r1, k0, k1))
            return real(p, it, qe, ke, m, r0, r1, k0, k1, *a, **kw)

        monkeypatch.setattr(module, "_scores", spy)
    q, k, v = problem(4, tq=TQ, tk=TK)
    given = polyattn.block_mask(recorded, (B,), H, TQ, TK, mod_args=MOD_ARGS, block=BLOCK)
    np.testing.assert_array_equal(given.kinds, kinds)
    calls.clear()
    out, pullback = polyattn.attention_vjp(q, k, v, enable_gqa=True, block_mask=given,
                                           mod_args=MOD_ARGS, implementation="chunked")
    grads = pullback(np.ones_like(out))
    _, reference = polyattn.attention_vjp(q, k, v, enable_gqa=True, block_mask=bm,
                                          mod_args=MOD_ARGS, implementation="reference")
    for a, b in zip(grads, reference(np.ones_like(out)), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    for b, heads, rows, keys in calls:
        tiles_seen = kinds[b][np.ix_(heads, np.unique(rows // bq), np.unique(keys // bk))]
        assert (tiles_seen == 1).all(), (b, heads, rows, keys)
    assert rectangles
    g = H // HKV
    for b, hk, q0, q1, k0, k1 in rectangles:
        for i in range(q0, q1):
            some = kinds[b, hk * g:(hk + 1) * g, i // bq, k0 // bk:(k1 - 1) // bk + 1]
            assert (some != 0).any(), (b, hk, i, k0, k1)


@pytest.mark.parametrize("order", ["sorted", "unsorted"])
def test_segment_ids(tiles, order):  # noqa: F811
    """Sorted ids are key ranges, unsorted ones a mask compared per tile; both as the
    equivalent mask on the reference, with a score_mod and the built-in rules."""
    q, k, v = problem(5, tq=TK, tk=TK)
    ids = np.sort(DOCS, axis=-1) if order == "sorted" else DOCS
    check(q, k, v, "float64", segment_ids=ids, is_causal=True, softcap=3.0)
    check(q, k, v, "float32", segment_ids=ids, score_mod=t5, mod_args=MOD_ARGS)
    e = polyattn.explain(q, k, v, enable_gqa=True, segment_ids=ids, implementation="chunked")
    assert e.module == "polyattn.backends.numpy.forward"


def test_inputs_and_mod_args_are_not_modified():
    q, k, v = problem(6, tq=TQ, tk=TK)
    table = TABLE.copy()
    args = (q, k, v, table, PREFIX.copy(), DOCS.copy(), WIDTH.copy())
    for a in args:
        a.setflags(write=False)
    before = [a.copy() for a in args]

    def writes(score, b, h, q_idx, kv_idx, table, prefix, docs, width):
        score += 1.0                           # the tile the rule is given is its own to change
        return score

    out, pullback = polyattn.attention_vjp(*args[:3], enable_gqa=True, score_mod=writes,
                                           mask_mod=prefix_lm, mod_args=args[3:],
                                           implementation="chunked")
    pullback(np.ones_like(out))
    for a, b in zip(args, before, strict=True):
        np.testing.assert_array_equal(a, b)
    ref = polyattn.scaled_dot_product_attention(*args[:3], enable_gqa=True, mask_mod=prefix_lm,
                                                mod_args=args[3:], implementation="reference")
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_nan_query_rows_stay_nan_and_hidden_keys_never_leak():
    """A NaN query row is NaN; NaN in keys and values that only a mask_mod hides leaves the
    rows that do not see them finite and exact where the tiles keep them apart."""
    q, k, v = problem(7, tq=TQ, tk=TK)
    q[0, 1, 5] = np.nan
    out, lse = polyattn.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, score_mod=t5, block_mask=block_mask(causal),
        mod_args=MOD_ARGS, return_lse=True, implementation="chunked")
    assert np.isnan(out[0, 1, 5]).all() and np.isnan(lse[0, 1, 5])
    mask = np.ones(out.shape[:-1], dtype=bool)
    mask[0, 1, 5] = False
    ref = polyattn.scaled_dot_product_attention(q, k, v, enable_gqa=True, score_mod=t5,
                                                mask_mod=causal, mod_args=MOD_ARGS,
                                                implementation="reference")
    np.testing.assert_allclose(out[mask], ref[mask], rtol=1e-12, atol=1e-12)


def test_explain_says_how_the_rules_run():
    q, k, v = problem(8, tq=TQ, tk=TK)
    e = polyattn.explain(q, k, v, enable_gqa=True, score_mod=t5, block_mask=block_mask(causal),
                         mod_args=MOD_ARGS, implementation="chunked")
    assert e.module == "polyattn.backends.numpy.forward"
    line = e.details["numpy_chunked rules"]
    counts = block_mask(causal).counts
    assert "score_mod called on each tile" in line
    assert f"{counts['partial']} partial of {sum(counts.values())} tiles of {BLOCK}" in line
    assert f"its {counts['empty']} empty tiles are not computed" in line
    assert "numpy_chunked rules" in str(e)
