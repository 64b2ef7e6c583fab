"""Cache fusion: ratio 1.0 equals full prefill, re-rotated stored KV equals KV computed at the
target position, blocks are freed exactly, and the selectors pick the expected tokens."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from oracle_cases import pool_bytes

from ragserve.generation import LLMEngine, SamplingParams, Segment
from ragserve.generation.fusion.prefill import (
    attention_scores,
    kv_deviation,
    pick_rows,
    query_rows,
    received_attention,
    rotate_keys,
)
from ragserve.generation.fusion.store import PassageKVStore
from ragserve.generation.segments import FusionPlan

MAX_TOKENS = 6


def _segments(seed: int, order: list[int]) -> list[Segment]:
    """Instructions, passages (keyed, in ``order``) and a question, as token ids."""
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 49152) for _ in range(rng.randrange(9, 30))] for _ in range(4)]
    head = [rng.randrange(3, 49152) for _ in range(7)]
    question = [rng.randrange(3, 49152) for _ in range(5)]
    passages = [Segment(docs[d], key=f"doc-{d}") for d in order]
    return [Segment(head), *passages, Segment(question)]


def _flat(segments: list[Segment]) -> list[int]:
    return [t for s in segments for t in s.content]


ORDERS = [[0, 1, 2], [2, 0, 1], [1, 3], [3, 2, 1, 0]]


def _engine(path, **kw) -> LLMEngine:
    blocks = kw.pop("num_blocks", 96)
    kw.setdefault("max_model_len", 384)
    return LLMEngine(path, device="cpu", kv_cache_bytes=pool_bytes(path, blocks, 16), **kw)


def _run(engine: LLMEngine, prompts: list, ratios: list[float | None]) -> list[list[int]]:
    """Two requests arrive per step (continuous batching); integrity checked every step."""
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    results: dict[int, list[int]] = {}
    step = 0
    while step * 2 < len(prompts) or engine.has_unfinished():
        for i in range(step * 2, min(step * 2 + 2, len(prompts))):
            engine.add_request(str(i), prompts[i], params, fusion_ratio=ratios[i])
        for output in engine.step():
            if output.finished:
                results[int(output.request_id)] = output.token_ids
        engine.check_integrity()
        step += 1
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_ratio_one_equals_full_prefill(arch, tiny_models):
    path = tiny_models[arch]
    segs = [_segments(5, o) for o in ORDERS]
    full = _run(_engine(path, enable_prefix_caching=False), [_flat(s) for s in segs], [None] * 4)
    engine = _engine(path)
    # fused and plain requests batched together; passages reused across requests
    prompts = segs + [_flat(s) for s in segs]
    fused = _run(engine, prompts, [1.0] * 4 + [None] * 4)
    assert fused == full + full
    stats = engine.stats()
    keyed = sum(len(p.content) for s in segs for p in s if p.key is not None)
    assert stats["num_fused_tokens"] == keyed
    assert stats["num_recomputed_tokens"] == keyed
    assert stats["num_fusion_store_misses"] == 4 and stats["num_fusion_store_hits"] == 8
    assert stats["kv_blocks_used"] == 0


def test_ratio_counts_and_blocks_freed(tiny_models):
    engine = _engine(tiny_models["llama"], fusion_ratio=0.3)
    segs = [_segments(5, o) for o in ORDERS]
    outs = _run(engine, segs, [None, 0.0, 0.3, None])
    assert all(len(o) == MAX_TOKENS for o in outs)
    stats = engine.stats()
    lengths = [[len(p.content) for p in s if p.key] for s in segs]
    ratios = [0.3, 0.0, 0.3, 0.3]
    expect = sum(math.ceil(r * n) for ls, r in zip(lengths, ratios, strict=True) for n in ls)
    assert stats["num_fused_tokens"] == sum(map(sum, lengths))
    assert stats["num_recomputed_tokens"] == expect
    assert stats["kv_blocks_used"] == 0
    engine.check_integrity()


def test_fusion_off_by_default_and_without_keys(tiny_models):
    engine = _engine(tiny_models["llama"])
    segs = _segments(5, [0, 1])
    engine.generate([_flat(segs)])
    engine.add_request("a", segs, SamplingParams(max_tokens=2))
    engine.add_request("b", [Segment(_flat(segs))], SamplingParams(max_tokens=2), fusion_ratio=0)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats()["num_fused_tokens"] == 0


def test_preempted_fused_request_recomputes(tiny_models):
    """A pool too small for all requests preempts fused ones; ratio 1.0 stays exact."""
    path = tiny_models["llama"]
    segs = [_segments(9, o) for o in ORDERS]
    full = _run(_engine(path, enable_prefix_caching=False), [_flat(s) for s in segs], [None] * 4)
    engine = _engine(path, num_blocks=10, max_model_len=128)
    assert _run(engine, segs, [1.0] * 4) == full
    assert engine.stats()["preemptions"] > 0


def test_passages_in_the_kv_tiers_swap_out_and_back_exactly(tiny_models):
    """A pool that holds the passages of about one request at a time, with a host tier:
    stored passages are evicted to the host and swapped back in. Ratio 1.0 equals full
    prefill; ratio 0.3 gives the tokens of the tree-off path (the separate fusion store)."""
    path = tiny_models["llama"]
    segs = [_segments(5, o) for o in ORDERS] * 2
    full = _run(_engine(path, enable_prefix_caching=False), [_flat(s) for s in segs], [None] * 8)
    host = pool_bytes(path, 16, 16)
    engine = _engine(path, num_blocks=22, max_model_len=160, host_kv_cache_bytes=host)
    assert _run(engine, segs, [1.0] * 8) == full
    stats = engine.stats()
    assert stats["num_swapped_in_blocks"] > 0 and stats["num_swapped_out_blocks"] > 0
    # every passage use is a hit (GPU, shared, or swapped in) or a miss (computed; stored
    # when it fits beside the running requests)
    assert stats["num_fusion_store_hits"] + stats["num_fusion_store_misses"] == 24
    assert stats["num_fusion_store_hits"] > 0 and stats["num_kv_tree_nodes"] == 4
    assert stats["kv_blocks_used"] == 0
    small = {"num_blocks": 22, "max_model_len": 160}
    tiers = _run(_engine(path, host_kv_cache_bytes=host, **small), segs, [0.3] * 8)
    store = _run(_engine(path, enable_knowledge_tree=False, **small), segs, [0.3] * 8)
    assert tiers == store


def test_rerotated_keys_equal_keys_at_target_position(tiny_models, hf_oracles):
    """Stored KV (passage alone at 0..n-1), re-rotated by ``s``, equals the KV transformers
    computes for the passage alone at ``s..s+n-1``, every layer."""
    for arch in ("llama", "qwen3"):
        engine = _engine(tiny_models[arch])
        runner = engine.model_runner.fusion
        rotary = engine.model_runner.model.model.rotary
        tokens = _segments(1, [0])[1].content
        stored = runner.passage_kv("p", tokens)
        for start in (0, 37, 200):
            pos = torch.arange(start, start + len(tokens))[None]
            out = hf_oracles[arch](torch.tensor([tokens]), position_ids=pos, use_cache=True)
            cache = out.past_key_values
            for layer in range(stored.shape[1]):
                hf_k, hf_v = _layer_kv(cache, layer)
                ours_k = rotate_keys(stored[0, layer], rotary, start)
                tight = dict(atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(ours_k, hf_k[0].transpose(0, 1), **tight)
                torch.testing.assert_close(stored[1, layer], hf_v[0].transpose(0, 1), **tight)


def _layer_kv(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def test_pick_rows_takes_top_share_of_each_keyed_segment():
    spans = [(0, 3, None), (3, 8, "a"), (8, 10, "b"), (10, 12, None)]
    scores = torch.tensor([9, 9, 9, 0.1, 0.5, 0.5, 0.9, 0.0, 0.2, 0.3, 9, 9])
    assert pick_rows(scores, spans, 0.0) == []
    assert pick_rows(scores, spans, 0.2) == [6, 9]  # ceil(0.2*5)=1, ceil(0.2*2)=1
    assert pick_rows(scores, spans, 0.5) == [4, 5, 6, 9]  # tie 4/5: both taken (3 of 5)
    assert pick_rows(scores, spans, 0.25) == [4, 6, 9]  # ceil(1.25)=2: tie keeps the earlier
    assert pick_rows(scores, spans, 1.0) == [3, 4, 5, 6, 7, 8, 9]


def test_query_attention_and_kv_deviation_scores():
    spans = [(0, 2, None), (2, 6, "a"), (6, 8, None)]
    assert query_rows(spans, 8) == [6, 7]
    assert query_rows([(0, 4, "a")], 4) == [3]
    rows = torch.tensor([0, 1, 6, 7])
    probs = torch.zeros(2, 4, 8)
    probs[:, 2, 4] = 0.7  # the query token at 6 attends to passage token 4
    probs[:, 3, 3] = 0.2
    probs[:, 0, 5] = 1.0  # an instruction row: not a query, ignored
    scores = attention_scores(probs, rows, torch.tensor([6, 7]))
    assert pick_rows(scores, spans, 0.25) == [4]
    assert pick_rows(scores, spans, 0.5) == [3, 4]
    fresh = torch.zeros(2, 8, 2, 4)
    stored = fresh.clone()
    stored[1, 5] += 3.0  # token 5's values moved most
    stored[0, 2] += 1.0
    dev = kv_deviation(fresh, stored)
    assert dev.argmax().item() == 5
    assert pick_rows(dev, spans, 0.5) == [2, 5]


def test_sift_scores_are_attention_received_inside_the_passage(tiny_models):
    probs = torch.tensor([[[1.0, 0, 0], [0.2, 0.8, 0], [0.1, 0.1, 0.8]]])
    assert received_attention(probs).tolist() == pytest.approx([1.3, 0.9, 0.8])
    engine = _engine(tiny_models["llama"], fusion_selector="sift")
    runner = engine.model_runner.fusion
    tokens = _segments(1, [0])[1].content
    scores = runner.passage_scores("p", tokens)
    heads = engine.model_config.num_attention_heads
    assert scores.shape == (len(tokens),) and bool((scores >= 0).all())
    assert float(scores.sum()) == pytest.approx(heads * len(tokens), rel=1e-5)  # rows sum to 1
    assert runner.passage_scores("p", tokens) is scores  # indexed once
    segs = [_segments(5, o) for o in ORDERS]
    assert all(len(o) == MAX_TOKENS for o in _run(engine, segs, [0.3] * 4))
    lengths = [len(p.content) for s in segs for p in s if p.key]
    assert engine.stats()["num_recomputed_tokens"] == sum(math.ceil(0.3 * n) for n in lengths)
    engine.check_integrity()


def test_store_tiers_and_token_check():
    one = torch.zeros(2, 1, 4, 1, 2)  # 64 bytes
    store = PassageKVStore(torch.device("cpu"), device_bytes=128, host_bytes=64)
    store.put("a", [1, 2, 3, 4], one)
    store.put("b", [5, 6, 7, 8], one.clone())
    store.put("c", [9, 9, 9, 9], one.clone())  # a -> host
    assert store.num_device_bytes == 128 and store.num_host_bytes == 64
    assert store.get("a", [1, 2, 3, 0]) is None  # same key, other tokens: a miss
    assert store.get("a", [1, 2, 3, 4]) is not None  # host hit: back on the device, b out
    assert store.num_host_hits == 1 and len(store) == 3 and "b" in store
    store.put("d", [1], one.clone())  # c -> host, b (host, LRU) dropped
    assert "b" not in store and store.num_evicted == 1
    store.put("big", [1], torch.zeros(2, 1, 9, 1, 2))  # over the device budget: not kept
    assert "big" not in store


def test_bad_fusion_inputs(tiny_models):
    engine = _engine(tiny_models["llama"])
    with pytest.raises(ValueError, match="fusion_ratio"):
        engine.add_request("x", _segments(1, [0]), SamplingParams(), fusion_ratio=1.5)
    with pytest.raises(ValueError, match="content is empty"):
        Segment([])
    with pytest.raises(ValueError, match="Segment.key"):
        Segment([1], key="")
    with pytest.raises(ValueError, match="fusion_ratio"):
        FusionPlan(((0, 1, "a"),), -0.1)
    with pytest.raises(ValueError, match="fusion_selector"):
        _engine(tiny_models["llama"], fusion_selector="nope")
    assert not engine.has_unfinished()


def test_paragraph_segments_key_the_middle_paragraphs():
    from ragserve.generation.segments import paragraph_segments

    text = "Use the passages.\n\n[1] Alpha\nriver\n\n[2] Beta\n\nQuestion: why?"
    segs = paragraph_segments(text)
    assert "".join(s.content for s in segs) == text
    assert [s.key is None for s in segs] == [True, False, False, True]
    again = paragraph_segments("Other.\n\n[2] Beta\n\nQ?")
    assert again[1].key == segs[2].key
    assert paragraph_segments("no blank lines") == [Segment("no blank lines")]


def test_workflow_node_fusion_ratio_reaches_the_engine(tiny_models):
    """``add_generation(fusion_ratio=...)`` -> ``GenerationParams`` -> runner -> engine."""
    from ragserve.graph import END, START, RAGraph
    from ragserve.runtime.runners import GenerationRunner
    from ragserve.scheduler.messages import GenerationParams, GenerationTask

    graph = RAGraph("g").add_generation(0, prompt="{input}", max_tokens=2, fusion_ratio=0.5)
    node = graph.add_edge(START, 0).add_edge(0, END).compile().nodes[0]
    params = GenerationParams.from_any(node)
    assert params.fusion_ratio == 0.5
    engine = _engine(tiny_models["llama"])
    runner = GenerationRunner(engine)
    prompt = "Answer.\n\nfirst passage here\n\nsecond passage\n\nQuestion: what?"
    assert runner.add([GenerationTask("t", prompt, params, chat=False)]) == []
    while engine.has_unfinished():
        runner.step()
    assert engine.stats()["num_fused_tokens"] > 0
    with pytest.raises(Exception, match="fusion_ratio"):
        RAGraph("h").add_generation(0, prompt="{input}", fusion_ratio=2.0)


@pytest.mark.slow
def test_smollm2_ratio_one_equals_full_prefill():
    """Real weights: text segments with keyed passages, reused in other orders, at ratio
    1.0 give exactly the greedy tokens of a full prefill of the same tokens."""
    from ragserve.generation.builtin import resolve_model

    folder = resolve_model("smollm2-135m-instruct")
    passages = [
        "Kenya: the capital is Nairobi; Swahili and English are official.\n\n",
        "Peru: the capital is Lima; Spanish and Quechua are spoken.\n\n",
        "Norway: the capital is Oslo; the climate is temperate along the coast.\n\n",
    ]
    engine = LLMEngine(folder, device="cpu", max_model_len=512, cpu_threads=1)
    params = SamplingParams(max_tokens=8)
    for order, question in (([0, 1, 2], "capital of Peru"), ([2, 0, 1], "capital of Kenya")):
        segs = [Segment("Answer from the passages.\n\n")]
        segs += [Segment(passages[i], key=f"p{i}") for i in order]
        segs.append(Segment(f"Question: What is the {question}?"))
        engine.add_request("fused", segs, params, fusion_ratio=1.0)
        fused = None
        while engine.has_unfinished():
            for out in engine.step():
                fused = out.token_ids
        (full,) = engine.generate([_ids(engine, segs)], params)
        assert fused == full.token_ids
    assert engine.stats()["num_fusion_store_hits"] == 3


def _ids(engine: LLMEngine, segs: list[Segment]) -> list[int]:
    from ragserve.generation.segments import tokenize_segments

    return tokenize_segments(segs, engine._tokenize_segment)[0]


def _dense_fused_logits(runner, token_ids: list[int], plan: FusionPlan, rows: list[int]):
    """The oracle of a fused prefill (session 1's path): a dense KV of the whole prompt with
    the stored passages re-rotated, ``rows`` recomputed at every layer by ``forward_rows``;
    the last token's logits and the dense stored KV (untouched by the rows)."""
    from ragserve.generation.fusion.prefill import forward_rows

    model = runner.model
    kv = runner._empty_kv(len(token_ids))
    for start, end, key in plan.spans:
        if key is not None:
            stored = runner.store.get(key, token_ids[start:end])
            kv[0, :, start:end] = rotate_keys(stored[0], model.model.rotary, start)
            kv[1, :, start:end] = stored[1]
    ids = torch.tensor(token_ids)
    hidden, _ = forward_rows(model, ids, kv.clone(), torch.tensor(rows))
    return model.compute_logits(model.model.norm(hidden[-1:]))[0], kv, ids


def _dense_qcfuse_scores(runner, kv, ids, plan: FusionPlan) -> torch.Tensor:
    """Session 1's QCFuse scores: the unkeyed rows densely up to the probe layer."""
    from ragserve.generation.fusion.prefill import forward_rows

    keyed = torch.zeros(len(ids), dtype=torch.bool)
    for start, end, key in plan.spans:
        if key is not None:
            keyed[start:end] = True
    keyed[-1] = False
    base = (~keyed).nonzero().flatten()
    _, probs = forward_rows(runner.model, ids, kv.clone(), base, probe_layer=runner.probe_layer)
    query = torch.tensor(query_rows(plan.spans, len(ids)))
    return attention_scores(probs, base, query)


@pytest.mark.parametrize("selector", ["qcfuse", "cacheblend"])
def test_paged_fused_prefill_equals_dense_oracle(selector, tiny_models):
    """Below ratio 1 the paged fused prefill (rows batched with other requests, per-query
    positions) gives the first-token logits of the dense oracle with the same rows; the
    QCFuse-style rows equal the dense probe's."""
    engine = _engine(tiny_models["qwen3"], enable_knowledge_tree=False, fusion_selector=selector)
    runner = engine.model_runner.fusion
    picked: dict[tuple[int, ...], list[int]] = {}
    prepare = runner.prepare

    def spy(token_ids, *args, **kw):
        picked[tuple(token_ids)] = rows = prepare(token_ids, *args, **kw)
        return rows

    runner.prepare = spy
    first: dict[str, torch.Tensor] = {}

    def hook(seqs, logits):
        for seq, row in zip(seqs, logits, strict=True):
            first.setdefault(seq.request_id, row.clone())

    engine.model_runner.logits_hook = hook
    segs = [_segments(7, o) for o in ORDERS]
    ratios = [0.3, 0.15, 0.5, 0.3]
    _run(engine, segs + segs, ratios + ratios)  # the second round reuses stored passages
    for i in range(len(segs), 2 * len(segs)):
        seq_ids = _flat(segs[i % len(segs)])
        rows = picked[tuple(seq_ids)]
        spans, start = [], 0
        for seg in segs[i % len(segs)]:
            spans.append((start, start + len(seg.content), seg.key))
            start += len(seg.content)
        plan = FusionPlan(tuple(spans), ratios[i % len(segs)])
        want, kv, ids = _dense_fused_logits(runner, seq_ids, plan, rows)
        torch.testing.assert_close(first[str(i)], want, atol=1e-4, rtol=1e-4)
        if selector == "qcfuse":  # a top share by the dense scores (near-ties either way)
            scores = _dense_qcfuse_scores(runner, kv, ids, plan)
            for start, end, key in plan.spans:
                if key is None:
                    continue
                took = [p for p in range(start, end) if p in rows]
                left = [p for p in range(start, end) if p not in rows]
                assert len(took) == math.ceil(plan.ratio * (end - start) - 1e-9)
                if took and left:
                    assert scores[took].min() >= scores[left].max() - 1e-5
        assert len(rows) < len(seq_ids)  # some stored rows kept: not a full prefill


def test_fused_and_plain_prefills_share_steps(tiny_models):
    """Several fused requests (two selectors' worth of ratios) and ordinary prefills enter at
    once and run in the same steps; each one's tokens equal its run alone, and every block
    is freed."""
    path = tiny_models["llama"]
    segs = [_segments(3, o) for o in ORDERS]
    prompts = [segs[0], segs[1], _flat(segs[2]), segs[3], _flat(segs[0])]
    ratios = [0.3, 0.0, None, 1.0, None]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    alone = []
    for prompt, ratio in zip(prompts, ratios, strict=True):
        engine = _engine(path, enable_knowledge_tree=False)
        for seg in segs[0] + segs[1] + segs[3]:  # store every passage first, as below
            if seg.key is not None:
                engine.model_runner.fusion.passage_kv(seg.key, seg.content)
        engine.add_request("x", prompt, params, fusion_ratio=ratio)
        (out,) = [o for _ in range(MAX_TOKENS + 1) for o in engine.step() if o.finished]
        alone.append(out.token_ids)
    engine = _engine(path, enable_knowledge_tree=False)
    for seg in segs[0] + segs[1] + segs[3]:
        if seg.key is not None:
            engine.model_runner.fusion.passage_kv(seg.key, seg.content)
    steps = []
    step = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(out := step()) or out
    for i, (prompt, ratio) in enumerate(zip(prompts, ratios, strict=True)):
        engine.add_request(str(i), prompt, params, fusion_ratio=ratio)
    together: dict[str, list[int]] = {}
    while engine.has_unfinished():
        together.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        engine.check_integrity()
    assert [together[str(i)] for i in range(len(prompts))] == alone
    first = steps[0]
    fused = [s for s in first.seqs if s.fusion is not None]
    assert len(fused) == 3 and len(first.seqs) == 5  # three fused, two plain in one step
    assert engine.stats()["kv_blocks_used"] == 0


def test_dense_switch_gives_the_paged_tokens(tiny_models):
    """``fusion_paged_prefill=False`` (the dense per-request forward) and the paged path pick
    the same rows and give the same tokens, with the knowledge tree's tiers."""
    segs = [_segments(11, o) for o in ORDERS]
    ratios = [0.3, 0.15, 0.5, 0.0]
    runs = []
    for paged in (True, False):
        engine = _engine(tiny_models["llama"], fusion_paged_prefill=paged)
        runs.append((_run(engine, segs + segs, ratios + ratios), engine.stats()))
        assert engine.model_runner.fusion.paged is paged
        engine.check_integrity()
    (paged_tokens, paged_stats), (dense_tokens, dense_stats) = runs
    assert paged_tokens == dense_tokens
    for key in ("num_fused_tokens", "num_recomputed_tokens", "kv_blocks_used"):
        assert paged_stats[key] == dense_stats[key]


def test_fused_prefills_cost_their_rows_in_the_token_budget(tiny_models):
    """A budget smaller than one fused prompt still takes several fused prefills in one step:
    each is charged the rows it computes (``FusionPlan.max_rows``), not its prompt."""
    segs = [_segments(5, o) for o in ORDERS[:3]]
    plans = []
    for s in segs:
        spans, start = [], 0
        for seg in s:
            spans.append((start, start + len(seg.content), seg.key))
            start += len(seg.content)
        plans.append(FusionPlan(tuple(spans), 0.1))
    costs = [p.max_rows(len(_flat(s))) for p, s in zip(plans, segs, strict=True)]
    assert all(c < len(_flat(s)) for c, s in zip(costs, segs, strict=True))
    engine = _engine(tiny_models["llama"], max_num_batched_tokens=sum(costs))
    assert sum(costs) < len(_flat(segs[0]))
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(out := schedule()) or out
    outs = _run_all(engine, segs, 0.1)
    assert [len(o) for o in outs] == [MAX_TOKENS] * 3
    assert len(steps[0].seqs) == 3 and steps[0].sample == [True] * 3
    assert engine.stats()["num_recomputed_tokens"] == sum(
        sum(math.ceil(0.1 * (e - s)) for s, e, k in p.spans if k) for p in plans
    )
    assert engine.stats()["kv_blocks_used"] == 0


def _run_all(engine: LLMEngine, prompts: list, ratio: float) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, fusion_ratio=ratio)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        engine.check_integrity()
    return [done[str(i)] for i in range(len(prompts))]


def test_a_steps_missing_passages_run_in_one_forward(tiny_models, monkeypatch):
    """``fusion_batch_misses``: the passages a step's fused prefills miss are computed in one
    forward (packed, attention within each), each equal to its forward alone, and the engine's
    outputs equal the one-forward-per-passage oracle's, with the tree and without."""
    from ragserve.generation.fusion import prefill

    engine = _engine(tiny_models["llama"])
    runner = engine.model_runner.fusion
    docs = [s.content for s in _segments(3, [0, 1, 2, 3])[1:-1]]
    packed = runner._compute_alone_many([*docs, docs[1]])
    for kv, doc in zip(packed, [*docs, docs[1]], strict=True):
        alone = runner._compute_alone_many([doc])[0]
        assert kv.shape == alone.shape
        torch.testing.assert_close(kv, alone, atol=1e-5, rtol=1e-5)
    calls = []
    forward = prefill.forward_rows
    monkeypatch.setattr(
        prefill, "forward_rows", lambda *a, **k: calls.append(1) or forward(*a, **k)
    )
    segs = [_segments(9, o) for o in ORDERS]
    one_each = [_segments(9, [d]) for d in range(4)]
    loads = [
        # 4 distinct passages: one forward each, or one per step that misses any: step 0
        # (requests 0 and 1: docs 0, 1, 2) and step 1 (requests 2 and 3: doc 3)
        (lambda e: _run(e, segs, [0.3] * 4), 2),
        # four requests, one passage each, none shared, prefilled in one step: one forward
        (lambda e: _run_all(e, one_each, 0.3), 1),
    ]
    for (run, batched_forwards), tree in itertools.product(loads, (True, False)):
        runs = []
        for batch in (False, True):
            calls.clear()
            e = _engine(tiny_models["llama"], fusion_batch_misses=batch, enable_knowledge_tree=tree)
            runs.append((run(e), e.stats()["num_fused_tokens"]))
            assert len(calls) == (batched_forwards if batch else 4), (tree, batch, len(calls))
        assert runs[0] == runs[1]
