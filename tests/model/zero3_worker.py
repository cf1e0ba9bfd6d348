"""Run by test_zero3.py in its own process: the model under real DeepSpeed ZeRO-3 (one CPU rank, gloo).

Checks, in order: weights initialised inside `deepspeed.zero.Init` (truncated normal, norms one);
other weights loaded into the partitioned model (`load_weights_into`, a scatter of partitions); loss and every full gradient equal a plain-PyTorch copy of the same weights, with activation
checkpointing on under ZeRO-3 and off in the copy; then one optimizer step and a real checkpoint
through olmo_ds.checkpoint.save_checkpoint, whose weights are also saved for the test to
compare the export against.

    python zero3_worker.py OUT_DIR TOKENIZER_JSON PORT
"""

import dataclasses
import os
import sys
from pathlib import Path

import torch

out_dir, tokenizer, port = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")

import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402

from olmo_ds.model import ModelConfig, OLMo  # noqa: E402
from olmo_ds.weights import load_weights_into  # noqa: E402
from olmo_ds.checkpoint import save_checkpoint  # noqa: E402

cfg = ModelConfig(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden=96, vocab_size=100278, max_seq_len=64,
                  sliding_window=8, sliding_window_pattern=[True, False], activation_checkpointing=True)
ds = {
    "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
    # Persistence threshold 0: every parameter is partitioned, so each one must be gathered by its own module.
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
with deepspeed.zero.Init(config_dict_or_path=ds):
    model = OLMo(cfg)
assert model.head.weight.numel() == 0, "zero.Init did not partition the head"

with deepspeed.zero.GatheredParameters(list(model.parameters())):
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
for name, w in weights.items():
    if name.endswith("norm.weight"):
        assert torch.equal(w, torch.ones_like(w)), name
    else:
        assert w.abs().max() <= 0.06 + 1e-7, f"{name} not truncated at 3 std: {w.abs().max()}"
        assert abs(w.std().item() - 0.01973) < 0.0015, f"{name} std {w.std().item()}"  # 0.02 * 0.9866 (truncation)

# Starting from other weights (as from scripts/import_hf.py) must reach every partition.
torch.manual_seed(1)
reference = OLMo(dataclasses.replace(cfg, activation_checkpointing=False))
load_weights_into(model, reference.state_dict())
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    for name, value in model.state_dict().items():
        assert torch.equal(value, reference.state_dict()[name]), f"{name} was not loaded"
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)
doc_lens = torch.tensor([[15, 25], [40, 0]], dtype=torch.int32)

out = engine(ids, labels=labels, doc_lens=doc_lens, z_loss_coef=1e-4)
engine.backward(out.loss)
expected = reference(ids, labels=labels, doc_lens=doc_lens, z_loss_coef=1e-4)
expected.loss.backward()
torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
ref_params = dict(reference.named_parameters())
for name, p in model.named_parameters():
    torch.testing.assert_close(safe_get_full_grad(p), ref_params[name].grad, rtol=1e-4, atol=1e-7, msg=name)
engine.step()

# A blocking save puts DeepSpeed's files on disk (fsync, not only the page cache) before train_state.json
# makes the checkpoint complete: every fsync of the save is recorded by the path it reached.
fsynced, real_fsync = [], os.fsync
os.fsync = lambda fd: (fsynced.append(os.readlink(f"/proc/self/fd/{fd}")), real_fsync(fd))[1]
try:
    ckpt = save_checkpoint(engine, out_dir / "run", 1, {"model": cfg.to_dict()}, rank=0, tokenizer_path=tokenizer)
finally:
    os.fsync = real_fsync
state_at = fsynced.index(str(ckpt / "train_state.json.tmp"))
written_by_deepspeed = sorted(str(p) for p in ckpt.glob("*_states.pt"))
assert written_by_deepspeed and all(p in fsynced[:state_at] for p in written_by_deepspeed), (written_by_deepspeed, fsynced)
assert str(ckpt) in fsynced[:state_at], fsynced
with deepspeed.zero.GatheredParameters(list(model.parameters())):
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out_dir / "weights.pt")
print(f"ZERO3 OK {ckpt}")
