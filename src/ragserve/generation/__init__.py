"""ragserve.generation (being built)."""
