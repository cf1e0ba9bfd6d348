"""Presets: exact parameter counts against the published model sizes, built from configs only."""

from __future__ import annotations

import pytest
import torch

from olmo_ds.model import PRESETS, ModelConfig, OLMo, YarnConfig, preset

# Published sizes to 3 significant figures (allenai model cards, including embeddings): OLMo-2-0425-1B 1.48B,
# OLMo-2-1124-7B 7.30B, OLMo-2-1124-13B 13.7B, Olmo-3-1025-7B 7.30B, Olmo-3-1125-32B 32.2B.
PUBLISHED = {"olmo2-1b": 1.48e9, "olmo2-7b": 7.30e9, "olmo2-13b": 13.7e9, "olmo3-7b": 7.30e9, "olmo3-32b": 32.2e9}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_preset_parameter_count_matches_published_size(name):
    cfg = preset(name)
    count = cfg.num_params()
    print(f"{name}: {count:,} parameters ({cfg.num_params(include_embedding=False):,} without embeddings)")
    assert float(f"{count:.3g}") == PUBLISHED[name], f"{name}: {count:,} does not round to {PUBLISHED[name]:.3g}"
    assert cfg.padded_vocab_size == 100352


@pytest.mark.parametrize("name", list(PRESETS))
def test_num_params_counts_the_built_module(name):
    with torch.device("meta"):
        model = OLMo(preset(name))
    assert sum(p.numel() for p in model.parameters()) == preset(name).num_params()


def test_olmo3_layer_pattern_keeps_last_layer_full():
    cfg = preset("olmo3-7b")
    kinds = [cfg.layer_is_sliding(i) for i in range(cfg.n_layers)]
    assert kinds[:4] == [True, True, True, False] and kinds[-1] is False and sum(kinds) == 24


def test_config_round_trips_and_rejects_bad_values():
    cfg = preset("olmo3-32b")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="n_heads"):
        ModelConfig(d_model=64, n_heads=5)
    with pytest.raises(ValueError, match="attention_backend"):
        ModelConfig(attention_backend="flash")
    with pytest.raises(ValueError, match="unknown model config key"):
        ModelConfig.from_dict({"d_model": 64, "n_layer": 2})


def test_flops_per_token_counts_the_head_and_sliding_layers_at_their_window():
    full, sliding = preset("olmo2-7b"), preset("olmo3-7b")
    head = 100352 * 4096  # the output head's matmul runs per token; the input embedding is a lookup
    assert full.flops_params == full.num_params() - head
    assert full.flops_per_token(4096) == 6 * (full.num_params(include_embedding=False) + head) + 12 * 32 * 4096 * 4096
    # At T = 8192, 24 of 32 layers attend to 4096 keys, 8 to all 8192.
    assert sliding.flops_per_token(8192) == 6 * sliding.flops_params + 12 * 4096 * (24 * 4096 + 8 * 8192)
    assert sliding.flops_per_token(2048) == 6 * sliding.flops_params + 12 * 4096 * 32 * 2048
    # A tied head is still a matmul per token.
    tied = preset("olmo2-1b", tie_embeddings=True)
    assert tied.flops_per_token(4096) == preset("olmo2-1b").flops_per_token(4096)


def test_flops_formula_gives_the_issues_mfu_for_olmo2_1b():
    """Issue #8: 55,000 tokens/s on 989 TFLOP/s is about 52% MFU for olmo2-1b at seq 4096."""
    cfg = preset("olmo2-1b")
    assert cfg.flops_per_token(4096) == 6 * 1_279_395_840 + 12 * 16 * 2048 * 4096 == 9_286_987_776
    assert round(100 * 55_000 * cfg.flops_per_token(4096) / 989e12, 1) == 51.6
    assert cfg.flops_formula(4096) == ("FLOPs/token = 6 x 1,279,395,840 params (all but the input embedding; output head "
                                       "included) + 12 x 16 layers x 2048 d_model x 4096 seq_len = 9.287e+09")
    assert "163,840 keys summed over layers" in preset("olmo3-7b").flops_formula(8192)


def test_compile_mode_is_validated_and_auto_means_cuda_only():
    assert preset("tiny").compile == "auto"
    assert preset("tiny").compiles_blocks("cuda") and not preset("tiny").compiles_blocks("cpu")
    assert preset("tiny", compile="blocks").compiles_blocks("cpu")
    assert not preset("tiny", compile="eager").compiles_blocks("cuda")
    with pytest.raises(ValueError, match=r"model.compile 'on' is not one of: auto, blocks, eager"):
        preset("tiny", compile="on")


def test_presets_are_copied_not_shared():
    a = preset("olmo3-7b")
    a.sliding_window_pattern.append(True)
    assert preset("olmo3-7b").sliding_window_pattern == [True, True, True, False]


def test_preset_table_prints_every_preset(capsys):
    from olmo_ds.model.__main__ import main

    main()
    out = capsys.readouterr().out
    assert "1,484,916,736" in out and "32,234,279,936" in out
    assert all(name in out for name in PRESETS)


@pytest.mark.parametrize("fields, message", [
    (dict(rope_theta=-1), r"model.rope_theta must be a finite number > 1 .*got -1"),
    (dict(rope_theta=0.0), r"model.rope_theta must be a finite number > 1 .*got 0.0"),
    (dict(rope_theta=float("nan")), r"model.rope_theta must be a finite number > 1 .*got nan"),
    (dict(sliding_window=4, sliding_window_pattern=[True, False], sliding_rope_theta=-10.0),
     r"model.sliding_rope_theta must be a finite number > 1 .*got -10.0"),
    (dict(sliding_rope_theta=10_000.0), r"model.sliding_rope_theta is set but no layer is sliding"),
    (dict(sliding_window=0, sliding_window_pattern=[True, False]), r"model.sliding_window must be a positive integer or null, got 0"),
    (dict(sliding_window=-4, sliding_window_pattern=[True, False]), r"model.sliding_window must be a positive integer or null, got -4"),
    (dict(sliding_window=4.5, sliding_window_pattern=[True, False]), r"model.sliding_window must be a positive integer or null, got 4.5"),
    (dict(sliding_window=True, sliding_window_pattern=[True, False]), r"model.sliding_window must be a positive integer or null, got True"),
    (dict(sliding_window=4, sliding_window_pattern=["yes", False]), r"model.sliding_window_pattern must be a list of true/false"),
    (dict(norm_eps=0.0), r"model.norm_eps must be a finite number > 0 .*got 0.0"),
    (dict(norm_eps=-1e-6), r"model.norm_eps must be a finite number > 0 .*got -1e-06"),
    (dict(init_std=0), r"model.init_std must be a finite number > 0 .*got 0"),
    (dict(n_layers=True), r"model.n_layers must be a positive integer, got True"),
    (dict(n_kv_heads=3), r"model.n_heads 4 is not divisible by model.n_kv_heads 3"),
    (dict(tie_embeddings="false"), r"model.tie_embeddings must be true or false, got 'false'"),
    (dict(yarn={"factor": 0.5}), r"model.yarn.factor must be >= 1"),
    (dict(yarn={"beta_fast": 1.0, "beta_slow": 1.0}), r"model.yarn needs beta_fast > beta_slow > 0"),
    (dict(yarn={"original_max_position_embeddings": 0}), r"model.yarn.original_max_position_embeddings must be a positive integer, got 0"),
    (dict(yarn={"factor": float("inf")}), r"model.yarn.factor must be a finite number, got inf"),
    (dict(sliding_window=4, sliding_window_pattern=[True, False], sliding_yarn={"factor": 2.0, "beta_slow": -1.0}),
     r"model.sliding_yarn needs beta_fast > beta_slow > 0"),
])
def test_values_that_give_nan_or_nonsense_are_refused_by_key_and_value(fields, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig(**{**dict(d_model=64, n_layers=2, n_heads=4, mlp_hidden=128, vocab_size=256, max_seq_len=64), **fields})


def test_negative_rope_theta_is_refused_at_config_load(tmp_path):
    """Issue 35.6: `--set model.rope_theta=-1` trained NaN from step 1; now the config does not load."""
    from olmo_ds.train.config import ConfigError, load_config

    path = tmp_path / "run.yaml"
    path.write_text("run_dir: runs/x\nmodel:\n  preset: tiny\ndata:\n  sources:\n    - path: data/demo/shards\n")
    assert load_config(path).model.build().rope_theta == 500_000.0
    with pytest.raises(ConfigError, match=r"run.yaml.*model.rope_theta must be a finite number > 1 .*got -1.0"):
        load_config(path, ["model.rope_theta=-1"])
    with pytest.raises(ConfigError, match=r"model.sliding_window must be a positive integer or null, got 0"):
        load_config(path, ["model.sliding_window=0", "model.sliding_window_pattern=[true, false]"])


def test_configs_and_checkpoints_written_before_rope_per_layer_type_keep_their_meaning():
    """A model dict without sliding_rope_theta / sliding_yarn (every checkpoint's train_state and model_config.json so
    far) loads as one base for all layers and YaRN on the full layers, equal to the same config built now."""
    old = preset("olmo3-7b", rope_theta=10_000.0, yarn=YarnConfig(factor=8.0)).to_dict()
    del old["sliding_rope_theta"], old["sliding_yarn"]
    cfg = ModelConfig.from_dict(old)
    assert cfg == preset("olmo3-7b", rope_theta=10_000.0, yarn=YarnConfig(factor=8.0))
    assert cfg.rope_for(sliding=True) == (10_000.0, None) and cfg.rope_for(sliding=False) == (10_000.0, YarnConfig(factor=8.0))
