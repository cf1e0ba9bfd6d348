"""scripts/bench_train.py --sft on CPU: pretraining and fine-tuning (packed masked rows) at the same row length in
one command, both printed with their ratio, packing efficiency and trained fraction; `--loss-chunk` passes the
fine-tuning divisor through to the loss."""

from __future__ import annotations

import json
import sys

from tests.train.train_testlib import ROOT, run

SCRIPT = ROOT / "scripts" / "bench_train.py"
TINY = ["--preset", "tiny", "--seq-len", "64", "--micro-batch-size", "2", "--grad-accum", "2", "--warmup", "1", "--steps", "2",
        "--model-set", "d_model=32", "--model-set", "n_heads=2", "--model-set", "n_kv_heads=1", "--model-set", "mlp_hidden=64"]


def test_sft_mode_prints_sft_and_pretraining_tokens_per_s(tmp_path):
    out = tmp_path / "r.json"
    proc = run([sys.executable, str(SCRIPT), *TINY, "--work-dir", str(tmp_path), "--no-reference", "--sft", "--loss-chunk", "16",
                "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    sft, pre = r["deepspeed_sft"], r["deepspeed"]
    assert sft["tokens_per_s"] > 0 and pre["tokens_per_s"] > 0
    assert r["ratio_sft_to_pretraining"] == sft["tokens_per_s"] / pre["tokens_per_s"]
    assert 0.5 < sft["packing"]["efficiency"] <= 1 and 0 < sft["trained_fraction"] < sft["packing"]["efficiency"]
    assert "DeepSpeed, SFT packed rows" in proc.stdout and "SFT / pretraining tokens/s at seq 64" in proc.stdout
