"""Builds the engine's KV tiers from its config (``make_kv_tiers``: the knowledge tree or the
plain block cache, the host tier, PGDSF's FLOP-derived cost model) and reports their
counters (``kv_tier_stats``). Measured cost models: ``bench/kv_cost_profile.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ragserve.generation.block_manager import BlockManager
from ragserve.generation.config import EngineConfig, ModelConfig
from ragserve.generation.kv_cache_manager import TieredBlockManager
from ragserve.generation.kv_swap import HostKVCache
from ragserve.generation.segments import whitespace_newline_counts


@dataclass(frozen=True)
class PrefillCostModel:
    """Prefill seconds of ``n`` new tokens after ``c`` cached ones:
    ``fixed_s + n * (per_token_s + per_token_context_s * (c + n / 2))``."""

    per_token_s: float
    per_token_context_s: float
    fixed_s: float = 0.0

    def __call__(self, num_tokens: int, num_context_tokens: int) -> float:
        attended = num_context_tokens + num_tokens / 2
        return self.fixed_s + num_tokens * (self.per_token_s + self.per_token_context_s * attended)

    @classmethod
    def from_flops(cls, cfg: ModelConfig, seconds_per_flop: float = 1e-12) -> PrefillCostModel:
        """Costs from the model's shape (2 FLOPs per weight, 4 per attended key) at
        ``seconds_per_flop`` (the default, 1 TFLOP/s, gives relative costs only)."""
        weights = cfg.num_hidden_layers * (
            cfg.hidden_size
            * cfg.head_dim
            * (cfg.num_attention_heads * 2 + cfg.num_key_value_heads * 2)
            + 3 * cfg.hidden_size * cfg.intermediate_size
        )
        attention = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim
        return cls(
            per_token_s=2.0 * weights * seconds_per_flop,
            per_token_context_s=attention * seconds_per_flop,
        )


def make_kv_tiers(
    config: EngineConfig,
    model_config: ModelConfig,
    model_runner: Any,
    tokenizer: Any,
    num_blocks: int,
) -> tuple[BlockManager | TieredBlockManager, HostKVCache | None]:
    """The block manager for ``config`` and the host tier's memory (``None`` without one)."""
    if not (config.enable_prefix_caching and config.enable_knowledge_tree):
        return BlockManager(num_blocks, config.block_size, config.enable_prefix_caching), None
    host = None
    per_block = model_runner.kv_cache[:, :, 0].numel() * model_runner.kv_cache.element_size()
    num_host_blocks = config.host_kv_cache_bytes // per_block
    if config.host_kv_cache_bytes and num_host_blocks == 0:
        raise ValueError(
            f"host_kv_cache_bytes={config.host_kv_cache_bytes} holds no block of {per_block} bytes"
        )
    if num_host_blocks:
        host = HostKVCache(
            model_runner.kv_cache,
            num_host_blocks,
            overlap=config.overlap_swap_in,
            async_swap_out=config.async_swap_out,
        )
    manager = TieredBlockManager(
        num_blocks,
        config.block_size,
        num_host_blocks=num_host_blocks,
        policy=config.kv_eviction_policy,
        cost_fn=PrefillCostModel.from_flops(model_config),
        newline_counts=whitespace_newline_counts(tokenizer),
        swap_out_filter=config.swap_out_filter,
    )
    return manager, host


def kv_tier_stats(
    bm: BlockManager | TieredBlockManager, host: HostKVCache | None, hit_tokens: int
) -> dict[str, int]:
    """The tier counters of ``LLMEngine.stats()`` (zeros where a tier does not exist)."""
    per_block = host.bytes_per_block if host is not None else 0
    tiered = isinstance(bm, TieredBlockManager)
    names = (
        "num_host_hit_tokens", "num_swapped_out_blocks", "num_swapped_in_blocks",
        "num_evicted_gpu_blocks", "num_evicted_host_blocks", "num_swap_skipped_blocks",
        "num_swap_out_skipped_blocks", "num_host_blocks_total",
    )  # fmt: skip
    stats = {name: getattr(bm, name.replace("_total", "")) if tiered else 0 for name in names}
    return stats | {
        "num_gpu_hit_tokens": bm.num_gpu_hit_tokens if tiered else hit_tokens,
        "num_swap_out_bytes": stats["num_swapped_out_blocks"] * per_block,
        "num_swap_in_bytes": stats["num_swapped_in_blocks"] * per_block,
        "num_swap_copies": host.num_copies if host is not None else 0,
        "num_kv_tree_nodes": len(bm.nodes) if tiered else 0,
        "num_host_blocks_used": bm.num_host_used_blocks if tiered else 0,
    }
