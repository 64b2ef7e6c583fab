"""Incremental detokenization and stop conditions for one sequence."""

from __future__ import annotations

from typing import Any

from ragserve.generation.sequence import Sequence

# Decode a few tokens of context before the new ones so word boundaries come out right.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Appends the text of newly generated tokens to ``seq.text``.

    Text is released only when it no longer ends in an incomplete UTF-8 sequence, so
    multi-token characters appear once they are whole.
    """

    def __init__(self, tokenizer: Any, seq: Sequence):
        self.tokenizer = tokenizer
        self.read_offset = seq.num_prompt_tokens
        self.prefix_offset = max(seq.num_prompt_tokens - _CONTEXT_TOKENS, 0)

    def update(self, seq: Sequence) -> int:
        """Decode the sequence's new tokens into ``seq.text``; returns the old text length."""
        old_len = len(seq.text)
        if self.tokenizer is None:
            return old_len
        ids = seq.token_ids
        decode = self.tokenizer.decode
        prefix = decode(ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        full = decode(ids[self.prefix_offset :], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            seq.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(ids)
        return old_len


def find_stop(text: str, stops: tuple[str, ...], old_len: int) -> int | None:
    """Where the earliest stop string starts, looking only at matches that end in new text."""
    best = None
    for stop in stops:
        idx = text.find(stop, max(old_len - len(stop) + 1, 0))
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best


def check_finished(
    seq: Sequence, token_id: int, eos_token_ids: tuple[int, ...], max_model_len: int
) -> str | None:
    """The finish reason after ``token_id`` was appended, from token ids and lengths alone."""
    params = seq.params
    if not params.ignore_eos and token_id in eos_token_ids:
        return "stop"
    if token_id in params.stop_token_ids:
        return "stop"
    if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
