"""Process-group setup for every way a run is launched: deepspeed, torchrun, Slurm srun, or plain python.

The deepspeed launcher and torchrun export RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT;
`srun` exports SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS / SLURM_JOB_NODELIST instead, so those are
translated; a bare `python scripts/pretrain.py` becomes a one-rank group. Also fixes up the
environment before DeepSpeed JIT-builds its ops (see `normalize_cuda_arch_list`).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from dataclasses import dataclass

from olmo_ds.ranks import rendezvous

log = logging.getLogger("olmo_ds")


@dataclass
class DistEnv:
    launcher: str  # deepspeed | torchrun | slurm | single
    rank: int
    local_rank: int
    world_size: int


def normalize_cuda_arch_list() -> None:
    """Rewrite TORCH_CUDA_ARCH_LIST entries like "9.0a" to "9.0".

    GPU images set "9.0a" (Hopper's arch-specific features) and DeepSpeed 0.19's op builder parses
    each entry with int(), failing with "invalid literal for int() with base 10: '0a'" the first time
    it builds FusedAdam. The plain arch builds kernels that run on the same GPU.
    """
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if not value:
        return
    entries = [e for e in re.split(r"[;\s]+", value.strip()) if e]
    fixed = [re.sub(r"^(\d+\.\d+)[a-zA-Z]+", r"\1", e) for e in entries]
    if fixed != entries:
        normalized = ";".join(fixed)
        os.environ["TORCH_CUDA_ARCH_LIST"] = normalized
        log.info("TORCH_CUDA_ARCH_LIST=%r normalised to %r (DeepSpeed's op builder cannot parse arch suffixes)", value, normalized)


def expand_nodelist(nodelist: str) -> list[str]:
    """Every host of a Slurm node list, in order: "gpu[007-008,012],login1" -> gpu007 gpu008 gpu012 login1.

    The syntax of SLURM_JOB_NODELIST and `scontrol show hostnames`: comma-separated names, each with
    any number of bracketed groups of numbers and zero-padded ranges.
    """
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            if nodelist[start:i].strip():
                names.append(nodelist[start:i].strip())
            start = i + 1
    if depth != 0 or not names:
        raise ValueError(f"cannot parse Slurm node list {nodelist!r}")
    return [host for name in names for host in _expand_name(name, nodelist)]


def _expand_name(name: str, nodelist: str) -> list[str]:
    m = re.fullmatch(r"([^\[\]]*)\[([^\]]+)\](.*)", name)
    if not m:
        if "[" in name or "]" in name:
            raise ValueError(f"cannot parse Slurm node list {nodelist!r} at {name!r}")
        return [name]
    prefix, ranges, rest = m.groups()
    numbers = []
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"cannot parse Slurm node list {nodelist!r} at [{ranges}]")
        numbers += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi or lo) + 1)]
    return [prefix + n + tail for n in numbers for tail in _expand_name(rest, nodelist)] if rest else [prefix + n for n in numbers]


def free_port() -> int:
    """A TCP port on the loopback address that nothing listens on right now (for a rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_environment(environ: dict | None = None) -> DistEnv:
    """Work out rank and world size, filling the env vars torch.distributed reads if a launcher did not."""
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "deepspeed"
        env.setdefault("LOCAL_RANK", "0")
    elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        launcher = "slurm"
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env["SLURM_NTASKS"]
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("MASTER_ADDR", expand_nodelist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "localhost")))[0])
        # One port per job so two jobs sharing a first node do not collide.
        env.setdefault("MASTER_PORT", str(20000 + int(env.get("SLURM_JOB_ID", "0")) % 20000))
    else:
        launcher = "single"
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", str(free_port()))
    return DistEnv(launcher, int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]))


def init_distributed() -> DistEnv:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPUs, gloo on the CPU accelerator).

    The process group is built on the store of the preflight rendezvous, so a rank that never comes
    is reported within seconds (`olmo_ds.ranks.rendezvous`) instead of after the process-group timeout.
    """
    import deepspeed
    import torch

    normalize_cuda_arch_list()
    dist_env = detect_environment()
    from deepspeed.accelerator import get_accelerator
    from deepspeed.constants import default_pg_timeout

    accel = get_accelerator()
    backend = accel.communication_backend_name()
    if accel.device_name() == "cuda":
        torch.cuda.set_device(dist_env.local_rank)
    if dist_env.world_size > 1 and not torch.distributed.is_initialized():
        store = rendezvous(dist_env.rank, dist_env.world_size, pg_timeout=default_pg_timeout)
        # As DeepSpeed's own init does: binding the GPU lets NCCL set up its communicator eagerly.
        device = {"device_id": torch.device("cuda", dist_env.local_rank)} if accel.device_name() == "cuda" else {}
        torch.distributed.init_process_group(backend, store=store, rank=dist_env.rank, world_size=dist_env.world_size,
                                             timeout=default_pg_timeout, **device)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False)
    return dist_env


def lost_ranks(wait_s: float = 10.0) -> list[int]:
    """After a collective failed: the ranks that do not check in on the rendezvous store within `wait_s`.

    gloo and NCCL report a dead peer as "Connection reset by peer [addr]:port", never as a rank, and
    the deepspeed launcher names the last rank it started rather than the one that died. So every
    surviving rank writes a key of its own to the store that the ranks met at, and waits; the ranks
    whose keys never appear are dead or hung. Under the deepspeed launcher (env:// rendezvous) rank 0
    hosts that store, so a store that cannot be reached means rank 0 is gone.
    """
    from datetime import timedelta

    import torch.distributed as dist

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world == 1:
        return []
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False,
                              timeout=timedelta(seconds=wait_s), wait_for_workers=False)
        prefix = "olmo_ds/roll-call/"
        store.set(f"{prefix}{rank}", "here")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world) if not store.check([f"{prefix}{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except (RuntimeError, KeyError, ValueError):  # DistStoreError is a RuntimeError: the store's host is gone
        return [0] if rank != 0 else []


def collective_failure(e: BaseException) -> bool:
    """Whether an exception is a failed collective (a peer gone), not an error of this rank's own."""
    import torch.distributed as dist

    text = str(e)
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "NCCL", "Connection reset", "Connection closed"))
