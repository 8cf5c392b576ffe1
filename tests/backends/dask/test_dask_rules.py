"""The Dask plan with user rules (``score_mod``, ``mask_mod``, ``mod_args``, block masks)
and segment ids: each tile calls the rules with the call's indices, against the float64
reference; the tiles a block mask or sorted segment ids leave empty get no task; building
the plan computes nothing.

These tests build Dask arrays themselves (with chunkings chosen per test), so they run in
the session that selects Dask.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from helpers import Backend, assert_close, assert_lse_close, selected_backends

import polyattn
from polyattn import ops
from polyattn import scaled_dot_product_attention as sdpa
from polyattn.backends.dask import plan as distributed

pytestmark = pytest.mark.skipif(
    Backend.DASK not in selected_backends(),
    reason="Dask plan tests: they run where POLYATTN_TEST_BACKENDS selects dask")

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")

#: (query chunks, key chunks, batch chunks) of the query (B1, B2, H, Tq, E) and keys
CHUNKINGS = [(37, 41, (2, 3)), (8, 8, (1, 1)), (5, 16, (2, 1)), ((10, 20, 7), (3, 30, 8), (1, 2))]
B1, B2, H, HKV, TQ, TK, E, EV = 2, 3, 4, 2, 37, 41, 8, 6
SPAN = TQ + TK                   # the table's distance axis: q_idx - kv_idx + TK in [0, SPAN)


def _inputs(rng):
    q = rng.standard_normal((B1, B2, H, TQ, E))
    k = rng.standard_normal((B1, B2, HKV, TK, E))
    v = rng.standard_normal((B1, B2, HKV, TK, EV))
    return q, k, v


def _dask(x, rows, batch):
    """``x`` (B1, B2, heads, T, F) chunked by ``batch`` on the batch axes and ``rows`` on T."""
    return da.from_array(x, chunks=(batch[0], batch[1], -1, rows, -1))


def relative_bias(score, b, h, q_idx, kv_idx, table, per_row):
    """A table indexed by the query head and the distance, and a bias per flat batch row."""
    return score + table[h, q_idx - kv_idx + TK] + per_row[b]


def striped(b, h, q_idx, kv_idx, table, per_row):
    """Hides keys by batch row, head, row and key together (the call's indices only)."""
    return ((q_idx + 2 * kv_idx + b + h) % 5) != 0


def _reference(q, k, v, **options):
    return sdpa(q, k, v, enable_gqa=True, return_lse=True, implementation="reference",
                **options)


@pytest.mark.parametrize("chunks", CHUNKINGS)
@pytest.mark.parametrize("tables", ["numpy", "dask"])
def test_user_rules_see_the_call_indices(chunks, tables):
    rng = np.random.default_rng(60)
    q, k, v = _inputs(rng)
    table = rng.standard_normal((H, SPAN))
    per_row = rng.standard_normal(B1 * B2)
    rows, keys, batch = chunks
    qd, kd, vd = _dask(q, rows, batch), _dask(k, keys, batch), _dask(v, keys, batch)
    args = (table, per_row)
    if tables == "dask":
        args = (da.from_array(table, chunks=(3, 11)), da.from_array(per_row, chunks=2))
    for options in ({"score_mod": relative_bias},
                    {"score_mod": relative_bias, "mask_mod": striped, "is_causal": True,
                     "causal_alignment": "bottom_right"}):
        out, lse = sdpa(qd, kd, vd, enable_gqa=True, return_lse=True, mod_args=args,
                        implementation="distributed", **options)
        ref, ref_lse = _reference(q, k, v, mod_args=(table, per_row), **options)
        assert_close(out.compute(), ref, "float64")
        assert_lse_close(lse.compute(), ref_lse, "float64")


def test_user_rules_with_positions_from_key_lengths():
    """Bottom-right positions that follow key lengths run the tile row by row: each row's
    ``b`` is still the call's."""
    rng = np.random.default_rng(61)
    q, k, v = _inputs(rng)
    table = rng.standard_normal((H, SPAN))
    per_row = rng.standard_normal(B1 * B2)
    lengths = np.array([[41, 17, 30], [5, 0, 40]])
    options = {"score_mod": relative_bias, "mask_mod": striped, "is_causal": True,
               "causal_alignment": "bottom_right", "key_lengths": lengths,
               "mod_args": (table, per_row)}
    out, lse = sdpa(_dask(q, 10, (1, 2)), _dask(k, 16, (1, 2)), _dask(v, 16, (1, 2)),
                    enable_gqa=True, return_lse=True, implementation="distributed", **options)
    ref, ref_lse = _reference(q, k, v, **options)
    assert_close(out.compute(), ref, "float64")
    assert_lse_close(lse.compute(), ref_lse, "float64")


def test_float32_tiles():
    rng = np.random.default_rng(62)
    q, k, v = (x.astype(np.float32) for x in _inputs(rng))
    table = rng.standard_normal((H, SPAN)).astype(np.float32)
    per_row = rng.standard_normal(B1 * B2).astype(np.float32)
    options = {"score_mod": relative_bias, "mask_mod": striped, "mod_args": (table, per_row)}
    out = sdpa(_dask(q, 8, (1, 3)), _dask(k, 8, (1, 3)), _dask(v, 8, (1, 3)),
               enable_gqa=True, **options)
    ref, _ = _reference(*(x.astype(np.float64) for x in (q, k, v)), **options)
    assert out.dtype == np.float32
    assert_close(out.compute(), ref, "float32")


# --- block masks: the empty tiles get no task ---------------------------------------------

def documents_and_prefix(b, h, q_idx, kv_idx):
    """Blocks of 16 rows see their own 16 keys and the first 8 keys: the tiles between
    them are empty, those on the diagonal full."""
    return ops.logical_or(q_idx // 16 == kv_idx // 16, kv_idx < 8)


def _tile_tasks(out):
    return [key for key in dict(out.__dask_graph__())
            if isinstance(key, tuple) and str(key[0]).startswith("attention-tile-")
            and isinstance(key[-1], int) and "merge" not in key]


@pytest.mark.parametrize("block", [(16, 16), (8, 8)])
def test_block_mask_tiles_that_are_empty_get_no_task(block):
    rng = np.random.default_rng(63)
    t = 64
    q, k, v = (rng.standard_normal((2, 2, t, 4)) for _ in range(3))
    bm = polyattn.block_mask(documents_and_prefix, None, None, t, t, block=block)
    qd, kd, vd = (da.from_array(x, chunks=(1, 2, 16, 4)) for x in (q, k, v))
    plan = distributed.make_plan(qd, kd, _rules(qd, block_mask=bm), None)
    # per batch chunk: query chunk 0 sees key chunk 0; chunk i > 0 sees 0 and i
    assert {iq: ks for ((b,), iq), ks in plan.tiles.items() if b == 0} == {
        0: (0,), 1: (0, 1), 2: (0, 2), 3: (0, 3)}
    assert plan.tile_tasks == 2 * 7 and plan.all_tiles == 2 * 16
    assert plan.full_tiles == 2 * 4          # the diagonal: mask_mod not evaluated there
    out, lse = sdpa(qd, kd, vd, block_mask=bm, return_lse=True)
    assert len(_tile_tasks(out)) == plan.tile_tasks
    e = polyattn.explain(qd, kd, vd, block_mask=bm)
    assert e.implementation == "distributed"
    assert "14 tile tasks (18 tiles no query sees are left out)" in e.plan
    assert "8 of the tile tasks full" in e.plan
    ref, ref_lse = sdpa(q, k, v, mask_mod=documents_and_prefix, return_lse=True,
                        implementation="reference")
    assert_close(out.compute(), ref, "float64")
    assert_lse_close(lse.compute(), ref_lse, "float64")


def test_a_full_tile_does_not_evaluate_the_mask_mod():
    """A tile the block mask calls full never calls mask_mod (counted as it runs)."""
    calls = []

    def counting(b, h, q_idx, kv_idx):
        calls.append(1)
        return q_idx >= 0                     # every key: every tile full

    q = da.from_array(np.random.default_rng(64).standard_normal((1, 1, 32, 4)),
                      chunks=(1, 1, 16, 4))
    bm = polyattn.block_mask(counting, None, None, 32, 32, block=(16, 16))
    out = sdpa(q, q, q, mask_mod=counting, block_mask=bm)
    calls.clear()                             # building the block mask and the call's checks
    got = out.compute(scheduler="sync")
    assert not calls
    x = q.compute()
    np.testing.assert_allclose(got, sdpa(x, x, x, implementation="reference"), rtol=1e-12)


def _rules(q, **options):
    from polyattn._problem import prepare

    defaults = {"attn_mask": None, "is_causal": False, "causal_alignment": "top_left",
                "scale": None, "enable_gqa": False}
    return prepare(q, q, q, **{**defaults, **options}).rules


# --- segment ids --------------------------------------------------------------------------

#: Two rows of packed documents, sorted: (16, 20, 28) tokens and (40, 24) tokens.
SORTED = np.array([[0] * 16 + [1] * 20 + [2] * 28, [5] * 40 + [9] * 24])


@pytest.mark.parametrize("chunks", [((1, 1), 16, 16), ((2,), 8, 24), ((1, 1), (10, 30, 24),
                                                                       (20, 4, 40))])
@pytest.mark.parametrize("order", ["sorted", "unsorted", "lazy"])
def test_segment_ids(chunks, order):
    rng = np.random.default_rng(65)
    batch, rows, keys = chunks
    q = rng.standard_normal((2, 4, 64, 8))
    k, v = (rng.standard_normal((2, 2, 64, 8)) for _ in range(2))
    ids = SORTED if order != "unsorted" else rng.permutation(SORTED, axis=1)
    given = ids
    if order == "lazy":                      # a task: values not at hand
        given = da.from_array(ids, chunks=(1, 16)) + 0
    qd = da.from_array(q, chunks=(batch, 4, rows, 8))
    kd, vd = (da.from_array(x, chunks=(batch, 2, keys, 8)) for x in (k, v))
    for options in ({}, {"is_causal": True}, {"window": (6, 3), "softcap": 5.0}):
        out, lse = sdpa(qd, kd, vd, segment_ids=given, enable_gqa=True, return_lse=True,
                        implementation="distributed", **options)
        ref, ref_lse = _reference(q, k, v, segment_ids=ids, **options)
        assert_close(out.compute(), ref, "float64")
        assert_lse_close(lse.compute(), ref_lse, "float64")


def test_segment_ids_as_a_pair_with_user_rules():
    rng = np.random.default_rng(66)
    q = rng.standard_normal((2, 4, 24, 8))
    k, v = (rng.standard_normal((2, 2, 40, 8)) for _ in range(2))
    q_ids = np.array([[0] * 10 + [1] * 14, [3] * 24])
    k_ids = np.array([[0] * 15 + [1] * 25, [3] * 30 + [4] * 10])
    table = rng.standard_normal((4, 64))

    def bias(score, b, h, q_idx, kv_idx, table):
        return score + table[h, q_idx - kv_idx + 40]

    options = {"segment_ids": (q_ids, k_ids), "score_mod": bias, "mod_args": (table,)}
    out = sdpa(da.from_array(q, chunks=(1, 4, 7, 8)), da.from_array(k, chunks=(1, 2, 9, 8)),
               da.from_array(v, chunks=(1, 2, 9, 8)), enable_gqa=True, **options)
    ref, _ = _reference(q, k, v, **options)
    assert_close(out.compute(), ref, "float64")


def test_sorted_segment_ids_leave_out_the_tiles_of_other_documents():
    q = da.zeros((2, 1, 64, 4), chunks=(1, 1, 16, 4))
    plan = distributed.make_plan(q, q, _rules(q, segment_ids=SORTED), None)
    # row 0: documents 0-15, 16-35, 36-63; row 1: 0-39, 40-63 (per batch chunk)
    assert {iq: ks for ((b,), iq), ks in plan.tiles.items() if b == 0} == {
        0: (0,), 1: (1, 2), 2: (1, 2, 3), 3: (2, 3)}
    assert {iq: ks for ((b,), iq), ks in plan.tiles.items() if b == 1} == {
        0: (0, 1, 2), 1: (0, 1, 2), 2: (0, 1, 2, 3), 3: (2, 3)}
    assert plan.tile_tasks == 8 + 12
    out = sdpa(q, q, q, segment_ids=SORTED)
    assert len(_tile_tasks(out)) == 20
    e = polyattn.explain(q, q, q, segment_ids=SORTED)
    assert "20 tile tasks (12 tiles no query sees are left out)" in e.plan
    assert "tiles outside every query's segment are left out" in e.plan
    # unsorted or lazy ids: a mask only, every tile kept
    for ids in (SORTED[:, ::-1], da.from_array(SORTED, chunks=(1, 64)) + 0):
        e = polyattn.explain(q, q, q, segment_ids=ids)
        assert e.implementation == "distributed"
        assert "32 tile tasks" in e.plan and "no tile is left out for them" in e.plan


# --- laziness -------------------------------------------------------------------------------

def _poisoned(shape, chunks, dtype=np.float64):
    """A Dask array that raises if any of its chunks is ever computed."""
    def boom(block_info=None):
        raise AssertionError("an input chunk was computed while the graph was built")

    return da.map_blocks(boom, dtype=dtype, chunks=chunks,
                         meta=np.empty((0,) * len(shape), dtype))


def test_building_the_plan_computes_nothing():
    shape, chunks = (1, 2, 64, 8), ((1,), (2,), (16,) * 4, (8,))
    q, k, v = (_poisoned(shape, chunks) for _ in range(3))
    table = _poisoned((2, 128), ((2,), (64, 64)))
    ids = _poisoned((1, 64), ((1,), (16,) * 4), np.int64)

    def bias(score, b, h, q_idx, kv_idx, table):
        return score + table[h, q_idx - kv_idx + 64]

    def causal(b, h, q_idx, kv_idx, table):
        return q_idx >= kv_idx

    options = {"score_mod": bias, "mask_mod": causal, "mod_args": (table,), "segment_ids": ids}
    calls = []

    def count(*args, **kwargs):
        calls.append(1)
        return dask.get(*args, **kwargs)

    with dask.config.set(scheduler=count):
        out, lse = sdpa(q, k, v, return_lse=True, **options)
        e = polyattn.explain(q, k, v, **options)
    assert not calls
    assert out.shape == (1, 2, 64, 8) and lse.shape == (1, 2, 64)
    assert e.implementation == "distributed" and "16 tile tasks" in e.plan
    # the table and the ids are layers the graph depends on, not values captured in it
    layers = out.__dask_graph__().layers
    assert table.name in layers and ids.name in layers


def test_tasks_capture_no_array_and_run_on_processes():
    rng = np.random.default_rng(67)
    q, k, v = _inputs(rng)
    table = rng.standard_normal((H, SPAN))
    per_row = rng.standard_normal(B1 * B2)
    options = {"score_mod": relative_bias, "mask_mod": striped, "mod_args": (table, per_row),
               "segment_ids": (np.arange(TQ) // 9, np.arange(TK) // 10)}
    out = sdpa(_dask(q, 16, (1, 3)), _dask(k, 16, (1, 3)), _dask(v, 16, (1, 3)),
               enable_gqa=True, **options)
    own = [task for key, task in dict(out.__dask_graph__()).items()
           if "attention" in str(key[0] if isinstance(key, tuple) else key)]
    assert own
    for task in own:
        assert len(pickle.dumps(task)) < 4096
    ref, _ = _reference(q, k, v, **options)
    assert_close(out.compute(scheduler="processes"), ref, "float64")
