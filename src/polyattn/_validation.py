"""Shape, dtype and device checks shared by the public functions.

Only ``.shape``, ``.dtype`` and ``.device`` are looked at here, never values,
so every check is cheap and works on lazy (Dask) and traced (JAX) arrays.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

from polyattn._interop import Array, Namespace, concrete_values, library_name

IMPLEMENTATIONS = ("auto", "native", "reference", "chunked", "numba_cuda", "distributed",
                   "numba_cpu")
ALIGNMENTS = ("top_left", "bottom_right")
#: The widest window side kept as given: 2^62 reaches past any sequence, and positions
#: (64-bit integers) plus or minus it do not overflow.
WINDOW_SIDE_MAX = 2**62
#: "BHTE": (B…, H, T, E), as torch; "BTHE": (B…, T, H, E), as JAX, Flax, Keras, FlashAttention.
LAYOUTS = ("BHTE", "BTHE")


def shape_str(x: Array) -> str:
    """``(2, 8, 16, 4)`` for an array's shape, as used in error messages."""
    return str(tuple(int(n) if n is not None else n for n in x.shape))


#: The real floating dtypes polyattn computes with (docs/semantics.rst, "dtypes"), where
#: the library has them.
FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")


def supported_floats(xp: Namespace) -> list[Any]:
    """The dtypes of :data:`FLOAT_NAMES` that namespace ``xp`` has."""
    return [getattr(xp, n) for n in FLOAT_NAMES if getattr(xp, n, None) is not None]


def is_supported_float(dtype: Any, xp: Namespace) -> bool:
    """Whether ``dtype`` is one of :func:`supported_floats` (``longdouble``, float8, … are not:
    no path computes them at their own precision)."""
    try:
        return any(bool(dtype == d) for d in supported_floats(xp))
    except Exception:          # not comparable with this library's dtypes
        return False


def floats_text(xp: Namespace) -> str:
    """The accepted dtypes in words: ``float16, bfloat16, float32 or float64``, or those of
    them the library has, saying which it lacks (bfloat16 is always named)."""
    have = [n for n in FLOAT_NAMES if getattr(xp, n, None) is not None]
    text = ", ".join(have[:-1]) + f" or {have[-1]}" if len(have) > 1 else "".join(have)
    missing = [n for n in FLOAT_NAMES[:2] if n not in have]
    if missing:
        text += f"; {library_name(xp)} has no {' or '.join(missing)}"
    return text


def _unsupported_float(dtype: Any, xp: Namespace) -> bool:
    """Whether ``dtype`` is floating but not one of :func:`supported_floats` (float128, …)."""
    try:
        return bool(xp.isdtype(dtype, "real floating"))
    except Exception:
        return False


def _dtype_text(dtype: Any) -> str:
    """``numpy.longdouble`` for a scalar type, else the dtype's repr."""
    if isinstance(dtype, type):
        return f"{dtype.__module__}.{dtype.__name__}"
    return repr(dtype)


def check_floating(name: str, x: Array, xp: Namespace) -> None:
    """``TypeError`` unless ``x`` has one of the real floating dtypes polyattn computes with."""
    if not is_supported_float(x.dtype, xp):
        hint = (f"; no implementation computes {x.dtype} at its own precision: cast `{name}` "
                "to one of those first" if _unsupported_float(x.dtype, xp) else "")
        raise TypeError(
            f"`{name}` must have a real floating dtype ({floats_text(xp)}); "
            f"got {x.dtype} ({library_name(xp)} array of shape {shape_str(x)}){hint}"
        )


def check_float_dtype(name: str, dtype: Any, xp: Namespace) -> Any:
    """``TypeError`` unless ``dtype`` (an argument such as ``dtype=``) is one of
    :func:`supported_floats` of ``xp``; returns it."""
    if not is_supported_float(dtype, xp):
        hint = ("; no implementation computes it at its own precision"
                if _unsupported_float(dtype, xp) else "")
        raise TypeError(f"`{name}` must be a real floating dtype of {library_name(xp)} "
                        f"({floats_text(xp)}); got {_dtype_text(dtype)}{hint}")
    return dtype


def check_min_ndim(name: str, x: Array, ndim: int, layout: str) -> None:
    """``ValueError`` unless ``x`` has at least ``ndim`` dimensions."""
    if x.ndim < ndim:
        raise ValueError(
            f"`{name}` must have at least {ndim} dimensions {layout}; "
            f"got shape {shape_str(x)}"
        )


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> str:
    """``ValueError`` unless ``value`` is one of ``choices``."""
    if not isinstance(value, str) or value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"`{name}` must be one of {options}; got {value!r}")
    return value


def check_bool(name: str, value: object) -> bool:
    """``TypeError`` unless ``value`` is a Python bool."""
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be True or False; got {value!r}")
    return value


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale: ``1/sqrt(E)`` by default, else a finite real number."""
    if scale is None:
        if head_dim == 0:
            raise ValueError(
                "`query` and `key` have 0 features, so the default scale 1/sqrt(E) is "
                "undefined; pass `scale` explicitly"
            )
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"`scale` must be a real number or None; got {scale!r}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"`scale` must be finite; got {scale!r}")
    return float(scale)


def check_nonnegative_int(name: str, value: object, *, minimum: int = 0) -> int:
    """``TypeError`` for a non-integer, ``ValueError`` below ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an integer; got {value!r}")
    if value < minimum:
        raise ValueError(f"`{name}` must be at least {minimum}; got {value}")
    return int(value)


def broadcast_shapes(names: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
                     what: str, *, full: tuple[tuple[int, ...], ...] | None = None,
                     hint: str = "") -> tuple[int, ...]:
    """Broadcast ``shapes`` by the standard's rules, naming the culprits on failure.

    ``full`` are the arguments' whole shapes, quoted in the message; ``hint``
    is appended to it.
    """
    ndim = max([0, *(len(s) for s in shapes)])  # (no default=: torch.compile traces this)
    out: list[int] = []
    for axis in range(-ndim, 0):
        size = 1
        for s in shapes:
            n = s[axis] if -axis <= len(s) else 1
            if n != 1:
                if size not in (1, n):
                    parts = ", ".join(f"{nm} {tuple(sh)}"
                                      for nm, sh in zip(names, shapes, strict=True))
                    detail = ", ".join(f"{nm} {tuple(sh)}"
                                       for nm, sh in zip(names, full or shapes, strict=True))
                    what_of = f"the {what} of {', '.join(names)}"
                    raise ValueError(
                        f"{what_of} do not broadcast: {parts}"
                        + (f" (shapes {detail})" if full is not None else "")
                        + (f"; {hint}" if hint else ""))
                size = n
        out.append(size)
    return tuple(out)


def check_broadcastable_to(name: str, x: Array, target: tuple[int, ...], target_desc: str) -> None:
    """``ValueError`` unless ``x`` broadcasts to ``target`` without growing it."""
    ok = x.ndim <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(x.shape), reversed(target), strict=False)
    )
    if not ok:
        raise ValueError(
            f"`{name}` of shape {shape_str(x)} does not broadcast to {target_desc} "
            f"{tuple(target)}"
        )


def check_window(window: object) -> tuple[int | None, int | None] | None:
    """``(left, right)``, each an int >= 0 or ``None`` (unbounded); ``None`` for no window."""
    if window is None:
        return None
    usage = ("`window` must be (left, right), each an integer >= 0 or None (unbounded), "
             "e.g. (4096, 0) for a causal sliding window of 4097 keys")
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"{usage}; got {window!r}")
    sides: list[int | None] = []
    for side, n in zip(("left", "right"), window, strict=True):
        if n is None:
            sides.append(None)
            continue
        if isinstance(n, bool) or not isinstance(n, numbers.Integral):
            static = ("; a window shapes the computation, so it must be static Python ints "
                      "(under jax.jit: a static argument)" if hasattr(n, "shape") else "")
            raise TypeError(f"{usage}; got {window!r} (its {side} side is "
                            f"{type(n).__name__}){static}")
        if n < 0:
            raise ValueError(f"{usage}; got {window!r} (its {side} side is negative; "
                             "FlashAttention's -1 for an unbounded side is None here)")
        # wider than any sequence is as wide as it: held where positions can add to it
        sides.append(min(int(n), WINDOW_SIDE_MAX))
    return sides[0], sides[1]


def check_softcap(softcap: object) -> float | None:
    """A finite real number > 0, or ``None``."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"`softcap` must be a real number > 0 or None; got {softcap!r}")
    if not (math.isfinite(float(softcap)) and float(softcap) > 0):
        raise ValueError(f"`softcap` must be a finite number > 0 (scores become "
                         f"softcap·tanh(scores/softcap)), or None for no soft-capping "
                         f"(FlashAttention's 0.0); got {softcap!r}")
    return float(softcap)


def check_known_shape(name: str, x: object) -> None:
    """``ValueError`` for an array whose shape is not known (Dask chunks of unknown size)."""
    shape = getattr(x, "shape", None)
    if shape is None or not hasattr(x, "dtype"):
        return
    if any(s is None or (isinstance(s, float) and math.isnan(s)) for s in shape):
        hint = (" (Dask: call .compute_chunk_sizes() on it first)"
                if type(x).__module__.startswith("dask") else "")
        raise ValueError(f"`{name}` has a shape that is not known yet, {tuple(shape)}; "
                         f"attention needs its sizes{hint}")


def check_dropout(p: object, seed: object) -> tuple[float, Array]:
    """``dropout_p`` in [0, 1) and, when it is > 0, ``dropout_seed`` an int in [0, 2⁶⁴)."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"`dropout_p` must be a real number in [0, 1); got {p!r}")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"`dropout_p` must lie in [0, 1) (the probability of dropping a "
                         f"weight); got {p!r}")
    if seed is None:
        if p > 0:
            raise ValueError(f"dropout_p={p!r} needs `dropout_seed` (an int): the mask is "
                             "drawn from counters keyed by it, the same on every backend, "
                             "and the backward pass needs the same seed again")
        return p, 0
    if hasattr(seed, "shape") and hasattr(seed, "dtype") and not isinstance(seed, numbers.Number):
        seed = _seed_array(seed)
        if not isinstance(seed, int):
            return p, seed
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"`dropout_seed` must be an int in [0, 2**64); got "
                        f"{type(seed).__name__} {seed!r}")
    if not 0 <= int(seed) < 2**64:
        raise ValueError(f"`dropout_seed` must lie in [0, 2**64); got {seed!r}")
    return p, int(seed)


def _seed_array(seed: Array) -> Array:
    """A 0-d integer array seed as an int, or as it is where its value is not at hand
    (traced by ``jax.jit``: the mask is then computed from the traced value)."""
    from polyattn._interop import array_namespace, concrete_values

    if tuple(seed.shape) != ():
        raise TypeError(f"`dropout_seed` must be an int or a 0-d integer array; got an array "
                        f"of shape {shape_str(seed)}")
    if not array_namespace(seed).isdtype(seed.dtype, "integral"):
        raise TypeError(f"`dropout_seed` must be an int or a 0-d integer array; got dtype "
                        f"{seed.dtype}")
    values = concrete_values(seed)
    return seed if values is None else int(values)


def array_like(x: object) -> bool:
    """An array (asked by attribute, so that ``torch.compile`` traces it without
    stepping into cached type checks)."""
    return hasattr(x, "shape") and hasattr(x, "dtype")


def check_mod_args(score_mod: Any, mask_mod: Any, mod_args: Any) -> list[Any]:
    """``score_mod`` and ``mask_mod`` callables (or ``None``), ``mod_args`` a sequence of
    arrays; returns the arrays as a list."""
    for name, fn in (("score_mod", score_mod), ("mask_mod", mask_mod)):
        if fn is not None and not callable(fn):
            raise TypeError(f"`{name}` must be a function ({name}(score, b, h, q_idx, kv_idx, "
                            f"*mod_args) or mask_mod(b, h, q_idx, kv_idx, *mod_args)); got "
                            f"{type(fn).__name__}")
    if mod_args is None:
        mod_args = ()
    if array_like(mod_args) or not isinstance(mod_args, (tuple, list)):
        raise TypeError("`mod_args` must be a tuple of arrays (what score_mod and mask_mod "
                        f"receive after the indices); got {type(mod_args).__name__}"
                        + (" (wrap one array as (array,))" if array_like(mod_args) else ""))
    for i, a in enumerate(mod_args):
        if not array_like(a):
            raise TypeError(f"`mod_args[{i}]` must be an array of the inputs' library; got "
                            f"{type(a).__name__}")
        kind = str(a.dtype).split(".")[-1]             # torch.float32 -> float32
        if not kind.startswith(("float", "int", "uint", "bool", "bfloat")):
            raise TypeError(f"`mod_args[{i}]` must have a real floating, integer or boolean "
                            f"dtype; got {kind} (shape {tuple(a.shape)})")
    if mod_args and score_mod is None and mask_mod is None:
        raise ValueError("`mod_args` are the arrays of score_mod and mask_mod; pass one of "
                         "them, or leave mod_args out")
    return list(mod_args)


def check_per_head(name: str, values: Array | None, batch: tuple[int, ...], h: int, dtype: Any,
              xp: Namespace, what: str) -> Array | None:
    """A per-head table (ALiBi slopes, sinks) as (B…|1, H|1) in the compute dtype, checked
    against (B…, H)."""
    if values is None:
        return None
    check_floating(name, values, xp)
    target = (*batch, h)
    ok = values.ndim <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(values.shape), reversed(target), strict=False))
    if not ok:
        raise ValueError(
            f"`{name}` must be one value, (H,) or (B…, H), broadcastable to (B…, H) = {target} "
            f"({what}); got shape {shape_str(values)}")
    values = xp.reshape(values, (1,) * (len(target) - values.ndim) + tuple(values.shape))
    return values if values.dtype == dtype else xp.astype(values, dtype)


def check_key_lengths(lengths: Any, batch: tuple[int, ...], tk: int, xp: Namespace,
                 device: Any) -> tuple[Array | None, Any]:
    """``key_lengths`` as an integer array with ``len(B…)`` dimensions, values checked where
    they are at hand; and those values (NumPy, ``len(B…)`` dimensions) or ``None``."""
    if lengths is None:
        return None, None
    if not array_like(lengths):
        if isinstance(lengths, bool) or not isinstance(lengths, int):
            raise TypeError("`key_lengths` must be an integer array (B…,) or an int; got "
                            f"{type(lengths).__name__} {lengths!r}")
        lengths = xp.asarray(lengths, device=device)
    if not xp.isdtype(lengths.dtype, "integral"):
        raise TypeError(f"`key_lengths` must have an integer dtype (the number of keys of "
                        f"each batch row); got {lengths.dtype} of shape {shape_str(lengths)}")
    ok = lengths.ndim <= len(batch) and all(
        s in (1, t) for s, t in zip(reversed(lengths.shape), reversed(batch), strict=False))
    if not ok:
        raise ValueError(f"`key_lengths` must broadcast to the batch dimensions B… = {batch} "
                         f"(one length per batch row); got shape {shape_str(lengths)}")
    values = concrete_values(lengths)
    if values is not None and values.size and (values.min() < 0 or values.max() > tk):
        raise ValueError(f"`key_lengths` must lie in [0, Tk] = [0, {tk}] (Tk: keys given); "
                         f"got values from {int(values.min())} to {int(values.max())}")
    shape = (1,) * (len(batch) - lengths.ndim) + tuple(lengths.shape)
    return xp.reshape(lengths, shape), None if values is None else values.reshape(shape)
