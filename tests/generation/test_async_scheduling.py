"""Overlapped (async) scheduling (``EngineConfig.enable_async_scheduling``): step n+1 is
launched before step n's tokens are read. The oracle is the synchronous loop (switch off):
every request's tokens, text and finish reason must be identical, whatever ends it (max_tokens,
the context end, a stop token, a stop string, an abort, an error), with preemption, prefix
reuse, seeded sampling and step isolation; and no token of a discarded step may reach an
output."""

from __future__ import annotations

import pytest

from ragserve.generation import LLMEngine, SamplingParams
from ragserve.generation.faults import FAULT_ENV
from ragserve.generation.model_runner import ModelRunner, SampledTokens

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Then it",
    "Paris is the capital of",
    "One, two, three, four,",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. Later",
]
POISON = "<poison>"


def make(tiny_models, overlap: bool, **kw) -> LLMEngine:
    opts = dict(device="cpu", block_size=4, max_model_len=64, kv_cache_bytes=16 * 1024**2)
    return LLMEngine(tiny_models["llama"], enable_async_scheduling=overlap, **(opts | kw))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def drive(engine: LLMEngine, arrivals: dict[int, dict], abort_at: dict[str, int] | None = None):
    """Step to the end; ``arrivals[k]``: requests (id -> (prompt, params)) added before the
    k-th call; ``abort_at[rid]``: abort once ``rid``'s output holds that many tokens. Request
    id -> final output (the last output seen for an aborted one)."""
    abort_at = dict(abort_at or {})
    final: dict = {}
    call = 0
    while engine.has_unfinished() or any(k >= call for k in arrivals):
        for rid, (prompt, p) in arrivals.get(call, {}).items():
            engine.add_request(rid, prompt, p)
        call += 1
        for out in engine.step():
            final[out.request_id] = out
            if len(out.token_ids) >= abort_at.get(out.request_id, 1 << 30):
                del abort_at[out.request_id]
                engine.abort(out.request_id)
    assert engine.stats()["kv_blocks_used"] == 0
    engine.check_integrity()
    return final


def summary(final: dict) -> dict:
    return {
        rid: (tuple(o.token_ids), o.text, o.finish_reason, o.error is None)
        for rid, o in final.items()
    }


def both(tiny_models, arrivals, abort_at=None, **kw) -> tuple[dict, dict]:
    """(synchronous, overlapped) summaries of the same run."""
    return tuple(
        summary(drive(make(tiny_models, overlap, **kw), arrivals, abort_at))
        for overlap in (False, True)
    )


def test_launch_precedes_reading_the_previous_step(tiny_models, monkeypatch) -> None:
    """The overlap itself: step n+1 is launched before step n's tokens are read."""
    events: list[str] = []
    launch, read = ModelRunner.launch_model, SampledTokens.tolist

    def spy_launch(self, out, prev=None):
        events.append("launch")
        return launch(self, out, prev)

    def spy_read(self):
        events.append("read")
        return read(self)

    monkeypatch.setattr(ModelRunner, "launch_model", spy_launch)
    monkeypatch.setattr(SampledTokens, "tolist", spy_read)
    for overlap, expected in (
        (False, "launch read " * 4),
        (True, "launch launch read " + "launch read " * 2 + "read "),
    ):
        events.clear()
        make(tiny_models, overlap).generate([PROMPTS[0]], greedy(4))
        assert " ".join(events) + " " == expected, overlap


def test_same_outputs_greedy_staggered_lengths(tiny_models) -> None:
    arrivals = {
        0: {"a": (PROMPTS[0], greedy(12)), "b": (PROMPTS[1], greedy(3))},
        2: {"c": (PROMPTS[2], greedy(1)), "d": (PROMPTS[3], greedy(9))},
        5: {"e": (PROMPTS[4], greedy(6))},
    }
    sync, overlapped = both(tiny_models, arrivals)
    assert sync == overlapped
    assert [sync[r][0].__len__() for r in "abcde"] == [12, 3, 1, 9, 6]


def test_same_outputs_when_a_stop_token_or_string_ends_a_request(tiny_models) -> None:
    """EOS-like finishes, unknown until the token is read: the step launched meanwhile holds
    the finished request, and its token there must never reach an output."""
    probe = make(tiny_models, False).generate([PROMPTS[0], PROMPTS[1]], greedy(10))
    stop_token = probe[0].token_ids[4]
    stop_text = probe[1].text[len(probe[1].text) // 2 :][:3]
    assert stop_text.strip()
    arrivals = {
        0: {
            "tok": (PROMPTS[0], greedy(10, stop_token_ids=(stop_token,))),
            "str": (PROMPTS[1], greedy(10, stop=(stop_text,))),
            "long": (PROMPTS[2], greedy(14)),
        }
    }
    sync, overlapped = both(tiny_models, arrivals)
    assert sync == overlapped
    assert sync["tok"][2] == sync["str"][2] == "stop"
    assert len(sync["tok"][0]) == probe[0].token_ids.index(stop_token) + 1
    assert stop_text not in sync["str"][1]


def test_same_outputs_at_the_context_end(tiny_models) -> None:
    arrivals = {0: {"a": (PROMPTS[0], greedy(100)), "b": (PROMPTS[3], greedy(5))}}
    sync, overlapped = both(tiny_models, arrivals, max_model_len=24)
    assert sync == overlapped
    assert sync["a"][2] == "length" and len(sync["a"][0]) < 100


def test_same_outputs_seeded_sampling(tiny_models) -> None:
    seeded = [
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=s)
        for s in (1, 2, 3)
    ]
    arrivals = {
        0: {"s1": (PROMPTS[0], seeded[0]), "g": (PROMPTS[1], greedy(7))},
        1: {"s2": (PROMPTS[2], seeded[1])},
        3: {"s3": (PROMPTS[0], seeded[2])},
    }
    sync, overlapped = both(tiny_models, arrivals)
    assert sync == overlapped


def test_same_outputs_with_aborts_mid_run(tiny_models) -> None:
    arrivals = {0: {r: (p, greedy(12)) for r, p in zip("abcd", PROMPTS, strict=False)}}
    sync, overlapped = both(tiny_models, arrivals, abort_at={"b": 3, "d": 1})
    assert sync == overlapped
    assert len(sync["b"][0]) == 3 and len(sync["a"][0]) == 12


@pytest.mark.parametrize("host_blocks", [0, 32])
def test_same_outputs_under_preemption(tiny_models, host_blocks) -> None:
    """A pool of 12 blocks of 4 tokens for 5 requests of ~20 tokens: the newest running
    requests are preempted (some with a token still in flight) and recomputed, or with a host
    tier swapped back in."""
    probe = make(tiny_models, False)
    per_block = probe.config.kv_cache_bytes // probe.block_manager.num_blocks
    arrivals = {0: {r: (p, greedy(10)) for r, p in zip("abcde", PROMPTS, strict=True)}}
    runs = []
    for overlap in (False, True):
        engine = make(
            tiny_models,
            overlap,
            kv_cache_bytes=12 * per_block,
            max_model_len=40,
            host_kv_cache_bytes=host_blocks * per_block,
        )
        runs.append(summary(drive(engine, arrivals)))
        assert engine.stats()["preemptions"] > 0
        assert (engine.stats().get("num_swapped_in_blocks", 0) > 0) == bool(host_blocks)
    assert runs[0] == runs[1]


def test_same_outputs_with_prefix_reuse_and_isolated_failures(tiny_models, monkeypatch) -> None:
    """The knowledge tree (prefix reuse) on and a request that fails in the forward pass, one
    that fails when its token is appended: they end with errors, the others as without
    overlap."""
    monkeypatch.setenv(FAULT_ENV, f"forward:{POISON},append:<late>")
    arrivals = {
        0: {
            "a": (PROMPTS[0], greedy(8)),
            "bad": (PROMPTS[1], greedy(8, stop=(POISON,))),
            "late": (PROMPTS[2], greedy(8, stop=("<late>",))),
        },
        3: {"b": (PROMPTS[4], greedy(8)), "c": (PROMPTS[0], greedy(5))},
    }
    sync, overlapped = both(tiny_models, arrivals)
    assert sync == overlapped
    assert sync["bad"][2] == sync["late"][2] == "error"
    assert all(sync[r][3] for r in "abc")


def test_no_extra_step_for_requests_that_end_by_length(tiny_models, monkeypatch) -> None:
    """A request whose pending token is its last is not scheduled again: the overlapped
    engine samples exactly as many rows as the synchronous one."""
    launch = ModelRunner.launch_model
    rows = []

    def count(self, out, prev=None):
        rows.append(sum(out.sample))
        return launch(self, out, prev)

    monkeypatch.setattr(ModelRunner, "launch_model", count)
    totals = []
    for overlap in (False, True):
        rows.clear()
        make(tiny_models, overlap).generate(PROMPTS[:3], [greedy(n) for n in (2, 5, 9)])
        totals.append(sum(rows))
    assert totals == [16, 16]


def test_generate_leaves_nothing_in_flight(tiny_models) -> None:
    engine = make(tiny_models, True)
    probe = engine.generate([PROMPTS[0]], greedy(8))[0]
    stop = probe.token_ids[2]
    engine.generate([PROMPTS[0], PROMPTS[1]], [greedy(8, stop_token_ids=(stop,)), greedy(3)])
    assert engine._inflight is None and not engine.has_unfinished()
    engine.set_kv_reuse(False)  # needs an idle engine
    engine.check_integrity()


@pytest.mark.gpu
def test_same_outputs_on_cuda_with_graphs(tiny_models) -> None:
    """The device path: sampled tokens stay on the GPU and feed the next step's inputs
    (CUDA-graph replays included)."""
    arrivals = {
        0: {"a": (PROMPTS[0], greedy(12)), "b": (PROMPTS[1], greedy(4))},
        2: {"c": (PROMPTS[2], SamplingParams(max_tokens=9, temperature=1.0, seed=5))},
    }
    sync, overlapped = both(
        tiny_models, arrivals, device="cuda", dtype="float32", enable_cuda_graphs=True
    )
    assert sync == overlapped


# -- packed step inputs (EngineConfig.enable_packed_inputs): the oracle is one copy per array --
def test_packed_inputs_equal_one_copy_per_array(tiny_models) -> None:
    """The step's index arrays through one buffer per dtype give the same tensors as one copy
    per array (pending rows of an overlapped step included) and the same outputs."""
    engine = make(tiny_models, True)
    runner = engine.model_runner
    seen = []
    prepare = runner.prepare_inputs

    def both_ways(out, fused_rows=None, prev=None):
        runner.pack_inputs = False
        single = prepare(out, fused_rows, prev)
        runner.pack_inputs = True
        packed = prepare(out, fused_rows, prev)
        seen.append(prev is not None)
        for a, b in zip(single[:2] + single[3:], packed[:2] + packed[3:], strict=True):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()
        for field in ("query_start_loc", "seq_lens", "block_tables", "slot_mapping"):
            a, b = getattr(single[2], field), getattr(packed[2], field)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist(), field
        return packed

    runner.prepare_inputs = both_ways
    engine.generate(PROMPTS, [greedy(n) for n in (6, 2, 9, 4, 7)])
    assert len(seen) > 5 and any(seen)  # steps with pending (on-device) inputs were checked
    arrivals = {
        0: {"a": (PROMPTS[0], greedy(12)), "b": (PROMPTS[1], greedy(3))},
        2: {"c": (PROMPTS[2], greedy(1)), "d": (PROMPTS[3], greedy(9))},
    }
    runs = [summary(drive(make(tiny_models, True, enable_packed_inputs=p), arrivals))
            for p in (False, True)]  # fmt: skip
    assert runs[0] == runs[1]


@pytest.mark.gpu
def test_packed_inputs_on_cuda(tiny_models) -> None:
    """The device path: one pinned buffer per dtype, split on the GPU (CUDA graphs on)."""
    arrivals = {
        0: {"a": (PROMPTS[0], greedy(12)), "b": (PROMPTS[1], greedy(4))},
        2: {"c": (PROMPTS[2], SamplingParams(max_tokens=9, temperature=1.0, seed=5))},
    }
    kw = dict(device="cuda", dtype="float32", enable_cuda_graphs=True)
    runs = [summary(drive(make(tiny_models, True, enable_packed_inputs=p, **kw), arrivals))
            for p in (False, True)]  # fmt: skip
    assert runs[0] == runs[1]
