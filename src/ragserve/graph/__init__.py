"""ragserve.graph (being built)."""
