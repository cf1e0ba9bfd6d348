"""AdamW parameter groups: weight decay on the matrices, none on embeddings and norms (OLMo 2's recipe).

Groups are chosen by module type, not by tensor rank, because under ZeRO-3 every parameter is a
flattened partition whose `.shape` no longer tells a matrix from a vector. DeepSpeed builds the
optimizer itself from the config (FusedAdam on GPU, its CPU Adam when offloading) and honours a
group's own `weight_decay`.
"""

from __future__ import annotations

import torch
from torch import nn

from olmo_ds.train.config import OptimConfig


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith("Norm")


def param_groups(model: nn.Module, cfg: OptimConfig) -> list[dict]:
    """[{"params": decayed, ...}, {"params": not decayed, "weight_decay": 0.0}] (empty groups dropped)."""
    no_decay: set[int] = set()
    for module in model.modules():
        if isinstance(module, nn.Embedding) and not cfg.decay_embeddings:
            no_decay |= {id(p) for p in module.parameters(recurse=False)}
        elif _is_norm(module) and not cfg.decay_norms:
            no_decay |= {id(p) for p in module.parameters(recurse=False)}
    decay, plain = [], []
    for _, p in model.named_parameters():  # named_parameters de-duplicates tied weights
        if p.requires_grad:
            (plain if id(p) in no_decay else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay, "name": "decay"},
              {"params": plain, "weight_decay": 0.0, "name": "no_decay"}]
    return [g for g in groups if g["params"]]


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
