"""The structure of a GGUF file: header, metadata and tensor table, parsed and checked.

The file is untrusted input: every length and count is checked against the
bytes the file still holds before it is read, so a damaged or hostile file
costs no more time or memory than its size allows; any defect is one
``ValueError`` naming the file and the entry. :func:`parse` gives the
metadata and where each tensor's data lies (checked to lie inside the file);
:func:`dequantize` turns one tensor's bytes into float32 with the ``gguf``
package (:func:`require_gguf`).
"""

from __future__ import annotations

import importlib
import itertools
import math
import os
import reprlib
import struct
from typing import Any, NamedTuple

import numpy as np

#: How to install the GGUF reader (with its own dependencies: PyYAML, …).
GGUF_HINT = 'pip install "polyattn[models]"'

#: The GGUF versions read (version 1 had 32-bit counts).
VERSIONS = (2, 3)
#: Where the tensors' data may start and each tensor's offset is a multiple of, by default.
DEFAULT_ALIGNMENT = 32
#: The most axes a GGML tensor has.
MAX_DIMS = 4
#: The fewest bytes a metadata entry takes (key length, empty key, type, one byte)
#: and a tensor description (name length, empty name, no axes, type, offset).
_MIN_ENTRY, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 4 + 8
#: The metadata value types with a fixed size: code -> (NumPy dtype, GGUF name).
_FIXED = {0: ("<u1", "uint8"), 1: ("<i1", "int8"), 2: ("<u2", "uint16"), 3: ("<i2", "int16"),
          4: ("<u4", "uint32"), 5: ("<i4", "int32"), 6: ("<f4", "float32"), 7: ("<u1", "bool"),
          10: ("<u8", "uint64"), 11: ("<i8", "int64"), 12: ("<f8", "float64")}
_BOOL, _STRING, _ARRAY = 7, 8, 9
#: The tensor types read: GGML code -> (name, elements per block, bytes per block).
TENSOR_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2),
                2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
                7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84),
                11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176),
                14: ("Q6_K", 256, 210)}
#: Long values are shortened in messages.
_repr = reprlib.Repr()
_repr.maxlist, _repr.maxstring, _repr.maxother = 6, 60, 60
show = _repr.repr


class TensorInfo(NamedTuple):
    """One entry of a GGUF file's tensor table, checked against the file's size."""

    name: str
    shape: tuple[int, ...]   #: NumPy order (GGUF lists the fastest axis first)
    type_code: int           #: GGML type
    start: int               #: absolute offset of the data in the file
    nbytes: int


class GGUFLayout(NamedTuple):
    """A GGUF file's metadata and tensor table, parsed and checked; the data not read."""

    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data: np.ndarray         #: the whole file, memory-mapped, as uint8


def require_gguf() -> Any:
    """Import the ``gguf`` package, or say why it cannot be imported.

    Raises
    ------
    ModuleNotFoundError
        ``gguf`` is not installed; the message gives :data:`GGUF_HINT`.
    ImportError
        ``gguf`` is installed but importing it fails (e.g. it was installed
        with ``--no-deps`` and lacks PyYAML); the message quotes the error.
    """
    try:
        return importlib.import_module("gguf")
    except ModuleNotFoundError as exc:
        if exc.name != "gguf":
            raise ImportError(
                f"the `gguf` package is installed but cannot be imported: {exc}; install it "
                f"with its dependencies: `{GGUF_HINT}`", name="gguf") from exc
        raise ModuleNotFoundError(
            f"reading GGUF files needs the `gguf` package; install it with `{GGUF_HINT}`",
            name="gguf") from exc
    except ImportError as exc:
        raise ImportError(f"the `gguf` package is installed but cannot be imported: {exc}",
                          name="gguf") from exc


# --------------------------------------------------------------------------
# The file's structure
# --------------------------------------------------------------------------


class _Cursor:
    """Reads little-endian GGUF values from ``buf``, never past its end."""

    def __init__(self, buf: memoryview, path: str | os.PathLike[str]) -> None:
        self.buf, self.path, self.pos, self.size = buf, path, 0, len(buf)

    def error(self, what: str) -> ValueError:
        return ValueError(f"cannot read {self.path} as a GGUF file: {what}")

    def check(self, n: int, what: str) -> None:
        """Fail unless ``n`` bytes are left at the cursor."""
        left = self.size - self.pos
        if n > left:
            raise self.error(f"{what} needs {n} bytes at offset {self.pos}, but only {left} "
                             "are left; the file is truncated or corrupt")

    def take(self, n: int, what: str) -> int:
        """Skip ``n`` bytes, which must be there; return where they start."""
        self.check(n, what)
        self.pos += n
        return self.pos - n

    def u32(self, what: str) -> int:
        return struct.unpack_from("<I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return struct.unpack_from("<Q", self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(f"the length of {what}")
        start = self.take(n, what)
        try:
            return str(self.buf[start:start + n], "utf-8")
        except UnicodeDecodeError as exc:
            raise self.error(f"{what} (at offset {start}) is not UTF-8: {exc.reason} at its "
                             f"byte {exc.start}") from None

    def value(self, code: int, what: str) -> Any:
        """A metadata value of type ``code``: a Python int, float, bool, str or list."""
        if code in _FIXED:
            dtype = np.dtype(_FIXED[code][0])
            value = np.frombuffer(self.buf, dtype, 1, self.take(dtype.itemsize, what))[0]
            return bool(value) if code == _BOOL else value.item()
        if code == _STRING:
            return self.string(what)
        if code == _ARRAY:
            return self.array(what)
        raise self.error(f"{what} has value type {code}, which is not a GGUF type (0 to 12)")

    def array(self, what: str) -> list[Any]:
        code = self.u32(f"the element type of {what}")
        count = self.u64(f"the length of {what}")
        if code in _FIXED:
            dtype, name = _FIXED[code]
            itemsize = np.dtype(dtype).itemsize
            start = self.take(count * itemsize, f"{what} ({count} elements of {name})")
            items = np.frombuffer(self.buf, dtype, count, start)
            return (items != 0).tolist() if code == _BOOL else items.tolist()
        if code == _STRING:
            self.check(count * 8, f"{what} ({count} strings of at least 8 bytes each)")
            return self.strings(count, what)
        if code == _ARRAY:
            raise self.error(f"{what} is an array of arrays, which this reader does not read")
        raise self.error(f"the elements of {what} have value type {code}, which is not a GGUF "
                         "type (0 to 12)")

    def strings(self, count: int, what: str) -> list[str]:
        """``count`` strings in a row (the hot loop: vocabularies have ~10^5)."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                self.check(8, f"the length of element {i} of {what}")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                self.pos = pos
                self.check(n, f"element {i} of {what}")
            try:
                out.append(str(buf[pos:pos + n], "utf-8"))
            except UnicodeDecodeError:
                self.pos = pos - 8
                self.string(f"element {i} of {what}")     # raises, naming the element
            pos += n
        self.pos = pos
        return out


def _tensor_type_name(code: int) -> str:
    if code in TENSOR_TYPES:
        return TENSOR_TYPES[code][0]
    try:
        return f"{require_gguf().GGMLQuantizationType(code).name} ({code})"
    except (ImportError, ValueError):
        return f"{code} (not a GGML type)"


def _tensor_info(cur: _Cursor, index: int) -> tuple[str, tuple[int, ...], int, int]:
    """Name, GGUF dims, type and data offset of the next entry of the tensor table."""
    name = cur.string(f"the name of tensor {index}")
    n_dims = cur.u32(f"the number of axes of tensor `{name}`")
    if n_dims > MAX_DIMS:
        raise cur.error(f"tensor `{name}` has {n_dims} axes; GGUF allows at most {MAX_DIMS}")
    dims = struct.unpack_from(f"<{n_dims}Q", cur.buf,
                              cur.take(8 * n_dims, f"the shape of tensor `{name}`"))
    code = cur.u32(f"the type of tensor `{name}`")
    offset = cur.u64(f"the data offset of tensor `{name}`")
    return name, dims, code, offset


def _check_data(cur: _Cursor, name: str, dims: tuple[int, ...], code: int, offset: int,
                data_start: int, alignment: int) -> TensorInfo:
    """The tensor's type is read here, its shape whole blocks, its data inside the file."""
    if code not in TENSOR_TYPES:
        raise cur.error(f"tensor `{name}` has type {_tensor_type_name(code)}, which this "
                        f"reader does not dequantize; supported types: "
                        f"{', '.join(t[0] for t in TENSOR_TYPES.values())}")
    type_name, block, type_size = TENSOR_TYPES[code]
    shape = tuple(reversed(dims))
    if min(dims, default=1) < 1:
        raise cur.error(f"tensor `{name}` has shape {shape}; every axis needs at least one "
                        "element")
    row = dims[0] if dims else 1
    if row % block:
        raise cur.error(f"tensor `{name}` has rows of {row} elements, not a whole number "
                        f"of {type_name} blocks of {block}")
    if offset % alignment:
        raise cur.error(f"the data offset {offset} of tensor `{name}` is not a multiple of "
                        f"the alignment, {alignment}")
    nbytes = math.prod(dims) // block * type_size
    start = data_start + offset
    if start + nbytes > cur.size:
        raise cur.error(f"tensor `{name}` ({type_name}, shape {shape}) needs {nbytes} bytes "
                        f"at offset {start}, past the end of the file ({cur.size} bytes); the "
                        "file is truncated or corrupt")
    return TensorInfo(name, shape, code, start, nbytes)


def _alignment(meta: dict[str, Any], cur: _Cursor) -> int:
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if (isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1
            or alignment & (alignment - 1)):
        raise cur.error(f"`general.alignment` must be a power of two; got {show(alignment)}")
    return alignment


def parse(path: str | os.PathLike[str]) -> GGUFLayout:
    """Parse and check the header, metadata and tensor table of the GGUF file ``path``.

    Nothing is read before its length is checked against the bytes left, so
    a file that claims more than it holds fails at once, whatever it claims.

    Raises
    ------
    ValueError
        The file cannot be opened, is not GGUF, is truncated, or holds a
        malformed or duplicated entry, a tensor of a type not in
        :data:`TENSOR_TYPES`, or tensor data outside the file or
        overlapping; the message names the file and the entry.
    """
    try:
        size = os.stat(path).st_size
        data = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read {path} as a GGUF file: {exc}") from exc
    cur = _Cursor(data.data, path)                       # the bytes, unsigned
    magic = bytes(cur.buf[:4])
    if magic != b"GGUF":
        raise cur.error(f"it does not start with the magic bytes b'GGUF' (it starts with "
                        f"{magic!r})")
    cur.pos = 4
    version = cur.u32("the version")
    if version not in VERSIONS:
        read = f"little-endian files of versions {' and '.join(map(str, VERSIONS))} are read"
        if version and not version & 0xFFFF:
            raise cur.error(f"it is a big-endian file (its version reads {version:#010x}); "
                            f"only {read}")
        raise cur.error(f"its version is {version}; {read}")
    tensor_count = cur.u64("the tensor count")
    kv_count = cur.u64("the metadata count")
    if kv_count * _MIN_ENTRY > cur.size - cur.pos:
        raise cur.error(f"the header claims {kv_count} metadata entries, but the "
                        f"{cur.size - cur.pos} bytes left hold at most "
                        f"{(cur.size - cur.pos) // _MIN_ENTRY}; the file is truncated or corrupt")
    meta: dict[str, Any] = {}
    for i in range(kv_count):
        key = cur.string(f"the key of metadata entry {i}")
        if key in meta:
            raise cur.error(f"the metadata key `{key}` appears twice (entry {i} repeats it)")
        meta[key] = cur.value(cur.u32(f"the value type of `{key}`"), f"the value of `{key}`")
    if tensor_count * _MIN_TENSOR > cur.size - cur.pos:
        raise cur.error(f"the header claims {tensor_count} tensors, but the "
                        f"{cur.size - cur.pos} bytes left hold at most "
                        f"{(cur.size - cur.pos) // _MIN_TENSOR} tensor descriptions; the file "
                        "is truncated or corrupt")
    entries: dict[str, tuple[tuple[int, ...], int, int]] = {}
    for i in range(tensor_count):
        name, dims, code, offset = _tensor_info(cur, i)
        if name in entries:
            raise cur.error(f"the tensor `{name}` is described twice (tensor {i} repeats it)")
        entries[name] = (dims, code, offset)
    alignment = _alignment(meta, cur)
    data_start = -(-cur.pos // alignment) * alignment
    tensors = {name: _check_data(cur, name, dims, code, offset, data_start, alignment)
               for name, (dims, code, offset) in entries.items()}
    ordered = sorted(tensors.values(), key=lambda t: t.start)
    for a, b in itertools.pairwise(ordered):
        if a.start + a.nbytes > b.start:
            raise cur.error(f"the data of tensors `{a.name}` and `{b.name}` overlap (bytes "
                            f"{a.start}-{a.start + a.nbytes} and {b.start}-{b.start + b.nbytes})")
    return GGUFLayout(meta, tensors, data)


def dequantize(gguf: Any, data: np.ndarray, t: TensorInfo) -> np.ndarray:
    """Tensor ``t`` of the file ``data`` in float32, NumPy shape, a copy."""
    _, block, type_size = TENSOR_TYPES[t.type_code]
    row = t.shape[-1] if t.shape else 1
    raw = data[t.start:t.start + t.nbytes].reshape(-1, row // block * type_size)
    w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(t.type_code))
    return np.array(w, dtype=np.float32).reshape(t.shape)
