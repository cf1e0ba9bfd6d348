"""Run by test_sft_multirank.py under torchrun: one real Trainer step on masked data, the full gradients captured.

    python -m torch.distributed.run --nproc_per_node N sft_grad_worker.py RUN.yaml OUT.pt

The engine's `step` is wrapped so that at the accumulation boundary, after the last backward and before the
update, every parameter's full gradient is gathered (`deepspeed.utils.safe_get_full_grad`, collective); rank 0
saves them with the step's metrics and the batch it trained on (all ranks' rows, gathered).
"""

import sys

import torch
from deepspeed.utils import safe_get_full_grad

from olmo_ds.train.config import load_config
from olmo_ds.train.trainer import Trainer

config, out = sys.argv[1], sys.argv[2]
trainer = Trainer.from_config(load_config(config))
engine = trainer.engine
grads: dict = {}
real_step = engine.step


def step(*args, **kwargs):
    if engine.is_gradient_accumulation_boundary():
        for name, p in engine.module.named_parameters():
            g = safe_get_full_grad(p)
            grads[name] = g.detach().double().cpu().clone()
    return real_step(*args, **kwargs)


engine.step = step
batch = trainer.loader.next_batch()
# The reference loss: this rank's summed cross-entropy (divisor 1) in one no-grad forward, summed over ranks,
# over the global target count: the step's token mean, independent of the trainer's bookkeeping.
with torch.no_grad():
    dev = {k: v.to(trainer.device) for k, v in batch.items()}
    summed = engine(dev["input_ids"], labels=dev["labels"], doc_lens=dev["doc_lens"], positions=dev["positions"], loss_divisor=1.0).ce_loss
    ref = torch.stack([summed.double(), (dev["labels"] != -100).sum().double()])
    torch.distributed.all_reduce(ref)
metrics = trainer.train_step(batch)
metrics["reference_loss"] = float(ref[0] / ref[1])
rows = [None] * trainer.world_size
torch.distributed.all_gather_object(rows, {k: v.clone() for k, v in batch.items()})
trainer.close()
if trainer.rank == 0:
    torch.save({"grads": grads, "metrics": metrics, "batch": {k: torch.cat([r[k] for r in rows]) for k in ("input_ids", "labels")}}, out)
