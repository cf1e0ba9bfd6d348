"""docs/training.md's train config reference equals what scripts/gen_config_reference.py makes now."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from olmo_ds.train.config import TrainConfig

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gen_config_reference.py"
DOC = REPO / "docs" / "training.md"


def test_committed_reference_is_current() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check", str(DOC)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_reference_lists_every_key() -> None:
    text = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    for f in dataclasses.fields(TrainConfig):
        if f.metadata.get("internal"):
            continue
        nested = f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)
        section = f"**{f.name}**" if nested else f"| `{f.name}` |"
        assert section in text, f"{f.name} missing from the reference"
