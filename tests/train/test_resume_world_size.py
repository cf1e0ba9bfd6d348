"""A ZeRO checkpoint written on 2 ranks resumes on 1 rank at the exact next global batch.

`--resume auto` on another data-parallel size converts the checkpoint once into DeepSpeed's universal
form (`step-NNNNNNN/universal/`) and loads that. The data order is exact (the loader's state is
world-size independent), so the resumed losses match the uninterrupted 2-rank run up to the order
of the gradient reductions, which differs between 1 and 2 ranks (fp32 on CPU: 0 to 1.2e-7 seen).
ZeRO-1 goes through the same DeepSpeed code as ZeRO-2 (stage_1_and_2) and is left out for time.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from olmo_ds.checkpoint import UNIVERSAL, read_train_state

from train_testlib import ROOT, losses_by_step, run, tiny_config, torchrun_cmd, write_config, write_markov_shards

PRETRAIN = ROOT / "scripts" / "pretrain.py"

pytestmark = pytest.mark.multirank


@pytest.mark.slow
@pytest.mark.parametrize("stage", [3, 2])
def test_resume_two_rank_checkpoint_on_one_rank(stage, tmp_path):
    data = write_markov_shards(tmp_path / "shards")
    cfg = tiny_config(tmp_path, data, max_steps=6, deepspeed_config=str(ROOT / "ds_configs" / f"zero{stage}_bf16.json"),
                      checkpoint={"every": 3, "keep_last": 2})
    config = write_config(tmp_path / "run.yaml", cfg)
    straight = Path(cfg["run_dir"])
    result = run(torchrun_cmd(PRETRAIN, "--config", str(config)))
    assert result.returncode == 0, result.stderr[-4000:]
    ref = losses_by_step(straight)
    assert sorted(ref) == list(range(1, 7))

    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step-0000003", resumed / "checkpoints" / "step-0000003")
    result = run(torchrun_cmd(PRETRAIN, "--config", str(config), "--set", f"run_dir={resumed}", "--resume", "auto", nproc=1))
    assert result.returncode == 0, result.stderr[-4000:]
    universal = resumed / "checkpoints" / "step-0000003" / UNIVERSAL
    assert universal.is_dir() and not universal.with_name(UNIVERSAL + ".tmp").exists()
    again = losses_by_step(resumed)
    assert sorted(again) == [4, 5, 6], "resume did not start after step 3"
    diff = max(abs(again[s] - ref[s]) for s in again)
    print(f"ZeRO-{stage}: max |loss difference| 1 rank vs 2 ranks, steps 4-6: {diff:.3g}")
    assert diff < 1e-5, (again, ref)
    end = read_train_state(resumed / "checkpoints" / "step-0000006")
    assert end["world_size"] == 1
    assert end["data"] == read_train_state(straight / "checkpoints" / "step-0000006")["data"]
