"""Run by test_rl_multirank.py under torchrun: one GRPO step (rollout + update) on a real DeepSpeed ZeRO-3 engine,
the full gradients captured.

    python -m torch.distributed.run --nproc_per_node N rl_grad_worker.py MICRO OUT.pt [SP [BETA [UPDATES]]]

Every rank builds the same tiny OLMo (same seed: ZeRO-3 initialises each weight whole, then partitions it) with the
dolma2 tokenizer's vocabulary, takes its data-parallel rank's share of 4 prompts (SP ranks a row: the ranks of a
sequence group the same prompts, as the loader hands them), and runs `RLObjective.rollout` (the weights gathered
into a plain model, 4 samples a prompt keyed by (step, prompt, sample), rewards, advantages, packing), then the
trainer's micro-batch loop (`begin`, `forward`, `engine.backward`, `engine.step`) once per update (`updates`:
UPDATES is rl.updates_per_rollout, 1 by default). With BETA > 0 the reference is the starting weights plus seeded
noise (the same on every rank), so that the KL term has a gradient. At each update's accumulation boundary, before
the update, every parameter's full gradient is gathered (`safe_get_full_grad`), and after it the whole weights; rank
0 saves them with the step's metrics and every rank's rows and the samples it drew itself.
"""

import sys

import deepspeed
import torch
from deepspeed.utils import safe_get_full_grad

from olmo_ds.model import OLMo
from olmo_ds.model.config import preset
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.train.config import RLConfig
import olmo_ds.train.rl.grpo as grpo
from olmo_ds.train.rl.grpo import RLObjective
from olmo_ds.train.launch import init_distributed
from olmo_ds.train.parallel import ParallelLayout, sequence_group

TOKENIZER = "/work/shared/tokenizers/dolma2-tokenizer.json"
PROMPTS = ["What is 2 + 3?", "Name a colour.", "Count to three:", "The capital of France is"]
SEQ = 64

micro, out = int(sys.argv[1]), sys.argv[2]
sp_size, beta = (int(sys.argv[3]) if len(sys.argv) > 3 else 1), (float(sys.argv[4]) if len(sys.argv) > 4 else 0.0)
updates = int(sys.argv[5]) if len(sys.argv) > 5 else 1
init_distributed()
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
layout = ParallelLayout(world_size=world, sp_size=sp_size, rank=rank)
sp = sequence_group(layout)
tok = load_tokenizer(TOKENIZER)
cfg = preset("tiny", d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, mlp_hidden=64, max_seq_len=SEQ, vocab_size=tok.vocab_size,
             init_std=0.5)  # large weights: peaked distributions, so float rounding of another batch never moves a draw
ds = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
      # several updates: a larger step, so that the second update's ratio moves past the clip
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3 if updates == 1 else 3e-2, "weight_decay": 0.0}}, "gradient_clipping": 0.0}
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=ds):
    model = OLMo(cfg)
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)


def whole_weights() -> dict:
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        return {k: p.detach().clone() for k, p in engine.module.named_parameters()}


start = whole_weights()


def reward(verifier, text, ground_truth):
    """A reward the samples' texts decide (the verifiers are tested on their own): spread within most groups."""
    return float(len(text) % 3 == 0)


# Truncated importance sampling off: its weight exp(old - sampled) carries the decode engine's log-probabilities
# into the gradient, and those are not bit for bit the same across processes on CPU (the same tokens, log-
# probabilities ~1e-7 apart, from MKL's alignment-dependent kernels): ~2e-6 in the gradient, over this test's 1e-6.
# The weight's own exactness is test_grpo_loss.py's. A decode batch holds one prompt's group in every layout.
rl = RLConfig(samples_per_prompt=4, max_new_tokens=8, temperature=1.0, generation_batch_size=4, seed=11, tis_cap=None,
              beta=beta, updates_per_rollout=updates)
reference = None
if beta:
    torch.manual_seed(1)
    reference = OLMo(cfg).eval()
    reference.load_state_dict({k: v + 0.05 * torch.randn_like(v) for k, v in start.items()})
objective = RLObjective(rl, seq_len=SEQ, micro_batch=micro, world_size=world, vocab_size=cfg.vocab_size,
                        device=engine.device, tokenizer=tok, reward_fn=reward, reference=reference, sp=sp)
drawn = []  # (prompt, tokens) of the samples this rank drew itself


def sample_groups(policy, prompts, **kwargs):
    samples = real_sample_groups(policy, prompts, **kwargs)
    drawn.extend((prompts[s.prompt].index, tuple(s.tokens)) for s in samples)
    return samples


real_sample_groups, grpo.sample_groups = grpo.sample_groups, sample_groups
dp_rank, dp_size = layout.dp_rank, layout.dp_size
mine = range(dp_rank * len(PROMPTS) // dp_size, (dp_rank + 1) * len(PROMPTS) // dp_size)
batch = {"prompt_ids": [tok.encode(PROMPTS[i]) for i in mine], "prompt_index": torch.tensor(list(mine)),
         "verifier": ["exact_match"] * len(mine), "ground_truth": ["x"] * len(mine)}
rows = objective.rollout(engine, batch, step=3)
parts = objective.updates(rows)
n_micro = parts[0]["input_ids"].shape[0] // micro
engine.set_train_batch_size(parts[0]["input_ids"].shape[0] * world)
grads: list[dict] = []
after: list[dict] = []
sums = torch.zeros(len(objective.stats), dtype=torch.float64)
for part in parts:
    rows_dev = objective.begin(part, n_micro)
    for i in range(n_micro):
        mb = {k: v[i * micro:(i + 1) * micro] for k, v in rows_dev.items()}
        engine.set_gradient_accumulation_boundary(i == n_micro - 1)
        loss, stats = objective.forward(engine, mb)
        sums += stats
        engine.backward(loss)
        if i == n_micro - 1:
            grads.append({name: safe_get_full_grad(p).detach().double().cpu().clone() for name, p in engine.module.named_parameters()})
        engine.step()
    after.append(whole_weights())
torch.distributed.all_reduce(sums)
metrics = objective.end(sums, n_micro=n_micro * len(parts), world_size=world, tokens=0)
gathered = [None] * world
torch.distributed.all_gather_object(gathered, {"rows": rows, "prompts": list(mine), "drawn": drawn})
if rank == 0:
    torch.save({"start": start, "cfg": cfg, "grads": grads[0], "update_grads": grads, "after": after, "metrics": metrics,
                "ranks": gathered, "n_micro": n_micro}, out)
torch.distributed.barrier()
