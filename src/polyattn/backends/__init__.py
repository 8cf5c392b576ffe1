"""The interchangeable attention implementations.

Every module here offers the same internal function, called by
:mod:`polyattn.attention` after validation::

    attention(q, k, v, /, *, mask, causal_offset, scale, xp, rules=None) -> (out, lse)

q (B…, H, Tq, E), k (B…, Hkv, Tk, E), v (B…, Hkv, Tk, Ev)
    One leading batch shape B… (already broadcast), one floating dtype (the
    compute dtype: float32 or float64), ``H % Hkv == 0``; query head ``h``
    reads key/value head ``h // (H // Hkv)``.
mask
    ``None`` or an array with ``q.ndim`` dimensions, each 1 or the full size
    of (B…, H, Tq, Tk); bool (True = attend) or the compute dtype (added to
    the scaled scores).
causal_offset
    ``None`` or an int: key ``j`` is visible to query ``i`` iff
    ``j <= i + causal_offset``.
scale
    Python float multiplying ``q · k``.
rules
    ``None`` (only ``causal_offset`` applies) or a :class:`._rules.Rules`
    with windows, key lengths, soft-capping or ALiBi (DESIGN §4.1). When
    given it is complete: it carries the causal flag and the query
    positions itself, and ``causal_offset`` is its static 0.1 form.

It returns ``out`` (B…, H, Tq, Ev) and ``lse`` (B…, H, Tq) in the compute
dtype. A fully masked row gives ``out = 0`` and ``lse = -inf``. Every
problem has at least one score: the caller answers Tq, Tk, B or H = 0 itself.

Nothing here imports the public modules; ``numba_cuda`` is imported lazily.
"""
