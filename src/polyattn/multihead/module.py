""":class:`MultiHeadAttention`, the module form: multi-head attention holding its parameters."""

from __future__ import annotations

import copy
import numbers
from typing import Any

from polyattn._interop import Array, Namespace, is_array, library_name, namespace_of, resolve_xp
from polyattn._validation import check_bool, check_float_dtype, check_nonnegative_int, shape_str
from polyattn.multihead.arguments import _check_heads
from polyattn.multihead.function import multi_head_attention
from polyattn.multihead.weights import _initial_weights, _to_namespace, _torch_weights


class MultiHeadAttention:
    """Multi-head attention holding its parameters.

    Parameters
    ----------
    embed_dim : int
        d_model, the query features and the output features.
    num_heads : int
        Query heads H (``embed_dim % num_heads == 0``).
    num_kv_heads : int, optional
        Key/value heads (grouped-query attention); default ``num_heads``.
    kdim, vdim : int, optional
        Key and value features (default ``embed_dim``).
    bias : bool
        Whether the four projections have biases.
    batch_first : bool
        True (default): inputs are (B…, T, features). False: they are
        (T, B, features), as a ``torch.nn.MultiheadAttention`` built with
        ``batch_first=False`` (torch's default) takes them; the output
        follows the input, the weights stay (B, Tq, Tk) (as torch).
    xp, dtype, device : optional
        Where the parameters are created: default NumPy, **float32** (as
        torch's modules; pass ``dtype`` for float64). A float64 input with
        float32 parameters computes in float64 (the standard's promotion),
        never downcast.
    seed : int, optional
        Seed of the initialisation. Weights w_q, w_k, w_v are Xavier/Glorot
        uniform, w_o is uniform in ±1/sqrt(fan_in) and biases are zero, as in
        ``torch.nn.MultiheadAttention``.
    sinks : bool
        Whether the module has attention sinks (gpt-oss): ``params["sinks"]``,
        one logit per query head, initialised to 0 (each row then gives the
        sink the weight of one key scoring 0).

    Attributes
    ----------
    params : dict
        The arrays, laid out as in :func:`multi_head_attention`.

    Examples
    --------
    >>> import numpy as np
    >>> from polyattn import MultiHeadAttention
    >>> mha = MultiHeadAttention(8, 2, seed=0)
    >>> sorted(mha.params)
    ['b_k', 'b_o', 'b_q', 'b_v', 'w_k', 'w_o', 'w_q', 'w_v']
    >>> x = np.ones((3, 8))                      # (T, d_model)
    >>> mha(x, is_causal=True).shape
    (3, 8)

    With attention sinks, a learned logit per head:

    >>> with_sinks = MultiHeadAttention(8, 2, seed=0, sinks=True)
    >>> with_sinks.params["sinks"]
    array([0., 0.], dtype=float32)
    >>> with_sinks(np.ones((2, 3, 8)), is_causal=True).shape
    (2, 3, 8)
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 kdim: int | None = None, vdim: int | None = None, bias: bool = True,
                 batch_first: bool = True, xp: Namespace = None, dtype: Any = None,
                 device: Any = None, seed: int | None = None, sinks: bool = False) -> None:
        import numpy as np

        embed_dim = check_nonnegative_int("embed_dim", embed_dim, minimum=1)
        self.num_heads, self.num_kv_heads = _check_heads(embed_dim, num_heads, num_kv_heads)
        self.embed_dim = embed_dim
        self.kdim = embed_dim if kdim is None else check_nonnegative_int("kdim", kdim, minimum=1)
        self.vdim = embed_dim if vdim is None else check_nonnegative_int("vdim", vdim, minimum=1)
        check_bool("bias", bias)
        check_bool("sinks", sinks)
        self.batch_first = check_bool("batch_first", batch_first)
        xp = resolve_xp(xp)
        dtype = xp.float32 if dtype is None else check_float_dtype("dtype", dtype, xp)
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
            raise TypeError(f"`seed` must be an int or None; got {type(seed).__name__} {seed!r}")
        if seed is not None and seed < 0:
            raise ValueError(f"`seed` must be a non-negative int or None; got {seed}")
        rng = np.random.default_rng(seed)
        e = embed_dim // self.num_heads
        kv = self.num_kv_heads * e
        host = _initial_weights(rng, embed_dim, self.kdim, self.vdim, kv, bias,
                                self.num_heads if sinks else 0)
        self.params = _to_namespace(host, xp, dtype, device)

    def __call__(self, query: Array, key: Array | None = None, value: Array | None = None,
                 /, **options: Any) -> Array | tuple[Array, ...]:
        """Attend: ``key`` defaults to ``query`` (self-attention), ``value`` to ``key``.

        Keywords are those of :func:`multi_head_attention` (``attn_mask``,
        ``key_padding_mask``, ``is_causal``, ``causal_alignment``,
        ``need_weights``, ``average_attn_weights``, ``implementation``,
        ``window``, ``softcap``, ``alibi_slopes``, ``key_lengths``,
        ``rotary``, ``positions``, ``cache``, ``dropout_p``, ``dropout_seed``,
        ``segment_ids``, and the rules you write, ``score_mod``, ``mask_mod``,
        ``mod_args`` and ``block_mask``, applied to the projected heads:
        docs/rules.rst),
        and so is the result.
        With ``batch_first=False``, 3-D inputs are (T, B, features) and so is
        the output.

        >>> import numpy as np
        >>> mha = MultiHeadAttention(8, 2, seed=0)
        >>> def causal(b, h, q_idx, kv_idx):
        ...     return q_idx >= kv_idx
        >>> mha(np.ones((3, 8)), mask_mod=causal).shape
        (3, 8)
        """
        key = query if key is None else key
        value = key if value is None else value
        self._check_library(query)
        if not self.batch_first:
            return self._call_time_first(query, key, value, options)
        expected = (("query", query, self.embed_dim, "embed_dim"),
                    ("key", key, self.kdim, "kdim"), ("value", value, self.vdim, "vdim"))
        for name, x, size, attr in expected:
            shape = getattr(x, "shape", None)
            if shape is not None and len(shape) >= 1 and shape[-1] != size:
                raise ValueError(f"`{name}` has {shape[-1]} features but this module has "
                                 f"{attr}={size} ({name} {shape_str(x)}, expected "
                                 f"(…, T, {size}))")
        return multi_head_attention(query, key, value, self.params, num_heads=self.num_heads,
                                    num_kv_heads=self.num_kv_heads, **options)

    def _check_library(self, query: Array) -> None:
        """``TypeError`` with the fix when the inputs' library is not the parameters'."""
        if not is_array(query):
            return
        ours = namespace_of({"params['w_q']": self.params["w_q"]})
        theirs = namespace_of({"query": query})
        if ours is not theirs:
            raise TypeError(
                f"`query` is a {library_name(theirs)} array but this module's parameters are "
                f"{library_name(ours)} arrays; create or load them in that library, e.g. "
                f"MultiHeadAttention(..., xp={_module_path(library_name(theirs))}) or "
                f"MultiHeadAttention.from_torch(module, xp=torch)")

    def _call_time_first(self, query: Array, key: Array, value: Array,
                         options: dict[str, Any]) -> Array | tuple[Array, ...]:
        """``batch_first=False``: (T, B, F) inputs viewed as (B, T, F), the output back."""
        named = (("query", query), ("key", key), ("value", value))
        ndims = {getattr(x, "ndim", None) for _, x in named}
        if ndims == {2}:                                   # unbatched (T, F): nothing to swap
            return MultiHeadAttention.__call__(_batch_first_view(self), query, key, value,
                                               **options)
        if ndims != {3}:
            shapes = ", ".join(f"{n} {shape_str(x)}" for n, x in named)
            raise ValueError(f"with batch_first=False the inputs must all be (T, B, features) "
                             f"or all (T, features); got {shapes}")
        xp = namespace_of(dict(named))
        swapped = [xp.permute_dims(x, (1, 0, 2)) for _, x in named]   # (B, T, F)
        result = MultiHeadAttention.__call__(_batch_first_view(self), *swapped, **options)
        if isinstance(result, tuple):
            out, *rest = result                                       # weights, cache: as given
            return (xp.permute_dims(out, (1, 0, 2)), *rest)           # (Tq, B, d_model), …
        return xp.permute_dims(result, (1, 0, 2))                      # (Tq, B, d_model)

    def __repr__(self) -> str:
        return (f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
                f"num_kv_heads={self.num_kv_heads}, kdim={self.kdim}, vdim={self.vdim}, "
                f"bias={'b_q' in self.params}, batch_first={self.batch_first}, "
                f"sinks={'sinks' in self.params})")

    @classmethod
    def from_torch(cls, module: Any, *, xp: Namespace = None, dtype: Any = None,
                   device: Any = None) -> MultiHeadAttention:
        """Load the weights of a ``torch.nn.MultiheadAttention``.

        Packed (``in_proj_weight``) and separate (``q_proj_weight`` …)
        projections are both read; torch's ``y = x Wᵀ + b`` becomes
        ``y = x @ w + b`` with ``w = Wᵀ``. The parameters land in ``xp``
        (default NumPy) with ``dtype`` (default: the module's precision).
        ``module.batch_first`` is kept: a module built with
        ``batch_first=False`` (torch's default) takes (T, B, E) inputs here
        too. Modules with ``add_bias_kv`` or ``add_zero_attn`` are not
        supported. Dropout is not applied (inference semantics). The
        parameters are new arrays: with ``xp=torch`` they are tensors that do
        not require grad; call ``p.requires_grad_()`` on each of
        ``mha.params.values()`` to train them. torch's
        boolean masks mean True = ignore: pass ``key_padding_mask`` as it is
        (same meaning here) and ``attn_mask`` negated.

        Examples
        --------
        >>> import torch                                     # doctest: +SKIP
        >>> m = torch.nn.MultiheadAttention(8, 2, batch_first=True)  # doctest: +SKIP
        >>> mha = MultiHeadAttention.from_torch(m)           # doctest: +SKIP
        """
        import numpy as np

        params = _torch_weights(module)
        d = int(module.embed_dim)
        self = cls.__new__(cls)
        self.embed_dim, self.num_heads = d, int(module.num_heads)
        self.num_kv_heads = self.num_heads
        self.kdim, self.vdim = int(module.kdim), int(module.vdim)
        self.batch_first = bool(getattr(module, "batch_first", False))
        xp_resolved = resolve_xp(xp)
        if dtype is None:
            float64 = params["w_q"].dtype == np.float64
            dtype = xp_resolved.float64 if float64 else xp_resolved.float32
        else:
            check_float_dtype("dtype", dtype, xp_resolved)
        self.params = _to_namespace(params, xp, dtype, device)
        return self


def _batch_first_view(module: MultiHeadAttention) -> MultiHeadAttention:
    """The same parameters, called with batch-first inputs."""
    view = copy.copy(module)
    view.batch_first = True
    return view


def _module_path(library: str) -> str:
    """The module a user passes as ``xp`` for a library (``dask`` -> ``dask.array``)."""
    return {"jax": "jax.numpy", "dask": "dask.array"}.get(library, library)
