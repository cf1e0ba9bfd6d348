"""docs/training.md's train config reference equals what scripts/gen_config_reference.py makes now, and lists every key
of every section, the keys found here from the dataclasses themselves (a key or section added to the config is
missing from the reference until it is regenerated)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
import types
import typing
from pathlib import Path

from olmo_ds.model.config import ModelConfig
from olmo_ds.train.config import ModelSpec, RLConfig, TrainConfig

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_config_reference.py"
DOC = REPO / "docs" / "training.md"


def test_committed_reference_is_current() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check", str(DOC)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def dataclass_of(tp) -> type | None:
    """The dataclass behind a field's type: X, X | None, list[X] (None for anything else)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType, list) and len(args) == 1:
        tp = args[0]
    if tp is ModelSpec:
        return ModelConfig
    return tp if dataclasses.is_dataclass(tp) else None


def expected_keys(cls=TrainConfig, path: str = "") -> dict[str, set[str]]:
    """Section path ("" for the top level, "rl", "data.sources") -> its keys, from the dataclasses."""
    hints = typing.get_type_hints(cls)
    out = {path: {f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")}}
    if cls is ModelConfig:
        return out
    for f in dataclasses.fields(cls):
        nested = None if f.metadata.get("internal") else dataclass_of(hints[f.name])
        if nested is not None:
            out.update(expected_keys(nested, f"{path}.{f.name}".lstrip(".")))
    return out


def documented_keys(text: str) -> dict[str, set[str]]:
    """Section path -> the keys of its table in the generated markdown (a title "a[] and b[]" serves both a and b)."""
    out: dict[str, set[str]] = {}
    for title, body in re.findall(r"^\*\*(.+?)\*\*\n(.*?)(?=^\*\*|\Z)", text, flags=re.M | re.S):
        keys = set(re.findall(r"^\| `(\w+)` \|", body, flags=re.M))
        names = ["" if title == "top level" else re.sub(r"\[\]$", "", n.split(" (")[0]) for n in title.split(" and ")]
        for name in names:
            out[name] = keys
    return out


def missing_keys(text: str) -> list[str]:
    """Every dotted key of the dataclasses that the reference `text` does not list in its section."""
    documented, missing = documented_keys(text), []
    for section, keys in expected_keys().items():
        if section not in documented:
            missing.append(f"{section} (the whole section)")
            continue
        if section == "":  # the always-present sections have tables of their own, not rows here
            keys = {k for k in keys if k in ("dpo", "rl") or dataclass_of(typing.get_type_hints(TrainConfig)[k]) is None}
        missing += sorted(f"{section}.{k}".lstrip(".") for k in keys - documented[section])
    return missing


def test_reference_lists_every_key_of_every_section() -> None:
    text = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert missing_keys(text) == []


def test_a_reference_without_an_rl_key_or_section_is_caught() -> None:
    """The check sees the rl section, key by key, from RLConfig's fields (keys added to it later included)."""
    text = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    key = dataclasses.fields(RLConfig)[-1].name
    head, rl = text.split("**rl ")
    assert missing_keys(head + "**rl " + re.sub(rf"^\| `{key}` \|.*\n", "", rl, flags=re.M)) == [f"rl.{key}"]
    without_rl = re.sub(r"^\*\*rl .*?(?=^<!--)", "", text, flags=re.M | re.S)
    assert missing_keys(without_rl) == ["rl (the whole section)"]
