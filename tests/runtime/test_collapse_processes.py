"""Section collapsing in workflows, through the real worker processes (spawned engine and
retrieval workers, the default co-scheduling: retrievals run staged, step-wise): a retrieval
node on an index with sections returns what `search_text(..., collapse_sections=True)`
returns; a node with `collapse_sections=False` returns the Faiss one-shot top-k."""

from __future__ import annotations

import pytest

from ragserve.graph import END, START, RAGraph
from ragserve.retrieval import Document, VectorIndex, load_embedder
from ragserve.retrieval.collapse import section_key
from ragserve.runtime import Server, ServerConfig

pytestmark = pytest.mark.integration

CITIES = ("Paris", "Berlin", "Rome", "Madrid", "Tokyo", "Nairobi", "Cairo", "Lima")
QUESTIONS = ("What is the capital of France?", "Which city has bronze gates?", "Tell me about Rome")


def _corpus() -> list[Document]:
    """One long "Capitals" section cut into 12 passages (they rank together), then one short
    section per city."""
    docs = [
        Document(
            f"guide.md#{c}",
            f"The capital of France is Paris; part {c} of the capitals overview lists it again.",
            "Guide > Capitals",
            {"source": "guide.md", "section": "Guide > Capitals", "chunk": c},
        )
        for c in range(12)
    ]
    for city in CITIES:
        for c, text in enumerate((f"{city} is a capital city.", f"{city} has bronze gates.")):
            meta = {"source": f"{city}.md", "section": city, "chunk": c}
            docs.append(Document(f"{city}.md#{c}", text, city, meta))
    return docs


@pytest.fixture(scope="module")
def sectioned_index(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, dict]:
    """The saved index, and per question the collapsed and the uncollapsed top 5 ids."""
    index = VectorIndex.build(_corpus(), load_embedder("all-minilm-l6-v2"), nlist=4, nprobe=4)
    assert index.collapse_sections and index.has_sections
    collapsed = {q: index.search_text([q], 5, collapse_sections=True)[0] for q in QUESTIONS}
    plain = {q: index.search_text([q], 5, collapse_sections=False)[0] for q in QUESTIONS}
    first = QUESTIONS[0]  # the long section fills the plain top 5: collapsing changes it
    assert len({section_key(h.document) for h in plain[first]}) < 5
    assert len({section_key(h.document) for h in collapsed[first]}) == len(collapsed[first]) == 5
    out = tmp_path_factory.mktemp("collapse") / "index"
    index.save(out)
    index.close()
    ids = {q: [h.id for h in hits] for q, hits in collapsed.items()}
    return str(out), ids, {q: [h.id for h in hits] for q, hits in plain.items()}


def _graph() -> RAGraph:
    g = RAGraph("collapse")
    g.add_retrieval("default", query="input", topk=5, output="collapsed")
    g.add_retrieval("off", query="input", topk=5, output="plain", collapse_sections=False)
    g.add_function("join", lambda s: len(s["collapsed"]) + len(s["plain"]), output="n")
    g.add_edge(START, ("default", "off")).add_edge("default", "join").add_edge("off", "join")
    return g.add_edge("join", END)


def test_retrieval_nodes_collapse_through_the_worker_processes(
    tiny_model: str, sectioned_index: tuple[str, dict, dict]
) -> None:
    path, collapsed, plain = sectioned_index
    config = ServerConfig(engine_kwargs={"device": "cpu"})
    assert config.cosched.enabled  # retrievals run as staged tasks
    with Server(tiny_model, path, config=config) as server:
        for q in QUESTIONS:
            response = server.run(q, _graph())
            assert response.error is None, response.error
            assert [p.doc_id for p in response.state["collapsed"]] == collapsed[q], q
            assert [p.doc_id for p in response.state["plain"]] == plain[q], q
