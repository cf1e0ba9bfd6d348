"""Choosing the next token: greedy, or sampling with temperature, top-k and top-p (nucleus).

Reproducible for any batch size: every sequence draws from its own `torch.Generator`, seeded from (seed, the
request's own `seed`, else its index), one uniform number per new token; the draw picks a token by inverting the
cumulative distribution of that sequence's filtered probabilities (in id order, float64: `next_tokens`). What a
sequence samples therefore depends on its own logits and its own generator only, never on which other sequences
share the batch.
Padded vocabulary rows (the embedding is rounded up to a multiple of 128) are never chosen.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_k 0 = no limit; top_p 1 = no limit."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no limit), got {self.top_k!r}")
        if not 0 <= self.seed < 2 ** 31:
            raise ValueError(f"seed must be in [0, 2**31), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, key: int) -> torch.Generator | None:
        """The generator of the request keyed `key` (its `Request.seed`, else its index; None when greedy)."""
        return None if self.greedy else torch.Generator().manual_seed(self.seed << 32 | key)


def stream_key(*parts) -> int:
    """A random-stream key in [0, 2**32) from `parts` (e.g. seed, step, prompt, sample), for `Request.seed`: the same
    parts give the same stream wherever and whenever the request is decoded."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def filtered_logits(logits: torch.Tensor, vocab_size: int, sampling: Sampling) -> torch.Tensor:
    """The float32 logits [..., vocab_size] of the distribution `next_tokens` draws from: greedy, the model's own;
    else divided by the temperature, with ids outside the top-k and outside the nucleus (the smallest most-likely set
    whose mass reaches top_p, always at least the most likely id) at -inf. Their log-softmax is what
    `Completion.logprobs` holds, and what a trainer that needs the sampling distribution (an RL importance ratio)
    computes from its own forward (`token_logprobs`)."""
    logits = logits[..., :vocab_size].float()
    if sampling.greedy:
        return logits
    logits = logits / sampling.temperature
    if 0 < sampling.top_k < vocab_size:
        kth = logits.topk(sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        probs, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
        outside = probs.cumsum(-1) - probs >= sampling.top_p
        logits = logits.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return logits


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int, sampling: Sampling) -> torch.Tensor:
    """float32 log-probabilities of `ids` [...] under the sampling distribution of `logits` [..., padded_vocab]."""
    logp = torch.log_softmax(filtered_logits(logits, vocab_size, sampling), dim=-1)
    return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1)


def next_tokens(logits: torch.Tensor, vocab_size: int, sampling: Sampling, generators: list) -> tuple[torch.Tensor, torch.Tensor]:
    """(the next id of each row of `logits` [A, padded_vocab], its float32 log-probability under the distribution it
    was drawn from: `filtered_logits`); `generators[a]` is row a's (see `Sampling.generator`). Greedy picks the
    arg-max of the raw logits (ties as transformers breaks them) and reports the model's log-probability."""
    logp = torch.log_softmax(filtered_logits(logits, vocab_size, sampling), dim=-1)
    if sampling.greedy:
        ids = logits[:, :vocab_size].float().argmax(-1)
        return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
    # The cumulative distribution in id order (not sorted by probability: near-equal probabilities, common in a flat
    # distribution over 100K ids, swap places in a sort at the slightest change of the logits, and every draw landing
    # in one of the two intervals then picks the other id), in float64 (interval edges exact to ~1e-16, not fp32's 6e-8).
    probs = logp.double().exp()
    cdf = probs.cumsum(-1)
    # non_blocking: the copy does not wait for the GPU's queue (pipelined graph steps keep it full)
    draws = torch.stack([torch.rand((), generator=g, dtype=torch.float64) for g in generators]).to(logits.device, non_blocking=True)
    ids = torch.searchsorted(cdf, (draws * cdf[:, -1])[:, None], right=True).clamp_(max=vocab_size - 1)
    # An id of probability 0 adds nothing to the cdf, so no draw below the total lands on it; a draw that
    # rounds up to the total (past the last id) goes to the last id of probability > 0.
    last = vocab_size - 1 - (probs > 0).flip(-1).int().argmax(-1, keepdim=True)
    ids = torch.where(probs.gather(-1, ids) > 0, ids, last).squeeze(-1)
    return ids, logp.gather(-1, ids[:, None]).squeeze(-1)
