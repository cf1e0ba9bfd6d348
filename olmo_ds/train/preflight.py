"""The checks a training launch makes in every rank before any CUDA call or collective.

`check_launch`: this host's ranks against its visible GPUs (`olmo_ds.ranks.check_devices`: an error
when there are more ranks, a warning when GPUs are left idle) and the world size against the batch
config. Then `launch.init_distributed` meets every rank at the rendezvous (`olmo_ds.ranks.rendezvous`)
and builds the process group on its store. A wrong launch so fails in seconds on every rank.
"""

from __future__ import annotations

import os

from olmo_ds.ranks import check_host
from olmo_ds.train.config import TrainConfig
from olmo_ds.train.ds_config import check_batch_divisible


def check_launch(cfg: TrainConfig, rank: int, local_rank: int, world_size: int, *, env: dict | None = None,
                 visible_gpus: int | None = None, host_gpus: int | None = None) -> None:
    """The checks of a launch that need no other rank. GPU counts default to this host's; none on CPU."""
    env = os.environ if env is None else env
    if visible_gpus is None:
        from olmo_ds.train.ds_config import device_type

        if device_type() == "cuda":
            import torch

            visible_gpus = torch.cuda.device_count()  # counts devices without creating a context on any
    if visible_gpus is not None:
        check_host(rank, local_rank, world_size, visible_gpus, env=env, host_gpus=host_gpus)
    check_batch_divisible(cfg, world_size)
