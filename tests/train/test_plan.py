"""A run's plan (`olmo_ds.train.plan.plan_run`) on real shards and configs, without a DeepSpeed engine or a process group.

What it decides (the resume point and the data position there, the micro-batch, the DeepSpeed layout, what
`init_from` brings) and what it refuses, with the messages a user sees. Checkpoints here are their
train_state.json alone: that file is all a plan reads of one.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

from olmo_ds.train.config import ConfigError, config_from_dict
from olmo_ds.train.ds_config import AUTO, SHIPPED_DIR
from olmo_ds.train.launch import DistEnv
from olmo_ds.train.plan import RunPlan, plan_run, run_length

from train_testlib import tiny_config, write_markov_shards

ONE_RANK = DistEnv("single", rank=0, local_rank=0, world_size=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_markov_shards(tmp_path_factory.mktemp("plan") / "shards", 20_000)


def plan(tmp_path: Path, shards: Path, /, *, resume: str | None = None, start_over: bool = False, env: DistEnv = ONE_RANK,
         **sections) -> RunPlan:
    cfg = config_from_dict(tiny_config(tmp_path, shards, **sections), source=str(tmp_path / "run.yaml"))
    made = plan_run(cfg, resume=resume, start_over=start_over, env=env)
    made.loader.close()
    assert not torch.distributed.is_initialized(), "planning created a process group"
    return made


def refused(tmp_path: Path, shards: Path, message: str, /, **kw) -> None:
    with pytest.raises(ConfigError, match=message):
        plan(tmp_path, shards, **kw)


def fake_checkpoint(made: RunPlan, step: int, *, world_size: int = 1, model: dict | None = None) -> Path:
    """A checkpoint of `made`'s run at `step` as far as a plan reads one: its train_state.json, with the
    data loader's position after `step` batches."""
    for _ in range(step):
        made.loader.next_batch()
    directory = made.run_dir / "checkpoints" / f"step-{step:07d}"
    directory.mkdir(parents=True)
    state = {"step": step, "tokens_seen": 0, "data": made.loader.state_dict(), "model": model or made.model.to_dict(),
             "ds_config": made.deepspeed.config, "world_size": world_size, "zero_stage": made.deepspeed.zero.stage,
             "tokenizer_fingerprint": made.loader.tokenizer_fingerprint}
    made.loader.close()
    (directory / "train_state.json").write_text(json.dumps(state))
    return directory


def test_a_new_run_is_planned_from_its_config_and_the_deepspeed_json(tmp_path, data):
    made = plan(tmp_path, data)
    assert made.resume_dir is None and made.resume_state is None and made.init_from is None and made.evaluator is None
    assert (made.model.vocab_size, made.model.d_model) == (256, 32)  # the data's vocabulary sizes the model
    ds = made.deepspeed
    assert (ds.micro_batch.size, ds.micro_batch.chosen_by, ds.accumulation_steps, ds.precision) == (2, "config", 4, "fp32")
    assert (ds.zero.stage, ds.zero.optimizer_offloaded, ds.zero.optimizer_on_host, ds.zero.params_on_host) == (3, False, 0.0, False)
    config = ds.config
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]) == (8, 2, 4)
    assert config["fp16"]["enabled"] is False and config["bf16"]["enabled"] is False and AUTO not in json.dumps(config)
    assert config["optimizer"]["params"]["torch_adam"] is True  # CPU without offload: torch's AdamW, for exact resume
    assert [p.name for p in made.run_dir.iterdir()] == ["run.lock"]  # planning writes nothing but rank 0's lock on the run dir


def test_auto_micro_batch_becomes_a_number_in_the_config_and_the_json(tmp_path, data):
    made = plan(tmp_path, data, batch={"global_batch_size": 8, "micro_batch_size": "auto", "seq_len": 32},
                env=DistEnv("single", rank=0, local_rank=0, world_size=2))
    micro = made.deepspeed.micro_batch
    assert micro.chosen_by == "auto" and micro.size == 4  # the tiny model fits all 4 rows per rank
    assert made.cfg.batch.micro_batch_size == 4 == made.deepspeed.config["train_micro_batch_size_per_gpu"]
    assert made.deepspeed.accumulation_steps == 1


def test_cpu_offload_is_read_once_into_the_layout(tmp_path, data):
    made = plan(tmp_path, data, deepspeed_config=str(SHIPPED_DIR / "zero3_bf16_offload.json"))
    zero = made.deepspeed.zero
    # On the CPU accelerator the offload JSON's intent stands (weights on the host too); the tiny model's
    # optimizer state fits any host whole.
    assert (zero.optimizer_offloaded, zero.optimizer_on_host, zero.params_on_host, zero.offloaded) == (True, 1.0, True, True)
    assert "torch_adam" not in made.deepspeed.config["optimizer"]["params"]  # offload keeps DeepSpeedCPUAdam


def test_resume_auto_takes_the_newest_complete_checkpoint_and_its_data_position(tmp_path, data):
    first = plan(tmp_path, data, batch={"global_batch_size": 8, "micro_batch_size": "auto", "seq_len": 32})
    saved = fake_checkpoint(first, 3)
    (first.run_dir / "checkpoints" / "step-0000009").mkdir()  # an interrupted save: no train_state.json
    made = plan(tmp_path, data, resume="auto", batch={"global_batch_size": 8, "micro_batch_size": "auto", "seq_len": 32},
                init_from={"path": str(tmp_path / "missing")})  # the run's own checkpoint wins; init_from is not even read
    assert made.resume_dir == saved and made.resume_state["step"] == 3 and made.init_from is None
    assert made.loader.step == 3  # the next batch is the 4th
    assert (made.deepspeed.micro_batch.size, made.deepspeed.micro_batch.chosen_by) == (first.deepspeed.micro_batch.size, "checkpoint")


def test_a_held_run_dir_is_refused_without_resume_or_start_over(tmp_path, data):
    fake_checkpoint(plan(tmp_path, data), 2)
    refused(tmp_path, data, r"already holds a run \(checkpoints/step-0000002\); continue it with --resume auto")
    refused(tmp_path, data, r"--start-over and --resume auto exclude each other", resume="auto", start_over=True)
    made = plan(tmp_path, data, start_over=True)
    assert made.resume_dir is None and [p.name for p in made.run_dir.iterdir()] == ["run.lock"]  # moved aside, whole; a new lock
    assert len(list(tmp_path.glob("run.replaced-*/checkpoints/step-0000002"))) == 1


def test_resume_refusals_name_the_checkpoint(tmp_path, data):
    first = plan(tmp_path, data)
    other_model = {**first.model.to_dict(), "n_layers": 3}
    ckpt_dir = fake_checkpoint(first, 2, model=other_model)
    refused(tmp_path, data, rf"{ckpt_dir}: the checkpoint's model differs from the configured one \(n_layers: checkpoint 3, config 2\)",
            resume="auto")
    # Kernel choices are not the model: the same checkpoint's model resumes eagerly and with recomputation.
    json_path = ckpt_dir / "train_state.json"
    state = json.loads(json_path.read_text())
    json_path.write_text(json.dumps({**state, "model": first.model.to_dict()}))
    plan(tmp_path, data, resume="auto", model={**tiny_config(tmp_path, data)["model"], "compile": "eager", "activation_checkpointing": True})
    refused(tmp_path, data, rf"{ckpt_dir}: refusing to resume on different data \(seed: checkpoint 3, now 4\)", resume="auto",
            data={"sources": [{"path": str(data)}], "seed": 4, "prefetch": 1})


def test_another_world_size_is_refused_with_offload_or_another_zero_stage(tmp_path, data):
    offload = str(SHIPPED_DIR / "zero3_bf16_offload.json")
    fake_checkpoint(plan(tmp_path, data, deepspeed_config=offload), 2, world_size=2)
    refused(tmp_path, data, r"written by 2 data-parallel ranks, this run has 1; a CPU-offloaded ZeRO run resumes only on its "
                            r"checkpoint's number of ranks", resume="auto", deepspeed_config=offload)
    refused(tmp_path, data, r"this run has 1 and ZeRO stage 2 \(the checkpoint's is 3\)", resume="auto",
            deepspeed_config=str(SHIPPED_DIR / "zero2_bf16.json"))


def test_init_from_a_checkpoint_with_its_optimizer_follows_the_one_model_rule(tmp_path, data):
    source_run = tmp_path / "source"
    source = fake_checkpoint(plan(source_run, data, model={**tiny_config(tmp_path, data)["model"], "max_seq_len": 32},
                                  batch={"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32}), 2)
    spec = {"path": str(source_run / "run"), "load_optimizer": True}
    refused(tmp_path, data, rf"init_from.path {source_run}/run \(checkpoint {source}\) does not match this run: model.max_seq_len: "
                            r"source 32, this run 64\. .*a deliberate change of max_seq_len, yarn, rope_theta, sliding_rope_theta, sliding_yarn goes in init_from.allow_changes",
            init_from=spec)
    made = plan(tmp_path, data, init_from={**spec, "allow_changes": ["max_seq_len"]})
    assert made.init_from.directory == source and made.init_from.kind == "checkpoint" and made.resume_dir is None
    assert made.init_state_fingerprint == "sha256:" + hashlib.sha256((source / "train_state.json").read_bytes()).hexdigest()
    assert made.loader.step == 0  # a fresh data position


def test_init_from_weights_only_compares_shapes_not_names(tmp_path, data):
    """Weights alone may come from a model whose vocabulary or init differ as long as the embedding rows match;
    the optimizer state may not (resume's rule: every field but the execution ones)."""
    source_run = tmp_path / "source"
    model = tiny_config(tmp_path, data)["model"]
    fake_checkpoint(plan(source_run, data, model={**model, "init_std": 0.01}), 1)
    made = plan(tmp_path, data, init_from={"path": str(source_run / "run")})
    assert made.init_from is not None and made.init_state_fingerprint is None
    refused(tmp_path, data, r"the checkpoint's model differs from the configured one \(init_std: checkpoint 0.01, config 0.02\)",
            init_from={"path": str(source_run / "run"), "load_optimizer": True})


def test_resume_logs_each_step_once_moving_later_metrics_lines_aside(tmp_path, data):
    """A resume continues metrics.jsonl at its checkpoint's step; lines past it (and, with --resume auto and no
    checkpoint, every line: the run starts again at step 1) are moved aside, not appended to again (issue 35, defect 4)."""
    first = plan(tmp_path, data)
    log = first.run_dir / "metrics.jsonl"
    lines = "".join(json.dumps({"step": s, "time": 1.0}) + "\n" for s in range(1, 6))
    log.write_text(lines)
    refused(tmp_path, data, r"already holds a run", resume=None)  # a refused start moves nothing
    assert log.read_text() == lines
    restarted = plan(tmp_path, data, resume="auto")  # no checkpoint: from the start
    aside = list(first.run_dir.glob("metrics.jsonl.after-step-0-*"))
    assert log.read_text() == "" and len(aside) == 1 and aside[0].read_text() == lines
    fake_checkpoint(restarted, 3)
    log.write_text(lines)  # the restarted run logged 5 steps, saved at 3, and died
    plan(tmp_path, data, resume="auto")
    assert log.read_text() == "".join(lines.splitlines(keepends=True)[:3])
    assert [p.read_text() for p in first.run_dir.glob("metrics.jsonl.after-step-3-*")] == ["".join(lines.splitlines(keepends=True)[3:])]


def test_the_plan_says_how_many_epochs_max_steps_reads(tmp_path: Path, data: Path) -> None:
    """SFT recipes are given in epochs: the plan logs (`run_length`) the run's length in epochs and the steps one epoch takes."""
    made = plan(tmp_path, data, max_steps=12)
    epoch = made.loader.mixture.epoch_size
    line = run_length(made.cfg, made.loader)
    assert line.startswith(f"max_steps 12 reads 96 instances of 32 tokens: {96 / epoch:.2f} epochs"), line
    assert f"an epoch is {epoch} instances, {epoch / 8:,.2f} steps at global batch 8" in line, line
    ramp = plan(tmp_path / "ramp", data, max_steps=12, batch={"global_batch_size": 8, "schedule": [{"step": 0, "global_batch_size": 4}, {"step": 4, "global_batch_size": 8}]})
    line = run_length(ramp.cfg, ramp.loader)
    assert "reads 80 instances" in line and "ceil" not in line, line  # 4 x 4 + 8 x 8
