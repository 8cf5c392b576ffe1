"""The weights of a BERT encoder in ``model.safetensors``: read, checked, laid out.

Each tensor's dtype and shape are checked (against ``config.json``) before
its data is read, and its values after; :func:`_arrange` turns the
checkpoint's tensors into the (in, out) layout of :class:`~polyattn.models._bert.BertEncoder`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from polyattn.models._bert_config import BertConfig, _brief, _one_line, _printable
from polyattn.models._bert_files import _require

Array = Any
Namespace = Any

#: The safetensors dtypes read (and cast to the ``dtype`` asked for).
_FLOAT_DTYPES = ("F16", "F32", "F64")


def _expected_tensors(config: BertConfig) -> Iterator[tuple[str, tuple[int | None, ...], str]]:
    """Every tensor the encoder reads: ``(name, shape, the config fields behind the shape)``.

    ``None`` in a shape is any positive size (the token-type table, of which
    row 0 is used).
    """
    d, i = config.hidden_size, config.intermediate_size
    vec, square = ((d,), "(hidden_size,)"), ((d, d), "(hidden_size, hidden_size)")
    yield ("embeddings.word_embeddings.weight", (config.vocab_size, d),
           "(vocab_size, hidden_size)")
    yield ("embeddings.position_embeddings.weight", (config.max_position_embeddings, d),
           "(max_position_embeddings, hidden_size)")
    yield ("embeddings.token_type_embeddings.weight", (None, d),
           "(type_vocab_size, hidden_size)")
    yield ("embeddings.LayerNorm.weight", *vec)
    yield ("embeddings.LayerNorm.bias", *vec)
    for layer in range(config.num_layers):
        pre = f"encoder.layer.{layer}."
        for part in ("self.query", "self.key", "self.value", "output.dense"):
            yield (f"{pre}attention.{part}.weight", *square)
            yield (f"{pre}attention.{part}.bias", *vec)
        yield (f"{pre}attention.output.LayerNorm.weight", *vec)
        yield (f"{pre}attention.output.LayerNorm.bias", *vec)
        yield (f"{pre}intermediate.dense.weight", (i, d), "(intermediate_size, hidden_size)")
        yield (f"{pre}intermediate.dense.bias", (i,), "(intermediate_size,)")
        yield (f"{pre}output.dense.weight", (d, i), "(hidden_size, intermediate_size)")
        yield (f"{pre}output.dense.bias", *vec)
        yield (f"{pre}output.LayerNorm.weight", *vec)
        yield (f"{pre}output.LayerNorm.bias", *vec)


def _read_tensors(path: Path, config: BertConfig) -> dict[str, Any]:
    """The encoder's tensors in ``model.safetensors`` as NumPy arrays, each one checked.

    The safetensors library checks the header against the file's size before
    anything is read; each tensor's dtype and shape are checked before its
    data is, and its values after.
    """
    safetensors = _require("safetensors")
    where = _printable(path)
    try:
        with safetensors.safe_open(os.fspath(path), framework="numpy") as handle:
            names = set(handle.keys())
            _check_layer_count(names, config, where)
            return {name: _read_tensor(handle, names, name, shape, fields, where)
                    for name, shape, fields in _expected_tensors(config)}
    except safetensors.SafetensorError as exc:
        raise ValueError(f"{where} is not a readable safetensors file ({_one_line(exc)}); "
                         "expected the model.safetensors of a BERT model") from None


def _check_layer_count(names: set[str], config: BertConfig, where: str) -> None:
    """No tensor of an encoder layer beyond config.json's ``num_hidden_layers``."""
    prefix = "encoder.layer."
    n = config.num_layers
    for name in sorted(names):
        index = name[len(prefix):].split(".", 1)[0] if name.startswith(prefix) else ""
        if index.isdigit() and (len(index) > len(str(n)) or int(index) >= n):
            raise ValueError(f"{where}: tensor {_brief(name)} is of a layer beyond "
                             f"`num_hidden_layers` ({n}) in config.json; the config and the "
                             "weights are of different models")


def _read_tensor(handle: Any, names: set[str], name: str, shape: tuple[int | None, ...],
                 fields: str, where: str) -> Any:
    import numpy as np

    if name not in names:
        raise ValueError(f"{where}: tensor '{name}' is missing; a BERT encoder with this "
                         "config.json needs it")
    view = handle.get_slice(name)
    dtype = view.get_dtype()
    if dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{where}: tensor '{name}' has dtype {dtype}; expected F32 "
                         "(F16 and F64 are read too)")
    got = tuple(view.get_shape())
    if len(got) != len(shape) or any(g < 1 if e is None else g != e
                                     for g, e in zip(got, shape, strict=False)):
        want = str(shape)
        if shape[0] is None:
            want = "(n, " + ", ".join(str(e) for e in shape[1:]) + ") with n >= 1"
        raise ValueError(f"{where}: tensor '{name}' has shape {got}; expected {want}, "
                         f"{fields} from config.json")
    tensor = handle.get_tensor(name)
    if not np.isfinite(tensor).all():
        raise ValueError(f"{where}: tensor '{name}' holds NaN or inf")
    return tensor


def _arrange(tensors: dict[str, Any], config: BertConfig, xp: Namespace, dtype: Any,
             device: Any) -> dict[str, Any]:
    """Turn the checkpoint's tensors into the (in, out) layout of :class:`MiniLM`."""

    def put(name: str, *, linear: bool = False) -> Array:
        w = tensors[name]
        if linear:
            w = w.T.copy()  # torch Linear stores (out, in); polyattn uses x @ w
        return xp.asarray(w, dtype=dtype, device=device)

    params: dict[str, Any] = {
        "word": put("embeddings.word_embeddings.weight"),
        "position": put("embeddings.position_embeddings.weight"),
        "token_type": put("embeddings.token_type_embeddings.weight"),
        "ln_g": put("embeddings.LayerNorm.weight"),
        "ln_b": put("embeddings.LayerNorm.bias"),
        "layers": [],
    }
    for i in range(config.num_layers):
        pre = f"encoder.layer.{i}."
        attention = {}
        for ours, theirs in (("q", "self.query"), ("k", "self.key"), ("v", "self.value"),
                             ("o", "output.dense")):
            attention[f"w_{ours}"] = put(f"{pre}attention.{theirs}.weight", linear=True)
            attention[f"b_{ours}"] = put(f"{pre}attention.{theirs}.bias")
        params["layers"].append({
            "attention": attention,
            "ln1_g": put(f"{pre}attention.output.LayerNorm.weight"),
            "ln1_b": put(f"{pre}attention.output.LayerNorm.bias"),
            "w_in": put(f"{pre}intermediate.dense.weight", linear=True),
            "b_in": put(f"{pre}intermediate.dense.bias"),
            "w_out": put(f"{pre}output.dense.weight", linear=True),
            "b_out": put(f"{pre}output.dense.bias"),
            "ln2_g": put(f"{pre}output.LayerNorm.weight"),
            "ln2_b": put(f"{pre}output.LayerNorm.bias"),
        })
    return params
