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

from polyattn._interop import Array, check_same_device, device_of, namespace_of
from polyattn._validation import check_bool, check_floating, check_nonnegative_int, shape_str
from polyattn.rules.online import quiet_floating_point


def apply_rotary_embedding(x: Array, positions: Array, /, *, base: float = 10000.0,
                           interleaved: bool = False, rotary_dim: int | None = None) -> Array:
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
        ``rotary_dim``; ``positions`` not broadcastable to ``x.shape[:-1]``.

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
    """
    with quiet_floating_point(x):         # non-finite inputs: the values say so, no warning
        arrays = {"x": x, "positions": positions}
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
        two_i = xp.arange(0, rd, 2, dtype=work, device=dev)                       # (rd/2,)
        inv_freq = 1.0 / xp.pow(xp.asarray(float(base), dtype=work, device=dev),
                                two_i / rd)                                        # base^(-2i/rd)
        angles = xp.expand_dims(xp.astype(positions, work), axis=-1) * inv_freq  # (P…, rd/2)
        cos, sin = xp.cos(angles), xp.sin(angles)

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
