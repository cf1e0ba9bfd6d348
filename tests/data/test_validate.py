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
from olmo_ds.tokenizer import load_tokenizer
from testdata import SHARED

REPO = Path(__file__).resolve().parents[2]
NEOX = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared") / "shards"
    prepare(PrepareConfig(inputs=[str(SHARED / "data" / "c4-sample")], output=out, tokenizer=str(NEOX), shard_tokens=3000, val_fraction=0.2, progress=False), log=lambda _: None)
    return out


@pytest.fixture
def shard_dir(prepared, tmp_path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "shards"))


def problems(directory: Path, tokenizer=NEOX) -> str:
    report = validate_directory(directory, load_tokenizer(tokenizer) if tokenizer else None)
    assert not report.ok
    return format_report(report)


def test_clean_output_passes(shard_dir):
    report = validate_directory(shard_dir, load_tokenizer(NEOX), workers=2)
    text = format_report(report)
    assert report.ok, text
    assert any(s.name.startswith("val/") for s in report.shards)
    assert "shard-00000.bin: OK (" in text and "vocab_max=50279)" in text
    assert text.splitlines()[-1].startswith("total: OK")


def test_truncated_bin(shard_dir):
    b = shards.bin_path(shard_dir, 1)
    b.write_bytes(b.read_bytes()[:-2])
    assert "shard-00001.bin: FAIL: size" in problems(shard_dir)


def test_out_of_range_id(shard_dir):
    b = shards.bin_path(shard_dir, 0)
    ids = np.fromfile(b, dtype="<u2")
    ids[3] = 60000  # vocab is 50,280
    ids.tofile(b)
    text = problems(shard_dir)
    assert "token id 60000 >= vocab_size 50280" in text and "checksum mismatch" in text


def test_flipped_byte_and_missing_eos(shard_dir):
    b = shards.bin_path(shard_dir, 0)
    meta = shards.ShardMeta.load(shards.meta_path(shard_dir, 0))
    ids = np.fromfile(b, dtype="<u2")
    ids[int(shards.load_offsets(shards.offsets_path(shard_dir, 0))[1]) - 1] = 11  # the first document's EOS
    ids.tofile(b)
    text = problems(shard_dir)
    assert f"1 documents do not end in EOS {meta.eos_id} (first: document 0)" in text and "checksum mismatch" in text


def test_manifest_shard_mismatch(shard_dir):
    m = json.loads((shard_dir / "manifest.json").read_text())
    m["num_tokens"] += 1
    (shard_dir / "manifest.json").write_text(json.dumps(m))
    assert "!= sum over shards" in problems(shard_dir)


def test_wrong_tokenizer(shard_dir):
    text = problems(shard_dir, DOLMA2)
    assert "tokenizer fingerprint" in text and "shards made with another tokenizer" in text


def test_missing_shard_and_unlisted_shard(shard_dir):
    shards.bin_path(shard_dir, 1).unlink()
    assert "shard-00001.bin: FAIL: missing .bin file" in problems(shard_dir, None)
    shutil.copy(shards.bin_path(shard_dir, 0), shard_dir / "shard-00099.bin")
    assert "shard-00099.bin: on disk but not in manifest.json" in problems(shard_dir, None)


def test_bad_offsets(shard_dir):
    offsets = np.array(shards.load_offsets(shards.offsets_path(shard_dir, 0)))
    offsets[1], offsets[2] = offsets[2], offsets[1]
    np.save(shards.offsets_path(shard_dir, 0), offsets)
    assert "offsets not strictly increasing" in problems(shard_dir)


def test_corrupt_val_split(shard_dir):
    b = shards.bin_path(shard_dir / "val", 0)
    b.write_bytes(b.read_bytes()[:-2])
    assert "val/shard-00000.bin: FAIL: size" in problems(shard_dir)


def test_script_exit_codes_and_json(shard_dir):
    cmd = [sys.executable, "scripts/validate_shards.py", str(shard_dir), "--tokenizer", str(NEOX)]
    ok = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert ok.returncode == 0 and ok.stdout.splitlines()[0].startswith("shard-00000.bin: OK (")
    shards.bin_path(shard_dir, 0).unlink()
    bad = subprocess.run(cmd + ["--json"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 1
    report = json.loads(bad.stdout)
    assert report["ok"] is False and report["shards"][0]["errors"] == ["missing .bin file"]


def test_eos_inside_a_document_fails_unless_the_manifest_says_it_was_asked_for(tmp_path):
    """An EOS id inside a document (literal "<|endoftext|>" matched as the special token) makes
    readers that split at EOS see two documents where the offsets record one."""
    from tests.data.test_prepare import write_corpus_quoting_special_tokens

    raw = tmp_path / "raw"
    write_corpus_quoting_special_tokens(raw)
    out = tmp_path / "matched"
    prepare(PrepareConfig(inputs=[str(raw)], output=out, tokenizer=str(NEOX), shard_tokens=3000, match_special_tokens=True, progress=False), log=lambda _: None)
    report = validate_directory(out, load_tokenizer(NEOX))
    assert report.ok, format_report(report)
    assert sum(s.docs_with_inner_eos for s in report.shards) == 2
    assert "documents hold EOS inside (documents " in format_report(report) and "(prepared with --match-special-tokens)" in format_report(report)
    m = json.loads((out / "manifest.json").read_text())
    m["arguments"]["match_special_tokens"] = False  # as if nobody had asked for it
    (out / "manifest.json").write_text(json.dumps(m))
    text = problems(out)
    assert "shard-00000.bin: FAIL: 2 documents hold EOS 50279 before their end (first: document 3, token " in text


def test_a_source_of_no_tokens_fails(tmp_path):
    """A manifest over no shards (what prepare_data wrote for inputs without documents) is no source."""
    out = tmp_path / "empty"
    out.mkdir()
    shards.write_manifest(out, load_tokenizer(NEOX), "train", {})
    assert "holds no tokens (0 documents in 0 shards)" in problems(out)
    proc = subprocess.run([sys.executable, "scripts/validate_shards.py", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "no tokens" in proc.stdout
