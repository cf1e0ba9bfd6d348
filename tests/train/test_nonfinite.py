"""A non-finite loss or gradient norm is never saved into a checkpoint; the run exits non-zero naming the step
and the likely causes, config values first (issue 35, defect 6). Real one-rank CPU runs of scripts/pretrain.py."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ds import checkpoint as ckpt
from olmo_ds.tools.check_resume import read_metrics

from train_testlib import ROOT, launch_env, tiny_config, write_config, write_markov_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_markov_shards(tmp_path_factory.mktemp("nonfinite") / "shards", 20_000)


def pretrain(tmp_path: Path, shards: Path, **sections) -> tuple[subprocess.CompletedProcess, Path]:
    cfg = tiny_config(tmp_path, shards, max_steps=3, logging={"tensorboard": False}, **sections)
    config = write_config(tmp_path / "run.yaml", cfg)
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(config)],
                            env=launch_env(), capture_output=True, text=True, timeout=300)
    return result, Path(cfg["run_dir"])


def saved_steps(run_dir: Path) -> list[int]:
    return [step for step, _ in ckpt.list_checkpoints(ckpt.checkpoints_dir(run_dir), complete_only=False)]


def test_a_loss_nan_from_the_first_step_saves_nothing_and_names_the_config_value(tmp_path, shards):
    """A value the config accepts (a positive init_std) that makes every loss NaN: before, 3 steps exited 0 with
    two NaN checkpoints saved."""
    model = {**tiny_config(tmp_path, shards)["model"], "init_std": 1e30}
    result, run_dir = pretrain(tmp_path, shards, model=model, checkpoint={"every": 2})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert saved_steps(run_dir) == []  # neither the periodic save at step 2 nor the final one
    assert "step 2: no checkpoint saved: this step's loss or gradient norm is not finite" in result.stdout
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: step 3: the loss or gradient norm is not finite (loss nan"), error
    assert "at every step of this run since its first; the run reached max_steps 3 on it" in error
    assert (f"most likely first: (1) config values outside their usual range in {tmp_path / 'run.yaml'}: "
            f"model.init_std = 1e+30 (usual: 0.002 to 0.05). (2) the data: ") in error
    assert "The learning rate is not a cause: step 1's loss and gradients come from the initial weights" in error
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]  # every step is still logged


def test_a_run_that_diverges_keeps_its_last_finite_checkpoint_newest(tmp_path, shards):
    """Finite at step 1, then the weights blow up: step 1 is saved, the non-finite steps 2 and 3 are not (before:
    step 3 was saved, from finite but useless weights, and the run exited 0)."""
    result, run_dir = pretrain(tmp_path, shards, checkpoint={"every": 1},
                               optim={"lr": 1e30, "grad_clip": 0.0}, schedule={"kind": "constant", "warmup_steps": 0})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert saved_steps(run_dir) == [1]
    error = result.stderr.strip().splitlines()[-1]
    newest = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(1)
    assert error.startswith("error: step 3: the loss or gradient norm is not finite"), error
    assert "2 steps since step 1, the last finite one; the run reached max_steps 3 on it" in error
    assert f"the newest checkpoint, {newest}, is from a finite step" in error
    # The config value first, then the learning rate as a cause; resuming is what to do once fixed.
    assert re.search(r"\(1\) config values outside their usual range in \S+: optim.lr = 1e\+30 .*\(2\) the learning rate: "
                     r"optim.lr 1e\+30 reached after schedule.warmup_steps 0 with optim.grad_clip 0", error), error
    assert error.endswith("Fix the cause, then resume with --resume auto")
