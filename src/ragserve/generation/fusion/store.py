"""The passage KV store used without the knowledge tree (one per engine): each passage's KV
computed alone, keyed by its key, checked against its token ids; LRU within a device budget, then a
host tier within a host budget."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class _Entry:
    token_ids: tuple[int, ...]
    kv: torch.Tensor
    on_device: bool

    @property
    def num_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


class PassageKVStore:
    """Owns stored passage KV; ``get`` may move entries between tiers, ``put`` may evict."""

    def __init__(self, device: torch.device, device_bytes: int, host_bytes: int):
        if device_bytes < 0 or host_bytes < 0:
            raise ValueError("device_bytes and host_bytes must be >= 0")
        self.device = device
        self.device_bytes = device_bytes
        self.host_bytes = host_bytes
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        self.num_hits = 0
        self.num_host_hits = 0
        self.num_misses = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def num_device_bytes(self) -> int:
        return sum(e.num_bytes for e in self._entries.values() if e.on_device)

    @property
    def num_host_bytes(self) -> int:
        return sum(e.num_bytes for e in self._entries.values() if not e.on_device)

    def get(self, key: str, token_ids: list[int]) -> torch.Tensor | None:
        """The stored KV of passage ``key`` on the device if it holds exactly ``token_ids``."""
        entry = self._entries.get(key)
        if entry is None or entry.token_ids != tuple(token_ids):
            self.num_misses += 1
            return None
        self._entries.move_to_end(key)
        self.num_hits += 1
        if not entry.on_device:
            self.num_host_hits += 1
            entry.kv = entry.kv.to(self.device, non_blocking=True)
            entry.on_device = True
            self._fit()
        return entry.kv

    def put(self, key: str, token_ids: list[int], kv: torch.Tensor) -> None:
        """Store (or replace) passage ``key``; an entry larger than the device budget is not
        kept. Evicts least recently used entries to fit."""
        self._entries.pop(key, None)
        entry = _Entry(tuple(token_ids), kv, on_device=True)
        if entry.num_bytes > self.device_bytes:
            return
        self._entries[key] = entry
        self._fit()

    def _fit(self) -> None:
        device_used = self.num_device_bytes
        for key, entry in list(self._entries.items())[:-1]:  # the newest stays on the device
            if device_used <= self.device_bytes:
                break
            if entry.on_device:
                device_used -= entry.num_bytes
                self._to_host(key, entry)
        host_used = self.num_host_bytes
        for key, entry in list(self._entries.items()):
            if host_used <= self.host_bytes:
                break
            if not entry.on_device:
                host_used -= entry.num_bytes
                del self._entries[key]
                self.num_evicted += 1

    def _to_host(self, key: str, entry: _Entry) -> None:
        if entry.num_bytes > self.host_bytes:
            del self._entries[key]
            self.num_evicted += 1
            return
        host = entry.kv.to("cpu")
        entry.kv = host.pin_memory() if self.device.type == "cuda" else host
        entry.on_device = False
