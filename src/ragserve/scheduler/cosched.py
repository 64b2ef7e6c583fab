"""``CoScheduleConfig``: which co-scheduling optimizations run (each exact), built once at the
edge; the runtime builds the transforms with ``make_transforms``."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ragserve.scheduler.similarity import SimilarityTransform, SpeculativeRetrievalTransform
from ragserve.scheduler.speculation import SpeculationTransform
from ragserve.scheduler.split import SplitTransform
from ragserve.scheduler.transforms import BaseTransform


@dataclass(frozen=True)
class CoScheduleConfig:
    """Switches and knobs of the co-scheduling transforms (``make_transforms``): ``split``,
    ``gen_chunks`` (only with ``split``), ``similarity``, ``speculation`` (``spec_*``) and the
    opt-in ``spec_retrieval`` (needs ``similarity``). ``auto`` (the default): the ``Server``
    resolves it once its workers are up (``resolve``); ``auto=False``: the switches as given."""

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
    auto: bool = True

    def __post_init__(self) -> None:
        if self.enable_spec_retrieval and not self.enable_similarity:
            raise ValueError("enable_spec_retrieval warms the similarity cache: enable both")

    @classmethod
    def none(cls) -> CoScheduleConfig:
        return cls(**_switches(()), auto=False)

    def resolve(self, tier_holds_index: bool) -> CoScheduleConfig:
        """The config that runs: ``auto`` turns every transform off when the GPU index tier
        holds every non-empty IVF list (a retrieval then takes less than the decode steps it
        would overlap: BENCHMARKS.md, issue 28); else the switches as given."""
        if self.auto and tier_holds_index:
            return replace(self, **_switches(()), auto=False)
        return replace(self, auto=False)

    @classmethod
    def from_names(cls, spec: str, **knobs: object) -> CoScheduleConfig:
        """``"auto"`` (the default: every transform, resolved by ``resolve``), ``"all"``
        (every transform, always), ``"off"``, or a comma list of ``OPTIMIZATIONS`` names:
        exactly those on. ``knobs`` set the other fields."""
        names = [n.strip() for n in spec.split(",") if n.strip()]
        knobs = {**knobs, "auto": names == ["auto"]}
        if names in (["all"], ["auto"]):
            return cls(**knobs)
        if names == ["off"] or names == ["none"]:
            return cls(**{**_switches(()), **knobs})
        unknown = [n for n in names if n not in OPTIMIZATIONS]
        if not names or unknown:
            raise ValueError(
                f"cosched: unknown optimization {', '.join(unknown) or repr(spec)}; use auto, "
                f"off, all or a comma list of {', '.join(OPTIMIZATIONS)}"
            )
        return cls(**{**_switches(names), **knobs})

    @property
    def enabled(self) -> tuple[str, ...]:
        on = [n for n in OPTIMIZATIONS if getattr(self, f"enable_{n}")]
        return tuple(n for n in on if n != "gen_chunks" or self.enable_split)


# The switchable optimizations, by the name ``--cosched`` and ``/health`` use.
OPTIMIZATIONS = tuple(
    f.name.removeprefix("enable_") for f in fields(CoScheduleConfig) if f.name.startswith("enable_")
)


def _switches(names: object) -> dict[str, bool]:
    return {f"enable_{n}": n in names for n in OPTIMIZATIONS}


def make_transforms(config: CoScheduleConfig) -> tuple[BaseTransform, ...]:
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
