"""The DeepSpeed hostfile that fits where it is written: one line per node, `<host> slots=<ranks>`.

A hostfile copied from another machine starts the wrong number of ranks: too many and a rank dies on a
GPU that does not exist, too few and GPUs sit idle. So it is made here from what the machine says:
inside a Slurm allocation, one line per node of SLURM_JOB_NODELIST with the GPUs Slurm gave each
node; elsewhere `localhost` with the GPUs visible to this process, or 2 ranks on a CPU-only machine
(one per core of the development machines). Used by `make hostfile` (scripts/make_hostfile.py).

A hostfile is not replaced unless asked (`force`): it is the user's file once written, and a node
list edited by hand is worth more than a guess. The header says which command wrote it.
"""

from __future__ import annotations

import os
from pathlib import Path

from olmo_ds.train.launch import expand_nodelist

CPU_SLOTS = 2
HEADER = "# DeepSpeed hostfile: one line per node, \"<host> slots=<GPUs>\". Written by `make hostfile` ({why}).\n"


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def slurm_gpus_per_node(env: dict) -> int | None:
    """GPUs Slurm gave each node: SLURM_GPUS_ON_NODE (set in a job step), else --gpus-per-node ("8" or "h100:8")."""
    for key in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        value = env.get(key, "").rsplit(":", 1)[-1]
        if value.isdigit():
            return int(value)
    return None


def hostfile_text(env: dict | None = None, gpus: int | None = None) -> str:
    """The hostfile for this machine or Slurm allocation; `gpus` defaults to the GPUs this process sees."""
    env = os.environ if env is None else env
    gpus = visible_gpus() if gpus is None else gpus
    nodelist = env.get("SLURM_JOB_NODELIST")
    if nodelist:
        slots = slurm_gpus_per_node(env) or gpus or CPU_SLOTS
        why = f"SLURM_JOB_NODELIST={nodelist}, {slots} GPUs per node"
        return HEADER.format(why=why) + "".join(f"{host} slots={slots}\n" for host in expand_nodelist(nodelist))
    why = f"{gpus} GPUs visible" if gpus else f"no GPU: {CPU_SLOTS} CPU ranks"
    return HEADER.format(why=why) + f"localhost slots={gpus or CPU_SLOTS}\n"


def write_hostfile(path: Path, text: str, *, force: bool = False) -> bool:
    """Write `text` to `path` unless a different hostfile is there and not `force`. Returns whether it wrote."""
    if path.exists() and not force and path.read_text() != text:
        return False
    path.write_text(text)
    return True
