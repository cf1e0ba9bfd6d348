"""scripts/bench_attention.py: the work it credits each backend with is the work the mask allows (counted here
against the model's own boolean mask), and without a GPU it says so instead of timing anything."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from olmo_ds.model.attention import AttentionMask
from olmo_ds.tools.bench_attention import doc_lens, pairs

from tests.train.train_testlib import ROOT


@pytest.mark.parametrize("window", [None, 700, 5000])
@pytest.mark.parametrize("documents", [False, True])
def test_pairs_are_what_the_models_mask_allows(window, documents):
    batch, seq = 2, 3000
    lens = doc_lens(batch, seq) if documents else None
    allowed = AttentionMask(batch, seq, torch.device("cpu"), lens).dense(window).expand(batch, 1, seq, seq)
    assert pairs(batch, seq, window, lens) == int(allowed.sum())


def test_documents_fill_each_row_with_the_loaders_mean_length():
    lens = doc_lens(4, 8192)
    assert lens.sum(dim=1).tolist() == [8192] * 4
    assert 900 < lens[lens > 0].float().mean() < 1500


def test_without_a_gpu_nothing_is_timed():
    assert not torch.cuda.is_available()
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_attention.py")], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "no CUDA device is visible" in proc.stderr
