"""Shared helpers for the model tests (imported as `model_testlib`): tiny configs and our model -> transformers conversion."""

from __future__ import annotations

import json

import torch

from olmo_ds.model import ModelConfig, OLMo, YarnConfig
from olmo_ds.model.hf import to_hf_config, to_hf_state_dict

# Tiny but structurally complete: GQA (4 heads / 2 kv), several layers so the sliding pattern
# repeats and the last layer is forced full, vocab not a multiple of 128 so padding is exercised.
OLMO2_TINY = dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden=96, vocab_size=300, max_seq_len=64)
OLMO3_TINY = dict(OLMO2_TINY, n_layers=5, sliding_window=6, sliding_window_pattern=[True, True, False],
                  max_seq_len=128, yarn=YarnConfig(factor=8.0, original_max_position_embeddings=16))


def random_model(cfg: ModelConfig, seed: int = 0, dtype=torch.float32) -> OLMo:
    """Our model with every weight random (norm weights too, so a swapped norm cannot hide)."""
    torch.manual_seed(seed)
    model = OLMo(cfg).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def hf_model_from(model: OLMo):
    """The same weights in transformers' Olmo2ForCausalLM / Olmo3ForCausalLM (float32, eager attention)."""
    import transformers

    cfg = model.cfg
    hf_cfg = to_hf_config(cfg)
    config = transformers.AutoConfig.for_model(**json.loads(json.dumps(hf_cfg)))
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(cfg, model.state_dict()), strict=False)
    tied = {"lm_head.weight"} if cfg.tie_embeddings else set()
    assert not unexpected and set(missing) <= tied, (missing, unexpected)
    if cfg.tie_embeddings:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf
