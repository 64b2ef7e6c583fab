"""One place picks a results message's encoding by its estimated size: rows below
``small_message_bytes`` (or above a slot) ride pickled in the message, the others as Arrow
in the ring. Both sides of the threshold carry exactly the same values (empty results,
unicode, ``None`` metadata, errors, operator results)."""

from __future__ import annotations

import pickle

import pytest

from ragserve.graph import Passage
from ragserve.runtime.config import ServerConfig
from ragserve.runtime.shm import ShmRef, ShmRing, ShmWriter
from ragserve.runtime.wire import (
    GenerationResultsMsg,
    Outbox,
    RetrievalResultsMsg,
    generation_bytes,
    read_results,
    retrieval_bytes,
    uses_arrow,
)
from ragserve.scheduler import GenerationUpdate, RetrievalResult
from ragserve.scheduler.messages import OperatorResult, RetrievalPartial, StagedRetrievalResult

UPDATES = [
    GenerationUpdate("a", "héllo ✓", (5, 6), False, prompt_token_ids=(1, 2, 3)),
    GenerationUpdate("b", "", (), False),
    GenerationUpdate("c", "llo", (7,), True, "stop", prompt_token_ids=(), final_text="日本"),
    GenerationUpdate("d", "", (), True, "error", error="boom ✗", error_kind="internal"),
]
RESULTS = [
    RetrievalResult("r0", (Passage("d1", "one", "T", 0.5), Passage("d2", "twé 🙂", None, None))),
    RetrievalResult("r1", ()),
    RetrievalResult("r2", (), "bad filter", error_kind="bad_request"),
    StagedRetrievalResult("r3", (Passage("d3", "", "", 1.0),), hit_clusters=(4,), num_substages=3),
    RetrievalPartial("r4", (Passage("d4", "x\x00y", None, -0.0),), 2),
    OperatorResult("op", value=[0.5, 0.25]),
]


class _Conn:
    def __init__(self) -> None:
        self.sent: list = []

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(pickle.loads(data))


@pytest.fixture
def ring():
    ring = ShmRing(2, 1 << 16)
    yield ring
    ring.close()


def _cross(ring: ShmRing, small_message_bytes: int, rows: list, gen: bool):
    conn = _Conn()
    outbox = Outbox(conn, ShmWriter(ring.handle()), 1 << 28, small_message_bytes)
    outbox.send_generation(rows, {"running": 1}) if gen else outbox.send_retrieval(rows)
    (msg,) = conn.sent
    return msg, read_results(msg, ring)


@pytest.mark.parametrize("gen", [True, False])
def test_both_sides_of_the_threshold_carry_the_same_values(ring, gen: bool) -> None:
    rows = UPDATES if gen else RESULTS
    size = generation_bytes(rows) if gen else retrieval_bytes(rows)
    small, out_small = _cross(ring, size + 1, rows, gen)  # just above: pickled
    large, out_large = _cross(ring, size, rows, gen)  # at the estimate: Arrow
    assert small.payload is None and isinstance(large.payload, ShmRef)
    assert out_small == rows and out_large == rows
    assert [type(r) for r in out_large] == [type(r) for r in rows]
    if gen:
        assert small.stats == large.stats == {"running": 1}
        assert large.updates == ()
    else:
        assert all(not getattr(r, "passages", ()) for r in large.results)
    assert ring.num_free == 2


@pytest.mark.parametrize("gen", [True, False])
def test_an_empty_batch_crosses_either_way(ring, gen: bool) -> None:
    for threshold in (0, 1 << 10):
        msg, out = _cross(ring, threshold, [], gen)
        assert out == [] and (msg.payload is None) == (threshold > 0)


def test_the_estimate_grows_with_text_and_tokens() -> None:
    base = retrieval_bytes([RetrievalResult("r", (Passage("d", "ab"),))])
    assert retrieval_bytes([RetrievalResult("r", (Passage("d", "ab" * 100, "t"),))]) > base + 198
    assert retrieval_bytes([OperatorResult("op", value=1)]) > 0
    one = generation_bytes([GenerationUpdate("g", "", (1,), False)])
    prompt = generation_bytes([GenerationUpdate("g", "", (1,), False, prompt_token_ids=(1,) * 400)])
    assert prompt == one + 8 * 400
    assert uses_arrow(10, 10, 100) and uses_arrow(100, 10, 100) and uses_arrow(0, 0, 100)
    assert not uses_arrow(9, 10, 100) and not uses_arrow(101, 10, 100)


@pytest.mark.parametrize("gen", [True, False])
def test_rows_larger_than_a_slot_ride_pickled(ring, gen: bool) -> None:
    if gen:
        rows = [GenerationUpdate("g", "", (1,), False, prompt_token_ids=tuple(range(10_000)))]
    else:
        rows = [RetrievalResult("r", (Passage("d", "é" * 70_000, None, None),))]
    msg, out = _cross(ring, 0, rows, gen)  # Arrow for all that fits a slot of 64 KiB
    assert msg.payload is None and out == rows


def test_large_passages_go_to_shared_memory_by_default() -> None:
    config = ServerConfig()
    ring = ShmRing(2, config.shm_slot_bytes)
    try:
        big = [RetrievalResult("r", (Passage("d", "x" * (config.small_message_bytes // 4)),) * 4)]
        msg, out = _cross(ring, config.small_message_bytes, big, gen=False)
        assert isinstance(msg.payload, ShmRef) and out == big
    finally:
        ring.close()
    ring = ShmRing(2, 1 << 16)
    small = [
        RetrievalResult(f"r{i}", (Passage("d", "text " * 100, "T", 0.5),) * 3) for i in range(32)
    ]
    try:
        msg, out = _cross(ring, config.small_message_bytes, small, gen=False)
        assert msg.payload is None and out == small
    finally:
        ring.close()


def test_unpicklable_small_results_fail_their_tasks_cleanly(ring) -> None:
    bad = [OperatorResult("op", value=lambda: 1), RetrievalResult("r", (Passage("d", "t"),))]
    msg, out = _cross(ring, 1 << 10, bad, gen=False)
    assert [r.task_id for r in out] == ["op", "r"]
    assert all("cannot be sent back" in r.error for r in out)


def test_small_updates_that_do_not_match_their_task_ids_are_refused(ring) -> None:
    msg = GenerationResultsMsg(("a", "x"), None, None, tuple(UPDATES[:2]))
    with pytest.raises(ValueError, match="not those of its task ids"):
        read_results(msg, ring)
    assert read_results(RetrievalResultsMsg((), None), ring) == []


def test_the_threshold_is_checked_in_the_config() -> None:
    assert ServerConfig(small_message_bytes=0).small_message_bytes == 0
    with pytest.raises(ValueError, match="small_message_bytes"):
        ServerConfig(small_message_bytes=-1)
    with pytest.raises(ValueError, match="small_message_bytes"):
        ServerConfig(small_message_bytes=2048, max_message_bytes=1024)
