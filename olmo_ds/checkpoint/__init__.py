"""Checkpoints and run directories: the one place that reads or writes them.

Training saves and resumes through here; evaluation, generation, HF export and starting a run from
weights (`olmo_ds.weights`) read through here. The layer sits low in the package: it imports
`olmo_ds.atomic` and `olmo_ds.model.config` and nothing else of olmo_ds, so every room above it
(train, eval, the tools) can use it without reaching into the trainer.

- `layout`: the names (`RUN/checkpoints/step-NNNNNNN/`, `latest`, `train_state.json`) and which
  checkpoints are complete;
- `save`: a collective, crash-safe save, retention, RNG streams;
- `async_save`: the same save with the writing in the background (training blocked only for a copy to host memory);
- `load`: RNG streams back, DeepSpeed's universal form for another world size, consolidated fp32
  weights on CPU;
- `manifest`: each file's size and checksum, computed while it is written, in `manifest.json`;
- `safe_load`: every checkpoint file read with `torch.load(weights_only=True)` (DeepSpeed's readers too),
  or refused naming the file;
- `verify`: whether a checkpoint is what was saved; the resume point (`--resume auto` passes over a damaged
  checkpoint); `python scripts/verify_checkpoint.py RUN`.
"""

from olmo_ds.checkpoint.layout import (
    CHECKPOINTS,
    LATEST,
    METRICS,
    TOKENIZER_COPY,
    TRAIN_STATE,
    UNIVERSAL,
    WANDB_ID,
    checkpoints_dir,
    is_complete,
    latest_checkpoint,
    list_checkpoints,
    move_run_aside,
    read_train_state,
    rng_file,
    run_dir_of,
    run_markers,
    step_of,
    step_tag,
)
from olmo_ds.checkpoint.manifest import MANIFEST, CheckpointFileError, DamagedCheckpointError, UnsafeCheckpointError
from olmo_ds.checkpoint.safe_load import load_file, safe_engine, weights_only_loads
from olmo_ds.checkpoint.verify import Verification, check_checkpoint, resolve_resume, verify_checkpoint
from olmo_ds.checkpoint.load import load_model_state, load_rng, universal_checkpoint
from olmo_ds.checkpoint.async_save import AsyncSaver, AsyncSaveError
from olmo_ds.checkpoint.save import BackgroundRemover, finalize_checkpoint, prune_checkpoints, rng_state, save_checkpoint, set_rng_state, versions

__all__ = [
    "MANIFEST", "CheckpointFileError", "DamagedCheckpointError", "UnsafeCheckpointError", "Verification", "check_checkpoint",
    "load_file", "safe_engine", "verify_checkpoint", "weights_only_loads",
    "AsyncSaveError", "AsyncSaver", "BackgroundRemover", "CHECKPOINTS", "LATEST", "METRICS", "TOKENIZER_COPY", "TRAIN_STATE", "UNIVERSAL", "WANDB_ID", "checkpoints_dir",
    "finalize_checkpoint", "is_complete", "latest_checkpoint", "list_checkpoints", "load_model_state", "load_rng", "move_run_aside",
    "prune_checkpoints", "read_train_state", "resolve_resume", "rng_file", "rng_state", "run_dir_of", "run_markers",
    "save_checkpoint", "set_rng_state", "step_of", "step_tag", "universal_checkpoint", "versions",
]
