"""A preallocated key/value cache for autoregressive decoding.

Keys and values live in arrays of a fixed ``capacity``; each batch row
remembers how many of its slots are filled (``lengths``), so rows may hold
sequences of different lengths. One decoding step appends the new keys and
values and attends over the whole cache, the unfilled slots excluded by
``key_lengths``::

    cache = cache.update(k_new, v_new)
    out = scaled_dot_product_attention(q_new, cache.keys, cache.values,
                                       key_lengths=cache.lengths, is_causal=True,
                                       causal_alignment="bottom_right")

With ``"bottom_right"`` the ``Tq`` new queries of row ``b`` have positions
``lengths[b] - Tq … lengths[b] - 1``: those of the keys appended with them.
"""

from __future__ import annotations

import math
from typing import Any

from polyattn._interop import (
    Array,
    Namespace,
    check_same_device,
    concrete_values,
    device_of,
    library_name,
    namespace_of,
    resolve_xp,
)
from polyattn._validation import check_floating, check_nonnegative_int, shape_str
from polyattn.positional import _float_dtype

#: Libraries whose arrays are written in place (the others get a new cache per update).
MUTABLE = ("numpy", "cupy", "torch", "array_api_strict")


class KVCache:
    """Keys and values of past tokens, preallocated to a fixed capacity.

    Parameters
    ----------
    batch_shape : tuple of int
        The batch dimensions B… (``()`` for none; an int ``n`` means ``(n,)``).
    num_kv_heads : int
        Key/value heads Hkv.
    capacity : int
        Slots per row: the most tokens a row can hold.
    head_dim : int
        Features per key, E.
    value_dim : int, optional
        Features per value, Ev (default E).
    xp, dtype, device : optional
        Where the arrays are created: default NumPy, the library's default
        floating dtype.

    Attributes
    ----------
    keys : array (B…, Hkv, capacity, E)
    values : array (B…, Hkv, capacity, Ev)
        Slots ``[0, lengths[b])`` of row ``b`` hold its tokens in order; the
        rest are zeros or stale entries, never attended to when
        ``key_lengths=cache.lengths`` is passed.
    lengths : integer array (B…,)
        Filled slots per row (the library's default integer dtype).
    capacity : int

    Notes
    -----
    :meth:`update` writes into ``keys`` and ``values`` in place and returns
    the cache itself on NumPy, CuPy, torch and array-api-strict; on JAX and
    Dask, whose arrays are immutable, it returns a new cache and leaves this
    one as it was. Writing ``cache = cache.update(k, v)`` works on all of
    them. On JAX a cache is a pytree (its leaves ``keys``, ``values``,
    ``lengths``), so it can be passed to and returned from ``jax.jit``-ed
    functions; its shapes, the capacity among them, are static.

    One cache must not be used from several threads at once: :meth:`update`
    reads ``lengths``, writes the slots after them and then replaces
    ``lengths``, with no lock, so two threads updating the same cache, or one
    updating it while another attends over it, may lose tokens or read
    half-written ones. Nothing is promised then (no error is raised either).
    Give each thread its own cache (one per sequence being decoded), or hold
    a lock of your own around each update and the attention that reads it.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import KVCache, scaled_dot_product_attention
    >>> rng = np.random.default_rng(0)
    >>> cache = KVCache((2,), 4, 16, 8)        # B = 2, Hkv = 4, capacity 16, E = 8
    >>> cache.keys.shape, cache.lengths
    ((2, 4, 16, 8), array([0, 0]))
    >>> prompt_k, prompt_v = rng.standard_normal((2, 2, 4, 5, 8))   # (B, Hkv, T, E) each
    >>> cache = cache.update(prompt_k, prompt_v)
    >>> for step in range(3):                  # one token per step
    ...     q, k, v = rng.standard_normal((3, 2, 4, 1, 8))
    ...     cache = cache.update(k, v)
    ...     out = scaled_dot_product_attention(
    ...         q, cache.keys, cache.values, key_lengths=cache.lengths,
    ...         is_causal=True, causal_alignment="bottom_right")
    >>> out.shape, cache.lengths
    ((2, 4, 1, 8), array([8, 8]))

    Rows of different lengths: only the first ``lengths[b]`` new tokens of
    row ``b`` are appended.

    >>> cache = KVCache((2,), 4, 16, 8).update(prompt_k, prompt_v, lengths=np.array([5, 3]))
    >>> cache.lengths
    array([5, 3])
    """

    keys: Array
    values: Array
    lengths: Array

    def __init__(self, batch_shape: tuple[int, ...] | int, num_kv_heads: int, capacity: int,
                 head_dim: int, /, *, value_dim: int | None = None, xp: Namespace = None,
                 dtype: Any = None, device: Any = None) -> None:
        batch = _check_batch_shape(batch_shape)
        hkv = check_nonnegative_int("num_kv_heads", num_kv_heads, minimum=1)
        cap = check_nonnegative_int("capacity", capacity, minimum=1)
        e = check_nonnegative_int("head_dim", head_dim, minimum=1)
        ev = e if value_dim is None else check_nonnegative_int("value_dim", value_dim, minimum=1)
        xp = resolve_xp(xp)
        dtype = _float_dtype(xp, dtype, device)
        self.keys = xp.zeros((*batch, hkv, cap, e), dtype=dtype, device=device)
        self.values = xp.zeros((*batch, hkv, cap, ev), dtype=dtype, device=device)
        self.lengths = xp.zeros(batch, dtype=_index_dtype(xp, device), device=device)
        if library_name(xp) == "jax":
            _register_jax_pytree()

    # --- shapes
    @property
    def capacity(self) -> int:
        """Slots per row."""
        return int(self.keys.shape[-2])

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The batch dimensions B…."""
        return tuple(self.keys.shape[:-3])

    @property
    def num_kv_heads(self) -> int:
        return int(self.keys.shape[-3])

    @property
    def head_dim(self) -> int:
        return int(self.keys.shape[-1])

    @property
    def value_dim(self) -> int:
        return int(self.values.shape[-1])

    @property
    def dtype(self) -> Any:
        return self.keys.dtype

    def __repr__(self) -> str:
        return (f"KVCache(batch_shape={self.batch_shape}, num_kv_heads={self.num_kv_heads}, "
                f"capacity={self.capacity}, head_dim={self.head_dim}, "
                f"value_dim={self.value_dim}, dtype={self.dtype})")

    # --- appending
    def update(self, key: Array, value: Array, /, *, lengths: Array | int | None = None
               ) -> KVCache:
        """Append ``key`` and ``value`` to each row, after the row's own ``lengths``.

        Parameters
        ----------
        key : array (B…, Hkv, Tnew, E)
        value : array (B…, Hkv, Tnew, Ev)
            In the cache's library and on its device; a dtype that the
            cache's dtype holds exactly (float16 into float32, float32 into
            float64, …; float64 into a float32 cache is a ``TypeError``).
        lengths : integer array (B…,) or int, optional
            How many of the ``Tnew`` new tokens of each row are real (the
            first ones; the rest are padding and not stored): ragged
            prompts, right-padded. Default: all ``Tnew``.

        Returns
        -------
        KVCache
            ``self``, written in place, on NumPy, CuPy, torch and
            array-api-strict; a new cache on JAX and Dask.

        Raises
        ------
        ValueError
            A row would hold more tokens than ``capacity`` (nothing is
            written then). Checked where the lengths' values are at hand;
            under ``jax.jit`` and on Dask they are not: there tokens past the
            capacity are dropped and ``lengths`` stops at ``capacity``.

        Notes
        -----
        With ``lengths`` smaller than ``Tnew`` the new queries of row ``b``
        are at positions ``old_lengths[b] + i``, while
        ``causal_alignment="bottom_right"`` places them at
        ``lengths_after[b] - Tnew + i``; the two agree where a row appends
        all ``Tnew`` tokens. For a ragged, right-padded prompt entering an
        empty cache, attend with ``causal_alignment="top_left"`` (positions
        ``i``) and ``key_lengths=cache.lengths``; the decoding steps after
        it use ``"bottom_right"``.
        """
        xp = self._check_update(key, value)
        tnew = int(key.shape[-2])
        counts = self._counts(lengths, tnew, xp)
        old, n = concrete_values(self.lengths), concrete_values(counts)
        if old is not None and n is not None:
            self._check_capacity(old, n, tnew)
        if key.dtype != self.dtype:
            key = xp.astype(key, self.dtype)
        if value.dtype != self.dtype:
            value = xp.astype(value, self.dtype)
        lib = library_name(xp)
        if lib in MUTABLE and old is not None and n is not None:
            self._write_in_place(key, value, old, n, xp)
            return self
        start = self.lengths
        new_lengths = xp.clip(start + counts, 0, self.capacity)
        if lib == "jax":
            keys, values = (_scatter_jax(c, x, start, counts) for c, x in
                            ((self.keys, key), (self.values, value)))
        else:
            keys, values = (_scatter(c, x, start, counts, xp) for c, x in
                            ((self.keys, key), (self.values, value)))
        if lib in MUTABLE:                       # values not at hand (torch.compile tracing)
            self.keys, self.values, self.lengths = keys, values, new_lengths
            return self
        return _replace(self, keys, values, new_lengths)

    def _check_update(self, key: Array, value: Array) -> Namespace:
        """The namespace, after checking the library, device, dtypes and shapes of an update."""
        arrays = {"cache.keys": self.keys, "key": key, "value": value}
        xp = namespace_of(arrays)
        check_same_device(arrays)
        for name, x in (("key", key), ("value", value)):
            check_floating(name, x, xp)
            if xp.result_type(x.dtype, self.dtype) != self.dtype:
                raise TypeError(f"`{name}` is {x.dtype} but the cache holds {self.dtype}, "
                                "which would lose precision; create the KVCache with "
                                f"dtype={x.dtype}")
        lead = (*self.batch_shape, self.num_kv_heads)
        expected = {"key": (*lead, "Tnew", self.head_dim),
                    "value": (*lead, "Tnew", self.value_dim)}
        for name, x in (("key", key), ("value", value)):
            want = expected[name]
            ok = x.ndim == len(want) and all(
                w == "Tnew" or s == w for s, w in zip(x.shape, want, strict=True))
            if not ok:
                letter = "E" if name == "key" else "Ev"
                raise ValueError(f"`{name}` must be (B…, Hkv, Tnew, {letter}) = "
                                 f"{_shape_text(want)} for this cache ({self!r}); "
                                 f"got shape {shape_str(x)}")
        if key.shape[-2] != value.shape[-2]:
            raise ValueError(f"`key` has {key.shape[-2]} new tokens but `value` has "
                             f"{value.shape[-2]} (key {shape_str(key)}, value "
                             f"{shape_str(value)})")
        return xp

    def _counts(self, lengths: Array | int | None, tnew: int, xp: Namespace) -> Array:
        """The number of new tokens per row, an integer array (B…,)."""
        batch, dtype, dev = self.batch_shape, self.lengths.dtype, device_of(self.lengths)
        if lengths is None:
            lengths = tnew
        if isinstance(lengths, int) and not isinstance(lengths, bool):
            if not 0 <= lengths <= tnew:
                raise ValueError(f"`lengths` must lie in [0, Tnew] = [0, {tnew}] (Tnew: new "
                                 f"tokens given); got {lengths}")
            counts = xp.full(batch, lengths, dtype=dtype, device=dev)
            values = None
        elif not (hasattr(lengths, "shape") and hasattr(lengths, "dtype")):
            raise TypeError(f"`lengths` must be an integer array (B…,) or an int; got "
                            f"{type(lengths).__name__} {lengths!r}")
        else:
            given: Array = lengths
            named = {"cache.lengths": self.lengths, "lengths": given}
            namespace_of(named)
            check_same_device(named)
            if not xp.isdtype(given.dtype, "integral"):
                raise TypeError(f"`lengths` must have an integer dtype (new tokens per row); "
                                f"got {given.dtype} of shape {shape_str(given)}")
            fits = given.ndim <= len(batch) and all(
                s in (1, t) for s, t in zip(reversed(given.shape), reversed(batch),
                                            strict=False))
            if not fits:
                raise ValueError(f"`lengths` must broadcast to the batch dimensions B… = "
                                 f"{batch}; got shape {shape_str(given)}")
            # checked before the cast, which would wrap 2**64 - 1 (uint64) to -1
            values = concrete_values(given)
            counts = xp.broadcast_to(xp.astype(given, dtype), batch)
        if values is not None and values.size and (values.min() < 0 or values.max() > tnew):
            raise ValueError(f"`lengths` must lie in [0, Tnew] = [0, {tnew}] (Tnew: new tokens "
                             f"given); got values from {int(values.min())} to "
                             f"{int(values.max())}")
        return counts

    def _check_capacity(self, old: Any, n: Any, tnew: int) -> None:
        """``ValueError`` naming the capacity when a row would overflow it."""
        total = old + n
        if total.size and int(total.max()) > self.capacity:
            import numpy as np

            row = tuple(int(i) for i in np.unravel_index(int(np.argmax(total)), total.shape))
            where = f" (batch row {row})" if row else ""
            raise ValueError(
                f"KVCache capacity exceeded: capacity is {self.capacity} tokens per row, but "
                f"appending {int(n[row])} of {tnew} new tokens to a row holding "
                f"{int(old[row])}{where} needs {int(total[row])}; create the cache with a "
                "larger capacity")

    def _write_in_place(self, key: Array, value: Array, old: Any, n: Any,
                        xp: Namespace) -> None:
        """Slice assignments, one for the whole batch where every row is alike."""
        import numpy as np

        if old.size == 0 or int(n.max()) == 0:
            return
        if (old == old.flat[0]).all() and (n == n.flat[0]).all():
            s, c = int(old.flat[0]), int(n.flat[0])
            self.keys[..., s:s + c, :] = key[..., :c, :]
            self.values[..., s:s + c, :] = value[..., :c, :]
        else:
            for row in np.ndindex(*old.shape):
                s, c = int(old[row]), int(n[row])
                if c:
                    dst = (*row, slice(None), slice(s, s + c), slice(None))
                    src = (*row, slice(None), slice(0, c), slice(None))
                    self.keys[dst] = key[src]
                    self.values[dst] = value[src]
        self.lengths = xp.asarray(old + n, dtype=self.lengths.dtype,
                                  device=device_of(self.lengths))


def _check_batch_shape(batch_shape: object) -> tuple[int, ...]:
    """``batch_shape`` as a tuple of non-negative ints (an int ``n`` is ``(n,)``)."""
    if isinstance(batch_shape, int) and not isinstance(batch_shape, bool):
        batch_shape = (batch_shape,)
    if not isinstance(batch_shape, (tuple, list)):
        raise TypeError(f"`batch_shape` must be a tuple of ints (the batch dimensions B…, "
                        f"() for none); got {batch_shape!r}")
    return tuple(check_nonnegative_int(f"batch_shape[{i}]", n)
                 for i, n in enumerate(batch_shape))


def _shape_text(shape: tuple[Any, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _index_dtype(xp: Namespace, device: Any) -> Any:
    """The library's default integer dtype (int64, or int32 for JAX without x64)."""
    try:
        return xp.__array_namespace_info__().default_dtypes(device=device)["integral"]
    except Exception:  # pragma: no cover - namespaces without the inspection API
        return xp.asarray(0).dtype


def _replace(cache: KVCache, keys: Array, values: Array, lengths: Array) -> KVCache:
    """A cache holding the given arrays (no checks: also builds JAX's unflattened pytrees)."""
    new = object.__new__(type(cache))
    new.keys, new.values, new.lengths = keys, values, lengths
    return new


def _scatter(cache: Array, new: Array, start: Array, counts: Array, xp: Namespace) -> Array:
    """``cache`` with ``new[…, t, :]`` at slot ``start[b] + t`` for ``t < counts[b]``.

    Built from standard calls for immutable arrays: slot ``j`` of row ``b``
    takes new token ``j - start[b]`` where that is in ``[0, counts[b])``
    (gathered with one ``take``) and keeps its entry elsewhere. Tokens past
    the capacity have no slot and are dropped.
    """
    *batch, hkv, cap, f = cache.shape
    tnew = int(new.shape[-2])
    if tnew == 0:
        return cache
    rows = math.prod(batch) * hkv
    dev = device_of(cache)
    j = xp.arange(cap, dtype=start.dtype, device=dev)                   # (C,)
    t = j - xp.expand_dims(start, axis=-1)                               # (B…, C)
    ok = xp.logical_and(t >= 0, t < xp.expand_dims(counts, axis=-1))     # (B…, C)
    t = xp.clip(t, 0, tnew - 1)
    first = xp.arange(rows, dtype=start.dtype, device=dev) * tnew
    first = xp.reshape(first, (*batch, hkv, 1))                         # (B…, Hkv, 1)
    index = first + xp.expand_dims(t, axis=-2)                           # (B…, Hkv, C)
    flat = xp.reshape(new, (rows * tnew, f))                             # (B…·Hkv·Tnew, F)
    gathered = xp.take(flat, xp.reshape(index, (rows * cap,)), axis=0)   # (B…·Hkv·C, F)
    gathered = xp.reshape(gathered, tuple(cache.shape))                  # (B…, Hkv, C, F)
    ok = xp.expand_dims(xp.expand_dims(ok, axis=-2), axis=-1)            # (B…, 1, C, 1)
    return xp.where(ok, gathered, cache)


def _scatter_jax(cache: Array, new: Array, start: Array, counts: Array) -> Array:
    """:func:`_scatter` as one JAX scatter of the ``Tnew`` tokens (out-of-range ones dropped)."""
    import jax.numpy as jnp

    *batch, hkv, cap, f = cache.shape
    tnew = int(new.shape[-2])
    rows = math.prod(batch)
    t = jnp.arange(tnew, dtype=start.dtype)                              # (Tnew,)
    slot = jnp.reshape(start, (rows, 1)) + t                             # (rows, Tnew)
    slot = jnp.where(t < jnp.reshape(counts, (rows, 1)), slot, cap)     # padding: no slot
    b = jnp.arange(rows)[:, None, None]                                  # (rows, 1, 1)
    h = jnp.arange(hkv)[None, :, None]                                   # (1, Hkv, 1)
    flat = jnp.reshape(cache, (rows, hkv, cap, f))                       # (rows, Hkv, C, F)
    src = jnp.reshape(new, (rows, hkv, tnew, f))                         # (rows, Hkv, Tnew, F)
    flat = flat.at[b, h, slot[:, None, :]].set(src, mode="drop")
    return jnp.reshape(flat, tuple(cache.shape))                         # (B…, Hkv, C, F)


_JAX_REGISTERED = False


def _register_jax_pytree() -> None:
    """Make :class:`KVCache` a JAX pytree (once; called when a JAX cache is created)."""
    global _JAX_REGISTERED
    if _JAX_REGISTERED:
        return
    import jax

    def flatten(c: KVCache) -> tuple[tuple[Array, Array, Array], None]:
        return (c.keys, c.values, c.lengths), None

    def unflatten(_: None, leaves: Any) -> KVCache:
        new = object.__new__(KVCache)
        new.keys, new.values, new.lengths = leaves
        return new

    jax.tree_util.register_pytree_node(KVCache, flatten, unflatten)
    _JAX_REGISTERED = True
