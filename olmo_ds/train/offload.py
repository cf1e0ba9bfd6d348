"""ZeRO-3 CPU offload sized to the machine: what goes to host memory, decided before any of it is allocated.

DeepSpeed's offload either fits the node's RAM or gets the run killed by the kernel's OOM killer minutes
later, after `zero.Init` and `deepspeed.initialize` have run (that is how olmo2-7b first failed on one
H200 with 125 GiB of RAM: BENCHMARKS.md). So the offload JSON may leave three fields "auto", decided here
(`olmo_ds.train.ds_config.resolve_zero` reads the JSON and writes the decisions into it; this module never sees it):

- `offload_param.device`: "none" when this rank's GPU holds its low-precision weights and gradients in
  under a third of its memory (an H200 holds olmo2-7b's 29 GB easily), else "cpu". Moving the weights
  to the host then costs two host-to-device copies of the whole model per step for nothing. On a
  device without its own memory figure (the CPU accelerator) the JSON's intent stands: "cpu".
- `offload_optimizer.ratio`: the share of the optimizer state (fp32 master weights and Adam's two
  moments, 12 bytes a parameter) kept on the host; the rest stays on the GPU (DeepSpeed's "partial
  offload"). "auto" is the largest share whose estimate fits `HOST_FRACTION` of the node's available
  memory, shared by the ranks on the node.
- `sub_group_size`: the optimizer's unit of work and of the ratio (whole sub-groups are offloaded, the
  last ones first); "auto" is `OFFLOAD_SUB_GROUP` elements when offloading, so the ratio is fine-grained.

A concrete ratio is checked against the same estimate, and a plan that cannot fit is a ConfigError naming
the numbers. The estimate follows what DeepSpeed 0.19 allocates on the host (stage3.py): gradient
partitions in one flat buffer of the run's dtype; per offloaded sub-group, master weights, moments
and an fp32 gradient buffer that `initialize_optimizer_states` allocates and never frees; with
parameter offload, one flat low-precision buffer per parameter group, after zero.Init pinned each
partition separately. Pinned buffers come from PyTorch's caching host allocator, which rounds every
block up to a power of two and keeps freed blocks cached, so zero.Init's copies are still held.
Measured on one H200 (125 GiB of RAM): olmo2-7b with everything offloaded was killed; with the
weights on the GPU and all optimizer state on the host, an estimate that left out the kept fp32
gradients (41 GiB of pinned blocks at that ratio) said 104 GiB and the run was killed too; with
them counted it chose ratio 0.670 and the run trained, at 104.5 GiB peak RSS against 105.7 estimated.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from olmo_ds.model import OLMo
from olmo_ds.model.config import ModelConfig
from olmo_ds.train.config import ConfigError, TrainConfig
from olmo_ds.train.optim import param_groups

GiB = 2**30
HOST_FRACTION = 0.85  # of the node's available memory at start-up, for all offloading ranks together
RANK_OVERHEAD = 4 * GiB  # one rank's own process: CUDA context, libraries, data loader, staging copies
GPU_FRACTION_FOR_WEIGHTS = 1 / 3  # weights + gradients above this share of GPU memory go to the host
OFFLOAD_SUB_GROUP = 100_000_000  # elements; DeepSpeed's default (1e9) would make the ratio coarse
DEFAULT_SUB_GROUP = 1_000_000_000
STATE_BYTES = 12  # fp32 master weight + Adam's exp_avg and exp_avg_sq


def pinned(nbytes: int, pin: bool) -> int:
    """Bytes a pinned allocation of `nbytes` really takes (rounded up to a power of two)."""
    return 1 << (nbytes - 1).bit_length() if pin and nbytes > 0 else nbytes


def host_memory_available() -> int:
    """Bytes this node can still give: the smaller of /proc/meminfo's MemAvailable and the cgroup's limit."""
    import psutil

    free = psutil.virtual_memory().available
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            limit, usage = Path(limit_file).read_text().strip(), Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:
            free = min(free, int(limit) - int(usage))
        break
    return free


def local_ranks(dp_world_size: int) -> int:
    """Ranks sharing this node's memory: the launcher's count (torchrun, deepspeed, Slurm), else one per visible GPU."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        if os.environ.get(name, "").isdigit():
            return max(1, int(os.environ[name]))
    import torch

    return max(1, min(dp_world_size, torch.cuda.device_count() if torch.cuda.is_available() else 1))


def gpu_memory() -> int | None:
    """Total memory of this rank's GPU, or None when the run is not on CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()).total_memory


def sub_group_numels(model: ModelConfig, cfg: TrainConfig, dp_world_size: int, sub_group_size: int) -> list[list[int]]:
    """Per optimizer parameter group, the element counts of this rank's sub-groups, as DeepSpeed forms them
    (parameters in group order, a sub-group closes once it reaches `sub_group_size`)."""
    import torch

    with torch.device("meta"):
        groups = param_groups(OLMo(model), cfg.optim)
    out = []
    for group in groups:
        parts = [math.ceil(p.numel() / dp_world_size) for p in group["params"]]
        if sub_group_size >= sum(parts):
            out.append([sum(parts)])
            continue
        subs, size = [], 0
        for i, n in enumerate(parts):
            size += n
            if size >= sub_group_size or i == len(parts) - 1:
                subs.append(size)
                size = 0
        out.append(subs)
    return out


@dataclass
class HostPlan:
    """What offloading puts in one node's memory; bytes are per rank unless named otherwise."""

    ratio: float  # share of sub-groups whose optimizer state is on the host
    param_bytes: int  # low-precision weights (parameter offload), zero.Init's cached copies included
    grad_bytes: int  # the flat low-precision gradient partitions
    state_bytes: int  # master weights + moments of the offloaded sub-groups
    fp32_grad_bytes: int  # each offloaded sub-group's fp32 gradient, allocated once and kept
    ranks: int  # ranks on the node
    available: int  # the node's available memory at start-up

    @property
    def per_rank(self) -> int:
        return RANK_OVERHEAD + self.param_bytes + self.grad_bytes + self.state_bytes + self.fp32_grad_bytes

    @property
    def budget(self) -> int:
        return int(HOST_FRACTION * self.available)

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.1f} GiB"  # noqa: E731
        return (f"optimizer state on the host: ratio {self.ratio:.3f}; host memory per rank {g(self.per_rank)} "
                f"(weights {g(self.param_bytes)}, gradients {g(self.grad_bytes)}, optimizer state {g(self.state_bytes)}, "
                f"fp32 gradients {g(self.fp32_grad_bytes)}, process {g(RANK_OVERHEAD)}) x {self.ranks} rank(s) = "
                f"{g(self.per_rank * self.ranks)} of {g(self.budget)} ({HOST_FRACTION:.0%} of {g(self.available)} available)")


def _plan(subs: list[list[int]], ratio: float, *, lp_bytes: int, offload_param: bool, pin_param: bool, pin: bool,
          ranks: int, available: int) -> HostPlan:
    flat = [n for group in subs for n in group]
    gpu_count = int((1 - ratio) * len(flat))  # DeepSpeed keeps the first sub-groups on the GPU
    on_host = flat[gpu_count:]
    total = sum(flat)
    params = 0
    if offload_param:
        params = sum(pinned(lp_bytes * sum(group), pin_param) for group in subs)
        params *= 2 if pin_param else 1  # zero.Init's per-partition pinned copies stay in the host cache
    # Gradients are kept in the run's dtype (DeepSpeed's grad_accum_dtype defaults to it), like the weights.
    return HostPlan(ratio=ratio, param_bytes=params, grad_bytes=pinned(lp_bytes * total, pin),
                    state_bytes=STATE_BYTES * sum(on_host), fp32_grad_bytes=sum(pinned(4 * n, pin) for n in on_host),
                    ranks=ranks, available=available)


def param_device(model: ModelConfig, dp_world_size: int, *, lp_bytes: int, device: str, gpu_bytes: int | None = None) -> str:
    """What `offload_param.device: auto` becomes: "none" when this rank's GPU holds its low-precision weights and
    gradients in under `GPU_FRACTION_FOR_WEIGHTS` of its memory, else "cpu" (and "cpu" off CUDA: the JSON's intent)."""
    if device != "cuda":
        return "cpu"
    gpu_bytes = gpu_bytes if gpu_bytes is not None else gpu_memory()
    weights = 2 * lp_bytes * math.ceil(model.num_params() / dp_world_size)  # weights + their gradients
    return "cpu" if gpu_bytes is None or weights > GPU_FRACTION_FOR_WEIGHTS * gpu_bytes else "none"


def plan_host(model: ModelConfig, cfg: TrainConfig, dp_world_size: int, *, source: str, stage: int, ratio: float | None,
              sub_group_size: int, lp_bytes: int, offload_param: bool, pin_param: bool, pin: bool,
              host_available: int | None = None, ranks: int | None = None) -> HostPlan:
    """The host-memory plan of optimizer offload; `ratio` None ("auto") chooses the largest share that fits, a
    given one is checked. A plan that cannot fit is a ConfigError naming `source` (the DeepSpeed JSON) and the
    numbers. `ds_config.resolve_zero` reads the JSON's fields and writes the chosen ratio back."""
    subs = sub_group_numels(model, cfg, dp_world_size, sub_group_size)
    ranks = ranks or local_ranks(dp_world_size)
    available = host_available if host_available is not None else host_memory_available()
    plan = lambda r: _plan(subs, r, lp_bytes=lp_bytes, offload_param=offload_param,  # noqa: E731
                           pin_param=pin_param, pin=pin, ranks=ranks, available=available)

    if stage != 3:  # stages 1-2 offload all optimizer state; no ratio
        result = plan(1.0)
    elif ratio is None:
        n = sum(len(g) for g in subs)
        # Sub-groups go to the host from the last one back; take as many as the budget holds. The ratio
        # given to DeepSpeed sits half a sub-group inside k/n so its int() rounding lands on k exactly.
        result = None
        for k in range(n, 0, -1):
            candidate = plan(1.0 if k == n else (k - 0.5) / n)
            if candidate.per_rank * ranks <= candidate.budget:
                result = candidate
                break
        if result is None:
            smallest = plan(0.5 / n)
            raise ConfigError(
                f"{source}: CPU offload does not fit this node's memory even with one optimizer sub-group on the host: "
                f"{smallest.describe()}. Use more nodes, a ds config without offload_param, or ds_configs/zero3_bf16.json"
            )
    else:
        result = plan(ratio)
    if result.per_rank * ranks > result.budget:
        raise ConfigError(
            f"{source}: CPU offload would not fit this node's memory: {result.describe()}. Set "
            f"zero_optimization.offload_optimizer.ratio to \"auto\" (or lower it), or train on more nodes"
        )
    return result
