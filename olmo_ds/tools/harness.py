"""The measurement harness the benchmarks share: the device and its clock, the counters that show which
path ran, the facts of the machine a report names, random-id shards (what `bench_data` reads), and the
one-rank training run that `bench_train` times and `bench_checkpoint` saves from (its options, its
TrainConfig, its shards).

A benchmark module holds what it measures and how it reports it; what a second benchmark needs lives
here, so that no benchmark imports another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from olmo_ds.data import shards
from olmo_ds.model.float8 import MATMULS_PER_BLOCK
from olmo_ds.model.model import BLOCK_CALLS
from olmo_ds.train.config import ConfigError, apply_override, config_from_dict

# --- the device and its clock --------------------------------------------------------------------


def current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def gpu_identity() -> tuple[tuple[int, int], str]:
    return torch.cuda.get_device_capability(), torch.cuda.get_device_name()


def sync() -> None:
    """Wait for the device's queued work, so that a host clock read after it covers that work."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn):
    """`(fn(), seconds)`, the device synchronised before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


# --- counters: which path ran --------------------------------------------------------------------


def dynamo_graphs() -> int:
    """Graphs torch.compile has built in this process so far (a count that grows while timed means recompiles)."""
    # Here, not at the top: `import torch` leaves torch._dynamo out and it takes a second to import, which
    # processes that never count (a sweep's parent, bench_data) need not pay.
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def block_counts() -> dict:
    """How many block calls ran compiled and eagerly in this process so far (see `BLOCK_CALLS`), how many of
    their matmuls ran in FP8 (`model.float8`; each block has 7, each with 2 more in backward), and how many
    graphs torch.compile has built (a count that grows during the timed steps means recompiles)."""
    return {"blocks_compiled": BLOCK_CALLS["compiled"], "blocks_eager": BLOCK_CALLS["eager"],
            "block_matmuls": MATMULS_PER_BLOCK * (BLOCK_CALLS["compiled"] + BLOCK_CALLS["eager"]),
            "float8_matmuls": BLOCK_CALLS["float8_matmuls"], "dynamo_graphs": dynamo_graphs()}


# --- the machine ---------------------------------------------------------------------------------


def environment() -> dict:
    """Versions and device a report names."""
    env = {"torch": torch.__version__, "device": "cpu", "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST")}
    try:
        # Here, not at the top: importing DeepSpeed takes seconds, and a report without it still says the rest.
        import deepspeed

        env["deepspeed"] = deepspeed.__version__
    except ImportError:
        env["deepspeed"] = None
    if torch.cuda.is_available():
        env["device"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    return env


# --- generated data ------------------------------------------------------------------------------


def generate_shards(directory: Path, total_tokens: int, *, shard_tokens: int = 1 << 28, vocab_size: int = 100278, mean_doc_len: int = 1200, seed: int = 0) -> Path:
    """Random-id shards totalling `total_tokens` (skipped if a complete set of that size is already there)."""
    directory = Path(directory)
    try:
        if shards.Manifest.load(directory).num_tokens == total_tokens:
            return directory
    except FileNotFoundError:
        pass
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    dtype = shards.dtype_for_vocab(vocab_size)
    names, num_docs, left, index = [], 0, total_tokens, 0
    while left > 0:
        n = min(shard_tokens, left)
        tokens = rng.integers(0, vocab_size, size=n, dtype=dtype)
        ends = np.cumsum(rng.geometric(1 / mean_doc_len, size=2 * n // mean_doc_len + 16))
        offsets = np.concatenate([[0], ends[ends < n], [n]])
        meta = shards.write_shard(directory, index, tokens, offsets, vocab_size=vocab_size, eos_id=0)
        names.append(meta.bin)
        num_docs += meta.num_docs
        left -= n
        index += 1
    shards.Manifest(
        num_tokens=total_tokens, num_docs=num_docs, shards=names, dtype=dtype.name, vocab_size=vocab_size, eos_id=0,
        tokenizer_fingerprint="sha256:random-ids", extra={"generated_by": "olmo_ds.tools.bench_data"},
    ).save(directory)
    return directory


# --- the one-rank training run -------------------------------------------------------------------


@dataclass
class Experiments:
    """Speed levers applied by patching this process (see `bench_train.apply_experiments`); all off by default.

    They exist to measure a lever before it is folded into the model or trainer code; each must keep
    the step's math unchanged (the tests compare losses with and without them).
    """

    # torch.compile the parameter-free math of eager blocks (RMSNorm body, RoPE, SwiGLU) as standalone
    # functions that take the already-gathered weight as an argument, so ZeRO-3's module hooks still
    # run eagerly around them. Meant for `compile=eager` (variant `eager`): compiled blocks bypass them.
    compile_pointwise: bool = False
    # Tokens per chunk of the fused output-projection + cross-entropy (default: `LMHead.forward`'s).
    loss_chunk: int | None = None
    # DeepSpeed's DeepCompile: `"compile": {"deepcompile": true}` and `engine.compile()` after init.
    deepcompile: bool = False
    # `engine.compile()` (plain torch.compile of the whole module under DeepSpeed's hooks).
    engine_compile: bool = False
    compile_backend: str = "inductor"  # for compile_pointwise and engine.compile(); blocks use the model's
    # Compiled blocks as CUDA graphs (torch.compile mode "reduce-overhead"): each block's kernels are
    # replayed from one graph launch instead of launched one by one (issue 24's attempt at the host gap
    # between micro-batches). The gathered weights are inputs, so inductor copies them into the graph's
    # static buffers on every call.
    cuda_graphs: bool = False


@dataclass
class BenchOptions:
    preset: str = "olmo2-1b"
    seq_len: int = 4096
    micro_batch_size: int = 4
    grad_accum: int = 1  # micro-batches per optimizer step (global batch = micro x accum, one rank)
    ds_config: str = "ds_configs/zero3_bf16.json"
    ds_set: list[str] = field(default_factory=list)  # "zero_optimization.reduce_bucket_size=500000000"
    model_set: list[str] = field(default_factory=list)  # ModelConfig fields, e.g. "compile=eager"
    window: int | None = None  # sliding window in tokens on the layers `window_pattern` marks (model.sliding_window)
    window_pattern: str = "TTTF"  # T = sliding, F = full, repeated over the layers (the last is always full): OLMo 3's
    document_masking: bool = False  # attend within documents (data.document_masking; generated docs average 1,200 tokens)
    precision: str | None = None  # None: bf16 on CUDA, fp32 on CPU
    warmup: int = 5
    steps: int = 20
    reference: bool = True
    reference_fp32_master: bool = False  # also a plain-PyTorch step with DeepSpeed's fp32 master weights and moments
    deepspeed: bool = True
    work_dir: str = "out/bench-train"  # shards (reused) and the resolved DeepSpeed JSON
    profile_dir: str | None = None  # profile two extra steps of each path and write op tables here
    experiments: Experiments = field(default_factory=Experiments)


def ds_overrides(opts: BenchOptions) -> list[str]:
    """The train config's `deepspeed_overrides` for `--ds-set` and the experiments (the JSON is read by the plan)."""
    return [*opts.ds_set, *(["compile.deepcompile=true"] if opts.experiments.deepcompile else [])]


def build_train_config(opts: BenchOptions, data_dir: Path, work: Path):
    """The TrainConfig a user would write for this benchmark (one rank, constant lr, no checkpoints)."""
    precision = opts.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    model = {"preset": opts.preset}
    if opts.window is not None:
        if not opts.window_pattern or set(opts.window_pattern) - {"T", "F"}:
            raise ConfigError(f"bench: --window-pattern {opts.window_pattern!r} must be letters T (sliding) and F (full), e.g. TTTF")
        model["sliding_window"] = opts.window
        model["sliding_window_pattern"] = [c == "T" for c in opts.window_pattern]
    for assignment in opts.model_set:
        apply_override(model, assignment)
    steps = opts.warmup + opts.steps
    tree = {
        "run_dir": str(work / "run"),
        "max_steps": steps,
        "precision": precision,
        "deepspeed_config": opts.ds_config,
        "deepspeed_overrides": ds_overrides(opts),
        "model": model,
        "data": {"sources": [{"path": str(data_dir)}], "prefetch": 2, "document_masking": opts.document_masking},
        "batch": {
            "global_batch_size": opts.micro_batch_size * opts.grad_accum,
            "micro_batch_size": opts.micro_batch_size,
            "seq_len": opts.seq_len,
        },
        "schedule": {"kind": "constant"},
        "checkpoint": {"every": 0, "save_final": False},
        "logging": {"tensorboard": False},
    }
    return config_from_dict(tree, source=f"bench_train ({opts.preset})")


def write_bench_shards(opts: BenchOptions, directory: Path, vocab_size: int) -> Path:
    """Random-id shards (never zeros: they can run faster than real data) big enough for both runs."""
    rows = (opts.warmup + opts.steps) * opts.micro_batch_size * opts.grad_accum
    tokens = (rows + 8) * opts.seq_len * 2
    return generate_shards(directory, tokens, shard_tokens=max(tokens // 2, opts.seq_len * 4), vocab_size=vocab_size,
                           mean_doc_len=min(1200, opts.seq_len))


# --- one launch per size: the real Trainer under torchrun, timed -------------------------------------


def timed_launch_worker(config: str, out: str, warmup: int) -> None:
    """In each rank of a launch: the config's Trainer, `warmup` steps, then the rest of max_steps timed; rank 0
    writes the figures to `out` (tokens/s per GPU, MFU, the largest rank's peak memory, the micro-batch and its
    memory estimate, the losses)."""
    from olmo_ds.train.metrics import peak_tflops
    from olmo_ds.train.trainer import Trainer
    from olmo_ds.train.config import load_config

    trainer = Trainer.from_config(load_config(config))
    steps = trainer.cfg.max_steps - warmup
    for _ in range(warmup):
        trainer.train_step(trainer.loader.next_batch())
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    tokens, losses, start = 0, [], time.perf_counter()
    for _ in range(steps):
        m = trainer.train_step(trainer.loader.next_batch())
        tokens += m["tokens"]
        losses.append(m["loss"])
    sync()
    seconds = time.perf_counter() - start
    peak = torch.tensor(float(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else 0.0, device=trainer.device)
    torch.distributed.all_reduce(peak, op=torch.distributed.ReduceOp.MAX)
    layout, rank = trainer.layout, trainer.rank
    per_gpu = tokens / seconds / layout.world_size
    device_peak = peak_tflops(trainer.cfg.logging.peak_tflops)
    tflops = per_gpu * trainer.model_cfg.flops_per_token(trainer.cfg.batch.seq_len) / 1e12
    trainer.close()
    if rank == 0:
        Path(out).write_text(json.dumps({
            "sequence_parallel_size": layout.sp_size, "data_parallel_size": layout.dp_size, "gpus": layout.world_size,
            "tokens_per_s": tokens / seconds, "tokens_per_s_per_gpu": per_gpu, "tflops_per_gpu": tflops,
            "mfu": tflops / device_peak if device_peak else None, "peak_gib": float(peak) / 2**30, "steps": steps,
            "seconds": seconds, "losses": losses, "micro_batch": trainer.plan.deepspeed.micro_batch.record(),
            "environment": environment()}, indent=1))


def add_launch_options(p, *, steps: int, work_dir: str) -> None:
    """The options every one-launch-per-size benchmark takes (timed steps, where its runs go, the worker's entry)."""
    gpu = torch.cuda.is_available()
    p.add_argument("--warmup", type=int, default=3 if gpu else 1)
    p.add_argument("--steps", type=int, default=steps if gpu else 2)
    p.add_argument("--work-dir", default=work_dir)
    p.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    p.add_argument("--worker", nargs=3, metavar=("CONFIG", "OUT", "WARMUP"), help=argparse.SUPPRESS)


def launch_timed(module: str, config: Path, out: Path, *, nproc: int, warmup: int, timeout: float) -> dict | None:
    """Launch `python -m module --worker CONFIG OUT WARMUP` on `nproc` ranks (torchrun, this host); the figures its
    `timed_launch_worker` wrote, or None (the log beside `out` says why)."""
    log = out.with_suffix(".log")
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", module, "--worker", str(config), str(out), str(warmup)]
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    if rc != 0 or not out.exists():
        print(f"{config.name}: the launch on {nproc} rank(s) failed (exit {rc}); see {log}", file=sys.stderr)
        return None
    return json.loads(out.read_text())
