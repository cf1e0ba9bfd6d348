"""scripts/bench_scaling.py on CPU ranks: one launch per size through the real Trainer, the table and the verdict last,
each size's figures in its JSON (what issue 47's GPU run reads)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.train.train_testlib import ROOT, run


@pytest.mark.slow
@pytest.mark.multirank
def test_cpu_ranks_time_each_size_with_the_same_rows_per_rank(tmp_path):
    proc = run([sys.executable, str(ROOT / "scripts" / "bench_scaling.py"), "--preset", "tiny", "--seq-len", "128",
                "--gpus", "1,2", "--micro-batch-size", "auto", "--warmup", "1", "--steps", "2", "--work-dir", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"gpus{n}.json").read_text()) for n in (1, 2))
    assert (one["gpus"], two["gpus"]) == (1, 2) and one["micro_batch"]["chosen_by"] == "auto"
    assert one["tokens_per_s"] > 0 and two["tokens_per_s"] > 0 and len(two["losses"]) == 2
    table = proc.stdout.strip().splitlines()
    assert table[-5].startswith("| GPUs | micro-batch | tokens/s per GPU")
    assert table[-3].startswith("| 1 | 4 (auto) |") and " 1.000 |" in table[-3] and table[-2].startswith("| 2 | 4 (auto) |")
    assert table[-1].startswith("2 GPUs at ") and "(target >= 0.90)" in table[-1]


def test_bad_sizes_fail_before_any_launch(tmp_path):
    proc = run([sys.executable, str(ROOT / "scripts" / "bench_scaling.py"), "--micro-batch-size", "four",
                "--work-dir", str(tmp_path / "w")], timeout=120)
    assert proc.returncode == 2 and "--micro-batch-size 'four': a positive number or auto" in proc.stderr
    assert not (tmp_path / "w").exists()
