"""Two "nodes" on one machine train bit-identically to the same four ranks on one node.

Each node is the command DeepSpeed's multi-node runner (pdsh) starts on every host of a hostfile:
`python -m deepspeed.launcher.launch --world_info=... --node_rank=N --master_addr=... --master_port=...`,
here twice on localhost with 2 CPU ranks each, joined by the rendezvous on rank 0 (ZeRO-3 over gloo).
What no single machine shows, and this does: ranks of another launcher group, the node rank, the
cross-node rank numbering and the rendezvous.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import pytest

from train_testlib import (ROOT, free_port, launch_env, losses_by_step, tiny_config, write_config,
                           write_markov_shards)

PRETRAIN = ROOT / "scripts" / "pretrain.py"


def launch_group(world_info: dict, node_rank: int, port: int, config: Path, log: Path) -> subprocess.Popen:
    info = base64.urlsafe_b64encode(json.dumps(world_info).encode()).decode()
    cmd = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", f"--world_info={info}", f"--node_rank={node_rank}",
           "--master_addr=127.0.0.1", f"--master_port={port}", str(PRETRAIN), "--config", str(config)]
    return subprocess.Popen(cmd, env=launch_env(), cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)


def train(world_info: dict, config: Path, tmp: Path) -> None:
    port = free_port()
    groups = [launch_group(world_info, n, port, config, tmp / f"node{n}.log") for n in range(len(world_info))]
    try:
        codes = [g.wait(timeout=600) for g in groups]
    finally:
        for g in groups:
            g.kill()
    logs = "\n".join((tmp / f"node{n}.log").read_text()[-3000:] for n in range(len(world_info)))
    assert codes == [0] * len(groups), logs


@pytest.mark.slow
@pytest.mark.multirank
def test_two_nodes_of_two_ranks_equal_four_ranks_on_one_node(tmp_path):
    data = write_markov_shards(tmp_path / "shards", 20_000)
    runs = {}
    for name, world in (("one_node", {"localhost": [0, 1, 2, 3]}), ("two_nodes", {"node-a": [0, 1], "node-b": [0, 1]})):
        cfg = tiny_config(tmp_path / name, data, max_steps=6, checkpoint={"every": 0}, logging={"every": 1, "tensorboard": False})
        (tmp_path / name).mkdir()
        train(world, write_config(tmp_path / name / "run.yaml", cfg), tmp_path / name)
        runs[name] = losses_by_step(Path(cfg["run_dir"]))
        assert "4 ranks" in (tmp_path / name / "node0.log").read_text()
    assert sorted(runs["one_node"]) == list(range(1, 7))
    assert runs["two_nodes"] == runs["one_node"]
