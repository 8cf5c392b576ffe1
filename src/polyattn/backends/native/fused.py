"""The input library's own fused attention, where it expresses the call exactly.

torch tensors run :func:`torch.nn.functional.scaled_dot_product_attention`;
JAX arrays run :func:`jax.nn.dot_product_attention`. Both differentiate
through their library's autodiff (torch autograd; ``jax.grad``, ``jax.vjp``,
``jax.jit``, ``jax.vmap``). :func:`unavailable` says, for one call, why the
native function cannot run it exactly (or ``None`` when it can); the
dispatcher then takes the next implementation, and an explicit
``implementation="native"`` raises with that reason.

How each part of polyattn's contract (docs/semantics.rst, "dtypes") is kept:

* **Causal alignment.** Both libraries' ``is_causal`` is top-left (query i
  sees keys j <= i), which is ``Rules.causal_offset == 0``. Any other
  offset (``"bottom_right"`` with Tq != Tk) and a causal mask combined with
  ``attn_mask`` are passed as one explicit boolean or float mask.
* **Fully masked rows** must give 0. torch >= 2.5 returns 0 for them (checked
  on the CPU, forward and gradients); on other devices the rows are set to 0
  afterwards. JAX replaces hidden scores by a large finite negative number, so
  such a row would average every value: the rows that see no key are found
  from the mask and set to 0. A float mask's ``-inf`` entries become a
  boolean mask (and 0 in the bias) so that JAX's scores stay finite and its
  gradients too.
* **Precision.** JAX computes the softmax in float32 whatever the input, so
  float64 JAX arrays are not run natively (docs/semantics.rst); float32 products run at
  ``"highest"`` matmul precision (no TF32 or bfloat16 passes on GPUs).
* **Windows, key lengths, ALiBi** become one dense mask (bool, or float with
  the ALiBi bias); the rules no mask expresses are refused, each with its
  reason (``REFUSED`` in :mod:`polyattn.backends.native`).
* **Non-finite queries.** torch's fused CPU kernel reports a query row holding
  NaN as 0, as if the row were fully masked; NaN never disappears (docs/semantics.rst), so
  the row sum of ``0·q`` (NaN for a row holding NaN or inf, else exactly 0) is
  added to the output, on both libraries. Gradients change by ``0·grad``.
* **lse.** Neither public function returns the log-sum-exp with gradients
  (JAX's ``return_residual`` stops them), so ``return_lse=True`` is not
  native.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from polyattn._interop import device_of, library_name
from polyattn.rules.online import NEG_INF, non_finite_rows
from polyattn.rules.visibility import Rules, drop_padding, fold_into_mask, positions, visible

Array = Any

#: The oldest torch whose SDPA takes ``enable_gqa`` and returns 0 for fully masked rows.
MIN_TORCH = (2, 5)


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def unavailable(xp: Any, q: Array, k: Array, v: Array | None, *, return_lse: bool,
                rules: Rules, refused: Mapping[str, str]) -> str | None:
    """Why the native attention cannot run this call exactly; ``None`` when it can.

    ``q``, ``k``, ``v`` are the implementations' (B…, H, T, E) arrays in the
    compute dtype. ``refused`` maps the rules the native functions cannot express to
    the reason, with ``{name}`` for the function's name; the first in use is given.
    """
    lib = library_name(xp)
    if lib == "torch":
        name = "torch.nn.functional.scaled_dot_product_attention"
        if _torch_version() < MIN_TORCH:
            return (f"{name} in torch < {'.'.join(map(str, MIN_TORCH))} lacks enable_gqa "
                    "and may return NaN for fully masked rows")
    elif lib == "jax":
        name = "jax.nn.dot_product_attention"
        if q.dtype == xp.float64:
            return f"{name} computes the softmax in float32, which would downcast float64"
        if v is not None and v.shape[-1] != k.shape[-1]:
            return (f"{name} needs values with as many features as the keys "
                    f"(key {tuple(k.shape)}, value {tuple(v.shape)})")
    else:
        return f"{lib} has no native attention function that polyattn uses"
    used = rules.in_use()
    for rule, why in refused.items():
        if rule in used:
            return why.format(name=name)
    if return_lse:
        return (f"return_lse=True: {name} does not return the log-sum-exp"
                + (" with its gradients (return_residual stops them)" if lib == "jax" else ""))
    return None


def attention(q: Array, k: Array, v: Array, /, *, mask: Array | None, rules: Rules,
              scale: float, xp: Any) -> tuple[Array, None]:
    """Run the native attention; returns ``(out, None)`` (no log-sum-exp).

    Call :func:`unavailable` first: this function assumes the call maps exactly.
    Rules beyond a causal mask (windows, key lengths, ALiBi) are folded into one
    dense mask (which is what both libraries build for them anyway); a causal mask
    alone is the library's ``is_causal`` where it is top-left and no mask is given.
    """
    if not rules.simple:
        mask = fold_into_mask(rules, mask, k.shape[-3], xp, q.dtype, device_of(q))
        k, v = drop_padding(k, rules, xp), drop_padding(v, rules, xp)
        rules = Rules(rules.tq, rules.tk)                # all in the mask now
    run = _torch if library_name(xp) == "torch" else _jax
    out = run(q, k, v, mask, rules, scale, xp)
    # torch's fused CPU kernel reports a query row holding NaN as 0, like a fully masked
    # row: NaN never disappears (docs/semantics.rst). Adds exactly 0 to finite rows, and 0·grad
    # to their gradients.
    return out + non_finite_rows(q, xp), None


def _with_causal(mask: Array | None, rules: Rules, xp: Any, device: Any) -> Array | None:
    """``mask`` with the causal rule of ``rules`` (causal only) folded in (bool: and; float:
    -inf where hidden)."""
    allowed = visible(rules, 0, rules.tq, 0, rules.tk, xp, device)      # (Tq, Tk)
    if allowed is None:
        return mask
    if mask is None:
        return allowed
    if mask.dtype == xp.bool:
        return xp.logical_and(mask, allowed)
    return xp.where(allowed, mask, NEG_INF)


def _visible_rows(mask: Array | None, rules: Rules, xp: Any, device: Any) -> Array | None:
    """Bool (…, Tq, 1): whether each row sees a key; ``None`` when every row does.

    ``mask`` is the boolean mask with the causal rule of ``rules`` already folded in.
    """
    if mask is not None:
        return xp.any(mask, axis=-1, keepdims=True)
    offset = rules.causal_offset
    if offset is not None and offset < 0:                                # Tq > Tk, bottom-right
        return positions(rules, 0, rules.tq, xp, device) >= 0             # (Tq, 1): p_i >= 0
    return None


# --- torch ----------------------------------------------------------------------------------

def _torch(q: Array, k: Array, v: Array, mask: Array | None, rules: Rules, scale: float,
           xp: Any) -> Array:
    import torch.nn.functional as F

    dev = device_of(q)
    is_causal = rules.causal_offset == 0 and mask is None
    attn_mask = mask if is_causal else _with_causal(mask, rules, xp, dev)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                         scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])
    if getattr(dev, "type", "cpu") != "cpu":
        # torch returns 0 for rows that see no key on the CPU (checked); elsewhere make sure
        hidden = attn_mask if attn_mask is None or attn_mask.dtype == xp.bool else (
            attn_mask != NEG_INF)
        visible = None if is_causal else _visible_rows(hidden, rules, xp, dev)
        if visible is not None:
            out = xp.where(visible, out, 0.0)
    return out


# --- JAX ------------------------------------------------------------------------------------

def _jax(q: Array, k: Array, v: Array, mask: Array | None, rules: Rules, scale: float,
         xp: Any) -> Array:
    import jax

    *batch, h, tq, _ = q.shape
    ev = v.shape[-1]
    flat = math.prod(batch)
    dev = device_of(q)

    def btne(x: Array) -> Array:
        x = xp.reshape(x, (flat, *x.shape[-3:]))                        # (B, N, T, F)
        return xp.permute_dims(x, (0, 2, 1, 3))                          # (B, T, N, F)

    # --- masks: booleans (JAX's), a finite float bias, the causal rule
    bias = None
    if mask is not None and mask.dtype != xp.bool:
        hidden = mask == NEG_INF
        bias, mask = xp.where(hidden, 0.0, mask), xp.logical_not(hidden)
    is_causal = rules.causal_offset == 0 and mask is None
    if not is_causal:
        mask = _with_causal(mask, rules, xp, dev)
    visible = None if is_causal else _visible_rows(mask, rules, xp, dev)

    def four_d(x: Array | None) -> Array | None:
        """(B…|1, H|1, Tq|1, Tk|1) -> (B|1, H|1, Tq|1, Tk|1), as JAX needs."""
        if x is None:
            return None
        x = xp.reshape(x, (1,) * (len(batch) + 3 - x.ndim) + tuple(x.shape))
        lead = tuple(x.shape[:-3])
        if math.prod(lead) != 1 and lead != tuple(batch):
            x = xp.broadcast_to(x, (*batch, *x.shape[-3:]))
        n = 1 if math.prod(lead) == 1 else flat
        return xp.reshape(x, (n, *x.shape[-3:]))

    with jax.default_matmul_precision("highest"):
        out = jax.nn.dot_product_attention(btne(q), btne(k), btne(v), bias=four_d(bias),
                                           mask=four_d(mask), scale=scale,
                                           is_causal=is_causal)          # (B, Tq, H, Ev)
    out = xp.reshape(xp.permute_dims(out, (0, 2, 1, 3)), (*batch, h, tq, ev))  # (B…, H, Tq, Ev)
    if visible is not None:
        out = xp.where(visible, out, 0.0)
    return out
