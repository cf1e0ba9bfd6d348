"""`make hostfile` writes what fits the machine or Slurm allocation; the Slurm script starts the right ranks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from olmo_ds.ranks import local_world_size
from olmo_ds.train.hostfile import hostfile_text, write_hostfile
from olmo_ds.train.launch import detect_environment

from train_testlib import ROOT, launch_env

SBATCH = ROOT / "scripts" / "slurm" / "pretrain.sbatch"


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_one_line_per_host_with_its_gpus():
    assert lines(hostfile_text(env={}, gpus=0)) == ["localhost slots=2"]  # CPU-only: 2 ranks
    assert lines(hostfile_text(env={}, gpus=1)) == ["localhost slots=1"]
    assert lines(hostfile_text(env={}, gpus=8)) == ["localhost slots=8"]
    slurm = {"SLURM_JOB_NODELIST": "gpu[007-008,012],login1", "SLURM_GPUS_PER_NODE": "h100:4"}
    assert lines(hostfile_text(env=slurm, gpus=0)) == ["gpu007 slots=4", "gpu008 slots=4", "gpu012 slots=4", "login1 slots=4"]
    assert lines(hostfile_text(env={**slurm, "SLURM_GPUS_ON_NODE": "8"}, gpus=1))[0] == "gpu007 slots=8"


def test_a_hand_edited_hostfile_is_kept_unless_forced(tmp_path):
    path = tmp_path / "hostfile"
    script = [sys.executable, str(ROOT / "scripts" / "make_hostfile.py")]
    env = {**launch_env(), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("SLURM_JOB_NODELIST", None)
    made = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0 and lines(path.read_text()) == ["localhost slots=2"], made.stderr
    assert write_hostfile(path, path.read_text())  # the same content: rewritten, nothing lost
    path.write_text("node-a slots=8\nnode-b slots=8\n")
    kept = subprocess.run(script, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert kept.returncode == 0 and "kept hostfile" in kept.stderr and "FORCE=1" in kept.stderr
    assert path.read_text() == "node-a slots=8\nnode-b slots=8\n"
    forced = subprocess.run([*script, "--force"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert forced.returncode == 0 and lines(path.read_text()) == ["localhost slots=2"]


FAKE_SRUN = """#!{python}
# srun as Slurm runs it for this allocation: every task of every node, each with its SLURM_* variables.
# Records each task's command and environment instead of starting it.
import json, os, sys
sys.path.insert(0, {root!r})
from olmo_ds.train.launch import expand_nodelist
n_opts = next(i for i, a in enumerate(sys.argv[1:]) if not a.startswith("-"))  # srun's options, then the command
opts, cmd = sys.argv[1:1 + n_opts], sys.argv[1 + n_opts:]
nodes, per_node = expand_nodelist(os.environ["SLURM_JOB_NODELIST"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
with open(os.environ["FAKE_SRUN_LOG"], "w") as log:
    for n, node in enumerate(nodes):
        for local in range(per_node):
            env = {{**os.environ, "SLURM_PROCID": str(n * per_node + local), "SLURM_LOCALID": str(local),
                    "SLURM_NODEID": str(n), "SLURMD_NODENAME": node}}
            log.write(json.dumps({{"opts": opts, "cmd": cmd, "env": env}}) + "\\n")
"""

FAKE_SCONTROL = """#!{python}
import sys
sys.path.insert(0, {root!r})
from olmo_ds.train.launch import expand_nodelist
assert sys.argv[1:3] == ["show", "hostnames"], sys.argv
print("\\n".join(expand_nodelist(sys.argv[3])))
"""


def test_slurm_script_starts_one_rank_per_gpu_on_two_nodes(tmp_path):
    """scripts/slurm/pretrain.sbatch for 2 nodes x 8 GPUs, as sbatch would run it, with srun and scontrol faked."""
    header = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", SBATCH.read_text(), re.M))
    assert (header["nodes"], header["ntasks-per-node"], header["gpus-per-node"]) == ("2", "8", "8")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text.format(python=sys.executable, root=str(ROOT)))
        (bin_dir / name).chmod(0o755)
    job = {"SLURM_JOB_ID": "73001", "SLURM_JOB_NODELIST": "gpu[007-008]", "SLURM_NNODES": header["nodes"],
           "SLURM_NTASKS_PER_NODE": header["ntasks-per-node"], "SLURM_NTASKS": str(2 * 8),
           "SLURM_GPUS_ON_NODE": header["gpus-per-node"], "SLURM_CPUS_PER_TASK": header["cpus-per-task"],
           "SLURM_SUBMIT_DIR": str(tmp_path)}
    env = {**os.environ, **job, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "FAKE_SRUN_LOG": str(tmp_path / "tasks.jsonl")}
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    done = subprocess.run(["bash", str(SBATCH), "configs/olmo2-1b.yaml", "--set", "max_steps=10"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    tasks = [json.loads(line) for line in (tmp_path / "tasks.jsonl").read_text().splitlines()]
    assert len(tasks) == 16
    assert {tuple(t["opts"]) for t in tasks} == {("--kill-on-bad-exit=1",)}
    assert {tuple(t["cmd"]) for t in tasks} == {("python", "scripts/pretrain.py", "--config", "configs/olmo2-1b.yaml",
                                                 "--resume", "auto", "--set", "max_steps=10")}
    seen = []
    for task in tasks:
        d = detect_environment(dict(task["env"]))
        seen.append((d.launcher, d.rank, d.local_rank, d.world_size, task["env"]["SLURMD_NODENAME"]))
        assert (task["env"]["MASTER_ADDR"], task["env"]["MASTER_PORT"]) == ("gpu007", str(20000 + 73001 % 20000))
        assert local_world_size(task["env"]) == 8 and task["env"]["OMP_NUM_THREADS"] == header["cpus-per-task"]
    assert seen == [("slurm", 8 * n + i, i, 16, f"gpu00{7 + n}") for n in range(2) for i in range(8)]
    assert (tmp_path / "logs").is_dir()
