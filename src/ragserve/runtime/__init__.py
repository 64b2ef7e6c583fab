"""ragserve.runtime (being built)."""
