"""RoPE per layer type across the transformers boundary (issue 36.1).

transformers 5's Olmo3Config keeps `rope_parameters` per layer type: the sliding-window layers may have
another base than the full-attention ones (`Olmo3Config(rope_theta=10000)` is full 10,000, sliding
500,000), and either may be scaled. Each case is checked both ways against real transformers: a
directory transformers saved imports to the same logits, and our export loads in transformers with ours.
"""

from __future__ import annotations

import json

import pytest
import torch

from olmo_ds.model import ModelConfig, OLMo, YarnConfig
from olmo_ds.model.hf import from_hf_config, to_hf_config
from olmo_ds.weights import export_hf, import_hf, load_model_dir, save_model_dir

from model_testlib import OLMO3_TINY, random_model

transformers = pytest.importorskip("transformers")

# OLMO3_TINY without its YaRN: 5 layers, sliding window 6 on layers 0, 1, 3; full on 2 and 4.
BASE = dict(OLMO3_TINY, yarn=None, vocab_size=384)
FULL_YARN = YarnConfig(factor=8.0, original_max_position_embeddings=16)
SLIDING_YARN = YarnConfig(factor=4.0, beta_fast=16.0, beta_slow=2.0, original_max_position_embeddings=32)

# name -> (our config's RoPE fields, transformers' rope_parameters for the same model)
CASES = {
    "split-theta": (dict(rope_theta=10_000.0, sliding_rope_theta=500_000.0),
                    {"full_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 500_000.0}}),
    "yarn-full-only": (dict(rope_theta=10_000.0, yarn=FULL_YARN),
                       {"full_attention": {"rope_type": "yarn", "rope_theta": 10_000.0, "factor": 8.0,
                                           "original_max_position_embeddings": 16},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "scaling-both": (dict(rope_theta=50_000.0, sliding_rope_theta=20_000.0, yarn=FULL_YARN, sliding_yarn=SLIDING_YARN),
                     {"full_attention": {"rope_type": "yarn", "rope_theta": 50_000.0, "factor": 8.0,
                                         "original_max_position_embeddings": 16},
                      "sliding_attention": {"rope_type": "yarn", "rope_theta": 20_000.0, "factor": 4.0, "beta_fast": 16.0,
                                            "beta_slow": 2.0, "original_max_position_embeddings": 32}}),
}
IDS = torch.randint(0, 384, (2, 48), generator=torch.Generator().manual_seed(3))  # past every window and original length


def _hf_config(rope_parameters: dict, **extra):
    return transformers.Olmo3Config(
        hidden_size=64, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
        vocab_size=384, max_position_embeddings=128, sliding_window=6, rms_norm_eps=1e-6, pad_token_id=None,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters=rope_parameters, **extra)


def _hf_model(config):
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # so that a swapped norm cannot hide
    return model


def _max_diff(ours, theirs) -> float:
    with torch.no_grad():
        return (ours(IDS) - theirs(IDS).logits).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_import_of_transformers_directory_keeps_rope_per_layer_type(case, tmp_path):
    fields, rope_parameters = CASES[case]
    theirs = _hf_model(_hf_config(json.loads(json.dumps(rope_parameters))))
    theirs.save_pretrained(tmp_path / "hf")
    cfg, _ = import_hf(tmp_path / "hf", tmp_path / "ours")
    assert cfg == ModelConfig(**{**BASE, **fields}, init_std=0.02)
    _, state = load_model_dir(tmp_path / "ours")
    ours = OLMo(cfg).eval()
    ours.load_state_dict(state)
    assert _max_diff(ours, theirs) <= 1e-4


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_with_rope_per_layer_type(case, tmp_path):
    fields, rope_parameters = CASES[case]
    cfg = ModelConfig(**{**BASE, **fields})
    ours = random_model(cfg, seed=11)
    save_model_dir(tmp_path / "ours", cfg, ours.state_dict())
    export_hf(tmp_path / "ours", tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").float().eval()
    for kind, want in rope_parameters.items():
        got = theirs.config.rope_parameters[kind]
        assert {k: got.get(k) for k in want} == want, kind
    assert _max_diff(ours, theirs) <= 1e-4
    # and back: the export imports to the same config
    assert from_hf_config(json.loads((tmp_path / "hf" / "config.json").read_text())) == cfg


def test_the_transformers_default_for_a_changed_theta_imports_as_the_model_it_is(tmp_path):
    """The issue's case: Olmo3Config(rope_theta=10000) is full 10,000 and sliding 500,000 in transformers 5."""
    theirs = _hf_model(_hf_config(None, rope_theta=10_000.0))
    theirs.save_pretrained(tmp_path / "hf")
    cfg, _ = import_hf(tmp_path / "hf", tmp_path / "ours")
    assert cfg.rope_for(sliding=False) == (10_000.0, None) and cfg.rope_for(sliding=True) == (500_000.0, None)
    _, state = load_model_dir(tmp_path / "ours")
    ours = OLMo(cfg).eval()
    ours.load_state_dict(state)
    assert _max_diff(ours, theirs) <= 1e-4


def test_legacy_keys_written_only_where_every_transformers_reads_them_alike():
    one = to_hf_config(ModelConfig(**{**BASE, "rope_theta": 10_000.0, "yarn": FULL_YARN}))
    assert one["rope_theta"] == 10_000.0 and one["rope_scaling"]["rope_type"] == "yarn"
    split = to_hf_config(ModelConfig(**{**BASE, **CASES["split-theta"][0]}))
    assert "rope_theta" not in split and "rope_scaling" not in split  # 4.x would apply 10,000 to the sliding layers too
    olmo2 = to_hf_config(ModelConfig(**dict(BASE, sliding_window=None, sliding_window_pattern=[], rope_theta=10_000.0)))
    assert olmo2["rope_parameters"] == {"rope_type": "default", "rope_theta": 10_000.0} and olmo2["rope_theta"] == 10_000.0


def _hf_dict(**rope) -> dict:
    cfg = to_hf_config(ModelConfig(**BASE))
    for key in ("rope_parameters", "rope_theta", "rope_scaling"):
        cfg.pop(key, None)
    return {**cfg, **rope}


@pytest.mark.parametrize("rope, message", [
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5},
                           "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}),
     r"config.json: rope_parameters.sliding_attention.rope_type 'linear' is not supported"),
    (dict(rope_parameters={"full_attention": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 5e5},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}),
     r"config.json: rope_parameters.full_attention.rope_type 'dynamic' is not supported"),
    (dict(rope_theta=10_000.0), r"config.json: rope_theta 10000.0 without rope_parameters is ambiguous for the sliding"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 5e5}), r"must be given per layer type"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": -1.0},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}),
     r"config.json: model.rope_theta must be a finite number > 1 .* got -1.0"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.5},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}),
     r"rope_parameters.full_attention.partial_rotary_factor 0.5 is not supported"),
])
def test_rope_olmo_ds_cannot_represent_is_refused_by_name(rope, message):
    with pytest.raises(ValueError, match=message):
        from_hf_config(_hf_dict(**rope), where="config.json")


def test_legacy_keys_still_import():
    """Directories written before rope_parameters (transformers 4.x, earlier olmo-ds exports) keep their meaning."""
    cfg = from_hf_config(_hf_dict(rope_theta=500_000.0, rope_scaling={"rope_type": "yarn", "factor": 8.0,
                                                                       "original_max_position_embeddings": 16}))
    assert cfg.rope_for(sliding=False) == (500_000.0, FULL_YARN) and cfg.rope_for(sliding=True) == (500_000.0, None)
    assert cfg.sliding_rope_theta is None and cfg.sliding_yarn is None
