"""Ulysses sequence parallelism in the model (olmo_ds/model/sequence_parallel.py): rows spread over 2 and 4 CPU
ranks give the whole-row loss and gradients, with sliding windows, document masks, RoPE positions that restart per
conversation, loss masks, grouped-query heads split or repeated, and activation checkpointing; the model without
its windows does not (the comparison sees the windows). The trainer's side: tests/train/test_sequence_parallel.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from olmo_ds.model import ModelConfig, OLMo
from olmo_ds.model.sequence_parallel import SequenceParallel, sequence_parallel_problems
from olmo_ds.tools.check_resume import launch_env

from model_testlib import OLMO3_TINY
from testdata import ROOT

WORKER = Path(__file__).with_name("sp_model_worker.py")


def run_worker(out: Path, nproc: int, *args: str) -> dict:
    env = launch_env()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), str(Path(__file__).parent), str(ROOT / "tests"),
                                                                env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER),
                           str(out), *args], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("sp") / "results.json", 4)


@pytest.mark.multirank
def test_rows_spread_over_ranks_give_the_whole_row_loss_and_gradients(results):
    cases = {name: r for name, r in results.items() if name != "without windows"}
    assert len(cases) == 13
    for name, r in cases.items():
        assert r["loss_diff"] <= 1e-6 * max(1.0, r["loss"]), (name, r)
        assert r["grad_rel"] <= 1e-5, (name, r)


@pytest.mark.multirank
def test_the_comparison_sees_the_windows(results):
    """Without its sliding windows the same model is far from the spread rows: a sequence-parallel attention that
    dropped the windows (as DeepSpeed's stock wrapper drops 4-D masks) would fail the test above."""
    r = results["without windows"]
    assert r["loss_diff"] > 1e-4 and r["grad_rel"] > 1e-2, r


def test_what_cannot_be_spread_is_named():
    assert sequence_parallel_problems(1, n_heads=3, n_kv_heads=3, seq_len=7) == []
    assert sequence_parallel_problems(4, n_heads=8, n_kv_heads=2, seq_len=64) == []  # kv heads repeated
    assert sequence_parallel_problems(2, n_heads=8, n_kv_heads=4, seq_len=64) == []
    heads, = sequence_parallel_problems(4, n_heads=6, n_kv_heads=6, seq_len=64)[:1]
    assert "6 attention heads (model.n_heads)" in heads
    kv = sequence_parallel_problems(4, n_heads=12, n_kv_heads=3, seq_len=64)
    assert len(kv) == 1 and "3 key/value heads (model.n_kv_heads)" in kv[0]
    rows = sequence_parallel_problems(4, n_heads=8, n_kv_heads=8, seq_len=4098)
    assert len(rows) == 1 and "batch.seq_len 4098 is not a multiple of 4" in rows[0]


def test_sequence_parallelism_is_for_training_forwards():
    model = OLMo(ModelConfig(**OLMO3_TINY))
    sp = SequenceParallel(group=None, size=2, rank=0, name="unused")
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match="sequence parallelism is for training forwards"):
        model(ids, score=(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)), sequence_parallel=sp)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_exchange_runs_inside_compiled_flex_blocks(tmp_path):
    """One GPU, a group of one rank (each all-to-all a copy): DeepSpeed's exchange traced into the compiled blocks,
    with flex_attention over windows and documents in bf16, trains as the blocks without it, each against the model
    eager in fp32 (a graph that dropped the exchange's backward would leave everything before it without gradient)."""
    r = run_worker(tmp_path / "gpu.json", 1, "cuda")
    plain, exchange = r["plain"], r["exchange"]
    assert plain["compiled"] == exchange["compiled"] == 5, r  # every block of both forwards compiled
    assert exchange["loss_diff"] < 1e-2, r
    for name, err in exchange["grad_rel"].items():
        assert err < max(2 * plain["grad_rel"][name], 1e-2) and err < 3e-2, (name, err, plain["grad_rel"][name])
