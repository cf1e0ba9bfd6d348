"""`bash scripts/eval.sh` end to end on an exported model: one rank and two ranks give the same numbers;
bad input fails fast with the file and line. (Checkpoints and the transformers agreement:
test_checkpoints.py.)"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from eval_testlib import ARC_EASY, C4, NEOX, PIQA, export_hf

REPO = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    return export_hf(model, NEOX, tmp_path_factory.mktemp("export") / "hf")


def eval_sh(args, nproc=1, cwd=None):
    env = {**os.environ, "NPROC": str(nproc), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "eval.sh"), *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=300)
    return proc


@pytest.mark.multirank
def test_eval_sh_one_and_two_ranks_agree(exported, tmp_path):
    args = [exported, "--data", f"c4={C4[0]}", "--tasks", PIQA, ARC_EASY, "--limit", "10", "--seq-len", "64", "--batch-tokens", "512"]
    one = eval_sh(args + ["--out", tmp_path / "one"], cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    assert "| c4 |" in one.stdout and "| piqa | 10 |" in one.stdout and "| arc_easy | 10 |" in one.stdout
    two = eval_sh(args + ["--out", tmp_path / "two"], nproc=2, cwd=tmp_path)
    assert two.returncode == 0, two.stderr
    r1 = json.loads((tmp_path / "one" / "results.json").read_text())
    r2 = json.loads((tmp_path / "two" / "results.json").read_text())
    assert r2["config"]["eval"]["world_size"] == 2
    for name in ("ce_loss", "bits_per_byte", "tokens", "bytes"):
        assert r1["perplexity"]["c4"][name] == r2["perplexity"]["c4"][name]
    for task in ("piqa", "arc_easy"):
        for m in ("acc", "acc_per_token", "acc_per_char", "bits_per_byte_corr", "primary"):
            assert r1["tasks"][task][m] == r2["tasks"][task][m]
    assert r1["kind"] == "hf" and r1["tokenizer_fingerprint"].startswith("sha256:")
    assert r1["versions"]["torch"] == torch.__version__
    st = r1["stats"]["tasks"]
    assert st["batching"] == "packed" and r1["config"]["eval"]["batching"] == "packed"
    for key in ("requests_per_second", "request_tokens_per_second", "forward_tokens_per_second", "scored_tokens_per_second"):
        assert st[key] > 0, key
    for key in ("tokens_per_second", "rows_per_second", "forward_tokens_per_second"):
        assert r1["perplexity"]["c4"][key] > 0, key
    assert "request tokens/s" in one.stdout and "forward tokens/s" in one.stdout


def test_eval_sh_reports_bad_input_before_loading(exported, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "Q", "choices": ["a", "b"], "gold": 5}\n')
    proc = eval_sh([exported, "--tasks", bad])
    assert proc.returncode == 2 and f"{bad}:1: gold index 5 is out of range for 2 choices" in proc.stderr
    proc = eval_sh([tmp_path / "nothing-here"])
    assert proc.returncode == 2 and "no such checkpoint, run or model directory" in proc.stderr


def test_default_sources_are_the_runs_validation_data(tmp_path):
    from olmo_ds.eval.runner import _default_sources

    # named as the in-loop evaluation names them (its name, else its directory's), so offline and in-loop tags agree
    assert _default_sources({"data": {"val_sources": [{"path": "d/shards/val"}, {"path": "w/val", "name": "wiki"}]}}) == ["val=d/shards/val", "wiki=w/val"]
    (tmp_path / "c4" / "val").mkdir(parents=True)
    (tmp_path / "c4" / "val" / "manifest.json").write_text("{}")
    (tmp_path / "code").mkdir()
    sources = {"data": {"sources": [{"path": str(tmp_path / "c4")}, {"path": str(tmp_path / "code")}]}}
    assert _default_sources(sources) == [f"c4={tmp_path / 'c4' / 'val'}"]  # a source without val/ has nothing held out
