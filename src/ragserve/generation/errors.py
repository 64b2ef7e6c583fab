"""Errors the engine raises for bad input (never for its own bugs)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model folder cannot be loaded (the message names the offending file)."""


class PromptTooLongError(ValueError):
    """A prompt does not fit the model's context (``max_model_len``)."""
