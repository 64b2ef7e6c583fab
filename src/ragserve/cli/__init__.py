"""The ``ragserve`` command line."""
