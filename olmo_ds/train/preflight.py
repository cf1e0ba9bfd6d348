"""The checks a training launch makes in every rank before any CUDA call or collective.

`check_launch`: this host's ranks against its visible GPUs (`olmo_ds.ranks.check_devices`: an error
when there are more ranks, a warning when GPUs are left idle), the world size against the batch
config, and whether FP8 (`model.float8`) can run here (`check_float8`: torchao installed, the GPU's
compute capability). Then `launch.init_distributed` meets every rank at the rendezvous
(`olmo_ds.ranks.rendezvous`) and builds the process group on its store. A wrong launch so fails in
seconds on every rank.
"""

from __future__ import annotations

import os

from olmo_ds.model import float8 as fp8
from olmo_ds.ranks import check_host
from olmo_ds.train.config import ConfigError, TrainConfig
from olmo_ds.train.ds_config import check_batch_divisible, device_type
from olmo_ds.train.parallel import ParallelLayout


def check_float8(cfg: TrainConfig, device: str, capability: tuple[int, int] | None = None, name: str | None = None) -> None:
    """`model.float8` can run in this process: torchao imports, and the device has FP8 matmuls (a CUDA GPU of
    compute capability 8.9 or more, given as `capability` and `name`; or the CPU, through torch's reference kernel)."""
    recipe = cfg.model.build().float8
    if recipe == "off":
        return
    problem = fp8.unavailable() or fp8.device_problem(device, capability, name)
    if problem:
        raise ConfigError(f"{cfg.source}: model.float8 {recipe!r}: {problem}; or set model.float8: \"off\"")


def check_launch(cfg: TrainConfig, rank: int, local_rank: int, world_size: int, *, env: dict | None = None,
                 visible_gpus: int | None = None, host_gpus: int | None = None, device: str | None = None,
                 gpu_capability: tuple[int, int] | None = None, gpu_name: str | None = None) -> None:
    """The checks of a launch that need no other rank. GPU counts, the device type and (with `model.float8`)
    this rank's GPU's compute capability default to this host's, read through torch.cuda's device queries
    before any kernel or collective; none on CPU."""
    env = os.environ if env is None else env
    float8 = cfg.model.build().float8 != "off"
    if device is None and (visible_gpus is None or float8):

        device = device_type()
    if visible_gpus is None and device == "cuda":
        import torch

        visible_gpus = torch.cuda.device_count()  # counts devices without creating a context on any
    if visible_gpus is not None:
        check_host(rank, local_rank, world_size, visible_gpus, env=env, host_gpus=host_gpus)
    check_batch_divisible(cfg, ParallelLayout.of(cfg, rank=rank, world_size=world_size).dp_size)
    if float8:
        if device == "cuda" and gpu_capability is None:
            import torch

            index = local_rank % max(visible_gpus or 1, 1)
            gpu_capability, gpu_name = torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index)
        check_float8(cfg, device, gpu_capability, gpu_name)
