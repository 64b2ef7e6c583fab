"""ragserve.scheduler (being built)."""
