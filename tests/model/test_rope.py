"""RoPE tables are cached per sequence length: the same logits as tables computed afresh, and a table
first built in evaluation (inference_mode) still serves a training forward and backward."""

from __future__ import annotations

import torch

from olmo_ds.model import ModelConfig

from model_testlib import OLMO3_TINY, random_model


def test_cached_rope_tables_change_nothing_and_serve_training_after_inference():
    model = random_model(ModelConfig(**OLMO3_TINY))  # sliding and full layers, YaRN on the full ones
    ids = torch.randint(0, 300, (2, 24))

    with torch.inference_mode():
        first = model(ids)  # builds the length-24 tables under inference_mode
    assert len(model._rope_cache) == 1
    for sliding, (cos, sin) in model._rope_cache[(24, ids.device)].items():
        fresh_cos, fresh_sin = model._rope_tables(torch.arange(24))[sliding]
        assert torch.equal(cos, fresh_cos) and torch.equal(sin, fresh_sin)
        assert not cos.is_inference()

    model.train()
    out = model(ids, labels=ids)  # the cached tables again, now with autograd
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        assert torch.equal(model.eval()(ids), first)

    for t in (8, 16, 32, 40, 48):  # lengths come and go; the cache stays small
        model(ids.repeat(1, 2)[:, :t])
    assert len(model._rope_cache) <= 4
