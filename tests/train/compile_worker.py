"""Run by test_compile_multirank.py under torchrun: a few real Trainer steps, then one JSON line from rank 0.

    python -m torch.distributed.run --nproc_per_node 2 compile_worker.py RUN.yaml STEPS

The line holds the per-step losses and gradient norms, some logits of a no-grad forward after training, how the block calls ran (`BLOCK_CALLS`: compiled or eager), how
many modules DeepSpeed treats as ZeRO-3 leaves, and the resolved ZeRO knobs that depend on compiling.
"""

import json
import sys

import torch
from deepspeed.utils import get_z3_leaf_modules

from olmo_ds.model.model import BLOCK_CALLS, Block
from olmo_ds.train.config import load_config
from olmo_ds.train.trainer import Trainer

config, steps = sys.argv[1], int(sys.argv[2])
trainer = Trainer(load_config(config))
metrics = [trainer.train_step(trainer.loader.next_batch()) for _ in range(steps)]
block_calls = dict(BLOCK_CALLS)
with torch.no_grad():  # evaluation runs blocks eagerly; with leaf blocks the block's own hooks gather the weights
    logits = trainer.engine(torch.arange(64).remainder(256).view(2, 32).to(trainer.device))
leaves = get_z3_leaf_modules(trainer.engine.module)
zero = trainer.ds_config["zero_optimization"]
result = {
    "losses": [m["loss"] for m in metrics],
    "grad_norms": [m["grad_norm"] for m in metrics],
    "eval_logits": logits[:, -1, :16].flatten().tolist(),
    "block_calls": block_calls,
    "block_calls_after_eval": dict(BLOCK_CALLS),
    "leaf_blocks": sum(isinstance(m, Block) for m in leaves),
    "leaf_modules": len(leaves),
    "reduce_bucket_size": zero["reduce_bucket_size"],
    "memory_efficient_linear": zero["memory_efficient_linear"],
}
trainer.close()
if trainer.rank == 0:
    print("COMPILE_RESULT " + json.dumps(result), flush=True)
