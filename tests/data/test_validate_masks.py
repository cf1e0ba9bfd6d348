"""validate_shards on masked (fine-tuning) sources: each damaged loss mask is found and named by its shard."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_ds.data import shards
from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare
from olmo_ds.data.validate import format_report, validate_directory
from testdata import SHARED

REPO = Path(__file__).resolve().parents[2]
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
CHAT = SHARED / "data" / "chat-sample"
PAD = 100277


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("chat") / "src"
    prepare(PrepareConfig(inputs=[str(CHAT / "train.jsonl")], output=out, tokenizer=str(DOLMA2), format="chat", chat_template="olmo3",
                          shard_tokens=30_000, val_fraction=0.1, max_tokens=2048, long_conversations="truncate", progress=False), log=lambda _: None)
    return out


@pytest.fixture
def src(prepared, tmp_path) -> Path:
    shutil.copytree(prepared, tmp_path / "src")
    return tmp_path / "src"


def failures(directory: Path) -> dict[str, str]:
    r = validate_directory(directory)
    out = {s.name: "; ".join(s.errors) for s in r.shards if s.errors}
    out.update({f"error{i}": e for i, e in enumerate(r.errors)})
    return out


def test_a_prepared_chat_source_validates_with_its_trained_tokens(prepared):
    r = validate_directory(prepared, workers=2)
    assert r.ok, format_report(r)
    m = shards.Manifest.load(prepared)
    assert r.trained_tokens == m.extra["trained_tokens"] > 0
    assert sum(s.docs_without_eos for s in r.shards if not s.name.startswith("val/")) >= 1  # the cut conversations, allowed here
    text = format_report(r)
    assert "trained (loss mask)" in text and "end without EOS" in text
    proc = subprocess.run([sys.executable, "scripts/validate_shards.py", str(prepared), "--tokenizer", str(DOLMA2)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def flip(path: Path, at: int, value: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[at] = data[at] ^ 1 if value is None else value
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, shard, expected", [
    ("missing", "shard-00001.bin", "missing loss mask shard-00001.mask"),
    ("short", "shard-00001.bin", "loss mask shard-00001.mask: 29"),
    ("flipped", "shard-00001.bin", "loss mask shard-00001.mask: checksum mismatch"),
    ("not_bool", "shard-00002.bin", "byte 5 is 7, not 0 or 1"),
    ("val_missing", "val/shard-00000.bin", "missing loss mask shard-00000.mask"),
    ("orphan_on_plain", "shard-00001.bin", "no loss mask: the manifest says the source is masked"),
])
def test_a_damaged_mask_fails_naming_its_shard(src, damage, shard, expected):
    if damage == "missing":
        shards.mask_path(src, 1).unlink()
    elif damage == "short":
        p = shards.mask_path(src, 1)
        p.write_bytes(p.read_bytes()[:-100])
    elif damage == "flipped":
        flip(shards.mask_path(src, 1), 1234)
    elif damage == "not_bool":
        flip(shards.mask_path(src, 2), 5, 7)
    elif damage == "val_missing":
        shards.mask_path(src / "val", 0).unlink()
    else:  # metadata that forgot its mask
        meta = json.loads(shards.meta_path(src, 1).read_text())
        for k in shards.MASK_META:
            meta.pop(k)
        shards.meta_path(src, 1).write_text(json.dumps(meta))
    got = failures(src)
    assert shard in got and expected in got[shard], got


def test_trained_counts_must_agree_with_the_manifest(src):
    m = json.loads((src / "manifest.json").read_text())
    m["trained_tokens"] += 1
    (src / "manifest.json").write_text(json.dumps(m))
    got = failures(src)
    assert any("manifest.json: trained_tokens" in e for e in got.values()), got
    meta = json.loads(shards.meta_path(src, 0).read_text())
    meta["trained_tokens"] -= 1
    shards.meta_path(src, 0).write_text(json.dumps(meta))
    assert "trained tokens != metadata trained_tokens" in failures(src)["shard-00000.bin"]


def _write_source(directory: Path, tokens, lens, mask, **manifest_extra):
    class Tok:
        vocab_size, eos_id, pad_id, fingerprint = 100278, 100257, PAD, "sha256:test"

    directory.mkdir()
    shards.write_shard(directory, 0, np.asarray(tokens, np.uint32), np.r_[0, np.cumsum(lens)], vocab_size=100278, eos_id=100257,
                       mask=None if mask is None else np.asarray(mask, bool))
    shards.write_manifest(directory, Tok, "train", manifest_extra)


def test_a_trained_padding_token_fails(tmp_path):
    tokens = [100264, 5, PAD, 7, 100257]
    _write_source(tmp_path / "ok", tokens, [5], [0, 1, 0, 1, 1])
    assert validate_directory(tmp_path / "ok").ok
    _write_source(tmp_path / "bad", tokens, [5], [0, 1, 1, 1, 1])
    assert "padding token 100277 trained at token 2" in failures(tmp_path / "bad")["shard-00000.bin"]


def test_eos_less_documents_only_where_the_source_truncated_them(tmp_path):
    tokens, lens, mask = [100264, 5, 6, 100264, 8, 100257], [3, 3], [0, 1, 1, 0, 1, 1]
    _write_source(tmp_path / "cut", tokens, lens, mask, chat={"long_conversations": "truncate"})
    r = validate_directory(tmp_path / "cut")
    assert r.ok and r.shards[0].docs_without_eos == 1
    _write_source(tmp_path / "plain", tokens, lens, mask, chat={"long_conversations": None})
    assert "do not end in EOS" in failures(tmp_path / "plain")["shard-00000.bin"]


def test_a_mask_beside_a_plain_shard_fails(tmp_path):
    _write_source(tmp_path / "plain", [5, 100257], [2], None)
    shards.mask_path(tmp_path / "plain", 0).write_bytes(b"\x00\x01")
    assert "loss mask shard-00000.mask on a shard of a source whose manifest is not masked" in failures(tmp_path / "plain")["shard-00000.bin"]
