"""`model.float8` and `batch.micro_batch_size: auto` in the train config and the trainer.

Errors come before any device or process group is touched, naming the key and its value; a real 2-rank
ZeRO-3 run on CPU (gloo) with FP8 and an automatic micro-batch logs both, reports the FP8 share of the
block matmuls in metrics.jsonl and on the console, records the choice in train_state.json, and resumes with
FP8 switched off (an execution field: no scale state) keeping the micro-batch its checkpoint ran with.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

from olmo_ds.checkpoint import read_train_state
from olmo_ds.model import float8 as fp8
from olmo_ds.train.config import ConfigError, config_from_dict
from olmo_ds.train.preflight import check_launch

from train_testlib import ROOT, launch_env, read_metrics, run, tiny_config, torchrun_cmd, write_config, write_markov_shards

PRETRAIN = ROOT / "scripts" / "pretrain.py"
needs_torchao = pytest.mark.skipif(fp8.unavailable() is not None, reason=f"model.float8: {fp8.unavailable()}")


def config(**fields):
    tree = {"model": {"preset": "tiny", "float8": "tensorwise"}, "data": {"sources": [{"path": "unused"}]}, "precision": "bf16",
            "batch": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 64}}
    for key, value in fields.items():
        tree[key] = {**tree.get(key, {}), **value} if isinstance(value, dict) else value
    return config_from_dict(tree, source="run.yaml")


def test_float8_config_errors_name_the_key_and_value():
    assert config().model.build().float8 == "tensorwise"
    with pytest.raises(ConfigError, match=r"run.yaml: model: model.float8 'fp8' is not one of: off, tensorwise, rowwise"):
        config(model={"float8": "fp8"})
    with pytest.raises(ConfigError, match=r"run.yaml: model.float8 'rowwise' with precision fp16: .*use precision bf16"):
        config(model={"float8": "rowwise"}, precision="fp16")
    with pytest.raises(ConfigError, match=r"run.yaml: model.float8 'tensorwise' needs batch.seq_len to be a multiple of 16 .*got 60"):
        config(batch={"seq_len": 60})
    with pytest.raises(ConfigError, match=r"needs batch.seq_len / parallel.sequence_parallel_size 4, a rank's share of a row, to be a "
                                          r"multiple of 16 .*got 96"):
        config(batch={"seq_len": 96}, parallel={"sequence_parallel_size": 4})  # 24 tokens a rank
    assert config(model={"float8": False}).model.build().float8 == "off"  # `float8: off` unquoted in YAML


def test_float8_launch_checks_come_before_any_device_is_used():
    cfg = config()
    with pytest.raises(ConfigError, match=r"run.yaml: model.float8 'tensorwise': NVIDIA A100-SXM4-80GB is sm_80; FP8 matmuls need "
                                          r"compute capability 8.9 or higher .*; or set model.float8: \"off\""):
        check_launch(cfg, 0, 0, 1, env={}, visible_gpus=1, host_gpus=1, device="cuda", gpu_capability=(8, 0),
                     gpu_name="NVIDIA A100-SXM4-80GB")
    check_launch(cfg, 0, 0, 1, env={}, visible_gpus=1, host_gpus=1, device="cuda", gpu_capability=(9, 0), gpu_name="NVIDIA H200")
    with mock.patch.object(fp8, "unavailable", return_value=f"torchao is not installed: {fp8.INSTALL}"):
        with pytest.raises(ConfigError, match=r"model.float8 'tensorwise': torchao is not installed: pip install 'torchao>=0.18'"):
            check_launch(cfg, 0, 0, 1, env={}, device="cpu")
        check_launch(config(model={"float8": "off"}), 0, 0, 1, env={}, device="cpu")  # not needed when off


@needs_torchao
@pytest.mark.multirank
def test_fp8_run_with_auto_micro_batch_reports_and_resumes_without_fp8(tmp_path):
    data_dir = write_markov_shards(tmp_path / "shards", 30_000)
    cfg = tiny_config(tmp_path, data_dir, max_steps=4, checkpoint={"every": 2, "keep_last": 2}, logging={"every": 1, "tensorboard": False},
                      model={"float8": "tensorwise"}, batch={"micro_batch_size": "auto"})
    path = write_config(tmp_path / "run.yaml", cfg)
    first = run(torchrun_cmd(PRETRAIN, "--config", str(path)))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-5000:]
    out = first.stdout
    # 8 sequences over 2 ranks: 4 rows per rank, and the tiny model fits them all in one micro-batch.
    assert "batch.micro_batch_size auto: 4 per rank; estimated peak" in out and "the host's" in out, out[-3000:]
    assert "model.float8 tensorwise: the 7 matmuls of every block in FP8" in out and "torch._scaled_mm's CPU kernel" in out
    assert "| fp8 100% |" in out
    run_dir = Path(cfg["run_dir"])
    lines = [m for m in read_metrics(run_dir) if "train/loss" in m]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    for m in lines:  # 2 layers, one micro-batch per step on each rank, eager blocks on CPU
        assert (m["perf/block_calls_eager"], m["perf/block_calls_compiled"]) == (2, 0), m
        assert (m["perf/float8_matmuls"], m["perf/float8_matmul_fraction"]) == (14, 1.0), m
    state = read_train_state(run_dir / "checkpoints" / "step-0000004")
    assert state["micro_batch"]["size"] == 4 and state["micro_batch"]["chosen_by"] == "auto" and state["micro_batch"]["estimate_bytes"] > 0
    assert state["config"]["batch"]["micro_batch_size"] == 4 and state["ds_config"]["train_micro_batch_size_per_gpu"] == 4
    assert state["model"]["float8"] == "tensorwise"

    # Resume with FP8 off: the same weights and optimizer state continue; the micro-batch stays the checkpoint's.
    second = run(torchrun_cmd(PRETRAIN, "--config", str(path), "--resume", "auto", "--set", "max_steps=6", "--set", "model.float8=off"))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-5000:]
    assert "batch.micro_batch_size auto: 4, kept from the checkpoint this run resumes" in second.stdout
    assert "resumed from" in second.stdout and "| fp8" not in second.stdout and "model.float8" not in second.stdout
    after = [m for m in read_metrics(run_dir) if "train/loss" in m][4:]
    assert [m["step"] for m in after] == [5, 6] and all("perf/float8_matmuls" not in m for m in after)
    state = read_train_state(run_dir / "checkpoints" / "step-0000006")
    assert state["model"]["float8"] == "off" and state["micro_batch"]["chosen_by"] == "checkpoint"


def test_pretrain_reports_a_float8_error_before_starting(tmp_path):
    """The CLI turns the launch check into one `error:` line and exit 2 (an fp16 run here)."""
    cfg = tiny_config(tmp_path, write_markov_shards(tmp_path / "shards", 5_000), precision="fp16", model={"float8": "tensorwise"})
    proc = subprocess.run([sys.executable, str(PRETRAIN), "--config", str(write_config(tmp_path / "r.yaml", cfg))],
                          env=launch_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "model.float8 'tensorwise' with precision fp16" in proc.stderr, proc.stderr[-2000:]
