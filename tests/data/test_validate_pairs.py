"""validate_shards on preference (DPO) sources: prepared pairs pass; each kind of broken pair (written with the shard
writer, since the preparation never writes one) is found, counted and named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_ds.data import shards
from olmo_ds.data.validate import format_report, validate_directory

from pref_testlib import encoded_pairs, prepare_pref_source, write_pref_source
from sft_testlib import DOLMA2

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pairs():
    return list(encoded_pairs("val"))


def failures(directory: Path) -> dict[str, str]:
    r = validate_directory(directory)
    out = {s.name: "; ".join(s.errors) for s in r.shards if s.errors}
    out.update({f"error{i}": e for i, e in enumerate(r.errors)})
    return out


def test_sound_pairs_validate_with_their_count(tmp_path, pairs):
    src = prepare_pref_source(tmp_path / "ok", "val", shard_tokens=5_000)
    r = validate_directory(src, workers=2)
    assert r.ok, format_report(r)
    assert r.pairs == len(pairs) and len(r.shards) > 3
    proc = subprocess.run([sys.executable, "scripts/validate_shards.py", str(src), "--tokenizer", str(DOLMA2)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0 and f"{len(pairs)} preference pairs" in proc.stdout, proc.stdout + proc.stderr


def damaged(pairs, j: int, how: str):
    """`pairs` with pair j broken in one way."""
    (c_ids, c_mask), (r_ids, r_mask) = pairs[j]
    c_ids, c_mask, r_ids, r_mask = c_ids.copy(), c_mask.copy(), r_ids.copy(), r_mask.copy()
    first = int(np.argmax(c_mask))
    if how == "no_target":
        r_mask[:] = False
    elif how == "earlier_turn_trained":  # a token of the prompt trained too: two runs on the chosen side
        c_mask[first // 2] = True
    elif how == "prompt_differs":
        r_ids[first // 2] = (int(r_ids[first // 2]) + 1) % 100_000
    elif how == "identical":
        r_ids, r_mask = c_ids, c_mask
    elif how == "reply_moved":  # the rejected side's reply starts one token later: no longer one shared prompt
        r_mask[first] = False
    out = list(pairs)
    out[j] = ((c_ids, c_mask), (r_ids, r_mask))
    return out


@pytest.mark.parametrize("how, expected", [
    ("no_target", "1 pairs train no token on one side"),
    ("earlier_turn_trained", "1 pairs train more than one run of tokens on a side"),
    ("prompt_differs", "1 pairs differ before their first trained token"),
    ("reply_moved", "1 pairs differ before their first trained token"),
    ("identical", "1 pairs have identical sides"),
])
def test_a_broken_pair_fails_naming_its_shard_and_pair(tmp_path, pairs, how, expected):
    src = write_pref_source(tmp_path / how, damaged(pairs, 5, how), shard_tokens=1_000_000)
    got = failures(src)
    assert list(got) == ["shard-00000.bin"] and expected in got["shard-00000.bin"], got
    assert "; first: pair 5 (documents 10, 11)" in got["shard-00000.bin"]


def test_many_broken_pairs_are_counted_and_the_first_named(tmp_path, pairs):
    broken = pairs
    for j in (2, 4, 6, 8, 20):
        broken = damaged(broken, j, "identical")
    src = write_pref_source(tmp_path / "many", broken, shard_tokens=1_000_000)
    assert failures(src)["shard-00000.bin"] == ("5 pairs have identical sides (nothing to prefer); first: pair 2 (documents 4, 5), "
                                                "pair 4 (documents 8, 9), pair 6 (documents 12, 13), ...")


def test_pair_counts_and_preference_keys_must_agree(tmp_path, pairs):
    src = write_pref_source(tmp_path / "counts", pairs, shard_tokens=5_000)
    m = json.loads((src / "manifest.json").read_text())
    m["pairs"] += 1
    (src / "manifest.json").write_text(json.dumps(m))
    assert any(f"manifest.json: pairs {len(pairs) + 1} != sum over the shards' metadata {len(pairs)}" in e for e in failures(src).values())
    meta = json.loads(shards.meta_path(src, 1).read_text())
    meta["pairs"] += 1
    shards.meta_path(src, 1).write_text(json.dumps(meta))
    assert "num_docs = 2 x pairs" in failures(src)["shard-00001.bin"]
    del meta["preference"], meta["pairs"]
    shards.meta_path(src, 1).write_text(json.dumps(meta))
    assert "says preference None, but the manifest holds preference pairs" in failures(src)["shard-00001.bin"]
