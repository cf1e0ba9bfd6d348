"""The GPU tier (`make test-gpu`): what the CPU suite cannot show, on one CUDA GPU (two for the last test).

bf16 training on CUDA through DeepSpeed's FusedAdam, ZeRO-3 with compiled blocks (leaf modules, the
path that failed before), FP8 block matmuls in them (`model.float8`) and `batch.micro_batch_size: auto`
against the GPU's memory, and ZeRO-3 resume after a SIGKILL. GPU kernels are not bitwise
deterministic, so resume is held to RESUME_TOLERANCE in loss against the straight run, with the
run-to-run noise of two straight runs measured alongside (OLMo-2-1B on one H200: ~1e-4).
The attention kernels' tier is tests/model/test_attention.py::test_gpu_backends_match_float64_reference.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from olmo_ds.model import float8 as fp8
from olmo_ds.tools.check_resume import ResumeCheck, run_check, verdict

from train_testlib import ROOT, losses_by_step, read_metrics, run, tiny_config, torchrun_cmd, write_config, write_markov_shards

PRETRAIN = ROOT / "scripts" / "pretrain.py"
RESUME_TOLERANCE = 2e-3  # |dloss| of the tiny bf16 model after resume; 20x the noise measured on the 1B
GPU_RUN = {"precision": "bf16", "deterministic": False, "max_steps": 12, "optim": {"lr": 1e-2}, "schedule": {"warmup_steps": 1},
           "model": {"preset": "tiny", "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "mlp_hidden": 128, "max_seq_len": 64},
           "batch": {"global_batch_size": 16, "micro_batch_size": 4, "seq_len": 32}, "checkpoint": {"every": 0},
           "logging": {"every": 1, "tensorboard": False}}

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def gpu_config(tmp: Path, **sections) -> Path:
    cfg = tiny_config(tmp, write_markov_shards(tmp / "shards", 40_000), **{**GPU_RUN, **sections})
    return write_config(tmp / "run.yaml", cfg)


def train(config: Path, cmd: list[str] | None = None) -> str:
    result = run(cmd or [sys.executable, str(PRETRAIN), "--config", str(config)], timeout=600)
    assert result.returncode == 0, f"--- stdout\n{result.stdout[-3000:]}\n--- stderr\n{result.stderr[-5000:]}"
    return result.stdout + result.stderr


@pytest.mark.parametrize("compile_mode", ["eager", "blocks"])
def test_bf16_zero3_trains_on_cuda(tmp_path, compile_mode):
    config = gpu_config(tmp_path, model={**GPU_RUN["model"], "compile": compile_mode})
    log = train(config)
    assert f"blocks {'compiled' if compile_mode == 'blocks' else 'eager'} (model.compile {compile_mode})" in log
    assert "ZeRO stage 3, bf16" in log
    losses = losses_by_step(tmp_path / "run")
    assert sorted(losses) == list(range(1, 13)) and all(map(torch.isfinite, torch.tensor(list(losses.values()))))
    assert (losses[11] + losses[12]) / 2 < losses[1] - 0.3, f"loss did not fall: {losses}"


def test_compiled_blocks_follow_eager_under_zero3(tmp_path):
    """Compiling changes kernels, not the math: the two runs agree to bf16 rounding over the first steps."""
    runs = {}
    for mode in ("eager", "blocks"):
        (tmp_path / mode).mkdir()
        train(gpu_config(tmp_path / mode, max_steps=6, model={**GPU_RUN["model"], "compile": mode}))
        runs[mode] = losses_by_step(tmp_path / mode / "run")
    diffs = [abs(runs["eager"][s] - runs["blocks"][s]) for s in range(1, 7)]
    assert max(diffs) < 0.05, f"compiled blocks diverge from eager: {runs}"


def test_zero3_resume_on_gpu_within_tolerance(tmp_path):
    """scripts/check_resume.py's check: 12 steps straight vs 8 + SIGKILL + resume, with the noise floor."""
    config = gpu_config(tmp_path)
    report = run_check(ResumeCheck(config=config, steps=12, kill_after=8, work_dir=tmp_path / "check", noise=True, timeout=600),
                       say=lambda _: None)
    code, line = verdict(report, RESUME_TOLERANCE)
    print(line)
    assert code == 0, line


@pytest.mark.skipif(fp8.unavailable() is not None, reason=f"model.float8: {fp8.unavailable()}")
def test_fp8_compiled_zero3_follows_bf16_and_auto_micro_batch_reads_the_gpu(tmp_path):
    """FP8 block matmuls inside compiled ZeRO-3 leaf blocks on CUDA (torch._scaled_mm's GPU kernels), both
    recipes: every block matmul in FP8 by the metrics, losses within FP8's rounding of the bf16 run's; the
    bf16 run's micro-batch comes from `auto` against this GPU's memory."""
    runs, metrics = {}, {}
    for recipe in ("off", "tensorwise", "rowwise"):
        (tmp_path / recipe).mkdir()
        batch = {**GPU_RUN["batch"], "micro_batch_size": "auto"} if recipe == "off" else GPU_RUN["batch"]
        log = train(gpu_config(tmp_path / recipe, max_steps=6, batch=batch,
                               model={**GPU_RUN["model"], "compile": "blocks", "float8": recipe}))
        runs[recipe] = losses_by_step(tmp_path / recipe / "run")
        metrics[recipe] = [m for m in read_metrics(tmp_path / recipe / "run") if "train/loss" in m]
        if recipe == "off":
            assert "batch.micro_batch_size auto: 16 per rank" in log and f"80% of {torch.cuda.get_device_name()}'s" in log, log[-3000:]
        else:
            assert f"model.float8 {recipe}: the 7 matmuls of every block in FP8" in log and "| fp8 100% |" in log
            assert all(m["perf/float8_matmul_fraction"] == 1.0 and m["perf/block_calls_eager"] == 0 for m in metrics[recipe])
    for recipe in ("tensorwise", "rowwise"):
        diffs = [abs(runs[recipe][s] - runs["off"][s]) for s in range(1, 7)]
        assert runs[recipe] != runs["off"] and max(diffs) < 0.1, f"{recipe} diverges from bf16: {runs}"


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpus_zero3_over_nccl(tmp_path):
    log = train(gpu_config(tmp_path), torchrun_cmd(PRETRAIN, "--config", str(tmp_path / "run.yaml")))
    assert "2 ranks" in log and sorted(losses_by_step(tmp_path / "run")) == list(range(1, 13))


def test_gpu_tier_runs_where_documented():
    """The Makefile target is what the docs name, and it selects this tier."""
    make = subprocess.run(["make", "-n", "test-gpu", "OFFLINE=1"], cwd=ROOT, capture_output=True, text=True)
    assert "OLMO_DS_TEST_DEVICE=cuda" in make.stdout and "-m gpu" in make.stdout, make.stdout + make.stderr
