"""A launch that does not fit the host, or cannot rendezvous, stops every rank within seconds with one clear error.

The GPU counts are faked (the checks take them as arguments); the launcher, its environment, the
rendezvous and the exit codes are real.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from olmo_ds.train.config import config_from_dict
from olmo_ds.ranks import LaunchError, check_devices, local_world_size, rendezvous
from olmo_ds.train.preflight import check_launch

from train_testlib import ROOT, deepspeed_cmd, free_port, launch_env, run, tiny_config, write_config, write_markov_shards

WORKER = Path(__file__).with_name("preflight_worker.py")
PRETRAIN = ROOT / "scripts" / "pretrain.py"


def test_more_ranks_than_gpus_is_an_error_naming_both_numbers_and_the_fix():
    with pytest.raises(LaunchError) as e:
        check_devices(2, 1, visible=1, on_host=1, env={"CUDA_VISIBLE_DEVICES": "0,1"})
    message = str(e.value)
    assert "2 ranks were started on" in message and "1 GPU visible (CUDA_VISIBLE_DEVICES=0,1), 1 on the host" in message
    assert "`slots=1`" in message and "make hostfile" in message and "--num_gpus 1" in message
    # Without the launcher's count, a rank still refuses a GPU index that does not exist.
    with pytest.raises(LaunchError, match="8 ranks were started"):
        check_devices(None, 7, visible=4, on_host=4, env={})


def test_idle_gpus_are_a_warning_and_a_fitting_launch_says_nothing():
    assert check_devices(2, 0, visible=2, on_host=8, env={"CUDA_VISIBLE_DEVICES": "0,1"}).startswith("using 2 of 8 GPUs on this host")
    assert check_devices(8, 3, visible=8, on_host=8, env={}) is None
    assert check_devices(None, 0, visible=1, on_host=8, env={}) is None  # no count of local ranks: no guess


@pytest.mark.parametrize("env, expected", [({"LOCAL_WORLD_SIZE": "4"}, 4), ({"LOCAL_SIZE": "2"}, 2),
                                           ({"SLURM_NTASKS_PER_NODE": "8"}, 8), ({}, None)])
def test_local_ranks_come_from_each_launchers_variable(env, expected):
    assert local_world_size(env) == expected


def test_world_size_is_checked_against_the_batch(tmp_path, caplog):
    cfg = config_from_dict(tiny_config(tmp_path, tmp_path), source="run.yaml")
    with pytest.raises(LaunchError, match="2 ranks were started"):
        check_launch(cfg, 1, 1, 2, env={"LOCAL_WORLD_SIZE": "2"}, visible_gpus=1, host_gpus=1)
    with pytest.raises(ValueError, match=r"run.yaml: global batch size 8 is not divisible by .* data-parallel size 3 = 6"):
        check_launch(cfg, 0, 0, 3, env={"LOCAL_WORLD_SIZE": "3"}, visible_gpus=3, host_gpus=3)
    with caplog.at_level(logging.WARNING, logger="olmo_ds"):
        check_launch(cfg, 0, 0, 2, env={"LOCAL_WORLD_SIZE": "2"}, visible_gpus=8, host_gpus=8)
    assert "using 2 of 8 GPUs on this host" in caplog.text


def test_rendezvous_errors_name_the_address_and_come_within_the_deadline():
    port = free_port()
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=rf"rank 0: rank 1 of 2 did not reach the rendezvous at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} within 1 s"):
        rendezvous(0, 2, timeout_s=1, env=env)
    with pytest.raises(LaunchError, match=rf"rank 1: cannot reach rank 0 at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} within 1 s"):
        rendezvous(1, 2, timeout_s=1, env=env)
    with pytest.raises(LaunchError, match=r"cannot resolve 'no-such-host.invalid'.*--master_addr"):
        rendezvous(1, 2, timeout_s=1, env={**env, "MASTER_ADDR": "no-such-host.invalid"})
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        with pytest.raises(LaunchError, match=rf"rank 0: cannot host the rendezvous at .*:{busy.getsockname()[1]}.*--master_port"):
            rendezvous(0, 2, timeout_s=1, env={**env, "MASTER_PORT": str(busy.getsockname()[1])})
    assert time.monotonic() - t0 < 15


@pytest.mark.multirank
def test_two_ranks_on_a_one_gpu_host_both_stop_with_the_error(tmp_path):
    """The reported case: `localhost slots=2` on a host with one GPU, under the real deepspeed launcher."""
    t0 = time.monotonic()
    result = run(deepspeed_cmd(WORKER, "1"), timeout=120)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: rank")]
    # Every rank makes the check, but the launcher stops the others as soon as one rank exits: on a busy
    # host the second rank may be stopped before it prints. What must hold: at least one rank says it,
    # whatever is said is the clear error, and no rank got as far as a raw CUDA error.
    assert errors and {line.split(":")[1] for line in errors} <= {" rank 0", " rank 1"}, result.stderr[-3000:]
    assert all("2 ranks were started on" in line and "1 GPU visible" in line for line in errors)
    assert "invalid device ordinal" not in result.stderr and "CUDA error" not in result.stderr
    assert time.monotonic() - t0 < 60
    fits = run(deepspeed_cmd(WORKER, "2"), timeout=120)
    assert fits.returncode == 0 and fits.stdout.count("passed (LOCAL_SIZE=2)") == 2, fits.stderr[-3000:]


@pytest.mark.multirank
def test_pretrain_with_a_missing_rank_exits_within_seconds(tmp_path):
    """Rank 1 of 2 started alone (rank 0 never comes): scripts/pretrain.py exits 2 naming the address."""
    config = write_config(tmp_path / "run.yaml", tiny_config(tmp_path, write_markov_shards(tmp_path / "shards", 5000)))
    port = free_port()
    env = {**launch_env(), "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "OLMO_DS_RENDEZVOUS_TIMEOUT": "3"}
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, str(PRETRAIN), "--config", str(config)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"error: rank 1: cannot reach rank 0 at MASTER_ADDR:MASTER_PORT 127.0.0.1:{port} within 3 s" in result.stderr
    assert time.monotonic() - t0 < 60
    assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_evaluation_ranks_are_checked_like_training_ones(monkeypatch):
    """scripts/eval.sh's ranks: more ranks than GPUs stops before any CUDA call; a rank that cannot meet rank 0 stops in seconds."""
    import torch

    from olmo_ds.eval import runner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail(f"set_device({d}) before the check"))
    for key, value in {"WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(LaunchError, match="2 ranks were started on .* 1 GPU visible"):
        runner._init_distributed(None)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("OLMO_DS_RENDEZVOUS_TIMEOUT", "1")
    start = time.monotonic()
    with pytest.raises(LaunchError, match="rank 1: cannot reach rank 0 at MASTER_ADDR:MASTER_PORT 127.0.0.1:.* within 1 s"):
        runner._init_distributed(None)
    assert time.monotonic() - start < 30
