"""The contract between the model and an attention backend, the backends' registry, and
``torch_ref``: the reference backend (CPU, and the oracle for faster ones; one SDPA per sequence
over its gathered blocks). Per layer, ``k_cache``/``v_cache`` are ``[num_blocks, block_size,
num_kv_heads, head_dim]``; token ``t`` of a sequence is at slot ``block_table[t // block_size] *
block_size + t % block_size``. Sequence ``i`` brings ``query_lens[i]`` new tokens and attends to
``seq_lens[i]`` keys, causally::

    kv positions   0 .............. seq_len - query_len ........ seq_len - 1
                   [ already cached: prefix hit / earlier chunks ][ new tokens ]

With ``query_positions`` (cache fusion) new token ``j`` sits at ``query_positions[j]`` and
sees every kv position ``<= query_positions[j]``::

    kv positions   0 ..................................................... seq_len - 1
                   [ cached | new | cached ......... | new | cached | new new new ]
"""

from __future__ import annotations

import importlib.util
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionMetadata:
    """Batch layout of one step, shared by every layer (built once per step)."""

    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]: cumulative query_lens, starts at 0
    seq_lens: torch.Tensor  # int32 [num_seqs]: context length including the new tokens
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq], padded with 0
    slot_mapping: torch.Tensor  # int64 [num_tokens]: flat cache slot of each new token
    query_lens_cpu: tuple[int, ...]
    seq_lens_cpu: tuple[int, ...]
    # int64 [num_tokens]: kv position of each new token when not the last ``query_len`` ones
    query_positions: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu, default=0)

    @property
    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens_cpu)


class BaseAttentionBackend(ABC):
    """Paged attention for one model; ``forward`` writes the new tokens' keys and values at
    ``metadata.slot_mapping`` (its only mutation) and returns the attention output."""

    name: str = "base"
    supports_cuda_graphs: bool = False  # replayable: no host lengths read, slot -1 skipped

    def prepare(self, metadata: AttentionMetadata) -> None:  # noqa: B027 - optional hook
        """Called once per step before the first layer (e.g. to build masks once)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write the new tokens' keys/values into their cache slots (in place)."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache.view(flat).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(flat).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


_BACKENDS: dict[str, Callable[[], BaseAttentionBackend]] = {}


def register_backend(name: str) -> Callable:
    """Class decorator: make a backend constructible by name."""

    def wrap(cls: type[BaseAttentionBackend]) -> type[BaseAttentionBackend]:
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return wrap


def get_backend(name: str, device: torch.device | str = "cpu") -> BaseAttentionBackend:
    """A new backend ``name`` (``"auto"``: ``resolve_backend``'s choice for ``device``)."""
    name = resolve_backend(name, device)
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; known: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def available_backends() -> list[str]:
    return sorted(_BACKENDS)


def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve_backend(name: str, device: torch.device | str) -> str:
    """``name``, or for ``"auto"`` the fastest backend on ``device`` (BENCHMARKS.md)."""
    if name != "auto":
        return name
    device = torch.device(device)
    if device.type == "cuda" and has_triton():
        return "triton"
    if device.type == "cuda":
        logger.warning("triton is not installed; falling back to the torch_ref attention backend")
    return "torch_ref"


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cached tokens of a sequence: ``[seq_len, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


@register_backend("torch_ref")
class TorchRefBackend(BaseAttentionBackend):
    def forward(self, q, k, v, k_cache, v_cache, metadata: AttentionMetadata, scale: float):
        store_kv(k, v, k_cache, v_cache, metadata.slot_mapping)
        num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for i, (q_len, seq_len) in enumerate(
            zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
        ):
            qi = q[start : start + q_len].transpose(0, 1)  # [H, q_len, D]
            ki = gather_context(k_cache, metadata.block_tables[i], seq_len)
            vi = gather_context(v_cache, metadata.block_tables[i], seq_len)
            ki = ki.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
            vi = vi.transpose(0, 1).repeat_interleave(group, dim=0).to(q.dtype)
            if metadata.query_positions is None:
                q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            else:
                q_pos = metadata.query_positions[start : start + q_len]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start : start + q_len] = oi.transpose(0, 1)
            start += q_len
        return out
