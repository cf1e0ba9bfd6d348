"""Our logits equal transformers' Olmo2ForCausalLM / Olmo3ForCausalLM on the same random weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from olmo_ds.model import ModelConfig

from model_testlib import OLMO2_TINY, OLMO3_TINY, hf_model_from, random_model

CASES = {
    "olmo2": OLMO2_TINY,
    "olmo2-mha-tied": dict(OLMO2_TINY, n_kv_heads=4, tie_embeddings=True),
    "olmo3-sliding-yarn": OLMO3_TINY,
    "olmo3-sliding": dict(OLMO3_TINY, yarn=None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case):
    cfg = ModelConfig(**CASES[case])
    ours = random_model(cfg)
    theirs = hf_model_from(ours)
    expected_arch = "Olmo3ForCausalLM" if case.startswith("olmo3") else "Olmo2ForCausalLM"
    assert type(theirs).__name__ == expected_arch
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = ours(ids)
        b = theirs(ids).logits
    assert a.shape == b.shape == (2, 40, cfg.padded_vocab_size)
    diff = (a - b).abs().max().item()
    assert diff <= 1e-4, f"{case}: max abs logit difference {diff}"
