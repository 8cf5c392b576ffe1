"""Text from a decoder: greedy or sampled continuation of a batch of prompts, or a stream.

Prompts of different lengths are right-padded into one batch; each row's
new token is appended to the cache at that row's own length, so no padding
ever sits between a prompt and its continuation. Sampling runs on the host
(NumPy), seeded.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from polyattn.models._bpe import check_token_ids
from polyattn.models._decoder import Decoder
from polyattn.models._decoder_blocks import _plural, _to_numpy

Array = Any


@dataclass(frozen=True)
class _Step:
    """The new tokens of one generation step: one per row, ``None`` where a row has ended."""

    tokens: list[int | None]


def _eos_ids(tokenizer: Any) -> frozenset[int]:
    """The tokens that end a sequence: the tokenizer's ``eos_ids`` where it has several
    (Llama 3, gpt-oss), else its ``eos_id`` (none: nothing ends early)."""
    ids = getattr(tokenizer, "eos_ids", None)
    if ids is None:
        eos = getattr(tokenizer, "eos_id", None)
        ids = () if eos is None else (eos,)
    return frozenset(int(i) for i in ids)


class CausalLM(Decoder):
    """A :class:`~polyattn.models._decoder.Decoder` that continues prompts:
    :meth:`generate` for a batch, :meth:`stream` for one prompt, token by token."""

    def _steps(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
               seed: int | None, stop_at_eos: bool) -> Iterator[_Step]:
        """Greedy or sampled decoding of a right-padded batch, one step at a time."""
        xp = self.xp
        b = len(prompts)
        lens = [len(p) for p in prompts]
        t = max(lens)
        pad = self.tokenizer.pad_id if self.tokenizer.pad_id is not None else 0
        ids = np.full((b, t), pad, dtype=np.int64)
        for row, p in enumerate(prompts):
            ids[row, :len(p)] = p
        cache = self.new_cache(b, t + max_new_tokens)
        ragged = len(set(lens)) > 1
        hidden = self.hidden_states(ids, cache, lengths=lens if ragged else None)  # (B, T, D)
        last = xp.asarray(np.arange(b) * t + np.asarray(lens) - 1, dtype=self._int,
                          device=self.device)
        h = xp.take(xp.reshape(hidden, (b * t, -1)), last, axis=0)      # (B, D)
        rng = np.random.default_rng(seed)
        done = [False] * b
        eos = _eos_ids(self.tokenizer)
        for step in range(max_new_tokens):
            logits = self.logits(h)                                     # (B, V)
            picked = self._pick(logits, temperature, rng)
            tokens: list[int | None] = [None if done[r] else picked[r] for r in range(b)]
            yield _Step(tokens)
            if stop_at_eos:
                done = [d or tok in eos for d, tok in zip(done, tokens, strict=True)]
            if all(done) or step == max_new_tokens - 1:
                return
            h = self.hidden_states(np.asarray(picked).reshape(b, 1), cache)  # (B, 1, D)
            h = xp.reshape(h, (b, -1))                                  # (B, D)

    def _pick(self, logits: Array, temperature: float, rng: np.random.Generator) -> list[int]:
        """The next token of each row: the most likely, or drawn at ``temperature``."""
        if temperature == 0.0:
            return [int(i) for i in _to_numpy(self.xp.argmax(logits, axis=-1))]
        z = _to_numpy(logits).astype(np.float64)                        # (B, V)
        # shift before dividing: the maximum lands on 0 and the rest at or below it, so
        # however cold the temperature, the quotients only underflow exp() to 0
        z -= z.max(axis=-1, keepdims=True)
        with np.errstate(over="ignore"):
            z /= temperature
        p = np.exp(z)
        p /= p.sum(axis=-1, keepdims=True)
        return [int(rng.choice(p.shape[-1], p=row)) for row in p]

    def _prompts(self, token_ids: Any) -> tuple[list[list[int]], bool]:
        """A batch of prompts as lists of ints, and whether one prompt was given."""
        if isinstance(token_ids, str):
            raise TypeError("`token_ids` must be token ids, not text; use "
                            "model.tokenizer.encode(text)")
        host = token_ids if isinstance(token_ids, (list, tuple)) else _to_numpy(token_ids)
        if not isinstance(host, (list, tuple)) and np.ndim(host) == 0:
            raise TypeError(f"`token_ids` must be a list of ints (one prompt) or of lists of "
                            f"ints (a batch); got {type(token_ids).__name__}")
        vocab = self.config.vocab_size
        single = len(host) > 0 and not any(isinstance(p, (list, tuple)) or np.ndim(p)
                                           for p in host)
        prompts = [check_token_ids(host, vocab)] if single else [
            check_token_ids(p, vocab) for p in host]
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token; got an empty one")
        return prompts, single

    def _check_room(self, prompts: list[list[int]], max_new_tokens: int) -> None:
        """The longest prompt and ``max_new_tokens`` fit the context, or a ValueError."""
        t, b, ctx = max(len(p) for p in prompts), len(prompts), self.config.context_length
        if t + max_new_tokens > ctx:
            fix = (f"ask for at most {ctx - t} new tokens" if t < ctx else
                   f"shorten the prompt to at most {ctx - max_new_tokens} tokens"
                   if max_new_tokens < ctx else
                   f"ask for at most {ctx - 1} new tokens and shorten the prompt")
            longest = " (the longest)" if b > 1 else ""
            raise self._too_long(f"a prompt of {_plural(t, 'token')}{longest} and "
                                 f"`max_new_tokens` = {max_new_tokens} make",
                                 t + max_new_tokens, fix, rows=b)

    @staticmethod
    def _check_generation(max_new_tokens: Any, temperature: Any, seed: Any
                          ) -> tuple[int, float]:
        """``max_new_tokens`` as an int and ``temperature`` as a float, once checked."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
            raise TypeError(f"`max_new_tokens` must be an int; got "
                            f"{type(max_new_tokens).__name__} {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"`max_new_tokens` must be a positive int; got {int(max_new_tokens)}")
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise TypeError(f"`temperature` must be a real number >= 0 (0: greedy); got "
                            f"{type(temperature).__name__} {temperature!r}")
        if not 0.0 <= float(temperature) < float("inf"):
            raise ValueError(f"`temperature` must be a finite number >= 0 (0: greedy); got "
                             f"{temperature!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(
                seed, numbers.Integral)):
            raise TypeError(f"`seed` must be a non-negative int or None; got "
                            f"{type(seed).__name__} {seed!r}")
        if seed is not None and seed < 0:
            raise ValueError(f"`seed` must be a non-negative int or None; got {seed!r}")
        return int(max_new_tokens), float(temperature)

    def generate(self, token_ids: Any, max_new_tokens: int, *, temperature: float = 0.0,
                 seed: int | None = None, stop_at_eos: bool = True) -> Any:
        """Continue one prompt, or a batch of prompts of different lengths.

        Parameters
        ----------
        token_ids : list of int, or list of lists of int
            One prompt, or several (no padding needed: they are right-padded
            here, and each row continues from its own length).
        max_new_tokens : int
            Tokens to produce per prompt, at most (at least 1; with the
            longest prompt, at most ``config.context_length``).
        temperature : float
            0 (default): greedy, always the most likely token. Above 0:
            tokens are drawn from ``softmax(logits / temperature)``.
        seed : int, optional
            Seed of the draws, a non-negative int (with greedy decoding,
            temperature 0, nothing is drawn and the seed has no effect).
        stop_at_eos : bool
            End a prompt's continuation after an end-of-sequence token
            (SmolLM2's ``<|im_end|>``; those of the checkpoint's
            configuration), which is included.

        Returns
        -------
        list of int, or list of lists of int
            The new tokens only (not the prompt), per prompt.

        Raises
        ------
        TypeError
            ``token_ids`` is text or holds something that is not an integer;
            ``max_new_tokens`` is not an int (``1e15``, ``True``, …).
        ValueError
            A token id outside the vocabulary; ``max_new_tokens`` below 1;
            the longest prompt and ``max_new_tokens`` together more than the
            model's context (``config.context_length``): nothing is
            allocated then, and the message says what the cache would take.
        """
        max_new_tokens, temperature = self._check_generation(max_new_tokens, temperature, seed)
        prompts, single = self._prompts(token_ids)
        self._check_room(prompts, max_new_tokens)
        out: list[list[int]] = [[] for _ in prompts]
        for step in self._steps(prompts, max_new_tokens, temperature, seed, stop_at_eos):
            for row, tok in enumerate(step.tokens):
                if tok is not None:
                    out[row].append(tok)
        return out[0] if single else out

    def stream(self, token_ids: Sequence[int], max_new_tokens: int, *,
               temperature: float = 0.0, seed: int | None = None,
               stop_at_eos: bool = True) -> Iterator[int]:
        """:meth:`generate` for one prompt, yielding each token as soon as it is chosen.

        The arguments are checked when it is called, before the first token
        is asked for; the errors are :meth:`generate`'s.
        """
        max_new_tokens, temperature = self._check_generation(max_new_tokens, temperature, seed)
        prompts, single = self._prompts(token_ids)
        if not single:
            raise ValueError("stream() takes one prompt (a list of token ids); use generate() "
                             "for a batch")
        self._check_room(prompts, max_new_tokens)
        return self._stream(prompts, max_new_tokens, temperature, seed, stop_at_eos)

    def _stream(self, prompts: list[list[int]], max_new_tokens: int, temperature: float,
                seed: int | None, stop_at_eos: bool) -> Iterator[int]:
        """The tokens of :meth:`stream`, its arguments checked."""
        for step in self._steps(prompts, max_new_tokens, temperature, seed, stop_at_eos):
            tok = step.tokens[0]
            if tok is not None:
                yield tok
