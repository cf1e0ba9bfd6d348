"""Where the ranks of a launch run and how they meet: checks every rank makes before any CUDA call or collective.

A launcher that starts more ranks on a host than it has GPUs gets "CUDA error: invalid device ordinal"
from the rank whose GPU does not exist, and the other ranks then wait for it in the rendezvous for the
process-group timeout (10 minutes). A rank that cannot reach MASTER_ADDR:MASTER_PORT waits just as
long with nothing said. So:

1. `check_devices`: this host's ranks against its visible GPUs (an error when there are more ranks, a
   warning when GPUs are left idle). Every rank of a host sees the same numbers, so every rank stops
   with the same message.
2. `rendezvous`: every rank meets at MASTER_ADDR:MASTER_PORT within `rendezvous_timeout()` seconds, or
   each stops naming the address and the ranks that did not arrive. Its store then becomes the process
   group's store, so the check costs no second connection.

Training (`olmo_ds/train/preflight.py`, which adds the batch-size check) and evaluation
(`olmo_ds/eval/runner.py`) both start this way. The device counts are arguments, so the checks run on
CPU machines with a faked GPU count. Imports nothing of olmo_ds.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from datetime import timedelta
from pathlib import Path

log = logging.getLogger("olmo_ds")

# Long enough for ranks that import torch and DeepSpeed at different speeds on a loaded node; short
# enough that a rank that will never come is reported while the user still watches.
RENDEZVOUS_TIMEOUT_S = 60.0
TIMEOUT_ENV = "OLMO_DS_RENDEZVOUS_TIMEOUT"

# What each launcher exports as the number of ranks on this host: torchrun, DeepSpeed 0.19's launcher
# (deepspeed/launcher/launch.py), and srun when the job gives --ntasks-per-node.
LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")

FIX = ("start one rank per GPU: set `slots={n}` for this host in the hostfile (`make hostfile` writes one that fits), "
       "or `deepspeed --num_gpus {n}` without a hostfile; `--nproc_per_node {n}` for torchrun; `--ntasks-per-node {n}` "
       "and `--gpus-per-node {n}` for Slurm")


class LaunchError(ValueError):
    """The launch does not fit this host or cannot rendezvous; raised on every rank it concerns."""


def local_world_size(env: dict) -> int | None:
    """The number of ranks on this host, as the launcher exported it; None when it did not say."""
    for key in LOCAL_SIZE_VARS:
        if env.get(key, "").isdigit():
            return int(env[key])
    return None


def host_gpu_count() -> int:
    """GPUs on this host whatever CUDA_VISIBLE_DEVICES says (the launcher narrows that): NVIDIA's device nodes."""
    return sum(1 for p in Path("/dev").glob("nvidia*") if re.fullmatch(r"nvidia\d+", p.name))


def check_devices(local_ranks: int | None, local_rank: int, visible: int, on_host: int, env: dict) -> str | None:
    """Raise when this host has more ranks than visible GPUs; return a warning when GPUs are left idle.

    Without the launcher's count of local ranks (`local_ranks` None) only this rank's own GPU is checked.
    """
    ranks = max(local_ranks or 0, local_rank + 1)
    mask = env.get("CUDA_VISIBLE_DEVICES")
    seen = f"{visible} GPU{'s' if visible != 1 else ''} visible" + (f" (CUDA_VISIBLE_DEVICES={mask})" if mask is not None else "")
    if ranks > visible:
        raise LaunchError(f"{ranks} ranks were started on {socket.gethostname()} but it has {seen}, "
                          f"{on_host} on the host: {FIX.format(n=visible)}")
    if local_ranks is not None and ranks < on_host:
        return (f"using {ranks} of {on_host} GPUs on this host ({seen}); to use all of them, set `slots={on_host}` "
                f"in the hostfile (`make hostfile FORCE=1`) or pass `--num_gpus {on_host}`")
    return None


def check_host(rank: int, local_rank: int, world_size: int, visible_gpus: int, *, env: dict | None = None,
               host_gpus: int | None = None) -> None:
    """`check_devices` for this rank as its launcher exported it; rank 0 logs the warning of idle GPUs."""
    env = os.environ if env is None else env
    local_ranks = local_world_size(env) or (1 if world_size == 1 else None)
    warning = check_devices(local_ranks, local_rank, visible_gpus, host_gpu_count() if host_gpus is None else host_gpus, env)
    if warning and rank == 0:
        log.warning(warning)


def rendezvous_timeout() -> float:
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return RENDEZVOUS_TIMEOUT_S
    try:
        return float(value)
    except ValueError:
        raise LaunchError(f"{TIMEOUT_ENV}={value!r}: expected a number of seconds") from None


def rendezvous(rank: int, world_size: int, *, timeout_s: float | None = None, env: dict | None = None,
               pg_timeout: timedelta = timedelta(minutes=10)):
    """Meet every rank at MASTER_ADDR:MASTER_PORT within `timeout_s`; returns the store, now with `pg_timeout`.

    Rank 0 hosts the store, as torch's env:// rendezvous would (under torchrun the agent already
    hosts one there). Each rank writes a key of its own and waits for all the others'.
    """
    from torch.distributed import TCPStore
    
    env = os.environ if env is None else env
    timeout_s = rendezvous_timeout() if timeout_s is None else timeout_s
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    where = f"MASTER_ADDR:MASTER_PORT {addr}:{port}"
    try:
        socket.getaddrinfo(addr, port)
    except socket.gaierror as e:
        raise LaunchError(f"rank {rank}: {where}: cannot resolve {addr!r} ({e.strerror}); pass the first node's "
                          f"address with --master_addr (the deepspeed launcher) or set MASTER_ADDR") from None
    hosts = rank == 0 and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    t0 = time.monotonic()
    try:
        store = TCPStore(addr, port, world_size, hosts, timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=True)
    except (RuntimeError, TimeoutError) as e:  # DistNetworkError / DistStoreError are RuntimeErrors
        first = str(e).splitlines()[0][:200]
        if hosts:
            raise LaunchError(f"rank 0: cannot host the rendezvous at {where} ({first}): another run may hold the "
                              f"port; pass another --master_port") from None
        raise LaunchError(f"rank {rank}: cannot reach rank 0 at {where} within {timeout_s:g} s ({first}): rank 0 failed "
                          f"before it (see its error), or {addr} is not an address of the first node that this node "
                          f"can reach (127.0.0.1 works on one machine only), or a firewall blocks port {port}. "
                          f"{TIMEOUT_ENV} sets the wait") from None
    prefix = f"olmo_ds/preflight/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    store.set(f"{prefix}{rank}", socket.gethostname())
    keys = [f"{prefix}{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=max(timeout_s - (time.monotonic() - t0), 1.0)))
    except (RuntimeError, TimeoutError):
        missing = [r for r in range(world_size) if not store.check([keys[r]])]
        raise LaunchError(f"rank {rank}: rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {world_size} "
                          f"did not reach the rendezvous at {where} within {timeout_s:g} s: they failed before it (see their "
                          f"errors), were never started (hostfile slots, --num_nodes), or cannot reach {addr}. "
                          f"{TIMEOUT_ENV} sets the wait") from None
    store.set_timeout(pg_timeout)  # from here on it is the process group's store
    return store
