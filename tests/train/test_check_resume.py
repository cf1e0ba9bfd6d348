"""scripts/check_resume.py: N steps straight vs K steps + SIGKILL + `--resume auto`, as a user runs it.

On CPU in fp32 the resume must be bit-identical, and the check must say so; a difference, however
small, must be reported with its step and fail the check unless it is within --tolerance. One real
check with --noise (four single-rank launches, ~20 s on 2 cores) is shared by the tests.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from olmo_ds.tools.check_resume import ResumeCheck, compare, compare_weights, load_weights, losses_by_step, verdict

from train_testlib import ROOT, launch_env, tiny_config, write_config, write_markov_shards

CHECK = ROOT / "scripts" / "check_resume.py"


def check_resume(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), *args], env=launch_env(), cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("check")
    cfg = tiny_config(tmp, write_markov_shards(tmp / "shards"), logging={"tensorboard": False})
    return write_config(tmp / "run.yaml", cfg)


@pytest.fixture(scope="module")
def checked(config) -> tuple[subprocess.CompletedProcess, dict, Path]:
    work = config.parent / "work"
    result = check_resume("--config", str(config), "--steps", "6", "--kill-after", "4", "--launcher", "python",
                          "--noise", "--work-dir", str(work), "--json", str(work / "report.json"))
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    return result, json.loads((work / "report.json").read_text()), work


def test_cpu_resume_after_sigkill_is_bit_identical(checked):
    result, report, work = checked
    assert "PASS: resume is bit-identical" in result.stdout
    r = report["resume"]
    assert r["identical"] and r["losses_identical"] and r["weights_identical"] and report["passed"]
    assert r["max_abs_dloss"] == 0 and r["max_abs_dw"] == 0 and r["rel_dw"] == 0
    assert [row["step"] for row in r["rows"]] == [5, 6]
    assert all(row["ref"] == row["other"] and 0 < row["ref"] < 10 for row in r["rows"])
    noise = report["noise"]  # two straight runs on CPU: no run-to-run difference either
    assert noise["identical"] and noise["max_abs_dloss"] == 0 and noise["max_abs_dw"] == 0 and len(noise["rows"]) == 2
    # The resume really started from the step-4 checkpoint of a killed run and went on to step 6.
    assert report["killed_at_step"] >= 4 and report["precision"] == "fp32" and report["world_size"] == 1
    assert "resumed from" in (work / "resumed.log").read_text() and "step-0000004" in (work / "resumed.log").read_text()
    assert sorted(losses_by_step(work / "resumed")) == list(range(1, 7))


def test_a_difference_is_reported_at_its_step_and_fails(checked, tmp_path):
    _, report, work = checked
    ref = losses_by_step(work / "straight")
    _, ref_weights, _ = load_weights(work / "straight", 6)
    # A later metrics line for step 6 overrides the earlier one, as a resumed run's lines do.
    other = tmp_path / "other"
    shutil.copytree(work / "resumed", other)
    with open(other / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "train/loss": ref[6] + 1e-6}) + "\n")
    differing = {**report, "resume": compare(ref, ref_weights, other, range(5, 7), 6)}
    r = differing["resume"]
    assert not r["identical"] and not r["losses_identical"] and r["weights_identical"]
    assert r["max_dloss_step"] == 6 and r["max_abs_dloss"] == pytest.approx(1e-6, rel=1e-3)
    code, line = verdict(differing, tolerance=None)
    assert code == 1 and line.startswith("FAIL") and "(step 6)" in line
    code, line = verdict(differing, tolerance=1e-5)
    assert code == 0 and line.startswith("PASS within --tolerance")
    assert verdict(differing, tolerance=1e-7)[0] == 1

    # Weights: the largest difference is named by tensor; the relative one is over all weights together.
    a = {"wte": torch.ones(4), "head": torch.full((2,), 2.0)}
    b = {"wte": torch.ones(4), "head": torch.tensor([2.0, 2.5])}
    w = compare_weights(a, b)
    assert w["max_dw_tensor"] == "head" and w["max_abs_dw"] == 0.5 and not w["weights_identical"]
    assert w["rel_dw"] == pytest.approx(0.5 / (4 + 8) ** 0.5)


def test_bad_arguments_fail_before_any_run(config, tmp_path):
    work = tmp_path / "work"
    result = check_resume("--config", str(config), "--steps", "6", "--kill-after", "3", "--work-dir", str(work))
    assert result.returncode == 2 and "--kill-after 3 must be more than half of --steps 6" in result.stderr
    assert not work.exists(), "a run was started"

    def problem(**kw) -> str:
        with pytest.raises(ValueError) as e:
            ResumeCheck(**{"config": config, "steps": 6, "kill_after": 4, "work_dir": work, **kw}).validate()
        return str(e.value)

    assert "between 1 and --steps - 1" in problem(kill_after=6)
    assert "the python launcher runs one rank" in problem(nproc=2)
    assert "--resume-nproc 1: needs --launcher torchrun or deepspeed" in problem(resume_nproc=1)
    assert "parallel.sequence_parallel_size" in problem(launcher="torchrun", nproc=2, resume_overrides=["parallel.sequence_parallel_size=0"])
    assert "does not exist" in problem(config=tmp_path / "missing.yaml")
    assert "batch.seq_len must be > 0" in problem(overrides=["batch.seq_len=0"])
    work.mkdir()
    (work / "keep.txt").write_text("mine")
    assert "is not empty" in problem()


@pytest.mark.slow
@pytest.mark.multirank
def test_a_run_saved_on_two_ranks_resumes_on_one_with_the_same_losses(config, tmp_path):
    # Issue 47's resume across sizes, as the GPU acceptance runs it (scripts/gpu/acceptance.sh multi-resume): the
    # resumed launch has half the ranks, so its checkpoint is converted to DeepSpeed's universal format first.
    work = tmp_path / "work"
    result = check_resume("--config", str(config), "--steps", "6", "--kill-after", "4", "--launcher", "torchrun", "--nproc", "2",
                          "--resume-nproc", "1", "--tolerance", "1e-5", "--work-dir", str(work), "--json", str(work / "report.json"))
    assert result.returncode == 0, f"exit {result.returncode}\n--- stdout\n{result.stdout[-4000:]}\n--- stderr\n{result.stderr[-4000:]}"
    report = json.loads((work / "report.json").read_text())
    assert (report["nproc"], report["resume_nproc"]) == (2, 1) and report["resume"]["max_abs_dloss"] <= 1e-5
    assert "on 1 ranks" in result.stdout and "universal" in (work / "resumed.log").read_text()
