"""Where a run's weights and optimizer state come from, put into a built DeepSpeed engine (or the model before it).

    load_engine_state(engine, ckpt_dir, state, rank, world_size)   # resume, or init_from with load_optimizer
    fingerprint = init_weights(model, directory, model_cfg, rank, world_size)   # init_from: weights only
    record = init_record(cfg.init_from, provenance, fingerprint)   # what train_state.json says of the source

The plan (`olmo_ds.train.plan`) has decided by now that the checkpoint or weights fit this run; this module only
loads them: every checkpoint file weights-only and checked against its manifest (`olmo_ds.checkpoint.safe_load`),
on another world size through DeepSpeed's universal form, and for `init_from` read by rank 0 alone, each rank
receiving only its own partitions.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
import torch.distributed as dist

from olmo_ds import checkpoint as ckpt
from olmo_ds import weights
from olmo_ds.model import ModelConfig
from olmo_ds.train.config import ConfigError, InitFromConfig

log = logging.getLogger("olmo_ds")


def load_engine_state(engine, ckpt_dir: Path, state: dict, rank: int, world_size: int) -> None:
    """Model weights and optimizer state of an olmo-ds checkpoint into the engine (on its world size
    exactly, on another through DeepSpeed's universal form); a damaged file is a ConfigError naming it."""
    universal = state["world_size"] != world_size
    if universal:
        load_dir, tag = ckpt_dir, ckpt.universal_checkpoint(ckpt_dir, rank).name
        log.info("%s was written by %d ranks: loading its universal form on %d", ckpt_dir, state["world_size"], world_size)
    else:  # ZeRO's own partitions: bitwise exact
        load_dir, tag = ckpt_dir.parent, ckpt_dir.name
    # DeepSpeed reads this flag only inside load_checkpoint; set for the one load rather than in the
    # DeepSpeed config, which is saved with every later checkpoint.
    engine._config.load_universal_checkpoint = universal
    groups = engine.optimizer.optimizer.param_groups
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    try:  # weights only, every file checked against the manifest (olmo_ds.checkpoint.safe_load)
        with ckpt.safe_engine(engine):
            load_path, _ = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False)
    except ckpt.CheckpointFileError as e:
        raise ConfigError(f"{ckpt_dir}: cannot be loaded: {e}") from None
    if universal:
        engine._config.load_universal_checkpoint = False
        _repair_universal_load(engine, groups, hyper)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load {ckpt_dir}")


def _repair_universal_load(engine, groups: list[dict], hyper: list[dict]) -> None:
    """Undo two slips of DeepSpeed 0.19's ZeRO-3 universal load that would bend the resumed run.

    It copies the first group's hyperparameters onto every group, which would decay the embeddings
    and norms: each group's own (this run's config) are put back. And it gives every parameter's
    Adam state the same `step` tensor, which torch's AdamW increments in place once per parameter,
    so the bias correction would run ahead: each state gets its own copy.
    """
    for g, h in zip(groups, hyper):
        g.update(h)
    for state in engine.optimizer.optimizer.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def init_weights(model, directory: Path, model_cfg: ModelConfig, rank: int, world_size: int) -> str:
    """The weights in `directory` (an `init_from` source) into the (partitioned) model, before DeepSpeed makes its
    fp32 master copies from them; returns their fingerprint. Only rank 0 reads the files; each rank receives only its
    own partitions."""
    state = weights.load_weights(directory).state_dict if rank == 0 else None
    fingerprint = [weights.weights_fingerprint(state) if rank == 0 else None]
    largest = weights.load_weights_into(model, state)
    del state
    received = [None] * world_size
    dist.all_gather_object(received, largest)
    dist.broadcast_object_list(fingerprint, src=0)
    biggest_param = max(math.prod(s) for s in weights.expected_shapes(model_cfg).values())
    log.info("init_from: largest tensor received per rank %s elements (largest parameter %s)", received, f"{biggest_param:,}")
    return fingerprint[0]


def init_record(cfg: InitFromConfig, info: weights.Provenance, fingerprint: str) -> dict:
    """What a checkpoint's train_state.json records of the run's `init_from` source (logged too)."""
    log.info("initialised from %s (%s %s, step %s, %s)%s", cfg.path, info.kind, info.directory, info.step, fingerprint,
             "; optimizer state loaded" if cfg.load_optimizer else "; fresh optimizer, schedule and data position")
    return {"path": cfg.path, "kind": info.kind, "directory": str(info.directory.resolve()), "step": info.step,
            "fingerprint": fingerprint, "load_optimizer": cfg.load_optimizer}
