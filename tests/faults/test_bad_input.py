"""Bad input the owners' tests do not already cover (see coverage.py for the ones they do).

Each case must fail with a message naming the file or key, before any output exists, and must leave
what was on disk as it was.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from olmo_ds.data import shards
from olmo_ds.data.config import DataConfig
from olmo_ds.data.loader import DataLoader
from olmo_ds.data.prepare.pipeline import PrepareConfig, PrepareError, prepare
from olmo_ds.data.validate import format_report, validate_directory
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.train.config import ConfigError, load_config
from tests.faults.faultlib import C4_DIR, NEOX, ROOT, check


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bad_input") / "shards"
    prepare(PrepareConfig(inputs=[str(C4_DIR)], output=out, tokenizer=str(NEOX), shard_tokens=3000, progress=False), log=lambda _: None)
    return out


def open_loader(directory: Path) -> DataLoader:
    return DataLoader(DataConfig(sources=[{"path": str(directory)}]), seq_len=32, global_batch_size=4, dp_rank=0, dp_world_size=1)


EMPTIED = [
    ("shard-00001.bin", r"shard-00001\.bin: size 0 bytes"),
    ("shard-00001.json", r"shard-00001\.json: shard metadata is not valid JSON"),
    ("shard-00001.offsets.npy", r"shard-00001\.offsets\.npy: unreadable document offsets"),
    ("manifest.json", r"manifest\.json: manifest is not valid JSON"),
]


@pytest.mark.parametrize("name, pattern", EMPTIED)
def test_zero_length_shard_files_are_named(shard_dir, tmp_path, name, pattern):
    d = Path(shutil.copytree(shard_dir, tmp_path / "shards"))
    (d / name).write_bytes(b"")
    check("bad input: zero-length shard file", lambda: open_loader(d), pattern, untouched=d)
    if name != "manifest.json":
        report = validate_directory(d, load_tokenizer(NEOX))
        text = format_report(report)
        assert not report.ok and "shard-00001.bin: FAIL" in text, text


def test_manifest_that_disagrees_with_its_shards(shard_dir, tmp_path):
    cases = {
        "num_tokens": (lambda m: m.update(num_tokens=m["num_tokens"] + 7), r"manifest\.json: num_tokens \d+ != \d+"),
        "a shard left out": (lambda m: m.update(shards=m["shards"][:-1]), r"manifest\.json: num_tokens \d+ != \d+"),
        "vocab_size": (lambda m: m.update(vocab_size=1000), r"1000|vocab"),
    }
    for name, (edit, pattern) in cases.items():
        d = Path(shutil.copytree(shard_dir, tmp_path / name.replace(" ", "_")))
        manifest = json.loads((d / "manifest.json").read_text())
        edit(manifest)
        (d / "manifest.json").write_text(json.dumps(manifest))
        check("bad input: manifest disagrees with shards (loader)", lambda: open_loader(d), pattern, untouched=d)


NOT_TOKENIZERS = {
    "empty.json": b"",
    "config.json": b'{"model_type": "olmo2", "hidden_size": 64}',
    "binary.json": bytes(range(256)) * 4,
    "garbage.model": b"\x00\x01 not a sentencepiece model",
    "vocab.txt": b"hello\nworld\n",
}


@pytest.mark.parametrize("name", NOT_TOKENIZERS)
def test_a_file_that_is_not_a_tokenizer(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(NOT_TOKENIZERS[name])
    out = tmp_path / "out"
    run = lambda: prepare(PrepareConfig(inputs=[str(C4_DIR)], output=out, tokenizer=str(path), progress=False), log=lambda _: None)
    check("bad input: tokenizer file that is not a tokenizer", run, rf"{path}: not a valid", errors=(PrepareError,))
    assert not out.exists(), "output written before the tokenizer was checked"


SIZES = [
    ("batch.global_batch_size=0", r"batch\.global_batch_size must be > 0, got 0"),
    ("batch.micro_batch_size=-2", r"batch\.micro_batch_size must be > 0, got -2"),
    ("batch.seq_len=0", r"batch\.seq_len must be > 0, got 0"),
    ("max_steps=-5", r"max_steps must be > 0, got -5"),
    ("model.d_model=0", r"model: .*d_model"),
    ("model.n_layers=-1", r"model: .*n_layers"),
    ("checkpoint.keep_last=0", r"checkpoint\.keep_last >= 1"),
    ("optim.lr=0", r"optim\.lr must be > 0"),
    ("data.sources=[{path: x, weight: -1}]", r"weight"),
    ("batch.seq_len=[1, 2]", r"batch\.seq_len: expected an integer"),
    ("deterministic=maybe", r"deterministic: expected true or false"),
    ("optim=3", r"optim: expected a mapping"),
]


@pytest.mark.parametrize("override, pattern", SIZES, ids=[s for s, _ in SIZES])
def test_config_sizes_and_types(override, pattern):
    fault = "bad input: YAML zero/negative size" if "=0" in override or "=-" in override or "-1" in override else "bad input: YAML wrong type"
    check(fault, lambda: load_config(ROOT / "configs" / "demo.yaml", [override]), pattern, errors=(ConfigError,))


PREPARE_SIZES = [({"shard_tokens": 0}, r"--shard-tokens must be >= 1"), ({"workers": 0}, r"--workers"), ({"val_fraction": -0.1}, r"--val-fraction must be in")]


@pytest.mark.parametrize("kw, pattern", PREPARE_SIZES)
def test_prepare_sizes(tmp_path, kw, pattern):
    out = tmp_path / "out"
    run = lambda: prepare(PrepareConfig(inputs=[str(C4_DIR)], output=out, tokenizer=str(NEOX), progress=False, **kw), log=lambda _: None)
    check("bad input: prepare_data zero/negative size", run, pattern, errors=(PrepareError,))
    assert not out.exists()


def test_shard_dtype_that_disagrees_with_its_vocab(shard_dir, tmp_path):
    d = Path(shutil.copytree(shard_dir, tmp_path / "shards"))
    meta = json.loads(shards.meta_path(d, 1).read_text())
    meta["dtype"] = "uint32"  # the .bin holds uint16 ids
    shards.meta_path(d, 1).write_text(json.dumps(meta))
    check("bad input: corrupt shard metadata", lambda: open_loader(d), r"shard-00001", untouched=d)
    assert np.asarray(shards.open_tokens(shards.bin_path(shard_dir, 1), shards.ShardMeta.load(shards.meta_path(shard_dir, 1)))).size
