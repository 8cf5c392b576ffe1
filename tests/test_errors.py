"""Bad input: every public function raises TypeError or ValueError naming what is wrong.

Each case states the exception and the pieces its message must contain, in
order: the argument's name, and what was received and expected (shapes,
dtypes, values). Cases built from ``xp`` run on every backend, so the checks
work with every library's dtypes and shape objects; the rest use NumPy.

``docs/errors_table.rst`` lists these cases with the library's actual
messages; :func:`test_errors_table_is_current` keeps it in step
(``python tests/test_errors.py`` rewrites it).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import Backend, available_backends

import polyattn

Call = Callable[[Any, Any], object]


@dataclass(frozen=True)
class Case:
    """A call that must fail: ``call(xp, device)`` raises ``error`` whose message has ``pieces``."""

    name: str
    function: str
    call: Call
    error: type[Exception]
    pieces: tuple[str, ...]

    @property
    def pattern(self) -> str:
        return ".*".join(re.escape(p) for p in self.pieces)


def z(xp, device, *shape, dtype="float64"):
    """Zeros of ``shape`` in ``xp``; ``dtype`` by name."""
    return xp.zeros(shape, dtype=getattr(xp, dtype), device=device)


def qkv(xp, device, dtype="float64"):
    """query (2, 3, 4, 5), key (2, 3, 6, 5), value (2, 3, 6, 7)."""
    return z(xp, device, 2, 3, 4, 5, dtype=dtype), z(xp, device, 2, 3, 6, 5, dtype=dtype), \
        z(xp, device, 2, 3, 6, 7, dtype=dtype)


sdpa = polyattn.scaled_dot_product_attention


def _stale_block_mask(xp, dev):
    """A block mask whose mask_mod reads a value changed after it was built."""
    reach = [1]
    bm = polyattn.block_mask(lambda b, h, i, j: i - j <= reach[0], None, None, 4, 6, xp=xp,
                             device=dev)
    reach[0] = 3
    return sdpa(*qkv(xp, dev), block_mask=bm)


def _branchy(score, b, h, q_idx, kv_idx):
    """A score_mod with Python control flow on the score (what ops.where is for)."""
    if score > 0:
        return score
    return 0.0 * score


def _sdpa(**kw) -> Call:
    return lambda xp, dev: sdpa(*qkv(xp, dev), **kw)


def _mha(xp, dev, *, params=None, x=None, key=None, value=None, **kw):
    mha = polyattn.MultiHeadAttention(8, 2, xp=xp, device=dev, dtype=xp.float64, seed=0)
    p = dict(mha.params)
    p.update(params or {})
    x = z(xp, dev, 2, 5, 8) if x is None else x
    kw.setdefault("num_heads", 2)
    return polyattn.multi_head_attention(x, x if key is None else key,
                                         x if value is None else value, p, **kw)


# --------------------------------------------------------------------------- #
# Cases that run on every backend
# --------------------------------------------------------------------------- #

PORTABLE = [
    # scaled_dot_product_attention: dtypes
    Case("integer query", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(z(xp, dev, 2, 3, 4, 5, dtype="int64"), *qkv(xp, dev)[1:]),
         TypeError, ("`query`", "real floating", "int64", "(2, 3, 4, 5)")),
    Case("boolean key", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(qkv(xp, dev)[0], z(xp, dev, 2, 3, 6, 5, dtype="bool"),
                              qkv(xp, dev)[2]),
         TypeError, ("`key`", "real floating", "bool", "(2, 3, 6, 5)")),
    Case("complex value", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev)[:2], z(xp, dev, 2, 3, 6, 7, dtype="complex128")),
         TypeError, ("`value`", "real floating", "complex128", "(2, 3, 6, 7)")),
    Case("integer mask", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), attn_mask=z(xp, dev, 4, 6, dtype="int32")),
         TypeError, ("`attn_mask`", "boolean", "real floating", "int32", "(4, 6)")),
    # shapes
    Case("mask does not broadcast", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), attn_mask=z(xp, dev, 4, 5, dtype="bool")),
         ValueError, ("`attn_mask`", "(4, 5)", "(B…, H, Tq, Tk)", "(2, 3, 4, 6)")),
    Case("mask with too many dimensions", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), attn_mask=z(xp, dev, 2, 2, 3, 4, 6, dtype="bool")),
         ValueError, ("`attn_mask`", "(2, 2, 3, 4, 6)", "(2, 3, 4, 6)")),
    Case("query of rank 1", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(z(xp, dev, 5), *qkv(xp, dev)[1:]),
         ValueError, ("`query`", "at least 2 dimensions", "(…, T, E)", "(5,)")),
    Case("key of rank 1", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(qkv(xp, dev)[0], z(xp, dev, 5), qkv(xp, dev)[2]),
         ValueError, ("`key`", "at least 2 dimensions", "(5,)")),
    Case("rank 2 with enable_gqa", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(z(xp, dev, 4, 5), z(xp, dev, 6, 5), z(xp, dev, 6, 7),
                              enable_gqa=True),
         ValueError, ("`query`", "at least 3 dimensions", "(B…, H, T, E)", "(4, 5)")),
    Case("feature sizes differ", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(qkv(xp, dev)[0], z(xp, dev, 2, 3, 6, 4), qkv(xp, dev)[2]),
         ValueError, ("`key` has 4 features", "`query` has 5", "query (2, 3, 4, 5)",
                      "key (2, 3, 6, 4)")),
    Case("key and value lengths differ", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev)[:2], z(xp, dev, 2, 3, 5, 7)),
         ValueError, ("`value` has 5 positions", "`key` has 6", "key (2, 3, 6, 5)",
                      "value (2, 3, 5, 7)")),
    Case("batch sizes differ", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(qkv(xp, dev)[0], z(xp, dev, 3, 3, 6, 5), z(xp, dev, 3, 3, 6, 7)),
         ValueError, ("do not broadcast", "query (2, 3)", "key (3, 3)", "query (2, 3, 4, 5)",
                      "key (3, 3, 6, 5)")),
    Case("fewer key heads without enable_gqa", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(z(xp, dev, 2, 4, 4, 5), z(xp, dev, 2, 2, 6, 5),
                              z(xp, dev, 2, 2, 6, 7)),
         ValueError, ("do not broadcast", "query (2, 4)", "key (2, 2)", "enable_gqa=True")),
    Case("GQA heads not divisible", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(qkv(xp, dev)[0], z(xp, dev, 2, 2, 6, 5), z(xp, dev, 2, 2, 6, 7),
                              enable_gqa=True),
         ValueError, ("`query` has 3 heads", "2 key/value heads", "query (2, 3, 4, 5)",
                      "key (2, 2, 6, 5)", "H % Hkv == 0")),
    Case("GQA key and value heads differ", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(qkv(xp, dev)[0], z(xp, dev, 2, 1, 6, 5), z(xp, dev, 2, 3, 6, 7),
                              enable_gqa=True),
         ValueError, ("`key` has 1 heads", "`value` has 3", "key (2, 1, 6, 5)",
                      "value (2, 3, 6, 7)")),
    # ALiBi slopes and key lengths
    Case("alibi_slopes of the wrong shape", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), alibi_slopes=z(xp, dev, 4)),
         ValueError, ("`alibi_slopes`", "(B…, H) = (2, 3)", "one slope per query head",
                      "got shape (4,)")),
    Case("integer alibi_slopes", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), alibi_slopes=z(xp, dev, 3, dtype="int32")),
         TypeError, ("`alibi_slopes`", "real floating", "int32", "(3,)")),
    Case("sinks of the wrong shape", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), sinks=z(xp, dev, 4)),
         ValueError, ("`sinks`", "(B…, H) = (2, 3)", "one sink logit per query head",
                      "got shape (4,)")),
    Case("integer sinks", "attention_vjp",
         lambda xp, dev: polyattn.attention_vjp(*qkv(xp, dev), sinks=z(xp, dev, 3,
                                                                     dtype="int32")),
         TypeError, ("`sinks`", "real floating", "int32", "(3,)")),
    Case("float segment_ids", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), segment_ids=z(xp, dev, 2, 5)),
         TypeError, ("`segment_ids`", "integer dtype", "(2, 5)")),
    Case("segment_ids for Tq != Tk", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), segment_ids=z(xp, dev, 2, 4, dtype="int32")),
         ValueError, ("`segment_ids`", "Tq = 4 and Tk = 6", "pass a pair")),
    Case("Python control flow in a score_mod", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), score_mod=_branchy),
         TypeError, ("score_mod _branchy cannot run on tiles of scores", "ops.where")),
    Case("a power of the score by the score", "ops",
         lambda xp, dev: sdpa(*qkv(xp, dev), score_mod=lambda s, b, h, i, j: s ** s),
         TypeError, ("score_mod", "write it with ops.exp and ops.log")),
    Case("a block mask of other lengths", "block_mask",
         lambda xp, dev: sdpa(*qkv(xp, dev), block_mask=polyattn.block_mask(
             lambda b, h, i, j: i >= j, None, None, 8, 8, xp=xp, device=dev)),
         ValueError, ("`block_mask` was built for Tq = 8, Tk = 8", "Tq = 4, Tk = 6")),
    Case("block_mask given an int as batch_shape", "block_mask",
         lambda xp, dev: polyattn.block_mask(lambda b, h, i, j: i >= j, 2, None, 4, 6, xp=xp,
                                             device=dev),
         TypeError, ("`batch_shape` must be a tuple of ints", "write (2,)")),
    Case("a block mask of another batch", "block_mask",
         lambda xp, dev: sdpa(*qkv(xp, dev), block_mask=polyattn.block_mask(
             lambda b, h, i, j: i >= j, (5,), None, 4, 6, xp=xp, device=dev)),
         ValueError, ("`block_mask` was built for batch (5,) (this call's B… is (2,))",
                      "batch_shape")),
    Case("a block mask of other heads", "block_mask",
         lambda xp, dev: sdpa(*qkv(xp, dev), block_mask=polyattn.block_mask(
             lambda b, h, i, j: i >= j, None, 4, 4, 6, xp=xp, device=dev)),
         ValueError, ("`block_mask` was built for 4 heads (this call has H = 3)",)),
    Case("a block mask whose rule changed since it was built", "block_mask",
         lambda xp, dev: _stale_block_mask(xp, dev),
         ValueError, ("`block_mask` was built for mask_mod", "has changed since",
                      "build the block mask again")),
    Case("block_mask given one array as mod_args", "block_mask",
         lambda xp, dev: polyattn.block_mask(lambda b, h, i, j, t: i >= j, None, None, 4, 6,
                                             mod_args=z(xp, dev, 3), xp=xp, device=dev),
         TypeError, ("`mod_args` must be a tuple of arrays", "(wrap one array as (array,))")),
    Case("not a BlockMask", "BlockMask",
         lambda xp, dev: sdpa(*qkv(xp, dev), block_mask=z(xp, dev, 2)),
         TypeError, ("`block_mask` must be a BlockMask from polyattn.block_mask(...)",)),
    Case("mod_args without a rule", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), mod_args=(z(xp, dev, 3),)),
         ValueError, ("`mod_args` are the arrays of score_mod and mask_mod",)),
    Case("float key_lengths", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), key_lengths=z(xp, dev, 2)),
         TypeError, ("`key_lengths`", "integer dtype", "float64", "(2,)")),
    Case("key_lengths of the wrong shape", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(xp, dev), key_lengths=z(xp, dev, 3, dtype="int64")),
         ValueError, ("`key_lengths`", "batch dimensions B… = (2,)", "got shape (3,)")),
    # attention_weights
    Case("integer query", "attention_weights",
         lambda xp, dev: polyattn.attention_weights(z(xp, dev, 4, 5, dtype="int32"),
                                                    z(xp, dev, 6, 5)),
         TypeError, ("`query`", "real floating", "int32", "(4, 5)")),
    Case("feature sizes differ", "attention_weights",
         lambda xp, dev: polyattn.attention_weights(z(xp, dev, 4, 5), z(xp, dev, 6, 4)),
         ValueError, ("`key` has 4 features", "`query` has 5", "(4, 5)", "(6, 4)")),
    Case("mask does not broadcast", "attention_weights",
         lambda xp, dev: polyattn.attention_weights(z(xp, dev, 4, 5), z(xp, dev, 6, 5),
                                                    attn_mask=z(xp, dev, 3, 6)),
         ValueError, ("`attn_mask`", "(3, 6)", "(1, 4, 6)")),
    Case("integer alibi_slopes", "attention_weights",
         lambda xp, dev: polyattn.attention_weights(z(xp, dev, 4, 5), z(xp, dev, 6, 5),
                                                    alibi_slopes=z(xp, dev, 1, dtype="int64")),
         TypeError, ("`alibi_slopes`", "real floating", "int64", "(1,)")),
    # softmax and logsumexp
    Case("integer input", "softmax",
         lambda xp, dev: polyattn.softmax(z(xp, dev, 3, dtype="int64")),
         TypeError, ("`x`", "real floating", "int64", "(3,)")),
    Case("boolean input", "softmax",
         lambda xp, dev: polyattn.softmax(z(xp, dev, 2, 3, dtype="bool")),
         TypeError, ("`x`", "real floating", "bool", "(2, 3)")),
    Case("0-d input", "softmax",
         lambda xp, dev: polyattn.softmax(z(xp, dev)),
         ValueError, ("`x`", "at least one dimension", "0-d")),
    Case("axis out of range", "softmax",
         lambda xp, dev: polyattn.softmax(z(xp, dev, 2, 3), axis=2),
         ValueError, ("`axis` 2", "out of range", "2 dimensions")),
    Case("complex input", "logsumexp",
         lambda xp, dev: polyattn.logsumexp(z(xp, dev, 3, dtype="complex128")),
         TypeError, ("`x`", "real floating", "complex128", "(3,)")),
    Case("axis out of range", "logsumexp",
         lambda xp, dev: polyattn.logsumexp(z(xp, dev, 2, 3), axis=-3),
         ValueError, ("`axis` -3", "out of range", "2 dimensions")),
    # multi_head_attention
    Case("integer query", "multi_head_attention",
         lambda xp, dev: _mha(xp, dev, x=z(xp, dev, 2, 5, 8, dtype="int64")),
         TypeError, ("`query`", "real floating", "int64", "(2, 5, 8)")),
    Case("w_k of the wrong shape", "multi_head_attention",
         lambda xp, dev: _mha(xp, dev, params={"w_k": z(xp, dev, 8, 6)}),
         ValueError, ("`w_k`", "(8, 6)", "expected (8, 8)")),
    Case("integer parameter", "multi_head_attention",
         lambda xp, dev: _mha(xp, dev, params={"w_o": z(xp, dev, 8, 8, dtype="int32")}),
         TypeError, ("`params['w_o']`", "real floating", "int32", "(8, 8)")),
    Case("key and value lengths differ", "multi_head_attention",
         lambda xp, dev: _mha(xp, dev, value=z(xp, dev, 2, 4, 8)),
         ValueError, ("`value` has 4 positions", "`key` has 5", "key (2, 5, 8)",
                      "value (2, 4, 8)")),
    Case("batch sizes differ", "multi_head_attention",
         lambda xp, dev: _mha(xp, dev, key=z(xp, dev, 3, 5, 8), value=z(xp, dev, 3, 5, 8)),
         ValueError, ("batch dimensions", "query (2,)", "key (3,)", "query (2, 5, 8)",
                      "key (3, 5, 8)")),
    # apply_rotary_embedding
    Case("float positions", "apply_rotary_embedding",
         lambda xp, dev: polyattn.apply_rotary_embedding(z(xp, dev, 4, 6), z(xp, dev, 4)),
         TypeError, ("`positions`", "integer dtype", "float64", "(4,)")),
    Case("odd rotary_dim", "apply_rotary_embedding",
         lambda xp, dev: polyattn.apply_rotary_embedding(
             z(xp, dev, 4, 6), z(xp, dev, 4, dtype="int64"), rotary_dim=3),
         ValueError, ("`rotary_dim`", "even", "6 features", "(4, 6)", "got 3")),
    Case("positions do not broadcast", "apply_rotary_embedding",
         lambda xp, dev: polyattn.apply_rotary_embedding(
             z(xp, dev, 2, 3, 4, 6), z(xp, dev, 2, 4, dtype="int64")),
         ValueError, ("`positions`", "(2, 4)", "x.shape[:-1] = (2, 3, 4)", "(B, 1, T)")),
    Case("inv_freq of the wrong size", "apply_rotary_embedding",
         lambda xp, dev: polyattn.apply_rotary_embedding(
             z(xp, dev, 4, 6), z(xp, dev, 4, dtype="int64"), inv_freq=z(xp, dev, 2)),
         ValueError, ("`inv_freq`", "shape (3,)", "rotary_dim / 2", "(2,)")),
    # rotary_frequencies
    Case("unknown rope_type", "rotary_frequencies",
         lambda xp, dev: polyattn.rotary_frequencies(
             8, scaling={"rope_type": "dynamic", "factor": 2.0}, xp=xp, device=dev),
         ValueError, ("rope_type 'dynamic'", "not implemented", "'linear'", "'yarn'")),
    Case("scaling key missing", "rotary_frequencies",
         lambda xp, dev: polyattn.rotary_frequencies(
             8, scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192}, xp=xp, device=dev),
         ValueError, ("rope_type 'llama3'", "lacks", "'high_freq_factor'")),
    Case("odd rotary_dim", "rotary_frequencies",
         lambda xp, dev: polyattn.rotary_frequencies(7, xp=xp, device=dev),
         ValueError, ("`rotary_dim`", "even", "7")),
    # alibi_slopes
    Case("no heads", "alibi_slopes", lambda xp, dev: polyattn.alibi_slopes(0, xp=xp),
         ValueError, ("`num_heads`", "at least 1", "0")),
    # KVCache
    Case("key of the wrong shape", "KVCache",
         lambda xp, dev: polyattn.KVCache((2,), 3, 8, 4, xp=xp, device=dev,
                                          dtype=xp.float64).update(z(xp, dev, 2, 3, 1, 5),
                                                                   z(xp, dev, 2, 3, 1, 4)),
         ValueError, ("`key`", "(B…, Hkv, Tnew, E) = (2, 3, Tnew, 4)", "(2, 3, 1, 5)")),
    Case("float lengths", "KVCache",
         lambda xp, dev: polyattn.KVCache((2,), 3, 8, 4, xp=xp, device=dev,
                                          dtype=xp.float64).update(
             z(xp, dev, 2, 3, 1, 4), z(xp, dev, 2, 3, 1, 4), lengths=z(xp, dev, 2)),
         TypeError, ("`lengths`", "integer dtype", "float64", "(2,)")),
]


def _strict_other_device(xp, dev):
    import array_api_strict as xs

    q, k, v = qkv(xs, xs.Device("CPU_DEVICE"))
    return sdpa(q, xs.asarray(k, device=xs.Device("device1")), v)


def _strict_mask_other_device(xp, dev):
    import array_api_strict as xs

    mask = xs.ones((4, 6), dtype=xs.bool, device=xs.Device("device1"))
    return sdpa(*qkv(xs, xs.Device("CPU_DEVICE")), attn_mask=mask)


def _torch(*shape, dtype="float64"):
    torch = pytest.importorskip("torch")
    return torch.zeros(shape, dtype=getattr(torch, dtype))


def _jax(*shape):
    jnp = pytest.importorskip("jax.numpy")
    return jnp.zeros(shape)


def _mha_torch_params(xp, dev):
    mha = polyattn.MultiHeadAttention(8, 2, seed=0)
    params = {**mha.params, "w_q": _torch(8, 8)}
    x = np.zeros((2, 5, 8))
    return polyattn.multi_head_attention(x, x, x, params, num_heads=2)


def _from_torch_bias_kv(xp, dev):
    torch = pytest.importorskip("torch")
    module = torch.nn.MultiheadAttention(8, 2, add_bias_kv=True)
    return polyattn.MultiHeadAttention.from_torch(module)


def _longdouble(*shape):
    if np.dtype(np.longdouble) == np.dtype(np.float64):
        pytest.skip("np.longdouble is float64 on this platform")
    return np.zeros(shape, dtype=np.longdouble)


def _from_torch_linear(xp, dev):
    torch = pytest.importorskip("torch")
    return polyattn.MultiHeadAttention.from_torch(torch.nn.Linear(3, 3))


def _with_budget(value):
    def call(xp, dev):
        previous = os.environ.get("POLYATTN_SCORE_BUDGET")
        os.environ["POLYATTN_SCORE_BUDGET"] = value
        try:
            return polyattn.explain(*qkv(np, None))
        finally:
            if previous is None:
                del os.environ["POLYATTN_SCORE_BUDGET"]
            else:
                os.environ["POLYATTN_SCORE_BUDGET"] = previous
    return call


def _numba_without_cuda(function):
    def call(xp, dev):
        q = np.zeros((1, 2, 8, 4))
        options = {"implementation": "numba_cuda"}
        if function == "explain":
            return polyattn.explain(q, q, q, **options)
        return sdpa(q, q, q, **options)
    return call


# --------------------------------------------------------------------------- #
# Cases with NumPy inputs (arguments that are not arrays, or several libraries)
# --------------------------------------------------------------------------- #

NUMPY = [
    # scaled_dot_product_attention: options
    Case("unknown implementation", "scaled_dot_product_attention", _sdpa(implementation="flash"),
         ValueError, ("`implementation`", "'auto', 'native', 'reference', 'chunked', 'numba_cuda'",
                      "got 'flash'")),
    Case("unknown causal_alignment", "scaled_dot_product_attention",
         _sdpa(is_causal=True, causal_alignment="bottom"),
         ValueError, ("`causal_alignment`", "'top_left', 'bottom_right'", "got 'bottom'")),
    Case("is_causal not a bool", "scaled_dot_product_attention", _sdpa(is_causal="yes"),
         TypeError, ("`is_causal`", "True or False", "'yes'")),
    Case("enable_gqa not a bool", "scaled_dot_product_attention", _sdpa(enable_gqa=1),
         TypeError, ("`enable_gqa`", "True or False", "got 1")),
    Case("return_lse not a bool", "scaled_dot_product_attention", _sdpa(return_lse=None),
         TypeError, ("`return_lse`", "True or False", "got None")),
    Case("scale not a number", "scaled_dot_product_attention", _sdpa(scale="0.5"),
         TypeError, ("`scale`", "real number or None", "'0.5'")),
    Case("scale not finite", "scaled_dot_product_attention", _sdpa(scale=float("nan")),
         ValueError, ("`scale`", "finite", "nan")),
    Case("query not an array", "scaled_dot_product_attention",
         lambda xp, dev: sdpa([[1.0, 2.0]], *qkv(np, None)[1:]),
         TypeError, ("`query`", "Array API", "list")),
    Case("numpy query, torch key", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(np.zeros((4, 5)), _torch(6, 5), np.zeros((6, 7))),
         TypeError, ("`query` is a numpy array", "`key` is a torch array")),
    Case("numpy inputs, jax mask", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(np.zeros((4, 5)), np.zeros((6, 5)), np.zeros((6, 7)),
                              attn_mask=_jax(4, 6)),
         TypeError, ("`query` is a numpy array", "`attn_mask` is a jax array")),
    Case("key on another device", "scaled_dot_product_attention", _strict_other_device,
         ValueError, ("`query`", "CPU_DEVICE", "`key`", "device1")),
    Case("mask on another device", "scaled_dot_product_attention", _strict_mask_other_device,
         ValueError, ("`query`", "CPU_DEVICE", "`attn_mask`", "device1")),
    Case("numba_cuda without CUDA", "scaled_dot_product_attention",
         _numba_without_cuda("sdpa"),
         RuntimeError, ("implementation='numba_cuda'", "CUDA", "numpy arrays")),
    # window, softcap, key lengths
    Case("negative window", "scaled_dot_product_attention", _sdpa(window=(-1, 0)),
         ValueError, ("`window`", "(left, right)", ">= 0", "got (-1, 0)",
                      "left side is negative")),
    Case("negative right side of window", "scaled_dot_product_attention",
         _sdpa(window=(0, -3)),
         ValueError, ("`window`", "got (0, -3)", "right side is negative")),
    Case("window not a pair", "scaled_dot_product_attention", _sdpa(window=4),
         TypeError, ("`window`", "(left, right)", "got 4")),
    Case("window of three", "scaled_dot_product_attention", _sdpa(window=(1, 2, 3)),
         TypeError, ("`window`", "(left, right)", "got (1, 2, 3)")),
    Case("window side not an integer", "scaled_dot_product_attention", _sdpa(window=(2.5, 0)),
         TypeError, ("`window`", "integer", "got (2.5, 0)", "left side is float")),
    Case("softcap zero", "scaled_dot_product_attention", _sdpa(softcap=0.0),
         ValueError, ("`softcap`", "finite number > 0", "got 0.0")),
    Case("negative softcap", "scaled_dot_product_attention", _sdpa(softcap=-2.0),
         ValueError, ("`softcap`", "> 0", "got -2.0")),
    Case("infinite softcap", "scaled_dot_product_attention", _sdpa(softcap=float("inf")),
         ValueError, ("`softcap`", "finite", "got inf")),
    Case("softcap a bool", "scaled_dot_product_attention", _sdpa(softcap=True),
         TypeError, ("`softcap`", "real number", "got True")),
    Case("key_lengths above Tk", "scaled_dot_product_attention",
         _sdpa(key_lengths=np.array([7, 2])),
         ValueError, ("`key_lengths`", "[0, Tk] = [0, 6]", "from 2 to 7")),
    Case("negative key_lengths", "scaled_dot_product_attention",
         _sdpa(key_lengths=np.array([-1, 3])),
         ValueError, ("`key_lengths`", "[0, Tk] = [0, 6]", "from -1 to 3")),
    # dropout
    Case("dropout_p of 1", "scaled_dot_product_attention",
         _sdpa(dropout_p=1.0, dropout_seed=0),
         ValueError, ("`dropout_p`", "[0, 1)", "got 1.0")),
    Case("negative dropout_p", "scaled_dot_product_attention",
         _sdpa(dropout_p=-0.1, dropout_seed=0),
         ValueError, ("`dropout_p`", "[0, 1)", "got -0.1")),
    Case("dropout_p a bool", "scaled_dot_product_attention", _sdpa(dropout_p=True),
         TypeError, ("`dropout_p`", "real number", "got True")),
    Case("dropout without a seed", "scaled_dot_product_attention", _sdpa(dropout_p=0.1),
         ValueError, ("dropout_p=0.1", "`dropout_seed`", "same on every backend")),
    Case("dropout_seed a float", "scaled_dot_product_attention",
         _sdpa(dropout_p=0.1, dropout_seed=1.5),
         TypeError, ("`dropout_seed`", "int", "float 1.5")),
    Case("negative dropout_seed", "scaled_dot_product_attention",
         _sdpa(dropout_p=0.1, dropout_seed=-1),
         ValueError, ("`dropout_seed`", "[0, 2**64)", "got -1")),
    # attention_vjp
    Case("grad_out of the wrong shape", "attention_vjp",
         lambda xp, dev: polyattn.attention_vjp(*qkv(xp, dev))[1](z(xp, dev, 2, 3, 4, 5)),
         ValueError, ("`grad_out`", "(2, 3, 4, 7)", "got (2, 3, 4, 5)")),
    Case("grad_lse of the wrong shape", "attention_vjp",
         lambda xp, dev: polyattn.attention_vjp(*qkv(xp, dev), return_lse=True)[1](
             z(xp, dev, 2, 3, 4, 7), z(xp, dev, 2, 3, 5)),
         ValueError, ("`grad_lse`", "(2, 3, 4)", "got (2, 3, 5)")),
    Case("integer grad_out", "attention_vjp",
         lambda xp, dev: polyattn.attention_vjp(*qkv(xp, dev))[1](
             z(xp, dev, 2, 3, 4, 7, dtype="int32")),
         TypeError, ("`grad_out`", "real floating", "int32")),
    Case("native", "attention_vjp",
         lambda xp, dev: polyattn.attention_vjp(*qkv(xp, dev), implementation="native"),
         ValueError, ("attention_vjp", "implementation='native'", "log-sum-exp")),
    Case("dropout without a seed", "attention_vjp",
         lambda xp, dev: polyattn.attention_vjp(*qkv(xp, dev), dropout_p=0.5),
         ValueError, ("dropout_p=0.5", "`dropout_seed`")),
    Case("int key_lengths above Tk", "scaled_dot_product_attention", _sdpa(key_lengths=9),
         ValueError, ("`key_lengths`", "[0, Tk] = [0, 6]", "9")),
    Case("key_lengths a float", "scaled_dot_product_attention", _sdpa(key_lengths=2.5),
         TypeError, ("`key_lengths`", "integer array", "or an int", "float 2.5")),
    # attention_weights
    Case("unknown causal_alignment", "attention_weights",
         lambda xp, dev: polyattn.attention_weights(np.zeros((4, 5)), np.zeros((6, 5)),
                                                    is_causal=True, causal_alignment="left"),
         ValueError, ("`causal_alignment`", "got 'left'")),
    Case("numpy query, torch key", "attention_weights",
         lambda xp, dev: polyattn.attention_weights(np.zeros((4, 5)), _torch(6, 5)),
         TypeError, ("`query` is a numpy array", "`key` is a torch array")),
    Case("negative window", "attention_weights",
         lambda xp, dev: polyattn.attention_weights(np.zeros((4, 5)), np.zeros((6, 5)),
                                                    window=(3, -1)),
         ValueError, ("`window`", "got (3, -1)", "right side is negative")),
    # softmax and logsumexp
    Case("axis not an integer", "softmax",
         lambda xp, dev: polyattn.softmax(np.zeros(3), axis=0.0),
         TypeError, ("`axis`", "integer", "0.0")),
    Case("input not an array", "softmax", lambda xp, dev: polyattn.softmax([1.0, 2.0]),
         TypeError, ("`x`", "Array API", "list")),
    Case("keepdims not a bool", "logsumexp",
         lambda xp, dev: polyattn.logsumexp(np.zeros(3), keepdims="no"),
         TypeError, ("`keepdims`", "True or False", "'no'")),
    # causal_mask
    Case("negative length", "causal_mask", lambda xp, dev: polyattn.causal_mask(-1, 3),
         ValueError, ("`tq`", "at least 0", "-1")),
    Case("non-integer length", "causal_mask", lambda xp, dev: polyattn.causal_mask(2, 3.0),
         TypeError, ("`tk`", "integer", "3.0")),
    Case("unknown alignment", "causal_mask",
         lambda xp, dev: polyattn.causal_mask(2, 3, alignment="bottom"),
         ValueError, ("`alignment`", "'top_left', 'bottom_right'", "'bottom'")),
    Case("xp not a namespace", "causal_mask",
         lambda xp, dev: polyattn.causal_mask(2, 3, xp="numpy"),
         TypeError, ("`xp`", "array namespace", "'numpy'")),
    # sinusoidal_positional_encoding
    Case("non-integer num_positions", "sinusoidal_positional_encoding",
         lambda xp, dev: polyattn.sinusoidal_positional_encoding(3.5, 4),
         TypeError, ("`num_positions`", "integer", "3.5")),
    Case("negative num_positions", "sinusoidal_positional_encoding",
         lambda xp, dev: polyattn.sinusoidal_positional_encoding(-1, 4),
         ValueError, ("`num_positions`", "at least 0", "-1")),
    Case("d_model below 1", "sinusoidal_positional_encoding",
         lambda xp, dev: polyattn.sinusoidal_positional_encoding(3, 0),
         ValueError, ("`d_model`", "at least 1", "0")),
    Case("non-integer d_model", "sinusoidal_positional_encoding",
         lambda xp, dev: polyattn.sinusoidal_positional_encoding(3, True),
         TypeError, ("`d_model`", "integer", "True")),
    Case("negative offset", "sinusoidal_positional_encoding",
         lambda xp, dev: polyattn.sinusoidal_positional_encoding(3, 4, offset=-2),
         ValueError, ("`offset`", "at least 0", "-2")),
    Case("base not positive", "sinusoidal_positional_encoding",
         lambda xp, dev: polyattn.sinusoidal_positional_encoding(3, 4, base=0.0),
         ValueError, ("`base`", "positive finite", "0.0")),
    Case("infinite base", "sinusoidal_positional_encoding",
         lambda xp, dev: polyattn.sinusoidal_positional_encoding(3, 4, base=float("inf")),
         ValueError, ("`base`", "positive finite", "inf")),
    Case("base not a number", "sinusoidal_positional_encoding",
         lambda xp, dev: polyattn.sinusoidal_positional_encoding(3, 4, base="1e4"),
         TypeError, ("`base`", "real number", "'1e4'")),
    Case("integer dtype", "sinusoidal_positional_encoding",
         lambda xp, dev: polyattn.sinusoidal_positional_encoding(3, 4, dtype=np.int32),
         TypeError, ("`dtype`", "real floating", "int32")),
    # multi_head_attention
    Case("w_o of the wrong shape", "multi_head_attention",
         lambda xp, dev: _mha(np, None, params={"w_o": np.zeros((6, 8))}),
         ValueError, ("`w_o`", "(6, 8)", "expected (8, 8)", "num_heads=2")),
    Case("b_q of the wrong shape", "multi_head_attention",
         lambda xp, dev: _mha(np, None, params={"b_q": np.zeros(6)}),
         ValueError, ("`b_q`", "(6,)", "expected (8,)")),
    Case("w_v not a matrix", "multi_head_attention",
         lambda xp, dev: _mha(np, None, params={"w_v": np.zeros(8)}),
         ValueError, ("`w_v`", "(8,)", "vdim=8")),
    Case("key features differ from w_k", "multi_head_attention",
         lambda xp, dev: _mha(np, None, key=np.zeros((2, 5, 6))),
         ValueError, ("`w_k`", "(8, 8)", "expected (6, 8)", "kdim=6")),
    Case("missing parameter", "multi_head_attention",
         lambda xp, dev: polyattn.multi_head_attention(
             np.zeros((5, 8)), np.zeros((5, 8)), np.zeros((5, 8)),
             {"w_q": np.zeros((8, 8)), "w_k": np.zeros((8, 8)), "w_o": np.zeros((8, 8))},
             num_heads=2),
         ValueError, ("`params`", "lacks w_v", "w_q, w_k, w_v, w_o")),
    Case("unknown parameter", "multi_head_attention",
         lambda xp, dev: _mha(np, None, params={"w_z": np.zeros(1)}),
         ValueError, ("`params`", "unknown keys ['w_z']",)),
    Case("params not a mapping", "multi_head_attention",
         lambda xp, dev: polyattn.multi_head_attention(
             np.zeros((5, 8)), np.zeros((5, 8)), np.zeros((5, 8)), [np.zeros((8, 8))],
             num_heads=2),
         TypeError, ("`params`", "mapping", "list")),
    Case("d_model not divisible by num_heads", "multi_head_attention",
         lambda xp, dev: _mha(np, None, num_heads=3),
         ValueError, ("d_model = 8", "`query` (2, 5, 8)", "`num_heads` (3)")),
    Case("num_heads below 1", "multi_head_attention",
         lambda xp, dev: _mha(np, None, num_heads=0),
         ValueError, ("`num_heads`", "at least 1", "0")),
    Case("num_heads not a multiple of num_kv_heads", "multi_head_attention",
         lambda xp, dev: _mha(np, None, num_kv_heads=3),
         ValueError, ("`num_heads` (2)", "multiple of `num_kv_heads` (3)")),
    Case("query of rank 1", "multi_head_attention",
         lambda xp, dev: _mha(np, None, x=np.zeros(8)),
         ValueError, ("`query`", "at least 2 dimensions", "(8,)")),
    Case("mask does not broadcast", "multi_head_attention",
         lambda xp, dev: _mha(np, None, attn_mask=np.ones((4, 5), dtype=bool)),
         ValueError, ("`attn_mask`", "(4, 5)", "(2, 2, 5, 5)")),
    Case("unknown implementation", "multi_head_attention",
         lambda xp, dev: _mha(np, None, implementation="fast"),
         ValueError, ("`implementation`", "got 'fast'")),
    Case("unknown causal_alignment", "multi_head_attention",
         lambda xp, dev: _mha(np, None, is_causal=True, causal_alignment="right"),
         ValueError, ("`causal_alignment`", "got 'right'")),
    Case("numpy inputs, torch parameter", "multi_head_attention", _mha_torch_params,
         TypeError, ("`query` is a numpy array", "`params['w_q']` is a torch array")),
    # apply_rotary_embedding
    Case("odd features without rotary_dim", "apply_rotary_embedding",
         lambda xp, dev: polyattn.apply_rotary_embedding(np.zeros((4, 5)), np.arange(4)),
         ValueError, ("`x`", "odd number of features, 5", "(4, 5)", "`rotary_dim`")),
    Case("rotary_dim above E", "apply_rotary_embedding",
         lambda xp, dev: polyattn.apply_rotary_embedding(np.zeros((4, 6)), np.arange(4),
                                                         rotary_dim=8),
         ValueError, ("`rotary_dim`", "at most the 6 features", "got 8")),
    # alibi_slopes
    Case("integer dtype", "alibi_slopes",
         lambda xp, dev: polyattn.alibi_slopes(4, dtype=np.int32),
         TypeError, ("`dtype`", "real floating", "int32")),
    # KVCache
    Case("capacity exceeded", "KVCache",
         lambda xp, dev: polyattn.KVCache((2,), 1, 2, 4).update(np.zeros((2, 1, 3, 4)),
                                                                 np.zeros((2, 1, 3, 4))),
         ValueError, ("capacity is 2", "appending 3", "holding 0", "needs 3")),
    Case("float64 into a float32 cache", "KVCache",
         lambda xp, dev: polyattn.KVCache((2,), 1, 2, 4, dtype=np.float32).update(
             np.zeros((2, 1, 1, 4)), np.zeros((2, 1, 1, 4))),
         TypeError, ("`key`", "float64", "float32", "dtype=float64")),
    Case("no capacity", "KVCache", lambda xp, dev: polyattn.KVCache((2,), 1, 0, 4),
         ValueError, ("`capacity`", "at least 1", "0")),
    # multi_head_attention: rotary embeddings and caches
    Case("rotary with Tq != Tk", "multi_head_attention",
         lambda xp, dev: _mha(np, None, key=np.zeros((2, 3, 8)), value=np.zeros((2, 3, 8)),
                              rotary={}),
         ValueError, ("`rotary`", "Tq = 5, Tk = 3")),
    Case("cache of other shapes", "multi_head_attention",
         lambda xp, dev: _mha(np, None, cache=polyattn.KVCache((3,), 2, 8, 4)),
         ValueError, ("`cache`", "(3,)", "(2,)", "KVCache((2,), 2, capacity, 4)")),
    # MultiHeadAttention
    Case("embed_dim not divisible by num_heads", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(10, 3),
         ValueError, ("`embed_dim` (10)", "divisible by `num_heads` (3)")),
    Case("embed_dim below 1", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(0, 1),
         ValueError, ("`embed_dim`", "at least 1", "0")),
    Case("non-integer embed_dim", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(8.0, 2),
         TypeError, ("`embed_dim`", "integer", "8.0")),
    Case("num_heads not a multiple of num_kv_heads", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(8, 4, num_kv_heads=3),
         ValueError, ("`num_heads` (4)", "`num_kv_heads` (3)")),
    Case("kdim below 1", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(8, 2, kdim=0),
         ValueError, ("`kdim`", "at least 1", "0")),
    Case("integer dtype", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(8, 2, dtype=np.int64),
         TypeError, ("`dtype`", "real floating", "int64")),
    Case("bias not a bool", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(8, 2, bias=None),
         TypeError, ("`bias`", "True or False", "None")),
    Case("query features differ from embed_dim", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(8, 2)(np.zeros((5, 6))),
         ValueError, ("`query` has 6 features", "embed_dim=8", "(5, 6)")),
    Case("value features differ from vdim", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(8, 2, vdim=4)(
             np.zeros((5, 8)), np.zeros((7, 8)), np.zeros((7, 3))),
         ValueError, ("`value` has 3 features", "vdim=4", "(7, 3)")),
    Case("torch module with add_bias_kv", "MultiHeadAttention", _from_torch_bias_kv,
         ValueError, ("add_bias_kv", "not supported")),
    # explain
    Case("unknown keyword", "explain",
         lambda xp, dev: polyattn.explain(*qkv(np, None), is_casual=True),
         TypeError, ("explain()", "is_casual")),
    Case("unknown implementation", "explain",
         lambda xp, dev: polyattn.explain(*qkv(np, None), implementation="flash"),
         ValueError, ("`implementation`", "got 'flash'")),
    Case("feature sizes differ", "explain",
         lambda xp, dev: polyattn.explain(np.zeros((4, 5)), np.zeros((6, 4)), np.zeros((6, 7))),
         ValueError, ("`key` has 4 features", "`query` has 5")),
    Case("integer query", "explain",
         lambda xp, dev: polyattn.explain(np.zeros((4, 5), dtype=np.int16), np.zeros((6, 5)),
                                          np.zeros((6, 7))),
         TypeError, ("`query`", "real floating", "int16", "(4, 5)")),
    Case("numba_cuda without CUDA", "explain", _numba_without_cuda("explain"),
         RuntimeError, ("implementation='numba_cuda'", "CUDA")),
    Case("softcap not positive", "explain",
         lambda xp, dev: polyattn.explain(*qkv(np, None), softcap=-1.0),
         ValueError, ("`softcap`", "finite number > 0", "got -1.0")),
    Case("key_lengths above Tk", "explain",
         lambda xp, dev: polyattn.explain(*qkv(np, None), key_lengths=np.array([3, 8])),
         ValueError, ("`key_lengths`", "[0, 6]", "from 3 to 8")),
    Case("negative POLYATTN_SCORE_BUDGET", "explain", _with_budget("-5"),
         ValueError, ("POLYATTN_SCORE_BUDGET", ">= 0", "got '-5'")),
    # float128 (np.longdouble): no path computes it at its own precision
    Case("float128 query", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(_longdouble(2, 3, 4, 5), *qkv(np, None)[1:]),
         TypeError, ("`query`", "float16, float32 or float64", "bfloat16", "got float128")),
    Case("float128 mask", "scaled_dot_product_attention",
         lambda xp, dev: sdpa(*qkv(np, None), attn_mask=_longdouble(4, 6)),
         TypeError, ("`attn_mask`", "float128", "float16, float32 or float64")),
    Case("float128 input", "softmax", lambda xp, dev: polyattn.softmax(_longdouble(3)),
         TypeError, ("`x`", "bfloat16", "got float128")),
    Case("float128 dtype", "KVCache",
         lambda xp, dev: (_longdouble(1), polyattn.KVCache((2,), 1, 4, 4,
                                                           dtype=np.longdouble))[1],
         TypeError, ("`dtype`", "bfloat16", "longdouble")),
    Case("float128 query", "attention_vjp",
         lambda xp, dev: polyattn.attention_vjp(_longdouble(2, 3, 4, 5), *qkv(np, None)[1:]),
         TypeError, ("`query`", "bfloat16", "got float128")),
    # pullbacks
    Case("grad_out None", "attention_vjp",
         lambda xp, dev: polyattn.attention_vjp(*qkv(np, None))[1](None),
         TypeError, ("`grad_out` must be an array", "(2, 3, 4, 7)", "got NoneType")),
    Case("float64 grad_out for a float32 result", "attention_vjp",
         lambda xp, dev: polyattn.attention_vjp(*qkv(np, None, dtype="float32"))[1](
             np.zeros((2, 3, 4, 7))),
         TypeError, ("`grad_out` is float64", "`out` is float32", "lose precision")),
    # multi-head attention
    Case("not a torch MultiheadAttention", "MultiHeadAttention", _from_torch_linear,
         TypeError, ("`module`", "torch.nn.MultiheadAttention", "Linear")),
    Case("seed not an integer", "MultiHeadAttention",
         lambda xp, dev: polyattn.MultiHeadAttention(8, 2, seed="a"),
         TypeError, ("`seed`", "int or None", "'a'")),
]


def _id(case: Case) -> str:
    return f"{case.function}-{case.name.replace(' ', '_')}"


@pytest.mark.parametrize("case", PORTABLE, ids=_id)
def test_bad_input_on_every_backend(case, backend, xp, device):
    if case.pieces and "complex128" in case.pieces and not hasattr(xp, "complex128"):
        pytest.skip(f"{backend.value} has no complex128")
    with pytest.raises(case.error, match=case.pattern):
        case.call(xp, device)


@pytest.mark.parametrize("case", NUMPY, ids=_id)
def test_bad_input(case, monkeypatch):
    monkeypatch.delenv("NUMBA_ENABLE_CUDASIM", raising=False)
    if "device1" in case.pieces and Backend.ARRAY_API_STRICT not in available_backends():
        pytest.skip("array-api-strict is not installed")
    with pytest.raises(case.error, match=case.pattern):
        case.call(np, None)


def test_every_public_function_has_cases():
    covered = {case.function for case in PORTABLE + NUMPY}
    public = set(polyattn.__all__) - {"__version__"}
    missing = public - covered - {"merge_attention"}
    assert not missing, f"no bad-input case for {sorted(missing)}"


# --------------------------------------------------------------------------- #
# docs/errors_table.rst
# --------------------------------------------------------------------------- #

TABLE = Path(__file__).resolve().parents[1] / "docs" / "errors_table.rst"


def _message(case: Case) -> str:
    previous = os.environ.pop("NUMBA_ENABLE_CUDASIM", None)
    try:
        case.call(np, None)
    except case.error as exc:
        return str(exc)
    finally:
        if previous is not None:
            os.environ["NUMBA_ENABLE_CUDASIM"] = previous
    raise AssertionError(f"{_id(case)} did not raise")  # pragma: no cover


HEADER = [
    ":orphan:",
    "",
    ".. This file is generated by ``python tests/test_errors.py``; do not edit it by hand.",
    "",
    "Errors",
    "======",
    "",
    "Bad arguments raise ``TypeError`` (wrong kind: dtype, type, library) or",
    "``ValueError`` (wrong value: shape, size, choice) before anything is computed.",
    "The message names the argument and quotes what was received and what was",
    "expected. ``implementation=\"numba_cuda\"`` where the kernel cannot run raises",
    "``RuntimeError``. The messages below are those NumPy inputs produce; other",
    "libraries give the same ones with their own dtype names.",
    "",
    ".. list-table::",
    "   :header-rows: 1",
    "   :widths: 18 22 12 48",
    "",
    "   * - Function",
    "     - Case",
    "     - Exception",
    "     - Example message",
]


def render_row(case: Case) -> str:
    """The table row of ``case``, with the message the library raises now."""
    return "\n".join([f"   * - ``{case.function}``", f"     - {case.name}",
                      f"     - ``{case.error.__name__}``", f"     - ``{_message(case)}``"])


def render_table(previous: str = "") -> str:
    """The reStructuredText page listing every case, with NumPy's messages (a case whose
    library is not installed keeps its row of ``previous``)."""
    rows = []
    for case in PORTABLE + NUMPY:
        try:
            rows.append(render_row(case))
        except pytest.skip.Exception:
            head = "\n".join([f"   * - ``{case.function}``", f"     - {case.name}", ""])
            start = previous.find(head)
            if start < 0:
                raise
            end = previous.find("\n   * - ``", start + 1)
            rows.append(previous[start:end if end >= 0 else len(previous)].rstrip("\n"))
    return "\n".join([*HEADER, *rows]) + "\n"


def test_errors_table_is_current(monkeypatch):
    """Every case has its row in docs/errors_table.rst, with today's message."""
    if not TABLE.exists():
        pytest.skip(f"{TABLE} is not part of this checkout")
    text = TABLE.read_text(encoding="utf-8")
    cases = PORTABLE + NUMPY
    assert text.count("\n   * - ``") == len(cases), "rows and cases differ in number"
    stale = []
    for case in cases:
        try:
            row = render_row(case)
        except pytest.skip.Exception:  # a library the case needs is not installed
            continue
        if row not in text:
            stale.append(_id(case))
    assert not stale, f"stale rows {stale}: run `python tests/test_errors.py`"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    TABLE.write_text(render_table(TABLE.read_text(encoding="utf-8") if TABLE.exists() else ""),
                     encoding="utf-8")
    print(f"wrote {TABLE}")
