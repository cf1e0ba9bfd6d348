"""OLMo's token files registered in place (olmo_ds/data/prepare/token_files.py), on files written the way
OLMo writes them: np.memmap(path, mode="w+", dtype=...) of each document's ids followed by EOS."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from olmo_ds.data import shards
from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.dataset import TokenSource
from olmo_ds.data.loader import DataLoader
from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare
from olmo_ds.data.prepare.token_files import TokenFileError, register_token_files
from olmo_ds.data.validate import validate_directory
from olmo_ds.tokenizer import load_tokenizer
from tests.data.test_prepare import C4_DIR, DOLMA2, NEOX, c4_texts

REPO = Path(__file__).resolve().parents[2]


def write_olmo_npy(path: Path, docs: list[list[int]], dtype, index: bool = False) -> np.ndarray:
    """As OLMo-core's data guide and Dolma's tokenizer write them: a raw memmap, no header."""
    ids = np.array([i for d in docs for i in d], dtype=dtype)
    path.parent.mkdir(parents=True, exist_ok=True)
    mm = np.memmap(path, mode="w+", dtype=dtype, shape=(len(ids),))
    mm[:] = ids
    mm.flush()
    del mm
    if index:  # Dolma's metadata: start,end,id,src,loc per document
        with gzip.open(path.with_name(path.name.replace(".npy", ".csv.gz")), "wt") as f:
            start = 0
            for k, d in enumerate(docs):
                f.write(f"{start},{start + len(d)},doc{k},s3://bucket/src.json.gz,{k + 1}\n")
                start += len(d)
    return ids


def encoded(tokenizer: Path, texts: list[str]) -> list[list[int]]:
    ref = tokenizers.Tokenizer.from_file(str(tokenizer))
    eos = ref.token_to_id("<|endoftext|>")
    return [ref.encode(t, add_special_tokens=False).ids + [eos] for t in texts]


@pytest.mark.parametrize("tokenizer, dtype", [(DOLMA2, np.uint32), (NEOX, np.uint16)])
def test_registered_in_place_reads_the_files_tokens_and_documents(tmp_path, tokenizer, dtype):
    docs = encoded(tokenizer, c4_texts())
    a = write_olmo_npy(tmp_path / "mix" / "a" / "part-0-00000.npy", docs[:12], dtype)
    b = write_olmo_npy(tmp_path / "mix" / "b" / "part-0-00000.npy", docs[12:], dtype, index=True)
    tok = load_tokenizer(tokenizer)
    m = register_token_files([str(tmp_path / "mix")], tmp_path / "src", tok, workers=2)
    assert (m.num_docs, m.num_tokens, m.dtype) == (30, len(a) + len(b), np.dtype(dtype).name)
    assert not list((tmp_path / "src").glob("*.bin"))  # nothing copied
    source = TokenSource(tmp_path / "src")
    out = np.empty(source.num_tokens, dtype=np.int64)
    source.read(0, out)
    assert out.tolist() == np.concatenate([a, b]).tolist()
    assert source.doc_lengths(0, source.num_tokens).tolist() == [len(d) for d in docs]
    assert validate_directory(tmp_path / "src", tok).ok
    # The fingerprint is the files' names in the manifest, sizes and sha256s: not where they live.
    before = source.fingerprint()
    (tmp_path / "mix").rename(tmp_path / "moved")
    register_token_files([str(tmp_path / "moved")], tmp_path / "src2", tok)
    assert TokenSource(tmp_path / "src2").fingerprint() == before


def test_usable_in_a_mixture_with_prepared_shards(tmp_path):
    docs = encoded(NEOX, c4_texts())
    write_olmo_npy(tmp_path / "mix" / "part-0-00000.npy", docs, np.uint16)
    tok = load_tokenizer(NEOX)
    register_token_files([str(tmp_path / "mix")], tmp_path / "olmo", tok)
    prepare(PrepareConfig(inputs=[str(C4_DIR)], output=tmp_path / "ours", tokenizer=str(NEOX), progress=False), log=lambda _: None)
    cfg = DataConfig(sources=[SourceConfig(str(tmp_path / "olmo"), weight=0.5), SourceConfig(str(tmp_path / "ours"), weight=0.5)], prefetch=0, document_masking=True)
    loader = DataLoader(cfg, seq_len=64, global_batch_size=4, dp_rank=0, dp_world_size=1)
    rows = [r["name"] for r in loader.mixture_report()]
    assert rows == ["olmo", "ours"]
    batch = loader.next_batch()
    assert batch["input_ids"].shape == (4, 64) and int(batch["doc_lens"].sum()) == 4 * 64
    loader.close()


@pytest.mark.parametrize("case, pattern", [
    ("out_of_range", r"bad\.npy: token 60000 at offset 5 \(byte 10\) is not below the tokenizer's vocabulary size 50,280"),
    ("odd_size", r"bad\.npy: size [\d,]+ bytes is not a positive multiple of uint16's 2 bytes"),
    ("no_final_eos", r"bad\.npy: the last token is 11, not EOS 50279"),
    ("uint32_as_uint16", r"bad\.npy: every second uint16 id is 0, the pattern of uint32 ids read as uint16; pass --dtype uint32"),
    ("uint16_as_uint32", r"bad\.npy: token \d+ at offset 0 \(byte 0\) is not below .* \(another tokenizer, or not uint32 ids\)"),
    ("npy_header", r"bad\.npy: has a NumPy header"),
    ("bad_index", r"bad\.csv\.gz:2: document 7\.\.9 does not follow the previous one \(ending at 5\)"),
])
def test_the_scan_refuses_bad_files_naming_file_and_offset(tmp_path, case, pattern):
    docs = encoded(NEOX, c4_texts()[:5])
    good = write_olmo_npy(tmp_path / "in" / "good.npy", docs, np.uint16)
    bad = tmp_path / "in" / "bad.npy"
    dtype = None
    if case == "out_of_range":
        ids = good.copy()
        ids[5] = 60000
        ids.tofile(bad)
    elif case == "odd_size":
        bad.write_bytes(good.tobytes() + b"\x01")
    elif case == "no_final_eos":
        np.append(good, np.uint16(11)).tofile(bad)
    elif case == "uint32_as_uint16":
        good.astype("<u4").tofile(bad)
    elif case == "uint16_as_uint32":
        good.tofile(bad)
        (tmp_path / "in" / "good.npy").unlink()
        dtype = "uint32"
    elif case == "npy_header":
        np.save(bad, good)
    elif case == "bad_index":
        good.tofile(bad)
        with gzip.open(tmp_path / "in" / "bad.csv.gz", "wt") as f:
            f.write("0,5\n7,9\n")
    with pytest.raises(TokenFileError, match=pattern):
        register_token_files([str(tmp_path / "in")], tmp_path / "src", load_tokenizer(NEOX), dtype=dtype, workers=2)
    assert not (tmp_path / "src").exists()


def test_script(tmp_path):
    write_olmo_npy(tmp_path / "mix" / "x.npy", encoded(DOLMA2, c4_texts()), np.uint32)
    cmd = [sys.executable, "scripts/register_token_files.py", "--input", str(tmp_path / "mix" / "*.npy"), "--tokenizer", str(DOLMA2), "--output", str(tmp_path / "src")]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0 and "1 token files in place, 30 documents" in proc.stdout, proc.stderr
    proc = subprocess.run(cmd[:-1] + [str(tmp_path / "src")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "not empty" in proc.stderr
    assert shards.Manifest.load(tmp_path / "src").extra["source"]["in_place"] is True


@pytest.mark.parametrize("tokenizer, dtype", [(DOLMA2, np.uint32), (NEOX, np.uint16)])
def test_released_documents_with_an_inner_eos_are_registered_and_validated_alike(tmp_path, tokenizer, dtype):
    """Dolma's tokenizer turns a quoted "<|endoftext|>" into the EOS id and its `.csv.gz` keeps the
    document whole. Registration accepted it and validation then failed with advice for prepared
    data ("prepare again without --match-special-tokens"): now both report the same documents, and
    validation passes, saying what readers that split at EOS see."""
    texts = c4_texts()[:8]
    texts[2] = "A page that quotes <|endoftext|> in its text. " + texts[2]
    texts[5] = texts[5] + " and twice: <|endoftext|><|endoftext|> end."
    docs = encoded(tokenizer, texts)  # HF's default: special-token text becomes the special token
    eos = docs[0][-1]
    assert docs[2][:-1].count(eos) == 1 and docs[5][:-1].count(eos) == 2
    write_olmo_npy(tmp_path / "mix" / "part-0-00000.npy", docs, dtype, index=True)
    proc = subprocess.run([sys.executable, "scripts/register_token_files.py", "--input", str(tmp_path / "mix"), "--tokenizer", str(tokenizer),
                           "--output", str(tmp_path / "src")], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "note: 2 documents in 1 files hold EOS inside" in proc.stdout and "(documents 2, 5)" in proc.stdout, proc.stdout
    recorded = json.loads(shards.meta_path(tmp_path / "src", 0).read_text())["in_place"]
    assert (recorded["docs_with_inner_eos"], recorded["inner_eos"], recorded["inner_eos_docs"]) == (2, 3, [2, 5])
    report = validate_directory(tmp_path / "src", load_tokenizer(tokenizer))
    assert report.ok, report.shards[0].errors
    s = report.shards[0]
    assert (s.docs_with_inner_eos, s.inner_eos, s.inner_eos_docs) == (2, 3, [2, 5])
    proc = subprocess.run([sys.executable, "scripts/validate_shards.py", str(tmp_path / "src"), "--tokenizer", str(tokenizer)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
    assert "2 documents hold EOS inside (documents 2, 5): olmo-ds reads the 8 documents of the offsets; a reader that splits at EOS" in proc.stdout
    assert "sees 11" in proc.stdout and "released token files" in proc.stdout and "--match-special-tokens" not in proc.stdout
