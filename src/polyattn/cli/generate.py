"""``generate``: SmolLM2-135M-Instruct, or a transformers checkpoint (``--model``), continues
a prompt, token by token."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from polyattn.cli import system
from polyattn.cli.system import check_backend
from polyattn.cli.text import CLIError, _first_line, _plural, check_utf8, format_bytes

#: Array libraries ``generate`` runs on.
GENERATE_BACKENDS = ("numpy", "torch", "jax", "cupy")
#: The lowest ``--temperature`` above 0 that ``generate`` takes.
MIN_TEMPERATURE = 1e-3


def cache_bytes(config: Any, tokens: int, dtype: str) -> int:
    """Bytes of the keys and values of ``tokens`` tokens of one sequence, every layer.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> smollm2 = SimpleNamespace(num_layers=30, num_kv_heads=3, head_dim=64)
    >>> cache_bytes(smollm2, 100_005, "float32")      # 2 · 30 · 3 · 64 · 4 bytes a token
    4608230400
    """
    per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return per_token * tokens * np.dtype(dtype).itemsize


def _cache_bytes(model: Any, tokens: int, args: argparse.Namespace) -> int:
    """The model's own ``cache_nbytes(1, tokens)`` where it has one, else :func:`cache_bytes`."""
    nbytes = getattr(model, "cache_nbytes", None)
    if callable(nbytes):
        try:
            return int(nbytes(1, tokens))
        except (TypeError, ValueError):
            pass
    return cache_bytes(model.config, tokens, args.dtype)


def check_context(model: Any, prompt_tokens: int, args: argparse.Namespace) -> None:
    """Raise :class:`CLIError` if the prompt and ``--max-new-tokens`` overflow the context.

    The limit is the model's ``config.context_length`` (a model without one
    is not checked); the message says what the cache would take.
    """
    config = getattr(model, "config", None)
    limit = getattr(config, "context_length", None)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        return
    new = args.max_new_tokens
    total = prompt_tokens + new
    if total <= limit:
        return
    try:
        memory = f"; their cache would take {format_bytes(_cache_bytes(model, total, args))}"
    except (AttributeError, TypeError, ValueError):
        memory = ""
    if prompt_tokens >= limit:
        fix = (f"shorten the prompt to at most {limit - new:,} tokens" if new < limit else
               f"give --max-new-tokens {limit - 1:,} or less and shorten the prompt")
        raise CLIError(f"the prompt is {_plural(prompt_tokens, 'token')}, which leaves no room "
                       f"in the model's context of {limit:,} tokens for --max-new-tokens {new}"
                       f" ({total:,} tokens{memory}); {fix}")
    raise CLIError(f"--max-new-tokens {new} and the prompt's "
                   f"{_plural(prompt_tokens, 'token')} make {total:,} tokens, more than the "
                   f"model's context of {limit:,} tokens{memory}; give --max-new-tokens "
                   f"{limit - prompt_tokens} or less")


def check_memory(model: Any, prompt_tokens: int, args: argparse.Namespace) -> None:
    """Raise :class:`CLIError` if the cache of the prompt and ``--max-new-tokens`` would not
    fit in the memory available (:func:`available_memory`; not checked where that cannot
    be told, or for ``--backend cupy``, whose cache is on the GPU).

    The cache grows by the same bytes each token, so the message says how many
    new tokens do fit.
    """
    if args.backend == "cupy":
        return
    free = system.available_memory()
    if free is None:
        return
    total = prompt_tokens + args.max_new_tokens
    try:
        need, per_token = _cache_bytes(model, total, args), _cache_bytes(model, 1, args)
    except (AttributeError, TypeError, ValueError):
        return                      # a model that cannot say: MemoryError is the fallback
    if need <= free:
        return
    what = (f"--max-new-tokens {args.max_new_tokens} and the prompt's "
            f"{_plural(prompt_tokens, 'token')} make {total:,} tokens, whose cache would take "
            f"{format_bytes(need)} in {args.dtype}, but {format_bytes(free)} of memory is "
            f"available")
    fits = free // max(per_token, 1) - prompt_tokens
    if fits < 1:
        raise CLIError(f"{what}; not even one new token fits: free some memory or shorten the "
                       f"prompt")
    raise CLIError(f"{what}; give --max-new-tokens {fits} or less")


def check_generate_args(args: argparse.Namespace) -> None:
    """Every check on ``generate``'s arguments that can fail before the model is read.

    Raises
    ------
    CLIError
        With one line naming the argument and the fix.
    """
    check_utf8(args.prompt, "the prompt")
    if not args.prompt.strip():
        raise CLIError("the prompt is empty; give some text, e.g. "
                       "polyattn generate \"The capital of France is\"")
    if args.max_new_tokens < 1:
        raise CLIError(f"--max-new-tokens must be at least 1; got {args.max_new_tokens}")
    if not 0.0 <= args.temperature < float("inf"):
        raise CLIError(f"--temperature must be a finite number >= 0 (0: greedy); got "
                       f"{args.temperature}")
    if 0.0 < args.temperature < MIN_TEMPERATURE:
        raise CLIError(f"--temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}; "
                       f"got {args.temperature} (sampling that cold is greedy decoding in all "
                       "but name, and its scaled logits can overflow: give 0)")
    if args.seed is not None and args.seed < 0:
        raise CLIError(f"--seed must be a non-negative integer; got {args.seed}")
    check_backend(args.backend)
    folder = getattr(args, "model", None)
    if folder is not None:
        _check_checkpoint(folder, args)
        return
    from polyattn.models import smollm2

    try:
        smollm2.check_requirements()
    except (ImportError, FileNotFoundError) as exc:
        raise CLIError(_first_line(exc)) from exc


def _check_checkpoint(folder: str, args: argparse.Namespace) -> None:
    """``--model``: a folder with a config.json, and no ``--chat`` (SmolLM2's template)."""
    path = Path(folder)
    if not path.is_dir():
        raise CLIError(f"--model {folder}: not a folder; give the folder of a transformers "
                       "checkpoint (config.json, *.safetensors, tokenizer.json)")
    if not (path / "config.json").is_file():
        raise CLIError(f"--model {folder}: the folder has no config.json; give the folder of "
                       "a transformers checkpoint (as save_pretrained writes it)")
    if args.chat:
        raise CLIError("--chat puts the prompt in SmolLM2's chat template; with --model, write "
                       "the model's own template into the prompt")
    if not (path / "tokenizer.json").is_file():
        raise CLIError(f"--model {folder}: the folder has no tokenizer.json, which generate "
                       "needs to turn the prompt into tokens and back; copy the checkpoint's "
                       "tokenizer.json into it")


def _load(args: argparse.Namespace) -> Any:
    """The model ``generate`` runs: the checkpoint of ``--model``, else SmolLM2."""
    from polyattn.models import smollm2

    folder = getattr(args, "model", None)
    try:
        if folder is None:
            return smollm2.load(xp=args.backend, dtype=args.dtype)
        from polyattn.models import from_pretrained

        return from_pretrained(folder, xp=args.backend, dtype=args.dtype)
    except ImportError as exc:
        raise CLIError(f"--backend {args.backend}: {_first_line(exc)}") from exc
    except ValueError as exc:       # not a GGUF file or checkpoint of a supported model
        raise CLIError(_first_line(exc)) from exc
    except OSError as exc:          # unreadable: permissions, a device, a missing file, ...
        what = "the model file" if folder is None else f"--model {folder}"
        raise CLIError(f"cannot read {what}: {_first_line(exc)}") from exc


class _Text:
    """The text of new tokens, printed as soon as it is whole.

    SmolLM2's tokenizer gives each token's bytes (a character's UTF-8 bytes
    may span tokens: an incomplete one is held back until its last byte
    comes); a checkpoint's tokenizer decodes the prompt and the tokens so far
    together (a token's leading space may depend on what precedes it), and
    the text new since the last token is printed, a trailing U+FFFD (a
    character not yet whole) held back. Special tokens are not printed, nor
    ids past the tokenizer's vocabulary (embedding rows some checkpoints pad
    their vocabulary with).
    """

    def __init__(self, tok: Any, prompt: list[int]) -> None:
        import codecs

        self.tok = tok
        self.bytes = hasattr(tok, "token_bytes")
        self.special = set(tok.special) if self.bytes else set()
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.ids = list(prompt)
        self.shown = 0 if self.bytes else len(tok.decode(self.ids, skip_special_tokens=True))

    def add(self, token: int) -> str:
        if self.bytes:
            if self.tok.tokens[token] in self.special:
                return ""
            return str(self.utf8.decode(self.tok.token_bytes(token)))
        vocab = getattr(self.tok, "vocab_size", None)
        if isinstance(vocab, int) and not 0 <= token < vocab:
            return ""               # a row of the embeddings past the tokenizer's: no text
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        whole = text.rstrip("\ufffd")
        new, self.shown = whole[self.shown:], max(self.shown, len(whole))
        return new


def cmd_generate(args: argparse.Namespace) -> int:
    """``generate``: SmolLM2-135M-Instruct (or ``--model``'s checkpoint) continues a prompt,
    streamed token by token."""
    check_generate_args(args)
    from polyattn.models import smollm2

    start = time.perf_counter()
    model = _load(args)
    loaded = time.perf_counter()
    tok = model.tokenizer
    text = smollm2.chat_prompt(args.prompt) if args.chat else args.prompt
    try:
        ids = tok.encode(text)
    except FileNotFoundError as exc:    # a checkpoint without tokenizer.json
        raise CLIError(f"--model {args.model}: {_first_line(exc)}") from exc
    except ValueError as exc:
        raise CLIError(f"the prompt cannot be tokenized: {_first_line(exc)}") from exc
    if not len(ids):
        raise CLIError(f"the prompt {args.prompt!r} gives no tokens (the vocabulary has none of "
                       "its characters); give other text")
    check_context(model, len(ids), args)
    check_memory(model, len(ids), args)
    if args.seed is not None and args.temperature == 0.0:
        print("note: --seed has no effect without --temperature above 0 (greedy decoding "
              "draws nothing)", file=sys.stderr)
    # The prompt is printed with the first token, so that an argument the model
    # refuses (or memory it cannot get) is told before anything is on stdout.
    echo = "" if args.chat else args.prompt
    # A character's UTF-8 bytes may span tokens: it is held back until it is
    # whole, and one still incomplete when generation stops (cut by
    # --max-new-tokens) is left out, not shown as U+FFFD.
    shown = _Text(tok, list(ids))
    count = 0
    first = second = end = loaded
    try:
        for token in model.stream(ids, args.max_new_tokens, temperature=args.temperature,
                                  seed=args.seed):
            count += 1
            if count == 1:
                first = time.perf_counter()
                print(echo, end="", flush=True)
            elif count == 2:
                second = time.perf_counter()
            print(shown.add(token), end="", flush=True)
    except KeyboardInterrupt:
        if count:
            print(flush=True)       # end the text's line; the exit status says it was cut
        return 130
    except MemoryError as exc:
        if count:
            print(flush=True)       # end the text's line
        where = f"after {_plural(count, 'token')}" if count else "before the first token"
        raise CLIError(f"out of memory {where} ({_first_line(exc)}); give a smaller "
                       "--max-new-tokens or a shorter prompt, or free some memory") from None
    except ValueError as exc:
        if count:                   # not an argument the model refused: a failure midway
            raise
        raise CLIError(_first_line(exc)) from exc
    end = time.perf_counter()
    if not count:
        print(echo, end="")
    print()
    print(timing_line(count, len(ids), (start, loaded, first, end), args, second=second),
          file=sys.stderr)
    return 0


def timing_line(count: int, prompt_tokens: int, times: tuple[float, float, float, float],
                args: argparse.Namespace, *, second: float | None = None) -> str:
    """``generate``'s last line (on stderr): the tokens, the time, the speed.

    ``times`` are the clock's readings when the model began to be read, was
    read, gave its first token and its last; ``second``, when it gave its
    second. The first token's time is the prompt's. The first decode step
    (the second token) is timed on its own where ``second`` is given, as it
    may include one-off work (JAX compiles the decoding there): the speed is
    then that of the tokens after it, the steady decoding rate. Without
    ``second`` the speed is of every token after the first. No speed is
    given for a single token.

    Examples
    --------
    >>> from types import SimpleNamespace
    >>> args = SimpleNamespace(backend="numpy", dtype="float32")
    >>> timing_line(11, 3, (0.0, 1.0, 1.25, 2.25), args)  # doctest: +ELLIPSIS
    '11 tokens in 1.25 s: prompt of 3 tokens 250 ms, then 10.0 tokens/s (numpy, float32; ...'
    >>> timing_line(11, 3, (0.0, 1.0, 1.25, 2.25), args, second=1.35)  # doctest: +ELLIPSIS
    '11 tokens in 1.25 s: prompt of 3 tokens 250 ms, first decode step 100 ms, then 10.0 ...'
    >>> timing_line(1, 3, (0.0, 1.0, 1.25, 1.25), args)
    '1 token in 0.25 s: prompt of 3 tokens 250 ms (numpy, float32; model read in 1.0 s)'
    """
    start, loaded, first, end = times
    text = f"{_plural(count, 'token')} in {end - loaded:.2f} s"
    if count:
        text += f": prompt of {_plural(prompt_tokens, 'token')} {(first - loaded) * 1e3:.0f} ms"
    if second is not None and count > 1 and second >= first:
        text += f", first decode step {(second - first) * 1e3:.0f} ms"
        if count > 2 and end > second:
            text += f", then {(count - 2) / (end - second):.1f} tokens/s"
    elif count > 1 and end > first:
        text += f", then {(count - 1) / (end - first):.1f} tokens/s"
    return f"{text} ({args.backend}, {args.dtype}; model read in {loaded - start:.1f} s)"
