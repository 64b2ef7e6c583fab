"""ragserve.workflows (being built)."""
