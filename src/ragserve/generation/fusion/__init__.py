"""Cache fusion: reuse each keyed passage's KV at any position (CacheBlend / QCFuse).

A request whose prompt is a list of ``Segment``s and that carries a ``fusion_ratio`` has its
keyed segments' KV taken from a ``PassageKVStore`` (computed once, alone, at positions
``0..n-1``), re-rotated to where the segment lands, and ``ratio`` of each segment's tokens
recomputed with full attention over the whole prompt; every unkeyed token is computed.
"""

from ragserve.generation.fusion.prefill import FusionRunner
from ragserve.generation.fusion.selectors import FUSION_SELECTORS
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
