"""An RL run's batch (issue 58, item 6): the global batch counts prompts, the micro-batch packed rows that every rollout
pads to whole micro-batches, so a batch of 2 prompts with micro-batch 4 is valid (it was refused as "not divisible");
only the prompts must split over the data-parallel ranks. The DeepSpeed JSON starts at one micro-batch per rank (the
trainer sets each step's rows). And RL's in-loop evaluation without validation prompts is refused as pretraining's is,
instead of printing an empty `eval step N | | 0.0s`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from olmo_ds.model import OLMo
from olmo_ds.model.config import preset
from olmo_ds.train.config import ConfigError, config_from_dict
from olmo_ds.train.ds_config import SHIPPED_DIR, load_ds_json, resolve_ds_config
from olmo_ds.train.launch import DistEnv
from olmo_ds.train.plan import plan_run
from olmo_ds.train.preflight import check_launch
from olmo_ds.weights import save_model_dir

from train_testlib import ROOT, launch_env, tiny_config, write_config

ONE_RANK = DistEnv("single", rank=0, local_rank=0, world_size=1)
TOKENIZER = "/work/shared/tokenizers/dolma2-tokenizer.json"
SEQ = 160
MODEL = {"preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 64, "max_seq_len": SEQ}


def rl_config(tmp_path, data, init, *, rl=None, **sections):
    cfg = tiny_config(tmp_path, data, **{"max_steps": 1, "model": MODEL, "tokenizer": TOKENIZER, "init_from": {"path": str(init)},
                                         "batch": {"global_batch_size": 2, "micro_batch_size": 4, "seq_len": SEQ},
                                         "rl": {"samples_per_prompt": 2, "max_new_tokens": 8, "generation_batch_size": 4, **(rl or {})},
                                         "logging": {"every": 1, "tensorboard": False}, "checkpoint": {"every": 0, "keep_last": 1},
                                         **sections})
    return cfg


def resolved(tmp_path, dp: int, *, ds: dict | None = None, **batch) -> dict:
    cfg = config_from_dict(rl_config(tmp_path, tmp_path / "data", tmp_path / "init", batch={**{"seq_len": SEQ}, **batch}),
                           source="run.yaml")
    return resolve_ds_config(cfg, cfg.model.build(vocab_size=256), dp, ds=ds, device="cpu")


def test_an_rl_batch_needs_only_its_prompts_split_over_the_ranks(tmp_path):
    ds = resolved(tmp_path, 1, global_batch_size=2, micro_batch_size=4)  # issue 58's example: refused before
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (4, 4, 1)
    ds = resolved(tmp_path, 2, global_batch_size=4, micro_batch_size=3)
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (6, 1)  # one micro-batch per rank to start
    with pytest.raises(ConfigError, match=r"run.yaml: global batch size 3 \(RL: prompts a step\) is not divisible by the "
                                          r"data-parallel size 2: each rank takes global / 2 prompts"):
        resolved(tmp_path, 2, global_batch_size=3, micro_batch_size=1)
    cfg = config_from_dict(rl_config(tmp_path, tmp_path / "data", tmp_path / "init", rl={"updates_per_rollout": 2}), source="run.yaml")
    with pytest.raises(ConfigError, match=r"rl.updates_per_rollout 2 exceeds the 1 prompts each of the 2 data-parallel ranks takes "
                                          r"at global batch size 2: .* raise the global batch to 4"):
        check_launch(cfg, 0, 0, 2, device="cpu")
    check_launch(cfg, 0, 0, 1, device="cpu")  # 2 prompts on one rank: one each update


def test_a_concrete_rl_batch_in_the_deepspeed_json_is_refused(tmp_path):
    ds = load_ds_json(SHIPPED_DIR / "zero3_bf16.json")
    ds["gradient_accumulation_steps"] = 4
    with pytest.raises(ConfigError, match=r"zero3_bf16.json: gradient_accumulation_steps = 4, but an RL run \(rl: in run.yaml\) "
                                          r"trains the rows each rollout packs, .* set gradient_accumulation_steps to \"auto\""):
        resolved(tmp_path, 1, ds=ds, global_batch_size=2, micro_batch_size=4)


def test_pretraining_batches_still_split_into_whole_micro_batches(tmp_path):
    cfg = config_from_dict(tiny_config(tmp_path, tmp_path / "data", batch={"global_batch_size": 2, "micro_batch_size": 4}),
                           source="run.yaml")
    with pytest.raises(ConfigError, match=r"global batch size 2 is not divisible by batch.micro_batch_size 4 x data-parallel size 1"):
        resolve_ds_config(cfg, cfg.model.build(vocab_size=256), 1, device="cpu")


@pytest.fixture(scope="module")
def prompts_and_model(tmp_path_factory):
    """tests/data/rl_fixtures' prompts prepared without a validation split, and a random tiny model as init_from."""
    root = tmp_path_factory.mktemp("rl_batch")
    result = subprocess.run([sys.executable, "scripts/prepare_data.py", "--format", "rl", "--chat-template", "olmo3", "--input",
                             "tests/data/rl_fixtures/train.jsonl", "--tokenizer", TOKENIZER, "--output", str(root / "prompts"),
                             "--max-tokens", "128", "--no-progress"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = preset("tiny", **{k: v for k, v in MODEL.items() if k != "preset"}, vocab_size=100278)
    torch.manual_seed(0)
    save_model_dir(root / "init", cfg, OLMo(cfg).state_dict())
    return root / "prompts", root / "init"


def test_the_plan_takes_two_prompts_with_micro_batch_four(tmp_path, prompts_and_model):
    made = plan_run(config_from_dict(rl_config(tmp_path, *prompts_and_model), source="run.yaml"), env=ONE_RANK)
    made.loader.close()
    ds = made.deepspeed
    assert (ds.micro_batch.size, ds.accumulation_steps, ds.config["train_batch_size"]) == (4, 1, 4)


def test_rl_in_loop_evaluation_without_validation_prompts_is_refused_naming_the_keys(tmp_path, prompts_and_model):
    data, init = prompts_and_model
    with pytest.raises(ConfigError, match=r"run.yaml: eval.every is 2 but there is nothing to evaluate: no RL prompt source "
                                          r"\(.*prompts\) has a validation split .* data.val_sources is empty. Prepare the prompts "
                                          r"with --val-fraction, set data.val_sources, or turn in-loop evaluation off with "
                                          r"--set eval.every=0"):
        plan_run(config_from_dict(rl_config(tmp_path, data, init, eval={"every": 2}), source="run.yaml"), env=ONE_RANK)
    with pytest.raises(ConfigError, match=r"eval.tasks \(arc_easy\) with rl: .* runs no eval.tasks"):
        plan_run(config_from_dict(rl_config(tmp_path, data, init, eval={"every": 2, "tasks": ["arc_easy"]}), source="run.yaml"),
                 env=ONE_RANK)
    assert not (tmp_path / "run").exists()  # a refused start leaves nothing


@pytest.mark.slow  # one RL step through the command line, ~30 s on 2 cores
def test_two_prompts_with_micro_batch_four_train_through_pretrain_py(tmp_path, prompts_and_model):
    config = write_config(tmp_path / "rl.yaml", rl_config(tmp_path, *prompts_and_model))
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(config)], cwd=ROOT,
                            env=launch_env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "step 1/1" in result.stdout and "not divisible" not in result.stderr
    assert "leaked" not in result.stderr, result.stderr[-3000:]  # nanobind's report of triton's objects at exit
