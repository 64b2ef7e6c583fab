"""``auto`` resolves to a backend that runs on the device; explicit names pass through."""

from __future__ import annotations

import pytest

from ragserve.generation.attention import available_backends, get_backend, resolve_backend, selector


def test_registry_names() -> None:
    assert {"torch_ref", "triton", "flex"} <= set(available_backends())
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


def test_auto_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_backend("auto", "cpu") == "torch_ref"
    assert resolve_backend("flex", "cpu") == "flex"
    monkeypatch.setattr(selector, "has_triton", lambda: True)
    assert resolve_backend("auto", "cuda") == "triton"
    monkeypatch.setattr(selector, "has_triton", lambda: False)
    assert resolve_backend("auto", "cuda") == "torch_ref"
