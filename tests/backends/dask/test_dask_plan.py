"""The Dask plan (implementation "distributed"): its tasks, its results, its laziness.

These tests build Dask arrays themselves (with chunkings chosen per test), so they
run in the session that selects Dask. The cluster tests are in
``test_dask_cluster.py``.
"""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from helpers import Backend, assert_close, assert_lse_close, ref_attention, selected_backends

import polyattn
from polyattn import scaled_dot_product_attention as sdpa
from polyattn.backends.dask import plan as distributed
from polyattn.backends.dask import tasks
from polyattn.rules.visibility import Rules

pytestmark = pytest.mark.skipif(
    Backend.DASK not in selected_backends(),
    reason="Dask plan tests: they run where POLYATTN_TEST_BACKENDS selects dask")

da = pytest.importorskip("dask.array")
dask = pytest.importorskip("dask")


def _dask(a: np.ndarray, chunk: int, axis: int = -2) -> object:
    """``a`` as a Dask array with chunks of ``chunk`` along ``axis`` (one chunk elsewhere)."""
    axis = axis % a.ndim
    return da.from_array(a, chunks=tuple(chunk if i == axis else -1 for i in range(a.ndim)))


def _inputs(rng, b=2, h=4, hkv=2, tq=37, tk=41, e=8, ev=6):
    q = rng.standard_normal((b, h, tq, e))
    k = rng.standard_normal((b, hkv, tk, e))
    v = rng.standard_normal((b, hkv, tk, ev))
    return q, k, v


def _plan(q, k, **options):
    return polyattn.explain(q, k, k, **options).plan


# --- the plan: which tasks exist -------------------------------------------------------

def test_auto_picks_distributed_and_explain_counts_tasks():
    q = da.zeros((1, 2, 64, 8), chunks=(1, 2, 16, 8))
    e = polyattn.explain(q, q, q)
    assert e.implementation == "distributed"
    assert e.candidates["distributed"] == ""
    assert "4 query chunks" in e.plan and "4 key chunks" in e.plan
    assert "16 tile tasks" in e.plan and "plan: " in str(e)


@pytest.mark.parametrize("nq", [1, 3, 8])
def test_causal_plan_has_the_lower_triangle_only(nq):
    t, c = 16 * nq, 16
    q = da.zeros((1, 1, t, 4), chunks=(1, 1, c, 4))
    plan = distributed.make_plan(q, q, _rules(q, is_causal=True), None)
    assert plan.tile_tasks == nq * (nq + 1) // 2
    assert plan.all_tiles == nq * nq
    assert all(tuple(range(iq + 1)) == ks for (_, iq), ks in plan.tiles.items())
    full = distributed.make_plan(q, q, _rules(q), None)
    assert full.tile_tasks == nq * nq


def _rules(q, **options):
    """The Rules that scaled_dot_product_attention would build for these options."""
    from polyattn._problem import prepare

    defaults = {"attn_mask": None, "is_causal": False, "causal_alignment": "top_left",
                "scale": None, "enable_gqa": False}
    problem = prepare(q, q, q, **{**defaults, **options})
    return problem.rules


def test_window_plan_keeps_the_band():
    q = da.zeros((1, 1, 128, 4), chunks=(1, 1, 16, 4))
    plan = distributed.make_plan(q, q, _rules(q, window=(16, 0), is_causal=True), None)
    # each query chunk sees its own key chunk and the one before it
    assert {iq: ks for (_, iq), ks in plan.tiles.items()} == {
        iq: tuple(range(max(0, iq - 1), iq + 1)) for iq in range(8)}
    assert "(49 tiles no query sees are left out)" in plan.describe()


def test_key_lengths_at_hand_leave_out_padding_tiles():
    q = da.zeros((4, 1, 64, 4), chunks=(2, 1, 16, 4))
    lengths = np.array([10, 20, 64, 33])
    plan = distributed.make_plan(q, q, _rules(q), lengths)
    # batch chunk 0 holds rows with 10 and 20 keys (2 key chunks), chunk 1 rows with 64, 33
    assert plan.tiles[(0,), 0] == (0, 1) and plan.tiles[(1,), 0] == (0, 1, 2, 3)
    got = polyattn.explain(q, q, q, key_lengths=da.from_array(lengths))
    assert "24 tile tasks" in got.plan   # 4 query chunks x (2 + 4) key chunks


def test_merge_tree_fan_in():
    q = da.zeros((1, 1, 8, 4), chunks=(1, 1, 8, 4))
    k = da.zeros((1, 1, 8 * 20, 4), chunks=(1, 1, 8, 4))
    plan = distributed.make_plan(q, k, _rules_qk(q, k), None)
    assert plan.tile_tasks == 20
    assert plan.merge_tasks == 3 + 1      # 20 parts -> 3 merges of up to 8 -> 1
    out = sdpa(q, k, k)
    merges = [key for key in dict(out.__dask_graph__()) if "merge" in key]
    assert len(merges) == plan.merge_tasks


def _rules_qk(q, k, **options):
    from polyattn._problem import prepare

    problem = prepare(q, k, k, attn_mask=None, is_causal=False, causal_alignment="top_left",
                      scale=None, enable_gqa=False, **options)
    return problem.rules


# --- laziness: nothing runs, nothing large is captured -----------------------------------

def _poisoned(shape, chunks):
    """A Dask array that raises if any of its chunks is ever computed."""
    def boom(block_info=None):
        raise AssertionError("an input chunk was computed while the graph was built")

    return da.map_blocks(boom, dtype=np.float32, chunks=chunks,
                         meta=np.empty((0,) * len(shape), np.float32))


def test_building_the_graph_computes_nothing():
    shape, chunks = (1, 2, 64, 8), ((1,), (2,), (16,) * 4, (8,))
    q, k, v = (_poisoned(shape, chunks) for _ in range(3))
    mask = da.ones((1, 1, 64, 64), dtype=bool, chunks=(1, 1, 16, 16))
    out, lse = sdpa(q, k, v, attn_mask=mask, is_causal=True, return_lse=True)
    assert out.shape == (1, 2, 64, 8) and lse.shape == (1, 2, 64)
    assert polyattn.explain(q, k, v, is_causal=True).implementation == "distributed"


def test_no_array_is_captured_in_a_task():
    rng = np.random.default_rng(0)
    q, k, v = (_dask(x, 16) for x in _inputs(rng, tq=64, tk=64))
    mask = _dask(rng.standard_normal((2, 1, 64, 64)) > 0, 16)
    out = sdpa(q, k, v, attn_mask=mask, enable_gqa=True)
    graph = dict(out.__dask_graph__())
    own = [task for key, task in graph.items() if "attention" in str(key[0])]
    assert own
    for task in own:
        # every argument of a tile, merge or output task is a key, a number or the spec
        assert len(pickle.dumps(task)) < 4096


# --- results: every keyword against the float64 oracle -------------------------------------

def test_uneven_chunks_batch_chunks_and_bthe_layout():
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, b=3, tq=23, tk=50)
    ref, ref_lse, _ = ref_attention(q, k, v, enable_gqa=True, is_causal=True,
                                    alignment="bottom_right")
    to_bthe = (0, 2, 1, 3)
    qd = da.from_array(q.transpose(to_bthe), chunks=((1, 2), (5, 11, 7), 4, 8))
    kd = da.from_array(k.transpose(to_bthe), chunks=((2, 1), (13, 30, 7), 2, 8))
    vd = da.from_array(v.transpose(to_bthe), chunks=(3, 17, 1, 6))
    out, lse = sdpa(qd, kd, vd, enable_gqa=True, is_causal=True, layout="BTHE",
                    causal_alignment="bottom_right", return_lse=True)
    assert out.shape == (3, 23, 4, 6)
    assert_close(out.compute().transpose(to_bthe), ref, "float64")
    assert_lse_close(lse.compute(), ref_lse, "float64")


def test_decode_splits_the_keys():
    """One query per row against a long cache: the keys are the split (split-K)."""
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, b=3, tq=1, tk=200)
    lengths = np.array([200, 57, 1])
    ref, ref_lse, _ = ref_attention(q, k, v, enable_gqa=True, alignment="bottom_right",
                                    is_causal=True, key_lengths=lengths)
    kw = {"is_causal": True, "key_lengths": da.from_array(lengths)}
    qd, kd, vd = _dask(q, 1), _dask(k, 32), _dask(v, 32)
    e = polyattn.explain(qd, kd, vd, enable_gqa=True, causal_alignment="bottom_right", **kw)
    assert "7 key chunks" in e.plan and "7 tile tasks" in e.plan
    out, lse = sdpa(qd, kd, vd, enable_gqa=True, causal_alignment="bottom_right",
                    return_lse=True, **kw)
    assert_close(out.compute(), ref, "float64")
    assert_lse_close(lse.compute(), ref_lse, "float64")


def test_fully_masked_rows_and_query_chunks_that_see_nothing():
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, b=1, tq=32, tk=32)
    mask = np.ones((1, 1, 32, 32), dtype=bool)
    mask[..., 3, :] = False                               # one fully masked row
    kw = {"window": (0, 0)}                               # each query sees its own key only
    ref, _, _ = ref_attention(q, k, v, enable_gqa=True, mask=mask, **kw)
    out, lse = sdpa(_dask(q, 8), _dask(k, 8), _dask(v, 8), attn_mask=_dask(mask, 8),
                    enable_gqa=True, return_lse=True, **kw)
    out, lse = dask.compute(out, lse)
    assert np.all(out[..., 3, :] == 0) and np.all(lse[..., 3] == -np.inf)
    assert_close(out, ref, "float64")
    # no key at all (key lengths 0, at hand): query chunks whose tiles are all left out
    qd, kd = _dask(q, 8), _dask(k, 8)
    assert "0 tile tasks" in polyattn.explain(qd, kd, kd, enable_gqa=True, key_lengths=0).plan
    out0, lse0 = dask.compute(*sdpa(qd, kd, kd, enable_gqa=True, key_lengths=0,
                                    return_lse=True))
    assert out0.shape == (1, 4, 32, 8)
    assert np.all(out0 == 0) and np.all(lse0 == -np.inf)


def test_nan_and_inf_propagate_as_on_one_machine():
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng, b=1, tq=24, tk=24)
    q[0, 1, 5, 0] = np.nan          # a NaN query row
    k[0, 0, 20, 2] = np.inf         # an inf key seen by rows >= 20 of heads 0 and 1
    args = [_dask(x, 8) for x in (q, k, v)]
    got = sdpa(*args, enable_gqa=True, is_causal=True).compute()
    with np.errstate(invalid="ignore"):        # inf - inf in the reference's softmax
        want = sdpa(q, k, v, enable_gqa=True, is_causal=True, implementation="reference")
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-12, atol=1e-12)


def test_large_scores_merge_within_the_contract_in_float32():
    """Tile lses are float64: scores near 1e4 still merge to float32 accuracy."""
    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng, b=1, tq=16, tk=64)
    q *= 300.0
    ref, ref_lse, _ = ref_attention(q.astype(np.float32), k.astype(np.float32), v,
                                    enable_gqa=True)
    assert np.abs(ref_lse).max() > 1000
    args = [_dask(x.astype(np.float32), c) for x, c in ((q, 16), (k, 8), (v, 8))]
    assert_close(sdpa(*args, enable_gqa=True).compute(), ref, "float32")


def test_numpy_constants_with_dask_inputs():
    """NumPy masks, slopes and key lengths (a NumPy scalar too) join Dask inputs."""
    rng = np.random.default_rng(10)
    q, k, v = _inputs(rng, b=2, tq=12, tk=12)
    kw = {"attn_mask": rng.random((12, 12)) > 0.2, "alibi_slopes": np.array([0.1, 0.2, 0.3, 0.4]),
          "key_lengths": np.int64(9), "is_causal": True}
    got = sdpa(_dask(q, 4), _dask(k, 4), _dask(v, 4), enable_gqa=True, **kw)
    assert polyattn.explain(_dask(q, 4), _dask(k, 4), _dask(v, 4), enable_gqa=True,
                            **kw).implementation == "distributed"
    np.testing.assert_allclose(got.compute(), sdpa(q, k, v, enable_gqa=True, **kw),
                               rtol=1e-12, atol=1e-12)


# --- what the plan does not do, said plainly ---------------------------------------------

def test_dropout_goes_to_the_blocked_path():
    rng = np.random.default_rng(11)
    q, k, v = (_dask(x, 8) for x in _inputs(rng, b=1, tq=16, tk=16))
    kw = {"enable_gqa": True, "dropout_p": 0.25, "dropout_seed": 3}
    e = polyattn.explain(q, k, v, **kw)
    assert e.implementation in ("reference", "chunked")
    assert "dropout" in e.candidates["distributed"]
    with pytest.raises(ValueError, match=r"implementation=.distributed.*dropout"):
        sdpa(q, k, v, implementation="distributed", **kw)
    want = sdpa(*(x.compute() for x in (q, k, v)), **kw)
    np.testing.assert_allclose(sdpa(q, k, v, **kw).compute(), want, rtol=1e-12, atol=1e-13)


def test_needs_dask_arrays_and_has_no_backward():
    q = np.zeros((1, 2, 8, 4))
    with pytest.raises(ValueError, match="not Dask arrays"):
        sdpa(q, q, q, implementation="distributed")
    qd = da.from_array(q, chunks=(1, 2, 4, 4))
    with pytest.raises(ValueError, match="no backward pass"):
        polyattn.attention_vjp(qd, qd, qd, implementation="distributed")
    out, pullback = polyattn.attention_vjp(qd, qd, qd)   # auto: the blocked path's backward
    assert all(g.shape == q.shape for g in pullback(da.ones_like(out)))


def test_unknown_chunk_sizes_are_named():
    q = da.zeros((1, 1, 8, 4), chunks=(1, 1, 4, 4))
    unknown = q[:, :, q[0, 0, :, 0] == 0]          # (1, 1, nan, 4)
    why = distributed.unavailable(unknown, q, q, None, Rules(8, 8))
    assert why is not None and "unknown size" in why
    for implementation in ("auto", "chunked", "distributed"):
        with pytest.raises(ValueError, match=r"`query` has a shape that is not known.*"
                                             r"compute_chunk_sizes"):
            sdpa(unknown, q, q, implementation=implementation)
    with pytest.raises(ValueError, match="`key` has a shape that is not known"):
        polyattn.explain(q, unknown, q)


def test_computed_key_lengths_are_not_computed_early():
    """Key lengths that the graph computes stay lazy; every key chunk keeps its tile."""
    def boom(x):
        if x.size:
            raise AssertionError("key lengths were computed while the graph was built")
        return x

    q = da.zeros((2, 2, 64, 4), chunks=(1, 2, 16, 4))
    lengths = da.from_array(np.array([10, 40])).map_blocks(boom, dtype=int,
                                                          meta=np.empty((0,), int))
    out = sdpa(q, q, q, key_lengths=lengths, is_causal=True)
    assert out.shape == q.shape
    assert "20 tile tasks" in polyattn.explain(q, q, q, key_lengths=lengths,
                                               is_causal=True).plan   # 2 x causal 10


@pytest.mark.parametrize("chunks", [1, 2])
def test_key_lengths_from_numpy_are_at_hand(chunks):
    from polyattn._interop import concrete_values

    lengths = da.from_array(np.array([10, 40]), chunks=chunks)
    np.testing.assert_array_equal(concrete_values(lengths), [10, 40])
    assert concrete_values(lengths + 1) is None           # a task: not at hand
    q = da.zeros((2, 2, 64, 4), chunks=(1, 2, 16, 4))
    # row 0 sees keys < 10 (key chunk 0), row 1 keys < 40 (chunks 0-2)
    assert "16 tile tasks" in polyattn.explain(q, q, q, key_lengths=lengths).plan
    with pytest.raises(ValueError, match="`key_lengths` must lie in"):
        sdpa(q, q, q, key_lengths=da.from_array(np.array([10, 65]), chunks=chunks))


def test_window_with_positions_from_key_lengths_keeps_the_band():
    q = da.zeros((1, 1, 4096, 4), chunks=(1, 1, 512, 4))
    kw = {"is_causal": True, "window": (100, 0), "causal_alignment": "bottom_right"}
    assert "15 tile tasks" in polyattn.explain(q, q, q, **kw).plan
    assert "15 tile tasks" in polyattn.explain(q, q, q, key_lengths=4096, **kw).plan
    # decoding: one query at position 8999 sees keys 7999..8999, two chunks of 1024
    q1 = da.zeros((1, 1, 1, 4), chunks=(1, 1, 1, 4))
    k = da.zeros((1, 1, 16384, 4), chunks=(1, 1, 1024, 4))
    e = polyattn.explain(q1, k, k, key_lengths=9000, is_causal=True,
                         causal_alignment="bottom_right", window=(1000, 0))
    assert "2 tile tasks" in e.plan


# --- schedulers ----------------------------------------------------------------------------

@pytest.mark.parametrize("scheduler", ["sync", "threads", "processes"])
def test_any_scheduler(scheduler):
    rng = np.random.default_rng(12)
    q, k, v = _inputs(rng, b=2, tq=20, tk=20)
    ref, _, _ = ref_attention(q, k, v, enable_gqa=True, is_causal=True)
    out = sdpa(_dask(q, 8), _dask(k, 8), _dask(v, 8), enable_gqa=True, is_causal=True)
    assert_close(out.compute(scheduler=scheduler), ref, "float64")


def test_multi_head_attention_on_dask():
    rng = np.random.default_rng(13)
    d, h, t = 16, 4, 24
    x = rng.standard_normal((2, t, d))
    mha = polyattn.MultiHeadAttention(d, h, num_kv_heads=2, dtype=np.float64, seed=1)
    want = mha(x, is_causal=True)
    params = {name: da.from_array(w) for name, w in mha.params.items()}
    xd = da.from_array(x, chunks=(1, 8, d))
    got = polyattn.multi_head_attention(xd, xd, xd, params, num_heads=h, num_kv_heads=2,
                                        is_causal=True)
    assert isinstance(got, da.Array)
    np.testing.assert_allclose(got.compute(), want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shift", [False, True])
def test_tiles_of_other_libraries_run_the_blocked_path(shift):
    """Blocks that are not NumPy arrays (CuPy on a GPU) go through the Array-API path."""
    xps = pytest.importorskip("array_api_strict")
    rng = np.random.default_rng(14)
    q, k, v = _inputs(rng, b=2, tq=6, tk=20)
    lengths = np.array([[17], [9]]).reshape(2)
    spec = distributed.Spec(scale=0.3, rules=Rules(12, 30, causal=True, offset=4,
                                                   lengths_shift=shift, window=(7, 0),
                                                   softcap=3.0))
    slopes = np.array([[0.5, 0.25, 0.125, 0.0625]])
    got = tasks.tile(*(xps.asarray(x) for x in (q, k, v)), None,
                     xps.asarray(lengths), xps.asarray(slopes), spec, 5, 8)
    want = tasks.tile(q, k, v, None, lengths, slopes, spec, 5, 8)
    assert isinstance(got[0], type(xps.asarray(1.0)))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == xps.asarray(w).dtype
        np.testing.assert_allclose(np.asarray(g), w, rtol=1e-12, atol=1e-12)


def test_module_with_numpy_parameters_names_dask_array():
    mha = polyattn.MultiHeadAttention(8, 2, seed=0)
    with pytest.raises(TypeError, match=r"xp=dask\.array\)"):
        mha(da.zeros((1, 4, 8), chunks=(1, 2, 8)))
