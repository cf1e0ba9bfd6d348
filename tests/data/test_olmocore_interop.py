"""open-instruct's OLMo-core SFT layout, both ways, on OLMo-core's own sample (shared/data/olmocore-sft-sample):
registered in place with its loss masks, and written from masked shards byte for byte."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_ds.chat import load_chat_template
from olmo_ds.data import shards
from olmo_ds.data.prepare.olmocore import ExportError, export_olmocore
from olmo_ds.data.prepare.pipeline import PrepareConfig, prepare
from olmo_ds.data.prepare.token_files import TokenFileError, register_token_files
from olmo_ds.data.validate import validate_directory
from olmo_ds.tokenizer import load_tokenizer
from testdata import SHARED

REPO = Path(__file__).resolve().parents[2]
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
CHAT = SHARED / "data" / "chat-sample"
SAMPLE = SHARED / "data" / "olmocore-sft-sample"
FILES = ("token_ids_part_0000.npy", "labels_mask_part_0000.npy", "token_ids_part_0000.csv.gz")


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DOLMA2)


def boundaries(path: Path) -> list[tuple[int, int]]:
    return [tuple(map(int, line.split(","))) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]


def copy_sample(directory: Path) -> Path:
    directory.mkdir(parents=True)
    for name in FILES:
        shutil.copy(SAMPLE / name, directory / name)
    return directory


def test_registered_sample_reads_back_its_ids_masks_and_boundaries(tmp_path, tok):
    m = register_token_files([str(SAMPLE)], tmp_path / "src", tok)
    assert m.masked and m.extra["trained_tokens"] == 36_995 and m.num_docs == 270 and m.extra["pad_id"] == 100277
    meta = shards.ShardMeta.load(shards.meta_path(tmp_path / "src", 0))
    assert Path(meta.mask) == (SAMPLE / "labels_mask_part_0000.npy").resolve() and Path(meta.bin) == (SAMPLE / FILES[0]).resolve()
    ids = np.asarray(shards.open_tokens(tmp_path / "src" / meta.bin, meta))
    mask = np.asarray(shards.open_mask(tmp_path / "src" / meta.mask, meta))
    np.testing.assert_array_equal(ids, np.fromfile(SAMPLE / FILES[0], dtype=np.uint32))
    np.testing.assert_array_equal(mask, np.fromfile(SAMPLE / FILES[1], dtype=np.bool_))
    offsets = np.asarray(shards.load_offsets(tmp_path / "src" / meta.offsets))
    assert list(zip(offsets[:-1].tolist(), offsets[1:].tolist())) == boundaries(SAMPLE / FILES[2])
    assert meta.trained_tokens == 36_995
    assert validate_directory(tmp_path / "src", tok).ok


@pytest.mark.parametrize("damage, named", [
    ("mask_missing", "labels_mask_part_0001.npy: missing"),
    ("mask_extra", "labels_mask_part_0002.npy: a loss mask whose token file"),
    ("mask_short", "labels_mask_part_0000.npy: 122,656 bytes, but"),
    ("mask_not_bool", "labels_mask_part_0000.npy: byte 7 is 2"),
])
def test_a_missing_extra_or_wrong_mask_is_refused_naming_it(tmp_path, tok, damage, named):
    d = copy_sample(tmp_path / "in")
    if damage == "mask_missing":
        shutil.copy(d / FILES[0], d / "token_ids_part_0001.npy")
    elif damage == "mask_extra":
        shutil.copy(d / FILES[1], d / "labels_mask_part_0002.npy")
    elif damage == "mask_short":
        (d / FILES[1]).write_bytes((d / FILES[1]).read_bytes()[:-1])
    else:
        data = bytearray((d / FILES[1]).read_bytes())
        data[7] = 2
        (d / FILES[1]).write_bytes(bytes(data))
    with pytest.raises(TokenFileError, match=named.replace("(", r"\(")):
        register_token_files([str(d)], tmp_path / "src", tok)
    assert not (tmp_path / "src" / "manifest.json").exists()


def test_prepared_chat_sample_exports_to_the_sample_byte_for_byte(tmp_path, tok):
    prepare(PrepareConfig(inputs=[str(CHAT / "train.jsonl")], output=tmp_path / "shards", tokenizer=str(DOLMA2), format="chat",
                          chat_template="olmo3", shard_tokens=20_000, progress=False), log=lambda _: None)
    out = tmp_path / "olmocore"
    r = subprocess.run([sys.executable, "scripts/export_olmocore_sft.py", str(tmp_path / "shards"), "--output", str(out), "--shuffle-seed", "42"],
                       cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    for name in FILES[:2]:
        assert (out / name).read_bytes() == (SAMPLE / name).read_bytes(), name
    assert boundaries(out / FILES[2]) == boundaries(SAMPLE / FILES[2])
    stats = json.loads((out / "dataset_statistics.json").read_text())["overall_statistics"]
    want = json.loads((SAMPLE / "dataset_statistics.json").read_text())["overall_statistics"]
    assert {k: stats[k] for k in ("total_instances", "total_tokens", "trainable_tokens")} == {k: want[k] for k in ("total_instances", "total_tokens", "trainable_tokens")}
    config = json.loads((out / "tokenizer" / "tokenizer_config.json").read_text())
    assert config["chat_template"] == json.loads((SAMPLE / "tokenizer" / "tokenizer_config.json").read_text())["chat_template"]
    assert load_chat_template(out / "tokenizer").text == load_chat_template("olmo3").text
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == DOLMA2.read_bytes()
    # and back: the export registers in place, masks included
    m = register_token_files([str(out)], tmp_path / "back", tok)
    assert m.masked and m.extra["trained_tokens"] == 36_995 and m.num_docs == 270
    # the shards' own order without --shuffle-seed; small parts cut conversations at the part's end, as the converter does
    parts = tmp_path / "parts"
    export_olmocore(tmp_path / "shards", parts, tok, part_bytes=4 * 40_000)
    names = sorted(p.name for p in parts.glob("token_ids_part_*.npy"))
    assert names == [f"token_ids_part_{k:04d}.npy" for k in range(4)]
    ids = np.concatenate([np.fromfile(parts / n, dtype=np.uint32) for n in names])
    assert [len(np.fromfile(parts / n, dtype=np.uint32)) for n in names] == [40_000, 40_000, 40_000, 2_657]
    prepared = np.concatenate([np.asarray(shards.open_tokens(b, shards.ShardMeta.load(b.with_suffix(".json")))) for b in shards.list_shards(tmp_path / "shards")])
    np.testing.assert_array_equal(ids, prepared)
    for n in names:
        b = boundaries(parts / n.replace(".npy", ".csv.gz"))
        assert b[0][0] == 0 and b[-1][1] == len(np.fromfile(parts / n, dtype=np.uint32))
        assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
        assert (parts / n.replace("token_ids", "labels_mask")).stat().st_size == b[-1][1]


def test_export_refuses_plain_shards_and_a_used_output(tmp_path, tok):
    prepare(PrepareConfig(inputs=[str(SHARED / "data" / "c4-sample")], output=tmp_path / "text", tokenizer=str(DOLMA2), progress=False), log=lambda _: None)
    with pytest.raises(ExportError, match="carry no loss mask"):
        export_olmocore(tmp_path / "text", tmp_path / "o", tok)
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("keep")
    register_token_files([str(SAMPLE)], tmp_path / "src", tok)
    with pytest.raises(ExportError, match="not an empty directory"):
        export_olmocore(tmp_path / "src", tmp_path / "used", tok)
    assert (tmp_path / "used" / "x").read_text() == "keep"


def test_masks_beside_the_named_token_files_are_taken_too(tmp_path, tok):
    m = register_token_files([str(SAMPLE / "token_ids_part_*.npy")], tmp_path / "src", tok)
    assert m.masked and m.extra["trained_tokens"] == 36_995
