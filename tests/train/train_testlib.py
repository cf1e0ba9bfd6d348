"""Shared pieces of the trainer tests: learnable synthetic shards, a tiny config, a 2-rank launcher.

The shards hold a noisy first-order Markov chain over a 256-id vocabulary (next = 5 * id + 3 mod 256
with probability 0.9, else uniform), so a tiny model's loss falls from ln(256) ~ 5.5 within a few
dozen steps; ids are written with the real shard writer and read by the real data loader.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml

from olmo_ds.data import shards
from olmo_ds.tools import check_resume
from olmo_ds.tools.check_resume import kill_all, losses_by_step, read_metrics  # noqa: F401 (the tests' helpers are the check's)
from olmo_ds.train.hostfile import hostfile_text, write_hostfile
from olmo_ds.train.launch import free_port  # noqa: F401 (tests take the port helper from here)
from testdata import SHARED, deepspeed_launcher  # noqa: F401 (the trainer tests take the test-data root from here)

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 256
EOS = 0


def write_markov_shards(directory: Path, num_tokens: int = 60_000, *, seed: int = 0, fingerprint: str = "sha256:synthetic-markov",
                        vocab_size: int = VOCAB) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens = np.empty(num_tokens, dtype=np.int64)
    tokens[0] = 1
    noise = rng.random(num_tokens) < 0.1
    random_ids = rng.integers(1, vocab_size, num_tokens)
    for i in range(1, num_tokens):
        tokens[i] = random_ids[i] if noise[i] else (5 * tokens[i - 1] + 3) % vocab_size
    ends = np.cumsum(rng.integers(40, 400, num_tokens // 40))
    ends = ends[ends < num_tokens - 1]
    tokens[ends - 1] = EOS
    offsets = np.concatenate([[0], ends, [num_tokens]])
    half = int(offsets[len(offsets) // 2])
    names = []
    for i, (lo, hi) in enumerate([(0, half), (half, num_tokens)]):
        doc_off = offsets[(offsets >= lo) & (offsets <= hi)] - lo
        meta = shards.write_shard(directory, i, tokens[lo:hi].astype(shards.dtype_for_vocab(vocab_size)), doc_off,
                                  vocab_size=vocab_size, eos_id=EOS)
        names.append(meta.bin)
    shards.Manifest(num_tokens=num_tokens, num_docs=len(offsets) - 1, shards=names, dtype=shards.dtype_for_vocab(vocab_size).name,
                    vocab_size=vocab_size, eos_id=EOS, tokenizer_fingerprint=fingerprint).save(directory)
    return directory


def tiny_config(tmp: Path, data_dir: Path, **sections) -> dict:
    """A config dict for a fast 2-rank CPU run; `sections` override whole keys (dicts merge one level)."""
    cfg = {
        "run_dir": str(tmp / "run"),
        "seed": 1,
        "max_steps": 12,
        "precision": "fp32",
        "deterministic": True,
        "deepspeed_config": str(ROOT / "ds_configs" / "zero3_bf16.json"),
        "model": {"preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 64, "max_seq_len": 64},
        "data": {"sources": [{"path": str(data_dir)}], "seed": 3, "prefetch": 1},
        "batch": {"global_batch_size": 8, "micro_batch_size": 2, "seq_len": 32},
        "optim": {"lr": 3e-3, "weight_decay": 0.1, "grad_clip": 1.0},
        "schedule": {"kind": "cosine", "warmup_steps": 2, "final_lr_fraction": 0.1},
        "checkpoint": {"every": 4, "keep_last": 2},
        "logging": {"every": 1, "tensorboard": True},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def launch_env() -> dict:
    """The check's launch environment (olmo_ds importable, no outer rank), one thread per rank."""
    return {**check_resume.launch_env(), "OMP_NUM_THREADS": "1"}


def torchrun_cmd(script: Path, *args: str, nproc: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(script), *args]


def run(cmd: list[str], timeout: float = 900, **kw) -> subprocess.CompletedProcess:
    """Run a launcher and its ranks in their own process group; on timeout kill the whole group.

    The timeout is generous because a fresh checkout's first multi-rank start JIT-builds DeepSpeed ops
    (shared-memory comm, CPU Adam for offload) for minutes on 2 cores; killing only the launcher
    would leave its ranks running, holding the port and the CPU for the tests after it.
    """
    with subprocess.Popen(cmd, env=launch_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **kw) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def deepspeed_cmd(script: Path, *args: str) -> list[str]:
    """The documented launch on one machine: the hostfile `make hostfile` writes on a CPU-only machine
    (localhost slots=2, in a directory of its own), no ssh."""
    launcher = deepspeed_launcher()
    hostfile = Path(tempfile.mkdtemp(prefix="olmo_ds_test_")) / "hostfile"
    write_hostfile(hostfile, hostfile_text(env={}, gpus=0))
    return [str(launcher), "--hostfile", str(hostfile), "--no_ssh_check", "--master_addr", "127.0.0.1",
            "--master_port", str(free_port()), str(script), *args]


DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"


def rl_inputs(root: Path, *, count: int, max_tokens: int, model: dict, val_fraction: float | None = None) -> tuple[Path, Path]:
    """An RL run's inputs as a user makes them: `count` IFEval-style prompts from scripts/make_rl_prompts.py (a random
    model's text meets some of their constraints, so rewards spread within groups), prepared by scripts/prepare_data.py
    --format rl with OLMo 3's template and the dolma2 tokenizer (prompts of up to `max_tokens`), and a random model of
    shape `model` (keys of `preset("tiny", ...)`) with that vocabulary as init_from. Returns (data dir, model dir)."""
    import torch

    from olmo_ds.model import OLMo
    from olmo_ds.model.config import preset
    from olmo_ds.weights import save_model_dir

    split = ("--val-fraction", str(val_fraction)) if val_fraction else ()
    for args in (("make_rl_prompts.py", "--task", "ifeval", "--count", str(count), "--output", root / "prompts.jsonl"),
                 ("prepare_data.py", "--format", "rl", "--chat-template", "olmo3", "--input", root / "prompts.jsonl", "--tokenizer",
                  DOLMA2, "--output", root / "data", *split, "--max-tokens", str(max_tokens), "--no-progress")):
        result = subprocess.run([sys.executable, str(ROOT / "scripts" / args[0]), *map(str, args[1:])], cwd=ROOT,
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    cfg = preset("tiny", **{k: v for k, v in model.items() if k != "preset"}, vocab_size=100278)
    torch.manual_seed(7)
    save_model_dir(root / "init", cfg, OLMo(cfg).state_dict())
    return root / "data", root / "init"
