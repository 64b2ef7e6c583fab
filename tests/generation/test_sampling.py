"""Sampler and detokenizer units: top-k/top-p supports, seeded generators, incremental text."""

from __future__ import annotations

import pytest
import torch

from ragserve.generation import SamplingParams
from ragserve.generation.detokenizer import IncrementalDetokenizer, find_stop
from ragserve.generation.sampler import Sampler
from ragserve.generation.sequence import Sequence


def _logits() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(3, 50) * 3


def test_greedy_rows_take_the_argmax():
    logits = _logits()
    sampler = Sampler(torch.device("cpu"))
    tokens = sampler.sample(logits, ["a", "b", "c"], [SamplingParams()] * 3).tolist()
    assert tokens == logits.argmax(-1).tolist()


def test_top_k_and_top_p_restrict_the_support():
    logits = _logits()
    top2 = logits[0].topk(2).indices.tolist()
    probs = logits[1].softmax(-1)
    order = probs.argsort(descending=True).tolist()
    # smallest prefix of the sorted tokens whose mass reaches 0.5
    mass, nucleus = 0.0, []
    for t in order:
        nucleus.append(t)
        mass += float(probs[t])
        if mass >= 0.5:
            break
    sampler = Sampler(torch.device("cpu"), seed=1)
    params = [SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, top_p=0.5)]
    seen = [set(), set()]
    for _ in range(200):
        a, b = sampler.sample(logits[:2], ["k", "p"], params).tolist()
        seen[0].add(a)
        seen[1].add(b)
    assert seen[0] == set(top2)
    assert seen[1] <= set(nucleus) and len(seen[1]) >= min(2, len(nucleus))


def test_seeded_generators_are_per_request():
    logits = _logits()
    params = SamplingParams(temperature=1.5, seed=42)

    def draw(ids):
        sampler = Sampler(torch.device("cpu"))
        return [int(sampler.sample(logits[:1], ids, [params])[0]) for _ in range(20)]

    assert draw(["x"]) == draw(["y"])  # same seed, same stream, whatever the request id
    sampler = Sampler(torch.device("cpu"))
    first = [int(sampler.sample(logits[:1], ["x"], [params])[0]) for _ in range(5)]
    sampler.release("x")  # a finished request's generator is dropped; a new one restarts
    again = [int(sampler.sample(logits[:1], ["x"], [params])[0]) for _ in range(5)]
    assert first == again


@pytest.mark.parametrize("text", ["héllo wörld, 世界 🙂🚀 ok", "  spaces\n\nand\ttabs  "])
def test_incremental_detokenizer_equals_full_decode(engine_tokenizer, text):
    tok = engine_tokenizer
    prompt = tok("Prompt:")["input_ids"]
    target = tok(text)["input_ids"]
    seq = Sequence("r", prompt, SamplingParams())
    detok = IncrementalDetokenizer(tok, seq)
    for t in target:
        seq.append_token(t)
        detok.update(seq)
        assert "\ufffd" not in seq.text
    assert seq.text == tok.decode(target, skip_special_tokens=True) == text


def test_find_stop_only_matches_in_new_text():
    assert find_stop("abc STOP def", ("STOP",), old_len=0) == 4
    assert find_stop("abc STOP def", ("STOP",), old_len=9) is None  # matched earlier already
    assert find_stop("abc ST", ("STOP",), old_len=4) is None
    assert find_stop("abc STOP", ("STOP", "c S"), old_len=3) == 2  # earliest wins


@pytest.fixture(scope="module")
def engine_tokenizer(tiny_models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_models["llama"])
