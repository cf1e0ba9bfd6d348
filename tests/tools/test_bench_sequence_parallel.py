"""scripts/bench_sequence_parallel.py on 2 CPU ranks: one launch per size through the real Trainer, the table last;
both sizes train the same rows, so their losses agree (the benchmark times the run it claims to)."""

from __future__ import annotations

import json
import sys

import pytest

from tests.train.train_testlib import ROOT, run


@pytest.mark.slow
@pytest.mark.multirank
def test_cpu_ranks_time_each_size_and_train_the_same_rows(tmp_path):
    proc = run([sys.executable, str(ROOT / "scripts" / "bench_sequence_parallel.py"), "--preset", "tiny", "--seq-len", "128",
                "--gpus", "2", "--sizes", "1,2", "--warmup", "1", "--steps", "2", "--work-dir", str(tmp_path)], timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"sp{n}.json").read_text()) for n in (1, 2))
    assert (one["data_parallel_size"], two["data_parallel_size"]) == (2, 1)
    assert all(abs(a - b) <= 1e-6 * b for a, b in zip(two["losses"], one["losses"], strict=True)), (one["losses"], two["losses"])
    table = proc.stdout.strip().splitlines()
    assert table[-4].startswith("| N | data-parallel | tokens/s per rank")
    assert table[-2].startswith("| 1 | 2 |") and table[-1].startswith("| 2 | 1 |") and " 1.000 |" in table[-2]
