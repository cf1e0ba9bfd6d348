"""Process-group setup for every way a run is launched: deepspeed, torchrun, Slurm srun, or plain python.

The deepspeed launcher and torchrun export RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT;
`srun` exports SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS / SLURM_JOB_NODELIST instead, so those are
translated; a bare `python scripts/pretrain.py` becomes a one-rank group. Also fixes up the
environment before DeepSpeed JIT-builds its ops (see `normalize_cuda_arch_list`), says which ops it is
about to build and where they are cached (`pending_op_builds`: a first start on 2 CPU cores spends ~100 s
compiling in silence otherwise), and makes a rank stop when the launcher that started it is gone
(`watch_launcher`).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

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


# What each op DeepSpeed may compile at the start is for (by builder name), for the line that announces the build.
OP_PURPOSES = {"deepspeed_shm_comm": "shared-memory collectives between CPU ranks", "cpu_adam": "Adam on the host for optimizer offload",
               "fused_adam": "fused Adam on the GPU"}


def pending_op_builds(optimizer_op: str | None = None) -> list[tuple[str, Path]]:
    """(op, cache directory) of each DeepSpeed op this start will compile: not shipped prebuilt and not in the
    torch extensions cache (~/.cache/torch_extensions, or TORCH_EXTENSIONS_DIR) yet. `deepspeed.init_distributed`
    builds the shared-memory collectives on the CPU accelerator; `deepspeed.initialize` builds `optimizer_op`, the
    builder of the optimizer the plan decided DeepSpeed picks (`DeepSpeedPlan.optimizer_op`: CPU Adam with optimizer
    offload, FusedAdam on GPUs unless torch_adam). A cached op whose sources changed is rebuilt without being listed:
    finding that out costs what the build costs."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    try:  # torch's own rule for where an extension is built (private: a torch without it gets no announcement)
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return []

    pending = []
    for name in ["ShareMemCommBuilder", *([optimizer_op] if optimizer_op else [])]:
        try:
            builder = get_accelerator().create_op_builder(name)
        except (ImportError, AttributeError, ValueError):
            builder = None
        if builder is None or installed_ops.get(builder.NAME) or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
            continue
        directory = Path(_get_build_directory(builder.name, verbose=False))
        if not (directory / f"{builder.name}.so").is_file():
            pending.append((builder.name, directory))
    return pending


def announce_op_builds(optimizer_op: str | None, rank: int) -> None:
    """One line on rank 0 for each op `pending_op_builds` finds, before the silence of its compilation."""
    if rank != 0:
        return
    for op, directory in pending_op_builds(optimizer_op):
        log.info("DeepSpeed compiles its %s op (%s) before training starts: a few minutes on a few CPU cores, once; cached "
                 "in %s for every later start", op, OP_PURPOSES.get(op, "a C++ extension"), directory)


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


def init_distributed(optimizer_op: str | None = None) -> DistEnv:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPUs, gloo on the CPU accelerator).

    The process group is built on the store of the preflight rendezvous, so a rank that never comes
    is reported within seconds (`olmo_ds.ranks.rendezvous`) instead of after the process-group timeout.
    Ops DeepSpeed is about to compile, here and `optimizer_op` (the plan's `DeepSpeedPlan.optimizer_op`, read from the
    resolved DeepSpeed config where it is interpreted), are announced first (`announce_op_builds`).
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
    announce_op_builds(optimizer_op, dist_env.rank)
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


# How long a rank whose launcher is gone may take to save and exit (the SIGTERM path) before it ends itself
# without a save: a collective with a rank that died too would otherwise hold it, and its GPU, for the
# process-group timeout.
LAUNCHER_GRACE_ENV = "OLMO_DS_LAUNCHER_GRACE_S"
LAUNCHER_GRACE_S = 300.0
_watched: list[tuple[int, str]] = []  # what `watch_launcher` watches: (pid, command line), parent first
_launcher_gone: str | None = None  # what of it exited, once it has


def _proc_ppid(pid: int) -> int | None:
    """The parent of `pid` (from /proc), or None when it is gone or /proc cannot say."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])  # the command name in (...) may hold spaces


def _proc_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def launcher_processes(environ: dict | None = None) -> list[tuple[int, str]]:
    """The processes whose exit ends this rank's launch, as (pid, command line): empty unless a launcher set RANK.

    Read before `detect_environment` fills RANK in. Under torchrun, and under the deepspeed launcher on another
    node, that is the parent. On the node where `deepspeed` itself runs, the ranks' parent is DeepSpeed's per-node
    `python -m deepspeed.launcher.launch`, and `kill <deepspeed pid>` ends only the `deepspeed` runner above it
    (which forwards no signal on one node): so the runner is watched too. A plain `python scripts/pretrain.py`
    watches nothing (its parent is a shell, which `nohup` is meant to outlive), nor does srun's task, whose
    step daemon ends it when the step ends.
    """
    env = os.environ if environ is None else environ
    if not ("RANK" in env and "WORLD_SIZE" in env):
        return []
    parent = os.getppid()
    if parent <= 1:
        return []
    chain = [(parent, _proc_cmdline(parent))]
    if "deepspeed.launcher.launch" in chain[0][1]:
        runner = _proc_ppid(parent)
        if runner and runner > 1 and "deepspeed" in (cmd := _proc_cmdline(runner)):
            chain.append((runner, cmd))
    return chain


def watch_launcher(environ: dict | None = None, *, poll_s: float = 1.0) -> list[tuple[int, str]]:
    """Stop this rank when a process of `launcher_processes` exits, so no rank trains on as an orphan.

    A daemon thread checks every `poll_s` seconds that this process's parent is unchanged (a dead parent's
    children are re-parented) and that the watched runner is still the launcher's parent; pids are never
    compared to pids that might be reused. When one is gone it sends SIGTERM to this process: in training
    that is the preemption path (a checkpoint, then exit; `launcher_gone` names what exited), before training
    the default action ends the process. A rank that has not exited `OLMO_DS_LAUNCHER_GRACE_S` seconds (300)
    later, e.g. blocked in a collective with a rank that died too, exits without saving. Returns what is watched.
    """
    global _watched
    chain = launcher_processes(environ)
    if chain and not _watched:
        _watched = chain
        grace = float(os.environ.get(LAUNCHER_GRACE_ENV, LAUNCHER_GRACE_S))
        threading.Thread(target=_watch, args=(poll_s, grace), name="olmo_ds-launcher-watch", daemon=True).start()
    return chain


def _watch(poll_s: float, grace_s: float) -> None:
    while launcher_gone() is None:
        time.sleep(poll_s)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    print(f"error: rank {os.environ.get('RANK', '0')}: {launcher_gone()} and this rank had not stopped {grace_s:g} s later; "
          f"exiting without a checkpoint (${LAUNCHER_GRACE_ENV} sets the wait)", file=sys.stderr, flush=True)
    os._exit(3)


def launcher_gone() -> str | None:
    """What of the processes `watch_launcher` watches has exited ("the launcher (pid N: ...) exited"), or None while
    they are there (or none are watched). Checked now, not at the watcher's last poll: another rank may have seen it first."""
    global _launcher_gone
    if _launcher_gone is None and _watched:
        parent = _watched[0][0]
        gone = None
        if os.getppid() != parent:  # a dead parent's children are re-parented
            gone = _watched[0]
        elif len(_watched) > 1 and _proc_ppid(parent) not in (_watched[1][0], None):
            gone = _watched[1]
        if gone is not None:
            _launcher_gone = f"the launcher (pid {gone[0]}: {gone[1][:120]}) exited"
    return _launcher_gone
