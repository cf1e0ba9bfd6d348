"""Whether a checkpoint is what was saved, before anything loads it; and the resume point that follows.

    python scripts/verify_checkpoint.py RUN_OR_CHECKPOINT [...]    # every file's size and checksum; exit 1 on a problem

A checkpoint verifies when its `train_state.json` reads, every file its manifest lists is there with the
recorded size (and checksum: every file with `full`, files up to 64 MiB with `auto`), and no `.pt` file's
pickle asks for anything but tensors and plain data (read without executing it). The level is
OLMO_DS_CHECKPOINT_VERIFY (`sizes`, `auto` by default, `full`); the command line tool always checks everything.

`resolve_resume("auto", run)` takes the newest checkpoint that verifies, saying on one line which file of
each newer one failed and why; an explicit checkpoint that fails is an error naming the file. A
checkpoint without a manifest (an earlier olmo-ds) is taken as it is, with a note in the log.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

from olmo_ds.checkpoint.layout import CHECKPOINTS, TRAIN_STATE, checkpoints_dir, is_complete, list_checkpoints
from olmo_ds.checkpoint.manifest import (MANIFEST, SMALL_BYTES, CheckpointFileError, DamagedCheckpointError,
                                         UnsafeCheckpointError, check_entry, read_manifest, verify_level)
from olmo_ds.checkpoint.safe_load import unsafe_globals

log = logging.getLogger("olmo_ds")


@dataclass
class Verification:
    ckpt_dir: Path
    problems: list[CheckpointFileError] = field(default_factory=list)
    legacy: bool = False  # no manifest: written by an earlier olmo-ds; sizes and checksums unknown
    files: int = 0
    checksummed: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_checkpoint(ckpt_dir: str | Path, level: str | None = None) -> Verification:
    """Check `ckpt_dir` (see the module docstring) at `level` (default: OLMO_DS_CHECKPOINT_VERIFY)."""
    ckpt_dir = Path(ckpt_dir)
    level = level or verify_level()
    result = Verification(ckpt_dir)
    try:
        json.loads((ckpt_dir / TRAIN_STATE).read_text())
    except FileNotFoundError:
        result.problems.append(DamagedCheckpointError(ckpt_dir / TRAIN_STATE, "missing: the checkpoint is incomplete"))
        return result
    except ValueError as e:
        result.problems.append(DamagedCheckpointError(ckpt_dir / TRAIN_STATE, f"not valid JSON ({e})"))
        return result
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointFileError as e:
        result.problems.append(e)
        return result
    if manifest is None:
        result.legacy = True
        names = sorted(p.name for p in ckpt_dir.glob("*.pt"))
    else:
        names = list(manifest["files"])
        for name in names:
            entry = manifest["files"][name]
            checksum = level == "full" or (level == "auto" and entry["size"] <= SMALL_BYTES)
            try:
                check_entry(ckpt_dir / name, entry, checksum=checksum)
            except CheckpointFileError as e:
                result.problems.append(e)
            result.checksummed += checksum
    result.files = len(names)
    broken = {e.path for e in result.problems}
    for name in names:
        path = ckpt_dir / name
        if not name.endswith(".pt") or path in broken:
            continue
        try:
            found = unsafe_globals(path, numpy_rng=name.startswith("rng-rank"))
        except CheckpointFileError as e:
            result.problems.append(e)
            continue
        if found:
            result.problems.append(UnsafeCheckpointError(path, f"its pickle asks for {', '.join(found[:4])}: more than tensors and "
                                                               f"plain data, so loading it could run code; refused"))
    return result


def check_checkpoint(ckpt_dir: str | Path, level: str | None = None) -> Verification:
    """`verify_checkpoint`, raising its first problem (a CheckpointFileError naming the file)."""
    result = verify_checkpoint(ckpt_dir, level)
    if result.problems:
        raise result.problems[0]
    if result.legacy:
        log.info("%s: no %s (written by an earlier olmo-ds): file sizes and checksums are not checked; its files still load "
                 "as weights only", ckpt_dir, MANIFEST)
    return result


def resolve_resume(resume: str | None, run_dir: str | Path, level: str | None = None) -> Path | None:
    """`--resume auto` -> the newest complete checkpoint of the run that verifies (None on a fresh run); a
    path -> that checkpoint, which must verify. Skipped checkpoints stay on disk as they are."""
    if not resume or resume == "none":
        return None
    if resume == "auto":
        complete = list_checkpoints(checkpoints_dir(run_dir))
        skipped = []
        for _, ckpt_dir in reversed(complete):
            result = verify_checkpoint(ckpt_dir, level)
            if not result.ok:
                log.warning("--resume auto: skipping %s: %s", ckpt_dir.name, result.problems[0])
                skipped.append((ckpt_dir, result.problems[0]))
                continue
            if skipped:
                log.warning("--resume auto: resuming from %s, the newest checkpoint that verifies (%d newer skipped: they stay "
                            "on disk; a save of the same step moves one to step-NNNNNNN.replaced-<time>)", ckpt_dir, len(skipped))
            if result.legacy:
                log.info("%s: no %s (written by an earlier olmo-ds): file sizes and checksums are not checked", ckpt_dir, MANIFEST)
            return ckpt_dir
        if skipped:
            raise ValueError(f"--resume auto: none of the {len(skipped)} complete checkpoints of {run_dir} verifies (newest: "
                             f"{skipped[0][1]}); check them with `python scripts/verify_checkpoint.py {run_dir}`, or start a "
                             f"new run with --start-over (which moves this one aside)")
        return None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory")
    if not is_complete(path):
        raise ValueError(f"--resume {resume}: incomplete checkpoint (no {TRAIN_STATE}; the save was interrupted)")
    result = verify_checkpoint(path, level)
    if not result.ok:
        raise ValueError(f"--resume {resume}: {result.problems[0]}")
    if result.legacy:
        log.info("%s: no %s (written by an earlier olmo-ds): file sizes and checksums are not checked", path, MANIFEST)
    return path


def _targets(path: Path) -> list[Path]:
    if (path / CHECKPOINTS).is_dir():
        return [d for _, d in list_checkpoints(checkpoints_dir(path), complete_only=False)]
    return [path]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/verify_checkpoint.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="a checkpoint directory (RUN/checkpoints/step-NNNNNNN) or a run directory (all of its checkpoints)")
    p.add_argument("--level", choices=["sizes", "auto", "full"], default="full", help="default full: every file's checksum")
    args = p.parse_args(argv)
    bad = 0
    for path in map(Path, args.paths):
        if not path.is_dir():
            print(f"{path}: no such directory", file=sys.stderr)
            bad += 1
            continue
        for ckpt_dir in _targets(path):
            if not is_complete(ckpt_dir):
                print(f"{ckpt_dir}: INCOMPLETE (no {TRAIN_STATE}: an interrupted save; never resumed or evaluated)")
                continue
            result = verify_checkpoint(ckpt_dir, args.level)
            if result.problems:
                bad += 1
                print(f"{ckpt_dir}: FAILED: " + "; ".join(str(e) for e in result.problems))
            elif result.legacy:
                print(f"{ckpt_dir}: ok, no {MANIFEST} (an earlier olmo-ds): {result.files} .pt files hold weights only; sizes and checksums unknown")
            else:
                print(f"{ckpt_dir}: ok ({result.files} files, {result.checksummed} checksummed, none holds code)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
