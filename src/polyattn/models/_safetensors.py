"""Tensors of a transformers checkpoint's ``*.safetensors`` files, as NumPy arrays.

A safetensors file is an 8-byte little-endian header length, a JSON header
naming each tensor's dtype, shape and byte range, then the bytes. The header
is read here and each tensor is a view of a memory map of the file, so no
tensor is read before it is asked for and no deep-learning library is
needed. bfloat16 (which NumPy lacks, and which ``safetensors``' NumPy loader
refuses) is widened to float32 exactly: a bfloat16 number is the upper 16
bits of the float32 of the same value.

A sharded checkpoint lists its files in ``model.safetensors.index.json``
(``weight_map``: tensor name → file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import numpy as np

#: safetensors dtypes and their NumPy dtype (bfloat16: its bits, widened on reading).
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_}
#: The header of a file bigger than this is not a safetensors header.
MAX_HEADER = 100_000_000
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsError(ValueError):
    """A safetensors file or index that cannot be read; the message names the file."""


class TensorInfo:
    """Where one tensor lies: its file, dtype name, shape and byte range."""

    def __init__(self, file: Path, dtype: str, shape: tuple[int, ...], start: int,
                 stop: int) -> None:
        self.file, self.dtype, self.shape, self.start, self.stop = file, dtype, shape, start, stop


def read_header(file: Path) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """The tensors of one file and its ``__metadata__``, each range checked."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsError(f"{file}: not a safetensors file (shorter than 8 bytes)")
            n = int.from_bytes(head, "little")
            if n > min(MAX_HEADER, size - 8):
                raise SafetensorsError(f"{file}: not a safetensors file (its first 8 bytes "
                                       f"give a header of {n} bytes, in a file of {size})")
            header = json.loads(f.read(n).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{file}: not a safetensors file (its header is not JSON: "
                               f"{exc})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{file}: the header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data_start, data_size = 8 + n, size - 8 - n
    tensors = {}
    for name, entry in header.items():
        try:
            dtype, shape, (start, stop) = entry["dtype"], tuple(entry["shape"]), \
                entry["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise SafetensorsError(f"{file}: the header's entry for {name!r} lacks `dtype`, "
                                   f"`shape` or `data_offsets`: {entry!r:.200}") from None
        if dtype not in DTYPES:
            raise SafetensorsError(f"{file}: tensor {name!r} has dtype {dtype!r}, which is not "
                                   f"read; read: {', '.join(DTYPES)}")
        count = int(np.prod(shape, dtype=np.int64))
        itemsize = np.dtype(DTYPES[dtype]).itemsize
        what = f"{file}: tensor {name!r} ({dtype} {list(shape)}) has bytes [{start}, {stop})"
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
            raise SafetensorsError(f"{what}, which is not a range of bytes")
        if stop - start != count * itemsize:
            raise SafetensorsError(f"{what}, {stop - start} bytes, but its dtype and shape "
                                   f"take {count * itemsize}: the header is inconsistent")
        if stop > data_size:
            raise SafetensorsError(f"{what}, beyond the file's {data_size} bytes of data: "
                                   f"the file is truncated")
        tensors[name] = TensorInfo(file, dtype, shape, data_start + start, data_start + stop)
    _check_overlaps(file, tensors, data_start)
    return tensors, metadata


def _check_overlaps(file: Path, tensors: dict[str, TensorInfo], data_start: int) -> None:
    """No two tensors share bytes (the ``safetensors`` library refuses such a file too)."""
    last: tuple[str, TensorInfo] | None = None
    for name, info in sorted(((n, i) for n, i in tensors.items() if i.stop > i.start),
                             key=lambda item: (item[1].start, item[1].stop)):
        if last is not None and info.start < last[1].stop:
            first, other = last
            raise SafetensorsError(
                f"{file}: tensors {first!r} and {name!r} overlap (`data_offsets` "
                f"[{other.start - data_start}, {other.stop - data_start}] and "
                f"[{info.start - data_start}, {info.stop - data_start}]): the header is "
                f"corrupt")
        if last is None or info.stop > last[1].stop:
            last = (name, info)


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: those of its index, else ``*.safetensors``."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise SafetensorsError(f"{index}: not a safetensors index (a JSON object with a "
                                   f"`weight_map`): {exc}") from None
        files = [folder / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise SafetensorsError(f"{index} lists {', '.join(missing)}, which "
                                   f"{'is' if len(missing) == 1 else 'are'} not in {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} holds no *.safetensors file (and no {INDEX_FILE}); "
                                "a transformers checkpoint saved with save_pretrained has them")
    return files


class Checkpoint(Mapping[str, np.ndarray]):
    """The tensors of a checkpoint's safetensors files, by name, read when asked for.

    Each value is a read-only NumPy array (float32 for bfloat16 tensors).
    ``dtypes`` gives each tensor's dtype in the file (``"BF16"``, ...).
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.infos: dict[str, TensorInfo] = {}
        for file in checkpoint_files(self.folder):
            tensors, _ = read_header(file)
            for name, info in tensors.items():
                if name in self.infos:
                    raise SafetensorsError(f"tensor {name!r} is in both {self.infos[name].file} "
                                           f"and {file}")
                self.infos[name] = info
        self._maps: dict[Path, np.memmap] = {}

    @property
    def dtypes(self) -> dict[str, str]:
        return {name: info.dtype for name, info in self.infos.items()}

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.infos[name]
        if info.file not in self._maps:
            self._maps[info.file] = np.memmap(info.file, dtype=np.uint8, mode="r")
        raw = self._maps[info.file][info.start:info.stop]
        data = np.frombuffer(raw, dtype=np.dtype(DTYPES[info.dtype]).newbyteorder("<"))
        if info.dtype == "BF16":
            # a bfloat16 is the upper half of the float32 of the same value
            data = (data.astype(np.uint32) << 16).view(np.float32)
        elif not data.dtype.isnative:
            data = data.astype(data.dtype.newbyteorder("="))  # pragma: no cover - big-endian
        return data.reshape(info.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.infos)

    def __len__(self) -> int:
        return len(self.infos)

    def describe(self, name: str) -> str:
        """``"BF16 [64, 32]"`` for a message."""
        info = self.infos[name]
        return f"{info.dtype} {list(info.shape)}"

