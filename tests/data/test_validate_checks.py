"""Check records: each shard checked by the process that wrote it (`validate.check_shard`), the final validation of
`prepare_data.py` taking each shard's reading from its record (`validate_directory(trust_checks=True)`), and
`validate_shards.py DIR` still reading everything from the files alone.

What a user relies on: the verdict with records is the verdict of a full read, on good and on broken output; a record
that is missing, edited, another shard's, or made under other rules is not taken (that shard is read again); the
records change no shard byte and are themselves the same bytes for any worker count and after a resume; chat,
preference and RL prompt sources get records too. Real tokenizers, real text (the C4 sample, the chat, preference
and RL samples)."""

from __future__ import annotations

import dataclasses
import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_ds.data import shards
from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare
from olmo_ds.data.validate import check_path, check_shard, format_report, split_rules, validate_directory
from olmo_ds.eval import verifiers
from olmo_ds.tokenizer import load_tokenizer
from testdata import SHARED

REPO = Path(__file__).resolve().parents[2]
NEOX = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
C4 = SHARED / "data" / "c4-sample"


def run(out: Path, inputs=(C4,), tokenizer=NEOX, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("chunk_bytes", 2048)
    return prepare(PrepareConfig(inputs=[str(i) for i in inputs], output=out, tokenizer=str(tokenizer), **kw), log=lambda _: None)


def dir_bytes(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def all_bins(directory: Path) -> list[Path]:
    return shards.list_shards(directory) + shards.list_shards(directory / "val")


def many_files(raw: Path) -> Path:
    """The C4 sample's documents over 12 files: enough for two workers to take whole files."""
    docs = [line for f in sorted(C4.glob("*.json.gz")) for line in gzip.open(f, "rt").read().splitlines()]
    raw.mkdir()
    for i in range(12):
        (raw / f"part-{i:02d}.jsonl").write_text("\n".join(docs[i::12]) + "\n")
    return raw


def verdicts(directory: Path, tokenizer=NEOX) -> tuple[str, str, int]:
    """The full read's report, the report with records, and how many shards the latter took from records."""
    tok = load_tokenizer(tokenizer)
    full = validate_directory(directory, tok)
    trusted = validate_directory(directory, tok, trust_checks=True)
    assert full.ok == trusted.ok
    return format_report(full), format_report(trusted), trusted.from_checks


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("checks") / "shards"
    result = run(out, shard_tokens=3000, val_fraction=0.2)
    assert result.validation.ok and result.validation.from_checks == len(all_bins(out)) >= 4
    return out


@pytest.fixture
def shard_dir(prepared, tmp_path) -> Path:
    return Path(shutil.copytree(prepared, tmp_path / "shards"))


def test_every_shard_gets_a_record_and_the_same_bytes_for_1_and_2_workers(tmp_path):
    raw = many_files(tmp_path / "raw")
    one = run(tmp_path / "one", [raw], shard_tokens=2500, val_fraction=0.1, workers=1, work_unit="blocks")
    two = run(tmp_path / "two", [raw], shard_tokens=2500, val_fraction=0.1, workers=2, work_unit="files")
    bins = all_bins(tmp_path / "one")
    assert len(bins) >= 4 and all(check_path(b.parent, b.name).is_file() for b in bins)
    assert sorted((tmp_path / "one").glob("shard-*.json")) == [b.with_suffix(".json") for b in shards.list_shards(tmp_path / "one")]  # metadata alone
    for r in (one, two):
        assert r.validation.ok and r.validation.from_checks == len(bins), format_report(r.validation)
    assert dir_bytes(tmp_path / "one") == dir_bytes(tmp_path / "two")  # the records too


def test_records_change_no_shard_byte(tmp_path, prepared):
    """The shards, offsets, metadata and manifests are what they were before records existed: without them, the
    directory is a complete output that a full read passes."""
    out = Path(shutil.copytree(prepared, tmp_path / "out"))
    for b in all_bins(out):
        meta = shards.ShardMeta.load(b.with_suffix(".json"))
        assert shards.sha256_file(b) == meta.checksum
        check_path(b.parent, b.name).unlink()
    report = validate_directory(out, load_tokenizer(NEOX), trust_checks=True)
    assert report.ok and report.from_checks == 0


def test_the_prepare_summary_and_validate_shards_say_what_was_read(tmp_path):
    out = tmp_path / "out"
    args = ["--input", str(C4), "--tokenizer", str(NEOX), "--shard-tokens", "3000", "--no-progress"]
    proc = subprocess.run([sys.executable, "scripts/prepare_data.py", *args, "--output", str(out)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    n = len(all_bins(out))
    assert f"validated       OK: {n} shards, {n} as checked by the process that wrote each, 0 read again" in proc.stdout
    for flags, taken in (([], 0), (["--trust-checks"], n)):
        proc = subprocess.run([sys.executable, "scripts/validate_shards.py", str(out), "--tokenizer", str(NEOX), "--json", *flags],
                              cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["from_checks"] == taken


def rules(directory: Path):
    """The rules the directory's manifest sets for its shards."""
    m = shards.Manifest.load(directory)
    return split_rules(m.masked, m.preference, m.prompts, m.extra)


def edit_record(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record))


@pytest.mark.parametrize("damage", ["missing", "not_json", "edited", "another_shards", "other_rules", "other_inner_eos_reason"])
def test_a_record_that_does_not_hold_is_not_taken(shard_dir, damage):
    rec = check_path(shard_dir, "shard-00001.bin")
    if damage == "missing":
        rec.unlink()
    elif damage == "not_json":
        rec.write_text(rec.read_text()[:-20])
    elif damage == "edited":  # a reading's result changed, its sha256 left as it was
        edit_record(rec, lambda r: r["found"][0][1].__setitem__(1, 7))
    elif damage == "another_shards":
        shutil.copy(check_path(shard_dir, "shard-00000.bin"), rec)
    elif damage == "other_rules":  # a consistent record, made as if documents might end without EOS
        assert check_shard(shard_dir, "shard-00001.bin", dataclasses.replace(rules(shard_dir), eos_less_ok=True)).ok
    else:
        assert check_shard(shard_dir, "shard-00001.bin", rules(shard_dir), "prepared with --match-special-tokens").ok
    full, trusted, taken = verdicts(shard_dir)
    assert full == trusted and "total: OK" in trusted.splitlines()[-1]
    assert taken == len(all_bins(shard_dir)) - 1


def flip_first_eos(directory: Path, index: int) -> None:
    b = shards.bin_path(directory, index)
    ids = np.fromfile(b, dtype="<u2")
    ids[int(shards.load_offsets(shards.offsets_path(directory, index))[1]) - 1] = 11
    ids.tofile(b)


DAMAGES = {
    "truncated_bin": lambda d: shards.bin_path(d, 1).write_bytes(shards.bin_path(d, 1).read_bytes()[:-2]),
    "offsets_edited": lambda d: np.save(shards.offsets_path(d, 1), np.load(shards.offsets_path(d, 1)) + np.r_[0, 1, np.zeros(
        len(np.load(shards.offsets_path(d, 1))) - 2, dtype=np.int64)].astype(np.int64)),
    "metadata_checksum_edited": lambda d: shards.meta_path(d, 0).write_text(shards.meta_path(d, 0).read_text().replace('"sha256:', '"sha256:0', 1)),
    "metadata_max_id_edited": lambda d: edit_record(shards.meta_path(d, 0), lambda m: m.__setitem__("max_token_id", m["max_token_id"] - 1)),
    "manifest_totals": lambda d: edit_record(d / "manifest.json", lambda m: m.__setitem__("num_tokens", m["num_tokens"] + 1)),
    "val_shard_missing": lambda d: shards.bin_path(d / "val", 0).unlink(),
    "shard_not_in_manifest": lambda d: [shutil.copy(p, d / p.name.replace("shard-00000", "shard-00099")) for p in d.glob("shard-00000.*")],
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_broken_output_gets_the_full_reads_verdict(shard_dir, damage):
    DAMAGES[damage](shard_dir)
    full, trusted, _ = verdicts(shard_dir)
    assert "total: FAIL" in full.splitlines()[-1]
    assert trusted == full


def test_a_shard_broken_before_its_check_is_reported_from_its_record(shard_dir):
    """The record of a shard that was wrong when its writer checked it holds the same findings a full read makes."""
    flip_first_eos(shard_dir, 0)
    report = check_shard(shard_dir, "shard-00000.bin", rules(shard_dir))
    assert not report.ok
    full, trusted, taken = verdicts(shard_dir)
    assert taken == len(all_bins(shard_dir)) and trusted == full
    assert "1 documents do not end in EOS" in trusted and "checksum mismatch" in trusted


def test_validate_shards_reads_every_byte_by_default(shard_dir):
    """A byte changed in place after its record was made, size kept: the record vouches for the shard as it was
    written, so only a full read finds it, and a full read is what validate_shards.py does unless told otherwise."""
    flip_first_eos(shard_dir, 1)
    proc = subprocess.run([sys.executable, "scripts/validate_shards.py", str(shard_dir)], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 1 and "shard-00001.bin: FAIL" in proc.stdout and "checksum mismatch" in proc.stdout
    proc = subprocess.run([sys.executable, "scripts/validate_shards.py", str(shard_dir), "--trust-checks"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


def test_a_resume_writes_the_record_a_kill_left_out(tmp_path, prepared):
    ref = Path(shutil.copytree(prepared, tmp_path / "ref"))
    out = Path(shutil.copytree(prepared, tmp_path / "out"))
    (out / "manifest.json").unlink()
    check_path(out, "shard-00001.bin").unlink()  # killed after the shard's metadata, before its record
    result = run(out, shard_tokens=3000, val_fraction=0.2)
    assert result.validation.ok and result.validation.from_checks == len(all_bins(out))
    assert dir_bytes(out) == dir_bytes(ref)


CHAT = SHARED / "data" / "chat-sample"
PREF = SHARED / "data" / "pref-sample"
RL = Path(__file__).resolve().parent / "rl_fixtures"


@pytest.mark.parametrize("fmt, inputs, kw", [
    ("chat", [CHAT / "train.jsonl"], {"max_tokens": 512, "long_conversations": "truncate"}),
    ("preference", [PREF / "train.jsonl"], {}),
    ("rl", [RL / "train.jsonl"], {"check_ground_truth": verifiers.check}),
])
def test_conversation_sources_get_records_and_the_full_reads_verdict(tmp_path, fmt, inputs, kw):
    out = tmp_path / "out"
    result = run(out, inputs, DOLMA2, format=fmt, chat_template="olmo3", shard_tokens=20000, val_fraction=0.1, chunk_bytes=8192, **kw)
    n = len(all_bins(out))
    assert result.validation.ok and result.validation.from_checks == n >= 2, format_report(result.validation)
    full, trusted, taken = verdicts(out, DOLMA2)
    assert trusted == full and taken == n
    meta = shards.ShardMeta.load(shards.meta_path(out, 0))
    damaged = out / (meta.mask or meta.prompts)  # a loss mask, or the RL prompts' sidecar
    raw = bytearray(damaged.read_bytes())
    raw[-2] = raw[-2] ^ 1  # same size: a mask's byte 0 <-> 1, a sidecar's character
    damaged.write_bytes(bytes(raw))
    assert not validate_directory(out, load_tokenizer(DOLMA2)).ok  # a full read finds it
    if meta.prompts:  # the sidecar is read again whole with records too: small, and the trainer reads it as written
        full, trusted, _ = verdicts(out, DOLMA2)
        assert trusted == full and "prompt records" in trusted


def test_a_shard_read_back_as_written_gives_the_whole_read_record(tmp_path):
    """Whole-file mode reads a shard back from its file in order as its parts land (`validate.ReadBack`), so the check
    after the last part does not read the whole shard again: its record is the one a whole read makes. Damage is found
    the same way, and a read-back that missed bytes is not taken."""
    from olmo_ds.data.validate import ReadBack, ShardRules

    rng = np.random.default_rng(0)
    parts = []
    for n_docs in (5, 7, 3):
        lens = rng.integers(2, 40, n_docs)
        ids = rng.integers(0, 900, int(lens.sum())).astype(np.uint16)
        ids[np.cumsum(lens) - 1] = 999
        parts.append((ids, lens))

    def write(name: str, damage: bool = False, skip_last_read: bool = False) -> tuple[Path, ReadBack]:
        directory = tmp_path / name
        directory.mkdir()
        w = shards.ShardWriter(directory, 0, vocab_size=1000, eos_id=999)
        for ids, lens in parts:
            w.append(ids, lens)
        w.close({})
        path, ends = shards.bin_path(directory, 0), np.cumsum([2 * len(ids) for ids, _ in parts])
        if damage:  # the file holds another byte than the one written (and hashed by the writer)
            with open(path, "r+b") as f:
                f.seek(ends[1] - 3)
                f.write(b"\x07")
        back = ReadBack(np.uint16, 999)
        for end in ends[:-1] if skip_last_read else ends:
            back.read(path, int(end))
        return directory, back

    def record(directory: Path, back: ReadBack | None):
        report = check_shard(directory, "shard-00000.bin", ShardRules(), read_back=back)
        return report, json.loads(check_path(directory, "shard-00000.bin").read_text())["found"]

    for damage, skip in ((False, False), (True, False), (False, True)):
        directory, back = write(f"shard-{damage}-{skip}", damage, skip)
        assert (back.done == shards.bin_path(directory, 0).stat().st_size) == (not skip)
        report, found = record(directory, back)
        whole_report, whole_found = record(directory, None)  # no read-back: the whole file read at the end
        assert found == whole_found and report.ok == whole_report.ok == (not damage)
        assert damage == any("checksum mismatch" in e for e in report.errors)
    # It is the read-back that the record holds: a byte changed after it, in the closed shard, only a whole read finds.
    directory, back = write("changed-after")
    with open(shards.bin_path(directory, 0), "r+b") as f:
        f.write(b"\x07")
    assert record(directory, back)[0].ok and not record(directory, None)[0].ok
