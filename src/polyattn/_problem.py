"""Validation and normalisation of an attention call into the implementations' form.

:func:`prepare` checks every argument (names, shapes, dtypes, devices), then
broadcasts the batch dimensions, casts to the compute dtype and normalises the
mask, so that every implementation receives the layout documented in
:mod:`polyattn.backends`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from polyattn._interop import (
    Array,
    Namespace,
    check_same_device,
    contiguous,
    device_of,
    library_name,
    namespace_of,
)
from polyattn._masking import call_block_mask, call_segments, function_name, segment_pair
from polyattn._validation import (
    ALIGNMENTS,
    LAYOUTS,
    array_like,
    broadcast_shapes,
    check_bool,
    check_choice,
    check_dropout,
    check_floating,
    check_key_lengths,
    check_known_shape,
    check_min_ndim,
    check_mod_args,
    check_per_head,
    check_scale,
    check_softcap,
    check_window,
    shape_str,
)
from polyattn.blockmask import BlockMask
from polyattn.masks import causal_offset as _causal_offset
from polyattn.masks import normalise_mask
from polyattn.rules.user import UserRules, probe
from polyattn.rules.visibility import Rules

LAYOUT = "(B…, H, T, E)"


@dataclass(frozen=True)
class Problem:
    """An attention call after validation, in the implementations' layout."""

    xp: Namespace
    q: Array                      # (B…, H, Tq, E), compute dtype
    k: Array                      # (B…, Hkv, Tk, E)
    v: Array | None               # (B…, Hkv, Tk, Ev)
    mask: Array | None            # len(B…) + 4 dims, each 1 or full
    rules: Rules                  # causality, window, key lengths, softcap, ALiBi, dropout
    scale: float
    result_dtype: Any             # dtype of the output
    compute_dtype: Any            # float32 or float64
    squeeze: bool                 # inputs were (T, E): drop the (1,) head axis again
    layout: str = "BHTE"          # the caller's layout of query, key, value and out
    sinks: Array | None = None    # (B…|1, H|1), compute dtype: joined by the engine, not backends

    @property
    def batch(self) -> tuple[int, ...]:
        return tuple(self.q.shape[:-3])

    @property
    def num_heads(self) -> int:
        return int(self.q.shape[-3])

    @property
    def tq(self) -> int:
        return int(self.q.shape[-2])

    @property
    def tk(self) -> int:
        return int(self.k.shape[-2])

    @property
    def score_elements(self) -> int:
        """Number of entries of the (B…, H, Tq, Tk) score matrix."""
        return math.prod(self.batch) * self.num_heads * self.tq * self.tk

    @property
    def requires_grad(self) -> bool:
        """Whether torch autograd is recording for one of the inputs (query, key, value,
        the mask, ALiBi's slopes, a rule's ``mod_args``)."""
        user = self.rules.user
        arrays = (self.q, self.k, self.v, self.mask, self.rules.alibi,
                  *(() if user is None else user.mod_args))
        if not any(getattr(x, "requires_grad", False) for x in arrays if x is not None):
            return False
        import torch

        return bool(torch.is_grad_enabled())

    @property
    def on_cuda(self) -> bool:
        """Whether the inputs live on a CUDA device (CuPy, or torch CUDA tensors)."""
        lib = library_name(self.xp)
        return lib == "cupy" or (lib == "torch" and
                                 getattr(device_of(self.q), "type", None) == "cuda")

    @property
    def torch_cpu(self) -> bool:
        """Whether the inputs are plain torch tensors on the CPU, outside compiler tracing.

        Such tensors can be viewed as NumPy arrays without a copy, so the paths
        written for NumPy (its fast path, the kernel on the simulator) can run on them.
        """
        if library_name(self.xp) != "torch":
            return False
        import torch

        if torch.compiler.is_compiling():
            return False
        functorch = getattr(torch._C, "_functorch", None)
        for x in (self.q, self.k, self.v, self.mask):
            if x is None:
                continue
            if type(x) is not torch.Tensor or x.device.type != "cpu" or x.is_sparse:
                return False
            if functorch is not None and functorch.is_functorch_wrapped_tensor(x):
                return False
        return True

    @property
    def jax_cpu(self) -> bool:
        """Whether the inputs are JAX arrays on the CPU (traced ones: where JAX places
        computations by default), which :mod:`polyattn._jax_bridge` hands to the paths
        written for NumPy."""
        if library_name(self.xp) != "jax":
            return False
        import jax

        for x in (self.q, self.k, self.v, self.mask):
            if x is None:
                continue
            devices = None if isinstance(x, jax.core.Tracer) else getattr(x, "devices", None)
            platforms = ({d.platform for d in devices()} if devices is not None
                         else {jax.default_backend()})
            if platforms != {"cpu"}:
                return False
        return True

    @property
    def constant_needing_grad(self) -> str | None:
        """The argument among ``attn_mask`` and ``alibi_slopes`` that torch records a
        gradient for (``None``: neither). The fused backward passes give gradients for
        query, key and value only."""
        if not self.requires_grad:
            return None
        alibi = self.rules.alibi
        for name, x in (("attn_mask", self.mask), ("alibi_slopes", alibi)):
            if x is not None and getattr(x, "requires_grad", False):
                return name
        return None

    def features(self) -> dict[str, str]:
        """The position and score keywords in use, for people (``explain()``)."""
        rules = self.rules
        lengths = rules.key_lengths
        found = {"window": rules.window, "softcap": rules.softcap,
                 "alibi_slopes": None if rules.alibi is None else tuple(rules.alibi.shape),
                 "dropout_p": f"{rules.dropout_p} (seed {rules.dropout_seed})"
                 if rules.dropout else None,
                 "sinks": None if self.sinks is None else
                 f"(B…, H) = {(*self.batch, self.num_heads)}, joined to each row through "
                 "the log-sum-exp",
                 "score_mod": None if rules.user is None or rules.user.score_mod is None
                 else function_name(rules.user.score_mod),
                 "mask_mod": None if rules.user is None or rules.user.mask_mod is None
                 else function_name(rules.user.mask_mod) + (
                     f"; {rules.blocks!r}: the empty tiles are skipped" if rules.blocks
                     is not None else "; no block mask (its values are not at hand): "
                     "evaluated on every tile"),
                 "segment_ids": None if rules.segments is None else
                 f"queries {tuple(rules.segments[0].shape)}, keys "
                 f"{tuple(rules.segments[1].shape)}" + (
                     " (sorted and at hand: key blocks outside each query block's segments "
                     "are skipped)" if rules.segment_keys is not None else
                     " (applied as a mask; no blocks skipped: the ids are not at hand or not "
                     "sorted)"),
                 "key_lengths": None if lengths is None else str(tuple(lengths.shape)) + (
                     " (query positions count back from each row's length)"
                     if rules.lengths_shift else "")}
        return {k: str(v) for k, v in found.items() if v is not None}

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments a family's own entry points take: the mask, the rules
        (always given: causality travels in them), the scale and the namespace."""
        return {"mask": self.mask, "rules": self.rules, "scale": self.scale, "xp": self.xp}

    def finish(self, x: Array, trailing: int) -> Array:
        """Undo the (1,) head axis added for (T, E) inputs; ``trailing`` axes follow it."""
        if not self.squeeze:
            return x
        return self.xp.reshape(x, tuple(x.shape[-trailing:]) if trailing else ())

    def finish_out(self, out: Array) -> Array:
        """``out`` (B…, H, Tq, Ev) in the caller's layout.

        For "BTHE" the result is row-major (B…, Tq, H, Ev), so that it reshapes
        to (B…, Tq, H·Ev) without a copy, as the layout's users expect: the
        NumPy fast path and torch's native attention write it in that order
        already; other implementations' results are copied once.
        """
        if self.layout == "BTHE":
            return contiguous(swap_heads_and_time(out, self.xp))      # (B…, Tq, H, Ev)
        return self.finish(out, 2)


def swap_heads_and_time(x: Array, xp: Namespace) -> Array:
    """(…, A, B, F) -> (…, B, A, F): between (B…, T, H, E) and (B…, H, T, E), as a view."""
    nd = x.ndim
    return xp.permute_dims(x, (*range(nd - 3), nd - 2, nd - 3, nd - 1))


def _shapes_error(what: str, a: str, x: Array, b: str, y: Array, detail: str) -> ValueError:
    return ValueError(f"{what} ({a} {shape_str(x)}, {b} {shape_str(y)}); {detail}")


def _gqa_hint(query: Array, kv: list[Array]) -> str:
    """A pointer to ``enable_gqa`` when the head axes look like grouped-query attention."""
    if query.ndim < 3 or any(x.ndim < 3 for x in kv):
        return ""
    h, kv_heads = query.shape[-3], {x.shape[-3] for x in kv}
    if len(kv_heads) == 1 and 1 < (hkv := kv_heads.pop()) < h and h % hkv == 0:
        return (f"for grouped-query attention ({h} query heads sharing {hkv} key/value "
                "heads) pass enable_gqa=True")
    return ""


def prepare(query: Array, key: Array, value: Array | None, *, attn_mask: Array | None,
            is_causal: bool, causal_alignment: str, scale: float | None,
            enable_gqa: bool, layout: str = "BHTE", window: Any = None,
            softcap: Any = None, alibi_slopes: Array | None = None,
            key_lengths: Any = None, dropout_p: Any = 0.0, dropout_seed: Any = None,
            sinks: Array | None = None, segment_ids: Any = None, score_mod: Any = None,
            mask_mod: Any = None, mod_args: Any = (), block_mask: Any = None) -> Problem:
    """Validate an attention call and bring it to the implementations' layout.

    With ``layout="BTHE"`` query, key and value arrive as (B…, T, H, E) and
    are viewed as (B…, H, T, E) (``permute_dims``, no copy); shapes in error
    messages are then those of the views, which the messages say.
    """
    pair = isinstance(segment_ids, (tuple, list))
    segment_ids = segment_pair(segment_ids)
    if block_mask is not None:
        if not isinstance(block_mask, BlockMask):
            raise TypeError("`block_mask` must be a BlockMask from polyattn.block_mask(...); "
                            f"got {type(block_mask).__name__}")
        if mask_mod is None:
            mask_mod = block_mask.mask_mod
            mod_args = mod_args or block_mask.mod_args
    mod_args = check_mod_args(score_mod, mask_mod, mod_args)
    attn_mask, alibi_slopes, key_lengths, sinks, q_ids, k_ids, *mod_args = _lift_to_dask(
        (query, key, value), (attn_mask, alibi_slopes, key_lengths, sinks, *segment_ids,
                              *mod_args))
    arrays = {"query": query, "key": key, "value": value, "attn_mask": attn_mask,
              "alibi_slopes": alibi_slopes, "sinks": sinks,
              "segment_ids": q_ids, "segment_ids (keys)": k_ids,
              **{f"mod_args[{i}]": a for i, a in enumerate(mod_args)},
              "key_lengths": key_lengths if array_like(key_lengths) else None}
    for name, x in arrays.items():
        check_known_shape(name, x)
    xp = namespace_of(arrays)
    check_same_device(arrays)
    extras = {"window": check_window(window), "softcap": check_softcap(softcap),
              "alibi_slopes": alibi_slopes, "key_lengths": key_lengths,
              "dropout": check_dropout(dropout_p, dropout_seed), "sinks": sinks,
              "segment_ids": (q_ids, k_ids, pair),
              "user": UserRules(score_mod, mask_mod, tuple(mod_args))
              if score_mod is not None or mask_mod is not None else None,
              "block_mask": block_mask}
    check_bool("is_causal", is_causal)
    check_bool("enable_gqa", enable_gqa)
    causal_alignment = check_choice("causal_alignment", causal_alignment, ALIGNMENTS)
    layout = check_choice("layout", layout, LAYOUTS)
    named = {"query": query, "key": key, "value": value}
    if layout == "BTHE":
        for name, x in named.items():
            if x is not None:
                check_floating(name, x, xp)
                check_min_ndim(name, x, 3, "(B…, T, H, E) with layout='BTHE'")
        query, key = swap_heads_and_time(query, xp), swap_heads_and_time(key, xp)
        value = None if value is None else swap_heads_and_time(value, xp)
    try:
        return _prepare(xp, query, key, value, attn_mask, is_causal, causal_alignment, scale,
                        enable_gqa, layout, extras)
    except ValueError as exc:
        if layout == "BHTE" or str(exc).startswith(_ONE_LAYOUT):
            raise
        raise ValueError(f"{exc} (layout='BTHE': the shapes are shown as their "
                         "(B…, H, T, E) views)") from None


def _lift_to_dask(inputs: tuple[Array | None, ...], constants: tuple[Any, ...],
                  ) -> tuple[Any, ...]:
    """NumPy masks, slopes and key lengths as Dask arrays when the inputs are Dask arrays.

    They are small next to the inputs (or broadcast views), and a NumPy array is what
    a Dask user has at hand for them; anything else is returned as it is.
    """
    if not any(type(x).__module__.startswith("dask") for x in inputs if x is not None):
        return constants
    import dask.array as da

    return tuple(da.asarray(c) if type(c).__module__ == "numpy" else c for c in constants)


#: Arguments whose shapes do not depend on the layout (their errors quote them as given).
_ONE_LAYOUT = ("`attn_mask`", "`key_lengths`", "`alibi_slopes`", "`sinks`", "`segment_ids`")


def _prepare(xp: Namespace, query: Array, key: Array, value: Array | None,
             attn_mask: Array | None, is_causal: bool, causal_alignment: str,
             scale: float | None, enable_gqa: bool, layout: str,
             extras: dict[str, Any]) -> Problem:
    """:func:`prepare` once the arrays are (B…, H, T, E) (views for "BTHE")."""
    named = {"query": query, "key": key, "value": value}
    min_ndim = 3 if enable_gqa else 2
    expected = "(B…, H, T, E)" if enable_gqa else "(…, T, E)"
    for name, x in named.items():
        if x is None:
            continue
        check_floating(name, x, xp)
        check_min_ndim(name, x, min_ndim, expected)
    if key.shape[-1] != query.shape[-1]:
        raise _shapes_error(
            f"`key` has {key.shape[-1]} features but `query` has {query.shape[-1]}",
            "query", query, "key", key, "the last axes must match")
    if value is not None and value.shape[-2] != key.shape[-2]:
        raise _shapes_error(
            f"`value` has {value.shape[-2]} positions but `key` has {key.shape[-2]}",
            "key", key, "value", value, "axis -2 (Tk) must match")
    kv = [("key", key)] + ([("value", value)] if value is not None else [])

    # --- leading dimensions: batch B… and heads H / Hkv
    if enable_gqa:
        heads = {name: x.shape[-3] for name, x in kv}
        hkv = heads["key"]
        if value is not None and heads["value"] != hkv:
            raise _shapes_error(
                f"`key` has {hkv} heads but `value` has {heads['value']}",
                "key", key, "value", value, "with enable_gqa=True they must match")
        h = query.shape[-3]
        if hkv == 0 or h % hkv:
            raise _shapes_error(
                f"`query` has {h} heads, not a multiple of the {hkv} key/value heads",
                "query", query, "key", key, "enable_gqa=True needs H % Hkv == 0")
        batch = broadcast_shapes(
            ("query", *[n for n, _ in kv]),
            (tuple(query.shape[:-3]), *[tuple(x.shape[:-3]) for _, x in kv]),
            "batch dimensions", full=(tuple(query.shape), *[tuple(x.shape) for _, x in kv]))
        squeeze = False
    else:
        lead = broadcast_shapes(
            ("query", *[n for n, _ in kv]),
            (tuple(query.shape[:-2]), *[tuple(x.shape[:-2]) for _, x in kv]),
            "leading (batch and head) dimensions",
            full=(tuple(query.shape), *[tuple(x.shape) for _, x in kv]),
            hint=_gqa_hint(query, [x for _, x in kv]))
        squeeze = len(lead) == 0
        lead = lead or (1,)
        batch, h = lead[:-1], lead[-1]
        kv_heads = {x.shape[-3] if x.ndim >= 3 else 1 for _, x in kv}
        hkv = kv_heads.pop() if len(kv_heads) == 1 else h
        hkv = hkv if hkv in (1, h) else h

    # --- dtypes: the standard's promotion; float16 is computed in float32
    floats = [x for x in named.values() if x is not None]
    result_dtype = xp.result_type(*floats)
    compute_dtype = result_dtype if result_dtype in (xp.float32, xp.float64) else xp.float32

    def to_layout(x: Array, heads: int) -> Array:
        shape = (*batch, heads, *x.shape[-2:])
        if tuple(x.shape) != shape:
            x = xp.broadcast_to(x, shape)
        return x if x.dtype == compute_dtype else xp.astype(x, compute_dtype)

    tq, tk = query.shape[-2], key.shape[-2]
    mask = normalise_mask(attn_mask, (*batch, h, tq, tk), compute_dtype, xp)
    bottom_right = causal_alignment == "bottom_right"
    lengths, lengths_at_hand = check_key_lengths(extras["key_lengths"], tuple(batch), tk,
                                                 xp, device_of(query))
    q_ids, k_ids, pair = extras["segment_ids"]
    segments, segment_keys = call_segments(q_ids, k_ids, pair, tuple(batch), tq, tk, xp)
    rules = Rules(
        tq=tq, tk=tk, causal=is_causal, offset=_causal_offset(tq, tk, causal_alignment),
        key_lengths=lengths, lengths_shift=bottom_right and lengths is not None,
        window=extras["window"], softcap=extras["softcap"],
        alibi=check_per_head("alibi_slopes", extras["alibi_slopes"], tuple(batch), h,
                             compute_dtype, xp, "one slope per query head"),
        dropout_p=extras["dropout"][0], dropout_seed=extras["dropout"][1],
        lengths_at_hand=lengths_at_hand, segments=segments, segment_keys=segment_keys,
        user=extras["user"])
    if extras["user"] is not None:
        probe(extras["user"], xp, compute_dtype, device_of(query))
        blocks = call_block_mask(extras["block_mask"], extras["user"], tuple(batch), h, tq, tk, xp,
                         device_of(query))
        if blocks is not None:
            rules = dataclasses.replace(rules, blocks=blocks)
    return Problem(
        xp=xp,
        q=to_layout(query, h),
        k=to_layout(key, hkv),
        v=None if value is None else to_layout(value, hkv),
        mask=mask,
        scale=check_scale(scale, int(query.shape[-1])),
        result_dtype=result_dtype,
        compute_dtype=compute_dtype,
        squeeze=squeeze,
        layout=layout,
        rules=rules,
        sinks=check_per_head("sinks", extras["sinks"], tuple(batch), h, compute_dtype, xp,
                             "one sink logit per query head"),
    )
