"""Run by test_sequence_parallel.py under torchrun: real Trainer steps, the first step's full gradients captured.

    python -m torch.distributed.run --nproc_per_node N sp_worker.py RUN.yaml OUT.pt STEPS

The engine's `step` is wrapped so that at the first accumulation boundary, after the last backward and before the
update, every parameter's full gradient is gathered (`deepspeed.utils.safe_get_full_grad`, collective); rank 0
saves them with every step's metrics and the run's layout.
"""

import sys

import torch
from deepspeed.utils import safe_get_full_grad

from olmo_ds.train.config import load_config
from olmo_ds.train.trainer import Trainer

config, out, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
trainer = Trainer.from_config(load_config(config))
engine = trainer.engine
grads: dict = {}
real_step = engine.step


def step(*args, **kwargs):
    if engine.is_gradient_accumulation_boundary() and not grads:
        for name, p in engine.module.named_parameters():
            grads[name] = safe_get_full_grad(p).detach().double().cpu().clone()
    return real_step(*args, **kwargs)


engine.step = step
metrics = [trainer.train_step(trainer.loader.next_batch()) for _ in range(steps)]
trainer.close()
if trainer.rank == 0:
    layout = trainer.layout
    torch.save({"grads": grads, "metrics": metrics, "layout": (layout.dp_size, layout.sp_size)}, out)
