"""The five built-in workflows give, through operator nodes and the new scheduler, exactly the
outputs the implementation before them gave (``fixtures/builtin_outputs.json``, written by
``builtin_golden.py`` on the same seeded tiny model and small index)."""

from __future__ import annotations

import json
from pathlib import Path

from builtin_golden import outputs


def test_builtin_workflow_outputs_are_unchanged(local_server) -> None:
    expected = json.loads((Path(__file__).parent / "fixtures/builtin_outputs.json").read_text())
    actual = json.loads(json.dumps(outputs(local_server)))
    assert sorted(actual) == sorted(expected) and len(expected) == 15
    for key, want in expected.items():
        assert actual[key] == want, key
