"""Incremental detokenization and stop conditions for one sequence."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ragserve.generation.sequence import Sequence

# Decode a few tokens of context before the new ones so word boundaries come out right.
_CONTEXT_TOKENS = 5


def make_decoder(tokenizer: Any, fast: bool = True) -> Callable[[list[int]], str] | None:
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=True)`` (``None``: no
    tokenizer); ``fast``: a plain fast tokenizer's Rust backend directly (half the cost)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    direct = fast and backend is not None and _plain_wrapper(tokenizer)
    decode = backend.decode if direct else tokenizer.decode
    return lambda ids: decode(ids, skip_special_tokens=True)


# transformers' own decode methods (4.x and 5.x): they pass the ids to the backend as they are
_PLAIN_DECODE = {"PreTrainedTokenizerBase.decode", "PreTrainedTokenizerFast.decode"}
_PLAIN_INNER_DECODE = {"PreTrainedTokenizerFast._decode", "TokenizersBackend._decode"}


def _plain_wrapper(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` is the backend's decode plus nothing: transformers' own
    ``decode``/``_decode`` (not a subclass's override) and no space clean-up."""
    cls = type(tokenizer)
    return (
        getattr(cls.decode, "__qualname__", None) in _PLAIN_DECODE
        and getattr(getattr(cls, "_decode", None), "__qualname__", None) in _PLAIN_INNER_DECODE
        and not getattr(tokenizer, "clean_up_tokenization_spaces", True)
    )


class IncrementalDetokenizer:
    """Appends the text of newly generated tokens to ``seq.text``, once it no longer ends in
    an incomplete UTF-8 sequence (``decode``: ``make_decoder``'s function)."""

    def __init__(
        self, tokenizer: Any, seq: Sequence, decode: Callable[[list[int]], str] | None = None
    ):
        self.tokenizer = tokenizer
        self.decode = decode or make_decoder(tokenizer, False)
        self.read_offset = seq.num_prompt_tokens
        self.prefix_offset = max(seq.num_prompt_tokens - _CONTEXT_TOKENS, 0)
        self._prefix_text: str | None = None  # decode of ids[prefix_offset:read_offset]

    def update(self, seq: Sequence) -> int:
        """Decode the sequence's new tokens into ``seq.text``; returns the old text length."""
        old_len = len(seq.text)
        if self.tokenizer is None:
            return old_len
        ids = seq.token_ids
        prefix = self._prefix_text
        if prefix is None:
            prefix = self._prefix_text = self.decode(ids[self.prefix_offset : self.read_offset])
        full = self.decode(ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            seq.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
            self._prefix_text = None
        return old_len


def find_stop(text: str, stops: tuple[str, ...], old_len: int) -> int | None:
    """Where the earliest stop string starts, looking only at matches that end in new text."""
    found = (text.find(stop, max(old_len - len(stop) + 1, 0)) for stop in stops)
    return min((i for i in found if i != -1), default=None)


def check_finished(
    seq: Sequence, token_id: int, eos_token_ids: tuple[int, ...], max_model_len: int
) -> str | None:
    """The finish reason after ``token_id`` was appended, from token ids and lengths alone."""
    params = seq.params
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_token_ids):
        return "stop"
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
