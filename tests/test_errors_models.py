"""Bad input to the real models and the command line: one clear error each.

The companion of ``test_errors.py`` for :mod:`polyattn.models` (model files are
untrusted input: GGUF and MiniLM files, tokenizer arguments, generation beyond
the context) and for ``polyattn`` on the command line (one line on stderr, exit
status 2). ``docs/errors_models_table.rst`` lists these cases with the actual
messages; :func:`test_errors_models_table_is_current` keeps it in step
(``python tests/test_errors_models.py`` rewrites it). Files are written under
one temporary folder, shown as ``…`` in the table.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import struct
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from polyattn.models import _bpe

#: Where the cases write their files; ``…`` in the table.
FILES = Path(tempfile.gettempdir()) / "polyattn-error-cases"
TABLE = Path(__file__).resolve().parents[1] / "docs" / "errors_models_table.rst"


@dataclass(frozen=True)
class Case:
    """``call()`` raises ``error`` whose message holds ``pieces``, in order."""

    name: str
    function: str
    call: Callable[[], object]
    error: type[Exception]
    pieces: tuple[str, ...]

    @property
    def pattern(self) -> str:
        return ".*".join(re.escape(p) for p in self.pieces)


def _require(*modules: str) -> None:
    for module in modules:
        pytest.importorskip(module, reason=f"this case needs {module}")


def _file(name: str, content: bytes) -> Path:
    FILES.mkdir(parents=True, exist_ok=True)
    path = FILES / name
    path.write_bytes(content)
    return path


def _gguf_string(text: str) -> bytes:
    data = text.encode()
    return struct.pack("<Q", len(data)) + data


def _u8_array_claiming(count: int) -> bytes:
    """A GGUF header with one metadata entry: a uint8 array that claims ``count`` items."""
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_string("test.bytes")
            + struct.pack("<IIQ", 9, 0, count) + b"\0" * 16)


def _load_gguf(name: str, content: bytes | None = None, **changes) -> Callable[[], object]:
    def call():
        _require("gguf")
        from polyattn.models import smollm2

        if content is not None:
            path = _file(name, content)
        else:
            from test_gguf_reader import write_model

            FILES.mkdir(parents=True, exist_ok=True)
            path = write_model(FILES / name, **changes)
        return smollm2.load(path)
    return call


def _tokenizer() -> _bpe.BPETokenizer:
    table = _bpe.bytes_to_unicode()
    return _bpe.BPETokenizer([table[b] for b in range(256)] + ["<|e|>"], [],
                             token_types=[1] * 256 + [3], engine="python")


def _tiny_model():
    _require("gguf")
    from test_gguf_reader import write_model

    from polyattn.models import smollm2

    FILES.mkdir(parents=True, exist_ok=True)
    return smollm2.load(write_model(FILES / "tiny.gguf"))


def _minilm(name: str, **changes) -> Callable[[], object]:
    def call():
        _require("safetensors", "tokenizers")
        from test_minilm_files import _DROP, tiny_config, write_model

        from polyattn.models import minilm

        directory = FILES / name
        directory.mkdir(parents=True, exist_ok=True)
        write_model(directory, config=tiny_config(
            **{k: _DROP if v == "drop" else v for k, v in changes.items()}))
        return minilm.MiniLM.load(directory)
    return call


def _gguf_meta(**entries):
    from test_gguf_reader import BASE_META

    return {key: (value, *BASE_META[key][1:]) if value is not None else None
            for key, value in entries.items()}


def _gguf_without(tensor: str):
    return {tensor: None}


def _short_embedding():
    from test_gguf_reader import D, V

    return {"token_embd.weight": np.zeros((V - 1, D), dtype=np.float32)}


def _with(factory, key):
    """``_load_gguf`` arguments computed when the case runs (gguf may be missing)."""
    def call():
        _require("gguf")
        return _load_gguf(f"{key}.gguf", **factory())()
    return call


#: A one-layer Llama of transformers' config.json, D = 8, 2 heads over 1 key/value head.
_LLAMA = {"model_type": "llama", "vocab_size": 16, "hidden_size": 8, "intermediate_size": 12,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "tie_word_embeddings": True}
_LLAMA_TENSORS = {"embed_tokens": (16, 8), "norm": (8,), "layers.0.input_layernorm": (8,),
                  "layers.0.post_attention_layernorm": (8,),
                  "layers.0.self_attn.q_proj": (8, 8), "layers.0.self_attn.k_proj": (4, 8),
                  "layers.0.self_attn.v_proj": (4, 8), "layers.0.self_attn.o_proj": (8, 8),
                  "layers.0.mlp.gate_proj": (12, 8), "layers.0.mlp.up_proj": (12, 8),
                  "layers.0.mlp.down_proj": (8, 12)}


def _checkpoint(name: str, shapes=None, **config) -> Path:
    """A transformers checkpoint folder: config.json (``_LLAMA`` with ``config``), and a
    model.safetensors of zeros of ``shapes`` (written by hand: no safetensors needed)."""
    import json

    folder = FILES / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**_LLAMA, **config}))
    header, data = {}, b""
    for tensor, shape in (shapes or _LLAMA_TENSORS).items():
        raw = np.zeros(shape, dtype=np.float32).tobytes()
        header[f"model.{tensor}.weight"] = {"dtype": "F32", "shape": list(shape),
                                            "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(len(head).to_bytes(8, "little") + head + data)
    return folder


def _from_pretrained(name: str, shapes=None, **config) -> Callable[[], object]:
    def call():
        from polyattn.models import from_pretrained

        return from_pretrained(_checkpoint(name, shapes, **config))
    return call


def _overlapping() -> Callable[[], object]:
    """A checkpoint whose ``model.norm.weight`` is given bytes inside another tensor's."""
    def call():
        import json

        from polyattn.models import from_pretrained

        folder = _checkpoint("hf-overlap")
        file = folder / "model.safetensors"
        data = file.read_bytes()
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + n])
        header["model.norm.weight"]["data_offsets"] = [4, 36]       # inside the embeddings
        head = json.dumps(header).encode()
        file.write_bytes(len(head).to_bytes(8, "little") + head + data[8 + n:])
        return from_pretrained(folder)
    return call


def _from_pretrained_as(name: str, **kwargs) -> Callable[[], object]:
    def call():
        from polyattn.models import from_pretrained

        return from_pretrained(_checkpoint(name), **kwargs)
    return call


CASES = [
    # the GGUF reader
    Case("empty file", "smollm2.load", _load_gguf("empty.gguf", b""),
         ValueError, ("cannot read", "empty.gguf", "as a GGUF file", "magic bytes")),
    Case("uint8 array claiming 2^60 items", "smollm2.load",
         _load_gguf("huge-array.gguf", _u8_array_claiming(1 << 60)),
         ValueError, ("huge-array.gguf", "`test.bytes`", "1152921504606846976 elements",
                      "truncated or corrupt")),
    Case("head_count 0", "smollm2.load",
         _with(lambda: {"meta": _gguf_meta(**{"llama.attention.head_count": 0})}, "heads0"),
         ValueError, ("heads0.gguf", "`llama.attention.head_count`", "integer >= 1", "got 0")),
    Case("missing hyper-parameter", "smollm2.load",
         _with(lambda: {"meta": {"llama.block_count": None}}, "no-layers"),
         ValueError, ("no-layers.gguf", "`llama.block_count`", "missing")),
    Case("missing tensor", "smollm2.load",
         _with(lambda: {"tensors": _gguf_without("output_norm.weight")}, "no-norm"),
         ValueError, ("no-norm.gguf", "`output_norm.weight`", "missing")),
    Case("embedding shorter than the vocabulary", "smollm2.load",
         _with(lambda: {"tensors": _short_embedding()}, "short-embedding"),
         ValueError, ("short-embedding.gguf", "`token_embd.weight`", "vocab_size")),
    # the tokenizer
    Case("float token id", "BPETokenizer.decode", lambda: _tokenizer().decode([1.5]),
         TypeError, ("`token_ids`", "ints", "float 1.5")),
    Case("token id outside the vocabulary", "BPETokenizer.decode",
         lambda: _tokenizer().decode([257]),
         ValueError, ("`token_ids`", "[0, 257)", "got 257")),
    Case("lone surrogate", "BPETokenizer.encode", lambda: _tokenizer().encode("hi\udcff"),
         ValueError, ("`text`", "lone surrogate U+DCFF", "errors='replace'")),
    # generation
    Case("beyond the context", "SmolLM2.generate",
         lambda: _tiny_model().generate([1], 100_000),
         ValueError, ("`max_new_tokens`", "context of 64 tokens", "cache", "at most 63")),
    Case("max_new_tokens a float", "SmolLM2.generate", lambda: _tiny_model().generate([1], 1e15),
         TypeError, ("`max_new_tokens`", "int", "float")),
    Case("cache beyond the context", "SmolLM2.new_cache",
         lambda: _tiny_model().new_cache(1, 65),
         ValueError, ("`capacity`", "65 tokens", "context of 64 tokens")),
    # transformers checkpoints
    Case("unsupported architecture", "from_pretrained",
         _from_pretrained("hf-mistral", model_type="mistral"),
         ValueError, ("config.json", "`model_type` 'mistral' is not supported", "supported: "
                      "gemma2, gemma3, gemma3_text, gpt_oss, llama, qwen3")),
    Case("rope type not implemented", "from_pretrained",
         _from_pretrained("hf-dynamic", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                         "rope_theta": 10000.0}),
         ValueError, ("config.json", "`rope_parameters`", "rope_type 'dynamic'",
                      "not implemented")),
    Case("quantized weights", "from_pretrained",
         _from_pretrained("hf-mxfp4", quantization_config={"quant_method": "mxfp4"}),
         ValueError, ("config.json", "`quantization_config`", "'mxfp4'", "dequantize")),
    Case("tensor of the wrong shape", "from_pretrained",
         _from_pretrained("hf-shape", intermediate_size=10),
         ValueError, ("`model.layers.0.mlp.gate_proj.weight`", "[12, 8]", "expected [10, 8]",
                      "(intermediate_size, hidden_size)")),
    Case("config.json without model_type", "from_pretrained",
         _from_pretrained("hf-no-type", model_type=None),
         ValueError, ("config.json", "has no `model_type`", "supported: gemma2")),
    Case("tensors sharing bytes", "from_pretrained", _overlapping(),
         ValueError, ("model.safetensors", "tensors 'model.embed_tokens.weight' and "
                      "'model.norm.weight' overlap", "corrupt")),
    Case("dtype not floating", "from_pretrained", _from_pretrained_as("hf-int", dtype="int32"),
         TypeError, ("`dtype` must be a real floating dtype", "for numpy", "'int32'")),
    Case("dtype of another library", "from_pretrained",
         lambda: _require("torch") or _from_pretrained_as(
             "hf-torch-dtype", dtype=__import__("torch").float64)(),
         TypeError, ("`dtype`", "of numpy", "torch.float64, a torch dtype")),
    Case("text without tokenizer.json", "PretrainedLM.tokenizer.encode",
         lambda: _from_pretrained("hf-no-tokenizer")().tokenizer.encode("hi"),
         FileNotFoundError, ("has no tokenizer.json", "pass token ids to generate()")),
    # MiniLM files
    Case("config.json without a hyper-parameter", "MiniLM.load",
         _minilm("minilm-no-vocab", vocab_size="drop"),
         ValueError, ("config.json", "`vocab_size`", "missing")),
    Case("heads that do not divide hidden_size", "MiniLM.load",
         _minilm("minilm-heads", num_attention_heads=3),
         ValueError, ("config.json", "`hidden_size`", "`num_attention_heads` (3)")),
]

#: ``polyattn`` arguments that must end as one line on stderr with exit status 2.
COMMANDS = [
    ("unknown option", ["--bogus"], ("unrecognized arguments: --bogus",)),
    ("no command", [], ("give a command",)),
    ("invalid choice", ["demo", "--backend", "x"], ("--backend", "invalid choice: 'x'")),
    ("new tokens not a whole number", ["generate", "hi", "--max-new-tokens", "1.5"],
     ("--max-new-tokens", "whole number")),
    ("prompt not UTF-8", ["generate", "\udcff\udcfe"], ("prompt", "not valid UTF-8")),
    ("--model not a folder", ["generate", "hi", "--model", "/no/such/checkpoint"],
     ("--model /no/such/checkpoint", "not a folder")),
    ("sentence not UTF-8", ["demo", "--model", "minilm", "--sentence", "\udcff\udcfe"],
     ("--sentence", "not valid UTF-8")),
    ("shape beyond memory", ["bench", "--shape", "99999999999,1,1,1"],
     ("--shape", "naive baseline needs", "available")),
    ("repeat too large", ["bench", "--repeat", "1e9"], ("--repeat", "at most")),
    ("heatmap not a PNG", ["demo", "--save-png", "weights.txt"], ("--save-png", ".png")),
    ("bad environment variable", ["POLYATTN_SCORE_BUDGET=lots", "info"],
     ("POLYATTN_SCORE_BUDGET", "got 'lots'")),
]


def _id(case: Case) -> str:
    return f"{case.function}-{case.name.replace(' ', '_')}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_bad_model_input(case):
    with pytest.raises(case.error, match=case.pattern):
        case.call()


def _run_cli(argv: list[str]) -> tuple[int, str]:
    """``polyattn argv`` in this process; leading ``NAME=value`` items set variables."""
    from polyattn.cli import main

    settings = {}
    while argv and "=" in argv[0] and argv[0].split("=")[0].isupper():
        name, value = argv[0].split("=", 1)
        settings[name], argv = value, argv[1:]
    saved = {name: os.environ.get(name) for name in settings}
    err = io.StringIO()
    try:
        os.environ.update(settings)
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    return code, err.getvalue()


@pytest.mark.parametrize(("name", "argv", "pieces"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_bad_command_line(name, argv, pieces):
    code, err = _run_cli(argv)
    assert code == 2, f"{argv}: exit status {code}"
    assert err.count("\n") == 1 and err.endswith("\n"), f"{argv}: not one line: {err!r}"
    assert re.search(".*".join(re.escape(p) for p in pieces), err), err


# --------------------------------------------------------------------------- #
# docs/errors_models_table.rst
# --------------------------------------------------------------------------- #

HEADER = [
    ":orphan:",
    "",
    ".. This file is generated by ``python tests/test_errors_models.py``; do not edit it",
    "   by hand.",
    "",
    "Errors of the models and the command line",
    "=========================================",
    "",
    "Model files are untrusted input: a malformed GGUF or MiniLM file is one",
    "``ValueError`` at load time naming the file and the field, with no allocation",
    "beyond what the file's size allows. (``…`` stands for the file's folder.) On",
    "the command line every bad argument is one line on stderr and exit status 2,",
    "before any work is done.",
    "",
    ".. list-table::",
    "   :header-rows: 1",
    "   :widths: 18 22 12 48",
    "",
    "   * - Function",
    "     - Case",
    "     - Exception",
    "     - Example message",
]

CLI_HEADER = [
    "",
    ".. list-table::",
    "   :header-rows: 1",
    "   :widths: 30 70",
    "",
    "   * - Command",
    "     - Message (exit status 2)",
]


def _message(case: Case) -> str:
    try:
        case.call()
    except case.error as exc:
        return str(exc).replace(str(FILES), "…")
    raise AssertionError(f"{_id(case)} did not raise")  # pragma: no cover


def render_row(case: Case) -> str:
    return "\n".join([f"   * - ``{case.function}``", f"     - {case.name}",
                      f"     - ``{case.error.__name__}``", f"     - ``{_message(case)}``"])


def _shell(arg: str) -> str:
    """``arg`` as a shell would be given it: bytes that are not UTF-8 as ``$'\\xff'``."""
    if all(c.isprintable() for c in arg):
        return arg
    return "$'" + "".join(f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else c
                          for c in arg) + "'"


def render_command(argv: list[str]) -> str:
    settings = [a for a in argv if "=" in a and a.split("=")[0].isupper()]
    shown = " ".join([*settings, "polyattn", *map(_shell, argv[len(settings):])])
    message = _run_cli(argv)[1].strip()
    # the memory free now is the machine's, not the message's
    message = re.sub(r"but [^;]* of memory is available", "but … of memory is available",
                     message)
    return f"   * - ``{shown}``\n     - ``{message}``"


def render_table() -> str:
    return "\n".join([*HEADER, *(render_row(c) for c in CASES), *CLI_HEADER,
                      *(render_command(argv) for _, argv, _ in COMMANDS)]) + "\n"


def test_errors_models_table_is_current():
    """Every case has its row in docs/errors_models_table.rst, with today's message."""
    if not TABLE.exists():
        pytest.skip(f"{TABLE} is not part of this checkout")
    text = TABLE.read_text(encoding="utf-8")
    assert text.count("\n   * - ``") == len(CASES) + len(COMMANDS), "rows and cases differ"
    stale = [_id(c) for c in CASES if render_row(c) not in text]
    stale += [name for name, argv, _ in COMMANDS if render_command(argv) not in text]
    assert not stale, f"stale rows {stale}: run `python tests/test_errors_models.py`"


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    TABLE.write_text(render_table(), encoding="utf-8")
    print(f"wrote {TABLE}")
