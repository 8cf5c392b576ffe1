"""Test helpers: backends, conversions, the float64 oracle and tolerances."""

from __future__ import annotations

import enum
import importlib
import math
from functools import cache
from typing import Any

import numpy as np
import pytest


class Backend(enum.Enum):
    """The array libraries polyattn is tested on."""

    NUMPY = "numpy"
    ARRAY_API_STRICT = "array_api_strict"
    TORCH = "torch"
    JAX = "jax"
    DASK = "dask"
    CUPY = "cupy"

    @property
    def is_cpu(self) -> bool:
        return self is not Backend.CUPY

    @property
    def module_name(self) -> str:
        return {"jax": "jax.numpy", "dask": "dask.array"}.get(self.value, self.value)


@cache
def available_backends() -> dict[Backend, bool]:
    """Installed backends -> whether they can run (CuPy needs a GPU)."""
    found = {}
    for b in Backend:
        try:
            importlib.import_module(b.module_name)
        except Exception:
            continue
        ok = True
        if b is Backend.CUPY:
            try:
                import cupy

                ok = cupy.cuda.runtime.getDeviceCount() > 0
            except Exception:
                ok = False
        if b is Backend.JAX:
            import jax

            jax.config.update("jax_enable_x64", True)
        found[b] = ok
    return found


def backend_namespace(backend: Backend) -> Any:
    """The standard-compatible namespace of ``backend``."""
    import array_api_compat

    module = importlib.import_module(backend.module_name)
    if backend is Backend.JAX:
        import jax

        jax.config.update("jax_enable_x64", True)
    return array_api_compat.array_namespace(module.asarray(0.0))


def default_device(backend: Backend, xp: Any) -> Any:
    """A non-default device where the backend has one (array-api-strict), else default."""
    if backend is Backend.ARRAY_API_STRICT:
        return xp.Device("device1")
    return None


def kernel_mode() -> str | None:
    """How the Numba CUDA kernel can be tested here: "simulator", "gpu" or None."""
    import importlib.util
    import os

    if importlib.util.find_spec("numba") is None or importlib.util.find_spec("numba.cuda") is None:
        return None
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return "simulator"
    if available_backends().get(Backend.CUPY):
        return "gpu"
    return None


def selected_backends() -> list[Backend]:
    """The backends of this run: ``POLYATTN_TEST_BACKENDS`` (set by nox), else every CPU one."""
    import os

    env = os.environ.get("POLYATTN_TEST_BACKENDS", "")
    names = [n.strip() for n in env.split(",") if n.strip()]
    return [Backend(n) for n in names] if names else [b for b in Backend if b.is_cpu]


#: The backends whose library has a native attention function polyattn runs.
NATIVE_BACKENDS = (Backend.TORCH, Backend.JAX)


#: The Numba CUDA kernel families, as test ids, and the settings that make
#: ``implementation="numba_cuda"`` run each: the one-thread-per-row kernel, the
#: register-tiled kernel (more than 16 query rows) and the tensor-core kernel (float16,
#: bfloat16, and float32 as 3xTF32; more than 16 query rows).
CUDA_FAMILIES = {
    "numba_cuda-rows": {"POLYATTN_CUDA_KERNEL": "rows"},
    "numba_cuda-tiled": {"POLYATTN_CUDA_KERNEL": "tiled", "POLYATTN_CUDA_FLOAT32": "exact"},
    "numba_cuda-tc": {"POLYATTN_CUDA_KERNEL": "tiled", "POLYATTN_CUDA_FLOAT32": "3xtf32"},
}


def public_name(case: str) -> str:
    """The ``implementation=`` name of a case id (``"numba_cuda-tiled"``: ``"numba_cuda"``)."""
    return case.split("-", 1)[0]


def numba_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("numba") is not None


def implementations_under_test(*, cuda_families: tuple[str, ...] = tuple(CUDA_FAMILIES)
                               ) -> list[str]:
    """The implementations tests run, as case ids (pass ``public_name(id)`` to the API).

    The CPU ones; ``"native"`` where torch or JAX is among the backends of this run;
    ``"numba_cpu"`` where Numba is installed and NumPy selected; ``"distributed"`` where
    Dask is selected; and each of ``cuda_families`` where the CUDA kernel can run
    (simulator or GPU). Every id contains its implementation's name, so that
    ``pytest -k numba_cpu`` (or ``-k numba_cuda``, ``-k numba_cuda-tiled``,
    ``-k distributed``) selects one.
    """
    names = ["reference", "chunked", "auto"]
    selected = selected_backends()
    installed = available_backends()
    if any(b in NATIVE_BACKENDS and b in installed for b in selected):
        names.append("native")
    if Backend.NUMPY in selected and numba_installed():
        names.append("numba_cpu")
    if Backend.DASK in selected and Backend.DASK in installed:
        names.append("distributed")
    if kernel_mode() is not None:
        names.extend(cuda_families)
    return names


#: The only array library each of these implementations takes (the others take every one).
#: numba_cuda takes NumPy arrays on the simulator and CuPy arrays on a GPU.
ONLY_ON = {"numba_cpu": Backend.NUMPY, "distributed": Backend.DASK}


#: Why ``"native"`` may refuse a call (DESIGN §3.1); any other refusal fails the test.
NATIVE_REFUSALS = (
    "return_lse=True",                      # neither library returns the lse with gradients
    "computes the softmax in float32",      # float64 on JAX
    "values with as many features",         # JAX needs Ev == E
    "has no native attention function",     # libraries other than torch and JAX
    "softcap: ",                            # soft-capping is not additive: no mask expresses it
    "dropout_p: ",                          # their own generators, not the Philox counters
    "has no attention sinks",               # sinks join through the lse, which they lack
    "mask_mod: ",                           # user rules: no native function takes them
    "score_mod: ",
)


def allow_native_fallback(monkeypatch: Any) -> None:
    """Make ``implementation="native"`` check its refusals instead of raising.

    Where the native function cannot run a call, asking for it by name raises
    ``ValueError``; under this patch the test checks that it does, for one of
    the :data:`NATIVE_REFUSALS`, and then runs what ``"auto"`` falls back to, so
    that every test body still checks the numbers of the call.
    """
    from polyattn import _dispatch

    real = _dispatch.choose

    def choose(problem: Any, requested: str, **options: Any) -> Any:
        if requested != "native":
            return real(problem, requested, **options)
        try:
            return real(problem, "native", **options)
        except ValueError as exc:
            assert any(r in str(exc) for r in NATIVE_REFUSALS), f"unexpected refusal: {exc}"
        fallback = real(problem, "auto", **options)
        assert fallback.implementation != "native"
        return fallback

    monkeypatch.setattr(_dispatch, "choose", choose)


def skip_unless_native_on(backend: Backend | None, implementation: str, monkeypatch: Any) -> None:
    """Skip ``"native"`` on backends without a native attention; else allow its fallbacks."""
    if implementation != "native":
        return
    if backend is not None and backend not in NATIVE_BACKENDS:
        pytest.skip(f"{backend.value} has no native attention (torch and JAX have)")
    allow_native_fallback(monkeypatch)


def skip_unless_kernel_runs_on(request: Any, implementation: str) -> None:
    """Skip a ``numba_cuda`` test whose arrays the kernel cannot take.

    On the simulator the kernel takes NumPy arrays; on a GPU, CuPy arrays.
    Tests without a ``backend`` parameter use NumPy arrays.
    """
    if public_name(implementation) != "numba_cuda":
        return
    wanted = Backend.NUMPY if kernel_mode() == "simulator" else Backend.CUPY
    params = getattr(request.node, "callspec", None)
    backend = params.params.get("backend", Backend.NUMPY) if params else Backend.NUMPY
    if backend is not wanted:
        pytest.skip(f"the numba_cuda kernel runs on {wanted.value} arrays here, "
                    f"not {backend.value}")


def dtype_of(xp: Any, name: str) -> Any:
    return getattr(xp, name)


def to_xp(a: np.ndarray, xp: Any, *, dtype: str | None = None, device: Any = None) -> Any:
    """A NumPy array in ``xp`` (optionally cast to dtype ``name``) on ``device``."""
    a = np.asarray(a)
    target = None if dtype is None else dtype_of(xp, dtype)
    if target is None and a.dtype == np.float64:
        target = xp.float64
    x = xp.asarray(a, dtype=target, device=device) if target is not None else \
        xp.asarray(a, device=device)
    if a.ndim >= 2 and "dask" in getattr(xp, "__name__", ""):
        # a few chunks along the sequence axis, so that the Dask plan has tiles to merge
        n = a.shape[-2]
        x = x.rechunk({a.ndim - 2: max(DASK_TEST_CHUNK, -(-n // 4))})
    return x


#: Fewest positions per chunk (axis -2) of the Dask arrays the tests make (at most 4 chunks).
DASK_TEST_CHUNK = 5


def to_numpy(x: Any) -> np.ndarray:
    """Any backend's array as a NumPy array (computing lazy ones)."""
    mod = type(x).__module__
    if hasattr(x, "compute") and mod.startswith("dask"):
        x = x.compute()
    if mod.startswith("torch"):
        return x.detach().cpu().numpy()
    if mod.startswith("cupy"):
        return x.get()
    if mod.startswith("array_api_strict"):
        import array_api_strict

        x = x.to_device(array_api_strict.Device("CPU_DEVICE"))
        return np.asarray(x)
    return np.asarray(x)


# --- the float64 oracle, written without polyattn ----------------------------------------

def ref_attention(q, k, v, *, mask=None, is_causal=False, alignment="top_left", scale=None,
                  enable_gqa=False, window=None, softcap=None, alibi_slopes=None,
                  key_lengths=None):
    """float64 attention with the semantics of DESIGN §4 and §4.1: returns (out, lse, weights).

    ``window``, ``softcap``, ``alibi_slopes`` and ``key_lengths`` follow §4.1
    element by element (:func:`ref_scores`); ``alibi_slopes`` (H,) or (B…, H),
    ``key_lengths`` an int or integer (B…,).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if enable_gqa:
        g = q.shape[-3] // k.shape[-3]
        k = np.repeat(k, g, axis=-3)
        v = np.repeat(v, g, axis=-3)
    s = ref_scores(q, k, mask=mask, is_causal=is_causal, alignment=alignment, scale=scale,
                   window=window, softcap=softcap, alibi_slopes=alibi_slopes,
                   key_lengths=key_lengths)
    tk = k.shape[-2]
    with np.errstate(invalid="ignore", divide="ignore"):
        m = np.max(s, axis=-1, keepdims=True) if tk else np.full((*s.shape[:-1], 1), -np.inf)
        m_safe = np.where(np.isneginf(m), 0.0, m)
        p = np.exp(s - m_safe)
        l = p.sum(-1, keepdims=True)
        w = np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0)
        lse = np.where(l > 0, m_safe + np.log(np.where(l > 0, l, 1.0)), -np.inf)[..., 0]
    out = np.einsum("...qk,...kf->...qf", w, v)
    return out, lse, w


def ref_scores(q, k, *, mask=None, is_causal=False, alignment="top_left", scale=None,
               window=None, softcap=None, alibi_slopes=None, key_lengths=None):
    """The scores that enter the softmax, (…, H, Tq, Tk) in float64, by DESIGN §4.1.

    ``k`` has as many heads as ``q`` (GQA already expanded). Every element
    ``(b…, h, i, j)`` gets, from index arrays over the whole score grid:
    ``Tk_b`` (``key_lengths[b]`` or Tk); ``p_i = i`` (top-left) or
    ``i + Tk_b - Tq`` (bottom-right); ``s = scale·q·k`` →
    ``softcap·tanh(s/softcap)`` → ``- slope_h·|p_i - j|`` → float mask added →
    ``-inf`` unless ``j < Tk_b``, ``j <= p_i`` (causal),
    ``p_i - left <= j <= p_i + right`` (window) and a boolean mask allows it.
    """
    q, k = np.asarray(q, dtype=np.float64), np.asarray(k, dtype=np.float64)
    tq, tk = q.shape[-2], k.shape[-2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = np.einsum("...qe,...ke->...qk", q, k) * scale
    mask = None if mask is None else np.asarray(mask)
    if mask is not None:                          # a mask may add leading axes
        s = np.broadcast_to(s, np.broadcast_shapes(s.shape, mask.shape))
    matrix = s.ndim == 2                          # (Tq, Tk): one head, no batch
    if matrix:
        s = s[None]                               # (1, Tq, Tk)
    grid = np.indices(s.shape)                    # one index array per axis of s
    i, j = grid[-2], grid[-1]
    batch_index = tuple(grid[:-3])                # (b…) of every element
    head_index = grid[-3]
    batch_shape = s.shape[:-3]
    tk_b = np.broadcast_to(np.asarray(tk if key_lengths is None else key_lengths),
                           batch_shape)[batch_index]
    p = i if alignment == "top_left" else i + tk_b - tq
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        slopes = np.broadcast_to(np.asarray(alibi_slopes, dtype=np.float64),
                                 (*batch_shape, s.shape[-3]))
        s = s - slopes[(*batch_index, head_index)] * np.abs(p - j)
    visible = j < tk_b
    if is_causal:
        visible &= j <= p
    if window is not None:
        left, right = window
        if left is not None:
            visible &= j >= p - left
        if right is not None:
            visible &= j <= p + right
    if mask is not None:
        if mask.dtype == bool:
            visible &= np.broadcast_to(mask, s.shape)
        else:
            s = s + mask.astype(np.float64)
    s = np.where(visible, s, -np.inf)
    return s[0] if matrix else s


def ref_attention_vjp(q, k, v, grad_out, grad_lse=None, *, enable_gqa=False, scale=None,
                      softcap=None, **rules):
    """float64 gradients ``(dq, dk, dv)`` of ``sum(out·grad_out) + sum(lse·grad_lse)``, by
    the closed form of softmax attention: ``dv = αᵀ g``, ``ds = α ∘ (g vᵀ − rowsum(g ∘ out)
    + grad_lse)``, through softcap's ``1 − tanh²``, ``dq = scale · ds k``, ``dk = scale · dsᵀ
    q`` (summed over each key/value head's query group). ``rules`` as for
    :func:`ref_attention` (a mask must not add leading axes).
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    g = np.asarray(grad_out, dtype=np.float64)
    group = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    kk, vv = (np.repeat(x, group, axis=-3) for x in (k, v))
    out, _, w = ref_attention(q, kk, vv, scale=scale, softcap=softcap, **rules)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    dv = np.einsum("...qk,...qf->...kf", w, g)
    ds = w * (np.einsum("...qf,...kf->...qk", g, vv) - np.sum(g * out, -1, keepdims=True))
    if grad_lse is not None:
        ds = ds + w * np.asarray(grad_lse, dtype=np.float64)[..., None]
    if softcap is not None:
        raw = np.einsum("...qe,...ke->...qk", q, kk) * scale
        ds = ds * (1.0 - np.tanh(raw / softcap) ** 2)
    dq = scale * np.einsum("...qk,...ke->...qe", ds, kk)
    dk = scale * np.einsum("...qk,...qe->...ke", ds, q)
    if group > 1:
        dk = dk.reshape(*k.shape[:-3], k.shape[-3], group, *k.shape[-2:]).sum(-3)
        dv = dv.reshape(*v.shape[:-3], v.shape[-3], group, *v.shape[-2:]).sum(-3)
    return dq, dk, dv


TOLERANCE = {"bfloat16": 4e-3, "float16": 2e-3, "float32": 1e-5, "float64": 1e-12}


def rel_error(out: np.ndarray, ref: np.ndarray) -> float:
    """‖out − ref‖ / ‖ref‖ (absolute error when ref is 0)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    den = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / den) if den > 0 else float(num)


def assert_close(out: Any, ref: np.ndarray, dtype: str, *, what: str = "out") -> None:
    """Relative error within the numerical contract for ``dtype``."""
    got = to_numpy(out)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert not np.isnan(got).any() or np.isnan(ref).any(), f"{what}: unexpected NaN"
    err = rel_error(got, ref)
    assert err <= TOLERANCE[dtype], f"{what}: relative error {err:.3g} > {TOLERANCE[dtype]}"


def assert_lse_close(lse: Any, ref: np.ndarray, dtype: str) -> None:
    """lse equal where -inf, relatively close elsewhere."""
    got = to_numpy(lse)
    assert got.shape == ref.shape
    inf = np.isneginf(ref)
    assert np.array_equal(np.isneginf(got), inf), "lse: -inf pattern differs"
    assert_close(np.where(inf, 0, got), np.where(inf, 0, ref), dtype, what="lse")


def assert_namespace_device(out: Any, xp: Any, device: Any, dtype: Any) -> None:
    """Output in namespace ``xp``, on ``device`` (when given), with ``dtype``."""
    import array_api_compat

    assert array_api_compat.array_namespace(out) is xp
    assert out.dtype == dtype, f"dtype {out.dtype} != {dtype}"
    if device is not None:
        assert array_api_compat.device(out) == device


def random_inputs(rng, shape_q, shape_k, shape_v):
    return rng.standard_normal(shape_q), rng.standard_normal(shape_k), rng.standard_normal(shape_v)
