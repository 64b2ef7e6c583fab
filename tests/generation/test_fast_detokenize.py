"""``enable_fast_detokenize``: the Rust backend's decode gives the text the tokenizer's
``decode`` gives (the oracle), token by token, for random ids, special ids and characters
split across tokens; a wrapper that adds something is never bypassed."""

from __future__ import annotations

import copy
import random

import pytest

from ragserve.generation import LLMEngine, SamplingParams
from ragserve.generation.detokenizer import IncrementalDetokenizer, make_decoder
from ragserve.generation.sequence import Sequence

ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def tokenizers(tiny_models):
    from ragserve.generation.engine_setup import load_tokenizer

    return {arch: load_tokenizer(tiny_models[arch]) for arch in ARCHS}  # the engines' own


def _streams(tok, rng: random.Random) -> list[list[int]]:
    """Random ids, ids around special tokens, and a text with multi-token characters."""
    vocab = len(tok)
    special = list(tok.all_special_ids)
    streams = [[rng.randrange(vocab) for _ in range(40)] for _ in range(20)]
    streams += [[rng.choice([*special, rng.randrange(vocab)]) for _ in range(30)] for _ in range(5)]
    streams.append(tok("héllo wörld, 世界 🙂🚀 ok  \n\tx", add_special_tokens=False)["input_ids"])
    return streams


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_decoder_equals_the_tokenizers_decode(tokenizers, arch: str) -> None:
    tok = tokenizers[arch]
    fast, oracle = make_decoder(tok, True), make_decoder(tok, False)
    rng = random.Random(0)
    for ids in _streams(tok, rng):
        for lo, hi in ((0, len(ids)), (3, 9), (5, 6), (0, 0)):
            assert (
                fast(ids[lo:hi])
                == oracle(ids[lo:hi])
                == tok.decode(ids[lo:hi], skip_special_tokens=True)
            )


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_text_is_the_same_token_by_token(tokenizers, arch: str) -> None:
    tok = tokenizers[arch]
    rng = random.Random(1)
    prompt = tok("Prompt:")["input_ids"]
    for ids in _streams(tok, rng):
        seqs = [Sequence("r", prompt, SamplingParams()) for _ in range(2)]
        detoks = [
            IncrementalDetokenizer(tok, seqs[0], make_decoder(tok, True)),
            IncrementalDetokenizer(tok, seqs[1]),  # the wrapper's decode: the oracle
        ]
        for t in ids:
            olds = []
            for seq, detok in zip(seqs, detoks, strict=True):
                seq.append_token(t)
                olds.append(detok.update(seq))
            assert seqs[0].text == seqs[1].text and olds[0] == olds[1]


def test_the_fast_path_is_taken_only_for_a_plain_wrapper(tokenizers) -> None:
    tok = copy.deepcopy(tokenizers["llama"])
    ids = tok("some text", add_special_tokens=False)["input_ids"]
    want = tok.decode(ids, skip_special_tokens=True)
    calls = []
    tok.decode = lambda *a, **kw: calls.append(a) or want  # an instance-level wrapper call
    assert make_decoder(tok, True)(ids) == want and not calls  # the backend, directly
    assert make_decoder(tok, False)(ids) == want and len(calls) == 1
    tok.clean_up_tokenization_spaces = True  # the wrapper would change the text: kept
    assert make_decoder(tok, True)(ids) == want and len(calls) == 2


def test_engine_outputs_equal_with_and_without_fast_detokenize(tiny_models) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(1, 200) for _ in range(12)] for _ in range(3)]
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=("ab",))
    outs = []
    for fast in (True, False):
        engine = LLMEngine(tiny_models["llama"], enable_fast_detokenize=fast)
        outs.append(
            [(o.text, o.token_ids, o.finish_reason) for o in engine.generate(prompts, params)]
        )
    assert outs[0] == outs[1] and any(text for text, _, _ in outs[0])
