import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from olmo_ds.data.prepare.readers import read_documents, resolve_inputs
from olmo_ds.tokenizer import load_tokenizer, train_bpe_tokenizer
from testdata import SHARED

REPO = Path(__file__).resolve().parents[2]
C4_DIR = SHARED / "data" / "c4-sample"


def c4_texts() -> list[str]:
    return [t for f in resolve_inputs([str(C4_DIR)]) for t in read_documents(f)]


def test_trained_tokenizer_round_trips_and_is_deterministic(tmp_path):
    texts = c4_texts()
    tok = train_bpe_tokenizer(texts, 800, tmp_path / "a" / "tokenizer.json")
    again = train_bpe_tokenizer(texts, 800, tmp_path / "b" / "tokenizer.json")
    assert tok.fingerprint == again.fingerprint
    assert (tok.vocab_size, tok.eos_id, tok.pad_id) == (800, 0, 1)
    ids = tok.encode_batch(texts)
    assert all(tok.decode(i) == t for i, t in zip(ids, texts))  # byte-level: lossless, no unknown token
    assert max(map(max, ids)) < 800 and sum(map(len, ids)) < sum(len(t.encode()) for t in texts) / 2
    assert tok.encode("<|endoftext|>") == [0]
    with pytest.raises(ValueError, match="too small"):
        train_bpe_tokenizer(texts, 100, tmp_path / "c.json")


def test_script_reads_the_same_inputs_as_prepare(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "notes.txt").write_text("def add(a, b):\n    return a + b\n" * 50)
    with gzip.open(C4_DIR / "c4-sample.01.json.gz", "rt") as f:
        (raw / "web.jsonl").write_text(f.read())
    out = tmp_path / "tok" / "tokenizer.json"
    proc = subprocess.run([sys.executable, "scripts/train_tokenizer.py", "--input", str(raw), "--vocab-size", "400", "--output", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "vocab_size=400, eos_id=0, pad_id=1" in proc.stdout
    tok = load_tokenizer(out.parent)
    code = "def add(a, b):\n    return a + b\n"
    assert tok.decode(tok.encode(code)) == code and len(tok.encode(code)) < len(code) / 2
    assert json.loads(out.read_text())["model"]["type"] == "BPE"
