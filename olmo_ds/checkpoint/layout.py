"""Where a run keeps its checkpoints, and which of them are complete: the names every reader and writer share.

Layout (docs/architecture.md, "Checkpoints"):

    RUN/checkpoints/step-NNNNNNN/   DeepSpeed's ZeRO files (tag step-NNNNNNN), rng-rankNNNNN.pt per rank,
                                    tokenizer.json, and train_state.json, written LAST
    RUN/checkpoints/latest          the tag of the newest complete checkpoint
    RUN/metrics.jsonl, RUN/wandb_id, RUN/tb/, RUN/eval/   what a run logs beside its checkpoints

A checkpoint is complete exactly when its `train_state.json` exists (see `olmo_ds.checkpoint.save`), so
a reader never picks a half-written directory: it lists `step-*` directories and keeps the complete ones.
"""

from __future__ import annotations

import datetime
import json
import os
import re
from pathlib import Path

CHECKPOINTS = "checkpoints"
TRAIN_STATE = "train_state.json"
LATEST = "latest"
TOKENIZER_COPY = "tokenizer.json"
UNIVERSAL = "universal"
METRICS = "metrics.jsonl"
WANDB_ID = "wandb_id"
_TAG = re.compile(r"^step-(\d{7,})$")


def step_tag(step: int) -> str:
    return f"step-{step:07d}"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / CHECKPOINTS


def rng_file(ckpt_dir: Path, rank: int) -> Path:
    return Path(ckpt_dir) / f"rng-rank{rank:05d}.pt"


def is_complete(ckpt_dir: Path) -> bool:
    return (Path(ckpt_dir) / TRAIN_STATE).is_file()


def list_checkpoints(root: Path, complete_only: bool = True) -> list[tuple[int, Path]]:
    """(step, directory) of the checkpoints under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _TAG.match(d.name)
        if m and d.is_dir() and (is_complete(d) or not complete_only):
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root` (by step; `latest` is a convenience pointer)."""
    complete = list_checkpoints(root)
    return complete[-1][1] if complete else None


def read_train_state(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / TRAIN_STATE
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir}: no {TRAIN_STATE}; not a complete olmo-ds checkpoint")
    return json.loads(path.read_text())


def run_dir_of(checkpoint: str | Path) -> Path | None:
    """The run a checkpoint directory belongs to (`RUN` of `RUN/checkpoints/step-N`), else None."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None


def step_of(checkpoint: str | Path) -> int | None:
    """The step in a checkpoint directory's name (`step-0000100` -> 100), else None."""
    m = _TAG.match(Path(checkpoint).name)
    return int(m.group(1)) if m else None


def run_markers(run_dir: str | Path) -> list[str]:
    """What makes `run_dir` hold a run, relative to it: any `checkpoints/step-*` directory (complete or
    not), `metrics.jsonl`, `wandb_id`. Empty for a new or empty run directory."""
    run_dir = Path(run_dir)
    found = [f"{CHECKPOINTS}/{d.name}" for _, d in list_checkpoints(checkpoints_dir(run_dir), complete_only=False)]
    return found + [name for name in (METRICS, WANDB_ID) if (run_dir / name).exists()]


def move_run_aside(run_dir: str | Path) -> Path:
    """Rename `run_dir` to `RUN.replaced-<UTC time>` (deleting nothing) so a new run can start there."""
    run_dir = Path(run_dir)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    target = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}")
    n = 1
    while target.exists():  # two restarts within a second
        target = run_dir.with_name(f"{run_dir.name}.replaced-{stamp}-{n}")
        n += 1
    os.rename(run_dir, target)
    return target
