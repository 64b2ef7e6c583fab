"""One in-process ``Server`` for the session's HTTP tests over the real runtime."""

from __future__ import annotations

import pytest
from stacks import tiny_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    with tiny_server(tmp_path_factory.mktemp("tiny-server")) as s:
        yield s
