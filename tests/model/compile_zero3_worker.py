"""Run by test_compile_zero3.py in its own process: compiled blocks under real DeepSpeed ZeRO-3 (one CPU rank, gloo),
16 layers, at rows of several shapes, against a plain-PyTorch copy of the same weights with eager blocks.

    python compile_zero3_worker.py PORT

The engine is set up as the RL benchmark's was when its blocks fell back to eager on a GPU: DeepSpeed's default
`memory_efficient_linear` (zero.Init replaces `torch.nn.functional.linear` process-wide), every parameter partitioned
(persistence threshold 0), blocks made ZeRO-3 leaves as the trainer does. Each shape runs a training forward and
backward of packed rows (documents and positions, as RL's and DPO's rows are) and a no-grad per-document forward
(DPO's reference pass, the compiled scoring function). Prints one JSON line: how many graphs each compiled function
holds, how the block calls ran, the largest loss, gradient and log-probability differences to the copy, and whether
a block of another partitioned model takes the compiled path (a leaf or not, its weights gathered or not).
"""

import dataclasses
import json
import os
import sys

port = sys.argv[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: E402

from olmo_ds.model import ModelConfig, OLMo  # noqa: E402
from olmo_ds.model.attention import AttentionMask  # noqa: E402
from olmo_ds.model.model import BLOCK_CALLS, _scoring_block_math, block_math, make_blocks_zero3_leaves  # noqa: E402

# Rows x length of each micro-batch: the first shape, a batch of one, then two more shapes that a recompile per shape
# would each compile again.
SHAPES = [(2, 32), (1, 48), (3, 24), (4, 16)]
cfg = ModelConfig(d_model=32, n_layers=16, n_heads=2, n_kv_heads=1, mlp_hidden=64, vocab_size=256, max_seq_len=64,
                  compile="blocks")
ds = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
    # lr 0: the optimizer steps (which clear the gradients) leave the weights as the copy has them
    "optimizer": {"type": "AdamW", "params": {"lr": 0.0, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "memory_efficient_linear": True},
}
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=ds):
    model = OLMo(cfg)
# The compiled path takes ZeRO-3 weights only in a leaf block, gathered: elsewhere its backward could find them released.
with deepspeed.zero.Init(config_dict_or_path=ds):
    other = OLMo(cfg)
x = torch.zeros(2, 32, cfg.d_model)
mask = AttentionMask(2, 32, x.device)
with deepspeed.zero.GatheredParameters(list(other.parameters())):
    routes = {"not_leaf": other.blocks[0]._compiled_attention(x, mask, None) is not None}
    make_blocks_zero3_leaves(other)
    routes["leaf"] = other.blocks[0]._compiled_attention(x, mask, None) is not None
routes["leaf_released"] = other.blocks[0]._compiled_attention(x, mask, None) is not None
make_blocks_zero3_leaves(model)
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    plain = OLMo(dataclasses.replace(cfg, compile="eager"))
    plain.load_state_dict(model.state_dict())
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
linear_replaced = torch.nn.functional.linear is not torch._C._nn.linear

g = torch.Generator().manual_seed(1)
loss_diff = grad_diff = logprob_diff = 0.0
for b, t in SHAPES:
    ids = torch.randint(0, cfg.vocab_size, (b, t), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], dim=1)
    first = int(torch.randint(1, t, (), generator=g))
    doc_lens = torch.tensor([[first, t - first]] * b, dtype=torch.int32)
    positions = torch.cat([torch.arange(first), torch.arange(t - first)]).expand(b, t)
    kwargs = dict(labels=labels, doc_lens=doc_lens, positions=positions)

    out = engine(ids, **kwargs)
    engine.backward(out.loss)
    plain.zero_grad()
    expected = plain(ids, **kwargs)
    expected.loss.backward()
    loss_diff = max(loss_diff, (out.loss - expected.loss).abs().item())
    for name, p in dict(model.named_parameters()).items():
        want = dict(plain.named_parameters())[name].grad
        grad_diff = max(grad_diff, ((safe_get_full_grad(p) - want).abs().max() / want.abs().max()).item())
    engine.step()

    with torch.no_grad():
        got = engine(ids, per_document=True, **kwargs)
        want = plain(ids, per_document=True, **kwargs)
    logprob_diff = max(logprob_diff, (got.logprob - want.logprob).abs().max().item())

result = {
    "linear_replaced": linear_replaced,
    "routes": routes,
    "training_graphs": len(_debug_get_cache_entry_list(block_math.__code__)),
    "scoring_graphs": len(_debug_get_cache_entry_list(_scoring_block_math.__code__)),
    "block_calls": dict(BLOCK_CALLS),
    "loss_diff": loss_diff, "grad_diff": grad_diff, "logprob_diff": logprob_diff,
}
print("COMPILE_ZERO3 " + json.dumps(result), flush=True)
