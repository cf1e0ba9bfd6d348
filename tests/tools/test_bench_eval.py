"""bench_eval runs end to end on CPU with a tiny model (the figures themselves are for docs/evaluation.md),
in a process of its own since it starts a DeepSpeed engine: every section reports, and on fp32 the
packed path's accuracies are the exact path's."""

import json
import subprocess
import sys

from olmo_ds.tools import package_env
from testdata import SHARED


def test_bench_eval_tiny_on_cpu(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "-m", "olmo_ds.tools.bench_eval", "--preset", "tiny", "--limit", "4", "--ppl-rows", "4", "--seq-len", "128",
           "--batch-tokens", "2048", "--inloop-exact", "--work-dir", str(tmp_path / "work"), "--json", str(out)]
    env = {**package_env(), "OLMO_DS_SHARED": str(SHARED), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads(out.read_text())
    assert r["inputs"]["tasks"] == {"arc_easy": 4, "piqa": 4} and r["inputs"]["requests"] == 24
    exact, packed = r["tasks"]["exact"], r["tasks"]["packed"]
    assert packed["metrics"] == exact["metrics"]
    for m in (exact, packed):
        assert m["requests_per_s"] > 0 and m["request_tokens_per_s"] > 0 and m["forward_tokens_per_s"] > 0
    assert len(packed["steady_s"]) == 2 and exact["steady_s"] == []
    ppl = r["perplexity"]
    assert ppl["packed"]["tokens"] == ppl["exact"]["tokens"] == 4 * 127
    assert abs(ppl["packed"]["ce_loss"] - ppl["exact"]["ce_loss"]) < 1e-5
    loop = r["in_loop"]
    assert loop["zero_stage"] == 3 and len(loop["packed"]["calls"]) == 3 and len(loop["exact"]["calls"]) == 1
    assert loop["packed"]["calls"][-1]["request_tokens_per_s"] > 0 and loop["packed"]["steady_s"] > 0
    assert loop["packed"]["metrics"] == loop["exact"]["metrics"]
    check = r["precision_check"]
    assert check["low_vs_fp32"]["max_abs"] < 1e-4 and check["vs_cpu_fp32"]["low_device"]["max_abs"] < 1e-4
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith("bench_eval: tiny (random init), float32, cpu") for line in lines)
    assert any(line.startswith("packed / exact: multiple choice") for line in lines)
    assert any(line.startswith("in-loop packed (Trainer's evaluator, ZeRO-3") for line in lines)
