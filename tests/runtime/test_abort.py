"""Aborts that overtake their request (the client gave up while the request was still on its
way to the scheduler), their bounded memory, and cancellation of ``submit`` / ``stream``."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ragserve.graph import END, START, RAGraph
from ragserve.runtime import Response, Server


def generate(max_tokens: int) -> RAGraph:
    g = RAGraph().add_generation(0, prompt="{input}", max_tokens=max_tokens)
    return g.add_edge(START, 0).add_edge(0, END)


def test_abort_before_the_request_sticks(local_server: Server) -> None:
    local_server.abort("early-1")
    r = local_server.run("Tell me about Peru.", generate(400), request_id="early-1")
    assert (r.error, r.error_kind) == ("aborted", "aborted")
    assert r.node_timings == ()  # nothing ran
    # the remembered abort is used up: the id serves a request again
    again = local_server.run("Tell me about Peru.", generate(2), request_id="early-1")
    assert again.error is None and again.error_kind is None
    assert local_server.stats()["num_active_requests"] == 0


def test_remembered_aborts_are_bounded_in_number_and_time(local_server: Server) -> None:
    scheduler = local_server.scheduler
    saved = scheduler.max_remembered_aborts, scheduler.abort_memory_s
    try:
        scheduler.max_remembered_aborts = 2
        for rid in ("bound-1", "bound-2", "bound-3"):
            local_server.abort(rid)
        assert local_server.run("q", generate(2), request_id="bound-1").error is None  # oldest
        assert local_server.run("q", generate(2), request_id="bound-3").error_kind == "aborted"
        scheduler.max_remembered_aborts = saved[0]
        scheduler.abort_memory_s = 0.0
        local_server.abort("expired-1")
        assert local_server.run("q", generate(2), request_id="expired-1").error is None
    finally:
        scheduler.max_remembered_aborts, scheduler.abort_memory_s = saved


@pytest.mark.parametrize("how", ["submit", "stream"])
def test_cancel_while_registering_aborts(
    local_server: Server, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Cancelled as soon as the registration thread starts: without the abort, the request
    would run its 400 tokens unwatched and finish without an error."""
    finished = threading.Event()
    box: list[Response] = []
    add_request = local_server.scheduler.add_request

    def spy(req):
        on_done = req.on_done
        req.on_done = lambda r: (box.append(r), finished.set(), on_done(r))
        add_request(req)

    monkeypatch.setattr(local_server.scheduler, "add_request", spy)

    async def go() -> None:
        if how == "submit":
            work = local_server.submit("Tell me about Chile.", generate(400), request_id="c-1")
        else:
            work = anext(local_server.stream("Tell me about Chile.", generate(400)))
        task = asyncio.ensure_future(work)
        await asyncio.sleep(0)  # the task starts; its registration runs in a thread
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert finished.wait(60)
    assert (box[0].error, box[0].error_kind) == ("aborted", "aborted")
