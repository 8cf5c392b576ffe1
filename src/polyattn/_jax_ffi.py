"""The host side of :mod:`._jax_bridge`'s compiled primitives on the CPU, as an XLA FFI
handler: the kernel reads the operands in XLA's own buffers and its results are written
into XLA's result buffers.

``jax.pure_callback`` copies every operand into a new NumPy array, then again onto a CPU
device, and each result back: for attention on (4, 12, 512, 64) float64 arrays, ten
operands and four results of 12.6 MB each took about 40 ms of a 140 ms ``jax.grad`` on
a 2-core Intel Xeon. Here one handler, registered with XLA once per process, is
called by every compiled primitive with the key of its entry in :data:`_CALLS` (the
host function, the call, the operands' and results' shapes and dtypes, kept for the
life of the process: one small entry per lowering) as its one attribute. The host
function is given the result buffers (``into``) and may write its results there; a
result elsewhere is copied in.

The handler is a ``ctypes`` callback (it holds the GIL while it runs, as a
``pure_callback`` does); the structures below are those of XLA's FFI C API
(``xla/ffi/api/c_api.h``, API version 0.x), which XLA keeps binary-compatible.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

#: The name of the handler in XLA's registry of FFI targets (CPU).
TARGET = "polyattn_numba_cpu_host"

_EXECUTE = 3                      # XLA_FFI_ExecutionStage_EXECUTE
_METADATA = 1                     # XLA_FFI_Extension_Metadata
_SCALAR = 3                       # XLA_FFI_AttrType_SCALAR
_INTERNAL = 13                    # XLA_FFI_Error_Code_INTERNAL


class _Extension(ctypes.Structure):
    pass


_Extension._fields_ = [("struct_size", ctypes.c_size_t), ("type", ctypes.c_int),
                       ("next", ctypes.POINTER(_Extension))]


class _Version(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("major", ctypes.c_int), ("minor", ctypes.c_int)]


class _Metadata(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("api_version", _Version),
                ("traits", ctypes.c_uint32), ("state_type_id", ctypes.c_int64)]


class _MetadataExtension(ctypes.Structure):
    _fields_ = [("base", _Extension), ("metadata", ctypes.POINTER(_Metadata))]


class _ErrorArgs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("message", ctypes.c_char_p), ("errc", ctypes.c_int)]


_ERROR_CREATE = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.POINTER(_ErrorArgs))


class _Api(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("api_version", _Version), ("internal_api", ctypes.c_void_p),
                ("error_create", ctypes.c_void_p)]


class _Buffer(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("dtype", ctypes.c_int), ("data", ctypes.c_void_p), ("rank", ctypes.c_int64),
                ("dims", ctypes.POINTER(ctypes.c_int64))]


class _List(ctypes.Structure):            # XLA_FFI_Args and XLA_FFI_Rets
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("items", ctypes.POINTER(ctypes.POINTER(_Buffer)))]


class _ByteSpan(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _Scalar(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("value", ctypes.c_void_p)]


class _Attrs(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t), ("extension_start", ctypes.c_void_p),
                ("size", ctypes.c_int64), ("types", ctypes.POINTER(ctypes.c_int)),
                ("names", ctypes.POINTER(ctypes.POINTER(_ByteSpan))),
                ("items", ctypes.POINTER(ctypes.c_void_p))]


class _CallFrame(ctypes.Structure):
    _fields_ = [("struct_size", ctypes.c_size_t),
                ("extension_start", ctypes.POINTER(_Extension)),
                ("api", ctypes.POINTER(_Api)), ("ctx", ctypes.c_void_p),
                ("stage", ctypes.c_int), ("args", _List), ("rets", _List),
                ("attrs", _Attrs), ("future", ctypes.c_void_p)]


#: key -> (host function, call, operands' (shape, dtype), results' (shape, dtype))
_CALLS: dict[int, tuple[Callable[..., tuple[Any, ...]], Any,
                        list[tuple[tuple[int, ...], np.dtype]],
                        list[tuple[tuple[int, ...], np.dtype]]]] = {}
_KEYS = itertools.count()
_LOCK = threading.Lock()


def register(host: Callable[..., tuple[Any, ...]], call: Any, avals_in: Sequence[Any],
             avals_out: Sequence[Any]) -> int:
    """The key under which the handler finds ``host(call, *operands)`` and the shapes and
    dtypes of its operands and results (abstract values of the lowering)."""
    def spec(avals: Sequence[Any]) -> list[tuple[tuple[int, ...], np.dtype]]:
        return [(tuple(int(s) for s in a.shape), np.dtype(a.dtype)) for a in avals]

    with _LOCK:
        key = next(_KEYS)
        _CALLS[key] = (host, call, spec(avals_in), spec(avals_out))
    return key


def _view(buffer: Any, shape: tuple[int, ...], dtype: np.dtype, writeable: bool
          ) -> np.ndarray:
    """A NumPy array over an XLA buffer, no copy (read-only for an operand)."""
    buf = buffer.contents
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes == 0 or not buf.data:
        return np.zeros(shape, dtype)
    raw = memoryview((ctypes.c_char * nbytes).from_address(buf.data)).cast("B")
    array = np.frombuffer(raw, dtype=dtype).reshape(shape)
    array.flags.writeable = writeable
    return array


def _key(attrs: _Attrs) -> int:
    for i in range(attrs.size):
        name = attrs.names[i].contents
        if ctypes.string_at(name.ptr, name.len) == b"call" and attrs.types[i] == _SCALAR:
            scalar = ctypes.cast(attrs.items[i], ctypes.POINTER(_Scalar)).contents
            return int(ctypes.cast(scalar.value, ctypes.POINTER(ctypes.c_int64)).contents.value)
    raise LookupError("the FFI call carries no 'call' attribute")


def _error(frame: _CallFrame, message: str) -> int | None:
    """An XLA_FFI_Error carrying ``message`` (XLA takes ownership)."""
    args = _ErrorArgs(ctypes.sizeof(_ErrorArgs), None, message.encode("utf-8", "replace"),
                      _INTERNAL)
    create = _ERROR_CREATE(frame.api.contents.error_create)
    return create(ctypes.byref(args))


def _run(frame_address: int) -> int | None:
    frame = _CallFrame.from_address(frame_address)
    ext = frame.extension_start
    if ext and ext.contents.type == _METADATA:       # XLA asks which API version we speak
        metadata = ctypes.cast(ext, ctypes.POINTER(_MetadataExtension)).contents.metadata
        version = frame.api.contents.api_version if frame.api else _Version(0, None, 0, 1)
        metadata.contents.api_version = _Version(ctypes.sizeof(_Version), None,
                                                 version.major, version.minor)
        metadata.contents.traits = 0
        return None
    if frame.stage != _EXECUTE:
        return None
    try:
        host, call, ins, outs = _CALLS[_key(frame.attrs)]
        operands = [_view(frame.args.items[i], *ins[i], writeable=False)
                    for i in range(frame.args.size)]
        targets = [_view(frame.rets.items[i], *outs[i], writeable=True)
                   for i in range(frame.rets.size)]
        results = host(call, *operands, into=targets)
        if len(results) != len(targets):
            raise RuntimeError(f"{len(results)} results for {len(targets)} buffers")
        for i, (result, target) in enumerate(zip(results, targets, strict=True)):
            result = np.asarray(result)
            if result.shape != target.shape or result.dtype != target.dtype:
                raise RuntimeError(f"result {i} is {result.dtype}{list(result.shape)}, its "
                                   f"buffer {target.dtype}{list(target.shape)}")
            if target.size and result.ctypes.data != target.ctypes.data:
                np.copyto(target, result)           # not written in place
    except BaseException as exc:                     # every failure goes back to XLA
        return _error(frame, "polyattn: " + "".join(
            traceback.format_exception_only(type(exc), exc)).strip())
    return None


_HANDLER = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p)(_run)
_registered = False


def available() -> bool:
    """Whether this JAX registers and lowers FFI handlers (``jax.ffi``; older JAX has none)."""
    import jax

    ffi = getattr(jax, "ffi", None)
    return all(hasattr(ffi, name) for name in ("ffi_lowering", "register_ffi_target",
                                               "pycapsule"))


def ensure_registered() -> str:
    """Register the handler with XLA's CPU FFI targets (once); returns its name."""
    global _registered
    with _LOCK:
        if not _registered:
            import jax

            pointer = ctypes.cast(_HANDLER, ctypes.c_void_p).value
            jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(pointer), platform="cpu")
            _registered = True
    return TARGET
