"""Run by test_dpo_multirank.py under torchrun: one real Trainer step on preference pairs, the full gradients captured.

    python -m torch.distributed.run --nproc_per_node N dpo_grad_worker.py RUN.yaml OUT.pt

The Trainer runs its reference pass at construction (the engine holds init_from's weights). The engine's `step` is
wrapped so that at the accumulation boundary, after the last backward and before the update, every parameter's full
gradient is gathered (`deepspeed.utils.safe_get_full_grad`, collective); rank 0 saves them with the step's metrics,
the batch it trained on (all ranks' rows, gathered, with each pair's reference) and the reference-pass counter.
"""

import sys

import torch
from deepspeed.utils import safe_get_full_grad

from olmo_ds.train.config import load_config
from olmo_ds.train.reference import REFERENCE_PASSES
from olmo_ds.train.trainer import Trainer

config, out = sys.argv[1], sys.argv[2]
trainer = Trainer.from_config(load_config(config))
engine = trainer.engine
grads: dict = {}
real_step = engine.step


def step(*args, **kwargs):
    if engine.is_gradient_accumulation_boundary():
        for name, p in engine.module.named_parameters():
            grads[name] = safe_get_full_grad(p).detach().double().cpu().clone()
    return real_step(*args, **kwargs)


engine.step = step
batch = trainer.loader.next_batch()
rows = [None] * trainer.world_size
torch.distributed.all_gather_object(rows, {**batch, "reference": trainer.objective.reference.train.lookup(batch["pair_ids"])})
metrics = trainer.train_step(batch)
trainer.close()
if trainer.rank == 0:
    width = {k: max(r[k].shape[1] for r in rows) for k in ("doc_lens", "pair_ids", "reference")}

    def padded(r, k):
        pad = width[k] - r[k].shape[1]
        if not pad:
            return r[k]
        fill = -1 if k == "pair_ids" else 0
        return torch.cat([r[k], torch.full((r[k].shape[0], pad, *r[k].shape[2:]), fill, dtype=r[k].dtype)], dim=1)

    gathered = {k: torch.cat([padded(r, k) if k in width else r[k] for r in rows]) for k in rows[0]}
    torch.save({"grads": grads, "metrics": metrics, "batch": gathered, "passes": dict(REFERENCE_PASSES)}, out)
