"""ragserve.retrieval (being built)."""
