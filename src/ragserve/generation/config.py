"""Engine and model configuration: frozen dataclasses. ``EngineConfig`` is what the user asked
for (``"auto"`` allowed; the engine resolves it once with ``replace``); ``ModelConfig`` is the
architecture read from a Hugging Face ``config.json``. Also the errors the engine raises for bad
input (never for its own bugs)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ragserve.generation.kv_tree import KV_EVICTION_POLICIES


class ModelLoadError(ValueError):
    """A model folder cannot be loaded (the message names the offending file)."""


class PromptTooLongError(ValueError):
    """A prompt does not fit the model's context (``max_model_len``)."""


# HF architecture name -> (has q/k per-head RMSNorm, default attention bias)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (False, True),
    "Qwen3ForCausalLM": (True, False),
}

CPU_DEFAULT_KV_CACHE_BYTES = 512 * 1024**2
FUSION_SELECTORS = ("qcfuse", "cacheblend", "sift")


@dataclass(frozen=True)
class EngineConfig:
    """What an ``LLMEngine`` runs with. ``None``/``"auto"`` fields are resolved by the engine."""

    model: str
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.85  # CUDA: share of free memory after weights
    enable_prefix_caching: bool = True
    # Switches below: each optimization's off position is its exactness oracle; what each
    # does is in docs/architecture.md ("LLM engine", "Document-KV reuse", "Cache fusion").
    enable_knowledge_tree: bool = True  # False: the plain hashed-block cache (LRU, GPU only)
    host_kv_cache_bytes: int = 0  # host tier (pinned CPU memory on CUDA); 0: GPU tier only
    kv_eviction_policy: str = "pgdsf"  # "pgdsf" | "lru"
    overlap_swap_in: bool = True  # host hits load during another step's forward
    async_swap_out: bool = True  # swap-outs off the critical path (False: blocking)
    swap_out_filter: bool = True  # full host tier: copy out only what outranks its victim
    enable_cache_aware_scheduling: bool = True  # larger cached share admitted first, within
    cache_aware_fairness_window: int = 8  # this many pass-overs
    attention_backend: str = "auto"
    enable_cuda_graphs: bool = True  # CUDA: decode steps replay captured graphs (cuda_graph.py)
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights)
    max_model_len: int | None = None
    seed: int = 0
    # CPU: torch intra-op threads (None: torch's default). NOTE: on a small shared machine 1
    # thread is often several times faster for small models (OpenMP barriers stall).
    cpu_threads: int | None = None
    fusion_ratio: float | None = None  # default for keyed-segment prompts (None: full prefill)
    fusion_selector: str = "qcfuse"  # "qcfuse" | "cacheblend" | "sift"
    fusion_probe_layer: int | None = None  # None: num_layers // 4
    fusion_kv_cache_bytes: int = 256 * 1024**2  # passage store budgets, used without the tree
    fusion_host_kv_cache_bytes: int = 0
    fusion_paged_prefill: bool = True  # False: the dense per-request fused forward
    fusion_batch_misses: bool = True  # a step's uncached passages in one forward, not one each
    enable_step_isolation: bool = True  # a raising step fails only the requests that raise
    # NOTE: the idle-time integrity check walks every block (~3 ms at 12k): deferred, it runs
    # after the step's outputs are handed on (``run_deferred_checks``, else the next step).
    enable_deferred_integrity_check: bool = True
    enable_fast_detokenize: bool = True  # decode through a fast tokenizer's backend directly
    enable_async_scheduling: bool = True  # step n+1 launched before step n's tokens are read
    enable_packed_inputs: bool = True  # a step's index arrays in 2 host-to-device copies, not 9

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.block_size < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and block_size must be >= 1")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"unknown load_format {self.load_format!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError("cpu_threads must be None or >= 1")
        if self.host_kv_cache_bytes < 0:
            raise ValueError("host_kv_cache_bytes must be >= 0")
        if self.host_kv_cache_bytes and not (
            self.enable_prefix_caching and self.enable_knowledge_tree
        ):
            raise ValueError(
                "host_kv_cache_bytes needs enable_prefix_caching and enable_knowledge_tree"
            )
        if self.kv_eviction_policy not in KV_EVICTION_POLICIES:
            raise ValueError(
                f"unknown kv_eviction_policy {self.kv_eviction_policy!r}; "
                f"use one of {KV_EVICTION_POLICIES}"
            )
        if self.cache_aware_fairness_window < 0:
            raise ValueError("cache_aware_fairness_window must be >= 0")
        if self.fusion_ratio is not None and not 0.0 <= self.fusion_ratio <= 1.0:
            raise ValueError(f"fusion_ratio must be None or in [0, 1], got {self.fusion_ratio}")
        if self.fusion_selector not in FUSION_SELECTORS:
            raise ValueError(
                f"unknown fusion_selector {self.fusion_selector!r}: {FUSION_SELECTORS}"
            )
        if self.fusion_kv_cache_bytes < 0 or self.fusion_host_kv_cache_bytes < 0:
            raise ValueError("fusion_kv_cache_bytes and fusion_host_kv_cache_bytes must be >= 0")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture fields the engine needs, read from ``config.json``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ModelConfig:
        path, gen_path = Path(folder) / "config.json", Path(folder) / "generation_config.json"
        if not path.is_file():
            raise ModelLoadError(f"no config.json in model folder {folder}")
        config = cls.from_dict(_read_json(path), source=str(path))
        if not gen_path.is_file():
            return config
        gen_eos = _read_json(gen_path, lambda raw: _as_ids(raw.get("eos_token_id")))
        return replace(config, eos_token_ids=gen_eos) if gen_eos else config

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"{source}: unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        qk_norm, default_bias = SUPPORTED_ARCHITECTURES[arch]
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
            theta = rope.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
            if rope.get("rope_type", rope.get("type", "default")) == "default":
                rope = {}
            window = raw.get("sliding_window")
            if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
                window = None
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                attention_bias=bool(raw.get("attention_bias", default_bias)),
                qk_norm=qk_norm,
                rope_scaling=rope,
                sliding_window=int(window) if window else None,
                eos_token_ids=_as_ids(raw.get("eos_token_id")),
                torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: malformed model config ({e!r})") from e


def _read_json(path: Path, parse: Callable[[Any], Any] = lambda raw: raw) -> Any:
    try:
        return parse(json.loads(path.read_text()))
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from e


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
