"""The CLI's own error: a command-line mistake a handler found (``main`` exits with code 2)."""


class UsageError(ValueError):
    """A command-line mistake the handler found (exit code 2)."""
