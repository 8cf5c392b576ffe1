"""Rotary position embedding (RoPE; Su et al. 2021).

Each pair of features of a query or key is rotated by the angle
``p · θ_i`` with ``θ_i = base^(-2i/rotary_dim)``, where ``p`` is the token's
position. A query at position ``m`` and a key at position ``n`` then have a
dot product that depends on the positions only through ``m - n``.

Two layouts of the pairs are in use:

- ``interleaved=False`` (Llama, GPT-NeoX, transformers' ``rotate_half``):
  feature ``i`` pairs with feature ``i + rotary_dim/2``;
- ``interleaved=True`` (GPT-J, the RoFormer paper): feature ``2i`` pairs
  with ``2i + 1``.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from polyattn._interop import (
    Array,
    Namespace,
    check_same_device,
    default_float_dtype,
    device_of,
    namespace_of,
    resolve_xp,
)
from polyattn._validation import (
    check_bool,
    check_float_dtype,
    check_floating,
    check_nonnegative_int,
    shape_str,
)
from polyattn.rules.online import quiet_floating_point


def apply_rotary_embedding(x: Array, positions: Array, /, *, base: float = 10000.0,
                           interleaved: bool = False, rotary_dim: int | None = None,
                           inv_freq: Array | None = None,
                           attention_factor: float = 1.0) -> Array:
    """Rotate the features of ``x`` by the angles of its tokens' positions (RoPE).

    For each pair ``(a, b)`` of rotated features and frequency
    ``θ_i = base^(-2i/rotary_dim)``, ``i = 0 … rotary_dim/2 - 1``::

        a' = a·cos(p·θ_i) - b·sin(p·θ_i)
        b' = b·cos(p·θ_i) + a·sin(p·θ_i)

    With ``interleaved=False`` the pairs are ``(x[i], x[i + rotary_dim/2])``:
    the result equals transformers'
    ``apply_rotary_pos_emb`` (``x·cos + rotate_half(x)·sin``) of the Llama
    models. With ``interleaved=True`` they are ``(x[2i], x[2i+1])``, as GPT-J's
    ``rotate_every_two``. Features from ``rotary_dim`` on pass through
    unchanged (GPT-NeoX's partial rotary).

    Context-extended models (Llama 3.1's ``"llama3"``, YaRN, linear
    interpolation) change the frequencies: pass them as ``inv_freq``, made
    by :func:`rotary_frequencies` from the model's configuration, with its
    ``attention_factor`` (YaRN's), which multiplies the rotated features as
    transformers multiplies its ``cos`` and ``sin``.

    Parameters
    ----------
    x : array (…, T, E)
        Queries or keys, real floating. Any leading axes, e.g. (B, H, T, E)
        or (B, T, H, E).
    positions : integer array
        The position of each token, broadcastable to ``x.shape[:-1]``
        without growing it: (T,) for one sequence, (B, 1, T) for (B, H, T, E)
        inputs whose rows start at different positions, (B, T, 1) for
        (B, T, H, E) inputs. When decoding with a cache, the new token of
        row ``b`` has position ``cache.lengths[b]`` (before the update).
    base : float
        The frequency base (10000 in the paper and Llama 2; models set their
        own, e.g. ``rope_theta`` in a transformers config).
    interleaved : bool
        Pair adjacent features (GPT-J) instead of the two halves (Llama).
    rotary_dim : int, optional
        How many leading features are rotated (even, at most E); default E.
    inv_freq : array (rotary_dim/2,), optional
        The frequencies ``θ_i`` themselves, real floating, of ``x``'s
        namespace and device (e.g. from :func:`rotary_frequencies`); then
        ``base`` must be left at its default. They are cast to the dtype the
        angles are computed in (below).
    attention_factor : float
        Multiplies the rotated features (``cos`` and ``sin``); 1 (default)
        but for YaRN. Features past ``rotary_dim`` are not multiplied.

    Returns
    -------
    array
        Same shape, dtype, namespace and device as ``x``. float16 and
        bfloat16 are computed in float32 and cast back; float32 is computed
        in float32 (as transformers does); float64 in float64.

    Raises
    ------
    TypeError
        ``positions`` not of an integer dtype, ``x`` not real floating.
    ValueError
        ``rotary_dim`` odd, not positive or above E; E odd without
        ``rotary_dim``; ``positions`` not broadcastable to ``x.shape[:-1]``;
        ``inv_freq`` not of shape (rotary_dim/2,), or given with ``base``;
        ``attention_factor`` not a positive finite number.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import apply_rotary_embedding
    >>> x = np.ones((3, 4))                            # (T, E)
    >>> apply_rotary_embedding(x, np.arange(3)).round(3)
    array([[ 1.   ,  1.   ,  1.   ,  1.   ],
           [-0.301,  0.99 ,  1.382,  1.01 ],
           [-1.325,  0.98 ,  0.493,  1.02 ]])

    The dot product of a rotated query and key depends on their distance:

    >>> rng = np.random.default_rng(0)
    >>> q, k = rng.standard_normal((2, 8))
    >>> def score(m, n):
    ...     return apply_rotary_embedding(q, np.array(m)) @ apply_rotary_embedding(k, np.array(n))
    >>> bool(np.isclose(score(5, 2), score(103, 100)))
    True

    Llama 3.1's frequencies, from its ``rope_scaling``:

    >>> from polyattn import rotary_frequencies
    >>> theta, factor = rotary_frequencies(8, base=500000.0, scaling={
    ...     "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
    ...     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    >>> y = apply_rotary_embedding(x, np.arange(3), inv_freq=theta[:2],
    ...                            attention_factor=factor)
    >>> y.shape
    (3, 4)
    """
    with quiet_floating_point(x):         # non-finite inputs: the values say so, no warning
        arrays = {"x": x, "positions": positions}
        if inv_freq is not None:
            arrays["inv_freq"] = inv_freq
        xp = namespace_of(arrays)
        check_same_device(arrays)
        check_floating("x", x, xp)
        if not xp.isdtype(positions.dtype, "integral"):
            raise TypeError(f"`positions` must have an integer dtype (one position per token); "
                            f"got {positions.dtype} of shape {shape_str(positions)}")
        check_bool("interleaved", interleaved)
        if isinstance(base, bool) or not isinstance(base, numbers.Real):
            raise TypeError(f"`base` must be a real number; got {base!r}")
        if not 0 < base < math.inf:
            raise ValueError(f"`base` must be a positive finite number; got {base!r}")
        if isinstance(attention_factor, bool) or not isinstance(attention_factor, numbers.Real):
            raise TypeError(f"`attention_factor` must be a real number; got {attention_factor!r}")
        if not 0 < attention_factor < math.inf:
            raise ValueError(f"`attention_factor` must be a positive finite number; got "
                             f"{attention_factor!r}")
        if x.ndim < 1:
            raise ValueError(f"`x` must have at least 1 dimension (…, T, E); got shape "
                             f"{shape_str(x)}")
        e = int(x.shape[-1])
        rd = _rotary_dim(rotary_dim, e, x)
        tokens = tuple(x.shape[:-1])
        fits = positions.ndim <= len(tokens) and all(
            s in (1, t) for s, t in zip(reversed(positions.shape), reversed(tokens), strict=False))
        if not fits:
            raise ValueError(
                f"`positions` of shape {shape_str(positions)} does not broadcast to "
                f"x.shape[:-1] = {tokens} (x {shape_str(x)}); one position per token, e.g. (T,), "
                "or (B, 1, T) for (B, H, T, E) inputs")

        # float64 stays float64; float16/bfloat16 are computed in float32
        work = xp.float64 if x.dtype == xp.float64 else xp.float32
        half = rd // 2
        dev = device_of(x)
        if inv_freq is None:
            two_i = xp.arange(0, rd, 2, dtype=work, device=dev)                   # (rd/2,)
            theta = 1.0 / xp.pow(xp.asarray(float(base), dtype=work, device=dev),
                                 two_i / rd)                                       # base^(-2i/rd)
        else:
            theta = _checked_inv_freq(inv_freq, base, half, xp, work)             # (rd/2,)
        angles = xp.expand_dims(xp.astype(positions, work), axis=-1) * theta     # (P…, rd/2)
        cos, sin = xp.cos(angles), xp.sin(angles)
        if attention_factor != 1.0:
            cos, sin = cos * float(attention_factor), sin * float(attention_factor)

        rotated = x[..., :rd] if rd < e else x
        if rotated.dtype != work:
            rotated = xp.astype(rotated, work)
        if interleaved:
            pairs = xp.reshape(rotated, (*rotated.shape[:-1], half, 2))          # (…, T, rd/2, 2)
            a, b = pairs[..., 0], pairs[..., 1]
        else:
            a, b = rotated[..., :half], rotated[..., half:]                       # (…, T, rd/2)
        a2 = a * cos - b * sin
        b2 = b * cos + a * sin
        if interleaved:
            out = xp.stack([a2, b2], axis=-1)                                     # (…, T, rd/2, 2)
            out = xp.reshape(out, (*out.shape[:-2], rd))                          # (…, T, rd)
        else:
            out = xp.concat([a2, b2], axis=-1)                                    # (…, T, rd)
        if out.dtype != x.dtype:
            out = xp.astype(out, x.dtype)
        if rd < e:
            out = xp.concat([out, x[..., rd:]], axis=-1)                          # (…, T, E)
        return out


def _checked_inv_freq(inv_freq: Array, base: float, half: int, xp: Any, work: Any) -> Array:
    """``inv_freq`` checked (floating, (rotary_dim/2,), no ``base`` beside it), in ``work``."""
    if base != 10000.0:
        raise ValueError(f"give either `base` ({base!r}) or `inv_freq`, not both: `inv_freq` "
                         "holds the frequencies that `base` would make")
    if not xp.isdtype(inv_freq.dtype, "real floating"):
        raise TypeError(f"`inv_freq` must be real floating; got {inv_freq.dtype}")
    if tuple(inv_freq.shape) != (half,):
        raise ValueError(f"`inv_freq` must have shape ({half},), one frequency per rotated "
                         f"pair (rotary_dim / 2); got {shape_str(inv_freq)}")
    return inv_freq if inv_freq.dtype == work else xp.astype(inv_freq, work)


def _rotary_dim(rotary_dim: object, e: int, x: Array) -> int:
    """The number of rotated features: E by default; even, in [2, E]."""
    if rotary_dim is None:
        if e % 2:
            raise ValueError(f"`x` has an odd number of features, {e} (x {shape_str(x)}): "
                             "features are rotated in pairs; pass an even `rotary_dim` < "
                             f"{e} to rotate only the first ones")
        return e
    rd = check_nonnegative_int("rotary_dim", rotary_dim, minimum=1)
    if rd % 2 or rd > e:
        raise ValueError(f"`rotary_dim` must be even and at most the {e} features of `x` "
                         f"(x {shape_str(x)}); got {rd}")
    return rd


#: The keys each ``rope_type`` of :func:`rotary_frequencies` reads (True: required).
_SCALING_KEYS: dict[str, dict[str, bool]] = {
    "default": {},
    "linear": {"factor": True},
    "llama3": {"factor": True, "low_freq_factor": True, "high_freq_factor": True,
               "original_max_position_embeddings": True},
    "yarn": {"factor": True, "original_max_position_embeddings": True,
             "attention_factor": False, "beta_fast": False, "beta_slow": False,
             "mscale": False, "mscale_all_dim": False, "truncate": False},
}
#: Keys of a transformers ``rope_parameters`` mapping that other arguments stand for.
_IGNORED_KEYS = ("rope_type", "type", "rope_theta", "partial_rotary_factor")


def rotary_frequencies(rotary_dim: int, /, *, base: float = 10000.0,
                       scaling: Mapping[str, Any] | None = None, xp: Namespace = None,
                       dtype: Any = None, device: Any = None) -> tuple[Array, float]:
    """The frequencies of RoPE, context-extension scaling included, and its attention factor.

    Plain RoPE rotates pair ``i`` by ``p · θ_i`` with
    ``θ_i = base^(-2i/rotary_dim)``. Models trained to read longer contexts
    than they were pre-trained on rescale the ``θ_i`` (and YaRN the rotated
    features). ``scaling`` is that rescaling as a transformers configuration
    writes it (its ``rope_scaling``, or ``rope_parameters`` since
    transformers 5), and the formulas are those of transformers'
    ``ROPE_INIT_FUNCTIONS``, computed in float64:

    - ``"default"`` (or ``scaling=None``): ``θ_i`` as above; factor 1.
    - ``"linear"`` (position interpolation): ``θ_i / factor``.
    - ``"llama3"`` (Llama 3.1): wavelengths ``2π/θ_i`` longer than
      ``original_max_position_embeddings / low_freq_factor`` are divided by
      ``factor``, those shorter than ``… / high_freq_factor`` kept, and
      those between interpolated smoothly.
    - ``"yarn"`` (YaRN; gpt-oss, Qwen's long-context configurations): a
      ramp between interpolated and original frequencies over the pairs
      that turn between ``beta_slow`` (default 1) and ``beta_fast`` (32)
      times within ``original_max_position_embeddings`` (bounds rounded
      outwards unless ``truncate`` is false); the attention factor is
      ``attention_factor`` if given, else ``0.1·ln(factor) + 1`` (with
      ``mscale`` and ``mscale_all_dim``, the ratio of the two such terms).

    Parameters
    ----------
    rotary_dim : int
        Rotated features per head (even): the head size, or less for partial
        rotary.
    base : float
        The frequency base (``rope_theta``).
    scaling : mapping, optional
        ``rope_type`` (or the older ``type``) and that type's keys, above.
        ``rope_theta`` and ``partial_rotary_factor`` may be present and are
        not read (``base`` and ``rotary_dim`` say them); any other key is an
        error, as is a missing one.
    xp : namespace, optional
        The library of the result (default NumPy).
    dtype : optional
        Its real floating dtype (default: the library's default).
    device : optional
        Its device.

    Returns
    -------
    inv_freq : array (rotary_dim/2,)
        The ``θ_i``, for :func:`apply_rotary_embedding`'s ``inv_freq``.
    attention_factor : float
        For :func:`apply_rotary_embedding`'s ``attention_factor``: 1 but for
        YaRN.

    Raises
    ------
    ValueError
        ``rotary_dim`` odd or below 2; ``base`` not positive and finite; an
        unknown ``rope_type`` (``"dynamic"`` and ``"longrope"``, which depend
        on the sequence's length, are not implemented), a key missing,
        unknown or out of range.
    TypeError
        ``scaling`` not a mapping, or a value not a number.

    Examples
    --------
    >>> from polyattn import rotary_frequencies
    >>> theta, factor = rotary_frequencies(4, base=100.0)
    >>> theta, factor
    (array([1. , 0.1]), 1.0)
    >>> rotary_frequencies(4, base=100.0, scaling={"rope_type": "linear", "factor": 2.0})[0]
    array([0.5 , 0.05])
    >>> theta, factor = rotary_frequencies(64, base=150000.0, scaling={
    ...     "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    ...     "original_max_position_embeddings": 4096, "truncate": False})
    >>> round(factor, 6)                                # 0.1 · ln 32 + 1
    1.346574
    """
    rd = check_nonnegative_int("rotary_dim", rotary_dim, minimum=2)
    if rd % 2:
        raise ValueError(f"`rotary_dim` must be even (features are rotated in pairs); got {rd}")
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not 0 < base < math.inf:
        raise ValueError(f"`base` must be a positive finite number; got {base!r}")
    theta, factor = _scaled_frequencies(rd, float(base), _rope_parameters(scaling))
    xp = resolve_xp(xp)
    dtype = (default_float_dtype(xp, device) if dtype is None
             else check_float_dtype("dtype", dtype, xp))
    return xp.asarray(theta, dtype=dtype, device=device), factor


def _rope_parameters(scaling: Mapping[str, Any] | None) -> tuple[str, dict[str, Any]]:
    """``scaling`` checked: its type and that type's keys."""
    if scaling is None:
        return "default", {}
    if not isinstance(scaling, Mapping):
        raise TypeError(f"`scaling` must be a mapping such as {{'rope_type': 'linear', "
                        f"'factor': 2.0}}, or None; got {type(scaling).__name__}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in _SCALING_KEYS:
        raise ValueError(f"`scaling` has rope_type {kind!r}, which is not implemented; "
                         f"implemented: {', '.join(repr(k) for k in _SCALING_KEYS)}")
    keys = _SCALING_KEYS[kind]
    unknown = sorted(set(scaling) - set(keys) - set(_IGNORED_KEYS))
    if unknown:
        raise ValueError(f"`scaling` of rope_type {kind!r} has unknown keys {unknown}; it "
                         f"reads {sorted(keys) or 'none'}")
    missing = sorted(k for k, required in keys.items()
                     if required and scaling.get(k) is None)
    if missing:
        raise ValueError(f"`scaling` of rope_type {kind!r} lacks {missing}")
    params = {k: scaling[k] for k in keys if scaling.get(k) is not None}
    for k, v in params.items():
        if k == "truncate":
            if not isinstance(v, bool):
                raise TypeError(f"`scaling['truncate']` must be a bool; got {v!r}")
        elif isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"`scaling[{k!r}]` must be a number; got {v!r}")
        elif not 0 < float(v) < math.inf:
            raise ValueError(f"`scaling[{k!r}]` must be a positive finite number; got {v!r}")
    if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
        raise ValueError(f"`scaling['high_freq_factor']` ({params['high_freq_factor']}) must "
                         f"be above `scaling['low_freq_factor']` ({params['low_freq_factor']})")
    return kind, params


def _scaled_frequencies(rd: int, base: float, kind_params: tuple[str, dict[str, Any]]
                        ) -> tuple[list[float], float]:
    """The ``θ_i`` and the attention factor, in Python floats (float64)."""
    kind, p = kind_params
    theta = [1.0 / base ** (i / rd) for i in range(0, rd, 2)]
    if kind == "linear":
        return [t / p["factor"] for t in theta], 1.0
    if kind == "llama3":
        factor, old = float(p["factor"]), float(p["original_max_position_embeddings"])
        low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
        out = []
        for t in theta:
            wavelen = 2 * math.pi / t
            if wavelen < old / high:            # high frequencies: kept
                out.append(t)
            elif wavelen > old / low:           # low frequencies: interpolated
                out.append(t / factor)
            else:                               # between: a smooth mix of the two
                smooth = (old / wavelen - low) / (high - low)
                out.append((1 - smooth) * t / factor + smooth * t)
        return out, 1.0
    if kind == "yarn":
        return _yarn(rd, base, theta, p)
    return theta, 1.0


def _yarn(rd: int, base: float, theta: list[float], p: dict[str, Any]
          ) -> tuple[list[float], float]:
    """YaRN's frequencies and attention factor (transformers' ``_compute_yarn_parameters``)."""
    factor, old = float(p["factor"]), float(p["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = p.get("attention_factor")
    if attention is None:
        if p.get("mscale") and p.get("mscale_all_dim"):
            attention = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return rd * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(p.get("beta_fast", 32)), correction_dim(p.get("beta_slow", 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rd - 1)
    if low == high:
        high += 0.001                                   # no division by zero
    out = []
    for i, t in enumerate(theta):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation = 1.0 - ramp                      # the share of the original θ_i
        out.append(t / factor * (1 - extrapolation) + t * extrapolation)
    return out, float(attention)
