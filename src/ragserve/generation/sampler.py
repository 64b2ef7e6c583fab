"""Turn last-position logits into next tokens: greedy, or temperature/top-k/top-p sampling;
a seeded request draws from its own ``torch.Generator``."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ragserve.generation.sampling_params import SamplingParams


class SamplerState(NamedTuple):
    """The random state of a ``Sampler``: the shared generator's and each request's."""

    default: torch.Tensor
    per_request: dict[str, torch.Tensor]


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        self.device = device
        self._default_gen = torch.Generator(device=device).manual_seed(seed)
        self._gens: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._gens.pop(request_id, None)

    def get_state(self) -> SamplerState:
        """A copy of every generator's state (a step that is run again restores it first)."""
        return SamplerState(
            self._default_gen.get_state(), {r: g.get_state() for r, g in self._gens.items()}
        )

    def set_state(self, state: SamplerState) -> None:
        """Back to ``state``: generators created since are dropped, the others rewound."""
        self._default_gen.set_state(state.default)
        self._gens = {r: g for r, g in self._gens.items() if r in state.per_request}
        for rid, gen in self._gens.items():
            gen.set_state(state.per_request[rid])

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self._default_gen
        if request_id not in self._gens:
            self._gens[request_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        return self._gens[request_id]

    def sample(
        self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> torch.Tensor:
        """``logits``: float32 ``[n, vocab]`` -> n token ids, int64 on the logits' device (no
        host sync)."""
        tokens = logits.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        if sampled:
            idx = to_device(sampled, logits.device)
            probs = self._probs(logits[idx], [params[i] for i in sampled])
            for row, i in enumerate(sampled):
                gen = self._generator(request_ids[i], params[i])
                tokens[i] = torch.multinomial(probs[row], 1, generator=gen)[0]
        return tokens

    @staticmethod
    def _probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        temps = to_device([p.temperature for p in params], logits.device)
        logits = logits / temps[:, None]
        top_ks = [p.top_k for p in params if p.top_k is not None]
        if top_ks:
            vocab = logits.shape[-1]
            ks = to_device([min(p.top_k or vocab, vocab) for p in params], logits.device)
            sorted_desc = logits.sort(dim=-1, descending=True).values
            kth = sorted_desc.gather(-1, (ks - 1)[:, None])
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = logits.softmax(dim=-1)
        if any(p.top_p < 1.0 for p in params):
            top_ps = to_device([p.top_p for p in params], logits.device)
            sorted_probs, order = probs.sort(dim=-1, descending=True)
            before = sorted_probs.cumsum(dim=-1) - sorted_probs  # mass strictly above
            drop_sorted = before >= top_ps[:, None]
            drop_sorted[:, 0] = False  # the nucleus always holds the most likely token
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            probs = probs.masked_fill(drop, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs


def to_device(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (list or numpy array) on ``device``. NOTE: CUDA: from pinned memory without
    blocking; a pageable copy would wait for the side stream's earlier swap-outs."""
    tensor = torch.as_tensor(values, dtype=dtype)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
