"""Tests of the fused Numba CUDA kernel (``implementations/numba_cuda.py``).

With ``NUMBA_ENABLE_CUDASIM=1`` the kernel runs on Numba's CPU simulator on
NumPy arrays, with small shapes and small tiles so that every case spans
several query blocks and key tiles. Where CuPy and a CUDA GPU are present
(and the simulator is off), the same cases run on CuPy arrays, followed by
larger shapes with the production tile sizes. Every result is compared with a
float64 NumPy reference written here or, for windows, soft-capping, ALiBi and
key lengths, with polyattn's reference implementation on the problem that
``polyattn._problem.prepare`` builds (what the public API hands the kernel).
Decoding runs both launches, one thread per query row and key lanes with
split keys, on the same inputs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os

import numpy as np
import pytest

SIMULATOR = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") == "1"


def _gpu_reason() -> str | None:
    """None when CuPy and a CUDA GPU are usable, else why not."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    try:
        import cupy

        if not cupy.cuda.is_available():
            return "no CUDA GPU"
    except Exception as exc:  # CUDA driver errors come in many types
        return f"CUDA is not usable ({exc})"
    return None


if importlib.util.find_spec("numba_cuda") is None:
    pytest.skip("numba-cuda is not installed", allow_module_level=True)
if not SIMULATOR and _gpu_reason() is not None:
    pytest.skip(
        f"needs NUMBA_ENABLE_CUDASIM=1 or a CUDA GPU with CuPy ({_gpu_reason()})",
        allow_module_level=True,
    )

import polyattn  # noqa: E402
from polyattn._problem import prepare  # noqa: E402
from polyattn.backends.array_api import reference as reference_implementation  # noqa: E402
from polyattn.backends.cuda import facade as numba_cuda  # noqa: E402
from polyattn.backends.cuda import launch as cuda_launch  # noqa: E402
from polyattn.backends.cuda import philox  # noqa: E402
from polyattn.backends.cuda import rows as cuda_rows  # noqa: E402
from polyattn.rules import dropout as _dropout  # noqa: E402
from polyattn.rules import element  # noqa: E402
from polyattn.rules.lowering import kernel_parameters  # noqa: E402
from polyattn.rules.visibility import Rules  # noqa: E402


def causal(offset, q, k):
    """The rules of a call where key ``j`` is visible to query ``i`` iff ``j <= i + offset``
    (every key where ``offset`` is None)."""
    return Rules.from_causal_offset(offset, q.shape[-2], k.shape[-2])


# Small tiles: small shapes then cover several query blocks and key tiles.
SMALL_TILES = {"block_q": 8, "block_k": 4}
TOL = {"float32": 1e-5, "float64": 1e-12}


@pytest.fixture(autouse=True, scope="module")
def simulator_threads(cuda_simulator):
    """The conftest's ``cuda_simulator`` (short thread switches, race-free shared
    arrays), named here for the kernel test modules that import it."""
    yield


# --------------------------------------------------------------------------- #
# Float64 NumPy reference
# --------------------------------------------------------------------------- #

def reference(q, k, v, mask, causal_offset, scale):
    """(out, lse) in float64 from the materialised score matrix."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    group = q.shape[-3] // k.shape[-3]
    k = np.repeat(k, group, axis=-3)  # (B…, H, Tk, E)
    v = np.repeat(v, group, axis=-3)  # (B…, H, Tk, Ev)
    s = scale * (q @ np.swapaxes(k, -1, -2))  # (B…, H, Tq, Tk)
    if mask is not None:
        mask = np.asarray(mask)
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask.astype(np.float64)
    if causal_offset is not None:
        tq, tk = s.shape[-2:]
        visible = np.arange(tk)[None, :] <= np.arange(tq)[:, None] + causal_offset
        s = np.where(visible, s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l = np.sum(p, axis=-1, keepdims=True)
    seen = l > 0
    out = np.where(seen, (p @ v) / np.where(seen, l, 1.0), 0.0)
    lse = np.where(seen, np.log(np.where(seen, l, 1.0)) + m, -np.inf)[..., 0]
    return out, lse


def rel_error(x, ref):
    """‖x − ref‖ / ‖ref‖ (the absolute error when ref is 0)."""
    x = np.asarray(x, dtype=np.float64)
    den = np.linalg.norm(ref)
    num = np.linalg.norm(x - ref)
    return num / den if den > 0 else num


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == ref_out.shape and lse.shape == ref_lse.shape
    assert str(out.dtype) == dtype and str(lse.dtype) == dtype
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert rel_error(out, ref_out) <= TOL[dtype]
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isneginf(lse), ~finite)
    assert rel_error(lse[finite], ref_lse[finite]) <= TOL[dtype]


# --------------------------------------------------------------------------- #
# Arrays: NumPy on the simulator, CuPy on a GPU
# --------------------------------------------------------------------------- #

def namespace():
    if SIMULATOR:
        return np
    import array_api_compat.cupy as cp_compat

    return cp_compat


def to_library(a):
    if SIMULATOR:
        return a
    import cupy

    return cupy.asarray(a)


def to_numpy(a):
    if SIMULATOR:
        return np.asarray(a)
    import cupy

    return cupy.asnumpy(a)


def run(q, k, v, *, mask=None, causal_offset=None, scale=None, dtype="float64",
        tiles=None, convert=to_library):
    """Kernel result and float64 reference for float64 NumPy inputs cast to ``dtype``."""
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    if mask is not None and mask.dtype != bool:
        mask = mask.astype(dtype)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    ref = reference(q, k, v, mask, causal_offset, scale)
    out, lse = numba_cuda.attention(
        convert(q), convert(k), convert(v),
        mask=None if mask is None else convert(mask),
        rules=causal(causal_offset, q, k), scale=scale, xp=namespace(),
        **(SMALL_TILES if tiles is None else tiles),
    )
    return (out, lse), ref


# --------------------------------------------------------------------------- #
# Cases
# --------------------------------------------------------------------------- #

def make_inputs(rng, batch, h, hkv, tq, tk, e, ev):
    q = rng.standard_normal((*batch, h, tq, e))
    k = rng.standard_normal((*batch, hkv, tk, e))
    v = rng.standard_normal((*batch, hkv, tk, ev))
    return q, k, v


def make_mask(rng, kind, shape):
    """A bool (about 70 % True) or float mask (normal, some -inf) of ``shape``."""
    keep = rng.random(shape) < 0.7
    if kind == "bool":
        return keep
    return np.where(keep, rng.standard_normal(shape), -np.inf)


# (batch, H, Hkv, Tq, Tk, E, Ev)
SHAPES = {
    "plain": ((2,), 2, 2, 9, 13, 4, 4),
    "tq_gt_tk": ((1,), 2, 2, 17, 6, 4, 4),
    "ev_ne_e": ((1,), 1, 1, 7, 11, 3, 7),
    "head_1": ((1,), 1, 1, 6, 10, 1, 1),
    "head_80": ((1,), 1, 1, 3, 5, 80, 72),
    "head_256": ((), 1, 1, 2, 3, 256, 200),
    "rank_3": ((), 3, 3, 5, 9, 4, 4),
    "two_batch_dims": ((2, 3), 2, 1, 5, 7, 4, 4),
    "gqa": ((1,), 4, 2, 6, 9, 4, 4),
    "mqa": ((2,), 3, 1, 5, 8, 4, 4),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes(name, dtype):
    rng = np.random.default_rng(len(name))
    got, ref = run(*make_inputs(rng, *SHAPES[name]), dtype=dtype)
    assert_matches(*got, *ref, dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("scale", [0.0, 0.37, 2.5])
def test_scale(scale, dtype):
    rng = np.random.default_rng(1)
    got, ref = run(*make_inputs(rng, (1,), 2, 2, 6, 9, 4, 4), scale=scale, dtype=dtype)
    assert_matches(*got, *ref, dtype)


# Mask shapes in terms of (B, H, Tq, Tk); 1 where the mask broadcasts.
B, H, TQ, TK = 2, 3, 9, 11
MASK_SHAPES = {
    "full": (B, H, TQ, TK),
    "padding": (B, 1, 1, TK),
    "square": (1, 1, TQ, TK),
    "per_head": (1, H, 1, 1),
    "per_query": (B, 1, TQ, 1),
}


@pytest.mark.parametrize("mask_batch", [(1, 3), (2, 1), (1, 1), (2, 3)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_broadcast_over_batch_dims(mask_batch, kind):
    rng = np.random.default_rng(3)
    q, k, v = make_inputs(rng, (2, 3), 2, 2, 5, 6, 4, 4)
    mask = make_mask(rng, kind, (*mask_batch, 1, 5, 6))
    got, ref = run(q, k, v, mask=mask, dtype="float64")
    assert_matches(*got, *ref, "float64")


# (Tq, Tk, causal_offset): top-left, bottom-right, negative, past the end, none visible
CAUSAL = {
    "top_left": (13, 13, 0),
    "bottom_right": (5, 18, 13),
    "bottom_right_tq_gt_tk": (12, 5, -7),
    "negative": (10, 12, -3),
    "beyond_tk": (6, 9, 50),
    "nothing_visible": (6, 9, -6),
    "tile_skipping": (6, 20, 0),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(CAUSAL))
def test_causal(name, dtype):
    tq, tk, offset = CAUSAL[name]
    rng = np.random.default_rng(4)
    got, ref = run(*make_inputs(rng, (1,), 2, 1, tq, tk, 4, 3), causal_offset=offset,
                   dtype=dtype)
    assert_matches(*got, *ref, dtype)


def test_key_tiles_beyond_the_causal_window_are_skipped():
    # NaN keys and values in tiles that no query may see: any tile that were
    # loaded and computed (rather than skipped) would turn the output into NaN.
    tq, tk, offset, block_k = 6, 20, 1, SMALL_TILES["block_k"]
    rng = np.random.default_rng(6)
    q, k, v = make_inputs(rng, (1,), 2, 2, tq, tk, 4, 4)
    first_hidden_tile = -(-(tq + offset) // block_k) * block_k
    assert first_hidden_tile < tk
    _, ref = run(q, k, v, causal_offset=offset)
    k[..., first_hidden_tile:, :] = np.nan
    v[..., first_hidden_tile:, :] = np.nan
    (out, lse), _ = run(q, k, v, causal_offset=offset)
    assert_matches(out, lse, *ref, "float64")


def test_no_keys():
    rng = np.random.default_rng(8)
    (out, lse), ref = run(*make_inputs(rng, (1,), 2, 2, 5, 0, 4, 3))
    assert_matches(out, lse, *ref, "float64")
    assert np.all(to_numpy(out) == 0) and np.all(np.isneginf(to_numpy(lse)))


def test_no_queries():
    rng = np.random.default_rng(9)
    (out, lse), _ = run(*make_inputs(rng, (1,), 2, 2, 0, 5, 4, 3))
    assert to_numpy(out).shape == (1, 2, 0, 3) and to_numpy(lse).shape == (1, 2, 0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_non_contiguous_inputs(dtype):
    rng = np.random.default_rng(10)
    # q as (B, Tq, H, E) seen as (B, H, Tq, E); k every other key; v in Fortran order;
    # a mask with a transposed layout.
    q = np.swapaxes(rng.standard_normal((2, 7, 3, 4)), 1, 2)
    k = rng.standard_normal((2, 3, 18, 4))[:, :, ::2, :]
    v = np.asfortranarray(rng.standard_normal((2, 3, 9, 5)))
    mask = np.swapaxes(rng.random((2, 3, 9, 7)) < 0.7, -1, -2)

    def convert(a):
        if SIMULATOR:
            return a
        import cupy

        # Same strides on the device: build the base array, then the same view.
        if a is q:
            return cupy.swapaxes(cupy.asarray(np.ascontiguousarray(np.swapaxes(a, 1, 2))), 1, 2)
        if a is k:
            base = np.repeat(a, 2, axis=2)
            return cupy.asarray(base)[:, :, ::2, :]
        if a is mask:
            return cupy.swapaxes(cupy.asarray(np.ascontiguousarray(np.swapaxes(a, -1, -2))),
                                 -1, -2)
        return cupy.asfortranarray(cupy.asarray(a))

    q, k, v = (a.astype(dtype) for a in (q, k, v))
    ref = reference(q, k, v, mask, 2, 0.5)
    out, lse = numba_cuda.attention(convert(q), convert(k), convert(v), mask=convert(mask),
                                    rules=causal(2, q, k), scale=0.5, xp=namespace(),
                                    **SMALL_TILES)
    assert_matches(out, lse, *ref, dtype)


def test_inputs_are_not_modified():
    rng = np.random.default_rng(11)
    q, k, v = make_inputs(rng, (1,), 2, 2, 5, 6, 4, 4)
    mask = make_mask(rng, "float", (1, 2, 5, 6))
    copies = [a.copy() for a in (q, k, v, mask)]
    if SIMULATOR:
        for a in (q, k, v, mask):
            a.flags.writeable = False
    numba_cuda.attention(to_library(q), to_library(k), to_library(v), mask=to_library(mask),
                         rules=causal(None, q, k), scale=0.5, xp=namespace(), **SMALL_TILES)
    for a, c in zip((q, k, v, mask), copies, strict=True):
        np.testing.assert_array_equal(a, c)


# --------------------------------------------------------------------------- #
# Errors, limits and bookkeeping
# --------------------------------------------------------------------------- #

def test_head_size_above_limit_names_sizes_and_chunked():
    rng = np.random.default_rng(12)
    q, k, v = make_inputs(rng, (1,), 1, 1, 2, 2, 257, 4)
    with pytest.raises(ValueError, match=r"257.*chunked"):
        numba_cuda.attention(to_library(q), to_library(k), to_library(v), mask=None,
                             rules=causal(None, q, k), scale=1.0, xp=namespace())


def test_unsupported_dtypes():
    rng = np.random.default_rng(13)
    q, k, v = make_inputs(rng, (1,), 1, 1, 2, 2, 4, 4)
    with pytest.raises(TypeError, match="float16"):
        numba_cuda.attention(*(to_library(a.astype(np.float16)) for a in (q, k, v)),
                             mask=None, rules=causal(None, q, k), scale=1.0, xp=namespace())
    with pytest.raises(TypeError, match="mask"):
        numba_cuda.attention(*(to_library(a) for a in (q, k, v)),
                             mask=to_library(np.zeros((1, 1, 2, 2), np.float32)),
                             rules=causal(None, q, k), scale=1.0, xp=namespace())


def test_head_buckets():
    assert numba_cuda.head_bucket(1, 1) == numba_cuda.HEAD_DIM_BUCKETS[0]
    assert numba_cuda.head_bucket(64, 64) == 64
    assert numba_cuda.head_bucket(65, 3) == 128
    assert numba_cuda.head_bucket(3, 256) == numba_cuda.MAX_HEAD_DIM == 256


def test_specializations_cover_every_combination():
    specs = list(cuda_rows.specializations())
    attention_kernels = (len(numba_cuda.DTYPES) * len(numba_cuda.HEAD_DIM_BUCKETS)
                         * len(numba_cuda.MASK_KINDS) * 2)  # plain and with score modifiers
    expected = attention_kernels + len(numba_cuda.DTYPES)  # and one split merge per dtype
    assert len(specs) == expected
    assert len({fn.__name__ for fn, _ in specs}) == expected
    assert sum("_mods" in fn.__name__ for fn, _ in specs) == attention_kernels // 2


def test_availability_reports_a_reason():
    usable, reason = numba_cuda.availability(namespace(), (to_library(np.zeros((1, 1, 1))),))
    assert usable and reason


# --------------------------------------------------------------------------- #
# Rules: windows, soft-capping, ALiBi, key lengths, positions (docs/semantics.rst)
# --------------------------------------------------------------------------- #

def prepared(q, k, v, dtype, *, mask=None, is_causal=False, alignment="top_left",
             window=None, softcap=None, alibi_slopes=None, key_lengths=None, dropout=None):
    """The Problem that the public API hands to implementations, for inputs cast to
    ``dtype`` (float64: the values the float32 run sees, rounded, then widened);
    ``dropout``: ``(p, seed)`` or None."""
    def cast(a):
        return None if a is None else a.astype(dtype)

    if mask is not None and mask.dtype != bool:
        mask = cast(mask)
    return prepare(cast(q), cast(k), cast(v), attn_mask=mask, is_causal=is_causal,
                   causal_alignment=alignment, scale=None, enable_gqa=True, window=window,
                   softcap=softcap, alibi_slopes=cast(alibi_slopes), key_lengths=key_lengths,
                   **({} if dropout is None else dict(zip(("dropout_p", "dropout_seed"),
                                                          dropout, strict=True))))


def run_rules(q, k, v, *, dtype="float64", tiles=None, dropout=None, **options):
    """Kernel (out, lse) on the prepared problem, and polyattn's reference on the float64
    problem built from the same (rounded) values; ``dropout``: ``(p, seed)`` or None."""
    rounded = [None if a is None else a.astype(dtype).astype(np.float64)
               for a in (q, k, v, options.get("alibi_slopes"))]
    ref_options = dict(options, alibi_slopes=rounded[3])
    mask = options.get("mask")
    if mask is not None and mask.dtype != bool:
        ref_options["mask"] = mask.astype(dtype).astype(np.float64)
    ref = prepared(*rounded[:3], "float64", dropout=dropout, **ref_options)
    ref_out, ref_lse = reference_implementation.attention(
        ref.q, ref.k, ref.v, mask=ref.mask, rules=ref.rules, scale=ref.scale, xp=ref.xp)
    got = prepared(q, k, v, dtype, dropout=dropout, **options)
    out, lse = numba_cuda.attention(
        convert_problem(got.q), convert_problem(got.k), convert_problem(got.v),
        mask=None if got.mask is None else convert_problem(got.mask),
        rules=rules_on_device(got.rules), scale=got.scale, xp=namespace(),
        **(SMALL_TILES if tiles is None else tiles))
    return (out, lse), (np.asarray(ref_out), np.asarray(ref_lse))


def convert_problem(a):
    return to_library(np.asarray(a))


def rules_on_device(rules):
    """The prepared rules with their arrays in the kernel's array library."""
    arrays = {name: getattr(rules, name) for name in ("key_lengths", "alibi")}
    moved = {n: None if a is None else convert_problem(a) for n, a in arrays.items()}
    return dataclasses.replace(rules, **moved)


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("decode", [False, True], ids=["rows", "decode"])
def test_every_rule_with_a_mask_gqa_and_broadcast_batch(kind, decode):
    rng = np.random.default_rng(21)
    tq, tk = (3, 17) if decode else (10, 17)
    q, k, v = make_inputs(rng, (2, 2), 4, 2, tq, tk, 5, 3)
    mask = make_mask(rng, kind, (2, 1, 1, tq, tk))
    options = dict(window=(6, None), softcap=2.0, alibi_slopes=rng.uniform(0.1, 1, (2, 1, 4)),
                   key_lengths=np.array([[17, 9], [0, 12]]), is_causal=True,
                   alignment="bottom_right", mask=mask)
    tiles = dict(SMALL_TILES, decode=decode, num_splits=3 if decode else 1)
    got, ref = run_rules(q, k, v, dtype="float64", tiles=tiles, **options)
    assert_matches(*got, *ref, "float64")


@pytest.mark.parametrize("window", [(0, 0), (2, None), (None, 3), (40, 40)],
                         ids=["diagonal", "left", "right", "wider_than_keys"])
def test_window_sides(window):
    rng = np.random.default_rng(22)
    q, k, v = make_inputs(rng, (1,), 2, 2, 11, 11, 4, 4)
    got, ref = run_rules(q, k, v, window=window)
    assert_matches(*got, *ref, "float64")


@pytest.mark.parametrize("shape", [(), (1,), (2,)], ids=["scalar", "one", "per_row"])
def test_key_lengths_broadcast_and_integer_dtypes(shape):
    rng = np.random.default_rng(23)
    q, k, v = make_inputs(rng, (2,), 2, 1, 4, 10, 4, 4)
    lengths = np.array([7, 3][:shape[0]] if shape else 6, dtype=np.int32).reshape(shape)
    got, ref = run_rules(q, k, v, key_lengths=lengths, is_causal=True, alignment="bottom_right")
    assert_matches(*got, *ref, "float64")


@pytest.mark.parametrize("slopes_shape", [(1, 3), (2, 1), (1, 1)])
def test_alibi_slopes_broadcast(slopes_shape):
    rng = np.random.default_rng(24)
    q, k, v = make_inputs(rng, (2,), 3, 3, 5, 8, 4, 4)
    slopes = rng.uniform(0.2, 1.0, slopes_shape)
    got, ref = run_rules(q, k, v, alibi_slopes=slopes, is_causal=True)
    assert_matches(*got, *ref, "float64")


def test_causal_rules_with_an_offset_match_the_reference():
    rng = np.random.default_rng(25)
    q, k, v = make_inputs(rng, (1,), 2, 2, 7, 12, 4, 4)
    rules = Rules(tq=7, tk=12, causal=True, offset=5)
    ruled = numba_cuda.attention(*(to_library(a) for a in (q, k, v)), mask=None,
                                 rules=rules, scale=0.5, xp=namespace(), **SMALL_TILES)
    assert_matches(*ruled, *reference(q, k, v, None, 5, 0.5), "float64")


def test_keys_outside_the_visible_area_are_never_read():
    # NaN keys and values past each row's key length and left of the window: a
    # kernel that loaded and multiplied them (even by a zero weight) would give NaN.
    rng = np.random.default_rng(26)
    q, k, v = make_inputs(rng, (2,), 2, 2, 2, 30, 4, 4)
    lengths = np.array([30, 19])
    options = dict(window=(4, 0), is_causal=True, alignment="bottom_right",
                   key_lengths=lengths)
    _, ref = run_rules(q, k, v, **options)
    for b, n in enumerate(lengths):
        k[b, :, : n - 6] = v[b, :, : n - 6] = np.nan
        k[b, :, n:] = v[b, :, n:] = np.nan
    for tiles in (SMALL_TILES, dict(SMALL_TILES, decode=True, num_splits=3),
                  dict(SMALL_TILES, decode=False)):
        (out, lse), _ = run_rules(q, k, v, tiles=tiles, **options)
        assert_matches(out, lse, *ref, "float64")


# --------------------------------------------------------------------------- #
# Decoding: key lanes and split keys (flash-decoding)
# --------------------------------------------------------------------------- #

def test_launch_plan_follows_the_shape():
    bq, bk = cuda_rows.BLOCK_Q, cuda_rows.MAX_BLOCK_K
    plan = numba_cuda.launch_plan
    long_keys = cuda_launch.SPLIT_MIN_KEYS * cuda_launch.MAX_SPLITS
    rows, lanes, splits = plan(1, long_keys, 4, bq, bk)
    assert rows == 1 and lanes == min(bq, bk) and splits > 1  # one step over a long cache
    rows, lanes, splits = plan(5, long_keys, 4, bq, bk)
    assert rows == 8 and rows * lanes == bq and splits > 1    # a few speculative tokens
    assert plan(1, long_keys, 4, bq, 4)[1] == 4                # no more lanes than tile keys
    assert plan(1, cuda_launch.SPLIT_MIN_KEYS - 1, 4, bq, bk)[2] == 1
    assert plan(bq * 8, bq * 8, 4096, bq, bk) == (bq, 1, 1)   # prefill
    blocks = cuda_launch.TARGET_BLOCKS
    assert plan(1, long_keys * 4, blocks, bq, bk)[2] == 1      # the grid is already full
    assert plan(1, long_keys * 4, 1, bq, bk)[2] == cuda_launch.MAX_SPLITS
    assert plan(3, 100, 4, 8, 4, decode=False, num_splits=5) == (8, 1, 5)


# (Tq, Tk, key lengths): one step, a few tokens, Tq > lanes' rows; splits beyond tiles
DECODE = {"step": (1, 37, [37, 20]), "tokens": (3, 29, [29, 0]), "eight": (8, 21, [5, 21])}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("splits", [1, 4, 16])
@pytest.mark.parametrize("name", list(DECODE))
def test_split_keys_match_the_reference_and_the_plain_launch(name, splits, dtype):
    tq, tk, lengths = DECODE[name]
    rng = np.random.default_rng(27)
    q, k, v = make_inputs(rng, (2,), 4, 2, tq, tk, 4, 5)
    mask = make_mask(rng, "bool", (2, 4, tq, tk))
    mask[1, 2] = False  # a fully masked head
    options = dict(is_causal=True, alignment="bottom_right", key_lengths=np.array(lengths),
                   softcap=3.0, alibi_slopes=rng.uniform(0.0, 0.3, (4,)), mask=mask)
    split, ref = run_rules(q, k, v, dtype=dtype, tiles=dict(SMALL_TILES, decode=True,
                                                           num_splits=splits), **options)
    plain, _ = run_rules(q, k, v, dtype=dtype, tiles=dict(SMALL_TILES, decode=False,
                                                         num_splits=1), **options)
    assert_matches(*split, *ref, dtype)
    assert_matches(*plain, *ref, dtype)
    out, lse = to_numpy(split[0]), to_numpy(split[1])
    assert rel_error(out, to_numpy(plain[0])) <= TOL[dtype]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(to_numpy(plain[1])))
    assert np.all(out[1, 2] == 0) and np.all(np.isneginf(lse[1, 2]))
    if 0 in lengths:
        b = lengths.index(0)
        assert np.all(out[b] == 0) and np.all(np.isneginf(lse[b]))


@pytest.mark.parametrize("splits", [2, 5])
def test_split_keys_without_rules(splits):
    rng = np.random.default_rng(28)
    q, k, v = make_inputs(rng, (2,), 2, 1, 2, 31, 4, 4)
    for offset in (None, 29, -2):  # none, bottom-right, nothing visible
        got, ref = run(q, k, v, causal_offset=offset,
                       tiles=dict(SMALL_TILES, decode=True, num_splits=splits))
        assert_matches(*got, *ref, "float64")


def test_split_keys_chosen_by_shape(monkeypatch):
    # Long keys, one query: the plan splits the keys without being asked.
    monkeypatch.setattr(cuda_launch, "SPLIT_MIN_KEYS", 8)
    _, lanes, splits = numba_cuda.launch_plan(1, 40, 2, *SMALL_TILES.values())
    assert lanes > 1 and splits > 1
    rng = np.random.default_rng(29)
    got, ref = run(*make_inputs(rng, (1,), 2, 2, 1, 40, 4, 4), causal_offset=39)
    assert_matches(*got, *ref, "float64")


def test_lanes_merge_in_several_passes():
    # Two-key tiles hold four lane states at once; 8 rows × 2 lanes hand over
    # 8 states, in two passes.
    rng = np.random.default_rng(30)
    q, k, v = make_inputs(rng, (1,), 1, 1, 7, 23, 4, 4)
    tiles = {"block_q": 16, "block_k": 2, "decode": True, "num_splits": 2}
    assert numba_cuda.launch_plan(7, 23, 1, 16, 2, decode=True)[:2] == (8, 2)
    got, ref = run(q, k, v, causal_offset=16, tiles=tiles)
    assert_matches(*got, *ref, "float64")


# --------------------------------------------------------------------------- #
# Dropout: Philox4x32-10 in the kernel, the reference's keep-mask bit for bit
# --------------------------------------------------------------------------- #

@pytest.mark.skipif(not SIMULATOR, reason="the device function runs as Python on the simulator")
@pytest.mark.parametrize("seed", [0, 7, 2**32 + 5, 2**64 - 1])
def test_philox_word_is_the_reference_cipher(seed):
    rng = np.random.default_rng(40)
    n = np.concatenate([np.arange(4), rng.integers(0, 2**62, 60), [2**32 - 1, 2**32, 2**63 - 1]])
    key0, key1 = _dropout.key_words(seed)
    keep_word = philox.philox_function()
    got = [int(keep_word(int(x), (np.uint64(key0), np.uint64(key1)))) for x in n]
    zero = np.zeros_like(n)
    expected = _dropout.philox_numpy(n & _dropout.MASK32, n >> 32, zero, zero, seed)[0]
    np.testing.assert_array_equal(np.array(got, dtype=np.uint64), expected)


def test_dropout_parameters():
    no_dropout = kernel_parameters(Rules(2, 3), "float64")[element.DROPOUT]  # p = 0: none
    assert int(no_dropout[1]) == 0 and not element.drops(kernel_parameters(Rules(2, 3),
                                                                            "float64"))
    rules = kernel_parameters(Rules(2, 3, dropout_p=0.25, dropout_seed=2**32 * 3 + 9),
                              "float32")
    scale, threshold, key0, key1 = rules[element.DROPOUT]
    assert scale.dtype == np.float32 and scale == np.float32(1 / 0.75)
    assert threshold.dtype == np.uint64 and int(threshold) == 2**30
    assert (int(key0), int(key1)) == (9, 3)
    assert element.drops(rules) and element.kept_scale(rules) == scale
    assert tuple(map(int, element.dropout_key(rules))) == (9, 3)
    assert element.kept(np.uint64(2**30), rules) and not element.kept(np.uint64(2**30 - 1),
                                                                         rules)


# The three launches: one thread per row, key lanes, key lanes with split keys.
LAUNCHES = {"rows": dict(decode=False, num_splits=1), "lanes": dict(decode=True, num_splits=1),
            "split": dict(decode=True, num_splits=3)}


def dropout_rules(p, seed, tq, tk, **fields):
    return Rules(tq, tk, dropout_p=p, dropout_seed=seed, **fields)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_dropout_keeps_exactly_the_reference_weights(launch, dtype):
    # With v the identity, out[…, i, j] is weight (i, j) times its dropout factor:
    # zero exactly where the weight is dropped (every weight is positive here).
    rng = np.random.default_rng(41)
    batch, h, hkv, tq, tk = (2,), 4, 2, 2, 12
    lanes = numba_cuda.launch_plan(tq, tk, 8, *SMALL_TILES.values(), **LAUNCHES[launch])[1]
    assert lanes == (1 if launch == "rows" else SMALL_TILES["block_k"])
    q, k, _ = make_inputs(rng, batch, h, hkv, tq, tk, 4, 1)
    v = np.broadcast_to(np.eye(tk), (*batch, hkv, tk, tk))
    p, seed = 0.3, 2**40 + 11
    rules = dropout_rules(p, seed, tq, tk)
    q, k, v = (a.astype(dtype) for a in (q, k, v))
    out, lse = numba_cuda.attention(to_library(q), to_library(k), to_library(v), mask=None,
                                    rules=rules, scale=0.5, xp=namespace(),
                                    **SMALL_TILES, **LAUNCHES[launch])
    out = to_numpy(out)
    row = np.arange(2 * h * tq).reshape(*batch, h, tq, 1)  # flat (b, h, i)
    expected = _dropout.keep(row, np.arange(tk), tk, seed, p, np)
    assert 0 < expected.mean() < 1
    np.testing.assert_array_equal(out != 0, expected)
    ref_out, ref_lse = reference_implementation.attention(
        q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask=None,
        rules=rules, scale=0.5, xp=np)
    assert_matches(out, lse, np.asarray(ref_out), np.asarray(ref_lse), dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_dropout_with_every_rule_matches_the_reference(launch, dtype):
    rng = np.random.default_rng(42)
    tq, tk = 4, 23
    q, k, v = make_inputs(rng, (2,), 4, 2, tq, tk, 4, 3)
    mask = make_mask(rng, "float", (2, 1, tq, tk))
    options = dict(is_causal=True, alignment="bottom_right", window=(12, None), softcap=2.0,
                   alibi_slopes=rng.uniform(0.0, 0.3, (4,)), key_lengths=np.array([23, 15]),
                   mask=mask, dropout=(0.4, 99))
    got, ref = run_rules(q, k, v, dtype=dtype, tiles=dict(SMALL_TILES, **LAUNCHES[launch]),
                         **options)
    assert_matches(*got, *ref, dtype)
    _, no_dropout = run_rules(q, k, v, dtype=dtype, **dict(options, dropout=None))
    assert rel_error(to_numpy(got[0]), no_dropout[0]) > 0.1  # weights were dropped
    np.testing.assert_allclose(to_numpy(got[1]), no_dropout[1], rtol=TOL[dtype])  # lse: before


def test_dropout_that_keeps_nothing():
    # p within 2⁻³² of 1: threshold 2³², above every word; lse is unchanged.
    rng = np.random.default_rng(43)
    q, k, v = make_inputs(rng, (1,), 2, 2, 6, 9, 4, 4)
    p = 1 - 2.0**-40
    assert _dropout.threshold(p) == 2**32
    rules = dropout_rules(p, 5, 6, 9)
    out, lse = numba_cuda.attention(*(to_library(a) for a in (q, k, v)), mask=None,
                                    rules=rules, scale=0.5, xp=namespace(), **SMALL_TILES)
    _, ref_lse = reference(q, k, v, None, None, 0.5)
    assert np.all(to_numpy(out) == 0)
    np.testing.assert_allclose(to_numpy(lse), ref_lse, rtol=1e-14)


# --------------------------------------------------------------------------- #
# The public API on the kernel
# --------------------------------------------------------------------------- #

@pytest.mark.parametrize("layout", ["BHTE", "BTHE"])
def test_public_api_numba_cuda_with_every_keyword(layout, monkeypatch):
    monkeypatch.setattr(cuda_rows, "BLOCK_Q", 8)
    rng = np.random.default_rng(31)
    q, k, v = make_inputs(rng, (2,), 4, 2, 6, 11, 4, 3)
    if layout == "BTHE":
        q, k, v = (np.swapaxes(a, 1, 2) for a in (q, k, v))
    options = dict(is_causal=True, causal_alignment="bottom_right", window=(4, 0),
                   softcap=2.5, alibi_slopes=rng.uniform(0.1, 0.5, (4,)), enable_gqa=True,
                   key_lengths=np.array([11, 7]), return_lse=True, layout=layout)
    ref_out, ref_lse = polyattn.scaled_dot_product_attention(
        q, k, v, implementation="reference", **options)
    out, lse = polyattn.scaled_dot_product_attention(
        *(to_library(a) for a in (q, k, v)), implementation="numba_cuda",
        **dict(options, alibi_slopes=to_library(options["alibi_slopes"]),
               key_lengths=to_library(options["key_lengths"])))
    assert_matches(out, lse, np.asarray(ref_out), np.asarray(ref_lse), "float64")


def test_public_api_numba_cuda_decodes_from_a_kv_cache(monkeypatch):
    monkeypatch.setattr(cuda_rows, "BLOCK_Q", 8)
    monkeypatch.setattr(cuda_launch, "SPLIT_MIN_KEYS", 4)  # split even these few keys
    rng = np.random.default_rng(32)
    # prompts of 5 and 3 tokens (a ragged batch), then one token per step
    prompt_k, prompt_v = rng.standard_normal((2, 2, 2, 5, 4))  # (B, Hkv, T, E) each
    cache = polyattn.KVCache((2,), 2, 12, 4, xp=namespace()).update(
        to_library(prompt_k), to_library(prompt_v), lengths=to_library(np.array([5, 3])))
    for _ in range(3):
        q = rng.standard_normal((2, 4, 1, 4))
        k, v = rng.standard_normal((2, 2, 2, 1, 4))
        cache = cache.update(to_library(k), to_library(v))
        options = dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True,
                       return_lse=True, window=(4, None), alibi_slopes=np.full(4, 0.25))
        out, lse = polyattn.scaled_dot_product_attention(
            to_library(q), cache.keys, cache.values, key_lengths=cache.lengths,
            implementation="numba_cuda",
            **dict(options, alibi_slopes=to_library(options["alibi_slopes"])))
        ref = polyattn.scaled_dot_product_attention(
            q, to_numpy(cache.keys), to_numpy(cache.values),
            key_lengths=to_numpy(cache.lengths), implementation="reference", **options)
        assert_matches(out, lse, *(np.asarray(a) for a in ref), "float64")
    np.testing.assert_array_equal(to_numpy(cache.lengths), [8, 6])


# --------------------------------------------------------------------------- #
# A real GPU: production tiles, larger shapes, torch tensors
# --------------------------------------------------------------------------- #

gpu_only = pytest.mark.skipif(SIMULATOR, reason="larger shapes need a real GPU")

# (batch, H, Hkv, Tq, Tk, E, Ev, mask kind, mask shape, causal offset)
GPU_CASES = {
    "plain": ((2,), 4, 4, 300, 257, 64, 64, None, None, None),
    "causal_top_left": ((2,), 4, 2, 333, 333, 64, 64, None, None, 0),
    "causal_bottom_right": ((1,), 8, 1, 100, 700, 128, 128, None, None, 600),
    "padding_mask": ((3,), 4, 4, 200, 300, 32, 48, "bool", (3, 1, 1, 300), None),
    "float_mask_causal": ((1,), 2, 2, 150, 150, 80, 80, "float", (1, 1, 150, 150), 0),
    "head_256": ((1,), 2, 2, 70, 90, 256, 256, None, None, None),
    "head_1": ((1,), 2, 2, 300, 400, 1, 1, None, None, 0),
    "many_heads": ((64,), 32, 8, 65, 65, 16, 16, None, None, None),
    "decode_split": ((4,), 8, 2, 1, 5000, 128, 128, None, None, 4999),
    "decode_tokens": ((2,), 8, 8, 5, 3000, 64, 64, "bool", (2, 1, 5, 3000), 2995),
}


@gpu_only
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_production_tiles(name, dtype):
    batch, h, hkv, tq, tk, e, ev, kind, mshape, offset = GPU_CASES[name]
    rng = np.random.default_rng(14)
    q, k, v = make_inputs(rng, batch, h, hkv, tq, tk, e, ev)
    mask = None if kind is None else make_mask(rng, kind, mshape)
    got, ref = run(q, k, v, mask=mask, causal_offset=offset, dtype=dtype, tiles={})
    assert_matches(*got, *ref, dtype)


@gpu_only
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("tq", [1, 4, 300])
def test_gpu_rules_production_tiles(tq, dtype):
    rng = np.random.default_rng(16)
    q, k, v = make_inputs(rng, (3,), 8, 2, tq, 4000, 64, 64)
    options = dict(is_causal=True, alignment="bottom_right", window=(1500, None),
                   softcap=20.0, alibi_slopes=rng.uniform(0.0, 0.01, (8,)),
                   key_lengths=np.array([4000, 2500, 0]))
    got, ref = run_rules(q, k, v, dtype=dtype, tiles={}, **options)
    assert_matches(*got, *ref, dtype)


@gpu_only
def test_gpu_torch_tensors():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    import array_api_compat.torch as torch_compat

    rng = np.random.default_rng(15)
    q, k, v = make_inputs(rng, (2,), 4, 2, 130, 170, 64, 32)
    mask = make_mask(rng, "bool", (2, 1, 130, 170))
    ref = reference(q, k, v, mask, 40, 0.125)
    tq, tk, tv, tm = (torch.as_tensor(a, device="cuda") for a in (q, k, v, mask))
    tq.requires_grad_(True)
    out, lse = numba_cuda.attention(tq, tk, tv, mask=tm, rules=causal(40, q, k), scale=0.125,
                                    xp=torch_compat)
    assert isinstance(out, torch.Tensor) and out.device == tq.device
    torch.cuda.synchronize()
    assert_matches(out.cpu().numpy(), lse.cpu().numpy(), *ref, "float64")
