"""Run by test_compile_multirank.py under torchrun: a few real Trainer steps, then one JSON line from rank 0.

    python -m torch.distributed.run --nproc_per_node 2 compile_worker.py RUN.yaml STEPS

The line holds the per-step losses and gradient norms, some logits of a no-grad forward after training, the
log-likelihoods evaluation's packed scoring gives (`score_requests` on the engine), how the block calls ran
(`BLOCK_CALLS`: compiled or eager), how many modules DeepSpeed treats as ZeRO-3 leaves, and the resolved
ZeRO knobs that depend on compiling.
"""

import json
import sys

import torch
from deepspeed.utils import get_z3_leaf_modules

from olmo_ds.eval.loglikelihood import score_requests
from olmo_ds.model.model import BLOCK_CALLS, Block
from olmo_ds.train.config import load_config
from olmo_ds.train.trainer import Trainer

config, steps = sys.argv[1], int(sys.argv[2])
trainer = Trainer.from_config(load_config(config))
metrics = [trainer.train_step(trainer.loader.next_batch()) for _ in range(steps)]
block_calls = dict(BLOCK_CALLS)
with torch.no_grad():  # evaluation runs blocks eagerly; with leaf blocks the block's own hooks gather the weights
    logits = trainer.engine(torch.arange(64).remainder(256).view(2, 32).to(trainer.device))
block_calls_after_eval = dict(BLOCK_CALLS)
# Evaluation's scoring: contexts with two continuations each, packed into rows, through the engine.
g = torch.Generator().manual_seed(0)
requests = [(torch.randint(0, 256, (n,), generator=g).tolist(), torch.randint(0, 256, (k,), generator=g).tolist())
            for n in (5, 9, 14, 20, 7) for k in (1, 4)]
scores = score_requests(trainer.engine, requests, max_len=64, batch_tokens=256)
leaves = get_z3_leaf_modules(trainer.engine.module)
zero = trainer.ds_config["zero_optimization"]
result = {
    "losses": [m["loss"] for m in metrics],
    "grad_norms": [m["grad_norm"] for m in metrics],
    "eval_logits": logits[:, -1, :16].flatten().tolist(),
    "block_calls": block_calls,
    "block_calls_after_eval": block_calls_after_eval,
    "block_calls_after_scoring": dict(BLOCK_CALLS),
    "scores": scores.logprob.tolist(),
    "leaf_blocks": sum(isinstance(m, Block) for m in leaves),
    "leaf_modules": len(leaves),
    "reduce_bucket_size": zero["reduce_bucket_size"],
    "memory_efficient_linear": zero["memory_efficient_linear"],
}
trainer.close()
if trainer.rank == 0:
    print("COMPILE_RESULT " + json.dumps(result), flush=True)
