"""Checkpoints that survive anything: layout, atomic completion, retention, resume, fp32 export.

Layout (docs/architecture.md, "Checkpoints"):

    RUN/checkpoints/step-NNNNNNN/   DeepSpeed's ZeRO files (tag step-NNNNNNN), rng-rankNNNNN.pt per rank,
                                    tokenizer.json, and train_state.json, written LAST
    RUN/checkpoints/latest          the tag of the newest complete checkpoint

A checkpoint is complete exactly when its `train_state.json` exists: rank 0 writes it (atomically)
only after a barrier that every rank reaches once its own files are on disk, then switches `latest`
(atomically). A crash at any moment therefore leaves either the new checkpoint complete or the
previous one untouched and still named by `latest`; resume never picks a half-written directory.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from olmo_ds.data.shards import atomic_write_bytes, atomic_write_json
from olmo_ds.model.config import ModelConfig

CHECKPOINTS = "checkpoints"
TRAIN_STATE = "train_state.json"
LATEST = "latest"
TOKENIZER_COPY = "tokenizer.json"
UNIVERSAL = "universal"
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


def resolve_resume(resume: str | None, run_dir: str | Path) -> Path | None:
    """`--resume auto` -> newest complete checkpoint of the run (None on a fresh run); a path -> that one."""
    if not resume or resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoints_dir(run_dir))
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"--resume {resume}: no such checkpoint directory")
    if not is_complete(path):
        raise ValueError(f"--resume {resume}: incomplete checkpoint (no {TRAIN_STATE}; the save was interrupted)")
    return path


# --- RNG -----------------------------------------------------------------------------------------


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

    import olmo_ds

    return {
        "olmo_ds": olmo_ds.__version__,
        "torch": torch.__version__,
        "deepspeed": deepspeed.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda or "none",
    }


def _barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# --- save ----------------------------------------------------------------------------------------


def save_checkpoint(engine, run_dir: str | Path, step: int, train_state: dict, *, rank: int, tokenizer_path: str | None) -> Path:
    """Collective: every rank calls it. Returns the checkpoint directory once it is complete."""
    root = checkpoints_dir(run_dir)
    tag = step_tag(step)
    ckpt = root / tag
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if ckpt.exists():  # leftover of an interrupted save of the same step: never mix two saves
            shutil.rmtree(ckpt)
    _barrier()
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    atomic_write_bytes(rng_file(ckpt, rank), _torch_bytes(rng_state()))
    _barrier()  # every rank's ZeRO shard and RNG file is on disk
    if rank == 0:
        if tokenizer_path:
            atomic_write_bytes(ckpt / TOKENIZER_COPY, Path(tokenizer_path).read_bytes())
        state = dict(train_state)
        state["step"] = step
        state["tag"] = tag
        state["timestamp"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        state["versions"] = versions()
        state["rng_files"] = sorted(p.name for p in ckpt.glob("rng-rank*.pt"))
        atomic_write_json(ckpt / TRAIN_STATE, state)
        atomic_write_bytes(root / LATEST, (tag + "\n").encode())
    _barrier()
    return ckpt


def _torch_bytes(obj) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def prune_checkpoints(root: Path, keep_last: int, keep_every: int = 0, *, protect: Path | None = None) -> list[Path]:
    """Delete complete checkpoints beyond the newest `keep_last` (sparing multiples of `keep_every`) and
    interrupted saves older than the newest complete one. Rank 0 only. Returns what was deleted."""
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
        shutil.rmtree(d, ignore_errors=True)
    return doomed


# --- load ----------------------------------------------------------------------------------------


def read_train_state(ckpt_dir: str | Path) -> dict:
    path = Path(ckpt_dir) / TRAIN_STATE
    if not path.is_file():
        raise FileNotFoundError(f"{ckpt_dir}: no {TRAIN_STATE}; not a complete olmo-ds checkpoint")
    return json.loads(path.read_text())


def load_rng(ckpt_dir: Path, rank: int, *, seed: int, step: int) -> None:
    """Restore this rank's RNG streams; a rank the checkpointed run did not have gets fresh streams
    seeded from (seed, step, rank), so a resume on more ranks is still repeatable."""
    path = rng_file(ckpt_dir, rank)
    if path.is_file():
        set_rng_state(torch.load(path, weights_only=False))
        return
    derived = int(np.random.SeedSequence([seed, step, rank]).generate_state(1, np.uint64)[0])
    random.seed(derived)
    np.random.seed(derived % 2**32)
    torch.manual_seed(derived)


def universal_checkpoint(ckpt_dir: Path, rank: int) -> Path:
    """Collective: `ckpt_dir/universal`, DeepSpeed's world-size-independent form of the checkpoint.

    Rank 0 converts once with DeepSpeed's ds_to_universal (every parameter's fp32 weights and Adam
    moments whole, one file each) into a temporary directory renamed into place when complete, so an
    interrupted conversion is redone and a finished one is reused by every later resume.
    """
    target = Path(ckpt_dir) / UNIVERSAL
    if rank == 0 and not target.is_dir():
        from argparse import Namespace

        from deepspeed.checkpoint import ds_to_universal

        tmp = Path(ckpt_dir) / f"{UNIVERSAL}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        # One worker: the conversion runs inside a training rank, where forking a process pool is unwelcome.
        ds_to_universal.main(Namespace(input_folder=str(ckpt_dir), output_folder=str(tmp), num_extract_workers=1,
                                       num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
        # ds_to_universal also points a `latest_universal` file at its output folder, i.e. at the temporary name.
        (Path(ckpt_dir) / "latest_universal").unlink(missing_ok=True)
        os.replace(tmp, target)
    _barrier()
    return target


def load_model_state(ckpt_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Consolidated fp32 weights of a checkpoint, on CPU, from any ZeRO stage and any world size.

    No GPU, no process group: DeepSpeed's zero_to_fp32 stitches the per-rank partitions together.
    Returns (model config, state dict keyed like `OLMo(cfg).state_dict()`, train_state).
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    train_state = read_train_state(ckpt_dir)
    model_cfg = ModelConfig.from_dict(train_state["model"])
    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir.parent), tag=ckpt_dir.name)
    state_dict = {k: v.float().cpu() for k, v in state_dict.items()}
    return model_cfg, state_dict, train_state
