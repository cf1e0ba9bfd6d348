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


@pytest.mark.parametrize("name", ["zero3_bf16", "zero3_bf16_offload", "zero2_bf16"])
def test_one_rank_zero3_skips_the_reduce_scatter_path_and_the_throughput_timer(name):
    """ZeRO-3 on a single data-parallel rank takes DeepSpeed's all-reduce gradient path (no concatenated
    copy of each bucket; nothing is communicated either way); with more ranks, or stages 1-2, the
    reduce-scatter stays. DeepSpeed's synchronizing throughput timer is off unless the JSON has one."""
    cfg = train_config(f"deepspeed_config={ROOT / 'ds_configs' / name}.json")
    model = cfg.model.build(vocab_size=1000)
    resolve = lambda ranks, ds=None: resolve_ds_config(  # noqa: E731
        cfg, model, ranks, ds=ds, device="cpu", offload_env=dict(host_available=10**12, ranks=ranks, gpu_bytes=None))
    one, two = resolve(1), resolve(2)
    stage3 = one["zero_optimization"]["stage"] == 3
    assert one["zero_optimization"]["reduce_scatter"] is (not stage3)
    assert two["zero_optimization"]["reduce_scatter"] is True
    assert one["timers"] == two["timers"] == {"throughput": {"enabled": False}}
    ds = json.loads((ROOT / "ds_configs" / f"{name}.json").read_text())
    ds["zero_optimization"]["reduce_scatter"] = True
    ds["timers"] = {"throughput": {"enabled": True, "synchronized": False}}
    kept = resolve(1, ds)
    assert kept["zero_optimization"]["reduce_scatter"] is True and kept["timers"] == ds["timers"]


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
    fp32 = train_config("precision=fp32")
    with pytest.raises(ConfigError) as refused:
        resolve_ds_config(fp32, model, 2, ds=ds)
    # The JSON file, its key and value, and the train config's own value of `precision` (issue 35: "precision = false").
    assert str(refused.value) == (f"{fp32.deepspeed_config}: bf16.enabled = true contradicts precision = \"fp32\" in {fp32.source} "
                                  f"(which means bf16.enabled = false); set bf16.enabled to \"auto\" so the train config decides")
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
    with pytest.raises(ConfigError, match=r"data_parallel_size = 4: the data-parallel size is the launch's ranks over "
                                          r"parallel.sequence_parallel_size"):
        resolve_ds_config(cfg, model, 2, ds={**base, "data_parallel_size": 4})
    contradicted = train_config("parallel.sequence_parallel_size=2")
    with pytest.raises(ConfigError, match=r"sequence_parallel_size = 4 contradicts parallel.sequence_parallel_size = 2"):
        resolve_ds_config(contradicted, model, 2, ds={**base, "sequence_parallel_size": 4})
    with pytest.raises(ConfigError, match=r"no train-config value fills zero_optimization.stage3_max_live_parameters"):
        resolve_ds_config(cfg, model, 2, ds={**base, "zero_optimization": {**base["zero_optimization"], "stage3_max_live_parameters": "auto"}})
    with pytest.raises(ConfigError, match="zero_optimization.stage must be 1, 2 or 3"):
        resolve_ds_config(cfg, model, 2, ds={**base, "zero_optimization": {"stage": 0}})
    with pytest.raises(ConfigError, match="nope.json does not exist"):
        resolve_ds_config(train_config("deepspeed_config=nope.json"), model, 2)


def test_batch_size_schedule_starts_small():
    cfg = train_config("batch.schedule=[{step: 0, global_batch_size: 16}, {step: 100, global_batch_size: 32}]")
    ds = resolve_ds_config(cfg, cfg.model.build(vocab_size=1000), 2)
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (16, 2)


# --- CPU offload sized to the node (olmo_ds/train/offload.py) ------------------------------------

OFFLOAD = ROOT / "ds_configs" / "zero3_bf16_offload.json"


def offload_run(preset="olmo2-7b", *overrides):
    cfg = train_config(f"deepspeed_config={OFFLOAD}", f"model.preset={preset}", "precision=bf16", "batch.global_batch_size=8",
                       "batch.micro_batch_size=2", *overrides)
    return cfg, cfg.model.build(vocab_size=100_278)


def test_offload_on_one_h200_keeps_weights_on_the_gpu_and_sizes_the_host_share():
    """olmo2-7b on one H200 (139 GiB): with everything on the host it was OOM-killed (BENCHMARKS.md)."""
    from olmo_ds.train.offload import GiB, HOST_FRACTION, OFFLOAD_SUB_GROUP, sub_group_numels

    cfg, model = offload_run()
    machine = dict(host_available=110 * GiB, ranks=1, gpu_bytes=139 * GiB)
    ds = resolve_ds_config(cfg, model, 1, device="cuda", offload_env=machine)
    zero = ds["zero_optimization"]
    assert zero["offload_param"]["device"] == "none" and zero["sub_group_size"] == OFFLOAD_SUB_GROUP
    ratio = zero["offload_optimizer"]["ratio"]
    subs = [n for group in sub_group_numels(model, cfg, 1, OFFLOAD_SUB_GROUP) for n in group]
    assert sum(subs) == model.num_params() and len(subs) > 50
    host = subs[int((1 - ratio) * len(subs)):]  # DeepSpeed's own split (stage3.py _create_fp32_partitions)
    pow2 = lambda n: 1 << (n - 1).bit_length()  # pinned blocks are rounded up to a power of two  # noqa: E731
    grads = pow2(2 * sum(subs))  # bf16 gradient partitions, one flat pinned buffer
    host_bytes = lambda subgroups: sum(12 * n + pow2(4 * n) for n in subgroups)  # state + kept fp32 grad  # noqa: E731
    assert 0.4 < ratio < 0.9 and 4 * GiB + grads + host_bytes(host) <= HOST_FRACTION * 110 * GiB
    # One more sub-group on the host would not fit.
    assert 4 * GiB + grads + host_bytes(subs[-len(host) - 1:]) > HOST_FRACTION * 110 * GiB

    # A GPU too small for the weights sends them to the host too, which leaves less room for optimizer state.
    small = resolve_ds_config(cfg, model, 1, device="cuda", offload_env={**machine, "gpu_bytes": 40 * GiB})["zero_optimization"]
    assert small["offload_param"]["device"] == "cpu" and small["offload_optimizer"]["ratio"] < ratio
    # A host with room for everything gets ratio 1.0: DeepSpeed's plain full offload.
    big = resolve_ds_config(cfg, model, 1, device="cuda", offload_env={**machine, "host_available": 400 * GiB})["zero_optimization"]
    assert big["offload_optimizer"]["ratio"] == 1.0


def test_offload_that_cannot_fit_fails_before_training_with_the_numbers():
    cfg, model = offload_run()
    ds = json.loads(OFFLOAD.read_text())
    ds["zero_optimization"]["offload_optimizer"]["ratio"] = 1.0
    ds["zero_optimization"]["offload_param"]["device"] = "cpu"
    with pytest.raises(ConfigError, match=r"zero3_bf16_offload.json: CPU offload would not fit this node's memory: "
                                          r"optimizer state on the host: ratio 1.000; host memory per rank .* GiB .* of 106.2 GiB "
                                          r"\(85% of 125.0 GiB available\)"):
        resolve_ds_config(cfg, model, 1, ds=ds, device="cuda", offload_env=dict(host_available=125 * 2**30, ranks=1, gpu_bytes=None))
    with pytest.raises(ConfigError, match=r"does not fit this node's memory even with one optimizer sub-group on the host"):
        resolve_ds_config(cfg, model, 1, device="cuda", offload_env=dict(host_available=8 * 2**30, ranks=8, gpu_bytes=139 * 2**30))


def test_offload_on_the_cpu_accelerator_keeps_the_json_intent():
    """Tiny model, CPU device: weights and all optimizer state on the host, as the CI runs exercise."""
    cfg, model = offload_run("tiny")
    zero = resolve_ds_config(cfg, model, 2, device="cpu")["zero_optimization"]
    assert zero["offload_param"]["device"] == "cpu" and zero["offload_optimizer"]["ratio"] == 1.0
    plain = resolve_ds_config(train_config(f"deepspeed_config={ROOT / 'ds_configs' / 'zero3_bf16.json'}"), model, 2, device="cpu")
    assert "sub_group_size" not in plain["zero_optimization"] and "offload_optimizer" not in plain["zero_optimization"]


def test_a_resumed_run_keeps_the_checkpoints_offload_choices():
    """The saved config's ratio, placement and sub-group size win over "auto", and are still checked."""
    cfg, model = offload_run()
    machine = dict(host_available=110 * 2**30, ranks=1, gpu_bytes=139 * 2**30)
    first = resolve_ds_config(cfg, model, 1, device="cuda", offload_env=machine)
    saved = json.loads(json.dumps(first))
    saved["zero_optimization"]["offload_optimizer"]["ratio"] = 0.5  # chosen on a host with less memory free
    again = resolve_ds_config(cfg, model, 1, device="cuda", offload_env={**machine, "host_available": 400 * 2**30}, resumed=saved)
    zero = again["zero_optimization"]
    assert zero["offload_optimizer"]["ratio"] == 0.5 and zero["offload_param"]["device"] == "none"
    assert zero["sub_group_size"] == first["zero_optimization"]["sub_group_size"]
    with pytest.raises(ConfigError, match="would not fit"):  # kept, but not blindly: a smaller host is refused
        resolve_ds_config(cfg, model, 1, device="cuda", offload_env={**machine, "host_available": 60 * 2**30}, resumed=saved)


def test_deepspeed_overrides_edit_the_json_as_it_is_read_and_the_train_configs_fields_still_win():
    cfg = train_config("deepspeed_overrides=[zero_optimization.reduce_bucket_size=12345, optimizer.params.torch_adam=true]")
    model = cfg.model.build(vocab_size=1000)
    ds = resolve_ds_config(cfg, model, 2, device="cpu")
    assert ds["zero_optimization"]["reduce_bucket_size"] == 12345 and ds["optimizer"]["params"]["torch_adam"] is True
    with pytest.raises(ConfigError, match=r"optimizer.params.lr = 0.1 contradicts optim.lr"):
        resolve_ds_config(train_config("deepspeed_overrides=[optimizer.params.lr=0.1]"), model, 2, device="cpu")
    with pytest.raises(ConfigError, match=r"deepspeed_overrides: .*expected KEY=VALUE"):
        resolve_ds_config(train_config("deepspeed_overrides=[reduce_bucket_size]"), model, 2, device="cpu")
