"""Run by test_in_loop.py under torchrun: the in-loop evaluators on a real DeepSpeed ZeRO-3 engine.

Every parameter is partitioned, so each forward is a collective; the task rows are deliberately
split unevenly across ranks (an odd number of batches for 2 ranks, with either batching), so this
hangs unless every rank runs the same number of forwards.
Rank 0 writes the metrics and the gathered weights for the test to recompute on one process.

    python -m torch.distributed.run --nproc_per_node 2 inloop_worker.py OUT_DIR VAL_SHARDS
"""

import json
import sys
from pathlib import Path

import deepspeed
import torch

from olmo_ds.data.loader import validation_batches
from olmo_ds.eval.multiple_choice import evaluate_tasks, prepare_tasks
from olmo_ds.eval.perplexity import evaluate_perplexity, load_source, token_byte_lengths, window_batches
from olmo_ds.eval.tasks import load_task
from olmo_ds.model import OLMo

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1])]  # eval_testlib, and testdata beside it
from eval_testlib import ARC_EASY, NEOX, tiny_config  # noqa: E402

from olmo_ds.tokenizer import load_tokenizer  # noqa: E402

out_dir, val = Path(sys.argv[1]), sys.argv[2]
torch.set_num_threads(1)
deepspeed.init_distributed(dist_backend="gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
tok = load_tokenizer(NEOX)
ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
      "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=ds):
    model = OLMo(tiny_config(tok.vocab_size, max_seq_len=64))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
engine.train()

table = token_byte_lengths(tok)
prepared = prepare_tasks(tok, [load_task(ARC_EASY)], limit=7)
results = {}
for batching in ("packed", "exact"):
    tasks = evaluate_tasks(engine, tok, prepared, rank, world, max_len=64, batch_tokens=128, batching=batching)
    own = list(validation_batches(val, 32, 2, rank, world))  # this rank's share, as the trainer holds it
    ppl_own = evaluate_perplexity(engine, own, table, split=False, batching=batching)
    ppl_split = evaluate_perplexity(engine, window_batches(load_source(val, tok).tokens, 32, 3), table, batching=batching)
    results[batching] = {"tasks": tasks.tasks, "ppl_own": ppl_own.to_dict(), "ppl_split": ppl_split.to_dict()}
    assert engine.training, "evaluation must give the model back in training mode"

with deepspeed.zero.GatheredParameters(list(model.parameters())):
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
if rank == 0:
    torch.save(weights, out_dir / "weights.pt")
    (out_dir / "metrics.json").write_text(json.dumps({**results, "world": world}))
print(f"INLOOP OK rank {rank}")
