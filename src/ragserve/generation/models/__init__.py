"""Model implementations: one decoder (``llama.py``) serves every supported architecture."""
