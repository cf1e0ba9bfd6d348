import gzip
import re
import shutil
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tokenizers

from olmo_ds.data import shards
from olmo_ds.data.prepare import pipeline as prepare_mod
from olmo_ds.data.prepare.pipeline import PrepareConfig, PrepareError, pool_layout, prepare, work_unit
from olmo_ds.data.prepare.worker import val_hash
from testdata import SHARED

REPO = Path(__file__).resolve().parents[2]
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


@pytest.mark.parametrize("cores", [2, 64])
def test_byte_identical_for_any_worker_count(tmp_path, monkeypatch, cores):
    """On 2 cores, 2 and 3 workers include the main process; with cores to spare, N worker processes
    tokenize and the main process only writes (`pool_layout`). Same bytes either way."""
    monkeypatch.setattr(prepare_mod, "usable_cores", lambda: cores)
    results = [run([C4_DIR], tmp_path / f"w{w}", DOLMA2, workers=w, shard_tokens=3000) for w in (1, 2, 3)]
    outputs = [dir_bytes(r.output) for r in results]
    assert outputs[0] == outputs[1] == outputs[2]
    assert sum(name.endswith(".bin") for name in outputs[0]) > 2
    assert [r.layout for r in results] == ["this process"] + (
        ["2 worker processes", "3 worker processes"] if cores == 64 else
        ["1 worker process and this one, whenever it would wait", "2 worker processes and this one, whenever it would wait"])


def test_pool_layout_keeps_a_core_for_the_main_process_when_there_is_one():
    assert pool_layout(1, cores=16) == (0, True)
    assert pool_layout(2, cores=16) == (2, False)
    assert pool_layout(15, cores=16) == (15, False)
    assert pool_layout(16, cores=16) == (15, True)
    assert pool_layout(2, cores=2) == (1, True)
    assert pool_layout(4, cores=2) == (3, True)


def write_many_files(raw: Path) -> list[str]:
    """The c4 documents over 14 files of every kind (JSON lines plain, gzip and zstd, .txt, Parquet, an
    empty file), with bad records and special-token text; returns the good texts in input order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    raw.mkdir(parents=True, exist_ok=True)
    texts = c4_texts()
    texts[5] = "quoting <|endoftext|> on a web page " + texts[5]
    lines = lambda ts: "".join(json.dumps({"text": t}) + "\n" for t in ts).encode()  # noqa: E731
    good = []
    for i in range(10):
        chunk = texts[(3 * i) % 30 : (3 * i) % 30 + 3 + i % 4]
        good += chunk
        data = lines(chunk)
        if i == 2:
            data = data + b'{"text": 42}\n{"id": 1}\n' + lines(texts[:1])
            good += texts[:1]
        name = f"f{i:02d}"
        if i % 3 == 0:
            (raw / f"{name}.jsonl.gz").write_bytes(gzip.compress(data))
        elif i % 3 == 1:
            (raw / f"{name}.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
        else:
            (raw / f"{name}.jsonl").write_bytes(data)
    (raw / "f10.jsonl").write_bytes(b"")
    (raw / "f11.txt").write_text(texts[29])
    pq.write_table(pa.table({"text": texts[10:20]}), raw / "f12.parquet", row_group_size=3)
    (raw / "f13.txt").write_text(" ")
    return good + [texts[29]] + texts[10:20]


def test_whole_files_give_the_bytes_of_one_worker(tmp_path):
    """--work-unit files (workers tokenize whole files into pieces, shards cut from them) writes
    exactly what one worker writes: every file of the output directory compared byte for byte (each
    shard's .bin, .offsets.npy and .json with its resume point, manifest.json with skip and note
    counts and examples, val/ and its manifest, .prepare.json), and nothing else is left behind."""
    raw = tmp_path / "raw"
    good = write_many_files(raw)
    for val_fraction, runs in ((0.3, ((1, "files"), (3, "files"), (2, "auto"))), (0.0, ((3, "files"),))):
        kw = dict(shard_tokens=2500, val_fraction=val_fraction)
        ref = run([raw], tmp_path / f"ref{val_fraction}", DOLMA2, **kw)
        assert ref.layout == "this process"
        expected = dir_bytes(ref.output)
        assert sum(k.endswith(".bin") for k in expected) > 6 and ref.skipped.counts and ref.noted.counts
        for workers, unit in runs:
            result = run([raw], tmp_path / f"w{workers}{unit}{val_fraction}", DOLMA2, workers=workers, work_unit=unit, **kw)
            assert result.layout.startswith(f"{workers} worker process") and "whole files" in result.layout
            assert dir_bytes(result.output) == expected, (workers, unit, val_fraction)
            assert sorted(p.name for p in result.output.iterdir()) == sorted({k.split("/")[0] for k in expected})
    hf = tokenizers.Tokenizer.from_file(str(DOLMA2))
    hf.encode_special_tokens = True  # special-token text is text, as prepare encodes it by default
    eos = hf.token_to_id("<|endoftext|>")
    docs = [hf.encode(t, add_special_tokens=False).ids + [eos] for t in good]
    ids, lens = read_all(tmp_path / "ref0.0")
    assert ids.tolist() == [i for d in docs for i in d] and lens == [len(d) for d in docs]
    dry = prepare(PrepareConfig(inputs=[str(raw)], output=tmp_path / "dry", tokenizer=str(DOLMA2), dry_run=True, progress=False, workers=2, work_unit="files"), log=lambda _: None)
    assert not (tmp_path / "dry").exists() and (dry.num_docs, [f.docs for f in dry.files]) == (len(good), [f.docs for f in ref.files])


@pytest.mark.parametrize("masked", [False, True])
def test_a_shards_parts_written_in_any_order_give_the_streamed_shard(tmp_path, masked, monkeypatch):
    """Whole-file mode writes a shard's parts at their places on whichever workers are free, in any order
    (`pieces.write_part`), and reads the shard back in order as its prefix grows (`pieces.Assembly`): the closed
    shard, its metadata (sha256, largest id, mask) and its check record are those of one writer streaming the
    documents (`ShardWriter`) and a whole read. A part whose bytes read back are not those written stops the run."""
    from olmo_ds.data.prepare.pieces import Assembly, PieceSplit, mask_piece, write_part
    from olmo_ds.data.validate import ShardRules

    rng = np.random.default_rng(1)
    pieces, stream = [], []
    for k, n_docs in enumerate((5, 7, 1, 3)):
        lens = rng.integers(2, 40, n_docs)
        ids = rng.integers(0, 900, int(lens.sum())).astype(np.uint16)
        ids[np.cumsum(lens) - 1] = 999
        mask = rng.random(len(ids)) < 0.5 if masked else None
        path = tmp_path / f"piece-{k}.bin"
        ids.tofile(path)
        if masked:
            mask.tofile(mask_piece(str(path)))
        pieces.append((str(path), lens))
        stream.append((ids, lens, mask))
    rules = (ShardRules(masked=masked), "")
    ref = tmp_path / "ref"
    ref.mkdir()
    w = shards.ShardWriter(ref, 0, vocab_size=1000, eos_id=999, masked=masked)
    for ids, lens, mask in stream:
        w.append(ids, lens, mask)
    w.close({"prepare": {"next_record": [9, 0]}})
    from olmo_ds.data.validate import check_shard
    check_shard(ref, "shard-00000.bin", *rules)

    out = tmp_path / "out"
    out.mkdir()
    split = PieceSplit(out, 10**6, 1000, 999, 0, 0, masked)
    jobs = [job for path, lens in pieces for job in split.add(path, lens, np.arange(len(lens)), lambda pos: {})]
    jobs += split.finish(99, {})
    jobs[-1].extra = {"prepare": {"next_record": [9, 0]}}
    assembly = Assembly(rules)
    to_write = assembly.made(jobs)
    assert [j.part for j in to_write] == [0, 1, 2, 3]  # the closing part holds no ids: written at once
    for job in (to_write[2], to_write[0], to_write[3], to_write[1]):
        assembly.written(write_part(job))
    assembly.finish()
    assert dir_bytes(out) == dir_bytes(ref)

    # The bytes read back differ from those just written: the write fails, naming the file.
    bad = tmp_path / "bad"
    bad.mkdir()
    split = PieceSplit(bad, 10**6, 1000, 999, 0, 0, masked)
    job = split.add(*pieces[0], np.arange(len(pieces[0][1])), lambda pos: {})[0]
    Assembly(rules).made([job])
    real_preadv = shards.os.preadv

    def preadv(fd, buffers, at):  # the kernel hands back another byte than the one written
        n = real_preadv(fd, buffers, at)
        buffers[0][0] ^= 1
        return n

    monkeypatch.setattr(shards.os, "preadv", preadv)
    with pytest.raises(OSError, match=r"the bytes read back at 0 are not those just written there: .*shard-00000.bin.tmp"):
        write_part(job)
    # A shard whose files are not the size its parts make is not closed.
    monkeypatch.undo()
    write_part(job)
    with pytest.raises(OSError, match=r"bytes once all its parts are written, not .*shard-00000.bin.tmp"):
        job.shard.close(job.tokens + 1, job.docs, "0" * 64, 0, "0" * 64)
    assert not shards.meta_path(bad, 0).exists()


def test_work_unit_auto_takes_whole_files_when_there_are_many():
    assert work_unit("auto", 16, 64) == "files" and work_unit("auto", 16, 63) == "blocks"
    assert work_unit("auto", 2, 8) == "files" and work_unit("auto", 1, 1000) == "blocks"
    assert work_unit("blocks", 16, 1000) == "blocks" and work_unit("files", 1, 1) == "files"


def test_whole_files_resume_after_a_crash_in_either_mode(tmp_path):
    """Shards finish out of order in whole-file mode; a rerun keeps only the complete shards before
    the first gap, drops the pieces, and resumes (mid-file) to the same bytes, in either mode."""
    raw = tmp_path / "raw"
    write_many_files(raw)
    kw = dict(shard_tokens=2500, val_fraction=0.3)
    ref = run([raw], tmp_path / "ref", NEOX, **kw)
    expected = dir_bytes(ref.output)
    n = len(shards.list_shards(ref.output))
    for unit in ("files", "blocks"):
        out = Path(shutil.copytree(ref.output, tmp_path / unit))
        (out / "manifest.json").unlink()
        for p in out.glob(f"shard-{n // 2:05d}.*"):  # a gap: later shards complete, this one not
            p.unlink()
        (out / f"shard-{n // 2:05d}.bin.tmp").write_bytes(b"\1" * 10)
        (out / ".prepare-pieces").mkdir()
        (out / ".prepare-pieces" / "piece-000003.train.bin").write_bytes(b"\0" * 64)
        result = run([raw], out, NEOX, workers=2, work_unit=unit, **kw)
        assert result.resumed_from is not None and not result.resumed_from.endswith(":1")  # mid-file
        assert result.run_tokens < result.num_tokens + result.val_tokens
        assert dir_bytes(out) == expected, unit


def test_whole_files_strict_stops_at_the_first_bad_record(tmp_path):
    raw = tmp_path / "raw"
    write_many_files(raw)
    with pytest.raises(PrepareError, match=rf"{re.escape(str((raw / 'f02.jsonl').resolve()))}:6: text not a string \(--strict"):
        run([raw], tmp_path / "out", NEOX, strict=True, workers=2, work_unit="files")
    assert not (tmp_path / "out" / ".prepare-pieces").exists()


def test_plain_files_read_by_the_workers_give_the_same_bytes_and_ids(tmp_path):
    """Uncompressed files are cut into byte ranges that each worker reads itself; mixed with a
    compressed file (read by the main process) and .txt documents, any worker count gives the
    documents' exact ids in input order."""
    texts = c4_texts()
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_bytes(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[:12]))
    with gzip.open(raw / "b.jsonl.gz", "wb") as f:
        f.write(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[12:20]))
    (raw / "c.txt").write_text(texts[20])
    (raw / "d.jsonl").write_bytes(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts[21:]).rstrip(b"\n"))
    outputs = [dir_bytes(run([raw], tmp_path / f"w{w}", NEOX, workers=w, shard_tokens=3000).output) for w in (1, 2, 3)]
    assert outputs[0] == outputs[1] == outputs[2]
    ref = tokenizers.Tokenizer.from_file(str(NEOX))
    eos = ref.token_to_id("<|endoftext|>")
    ids, lens = read_all(tmp_path / "w2")
    docs = [ref.encode(t, add_special_tokens=False).ids + [eos] for t in texts]
    assert ids.tolist() == [i for d in docs for i in d] and lens == [len(d) for d in docs]


def test_parquet_row_groups_are_blocks_with_row_numbers_and_resume(tmp_path):
    """A Parquet file's rows are its records (row groups read by the workers, rows numbered from 1);
    the output equals the same records as JSON lines, and a rerun after a crash resumes mid-file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = c4_texts()
    column = texts[:10] + [None, "   "] + texts[10:]  # a null and an empty document at rows 11 and 12
    raw = tmp_path / "raw"
    raw.mkdir()
    pq.write_table(pa.table({"id": list(range(len(column))), "text": column}), raw / "a.parquet", row_group_size=4)
    twin = tmp_path / "twin"
    twin.mkdir()
    (twin / "a.jsonl").write_bytes(b"".join(json.dumps({"text": t}).encode() + b"\n" for t in texts))
    ref = run([twin], tmp_path / "ref", NEOX, shard_tokens=2500)
    for w in (1, 3):
        result = run([raw], tmp_path / f"w{w}", NEOX, shard_tokens=2500, workers=w)
        where = str((raw / "a.parquet").resolve())
        assert result.skipped.examples == {"missing_text_field": [f"{where}:11"], "empty_document": [f"{where}:12"]}
        assert {k: v for k, v in dir_bytes(tmp_path / f"w{w}").items() if k.endswith((".bin", ".npy"))} == \
            {k: v for k, v in dir_bytes(ref.output).items() if k.endswith((".bin", ".npy"))}
    out = Path(shutil.copytree(tmp_path / "w1", tmp_path / "crashed"))
    n = len(shards.list_shards(out))
    (out / "manifest.json").unlink()
    for i in range(n // 2, n):
        for p in out.glob(f"shard-{i:05d}.*"):
            p.unlink()
    result = run([raw], out, NEOX, shard_tokens=2500, workers=2)
    assert result.resumed_from is not None and dir_bytes(out) == dir_bytes(tmp_path / "w1")


def test_parquet_without_a_text_column_is_refused_before_work(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["a"], "n": [1]}), tmp_path / "a.parquet")
    with pytest.raises(PrepareError, match=r"a\.parquet: no column 'text' \(columns: body, n\)"):
        run([tmp_path / "a.parquet"], tmp_path / "out", NEOX)
    with pytest.raises(PrepareError, match=r"a\.parquet: column 'n' holds int64, not strings"):
        run([tmp_path / "a.parquet"], tmp_path / "out", NEOX, text_field="n")
    assert not (tmp_path / "out").exists()


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


def write_corpus_with_bad_records(raw: Path, copies: int = 1) -> list[str]:
    """c4 documents as JSON lines, `copies` times over, with one bad record of every kind per copy;
    returns the good texts in input order."""
    raw.mkdir(parents=True, exist_ok=True)
    texts = c4_texts()
    good = []
    with open(raw / "mixed.jsonl", "wb") as f:
        for c in range(copies):
            for i, t in enumerate(texts):
                f.write(json.dumps({"text": t, "copy": c}).encode() + b"\n")
                good.append(t)
                if i == 3:
                    f.write(b'{"text": "unterminated\n')
                    f.write(b'{"id": 1}\n')
                    f.write(b'{"text": 42}\n')
                    f.write(b'{"text": "bad \xff byte"}\n')
                    f.write(b'{"text": "lone \\ud800 surrogate"}\n')
                    f.write(b'{"text": "  \\n "}\n')
                    f.write(b"\n")  # a blank line is not a record
    return good


def test_every_bad_record_kind_is_skipped_counted_and_located(tmp_path):
    raw = tmp_path / "raw"
    good = write_corpus_with_bad_records(raw)
    (raw / "empty.txt").write_text("")
    (raw / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    result = run([raw], tmp_path / "out", NEOX, workers=2)
    mixed, empty, latin1 = (str((raw / n).resolve()) for n in ("mixed.jsonl", "empty.txt", "latin1.txt"))
    assert result.skipped.counts == {"malformed_json": 1, "missing_text_field": 1, "text_not_a_string": 1, "invalid_utf8": 3, "empty_document": 2}
    assert result.skipped.examples == {
        "malformed_json": [f"{mixed}:5"], "missing_text_field": [f"{mixed}:6"], "text_not_a_string": [f"{mixed}:7"],
        "invalid_utf8": [f"{latin1}:1", f"{mixed}:8", f"{mixed}:9"], "empty_document": [f"{empty}:1", f"{mixed}:10"],
    }
    manifest = shards.Manifest.load(tmp_path / "out")
    assert manifest.extra["skipped"] == result.skipped.to_dict() and manifest.num_docs == len(good)
    ref = tokenizers.Tokenizer.from_file(str(NEOX))
    assert read_all(tmp_path / "out")[0].tolist() == [i for t in good for i in ref.encode(t, add_special_tokens=False).ids + [50279]]
    with pytest.raises(PrepareError, match=rf"{empty}:1: empty document \(--strict"):
        run([raw], tmp_path / "strict", NEOX, strict=True)
    with pytest.raises(PrepareError, match=rf"{mixed}:5: malformed json"):
        run([raw / "mixed.jsonl"], tmp_path / "strict2", NEOX, strict=True)


def test_dry_run_writes_nothing_and_verbose_reports_files(tmp_path):
    lines = []
    result = prepare(PrepareConfig(inputs=[str(C4_DIR)], output=tmp_path / "out", tokenizer=str(DOLMA2), dry_run=True, verbose=True, progress=False), log=lines.append)
    assert not (tmp_path / "out").exists()
    assert [f.docs for f in result.files] == [10, 10, 10] and result.num_docs == 30
    assert sum(f.tokens for f in result.files) == result.num_tokens == sum(len(ids) + 1 for ids in load_ids(DOLMA2))
    assert len(lines) == 3 and lines[0].endswith("c4-sample.01.json.gz: 10 docs, " + f"{result.files[0].tokens:,} tokens, 0 skipped")


def load_ids(tokenizer):
    ref = tokenizers.Tokenizer.from_file(str(tokenizer))
    return [ref.encode(t, add_special_tokens=False).ids for t in c4_texts()]


def test_clear_errors_before_any_work(tmp_path):
    (tmp_path / "emptydir").mkdir()
    (tmp_path / "data.csv").write_text("a,b")
    cases = [
        ([tmp_path / "nope.jsonl"], NEOX, "nope.jsonl: no such file or directory"),
        ([tmp_path / "emptydir"], NEOX, "emptydir: directory holds no supported input files"),
        ([tmp_path / "data.csv"], NEOX, "data.csv: unsupported input type"),
        ([tmp_path / "*.jsonl"], NEOX, r"\*.jsonl: glob matches no supported input files"),
        ([C4_DIR], tmp_path / "tok.json", "tokenizer file not found"),
    ]
    for inputs, tok, message in cases:
        with pytest.raises(PrepareError, match=message):
            run(inputs, tmp_path / "out", tok)
    assert not (tmp_path / "out").exists()
    with pytest.raises(PrepareError, match="--val-fraction must be in"):
        run([C4_DIR], tmp_path / "out", NEOX, val_fraction=1.0)


def test_output_of_another_tokenizer_or_settings_is_refused(tmp_path):
    out = tmp_path / "out"
    run([C4_DIR], out, NEOX, shard_tokens=3000)
    before = dir_bytes(out)
    with pytest.raises(PrepareError, match="holds shards of another tokenizer.*--overwrite"):
        run([C4_DIR], out, DOLMA2, shard_tokens=3000)
    with pytest.raises(PrepareError, match=r"other settings \(shard_tokens differ\)"):
        run([C4_DIR], out, NEOX, shard_tokens=5000)
    (out / ".prepare.json").unlink()  # shards without the state of the run that made them
    with pytest.raises(PrepareError, match="holds shards of another tokenizer"):
        run([C4_DIR], out, DOLMA2)
    assert dir_bytes(out) == {k: v for k, v in before.items() if k != ".prepare.json"}
    run([C4_DIR], out, DOLMA2, overwrite=True)
    assert shards.Manifest.load(out).vocab_size == 100278 and not shards.bin_path(out, 3).exists()
    assert run([C4_DIR], out, DOLMA2).already_complete


@pytest.mark.parametrize("val_fraction", [0.0, 0.25])
def test_rerun_after_a_crash_at_any_point_is_byte_identical(tmp_path, val_fraction):
    raw = tmp_path / "raw"
    write_corpus_with_bad_records(raw, copies=2)
    ref = tmp_path / "ref"
    run([raw], ref, NEOX, shard_tokens=2500, val_fraction=val_fraction)
    expected = dir_bytes(ref)
    n = len(shards.list_shards(ref))
    assert n >= 6

    def crashed(name: str, damage) -> Path:
        out = Path(shutil.copytree(ref, tmp_path / name))
        (out / "manifest.json").unlink()
        damage(out)
        return out

    states = {
        "before_manifest": lambda out: None,
        "before_last_meta": lambda out: shards.meta_path(out, n - 1).unlink(),
        "mid_shard": lambda out: [
            [p.unlink() for p in out.glob(f"shard-{i:05d}.*")] for i in range(n // 2, n)
        ] + [(out / f"shard-{n // 2:05d}.bin.tmp").write_bytes(b"\x01\x02" * 100), (out / f"shard-{n // 2:05d}.offsets.raw.tmp").write_bytes(b"\0" * 16)],
        "offsets_renamed_meta_not": lambda out: [shards.meta_path(out, 2).unlink()] + [p.unlink() for i in range(3, n) for p in out.glob(f"shard-{i:05d}.*")],
        "nothing_complete": lambda out: [p.unlink() for p in out.glob("shard-*")] + [shutil.rmtree(out / "val", ignore_errors=True)],
    }
    for name, damage in states.items():
        out = crashed(name, damage)
        result = run([raw], out, NEOX, shard_tokens=2500, val_fraction=val_fraction, workers=2 if name == "mid_shard" else 1)
        assert dir_bytes(out) == expected, name
        if name in ("mid_shard", "offsets_renamed_meta_not"):
            assert result.resumed_from is not None and result.run_tokens < result.num_tokens + result.val_tokens


@pytest.mark.parametrize("val_fraction", ["0", "0.01"])
def test_rerun_after_sigkill_is_byte_identical(tmp_path, val_fraction):
    """With a validation split too: its shards are few (often none complete when the run is
    killed), and a rerun once started over from the first document, saying nothing."""
    import signal
    import time

    raw = tmp_path / "raw"
    write_corpus_with_bad_records(raw, copies=25)
    # The HF backend is the slower one: the run must still be going when it is killed.
    args = ["--input", str(raw), "--tokenizer", str(NEOX), "--shard-tokens", "2000", "--workers", "2", "--no-progress", "--tokenizer-backend", "hf",
            "--val-fraction", val_fraction]
    ref = tmp_path / "ref"
    subprocess.run([sys.executable, "scripts/prepare_data.py", *args, "--output", str(ref)], cwd=REPO, check=True, capture_output=True)
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "scripts/prepare_data.py", *args, "--output", str(out)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(out.glob("shard-*.json"))) < 5 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", *args, "--output", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "resumed from" in proc.stdout and "resuming" in proc.stdout
    assert dir_bytes(out) == dir_bytes(ref)


@pytest.mark.parametrize("unit, workers", [("blocks", 1), ("blocks", 3), ("files", 2)])
def test_a_resume_with_a_validation_split_tokenizes_only_what_is_not_kept(tmp_path, unit, workers):
    """Documents already in complete train shards are not tokenized again: between the validation
    split's resume point (often the first document: a 1 % split rarely completes a shard before a
    kill) and the train split's, only validation documents are."""
    raw = tmp_path / "raw"
    write_corpus_with_bad_records(raw, copies=4)
    # Files before the one where the train split resumes (many blocks each), and a compressed one after.
    shutil.copy(raw / "mixed.jsonl", raw / "a-first.jsonl")
    (raw / "z-last.jsonl.gz").write_bytes(gzip.compress((raw / "mixed.jsonl").read_bytes()))
    kw = dict(shard_tokens=2500, val_fraction=0.02, work_unit=unit, workers=workers)
    ref = tmp_path / "ref"
    full = run([raw], ref, NEOX, **kw)
    # Killed once the train split had moved on into the second file: its shards up to there are
    # complete, and of the validation split's only those that closed before (often none).
    meta = lambda d, i: json.loads(shards.meta_path(d, i).read_text())["prepare"]["next_record"]
    n_train, n_val = len(shards.list_shards(ref)), len(shards.list_shards(ref / "val"))
    kept = next(k for k in range(1, n_train) if meta(ref, k - 1)[0] >= 1)
    val_kept = sum(meta(ref / "val", i) <= meta(ref, kept - 1) for i in range(n_val))
    assert kept < n_train - 2 and val_kept < n_val
    out = Path(shutil.copytree(ref, tmp_path / "out"))
    (out / "manifest.json").unlink()
    (out / "val" / "manifest.json").unlink()
    for d, k in ((out, kept), (out / "val", val_kept)):
        for p in d.glob("shard-*"):
            if int(p.name[6:11]) >= k:
                p.unlink()
    kept_tokens = sum(shards.ShardMeta.load(shards.meta_path(out, i)).num_tokens for i in range(kept))
    kept_val = sum(shards.ShardMeta.load(shards.meta_path(out / "val", i)).num_tokens for i in range(val_kept))
    lines = []
    result = prepare(PrepareConfig(inputs=[str(raw)], output=out, tokenizer=str(NEOX), chunk_bytes=2048, progress=False, **kw), log=lines.append)
    assert dir_bytes(out) == dir_bytes(ref)
    assert result.run_tokens == full.num_tokens - kept_tokens + full.val_tokens - kept_val  # the kept shards' documents were not tokenized
    assert result.resumed_from is not None and any(line.startswith(f"resuming {out}") and f"{kept} train, {val_kept} val" in line for line in lines), lines


def test_backends_write_identical_shards(tmp_path):
    outs = {}
    for backend in ("hf", "fast"):
        result = run([C4_DIR], tmp_path / backend, DOLMA2, tokenizer_backend=backend, shard_tokens=3000, val_fraction=0.2)
        assert result.backend == {"hf": "tokenizers", "fast": "fastokens"}[backend]
        assert shards.Manifest.load(tmp_path / backend).extra["tokenizer_backend"]["name"] == result.backend
        outs[backend] = {k: v for k, v in dir_bytes(tmp_path / backend).items() if not k.endswith("manifest.json")}
    assert outs["hf"] == outs["fast"] and len(outs["hf"]) > 6


def neox_variant(tmp_path, normalizer: dict) -> Path:
    d = json.loads(NEOX.read_text())
    d["normalizer"] = normalizer
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(d))
    return path


def test_fast_backend_falls_back_to_hf_with_a_warning(tmp_path):
    tok = neox_variant(tmp_path, {"type": "NFKC"})  # a normalizer fastokens does not implement
    messages = []
    result = prepare(PrepareConfig(inputs=[str(C4_DIR)], output=tmp_path / "out", tokenizer=str(tok), progress=False), log=messages.append)
    assert result.backend == "tokenizers"
    assert any(m.startswith("warning: fastokens does not match HF tokenizers") and "NFKC" in m for m in messages)
    recorded = shards.Manifest.load(tmp_path / "out").extra["tokenizer_backend"]
    assert recorded["requested"] == "auto" and "fastokens cannot load it" in recorded["fallback_reason"]
    ref = tokenizers.Tokenizer.from_file(str(tok))
    assert read_all(tmp_path / "out")[0].tolist() == [i for t in c4_texts() for i in ref.encode(t, add_special_tokens=False).ids + [50279]]
    with pytest.raises(PrepareError, match="--tokenizer-backend fast: fastokens does not match HF tokenizers: .*NFKC"):
        run([C4_DIR], tmp_path / "fast", tok, tokenizer_backend="fast")
    assert not (tmp_path / "fast").exists()


@pytest.mark.parametrize("workers, unit", [(1, "blocks"), (3, "blocks"), (3, "files")])
def test_a_fast_backend_that_differs_on_the_input_falls_back_to_hf(tmp_path, monkeypatch, workers, unit):
    """fastokens loads but would encode two of the sampled documents otherwise than HF. The check
    (run by the workers) names the first of them, as one process would, and the run falls back to
    HF with workers started anew: the shards are HF's. --tokenizer-backend fast stops instead."""
    from olmo_ds.tokenizer import FastHFTokenizer

    raw = tmp_path / "raw"
    write_many_files(raw)
    first = json.loads(gzip.decompress((raw / "f00.jsonl.gz").read_bytes()).splitlines()[1])["text"]
    wrong = {first, (raw / "f11.txt").read_text()}  # in the first and in a late sampled file
    encode = FastHFTokenizer.encode_batch_flat

    def differs(self, texts):
        ids, offsets = encode(self, texts)
        ids = ids.copy()
        for i, t in enumerate(texts):
            if t in wrong:
                ids[offsets[i]] += 1
        return ids, offsets

    monkeypatch.setattr(FastHFTokenizer, "encode_batch_flat", differs)
    messages = []
    kw = dict(shard_tokens=2500, workers=workers, work_unit=unit)
    result = prepare(PrepareConfig(inputs=[str(raw)], output=tmp_path / "out", tokenizer=str(DOLMA2), progress=False, **kw), log=messages.append)
    where = f"{(raw / 'f00.jsonl.gz').resolve()}:2: ids differ from token 0"
    assert result.backend == "tokenizers" and [m for m in messages if m.startswith("warning: ")] == [
        m for m in messages if m.startswith(f"warning: fastokens does not match HF tokenizers ({where}")]
    assert shards.Manifest.load(tmp_path / "out").extra["tokenizer_backend"]["fallback_reason"].startswith(where)
    hf = run([raw], tmp_path / "hf", DOLMA2, tokenizer_backend="hf", **kw)
    assert {k: v for k, v in dir_bytes(result.output).items() if k != "manifest.json"} == {
        k: v for k, v in dir_bytes(hf.output).items() if k != "manifest.json"}
    with pytest.raises(PrepareError, match=f"--tokenizer-backend fast: fastokens does not match HF tokenizers: {re.escape(where)}"):
        run([raw], tmp_path / "fast", DOLMA2, tokenizer_backend="fast", **kw)
    assert not (tmp_path / "fast").exists()


@pytest.mark.parametrize("unit", ["blocks", "files"])
def test_a_truncated_compressed_input_stops_the_run_naming_it_and_keeps_complete_shards(tmp_path, unit):
    """Whole files: the shards the workers were writing leave no trace either, nor do the pieces."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    raw.mkdir()
    texts = c4_texts()
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    blob = gzip.compress("".join(json.dumps({"text": t}) + "\n" for t in texts * 20).encode())
    (raw / "b.jsonl.gz").write_bytes(blob[: len(blob) * 3 // 4])
    cmd = [sys.executable, "scripts/prepare_data.py", "--input", str(raw), "--output", str(out), "--tokenizer", str(NEOX), "--shard-tokens", "3000",
           "--work-unit", unit, "--workers", "1" if unit == "blocks" else "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "b.jsonl.gz: cannot decompress past line" in proc.stderr and "Complete shards" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    bins = sorted(out.glob("shard-*.bin"))
    assert not list(out.glob("*.tmp*")) and not (out / ".prepare-pieces").exists()  # the partial shards are gone
    assert len(bins) > 3 or unit == "files"  # whole files: how many of a.jsonl's shards were written before b.jsonl.gz failed varies
    for b in bins:
        meta = shards.ShardMeta.load(b.with_suffix(".json"))
        assert b.stat().st_size == meta.num_tokens * 2


def write_corpus_quoting_special_tokens(raw: Path) -> list[str]:
    """c4 documents as JSON lines, two of them quoting special tokens the way web pages do."""
    raw.mkdir(parents=True, exist_ok=True)
    texts = c4_texts()
    texts[3] = texts[3][:200] + " The GPT-2 separator <|endoftext|> ends a document. " + texts[3][200:]
    texts[7] = "padding <|pad|> and <|padding|> and <|endoftext|><|endoftext|> " + texts[7]
    (raw / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return texts


@pytest.mark.parametrize("tokenizer", [DOLMA2, NEOX])
def test_special_token_text_inside_documents_is_encoded_as_text_by_default(tmp_path, tokenizer):
    raw = tmp_path / "raw"
    texts = write_corpus_quoting_special_tokens(raw)
    ref = tokenizers.Tokenizer.from_file(str(tokenizer))
    eos = ref.token_to_id("<|endoftext|>")
    matched = [ref.encode(t, add_special_tokens=False).ids for t in texts]
    ref.encode_special_tokens = True  # HF's own switch for "special-token text is text"
    as_text = [ref.encode(t, add_special_tokens=False).ids for t in texts]
    assert [i for i, (a, b) in enumerate(zip(matched, as_text)) if a != b] == [3, 7]  # other text: HF's ids either way
    where = str((raw / "a.jsonl").resolve())
    outputs = {}
    for backend in ("hf", "fast"):
        result = run([raw], tmp_path / backend, tokenizer, tokenizer_backend=backend, shard_tokens=3000, workers=2)
        ids, lens = read_all(tmp_path / backend)
        assert ids.tolist() == [i for d in as_text for i in d + [eos]] and lens == [len(d) + 1 for d in as_text]
        assert int(np.count_nonzero(ids == eos)) == len(texts)  # EOS only ends documents
        assert result.noted.counts == {"special_token_text": 2}
        assert result.noted.examples == {"special_token_text": [f"{where}:4", f"{where}:8"]}
        manifest = shards.Manifest.load(tmp_path / backend)
        assert manifest.extra["noted"] == result.noted.to_dict() and manifest.extra["arguments"]["match_special_tokens"] is False
        outputs[backend] = {k: v for k, v in dir_bytes(tmp_path / backend).items() if k != "manifest.json"}
    assert outputs["hf"] == outputs["fast"]

    result = run([raw], tmp_path / "matched", tokenizer, match_special_tokens=True, shard_tokens=3000)
    ids, lens = read_all(tmp_path / "matched")
    assert ids.tolist() == [i for d in matched for i in d + [eos]]
    assert int(np.count_nonzero(ids == eos)) > len(texts) and result.noted.counts == {"special_token_text": 2}
    # A directory started one way is not continued the other way.
    with pytest.raises(PrepareError, match=r"other settings \(special_tokens differ\)"):
        run([raw], tmp_path / "matched", tokenizer, shard_tokens=3000)


def test_a_directory_started_before_the_option_resumes_with_match_special_tokens(tmp_path):
    """Older runs matched special tokens and recorded no setting for it: with --match-special-tokens
    their state still matches, so a half-written directory resumes."""
    out = tmp_path / "out"
    run([C4_DIR], out, NEOX, match_special_tokens=True, shard_tokens=3000)
    state = json.loads((out / ".prepare.json").read_text())
    assert "special_tokens" not in state
    (out / "manifest.json").unlink()
    for p in out.glob("shard-0000[3-9].*"):
        p.unlink()
    result = run([C4_DIR], out, NEOX, match_special_tokens=True, shard_tokens=3000)
    assert result.resumed_from is not None


def test_progress_lines_when_stderr_is_not_a_terminal(tmp_path, capsys):
    """A Slurm job's log gets plain lines (share done, tokens/s, ETA, which part) instead of a bar."""
    raw = tmp_path / "raw"
    write_corpus_with_bad_records(raw, copies=3)
    (raw / "second.jsonl").write_bytes((raw / "mixed.jsonl").read_bytes())
    run([raw], tmp_path / "out", NEOX, progress=None, progress_every=0, partition=(1, 2))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) > 3 and all(line.startswith("prepare part 1/2: ") for line in lines)
    assert all(re.search(r"% of [\d.]+ GB, [\d,]+ tokens in \d+:\d\d:\d\d, [\d.]+M tokens/s, [\d.]+ MB/s of text, ETA ", line) for line in lines)
    assert lines[-1].startswith("prepare part 1/2: 100.0% ") and lines[-1].endswith("ETA done")
    assert re.search(r"ETA \d+:\d\d:\d\d$", lines[0])
    run([raw], tmp_path / "quiet", NEOX, progress=False, progress_every=0)
    assert capsys.readouterr().err == ""


def test_inputs_without_documents_are_an_error_and_leave_no_source(tmp_path):
    """Empty files (and files of blank documents) used to "succeed" with 0 tokens and a manifest
    that validated; a source of nothing fails only when training reads it."""
    raw = tmp_path / "raw"
    raw.mkdir()
    (raw / "a.jsonl").write_bytes(b"")
    (raw / "b.jsonl").write_bytes(b"")
    with pytest.raises(PrepareError, match=r"every input file is empty \(0 bytes\): .*a\.jsonl, .*b\.jsonl"):
        run([raw], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (raw / "c.jsonl").write_text(json.dumps({"text": "   "}) + "\n\n" + json.dumps({"body": "x"}) + "\n")
    (raw / "d.jsonl.gz").write_bytes(gzip.compress(b""))
    for unit, workers in (("blocks", 1), ("files", 2)):
        out = tmp_path / f"out-{unit}"
        with pytest.raises(PrepareError) as e:
            run([raw], out, work_unit=unit, workers=workers)
        message = str(e.value)
        assert "no documents in the input (4 files)" in message and "a.jsonl (empty, 0 bytes)" in message
        assert "c.jsonl (2 records skipped)" in message and "d.jsonl.gz (no records)" in message
        assert "empty_document 1" in message and "missing_text_field 1" in message and "--text-field is 'text'" in message
        assert not out.exists()
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", "--input", str(raw), "--output", str(tmp_path / "out"), "--tokenizer", str(NEOX)],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "no documents in the input" in proc.stderr and "Traceback" not in proc.stderr


def test_the_summary_time_covers_the_whole_run(tmp_path):
    """The summary's time once counted the tokenizing loop only, leaving out the backend check
    (26 s of a "0.552 s" run): now its total is the whole run, with the check shown apart."""
    import time

    from olmo_ds.data.prepare.report import format_summary

    t0 = time.perf_counter()
    result = run([C4_DIR], tmp_path / "out", DOLMA2, tokenizer_backend="auto")
    wall = time.perf_counter() - t0
    text = format_summary(result)
    total = float(re.search(r"^time\s+([\d.,]+) s in all$", text, re.M).group(1).replace(",", ""))
    check = float(re.search(r"^  backend check\s+([\d.,]+) s", text, re.M).group(1).replace(",", ""))
    loop = float(re.search(r"^  tokenizing\s+([\d.,]+) s", text, re.M).group(1).replace(",", ""))
    rest = float(re.search(r"^  the rest\s+([\d.,]+) s", text, re.M).group(1).replace(",", ""))
    assert 0.95 * wall - 0.005 <= total <= wall + 0.001, (total, wall)
    assert check > 0 and loop > 0 and abs(check + loop + rest - total) < 0.005
    # The rest, step by step in run order (what bench_prepare.py reads back to show start-up on many cores).
    steps = re.findall(r"^    (\S.*?)\s+([\d.,]+) s$", text, re.M)
    assert [name for name, _ in steps] == ["inputs", "tokenizer", "output", "fast backend", "workers", "resume", "manifests", "stop workers", "validate"]
    assert list(result.phases) == ["inputs", "tokenizer", "output", "fast backend", "workers", "backend", "resume", "tokenizing", "manifests", "stop workers",
                                   "validate"]
    assert abs(sum(float(v) for _, v in steps) - rest) < 0.01 and result.phases["tokenizing"] >= loop - 0.001
    # Without a check (HF asked for), choosing the backend is a step under the rest like the others.
    text = format_summary(run([C4_DIR], tmp_path / "hf", DOLMA2, tokenizer_backend="hf"))
    rest = float(re.search(r"^  the rest\s+([\d.,]+) s", text, re.M).group(1).replace(",", ""))
    steps = re.findall(r"^    (\S.*?)\s+([\d.,]+) s$", text, re.M)
    assert "backend check" not in text and [name for name, _ in steps] == ["inputs", "tokenizer", "output", "fast backend", "workers", "backend", "resume",
                                                                             "manifests", "stop workers", "validate"]
    assert abs(sum(float(v) for _, v in steps) - rest) < 0.01


def test_workers_are_forked_after_fastokens_parsed_in_a_thread():
    """fastokens parses the tokenizer in a thread while HF loads it (`backend.early_parse`); that
    thread has ended when the workers start, so they are still forked (and inherit both encoders),
    even in the moment the system lists an ended thread. A thread still running means spawn."""
    import threading

    from olmo_ds.data.prepare.backend import early_parse, fast_candidate
    from olmo_ds.tokenizer import load_tokenizer

    before = prepare_mod._thread_count()
    parse = early_parse("auto", DOLMA2)
    hf = load_tokenizer(DOLMA2)
    fast, why = fast_candidate("auto", hf, parse)
    assert why is None and fast.backend == "fastokens" and fast.encode("Hello world") == hf.encode("Hello world")
    assert parse.thread_id is not None and prepare_mod._start_method(before, parse.thread_id) == "fork"
    assert early_parse("hf", DOLMA2) is None
    stop = threading.Event()
    running = threading.Thread(target=stop.wait)
    running.start()
    try:
        assert prepare_mod._start_method(before, parse.thread_id) == "spawn"
    finally:
        stop.set()
        running.join()


def test_prepare_data_starts_the_parse_before_its_imports_and_prepare_takes_it(tmp_path, monkeypatch):
    """`prepare_data.py` imports only the standard library before it knows the tokenizer, starts fastokens' parse
    then (`olmo_ds.fast_parse`), and only then imports the pipeline; `prepare` takes that parse instead of
    starting its own. A parse of another file, or one `--tokenizer-backend hf` does not need, ends and is dropped."""
    from olmo_ds import fast_parse
    from olmo_ds.cli import prepare_data as cli
    from olmo_ds.data.prepare import backend

    fresh = subprocess.run([sys.executable, "-c", "import sys, olmo_ds.cli.prepare_data as m; "
                            "print(sorted(n for n in sys.modules if n.split('.')[0] in ('numpy', 'tokenizers', 'fastokens') "
                            "or n.startswith('olmo_ds.data')))"], capture_output=True, text=True, check=True)
    assert fresh.stdout.strip() == "[]", f"prepare_data.py imports these before it starts the parse: {fresh.stdout}"

    started = []

    class Recorded(fast_parse.FastParse):
        def __init__(self, path, single_thread=True):
            started.append(Path(path))
            super().__init__(path, single_thread)

    class Refused(fast_parse.FastParse):
        def __init__(self, *a, **k):
            raise AssertionError("prepare started a second parse")

    monkeypatch.setattr(cli, "FastParse", Recorded)
    monkeypatch.setattr(backend, "FastParse", Refused)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    shutil.copy(DOLMA2, tok_dir / "tokenizer.json")
    assert cli.main(["--input", str(C4_DIR), "--output", str(tmp_path / "out"), "--tokenizer", str(tok_dir), "--no-progress"]) == 0
    assert started == [tok_dir / "tokenizer.json"]
    assert shards.Manifest.load(tmp_path / "out").extra["tokenizer_backend"]["name"] == "fastokens"

    monkeypatch.setattr(backend, "FastParse", fast_parse.FastParse)
    other = fast_parse.FastParse(DOLMA2)
    copy = tok_dir / "tokenizer.json"
    mine = backend.early_parse("auto", copy, other)
    assert mine is not other and mine.path == copy and not other._thread.is_alive()
    assert backend.early_parse("hf", copy, mine) is None and not mine._thread.is_alive()
    assert fast_parse.local_tokenizer_json("allenai/dolma2-tokenizer") is None and fast_parse.local_tokenizer_json(tmp_path) is None
