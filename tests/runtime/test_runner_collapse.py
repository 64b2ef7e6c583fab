"""Section collapsing in retrieval nodes' runners: a dense, unfiltered task on an index with
sections equals `search_text(..., collapse_sections=True)` (the plain runner and the staged,
step-wise one, partials collapsed too, the short-of-sections case finished by a deeper
search); `collapse_sections=False` or an index without sections is the Faiss one-shot top-k
and never goes through `search_text`."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from ragserve.retrieval import Document, VectorIndex
from ragserve.retrieval.collapse import FETCH_FACTOR, section_key
from ragserve.runtime.staged_retrieval import StagedRetrievalRunner
from ragserve.scheduler import RetrievalTask
from ragserve.scheduler.messages import RetrievalPartial, StagedRetrievalTask

WORDS = ("apple", "banana", "cherry", "grape", "lemon", "mango", "olive", "peach", "plum")
QUERIES = ("apple", "apple plum", "lemon grape olive", "mango peach banana")


class Bow:
    name, dim = "bow", 16

    def encode(self, texts, *, is_query: bool, progress: bool = False) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            for w in t.split():
                out[i, zlib.crc32(w.encode()) % self.dim] += 1
            out[i] /= max(float(np.linalg.norm(out[i])), 1e-6)
        return out


def _corpus(sectioned: bool) -> list[Document]:
    """12 sections; section 0: 60 "apple" passages (more than topk * FETCH_FACTOR), the
    others 1-6 passages of random words. Without `sectioned`, no passage has a section."""
    rng = np.random.default_rng(3)
    docs = []
    for s in range(12):
        for c in range(60 if s == 0 else 1 + s % 6):
            words = ["apple"] * 3 if s == 0 else list(rng.choice(WORDS, 5))
            meta = {"source": f"f{s % 3}.rst", "section": f"Part {s}"} if sectioned else {}
            docs.append(Document(f"s{s}.{c}", " ".join(words), f"Part {s}", meta))
    return docs


def _index(sectioned: bool) -> VectorIndex:
    emb = Bow()
    docs = _corpus(sectioned)
    x = emb.encode([f"{d.title}: {d.text}" for d in docs], is_query=False)
    return VectorIndex.from_vectors(docs, x, embedder_name="bow", nlist=8, nprobe=6, embedder=emb)


@pytest.fixture
def sectioned():
    vi = _index(True)
    yield vi
    vi.close()


@pytest.fixture
def plain():
    vi = _index(False)
    yield vi
    vi.close()


def _drive(runner: StagedRetrievalRunner, tasks: list) -> tuple[dict, dict]:
    """Run ``tasks`` to the end; final results and partials by task id."""
    finals, partials = {}, {}
    updates = runner.run(tasks)
    while True:
        for u in updates:
            if isinstance(u, RetrievalPartial):
                partials.setdefault(u.task_id, []).append(u)
            else:
                finals[u.task_id] = u
        if not runner.has_pending():
            return finals, partials
        updates = runner.run([])


def _staged(task_id: str, query: str, topk: int, **kwargs) -> StagedRetrievalTask:
    return StagedRetrievalTask(
        task_id, query, topk, split=True, budget_s=1e-9, emit_partials=True, **kwargs
    )


def _ids(passages) -> list[str]:
    return [p.doc_id for p in passages]


def _sections(vi: VectorIndex, passages) -> list:
    return [section_key(d) for d in vi.get_documents(_ids(passages))]


def _one_shot(vi: VectorIndex, query: str, topk: int) -> list:
    found = vi.search(vi.embedder.encode([query], is_query=True), topk)
    return vi.documents_of(found)[0]


def _same(vi: VectorIndex, got, want) -> None:
    """Same sections and scores in order (equal scores may swap passages of one section:
    section 0's passages are identical)."""
    assert _sections(vi, got) == [section_key(h.document) for h in want]
    assert [p.score for p in got] == pytest.approx([h.score for h in want])


def _collapsed(vi: VectorIndex, query: str, topk: int) -> list:
    return vi.search_text([query], topk, mode="dense", collapse_sections=True)[0]


@pytest.mark.parametrize("staged", [False, True])
def test_collapsed_node_equals_search_text(sectioned: VectorIndex, staged: bool) -> None:
    runner = StagedRetrievalRunner(sectioned, sectioned.embedder)
    make = _staged if staged else RetrievalTask
    tasks = [make(f"t{i}", q, 5) for i, q in enumerate(QUERIES)]
    tasks.append(make("off", "apple", 5, collapse_sections=False))
    finals, partials = _drive(runner, tasks)
    assert sectioned.collapse_sections and sectioned.has_sections
    for i, q in enumerate(QUERIES):
        got = finals[f"t{i}"].passages
        _same(sectioned, got, _collapsed(sectioned, q, 5))
        assert len(set(_sections(sectioned, got))) == len(got) == 5
    # "apple": the 60 passages of section 0 fill the step-wise top 5 * FETCH_FACTOR, so the
    # staged runner finishes it with a deeper search; uncollapsed it is the one-shot top 5
    assert 5 * FETCH_FACTOR < 60 and len(finals["t0"].passages) == 5
    _same(sectioned, finals["off"].passages, _one_shot(sectioned, "apple", 5))
    assert {p.doc_id.split(".")[0] for p in finals["off"].passages} == {"s0"}
    if staged:
        assert partials  # sub-stages ran; every partial has one passage per section
        for task_id, task_partials in partials.items():
            for part in task_partials:
                sections = _sections(sectioned, part.passages)
                if task_id == "off":
                    assert len(sections) <= 5
                else:
                    assert len(set(sections)) == len(sections) <= 5


def test_collapsed_staged_task_that_needs_no_deeper_search(sectioned: VectorIndex) -> None:
    runner = StagedRetrievalRunner(sectioned, sectioned.embedder)
    calls = []
    search_text = sectioned.search_text
    sectioned.search_text = lambda *a, **k: calls.append(a) or search_text(*a, **k)
    finals, _ = _drive(runner, [_staged("t", "apple plum", 4, cache_topk=30)])
    sectioned.search_text = search_text
    assert calls == []  # collapsed from its own step-wise ranking (4 * FETCH_FACTOR deep)
    plain_top = _one_shot(sectioned, "apple plum", 4)  # section 11 twice: collapsing shows
    assert len({section_key(h.document) for h in plain_top}) < 4
    _same(sectioned, finals["t"].passages, _collapsed(sectioned, "apple plum", 4))
    assert finals["t"].hit_clusters  # the cache still sees the uncollapsed top cache_topk


@pytest.mark.parametrize("staged", [False, True])
def test_index_without_sections_stays_faiss_one_shot(plain: VectorIndex, staged: bool) -> None:
    runner = StagedRetrievalRunner(plain, plain.embedder)
    plain.search_text = None  # never called: nothing to collapse
    make = _staged if staged else RetrievalTask
    tasks = [make(f"t{i}", q, 6, collapse_sections=i % 2 == 0) for i, q in enumerate(QUERIES)]
    finals, _ = _drive(runner, tasks)
    assert plain.collapse_sections and not plain.has_sections
    for i, q in enumerate(QUERIES):
        assert _ids(finals[f"t{i}"].passages) == [h.id for h in _one_shot(plain, q, 6)]


def test_index_switched_off_and_sections_added_later(plain: VectorIndex) -> None:
    runner = StagedRetrievalRunner(plain, plain.embedder)
    assert not runner.collapses(RetrievalTask("t", "apple", 5))
    extra = [Document(f"x{c}", "apple apple apple", "X", {"source_id": "x"}) for c in range(3)]
    plain.add_documents(extra)
    assert plain.has_sections and runner.collapses(RetrievalTask("t", "apple", 5))
    plain.metadata["collapse_sections"] = False  # `ragserve index build --no-collapse-sections`
    assert not runner.collapses(RetrievalTask("t", "apple", 5))
    assert runner.collapses(RetrievalTask("t", "apple", 5, collapse_sections=True))
    with pytest.raises(ValueError, match="collapse_sections"):
        plain.collapses("yes")


@pytest.mark.parametrize("staged", [False, True])
def test_bad_collapse_value_fails_its_task_only(sectioned: VectorIndex, staged: bool) -> None:
    from ragserve.runtime.staged_retrieval import run_isolated

    runner = StagedRetrievalRunner(sectioned, sectioned.embedder)
    make = _staged if staged else RetrievalTask
    tasks = [make("bad", "apple", 5, collapse_sections="yes"), make("ok", "lemon", 5)]
    finals = {r.task_id: r for r in run_isolated(runner, tasks)}
    while runner.has_pending():
        finals.update((r.task_id, r) for r in runner.run([]) if not isinstance(r, RetrievalPartial))
    assert "collapse_sections" in finals["bad"].error and finals["bad"].passages == ()
    assert finals["ok"].error is None
    _same(sectioned, finals["ok"].passages, _collapsed(sectioned, "lemon", 5))
