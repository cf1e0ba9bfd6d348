"""Reading a checkpoint back: RNG streams, DeepSpeed's universal form for another world size, and
consolidated fp32 weights without the GPUs (or the number of ranks) the run used.

Every file is read weights-only and checked against the checkpoint's manifest (`safe_load`, `manifest`):
DeepSpeed's readers run inside `weights_only_loads`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

from olmo_ds.checkpoint.layout import UNIVERSAL, read_train_state, rng_file
from olmo_ds.checkpoint.safe_load import load_file, weights_only_loads
from olmo_ds.checkpoint.save import barrier, set_rng_state
from olmo_ds.checkpoint.verify import check_checkpoint
from olmo_ds.model.config import ModelConfig


def load_rng(ckpt_dir: Path, rank: int, *, seed: int, step: int) -> None:
    """Restore this rank's RNG streams; a rank the checkpointed run did not have gets fresh streams
    seeded from (seed, step, rank), so a resume on more ranks is still repeatable."""
    path = rng_file(ckpt_dir, rank)
    if path.is_file():
        set_rng_state(load_file(path, numpy_rng=True))  # numpy_rng: a previous version's file holds numpy's state array
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
        with weights_only_loads():
            ds_to_universal.main(Namespace(input_folder=str(ckpt_dir), output_folder=str(tmp), num_extract_workers=1,
                                           num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True))
        # ds_to_universal also points a `latest_universal` file at its output folder, i.e. at the temporary name.
        (Path(ckpt_dir) / "latest_universal").unlink(missing_ok=True)
        os.replace(tmp, target)
    barrier()
    return target


@contextlib.contextmanager
def _deepspeed_output_to_stderr():
    """DeepSpeed's output, sent to stderr for the duration: its print()s, and its logger, whose handler
    holds the stdout of the moment deepspeed was first imported (importing it warns about the accelerator).

    Consolidation narrates on stdout; every caller's stdout carries its result (an eval table, the
    directory export_hf.py wrote, generated text) and must stay pipeable.
    """
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.utils import logger

        moved = [(h, h.setStream(sys.stderr)) for h in logger.handlers if isinstance(h, logging.StreamHandler) and h.stream is sys.__stdout__]
        try:
            yield
        finally:
            for handler, stream in moved:
                handler.setStream(stream)


def load_model_state(ckpt_dir: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor], dict]:
    """Consolidated fp32 weights of a checkpoint, on CPU, from any ZeRO stage and any world size.

    No GPU, no process group: DeepSpeed's zero_to_fp32 stitches the per-rank partitions together, every
    file read weights-only after the checkpoint verified (`verify.check_checkpoint`; a problem raises a
    CheckpointFileError naming the file). Returns (model config, state dict keyed like `OLMo(cfg).state_dict()`, train_state).
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {ckpt_dir} does not exist")
    train_state = read_train_state(ckpt_dir)
    model_cfg = ModelConfig.from_dict(train_state["model"])
    check_checkpoint(ckpt_dir)
    with _deepspeed_output_to_stderr(), weights_only_loads():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(ckpt_dir.parent), tag=ckpt_dir.name)
    state_dict = {k: v.float().cpu() for k, v in state_dict.items()}
    return model_cfg, state_dict, train_state
