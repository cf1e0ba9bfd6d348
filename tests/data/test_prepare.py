import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from olmo_ds.data import shards
from olmo_ds.data.prepare import PrepareConfig, PrepareError, prepare, val_hash

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO / ".." / "shared"
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
NEOX = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
C4_DIR = SHARED / "data" / "c4-sample"


def c4_texts() -> list[str]:
    texts = []
    for path in sorted(C4_DIR.glob("*.json.gz")):
        with gzip.open(path, "rt") as f:
            texts += [json.loads(line)["text"] for line in f]
    return texts


def run(inputs, out, tokenizer=NEOX, **kw) -> object:
    kw.setdefault("chunk_bytes", 2048)  # many blocks, so that worker pools really interleave
    kw.setdefault("progress", False)
    return prepare(PrepareConfig(inputs=[str(i) for i in inputs], output=out, tokenizer=str(tokenizer), **kw), log=lambda _: None)


def read_all(directory: Path) -> tuple[np.ndarray, list[int]]:
    """All ids of a shard directory in name order, and the document lengths from the offsets."""
    ids, lens = [], []
    for b in shards.list_shards(directory):
        meta = shards.ShardMeta.load(b.with_suffix(".json"))
        ids.append(np.asarray(shards.open_tokens(b, meta)))
        lens += np.diff(shards.load_offsets(b.with_name(meta.offsets))).tolist()
    return np.concatenate(ids), lens


def dir_bytes(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("tokenizer, dtype", [(DOLMA2, np.uint32), (NEOX, np.uint16)])
def test_ids_equal_the_tokenizers_own_output(tmp_path, tokenizer, dtype):
    result = run([C4_DIR], tmp_path / "out", tokenizer, shard_tokens=4000)
    ref = tokenizers.Tokenizer.from_file(str(tokenizer))
    eos = ref.token_to_id("<|endoftext|>")
    docs = [ref.encode(t, add_special_tokens=False).ids + [eos] for t in c4_texts()]
    ids, lens = read_all(tmp_path / "out")
    assert ids.dtype == dtype
    assert ids.tolist() == [i for d in docs for i in d]
    assert lens == [len(d) for d in docs]
    manifest = shards.Manifest.load(tmp_path / "out")
    assert (manifest.num_docs, manifest.num_tokens) == (30, len(ids)) == (result.num_docs, result.num_tokens)
    assert manifest.dtype == np.dtype(dtype).name and manifest.eos_id == eos
    assert len(manifest.shards) > 1
    for b in shards.list_shards(tmp_path / "out"):  # shards close on a document boundary at --shard-tokens
        meta = shards.ShardMeta.load(b.with_suffix(".json"))
        assert meta.num_tokens <= 4000 and shards.sha256_file(b) == meta.checksum


def test_byte_identical_for_any_worker_count(tmp_path):
    outputs = [dir_bytes(run([C4_DIR], tmp_path / f"w{w}", DOLMA2, workers=w, shard_tokens=3000).output) for w in (1, 2, 3)]
    assert outputs[0] == outputs[1] == outputs[2]
    assert sum(name.endswith(".bin") for name in outputs[0]) > 2


def test_val_split_by_document_hash(tmp_path):
    out = tmp_path / "out"
    result = run([C4_DIR], out, NEOX, val_fraction=0.3, workers=2)
    texts = c4_texts()
    threshold = int(0.3 * 2**64)
    in_val = [val_hash(t) < threshold for t in texts]
    assert 0 < sum(in_val) < len(texts)
    ref = tokenizers.Tokenizer.from_file(str(NEOX))
    for directory, want in ((out, False), (out / "val", True)):
        ids, _ = read_all(directory)
        expected = [i for t, v in zip(texts, in_val) if v == want for i in ref.encode(t, add_special_tokens=False).ids + [50279]]
        assert ids.tolist() == expected
    assert (result.val_docs, shards.Manifest.load(out / "val").num_docs) == (sum(in_val), sum(in_val))


def test_text_and_jsonl_variants(tmp_path):
    import zstandard

    raw = tmp_path / "raw"
    (raw / "sub").mkdir(parents=True)
    texts = c4_texts()[:6]
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[:2]))
    (raw / "sub" / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress("".join(json.dumps({"body": t}) + "\n" for t in texts[2:4]).encode()))
    (raw / "sub" / "c.txt").write_text(texts[4])
    (raw / "ignored.csv").write_text("not an input")
    out = tmp_path / "out"
    with pytest.raises(PrepareError):  # b.jsonl.zst has no "text" field: every record of it is skipped...
        run([raw], out, NEOX, strict=True)
    result = run([raw], out, NEOX, overwrite=True)
    assert result.skipped.counts == {"missing_text_field": 2}
    assert result.skipped.examples["missing_text_field"] == [f"{(raw / 'sub' / 'b.jsonl.zst').resolve()}:1", f"{(raw / 'sub' / 'b.jsonl.zst').resolve()}:2"]
    ref = tokenizers.Tokenizer.from_file(str(NEOX))
    ids, _ = read_all(out)  # files in sorted path order: a.jsonl, sub/b.jsonl.zst, sub/c.txt
    assert ids.tolist() == [i for t in texts[:2] + texts[4:5] for i in ref.encode(t, add_special_tokens=False).ids + [50279]]


def test_script_end_to_end(tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "scripts/prepare_data.py", "--input", str(C4_DIR), "--output", str(out), "--tokenizer", str(NEOX), "--workers", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "30 docs" in proc.stdout and (out / "manifest.json").is_file()
    proc = subprocess.run(cmd[:-6] + ["--input", str(tmp_path / "missing.jsonl"), "--output", str(out), "--tokenizer", str(NEOX)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "missing.jsonl: no such file" in proc.stderr
