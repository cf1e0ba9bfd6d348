"""scripts/bench_train.py --dpo on CPU: the trainer's DPO step (synthetic pairs packed whole, reference cached), its
reference pass timed again after the one at start, and the SFT step on the same documents, in one command, printed
with their ratios (the GPU run's targets: DPO >= 0.95x SFT, the reference pass >= 2x the DPO step)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.train.train_testlib import ROOT, run

SCRIPT = ROOT / "scripts" / "bench_train.py"
TINY = ["--preset", "tiny", "--seq-len", "128", "--micro-batch-size", "2", "--grad-accum", "2", "--warmup", "1", "--steps", "2",
        "--model-set", "d_model=32", "--model-set", "n_heads=2", "--model-set", "n_kv_heads=1", "--model-set", "mlp_hidden=64"]


@pytest.mark.slow
def test_dpo_mode_times_the_dpo_step_the_reference_pass_and_sft_on_the_same_data(tmp_path):
    out = tmp_path / "r.json"
    proc = run([sys.executable, str(SCRIPT), *TINY, "--work-dir", str(tmp_path), "--no-reference", "--no-deepspeed", "--dpo",
                "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())["dpo"]
    assert d["dpo"]["tokens_per_s"] > 0 and d["sft"]["tokens_per_s"] > 0
    assert d["ratio_dpo_to_sft"] == d["dpo"]["tokens_per_s"] / d["sft"]["tokens_per_s"]
    ref = d["dpo"]["reference_pass"]
    assert ref["batches"] > 0 and ref["row_tokens"] == ref["batches"] * 2 * 128 and ref["first_pass"]["row_tokens"] == ref["row_tokens"]
    assert d["ratio_reference_pass_to_dpo_step"] == ref["tokens_per_s"] / d["dpo"]["tokens_per_s"]
    log = proc.stdout + proc.stderr
    assert log.count("reference pass: computed") == 1  # the trainer's, at start; the timed one is the benchmark's own
    assert "DPO (--dpo, dpo_norm, reference cached)" in proc.stdout and "DPO / SFT" in proc.stdout
    assert (tmp_path / "run-dpo" / "reference" / "reference.json").is_file()
