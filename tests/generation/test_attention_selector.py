"""``auto`` resolves to a backend that runs on the device; explicit names pass through."""

from __future__ import annotations

import pytest

from ragserve.generation.attention import base
from ragserve.generation.attention.base import available_backends, get_backend, resolve_backend


def test_registry_names() -> None:
    assert {"torch_ref", "triton"} <= set(available_backends())
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("nope")


def test_auto_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_backend("auto", "cpu") == "torch_ref"
    assert resolve_backend("triton", "cpu") == "triton"
    monkeypatch.setattr(base, "has_triton", lambda: True)
    assert resolve_backend("auto", "cuda") == "triton"
    monkeypatch.setattr(base, "has_triton", lambda: False)
    assert resolve_backend("auto", "cuda") == "torch_ref"


def test_split_kv_rule() -> None:
    from ragserve.generation.attention.triton_backend import choose_num_splits

    # batch 1 over 8 kv heads: 32 splits to fill the GPU, but a 1k context has only 16 tiles
    assert choose_num_splits(1, 8, 1024, 64) == 16
    assert choose_num_splits(1, 8, None, 64) == 32  # CUDA graphs: independent of the length
    assert choose_num_splits(16, 8, None, 64) == 4
    assert choose_num_splits(64, 8, 1024, 64) == 1
    assert choose_num_splits(1, 8, 10, 64) == 1
