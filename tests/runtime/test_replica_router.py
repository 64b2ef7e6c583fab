"""``ReplicaRouter``: KV affinity by the prompt's document prefix, spilled when overloaded."""

from __future__ import annotations

import pytest

from ragserve.runtime.ray_backend import ReplicaRouter


def test_same_document_prefix_goes_to_the_same_replica() -> None:
    router = ReplicaRouter(4, affinity_chars=32, overload_slack=100)
    docs = "[1] Kenya\nThe capital of Kenya is Nairobi.\n\n"
    first = router.route("a", docs + "Question one?")
    assert router.route("b", docs + "A different question?") == first
    assert router.preferred(docs) == first
    prefixes = [f"[1] Document number {i} about something\n" for i in range(200)]
    assert {router.preferred(p) for p in prefixes} == {0, 1, 2, 3}  # keys spread over replicas
    assert router.stats() == {"affinity": 2, "spilled": 0}


def test_overloaded_replica_spills_to_the_least_loaded() -> None:
    router = ReplicaRouter(2, overload_slack=2)
    prompt = "same documents, same replica"
    home = router.preferred(prompt)
    routed = [router.route(f"t{i}", prompt) for i in range(5)]
    # home takes 3 (3 - 0 > 2 sends the 4th away), then 3 - 1 = 2 keeps the 5th home.
    assert routed == [home, home, home, 1 - home, home]
    assert router.loads[home] == 4 and router.loads[1 - home] == 1
    assert router.stats() == {"affinity": 4, "spilled": 1}
    assert router.finish("t0") == home and router.finish("t0") is None
    assert sorted(router.tasks_on(1 - home)) == ["t3"]
    assert router.replica_of("t3") == 1 - home
    with pytest.raises(ValueError, match="already routed"):
        router.route("t1", prompt)


def test_token_prompts_and_bad_arguments() -> None:
    router = ReplicaRouter(3)
    assert router.preferred((1, 2, 3)) == router.preferred([1, 2, 3])
    for kwargs, field in [
        ({"num_replicas": 0}, "num_replicas"),
        ({"num_replicas": 1, "affinity_chars": -1}, "affinity_chars"),
        ({"num_replicas": 1, "overload_slack": -1}, "overload_slack"),
    ]:
        with pytest.raises(ValueError, match=field):
            ReplicaRouter(**kwargs)


def test_a_replica_that_is_down_gets_no_new_tasks() -> None:
    router = ReplicaRouter(2, overload_slack=100)
    prompt = "documents whose home replica restarts"
    home = router.preferred(prompt)
    router.set_available(home, False)
    assert router.route("a", prompt) == 1 - home
    assert router.stats() == {"affinity": 0, "spilled": 1}
    router.set_available(home, True)
    assert router.route("b", prompt) == home
    router.set_available(0, False)
    router.set_available(1, False)
    assert router.route("c", prompt) == home  # none is up: the home replica's queue waits
