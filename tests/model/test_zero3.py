"""The model under real DeepSpeed ZeRO-3, and a real checkpoint exported to transformers.

One CPU rank in a subprocess (zero3_worker.py): partitioned parameters are gathered only while
their own module runs, so this fails if any parameter is read outside its module's forward (the
fused loss in the head), if initialisation happens after partitioning, or if activation
checkpointing breaks under ZeRO-3. The checkpoint it writes is then exported with
scripts/export_hf.py, consolidated on CPU, and must give transformers the same logits as ours.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from olmo_ds.model import OLMo
from olmo_ds.weights import load_weights
from olmo_ds.train.launch import free_port
from testdata import SHARED

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = SHARED / "tokenizers" / "dolma2-tokenizer.json"


def test_zero3_training_step_and_checkpoint_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    worker = Path(__file__).with_name("zero3_worker.py")
    proc = subprocess.run([sys.executable, str(worker), str(tmp_path), str(TOKENIZER), str(free_port())],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and "ZERO3 OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    ckpt = tmp_path / "run" / "checkpoints" / "step-0000001"

    loaded = load_weights(ckpt)
    cfg, state = loaded.provenance.cfg, loaded.state_dict
    trained = torch.load(tmp_path / "weights.pt")
    assert all(torch.equal(state[k], v) for k, v in trained.items())

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "scripts/export_hf.py", str(ckpt), str(out)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    ids = torch.tensor([tok("The quick brown fox jumps over the lazy dog.").input_ids])
    ours = OLMo(cfg).eval()
    ours.load_state_dict(state)
    with torch.no_grad():
        diff = (ours(ids) - hf(ids).logits).abs().max().item()
    assert diff <= 1e-4
