"""``CoScheduleConfig``: which co-scheduling optimizations run, built once at the edge.

``ServerConfig(cosched=CoScheduleConfig(...))`` switches them on (the runtime builds the
transforms with ``make_transforms``); each is exact (split and reordered search return
Faiss's top-k, speculation keeps greedy outputs).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ragserve.scheduler.similarity import SimilarityTransform, SpeculativeRetrievalTransform
from ragserve.scheduler.speculation import SpeculationTransform
from ragserve.scheduler.split import SplitTransform
from ragserve.scheduler.transforms import BaseTransform


@dataclass(frozen=True)
class CoScheduleConfig:
    """Switches and knobs of the co-scheduling transforms.

    - ``enable_split``: retrieval sub-stages under the budget ``mb`` (``budget_s``; ``None``:
      Eq. 1 from the worker's measurements).
    - ``enable_gen_chunks`` (with ``enable_split``; no effect without it): generation
      sub-stages too: generation tasks report in chunks of decode steps of ``mb`` seconds
      instead of one update per token (``budget_s``, or with ``None`` the ``mb`` learned from
      split retrieval results; per-token updates until one is known). First token and final
      update are never delayed; outputs are identical. Speculative generations (started by
      the speculation transform, after the split) keep per-token updates; speculative
      retrieval fires on the first update at or past its fraction, so up to one chunk later
      (not at all when the rest of the generation fits in one chunk).
    - ``enable_similarity``: per-request local cache of the top-``cache_topk`` clusters and
      cluster reordering.
    - ``enable_speculation``: generation on partial top-k when in-flight generation tasks /
      ``spec_capacity`` < ``spec_tau``; ``spec_first_clusters`` > 0 cuts an early first
      sub-stage of that many clusters.
    - ``enable_spec_retrieval`` (opt-in): search with a generation's partial text once
      ``spec_retrieval_fraction`` of its tokens exist, to warm the next retrieval's cache.
    """

    enable_split: bool = True
    enable_gen_chunks: bool = True
    enable_similarity: bool = True
    enable_speculation: bool = True
    budget_s: float | None = None
    cache_topk: int = 20
    spec_tau: float = 0.75
    spec_capacity: int = 64
    spec_first_clusters: int = 0
    spec_max_restarts: int = 1
    enable_spec_retrieval: bool = False
    spec_retrieval_fraction: float = 0.5

    def __post_init__(self) -> None:
        if self.enable_spec_retrieval and not self.enable_similarity:
            raise ValueError("enable_spec_retrieval warms the similarity cache: enable both")

    @classmethod
    def none(cls) -> CoScheduleConfig:
        return cls(enable_split=False, enable_similarity=False, enable_speculation=False)

    @classmethod
    def from_names(cls, spec: str, **knobs: object) -> CoScheduleConfig:
        """``"all"`` (the defaults), ``"off"``, or a comma list of ``OPTIMIZATIONS`` names
        (``"split,similarity"``): exactly those switched on. ``knobs`` set the other fields."""
        names = [n.strip() for n in spec.split(",") if n.strip()]
        if names == ["all"]:
            return cls(**knobs)
        if names == ["off"] or names == ["none"]:
            return cls(**{**_switches(()), **knobs})
        unknown = [n for n in names if n not in OPTIMIZATIONS]
        if not names or unknown:
            raise ValueError(
                f"cosched: unknown optimization {', '.join(unknown) or repr(spec)}; use off, all "
                f"or a comma list of {', '.join(OPTIMIZATIONS)}"
            )
        return cls(**{**_switches(names), **knobs})

    @property
    def enabled(self) -> tuple[str, ...]:
        """Names of the optimizations that run (``gen_chunks`` only with ``split``)."""
        on = [n for n in OPTIMIZATIONS if getattr(self, f"enable_{n}")]
        return tuple(n for n in on if n != "gen_chunks" or self.enable_split)


# The switchable optimizations, by the name ``--cosched`` and ``/health`` use.
OPTIMIZATIONS = tuple(
    f.name.removeprefix("enable_") for f in fields(CoScheduleConfig) if f.name.startswith("enable_")
)


def _switches(names: object) -> dict[str, bool]:
    return {f"enable_{n}": n in names for n in OPTIMIZATIONS}


def make_transforms(config: CoScheduleConfig) -> tuple[BaseTransform, ...]:
    """The transforms for ``config``, in the order the scheduler must apply them."""
    out: list[BaseTransform] = []
    if config.enable_split:
        out.append(SplitTransform(config.budget_s, gen_chunks=config.enable_gen_chunks))
    if config.enable_similarity:
        similarity = SimilarityTransform(config.cache_topk)
        out.append(similarity)
        if config.enable_spec_retrieval:
            out.append(SpeculativeRetrievalTransform(similarity, config.spec_retrieval_fraction))
    if config.enable_speculation:
        out.append(
            SpeculationTransform(
                tau=config.spec_tau,
                capacity=config.spec_capacity,
                first_clusters=config.spec_first_clusters,
                max_restarts=config.spec_max_restarts,
            )
        )
    return tuple(out)
