"""ragserve.server (being built)."""
