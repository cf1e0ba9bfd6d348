import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_ds.data import shards
from olmo_ds.data.prepare.megatron import export_megatron, import_megatron
from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare
from olmo_ds.data.validate import validate_directory
from olmo_ds.tokenizer import load_tokenizer
from testdata import SHARED

REPO = Path(__file__).resolve().parents[2]
C4_DIR = SHARED / "data" / "c4-sample"


def write_idx(prefix: Path, code: int, docs: list[list[list[int]]], dtype) -> None:
    """A Megatron/NeoX index written straight from the format description (independent of the code under test)."""
    seqs = [s for d in docs for s in d]
    sizes = np.array([len(s) for s in seqs], dtype="<i4")
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1])]).astype("<i8") * np.dtype(dtype).itemsize
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    np.array([t for s in seqs for t in s], dtype=dtype).tofile(prefix.with_suffix(".bin"))
    with open(prefix.with_suffix(".idx"), "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code) + struct.pack("<Q", len(seqs)) + struct.pack("<Q", len(doc_idx)))
        f.write(sizes.tobytes() + pointers.tobytes() + doc_idx.tobytes())


@pytest.mark.parametrize("tokenizer, code", [("dolma2-tokenizer.json", 4), ("gpt-neox-olmo-dolma-v1_5.json", 8)])
def test_round_trip(tmp_path, tokenizer, code):
    path = SHARED / "tokenizers" / tokenizer
    ours = tmp_path / "ours"
    prepare(PrepareConfig(inputs=[str(C4_DIR)], output=ours, tokenizer=str(path), shard_tokens=3000, progress=False), log=lambda _: None)
    n, tokens = export_megatron(ours, tmp_path / "mg" / "c4_text_document")
    assert n == 30
    idx = (tmp_path / "mg" / "c4_text_document.idx").read_bytes()
    magic, version, dtype_code, seqs, d = struct.unpack("<9sQBQQ", idx[:34])
    assert (magic, version, dtype_code, seqs, d) == (b"MMIDIDX\x00\x00", 1, code, 30, 31)
    sizes = np.frombuffer(idx, "<i4", 30, 34)
    doc_idx = np.frombuffer(idx, "<i8", 31, 34 + 12 * 30)
    assert sizes.sum() == tokens and doc_idx.tolist() == list(range(31))
    concatenated = b"".join(p.read_bytes() for p in shards.list_shards(ours))
    assert (tmp_path / "mg" / "c4_text_document.bin").read_bytes() == concatenated

    back = tmp_path / "back"
    tok = load_tokenizer(path)
    import_megatron(tmp_path / "mg" / "c4_text_document", back, tok, shard_tokens=3000)
    for p in sorted(ours.glob("shard-*.bin")) + sorted(ours.glob("shard-*.offsets.npy")):
        assert (back / p.name).read_bytes() == p.read_bytes(), p.name
    assert validate_directory(back, tok).ok
    # One manifest writer: the imported directory records what docs/data.md lists, as prepare_data's does.
    imported, prepared = shards.Manifest.load(back), shards.Manifest.load(ours)
    assert (imported.extra["split"], imported.extra["pad_id"]) == ("train", tok.pad_id) == (prepared.extra["split"], prepared.extra["pad_id"])


def test_import_sentence_split_int16_and_append_eos(tmp_path):
    tok = load_tokenizer(SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json")
    # Document 0 has two sequences (sentence-split), document 1 is empty, document 2 one sequence.
    write_idx(tmp_path / "mg", 3, [[[5, 6], [7]], [], [[8, 9, 10]]], "<i2")
    with pytest.raises(ValueError, match="document 0 does not end in EOS 50279; pass --append-eos"):
        import_megatron(tmp_path / "mg", tmp_path / "a", tok)
    m = import_megatron(tmp_path / "mg", tmp_path / "b", tok, append_eos=True)
    assert (m.num_docs, m.num_tokens, m.extra["source"]["dropped_empty"]) == (2, 8, 1)
    ids = np.fromfile(tmp_path / "b" / "shard-00000.bin", dtype="<u2").tolist()
    assert ids == [5, 6, 7, 50279, 8, 9, 10, 50279]
    assert shards.load_offsets(tmp_path / "b" / "shard-00000.offsets.npy").tolist() == [0, 4, 8]


def test_bad_indexes_are_refused(tmp_path):
    tok = load_tokenizer(SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json")
    write_idx(tmp_path / "f", 6, [[[1, 2]]], "<f4")
    with pytest.raises(ValueError, match="dtype code 6 does not hold token ids"):
        import_megatron(tmp_path / "f", tmp_path / "o1", tok)
    write_idx(tmp_path / "big", 4, [[[1, 60000, 50279]]], "<i4")
    with pytest.raises(ValueError, match="token 60000 at position 1 is outside"):
        import_megatron(tmp_path / "big", tmp_path / "o2", tok)
    with pytest.raises(FileNotFoundError, match="missing.bin: not found"):
        import_megatron(tmp_path / "missing", tmp_path / "o3", tok)


def test_script(tmp_path):
    tok = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
    write_idx(tmp_path / "mg", 8, [[[5, 50279]], [[6, 7, 50279]]], "<u2")
    proc = subprocess.run([sys.executable, "scripts/convert_shards.py", "from-megatron", str(tmp_path / "mg"), str(tmp_path / "ours"), "--tokenizer", str(tok)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "scripts/convert_shards.py", "to-megatron", str(tmp_path / "ours"), str(tmp_path / "again")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"again{ext}").read_bytes() == (tmp_path / f"mg{ext}").read_bytes()
