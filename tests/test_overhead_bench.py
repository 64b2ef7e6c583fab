"""``bench/overhead.py``'s statistics (fast, no server): the rounds' paired ratios and sign
test, the orchestration share's standard error (``overhead_report``), and reading a live
worker trace (``overhead_trace``)."""

from __future__ import annotations

import json

import pytest


@pytest.fixture(scope="module")
def report(bench_module):
    return bench_module("overhead_report")


@pytest.fixture(scope="module")
def trace(bench_module):
    return bench_module("overhead_trace")


def _rounds(before, after):
    return {"before": [{"scheduler_s_per_node": b} for b in before],
            "after": [{"scheduler_s_per_node": a} for a in after]}  # fmt: skip


def test_rounds_paired_and_sign_test(report) -> None:
    result = {"concurrent": 32, "workflow": "irg",
              "rounds": _rounds([2e-3, 1e-3, 4e-3], [0.5e-3, 0.6e-3, 1e-3])}  # fmt: skip
    report.compare_rounds(result)
    assert result["paired_ratios"] == pytest.approx([0.25, 0.6, 0.25])
    assert result["rounds_at_most_half"] == 2
    assert result["sign_test_p"] == pytest.approx(4 / 8)  # P(X >= 2), X ~ Bin(3, 1/2)
    assert result["median_ms_per_node"] == pytest.approx({"before": 2.0, "after": 0.6})
    result["rounds"] = _rounds([1e-3] * 7, [0.4e-3] * 7)
    report.compare_rounds(result)
    assert result["sign_test_p"] == pytest.approx(1 / 128)


def test_share_standard_error(report) -> None:
    side = {"src": "x", "data_plane_us": {}, "served": [
        {"e2e": e, "model": 0.98 * e, "nodes": 2, "scheduler": 0.0} for e in (1.0, 2.0, 3.0)
    ]}  # fmt: skip
    row = report.summarize(side)
    assert row["orchestration_share"] == pytest.approx(0.02)
    assert row["orchestration_share_se"] == pytest.approx(0.0, abs=1e-12)  # the same share
    side["served"][0]["model"] = 0.9
    row = report.summarize(side)
    orch, e2e = [0.1, 0.04, 0.06], [1.0, 2.0, 3.0]
    share = sum(orch) / sum(e2e)
    resid = [o - share * e for o, e in zip(orch, e2e, strict=True)]
    expected = (sum(d * d for d in resid) / 6) ** 0.5 * 3 / sum(e2e)
    assert row["orchestration_share_se"] == pytest.approx(expected)
    assert row["num_questions"] == 3


def test_live_trace_skips_a_line_being_written(trace, tmp_path) -> None:
    (tmp_path / "1.jsonl").write_text(json.dumps([2.0, 3.0, "model"]) + "\n[4.0, 5")
    (tmp_path / "2.jsonl").write_text(
        json.dumps([0.5, 1.0, "model"]) + "\n" + json.dumps([1.0, 2.0, "gen_send"]) + "\n"
    )
    intervals = trace.read_trace(str(tmp_path))
    assert intervals == [[0.5, 1.0, "model"], [1.0, 2.0, "gen_send"], [2.0, 3.0, "model"]]
    assert trace.covered(intervals, 0.0, 2.5) == 1.0  # model intervals only


def test_decomposition_gives_each_instant_to_one_phase(trace) -> None:
    intervals = [
        (1.0, 5.0, "engine_other"),  # an engine step ...
        (2.0, 3.0, "model"),  # ... holding the forward (higher rank)
        (4.0, 6.0, "gen_send"),  # overlaps the step's end: the step keeps 4..5
        (7.0, 10.0, "sched_work"),  # a scheduler cycle ...
        (8.0, 9.0, "wait"),  # ... waiting in poll: not scheduler work
        (8.5, 9.0, "sched_receive"),  # reading a message inside the poll
        (11.0, 20.0, "model"),  # past the window: clipped
    ]
    phases = trace.decompose(intervals, 0.0, 12.0)
    assert sum(phases.values()) == pytest.approx(12.0)
    expected = {"model": 2.0, "engine_other": 3.0, "gen_send": 1.0, "sched_work": 2.0,
                "sched_receive": 0.5, "transit": 3.5}  # fmt: skip
    assert {k: v for k, v in phases.items() if v} == pytest.approx(expected)
    calls = trace.count_calls(intervals, 0.0, 12.0)
    assert calls["model"] == 2 and calls["gen_send"] == 1 and calls["wait"] == 1  # by start


def test_token_reads_count_hidden_host_work_only_while_the_device_ran(trace, monkeypatch) -> None:
    """Overlapped steps: a token read is model time, and the gap since the step's launch too
    when the step was still running at the read (host work beside the forward); a step that
    had already ended leaves the gap to the host phases."""
    from ragserve.generation import model_runner

    class FakeTokens:
        def __init__(self, launched_at: float, ready: bool):
            self.launched_at, self.ready = launched_at, ready

        def is_ready(self) -> bool:
            return self.ready

        def tolist(self) -> list[int]:
            return [7]

    monkeypatch.setattr(model_runner, "SampledTokens", FakeTokens)
    intervals: list = []
    clock = iter([10.0, 10.5, 20.0, 20.25])
    trace.trace_token_reads(intervals, clock=lambda: next(clock))
    assert FakeTokens(8.0, ready=False).tolist() == [7]
    assert FakeTokens(18.0, ready=True).tolist() == [7]
    assert intervals == [(8.0, 10.0, "model"), (10.0, 10.5, "model"), (20.0, 20.25, "model")]
