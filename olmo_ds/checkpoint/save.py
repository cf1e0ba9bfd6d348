"""Writing a checkpoint so that it survives anything: atomic completion, `latest`, retention, RNG streams.

Rank 0 writes `train_state.json` (atomically) only after a barrier that every rank reaches once its own
files are on disk (fsynced, not only in the page cache), then switches `latest` (atomically). Each file's
size and checksum, computed as its bytes are written, go into the checkpoint's `manifest.json` first
(`olmo_ds.checkpoint.manifest`), so every reader can tell a damaged or partial copy from the checkpoint. A crash at
any moment therefore leaves either the new checkpoint complete or the previous one untouched and still
named by `latest`; resume never picks a half-written directory.
"""

from __future__ import annotations

import datetime
import io
import logging
import os
import platform
import random
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import olmo_ds
from olmo_ds.atomic import atomic_write_bytes, atomic_write_json, fsync_path
from olmo_ds.checkpoint.layout import LATEST, TOKENIZER_COPY, TRAIN_STATE, checkpoints_dir, is_complete, list_checkpoints, rng_file, step_tag
from olmo_ds.checkpoint.manifest import entry_of_bytes, merge_parts, relative_name, write_part, write_torch

log = logging.getLogger("olmo_ds")


def rng_state() -> dict[str, Any]:
    """This process's RNG streams as tensors and plain values, so that the file loads with weights_only=True
    (format 2; format 1 pickled numpy's state tuple, an ndarray, which `set_rng_state` still takes)."""
    version, internal, gauss = random.getstate()
    algorithm, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"format": 2, "python": [version, list(internal), gauss],
             "numpy": {"algorithm": algorithm, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what `rng_state` returned, in either format."""
    python, numpy_state = state["python"], state["numpy"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    if isinstance(numpy_state, dict):
        numpy_state = (numpy_state["algorithm"], numpy_state["keys"].numpy().astype(np.uint32), numpy_state["pos"],
                       numpy_state["has_gauss"], numpy_state["cached_gaussian"])
    np.random.set_state(numpy_state)
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


def save_checkpoint(engine, run_dir: str | Path, step: int, train_state: dict, *, rank: int, tokenizer_path: str | Path | None,
                    rank_files: dict[str, Any] | None = None) -> Path:
    """Collective, blocking: every rank calls it. Returns the checkpoint directory once it is complete.
    `rank_files`: this rank's own files beside the engine's ({path in the checkpoint: object}, `write_rng`).
    (`olmo_ds.checkpoint.async_save.AsyncSaver` does the same with the writing off the training path.)"""
    ckpt = prepare_checkpoint_dir(run_dir, step, rank)
    recorder = _RecordingEngine(engine.checkpoint_engine, ckpt)
    engine.checkpoint_engine = recorder
    try:
        engine.save_checkpoint(str(checkpoints_dir(run_dir)), tag=step_tag(step), save_latest=False)
    finally:
        engine.checkpoint_engine = recorder.inner
    for directory in {Path(p).parent for p in recorder.paths}:  # the files themselves were fsynced as written
        fsync_path(directory)
    files = dict(recorder.files)
    files.update(write_rng(ckpt, rank, rank_files))
    write_part(ckpt, rank, files)
    barrier()  # every rank's ZeRO shard, RNG file and part of the manifest is on disk
    if rank == 0:
        finalize_checkpoint(ckpt, step, train_state, tokenizer_path=tokenizer_path)
    barrier()
    return ckpt


class _RecordingEngine:
    """DeepSpeed's checkpoint engine, except that each file it saves is written by `manifest.write_torch`
    (hashed while written, fsynced); notes every file's path and manifest entry (this rank's)."""

    def __init__(self, inner, ckpt_dir: Path):
        self.inner, self.ckpt_dir, self.paths, self.files = inner, Path(ckpt_dir), [], {}

    def save(self, state_dict, path):
        self.files[relative_name(path, self.ckpt_dir)] = write_torch(state_dict, path)
        self.paths.append(str(path))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def prepare_checkpoint_dir(run_dir: str | Path, step: int, rank: int) -> Path:
    """Collective: the empty directory of step `step`. A leftover of an interrupted save of the same step is
    removed first (two saves are never mixed); a complete checkpoint of that step (one `--resume auto` passed
    over as damaged, or one newer than the checkpoint resumed explicitly) is moved to
    `step-NNNNNNN.replaced-<UTC time>`, deleting nothing."""
    root = checkpoints_dir(run_dir)
    ckpt = root / step_tag(step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if is_complete(ckpt):
            stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
            aside = root / f"{ckpt.name}.replaced-{stamp}"
            os.rename(ckpt, aside)
            log.warning("%s existed already (complete): moved to %s before saving this step again; delete it when it is not needed",
                        ckpt, aside.name)
        elif ckpt.exists():
            shutil.rmtree(ckpt)
    barrier()
    return ckpt


def write_rng(ckpt_dir: Path, rank: int, rank_files: dict[str, Any] | None = None) -> dict[str, dict]:
    """This rank's RNG file, and its `rank_files` ({path in the checkpoint: object}: state an objective keeps per rank,
    RL's samples in flight), each with torch.save, atomically; their manifest entries ({name: entry})."""
    entries = {}
    for name, obj in [(rng_file(ckpt_dir, rank).name, rng_state()), *(rank_files or {}).items()]:
        data, path = _torch_bytes(obj), Path(ckpt_dir) / name
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        entries[name] = entry_of_bytes(data)
    return entries


def finalize_checkpoint(ckpt: Path, step: int, train_state: dict, *, tokenizer_path: str | Path | None) -> None:
    """Rank 0, once every rank's files and part of the manifest are on disk: the tokenizer copy, `manifest.json`,
    `train_state.json` (which makes the checkpoint complete) and `latest`, each atomically."""
    extra = {}
    if tokenizer_path:
        data = Path(tokenizer_path).read_bytes()
        atomic_write_bytes(ckpt / TOKENIZER_COPY, data)
        extra[TOKENIZER_COPY] = entry_of_bytes(data)
    merge_parts(ckpt, extra)
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

    def make_room(self, directory: Path, nbytes: int) -> float:
        """Before `nbytes` are written into `directory`: wait for the deletes still running only if the disk has not
        that much free (with a twentieth spare), so a disk that holds two checkpoints still never holds three,
        and a roomier one writes while the old checkpoint is freed. Deleting a checkpoint of many GB also drops its
        pages from the page cache, seconds that a save would otherwise wait for. Returns the seconds waited."""
        if not self._threads or shutil.disk_usage(directory).free >= 1.05 * nbytes:
            return 0.0
        t0 = time.perf_counter()
        self.wait()
        return time.perf_counter() - t0
