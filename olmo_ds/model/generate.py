"""Text generation with a KV cache: greedy or nucleus (top-p) sampling, for reading samples from a model.

Prompts are decoded one at a time (no padding, so positions and masks stay exactly those of
training); the prompt runs in one forward that fills the cache, then each new token costs one
single-position forward. Padded vocabulary rows are never sampled.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from olmo_ds.model.model import KVCache, OLMo


def sample_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """The next id from fp32 logits [V]: argmax when temperature is 0, else top-p sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits / temperature, dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    # Keep the smallest prefix whose mass reaches top_p (always at least the most likely id).
    outside = sorted_probs.cumsum(-1) - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(outside, 0.0)
    choice = torch.multinomial(sorted_probs, 1, generator=generator)
    return int(order[choice])


@torch.no_grad()
def generate(model: OLMo, prompts: list[list[int]], max_new_tokens: int, *, temperature: float = 0.0,
             top_p: float = 1.0, eos_id: int | None = None, stop_ids: Iterable[int] = (),
             seed: int | None = None) -> list[list[int]]:
    """Continue each prompt by up to `max_new_tokens` ids, stopping after `eos_id` or any of `stop_ids`
    (a chat model's turn end, `<|im_end|>`, as well as the EOS); returns the new ids, the stop id included."""
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    cfg = model.cfg
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    stop = set(stop_ids) | ({eos_id} if eos_id is not None else set())
    was_training = model.training
    model.eval()
    outputs = []
    for prompt in prompts:
        if not prompt:
            raise ValueError("every prompt needs at least one token")
        total = len(prompt) + max_new_tokens
        if total > cfg.max_seq_len:
            raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds model.max_seq_len "
                             f"{cfg.max_seq_len}")
        cache = KVCache(cfg, 1, total, device, dtype)
        logits = model(torch.tensor([prompt], device=device), cache=cache)[0, -1]
        new: list[int] = []
        for _ in range(max_new_tokens):
            next_id = sample_next(logits[:cfg.vocab_size].float(), temperature, top_p, generator)
            new.append(next_id)
            if next_id in stop:
                break
            logits = model(torch.tensor([[next_id]], device=device), cache=cache)[0, -1]
        outputs.append(new)
    model.train(was_training)
    return outputs
