"""Start-up plumbing of the GPU index tier: resolve ``ServerConfig.gpu_tier`` into the engine's
``kv_cache_bytes`` and the tier's ``budget_bytes`` (HedraRAG Eq. 2, ``scheduler.memory_split``).

```
gpu_memory_bytes (free on the device - model weights, or given)
  ├── KV cache: num_kv_blocks * block_bytes  -> engine_kwargs["kv_cache_bytes"]
  └── index tier                             -> WorkerSpec.tier_bytes / set_gpu_tier(...)
```

An explicit ``GpuTierConfig.budget_bytes`` or ``engine_kwargs["kv_cache_bytes"]`` overrides its
side; otherwise the split needs both measured profiles (``ValueError`` naming the field).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ragserve.runtime.config import ServerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierPlan:
    """What start-up resolved: the tier's bytes (``None``: no tier) and how (``source``)."""

    tier_bytes: int | None
    kv_cache_bytes: int | None
    source: str  # "off" | "override" | "eq2"


def plan_gpu_memory(config: ServerConfig, model: Any, index: Any) -> tuple[ServerConfig, TierPlan]:
    """``config`` with the engine's ``kv_cache_bytes`` set from the split, and the plan."""
    tier = config.gpu_tier
    if tier is None:
        return config, TierPlan(None, None, "off")
    engine = dict(config.engine_kwargs)
    kv = engine.get("kv_cache_bytes")
    if tier.budget_bytes is not None and (kv is not None or tier.device == "cpu"):
        return config, TierPlan(tier.budget_bytes, kv, "override")
    from ragserve.scheduler.memory_split import ThroughputProfile, solve_memory_split

    block_bytes = kv_block_bytes(model, engine)
    total = tier.gpu_memory_bytes or free_gpu_bytes(tier.device) - _weight_bytes(model, engine)
    gen = _profile(tier.generation_profile, "generation_profile", ThroughputProfile)
    ret = _profile(tier.retrieval_profile, "retrieval_profile", ThroughputProfile)
    if tier.budget_bytes is None and kv is None and (gen is None or ret is None):
        raise ValueError(
            "gpu_tier.budget_bytes: give a tier size, or generation_profile and "
            "retrieval_profile for Eq. 2"
        )
    split = solve_memory_split(
        total,
        block_bytes,
        gen,
        ret,
        max_index_bytes=_index_bytes(index),
        kv_cache_bytes=kv,
        index_tier_bytes=tier.budget_bytes,
    )
    engine["kv_cache_bytes"] = split.kv_cache_bytes
    logger.info(
        "GPU memory split (%s): KV %.2f GB (%d blocks), index tier %.2f GB",
        split.source,
        split.kv_cache_bytes / 1e9,
        split.num_kv_blocks,
        split.index_tier_bytes / 1e9,
    )
    resolved = dataclasses.replace(config, engine_kwargs=tuple(sorted(engine.items())))
    return resolved, TierPlan(split.index_tier_bytes, split.kv_cache_bytes, split.source)


def load_profiles(path: str | Path) -> dict[str, tuple[tuple[float, float], ...]]:
    """``{"generation_profile": [[kv_blocks, rps], ...], "retrieval_profile": [[bytes, rps],
    ...]}`` from a JSON file, as ``GpuTierConfig`` fields."""
    data = json.loads(Path(path).read_text())
    out = {}
    for key in ("generation_profile", "retrieval_profile"):
        if key not in data:
            raise ValueError(f"{path}: missing {key!r}")
        out[key] = tuple((float(a), float(b)) for a, b in data[key])
    return out


def _profile(points: Any, name: str, cls: Any) -> Any:
    if points is None:
        return None
    if not points:
        raise ValueError(f"gpu_tier.{name} must have at least one (size, rps) point")
    sizes, rps = zip(*points, strict=True)
    return cls(tuple(float(s) for s in sizes), tuple(float(r) for r in rps))


def kv_block_bytes(model: Any, engine_kwargs: dict[str, Any]) -> int:
    """Bytes of one KV block of ``model`` (an engine, a folder or a built-in name) under
    ``engine_kwargs`` (dtype, device, block_size)."""
    from ragserve.generation.config import ModelConfig
    from ragserve.generation.model_runner import kv_cache_bytes_per_block

    cfg = getattr(model, "model_config", None)
    cfg = cfg or ModelConfig.from_folder(model_folder(model, engine_kwargs))
    block = int(engine_kwargs.get("block_size", 16))
    dtype = kv_dtype(engine_kwargs.get("dtype", "auto"), engine_kwargs.get("device", "auto"))
    return int(kv_cache_bytes_per_block(cfg, block, dtype))


def free_gpu_bytes(device: str) -> int:
    """92 % of the free memory on CUDA ``device`` (``ValueError`` naming
    ``gpu_tier.gpu_memory_bytes`` when it cannot be measured)."""
    import torch

    if not device.startswith("cuda") or not torch.cuda.is_available():
        raise ValueError(
            f"gpu_tier.gpu_memory_bytes: cannot measure GPU memory on {device!r}; give it"
        )
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    return int(free * 0.92)  # NOTE: headroom for activations, CUDA graphs and the allocator


def _weight_bytes(model: Any, engine: dict[str, Any]) -> int:
    return sum(f.stat().st_size for f in model_folder(model, engine).glob("*.safetensors"))


def model_folder(model: Any, engine_kwargs: dict[str, Any]) -> Path:
    """The model's folder: a random-weight (``load_format="dummy"``) folder as is, else
    ``resolve_model``'s (built-in names converted on first use); ``ValueError`` for a live
    model."""
    if not isinstance(model, (str, Path)):
        raise ValueError("gpu_tier: the model must be a folder or a built-in name to plan memory")
    folder = Path(str(model))
    if engine_kwargs.get("load_format") == "dummy" and (folder / "config.json").is_file():
        return folder
    from ragserve.generation.builtin import resolve_model

    return resolve_model(model)


def _index_bytes(index: Any) -> int | None:
    from ragserve.retrieval import VectorIndex

    if isinstance(index, VectorIndex):
        return int(index.cluster_cost_bytes().sum())
    folder = Path(str(index))
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return None
    generation = int(json.loads(manifest.read_text()).get("generation", 1))
    from ragserve.retrieval.storage import snapshot_name

    snapshot = folder / snapshot_name(generation)
    return snapshot.stat().st_size if snapshot.is_file() else None


def kv_dtype(name: str, device: str = "auto") -> Any:
    """The torch dtype of the KV cache for the engine's ``dtype`` and ``device`` settings
    (``auto``: bfloat16 on CUDA, float32 on CPU, as ``LLMEngine`` resolves them)."""
    import torch

    if name == "auto":
        on_cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        return torch.bfloat16 if on_cuda else torch.float32
    return getattr(torch, name)
