"""Cache fusion: reuse each keyed passage's KV at any position (CacheBlend / QCFuse)."""

from ragserve.generation.config import FUSION_SELECTORS
from ragserve.generation.fusion.prefill import FusionRunner
from ragserve.generation.fusion.store import PassageKVStore
from ragserve.generation.segments import FusionPlan, Segment, paragraph_segments, tokenize_segments

__all__ = [
    "FUSION_SELECTORS",
    "FusionPlan",
    "FusionRunner",
    "PassageKVStore",
    "Segment",
    "paragraph_segments",
    "tokenize_segments",
]
