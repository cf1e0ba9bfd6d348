"""The rl: section's refusals (issue 52): each names the key, the value and the fix, from the config alone or from
the plan, before any engine or device is touched."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from olmo_ds.train.config import ConfigError, RLConfig, config_from_dict
from olmo_ds.train.launch import DistEnv
from olmo_ds.train.plan import plan_run

from train_testlib import tiny_config, write_markov_shards

ONE_RANK = DistEnv("single", rank=0, local_rank=0, world_size=1)
INIT = {"path": "/nonexistent/sft-run"}  # never read: every refusal here comes first


def config(tmp_path, rl: dict, **sections):
    cfg = tiny_config(tmp_path, tmp_path / "data", rl=rl, **{"init_from": INIT, **sections})
    return config_from_dict(cfg, source=str(tmp_path / "run.yaml"))


@pytest.mark.parametrize("rl,message", [
    ({"samples_per_prompt": 1}, r"rl.samples_per_prompt must be >= 2, got 1"),
    ({"samples_per_prompt": 0}, r"rl.samples_per_prompt must be a positive integer, got 0"),
    ({"clip_low": 1.0}, r"rl.clip_low must be in \[0, 1\), got 1.0"),
    ({"clip_low": -0.1}, r"rl.clip_low must be in \[0, 1\)"),
    ({"clip_high": 0.0}, r"rl.clip_high must be > 0, got 0.0"),
    ({"clip_high": None}, r"rl.clip_high is null but the other clip bound is set"),
    ({"tis_cap": 0.5}, r"rl.tis_cap must be > 1, or 0 / null to turn truncated importance sampling off, got 0.5"),
    ({"tis_cap": 1.0}, r"rl.tis_cap must be > 1"),
    ({"beta": -1.0}, r"rl.beta must be >= 0"),
    ({"kl_estimator": "k4"}, r"rl.kl_estimator 'k4' is not one of k1, k2, k3"),
    ({"temperature": 0.0}, r"rl.temperature must be > 0"),
    ({"updates_per_rollout": 0}, r"rl.updates_per_rollout must be a positive integer, got 0"),
    ({"updates_per_rollout": 1.5}, r"rl.updates_per_rollout: expected an integer, got 1.5"),
    ({"updates_per_rollout": "2"}, r"rl.updates_per_rollout: expected an integer, got '2'"),
    ({"updates_per_rollout": 9}, r"rl.updates_per_rollout 9 exceeds the 8 prompts of a step \(batch.global_batch_size\): each "
                                 r"update trains 1/K of the step's prompts, so some would have none"),
    ({"max_new_tokens": 32}, r"rl.max_new_tokens 32 leaves no room for a prompt in batch.seq_len 32"),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, rl, message):
    with pytest.raises(ConfigError, match=message) as e:
        config(tmp_path, {"max_new_tokens": 16, **rl})
    assert str(tmp_path / "run.yaml") in str(e.value)


def test_rl_needs_init_from(tmp_path):
    with pytest.raises(ConfigError, match=r"rl needs init_from.path: RL starts from a model that can already answer"):
        config(tmp_path, {"max_new_tokens": 16}, init_from={"path": None})


def test_rl_and_dpo_together_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"rl and dpo are both set"):
        config(tmp_path, {"max_new_tokens": 16}, dpo={"loss": "dpo"})


def test_rl_with_sequence_parallelism_is_accepted_where_the_rows_can_be_spread(tmp_path):
    cfg = config(tmp_path, {"max_new_tokens": 16}, parallel={"sequence_parallel_size": 2})
    assert cfg.parallel.sequence_parallel_size == 2 and cfg.rl is not None
    # what sequence parallelism cannot split is still refused: 2 heads over 4 ranks, rows of 30 tokens over 4
    with pytest.raises(ConfigError, match=r"parallel.sequence_parallel_size 4: the model's 2 attention heads"):
        config(tmp_path, {"max_new_tokens": 16}, parallel={"sequence_parallel_size": 4})
    with pytest.raises(ConfigError, match=r"batch.seq_len 30 is not a multiple of 4"):
        config(tmp_path, {"max_new_tokens": 16}, parallel={"sequence_parallel_size": 4},
               model={"n_heads": 4, "n_kv_heads": 2}, batch={"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 30})


def test_the_defaults_are_open_instructs_olmo3_settings():
    rl = RLConfig()
    assert (rl.clip_low, rl.clip_high, rl.tis_cap, rl.beta, rl.kl_estimator, rl.temperature) == (0.2, 0.272, 2.0, 0.0, "k3", 1.0)
    assert RLConfig(tis_cap=0).cap is None and RLConfig(tis_cap=None).cap is None and rl.cap == 2.0


def test_several_updates_per_rollout_are_accepted_up_to_the_prompts_of_a_step(tmp_path):
    assert config(tmp_path, {"max_new_tokens": 16, "updates_per_rollout": 8}).rl.updates_per_rollout == 8
    with pytest.raises(ConfigError, match=r"rl.updates_per_rollout 4 exceeds the 2 prompts of a step \(batch.global_batch_size "
                                          r"schedule\)"):
        config(tmp_path, {"max_new_tokens": 16, "updates_per_rollout": 4},
               batch={"schedule": [{"step": 0, "global_batch_size": 2}, {"step": 5, "global_batch_size": 8}]})


def test_off_switches_are_accepted(tmp_path):
    cfg = config(tmp_path, {"max_new_tokens": 16, "clip_low": None, "clip_high": None, "tis_cap": None})
    assert cfg.rl.clip_low is None and cfg.rl.cap is None


def test_the_plan_refuses_rl_on_data_that_is_not_prompts(tmp_path):
    shards = write_markov_shards(tmp_path / "shards", 5_000)
    cfg = config_from_dict(tiny_config(tmp_path, shards, rl={"max_new_tokens": 16}, init_from=INIT),
                           source=str(tmp_path / "run.yaml"))
    with pytest.raises(ConfigError, match=r"the rl: section needs RL prompts, but data.sources .* are not: prepare them with "
                                          r"prepare_data.py --format rl, or remove rl:"):
        plan_run(cfg, env=ONE_RANK)
    assert not torch.distributed.is_initialized()
    assert not (Path(tmp_path) / "run").exists()  # a refused start leaves nothing behind


def test_the_rollout_memory_estimate_adds_the_decode_copy_and_the_kv_cache():
    from olmo_ds.model.config import preset
    from olmo_ds.model.decode import bytes_per_sequence
    from olmo_ds.train.memory import GiB, estimate_peak_memory, estimate_rollout_memory

    model = preset("olmo2-1b")
    one = estimate_rollout_memory(model, generation_batch=64, max_len=1280)
    assert one.decode_copy == 2 * model.num_params()  # bf16, every parameter
    assert one.kv_cache == 64 * bytes_per_sequence(model, 1280, torch.bfloat16)
    assert one.model_state == estimate_peak_memory(model, micro_batch=1, seq_len=1).model_state
    eight = estimate_rollout_memory(model, generation_batch=64, max_len=1280, dp_world_size=8)
    assert eight.decode_copy == one.decode_copy and eight.model_state < one.model_state / 7  # the copy is whole on every rank
    assert 10 < one.total / GiB < 40 and "the decode copy" in one.describe()


@pytest.fixture(scope="module")
def prompt_shards(tmp_path_factory) -> Path:
    """tests/data/rl_fixtures' training prompts through prepare_data.py --format rl (OLMo 3's template, dolma2)."""
    import subprocess
    import sys

    from train_testlib import ROOT

    out = tmp_path_factory.mktemp("rlplan") / "prompts"
    result = subprocess.run([sys.executable, "scripts/prepare_data.py", "--format", "rl", "--chat-template", "olmo3", "--input",
                             "tests/data/rl_fixtures/train.jsonl", "--tokenizer", TOKENIZER, "--output", str(out),
                             "--max-tokens", "256", "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


TOKENIZER = "/work/shared/tokenizers/dolma2-tokenizer.json"


def plan_prompts(tmp_path, shards, **sections):
    cfg = tiny_config(tmp_path, shards, tokenizer=TOKENIZER, init_from=INIT, **sections)
    cfg["model"] = {**cfg["model"], "max_seq_len": 256}
    return plan_run(config_from_dict(cfg, source=str(tmp_path / "run.yaml")), env=ONE_RANK)


def test_the_plan_refuses_prompts_without_rl_and_a_prompt_that_leaves_no_room(tmp_path, prompt_shards):
    with pytest.raises(ConfigError, match=r"are RL prompts, which train with GRPO: add an rl: section"):
        plan_prompts(tmp_path, prompt_shards, batch={"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 128})
    # the fixtures' longest prompt is 102 tokens: 102 + 64 > 128
    with pytest.raises(ConfigError, match=r"a prompt of 102 tokens \(.*prompts\) plus rl.max_new_tokens 64 exceeds batch.seq_len 128 .*"
                                          r"raise batch.seq_len to 166"):
        plan_prompts(tmp_path, prompt_shards, batch={"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 128},
                     rl={"max_new_tokens": 64})
    with pytest.raises(ConfigError, match=r"rl needs `tokenizer`"):
        cfg = tiny_config(tmp_path, prompt_shards, init_from=INIT, rl={"max_new_tokens": 16},
                          batch={"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 128})
        cfg["model"] = {**cfg["model"], "max_seq_len": 256}
        plan_run(config_from_dict(cfg, source=str(tmp_path / "run.yaml")), env=ONE_RANK)
    assert not torch.distributed.is_initialized()
