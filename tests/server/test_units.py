"""Pure pieces of the HTTP front: workflow tuning, admission, stats flattening, config."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ragserve.server import ServeConfig
from ragserve.server.context import Admission
from ragserve.server.errors import APIError
from ragserve.server.graphs import resolve_workflow, tune_graph
from ragserve.server.metrics import ServerMetrics, flatten_stats
from ragserve.workflows import hyde, multistep


def test_tune_graph_without_overrides_is_identity() -> None:
    graph = hyde()
    assert tune_graph(graph) is graph


def test_tune_graph_touches_retrieval_and_answer_nodes_only() -> None:
    graph = multistep(rounds=2)
    tuned = tune_graph(
        graph, topk=7, nprobe=3, max_tokens=5, temperature=0.5, top_p=0.9, seed=3, stop=("END",)
    )
    assert (tuned.nodes[1].topk, tuned.nodes[1].nprobe) == (7, 3)
    assert tuned.nodes[3].max_tokens == 5 and tuned.nodes[3].temperature == 0.5
    assert (tuned.nodes[3].top_p, tuned.nodes[3].seed) == (0.9, 3)
    assert tuned.nodes[3].stop == ("END",)
    assert tuned.nodes[0] == graph.nodes[0]  # the sub-question step keeps its own settings
    assert tuned.nodes[0].stop == ("\n",)
    assert tuned.edges is graph.edges
    assert graph.nodes[1].topk == 2 and graph.nodes[3].max_tokens == 64  # original untouched


def test_tune_graph_adds_stop_strings_to_existing_ones() -> None:
    graph = tune_graph(multistep(), stop=("x",))
    graph = tune_graph(graph, stop=("x", "y"))
    assert graph.nodes[3].stop == ("x", "y")


def test_resolve_workflow() -> None:
    workflows = {"hyde": hyde()}
    assert resolve_workflow(workflows, "ragserve/hyde", None)[0] == "hyde"
    assert resolve_workflow(workflows, "hyde", None)[0] == "hyde"
    assert resolve_workflow(workflows, "anything", "hyde")[0] == "hyde"
    with pytest.raises(APIError) as err:
        resolve_workflow(workflows, "ragserve/nope", None)
    assert err.value.status_code == 404 and "ragserve/hyde" in err.value.message


def test_admission_bounds_and_releases() -> None:
    admission = Admission(limit=2, retry_after_s=3)
    admission.try_acquire()
    with admission.admit():
        assert admission.num_inflight == 2
        with pytest.raises(APIError) as err:
            admission.try_acquire()
        assert err.value.status_code == 429 and err.value.headers == {"Retry-After": "3"}
    assert admission.num_inflight == 1 and admission.num_rejected == 1
    admission.release()
    assert admission.num_inflight == 0


def test_flatten_stats_keeps_numbers_only() -> None:
    stats = {"a": 1, "b": {"c": 2.5, "d": "text", "e": True, "f": {"g": 3}}}
    assert flatten_stats(stats) == {"a": 1.0, "b.c": 2.5, "b.e": 1.0, "b.f.g": 3.0}


def test_metrics_render_stats_as_gauges() -> None:
    stats = {
        "num_running": 2,
        "num_waiting": 1,
        "num_blocks_used": 8,
        "num_blocks_total": 32,
        "num_active_requests": 6,
        "workers": {"gen": {"in_flight": 4, "pending": 7, "alive": True}, "inbox_queue": 5},
    }
    metrics = ServerMetrics(lambda: stats, lambda: 3)
    metrics.requests.labels("hyde", "ok").inc()
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }
    assert values[("ragserve:num_requests_running", ())] == 2
    assert values[("ragserve:kv_cache_usage_perc", ())] == 0.25
    assert values[("ragserve:num_requests_admitted", ())] == 3
    assert values[("ragserve:num_requests_active", ())] == 6
    assert values[("ragserve:queue_depth", (("queue", "workers.inbox_queue"),))] == 5
    assert values[("ragserve:queue_depth", (("queue", "workers.gen.pending"),))] == 7
    assert values[("ragserve:server_stat", (("key", "workers.gen.alive"),))] == 1
    assert values[("ragserve:server_stat", (("key", "workers.gen.in_flight"),))] == 4
    worker = ("ragserve:worker_stat", (("stat", "in_flight"), ("worker", "gen")))
    assert values[worker] == 4  # per worker / Ray actor labels (issue 17)
    assert ("ragserve:worker_stat", (("stat", "inbox_queue"), ("worker", "workers"))) not in values
    assert values[("ragserve:requests_total", (("status", "ok"), ("workflow", "hyde")))] == 1


@pytest.mark.parametrize(
    "kwargs",
    [{"max_num_inflight": 0}, {"max_body_bytes": 0}, {"api_key": ""}, {"port": 70000}],
)
def test_serve_config_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ServeConfig(**kwargs)
