"""DeepSpeed config resolution: "auto" filled from the train config, contradictions named on both sides."""

import json
from pathlib import Path

import pytest

from olmo_ds.train.config import ConfigError, load_config
from olmo_ds.train.ds_config import resolve_ds_config

ROOT = Path(__file__).resolve().parents[2]


def train_config(*overrides):
    return load_config(None, ["data.sources=[{path: x}]", "batch.global_batch_size=32", "batch.micro_batch_size=4",
                              "optim.lr=6e-4", "optim.grad_clip=0.5", *overrides])


@pytest.mark.parametrize("name", ["zero3_bf16", "zero3_bf16_offload", "zero3_fp16", "zero2_bf16", "zero1_bf16"])
def test_shipped_configs_resolve_from_the_train_config(name):
    cfg = train_config(f"deepspeed_config={ROOT / 'ds_configs' / name}.json", "precision=" + ("fp16" if "fp16" in name else "bf16"))
    model = cfg.model.build(vocab_size=1000)
    ds = resolve_ds_config(cfg, model, dp_world_size=2, device="cpu")
    assert "auto" not in json.dumps(ds)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (32, 4, 4)
    assert ds["gradient_clipping"] == 0.5
    assert ds["optimizer"]["params"]["lr"] == 6e-4 and ds["optimizer"]["params"]["betas"] == [0.9, 0.95]
    assert ds["bf16"]["enabled"] == ("bf16" in name) and ds["fp16"]["enabled"] == ("fp16" in name)
    zero = ds["zero_optimization"]
    d = model.d_model
    assert zero["reduce_bucket_size"] == d * d
    if zero["stage"] == 3:
        assert zero["stage3_prefetch_bucket_size"] == int(0.9 * d * d)
        assert zero["stage3_param_persistence_threshold"] == 10 * d
        assert zero["memory_efficient_linear"] is True  # eager blocks (compile auto on CPU): DeepSpeed's default
    else:
        assert not any(k.startswith("stage3_") for k in zero) and "memory_efficient_linear" not in zero


@pytest.mark.parametrize("name", ["zero3_bf16", "zero2_bf16"])
def test_compiled_blocks_take_the_measured_zero3_knobs_unless_the_json_says_otherwise(name):
    """On CUDA `compile: auto` means compiled blocks, and ZeRO-3 then gets the knobs measured with them
    (BENCHMARKS.md); stages 1-2 and eager blocks keep d^2 buckets; a concrete JSON value always wins."""
    cfg = train_config(f"deepspeed_config={ROOT / 'ds_configs' / name}.json")
    model = cfg.model.build(vocab_size=1000)
    d2 = model.d_model ** 2
    zero = resolve_ds_config(cfg, model, 2, device="cuda")["zero_optimization"]
    if zero["stage"] == 3:
        assert (zero["reduce_bucket_size"], zero["memory_efficient_linear"]) == (500_000_000, False)
    else:
        assert zero["reduce_bucket_size"] == d2 and "memory_efficient_linear" not in zero
    eager = train_config(f"deepspeed_config={ROOT / 'ds_configs' / name}.json", "model.compile=eager")
    zero = resolve_ds_config(eager, eager.model.build(vocab_size=1000), 2, device="cuda")["zero_optimization"]
    assert zero["reduce_bucket_size"] == d2 and zero.get("memory_efficient_linear", True) is True
    ds = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
    ds["zero_optimization"].update(reduce_bucket_size=12345, memory_efficient_linear=True)
    zero = resolve_ds_config(cfg, model, 2, ds=ds, device="cuda")["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["memory_efficient_linear"]) == (12345, True)


def test_concrete_value_that_agrees_is_kept_and_one_that_disagrees_names_both(tmp_path):
    ds = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    cfg = train_config()
    model = cfg.model.build(vocab_size=1000)
    ds["train_micro_batch_size_per_gpu"] = 4
    assert resolve_ds_config(cfg, model, 2, ds=ds)["train_micro_batch_size_per_gpu"] == 4
    ds["train_micro_batch_size_per_gpu"] = 8
    with pytest.raises(ConfigError, match=r"train_micro_batch_size_per_gpu = 8 contradicts batch.micro_batch_size = 4"):
        resolve_ds_config(cfg, model, 2, ds=ds)
    ds["train_micro_batch_size_per_gpu"] = "auto"
    ds["bf16"]["enabled"] = True
    with pytest.raises(ConfigError, match=r"bf16.enabled = true contradicts precision = false"):
        resolve_ds_config(train_config("precision=fp32"), model, 2, ds=ds)
    ds["bf16"]["enabled"] = "auto"
    ds["optimizer"]["params"]["lr"] = 1e-3
    with pytest.raises(ConfigError, match=r"optimizer.params.lr = 0.001 contradicts optim.lr = 0.0006"):
        resolve_ds_config(cfg, model, 2, ds=ds)


def test_structural_errors():
    cfg = train_config()
    model = cfg.model.build(vocab_size=1000)
    base = json.loads((ROOT / "ds_configs" / "zero3_bf16.json").read_text())
    with pytest.raises(ConfigError, match=r"global batch size 32 is not divisible by batch.micro_batch_size 4 x data-parallel size 3 = 12"):
        resolve_ds_config(cfg, model, 3, ds=base)
    with pytest.raises(ConfigError, match="scheduler"):
        resolve_ds_config(cfg, model, 2, ds={**base, "scheduler": {"type": "WarmupLR"}})
    with pytest.raises(ConfigError, match=r"no train-config value fills zero_optimization.sub_group_size"):
        resolve_ds_config(cfg, model, 2, ds={**base, "zero_optimization": {**base["zero_optimization"], "sub_group_size": "auto"}})
    with pytest.raises(ConfigError, match="zero_optimization.stage must be 1, 2 or 3"):
        resolve_ds_config(cfg, model, 2, ds={**base, "zero_optimization": {"stage": 0}})
    with pytest.raises(ConfigError, match="nope.json does not exist"):
        resolve_ds_config(train_config("deepspeed_config=nope.json"), model, 2)


def test_batch_size_schedule_starts_small():
    cfg = train_config("batch.schedule=[{step: 0, global_batch_size: 16}, {step: 100, global_batch_size: 32}]")
    ds = resolve_ds_config(cfg, cfg.model.build(vocab_size=1000), 2)
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (16, 2)
