"""Resolve a DeepSpeed JSON config against the train config: one source of truth for every number.

The files in `ds_configs/` say *how* to train (ZeRO stage, offload, communication knobs); the train
config says *what* (batch sizes, precision, clipping, optimizer hyper-parameters). Fields owned by the
train config are `"auto"` in the JSON and are filled here; a concrete value that agrees is accepted, one
that disagrees is an error naming both places, because DeepSpeed would otherwise silently train with
a batch size or precision the user did not ask for.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmo_ds.model.config import ModelConfig
from olmo_ds.train.config import ConfigError, TrainConfig, apply_override
from olmo_ds.train.offload import DEFAULT_SUB_GROUP, OFFLOAD_SUB_GROUP, HostPlan, param_device, plan_host

log = logging.getLogger("olmo_ds")

AUTO = "auto"


SHIPPED_DIR = Path(__file__).resolve().parent / "ds_configs"  # package data; `ds_configs/` in a clone links here


def find_ds_config(path: str | Path, config_file: str | Path | None = None) -> Path:
    """The DeepSpeed JSON that `deepspeed_config: PATH` names: PATH itself (absolute, or relative to the
    working directory), else relative to the train config file, else one of the configs shipped with the
    package when PATH is `ds_configs/NAME.json` or `NAME.json` — so the defaults work from an installed
    package and from any directory, while a file of the user's own always wins."""
    path = Path(path)
    tried = [path]
    if path.is_file():
        return path
    if config_file is not None and not path.is_absolute():
        beside = Path(config_file).parent / path
        tried.append(beside)
        if beside.is_file():
            return beside
    if not path.is_absolute() and path.parent in (Path("."), Path("ds_configs")):
        shipped = SHIPPED_DIR / path.name
        tried.append(shipped)
        if shipped.is_file():
            return shipped
    names = ", ".join(sorted(p.name for p in SHIPPED_DIR.glob("*.json")))
    raise ConfigError(f"DeepSpeed config {path} does not exist (train config key deepspeed_config); looked at "
                      f"{', '.join(map(str, tried))}. Shipped configs: ds_configs/ + one of {names}")


def load_ds_json(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"DeepSpeed config {path} does not exist (train config key deepspeed_config)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{e.lineno}: not valid JSON: {e.msg}") from None


# Reduce bucket for ZeRO-3 with compiled blocks: DeepSpeed's own default, 5e8 elements. Measured on
# one H200 (olmo2-1b, BENCHMARKS.md): +6.1% over d^2 with compiled blocks; no change with eager blocks,
# so eager runs keep d^2.
COMPILED_REDUCE_BUCKET = 500_000_000


def zero3_knobs(d_model: int, stage: int, compiled_blocks: bool, dp_world_size: int) -> dict[str, Any]:
    """ZeRO communication knobs for "auto" fields: the values HF Accelerate/Trainer derive from the hidden
    size, except where a measurement with compiled blocks said otherwise.

    Buckets of d^2 elements keep all-gathers/reduce-scatters large enough to saturate the link yet
    small enough to overlap with compute; parameters below 10*d elements (norm weights, biases) stay
    resident on every rank because gathering them costs more latency than their memory is worth.
    With ZeRO-3 and compiled blocks (`ModelConfig.compiles_blocks`), the reduce bucket is
    `COMPILED_REDUCE_BUCKET` and `memory_efficient_linear` is false: zero.Init otherwise replaces
    `torch.nn.functional.linear` process-wide with DeepSpeed's own autograd function, which a compiled
    block cannot fuse through (measured +22% tokens/s and 8 GiB less peak memory without it; with eager
    blocks it changed nothing, so eager runs keep DeepSpeed's default, true).

    `reduce_scatter` is false for ZeRO-3 on a single data-parallel rank, where there is nothing to
    communicate: DeepSpeed's reduce-scatter path then still concatenates each reduce bucket into a new
    tensor and runs it through a one-rank collective, once per micro-batch, where the all-reduce path
    works in the contiguous bucket it already has. The gradients are the same bit for bit; on one H200
    the difference was within noise (+0.3%, BENCHMARKS.md). With more ranks the reduce-scatter moves
    half the bytes, so it stays on.
    """
    compiled3 = compiled_blocks and stage == 3
    return {
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": not (stage == 3 and dp_world_size == 1),
        "reduce_bucket_size": COMPILED_REDUCE_BUCKET if compiled3 else d_model * d_model,
        "stage3_prefetch_bucket_size": int(0.9 * d_model * d_model),
        "stage3_param_persistence_threshold": 10 * d_model,
        "memory_efficient_linear": not compiled3,
    }


# Knobs that exist only for ZeRO-3 (zero.Init and parameter partitioning); an "auto" one in a stage 1/2 JSON is dropped.
_STAGE3_ONLY = ("stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "memory_efficient_linear")


def device_type() -> str:
    """The device type the run trains on ("cuda", "cpu", ...): DeepSpeed's accelerator, as the engine uses."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def check_batch_divisible(cfg: TrainConfig, dp_world_size: int) -> None:
    """Every global batch size of the run splits into whole micro-batches on every rank (with
    `micro_batch_size: auto`, into whole rows per rank: the micro-batch chosen later divides those).

    RL (`rl:`) counts its global batch in prompts and its micro-batch in packed rows of samples: each rank takes
    global / data-parallel prompts, and its rollout pads the rows it packs to whole micro-batches
    (`olmo_ds.train.rl.grpo`), so only the prompts must split over the ranks, each rank with at least one prompt
    for every one of `rl.updates_per_rollout` updates (an update of none would step the optimizer on no data)."""
    b = cfg.batch
    for size in sorted({size for _, size in b.size_schedule().points}):
        if cfg.rl is not None:
            if size % dp_world_size:
                raise ConfigError(f"{cfg.source}: global batch size {size} (RL: prompts a step) is not divisible by the "
                                  f"data-parallel size {dp_world_size}: each rank takes global / {dp_world_size} prompts")
            updates = cfg.rl.updates_per_rollout
            if size // dp_world_size < updates:
                raise ConfigError(f"{cfg.source}: rl.updates_per_rollout {updates} exceeds the {size // dp_world_size} prompts "
                                  f"each of the {dp_world_size} data-parallel ranks takes at global batch size {size}: every "
                                  f"update trains its share of each rank's prompts, so some would train none; lower "
                                  f"rl.updates_per_rollout or raise the global batch to {updates * dp_world_size}")
            continue
        if b.micro_batch_size == AUTO:
            if size % dp_world_size:
                raise ConfigError(f"{cfg.source}: global batch size {size} is not divisible by the data-parallel size "
                                  f"{dp_world_size} (batch.micro_batch_size auto needs whole sequences on every rank)")
            continue
        if size % (b.micro_batch_size * dp_world_size):
            raise ConfigError(
                f"{cfg.source}: global batch size {size} is not divisible by batch.micro_batch_size "
                f"{b.micro_batch_size} x data-parallel size {dp_world_size} = {b.micro_batch_size * dp_world_size}"
            )


class _Resolver:
    def __init__(self, ds: dict, ds_path: str, cfg: TrainConfig):
        self.ds = ds
        self.ds_path = ds_path
        self.cfg = cfg

    def fill(self, node: dict, key: str, value: Any, train_key: str, dotted: str | None = None, *,
             train_value: Any = None) -> None:
        """Set node[key] to `value` if "auto" or absent; else require that it equals `value`. `train_value`: what
        the train config says, when that is not `value` itself (`precision: fp32` means `bf16.enabled: false`)."""
        dotted = dotted or key
        current = node.get(key, AUTO)
        if current == AUTO:
            node[key] = value
            return
        same = current == value
        if isinstance(value, (list, tuple)) and isinstance(current, (list, tuple)):
            same = list(current) == list(value)
        if not same:
            means = "" if train_value is None else f" (which means {dotted} = {json.dumps(value)})"
            shown = value if train_value is None else train_value
            raise ConfigError(
                f"{self.ds_path}: {dotted} = {json.dumps(current)} contradicts {train_key} = {json.dumps(shown)} "
                f"in {self.cfg.source}{means}; set {dotted} to \"auto\" so the train config decides"
            )


@dataclass(frozen=True)
class ZeroLayout:
    """Where a resolved DeepSpeed config puts the model state, read from its `zero_optimization` section here
    and nowhere else: the micro-batch estimate, the resume checks, the optimizer choice and the tools use this."""

    stage: int | None
    reduce_bucket_size: int | None
    optimizer_offloaded: bool  # offload_optimizer.device is "cpu" or "nvme"
    optimizer_on_host: float  # the share of the optimizer state on the host: offload_optimizer.ratio, 0.0 without offload
    params_on_host: bool  # offload_param.device is "cpu" or "nvme"

    @classmethod
    def of(cls, ds: dict) -> ZeroLayout:
        """The layout of `ds`, a resolved config (the run's, or one a checkpoint saved; missing sections read as none)."""
        zero = ds.get("zero_optimization") or {}
        optimizer, params = zero.get("offload_optimizer") or {}, zero.get("offload_param") or {}
        offloaded = optimizer.get("device", "none") not in ("none", None)
        bucket = zero.get("reduce_bucket_size")
        return cls(stage=zero.get("stage"), reduce_bucket_size=int(bucket) if bucket is not None else None, optimizer_offloaded=offloaded,
                   optimizer_on_host=float(optimizer.get("ratio", 1.0)) if offloaded else 0.0,
                   params_on_host=params.get("device", "none") not in ("none", None))

    @property
    def offloaded(self) -> bool:
        return self.optimizer_offloaded or self.params_on_host


def optimizer_op(ds: dict, zero: ZeroLayout) -> str | None:
    """The DeepSpeed op builder `deepspeed.initialize` runs for the optimizer of `ds`, a resolved config whose ZeRO
    layout is `zero`: CPU Adam with optimizer offload, FusedAdam for (Adam)W otherwise, none with torch's AdamW
    (`optimizer.params.torch_adam`); what the launch announces before it compiles (`launch.announce_op_builds`)."""
    if zero.optimizer_offloaded:
        return "CPUAdamBuilder"
    optimizer = ds.get("optimizer") or {}
    if str(optimizer.get("type", "")).lower() in ("adam", "adamw") and not (optimizer.get("params") or {}).get("torch_adam"):
        return "FusedAdamBuilder"
    return None


def read_ds_config(cfg: TrainConfig, ds: dict | None = None) -> dict:
    """The run's DeepSpeed JSON (`ds` instead, for tests), copied, with what the train config owns refused:
    a learning-rate scheduler, and a concrete micro-batch or accumulation while the micro-batch is `auto`."""
    ds_path = cfg.deepspeed_config
    ds = copy.deepcopy(ds if ds is not None else load_ds_json(find_ds_config(ds_path, cfg.path)))
    for assignment in cfg.deepspeed_overrides:
        try:
            apply_override(ds, assignment)
        except ConfigError as e:
            raise ConfigError(f"{cfg.source}: deepspeed_overrides: {e}") from None
    if "scheduler" in ds:
        raise ConfigError(
            f"{ds_path}: has a \"scheduler\" section; the learning-rate schedule lives in the train config "
            f"(schedule: kind, warmup_steps, ...). Remove it from the JSON."
        )
    if "data_parallel_size" in ds:
        # With `sequence_parallel_size` beside it, DeepSpeed would build a device mesh of its own, with other groups.
        raise ConfigError(f"{ds_path}: data_parallel_size = {ds['data_parallel_size']}: the data-parallel size is the launch's "
                          f"ranks over parallel.sequence_parallel_size in {cfg.source} (olmo_ds/train/parallel.py); "
                          f"remove it from the JSON")
    if cfg.batch.micro_batch_size == AUTO:
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if ds.get(key, AUTO) != AUTO:
                raise ConfigError(f"{ds_path}: {key} = {ds[key]} while batch.micro_batch_size is auto in {cfg.source}; "
                                  f"set {key} to \"auto\" (or give batch.micro_batch_size a number)")
    return ds


def resolve_ds_config(cfg: TrainConfig, model: ModelConfig, dp_world_size: int, *, ds: dict | None = None,
                      device: str | None = None, offload_env: dict | None = None, resumed: dict | None = None) -> dict:
    """The concrete DeepSpeed config for this run (no "auto" left), validated against the train config.

    `device` is the device type the run trains on (default: `device_type()`); it decides whether the
    model's `compile: auto` means compiled blocks, on which some ZeRO-3 knobs depend. CPU offload is sized
    to the node (`olmo_ds.train.offload`); `offload_env` overrides what it reads of the machine
    (host_available, ranks, gpu_bytes), for tests; `resumed` (the checkpoint's saved DeepSpeed config)
    keeps the offload choices of the run being resumed. A training run resolves it in
    `olmo_ds.train.plan.plan_deepspeed`, which chooses `batch.micro_batch_size: auto` between the two halves.
    """
    if cfg.batch.micro_batch_size == AUTO:
        raise ConfigError(f"{cfg.source}: batch.micro_batch_size auto must be chosen (olmo_ds.train.plan.plan_deepspeed, "
                          f"as the trainer does) before the DeepSpeed config is resolved")
    ds = read_ds_config(cfg, ds)
    host = resolve_zero(ds, cfg, model, dp_world_size, device=device, offload_env=offload_env, resumed=resumed)
    if host is not None:
        log.info("%s: %s", cfg.deepspeed_config, host.describe())
    return fill_train_fields(ds, cfg, dp_world_size)


def fill_train_fields(ds: dict, cfg: TrainConfig, dp_world_size: int) -> dict:
    """Fill, in place, what the train config owns (batch, clipping, precision, optimizer) into `ds`, whose ZeRO
    section `resolve_zero` resolved, once `batch.micro_batch_size` is a number; returns `ds`, no "auto" left.
    `dp_world_size`: the ranks that read rows. With sequence parallelism (`parallel.sequence_parallel_size` N > 1)
    the launch has N times as many, and `sequence_parallel_size` tells DeepSpeed so, that its train_batch_size =
    micro-batch x accumulation x data-parallel ranks counts rows (olmo_ds/train/parallel.py)."""
    ds_path = cfg.deepspeed_config
    r = _Resolver(ds, ds_path, cfg)
    b, o = cfg.batch, cfg.optim
    check_batch_divisible(cfg, dp_world_size)
    r.fill(ds, "train_micro_batch_size_per_gpu", b.micro_batch_size, "batch.micro_batch_size")
    if cfg.rl is not None:
        _fill_rl_batch(ds, ds_path, cfg, dp_world_size)
    else:
        first = b.size_schedule().at(0)
        r.fill(ds, "train_batch_size", b.global_batch_size, "batch.global_batch_size")
        ds["train_batch_size"] = first  # a batch-size schedule starts smaller; the trainer steps it up
        r.fill(
            ds, "gradient_accumulation_steps", b.global_batch_size // (b.micro_batch_size * dp_world_size),
            "batch.global_batch_size / (batch.micro_batch_size x data-parallel size)",
        )
        ds["gradient_accumulation_steps"] = first // (b.micro_batch_size * dp_world_size)
    r.fill(ds, "gradient_clipping", o.grad_clip, "optim.grad_clip")
    sp = cfg.parallel.sequence_parallel_size
    if sp > 1 or "sequence_parallel_size" in ds:
        r.fill(ds, "sequence_parallel_size", sp, "parallel.sequence_parallel_size")

    for name in ("bf16", "fp16"):
        section = ds.setdefault(name, {})
        r.fill(section, "enabled", cfg.precision == name, "precision", f"{name}.enabled", train_value=cfg.precision)
    if cfg.precision == "fp16":
        ds["fp16"].setdefault("loss_scale", 0)  # 0 = dynamic loss scaling

    optimizer = ds.setdefault("optimizer", {"type": "AdamW"})
    if str(optimizer.get("type", "")).lower() not in ("adamw", "adam"):
        raise ConfigError(f"{ds_path}: optimizer.type {optimizer.get('type')!r}: olmo-ds trains with AdamW")
    params = optimizer.setdefault("params", {})
    r.fill(params, "lr", o.lr, "optim.lr", "optimizer.params.lr")
    r.fill(params, "betas", list(o.betas), "optim.betas", "optimizer.params.betas")
    r.fill(params, "eps", o.eps, "optim.eps", "optimizer.params.eps")
    r.fill(params, "weight_decay", o.weight_decay, "optim.weight_decay", "optimizer.params.weight_decay")
    if optimizer["type"].lower() == "adam":
        params.setdefault("adam_w_mode", True)  # DeepSpeed's "Adam" + adam_w_mode is decoupled AdamW

    ds.setdefault("steps_per_print", 10**9)  # olmo-ds prints its own progress line
    # DeepSpeed's throughput timer synchronizes the device at the start of every forward and the end of
    # every engine.step(), i.e. twice per micro-batch, to time what olmo-ds already reports (BENCHMARKS.md).
    ds.setdefault("timers", {"throughput": {"enabled": False}})
    ds.setdefault("wall_clock_breakdown", False)

    leftover = _find_auto(ds)
    if leftover:
        raise ConfigError(f"{ds_path}: no train-config value fills {', '.join(leftover)} = \"auto\"; set a concrete value")
    return ds


def _fill_rl_batch(ds: dict, ds_path: str, cfg: TrainConfig, dp_world_size: int) -> None:
    """An RL run's DeepSpeed batch at the start: one micro-batch per data-parallel rank (accumulation 1).

    DeepSpeed counts rows, and an RL step's rows are known only once its rollout has packed them (whole
    micro-batches, as many as the fullest rank needs); the trainer sets DeepSpeed's batch to them at every step
    (`engine.set_train_batch_size`). The start's value is the least a step trains, so the JSON is consistent
    (train_batch_size = micro-batch x accumulation x data-parallel ranks) and claims no batch the run never has.
    A concrete value in the JSON would be a second, contradicted source for that number: it is refused."""
    for key in ("train_batch_size", "gradient_accumulation_steps"):
        if ds.get(key, AUTO) != AUTO:
            raise ConfigError(f"{ds_path}: {key} = {json.dumps(ds[key])}, but an RL run (rl: in {cfg.source}) trains the rows "
                              f"each rollout packs, which the trainer gives DeepSpeed at every step; set {key} to \"auto\"")
    ds["train_batch_size"] = cfg.batch.micro_batch_size * dp_world_size
    ds["gradient_accumulation_steps"] = 1


def resolve_zero(ds: dict, cfg: TrainConfig, model: ModelConfig, dp_world_size: int, *, device: str | None = None,
                 offload_env: dict | None = None, resumed: dict | None = None) -> HostPlan | None:
    """Fill the `zero_optimization` section's "auto" knobs and offload fields of `ds` in place (see
    `resolve_ds_config`); returns the host-memory plan of CPU offload, None without it. Needs no batch size,
    so the micro-batch choice (`olmo_ds.train.memory`) reads the ZeRO layout the run will have."""
    ds_path = cfg.deepspeed_config
    zero = ds.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") not in (1, 2, 3):
        raise ConfigError(f"{ds_path}: zero_optimization.stage must be 1, 2 or 3 (olmo-ds trains with ZeRO)")
    compiled = model.compiles_blocks(device or device_type())
    for key, value in zero3_knobs(model.d_model, zero["stage"], compiled, dp_world_size).items():
        if key in _STAGE3_ONLY and zero["stage"] != 3:
            if zero.get(key) == AUTO:
                del zero[key]
        elif zero.get(key, AUTO) == AUTO:
            zero[key] = value
    return _resolve_offload(zero, ds_path, cfg, model, dp_world_size, device=device or device_type(),
                            resumed=resumed, **(offload_env or {}))


def _resolve_offload(zero: dict, ds_path: str, cfg: TrainConfig, model: ModelConfig, dp_world_size: int, *,
                     device: str, host_available: int | None = None, ranks: int | None = None,
                     gpu_bytes: int | None = None, resumed: dict | None = None) -> HostPlan | None:
    """Fill the "auto" offload fields of `zero` (in place) with `olmo_ds.train.offload`'s decisions and check its
    host plan; None without optimizer offload. `resumed` is the resolved DeepSpeed config saved with the
    checkpoint a run resumes from: its choices for the "auto" fields are kept (and checked like explicit ones), so
    a resumed run puts the same sub-groups' optimizer state on the host and runs the same kernels on them."""
    opt = zero.get("offload_optimizer") or {}
    par = zero.get("offload_param") or {}
    saved = (resumed or {}).get("zero_optimization", {})
    for node, saved_node, key in ((par, saved.get("offload_param") or {}, "device"), (opt, saved.get("offload_optimizer") or {}, "ratio"),
                                  (zero, saved, "sub_group_size")):
        if node.get(key) == AUTO and saved_node.get(key, AUTO) != AUTO:
            node[key] = saved_node[key]
    lp_bytes = 4 if cfg.precision == "fp32" else 2
    if par.get("device") == AUTO:
        par["device"] = param_device(model, dp_world_size, lp_bytes=lp_bytes, device=device, gpu_bytes=gpu_bytes)
    if opt.get("device") not in ("cpu",):
        if opt.get("ratio", AUTO) == AUTO:
            opt.pop("ratio", None)
        if zero.get("sub_group_size") == AUTO:
            zero["sub_group_size"] = DEFAULT_SUB_GROUP
        return None
    stage = zero.get("stage")
    if stage != 3 and opt.get("ratio", AUTO) not in (AUTO, 1, 1.0):
        raise ConfigError(f"{ds_path}: zero_optimization.offload_optimizer.ratio {opt['ratio']} needs ZeRO stage 3")
    if zero.get("sub_group_size", AUTO) == AUTO:
        zero["sub_group_size"] = OFFLOAD_SUB_GROUP
    ratio = opt.get("ratio", AUTO)
    plan = plan_host(model, cfg, dp_world_size, source=ds_path, stage=stage, ratio=None if ratio == AUTO or stage != 3 else float(ratio),
                     sub_group_size=int(zero["sub_group_size"]), lp_bytes=lp_bytes, offload_param=par.get("device") == "cpu",
                     pin_param=bool(par.get("pin_memory", False)), pin=bool(opt.get("pin_memory", False)),
                     host_available=host_available, ranks=ranks)
    if stage != 3:
        opt.pop("ratio", None)
    elif ratio == AUTO:
        opt["ratio"] = plan.ratio
    return plan


def _find_auto(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        out = []
        for k, v in node.items():
            out += _find_auto(v, f"{prefix}{k}.")
        return out
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _find_auto(v, f"{prefix[:-1]}[{i}].")]
    return [prefix[:-1]] if node == AUTO else []
