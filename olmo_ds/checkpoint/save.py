"""Writing a checkpoint so that it survives anything: atomic completion, `latest`, retention, RNG streams.

Rank 0 writes `train_state.json` (atomically) only after a barrier that every rank reaches once its own
files are on disk (fsynced, not only in the page cache), then switches `latest` (atomically). A crash at
any moment therefore leaves either the new checkpoint complete or the previous one untouched and still
named by `latest`; resume never picks a half-written directory.
"""

from __future__ import annotations

import datetime
import io
import platform
import random
import shutil
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import olmo_ds
from olmo_ds.atomic import atomic_write_bytes, atomic_write_json, fsync_path
from olmo_ds.checkpoint.layout import LATEST, TOKENIZER_COPY, TRAIN_STATE, checkpoints_dir, is_complete, list_checkpoints, rng_file, step_tag


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def versions() -> dict[str, str]:
    import deepspeed

    return {
        "olmo_ds": olmo_ds.__version__,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda or "none",
    }


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


def save_checkpoint(engine, run_dir: str | Path, step: int, train_state: dict, *, rank: int, tokenizer_path: str | Path | None) -> Path:
    """Collective, blocking: every rank calls it. Returns the checkpoint directory once it is complete.
    (`olmo_ds.checkpoint.async_save.AsyncSaver` does the same with the writing off the training path.)"""
    ckpt = prepare_checkpoint_dir(run_dir, step, rank)
    recorder = _RecordingEngine(engine.checkpoint_engine)
    engine.checkpoint_engine = recorder
    try:
        engine.save_checkpoint(str(checkpoints_dir(run_dir)), tag=step_tag(step), save_latest=False)
    finally:
        engine.checkpoint_engine = recorder.inner
    for path in recorder.paths:  # torch.save leaves them in the page cache; a power loss must not cost them
        fsync_path(path)
    for directory in {Path(p).parent for p in recorder.paths}:
        fsync_path(directory)
    write_rng(ckpt, rank)
    barrier()  # every rank's ZeRO shard and RNG file is on disk
    if rank == 0:
        finalize_checkpoint(ckpt, step, train_state, tokenizer_path=tokenizer_path)
    barrier()
    return ckpt


class _RecordingEngine:
    """DeepSpeed's checkpoint engine as it is, noting the path of every file it saves (this rank's)."""

    def __init__(self, inner):
        self.inner, self.paths = inner, []

    def save(self, state_dict, path):
        result = self.inner.save(state_dict, path)
        self.paths.append(str(path))
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


def prepare_checkpoint_dir(run_dir: str | Path, step: int, rank: int) -> Path:
    """Collective: the empty directory of step `step` (a leftover of an interrupted save of the same step
    is removed first: two saves are never mixed)."""
    root = checkpoints_dir(run_dir)
    ckpt = root / step_tag(step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if ckpt.exists():
            shutil.rmtree(ckpt)
    barrier()
    return ckpt


def write_rng(ckpt_dir: Path, rank: int) -> None:
    atomic_write_bytes(rng_file(ckpt_dir, rank), _torch_bytes(rng_state()))


def finalize_checkpoint(ckpt: Path, step: int, train_state: dict, *, tokenizer_path: str | Path | None) -> None:
    """Rank 0, once every rank's files are on disk: the tokenizer copy, `train_state.json` (which makes
    the checkpoint complete) and `latest`, each atomically."""
    if tokenizer_path:
        atomic_write_bytes(ckpt / TOKENIZER_COPY, Path(tokenizer_path).read_bytes())
    state = dict(train_state)
    state["step"] = step
    state["tag"] = step_tag(step)
    state["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    state["versions"] = versions()
    state["rng_files"] = sorted(p.name for p in ckpt.glob("rng-rank*.pt"))
    atomic_write_json(ckpt / TRAIN_STATE, state)
    atomic_write_bytes(ckpt.parent / LATEST, (step_tag(step) + "\n").encode())


def _torch_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _remove(d: Path) -> None:
    shutil.rmtree(d, ignore_errors=True)


def prune_checkpoints(root: Path, keep_last: int, keep_every: int = 0, *, protect: Path | None = None,
                      remove: Callable[[Path], None] = _remove) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (sparing multiples of `keep_every`) and
    interrupted saves older than the newest complete one. Rank 0 only. Returns what was deleted.

    Every doomed directory loses its completion marker here, before this returns, so nothing reads it as
    a checkpoint from then on; `remove` then deletes its files (`BackgroundRemover` does that off the
    caller's thread)."""
    complete = list_checkpoints(root)
    if not complete:
        return []
    keep = {d for _, d in complete[-keep_last:]}
    if keep_every:
        keep |= {d for s, d in complete if s % keep_every == 0}
    if protect is not None:
        keep.add(Path(protect))
    newest = complete[-1][0]
    doomed = [d for _, d in complete if d not in keep]
    doomed += [d for s, d in list_checkpoints(root, complete_only=False) if not is_complete(d) and s < newest]
    for d in doomed:
        # Drop the completion marker first so a crash mid-delete leaves an incomplete dir, not a broken "complete" one.
        (d / TRAIN_STATE).unlink(missing_ok=True)
    for d in doomed:
        remove(d)
    return doomed


class BackgroundRemover:
    """Deletes pruned checkpoint directories on threads of their own, so training does not wait while the
    filesystem frees a checkpoint's gigabytes. `wait` before the space is needed again (the next save) and
    before exiting. A process killed mid-delete leaves an incomplete directory older than the newest
    complete checkpoint, which resume skips and the next prune removes."""

    def __init__(self):
        self._threads: list[threading.Thread] = []

    def __call__(self, d: Path) -> None:
        thread = threading.Thread(target=_remove, args=(d,), name=f"olmo_ds-remove-{d.name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def wait(self) -> None:
        for thread in self._threads:
            thread.join()
        self._threads.clear()
