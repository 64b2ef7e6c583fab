"""Cache fusion through the real engine on CUDA (Triton backend, CUDA graphs for decode) and
its CPU twin (``torch_ref``): the paged fused prefill equals full prefill at ratio 1 and the
dense fused path below it, with fused requests batched together.

Random float32 weights (``load_format="dummy"``, no tokenizer): prompts are token ids.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from ragserve.generation import LLMEngine, SamplingParams, Segment

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512,
    "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}  # fmt: skip


def _prompts(n: int, seed: int, doc_len: tuple[int, int]) -> list[list[Segment]]:
    rng = random.Random(seed)
    docs = [[rng.randrange(3, 512) for _ in range(rng.randrange(*doc_len))] for _ in range(6)]
    out = []
    for _ in range(n):
        head = [rng.randrange(3, 512) for _ in range(16)]
        question = [rng.randrange(3, 512) for _ in range(12)]
        picked = rng.sample(range(len(docs)), 3)
        out.append([Segment(head), *(Segment(docs[d], key=f"d{d}") for d in picked),
                    Segment(question)])  # fmt: skip
    return out


def _run(engine: LLMEngine, prompts, ratio) -> tuple[list[list[int]], list[torch.Tensor]]:
    """All requests at once (fused and plain batched); tokens and first-token logits."""
    first: dict[str, torch.Tensor] = {}

    def hook(seqs, logits):
        for seq, row in zip(seqs, logits, strict=True):
            first.setdefault(seq.request_id, row.float().cpu())

    engine.model_runner.logits_hook = hook
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params, fusion_ratio=ratio)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    ids = [str(i) for i in range(len(prompts))]
    return [done[i] for i in ids], [first[i] for i in ids]


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
def test_paged_fusion_equals_full_and_dense(device: str, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    cuda = device == "cuda"
    prompts = _prompts(6, 0, (100, 300)) if cuda else _prompts(3, 0, (20, 50))
    flat = [[t for s in p for t in s.content] for p in prompts]

    def engine(**kw) -> LLMEngine:
        backend = "triton" if cuda else "torch_ref"
        return LLMEngine(tmp_path, device=device, dtype="float32", load_format="dummy",
                         attention_backend=backend, max_model_len=2048, seed=0,
                         kv_cache_bytes=64 * 2**20, **kw)  # fmt: skip

    paged = engine()
    if cuda:  # decode still runs in CUDA graphs
        assert paged.model_runner.graph_runner is not None
    full_tokens, full_logits = _run(engine(enable_prefix_caching=False), flat, None)
    tokens, logits = _run(paged, prompts, 1.0)
    assert tokens == full_tokens
    for ours, want in zip(logits, full_logits, strict=True):
        torch.testing.assert_close(ours, want, atol=2e-3, rtol=0)
    dense = engine(fusion_paged_prefill=False)
    for ratio in (0.0, 0.15, 0.3) if cuda else (0.3,):
        got, got_logits = _run(paged, prompts, ratio)
        want, want_logits = _run(dense, prompts, ratio)
        for ours, ref in zip(got_logits, want_logits, strict=True):
            torch.testing.assert_close(ours, ref, atol=2e-3, rtol=0)
        assert sum(a == b for a, b in zip(got, want, strict=True)) >= len(got) - 1
    assert paged.stats()["kv_blocks_used"] == 0
    paged.check_integrity()
