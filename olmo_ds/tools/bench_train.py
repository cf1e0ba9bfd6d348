"""Training throughput, MFU, memory and data wait of the real pretrain step on one device,
against a plain-PyTorch step of the same model and batches (see olmo_ds/tools/bench_train.py).

    python scripts/bench_train.py                                    # GPU: olmo2-1b, seq 4096, micro-batch 4, ZeRO-3
    python scripts/bench_train.py --preset tiny --seq-len 64 --micro-batch-size 2 --steps 3   # CPU smoke run
    python scripts/bench_train.py --ds-set zero_optimization.reduce_bucket_size=500000000
    python scripts/bench_train.py --sweep baseline,eager,baseline+accum8   # one process per variant, table last
    python scripts/bench_train.py --float8 tensorwise,rowwise --grad-accum 8   # bf16 and FP8 side by side (a sweep)

Runs as a single rank without a launcher (or under `deepspeed --num_gpus 1`). On a machine without a
GPU it defaults to the tiny preset in fp32 so that it finishes in seconds.

Training throughput of the real pretrain step path on one device, against a plain-PyTorch step.

What is timed is what `scripts/pretrain.py` runs: a `Trainer` (DeepSpeed engine with the chosen ZeRO
config, the real `DataLoader` over shards written with `olmo_ds.data.shards`) and its `train_step`,
data loading included, after warm-up steps that absorb compilation, DeepSpeed's JIT op builds and
allocator growth. In the same process, before the engine exists, the same model and the same batches
run through a plain-PyTorch step (parameters in the run's precision, bf16 on a GPU, fused
`torch.optim.AdamW`, gradient clipping, no DeepSpeed): the ratio of the two is what DeepSpeed costs or gains on this device.

Throughput uses one FLOP formula, `ModelConfig.flops_per_token` (6 x every parameter but the input
embedding, the output head included, + 12 x layers x d_model x seq_len per token), printed with every
report, the same the trainer logs.

The speed levers measured here and found to pay are the model's and trainer's defaults now (compiled
blocks, ZeRO-3 leaf blocks and the ZeRO-3 knobs that go with them; `model.compile`, BENCHMARKS.md), so
the benchmark times what a user runs; `--model-set compile=eager` (variant `eager`) times the eager path
for comparison. Experiment switches (`Experiments`) try further levers without changing the model or
trainer code: each patches this process only, is named in the report, and is off by default. Variants
of a sweep (`VARIANTS`) run in separate processes so that one variant's memory, compiled graphs or
crash cannot affect the next; the sweep prints one table at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import logging
import math
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile, record_function

import olmo_ds.model.model as model_mod
from olmo_ds.data import shards
from olmo_ds.data.dataset import TokenSource
from olmo_ds.data.loader import DataLoader, validation_batches
from olmo_ds.model import OLMo
from olmo_ds.model.config import preset as model_preset
from olmo_ds.model.model import BLOCK_CALLS
from olmo_ds.ranks import LaunchError
from olmo_ds.tools import package_env
from olmo_ds.tools.harness import (BenchOptions, Experiments, block_counts, build_train_config, current_device, dynamo_graphs,
                                   environment, gpu_identity, sync, write_bench_shards)
from olmo_ds.train.config import ConfigError, DPOConfig, InitFromConfig
from olmo_ds.train.ds_config import resolve_ds_config
from olmo_ds.train.launch import normalize_cuda_arch_list
from olmo_ds.train.memory import estimate_peak_memory
from olmo_ds.train.metrics import memory_gib, peak_tflops, setup_console_logging
from olmo_ds.train.optim import param_groups
from olmo_ds.train.preflight import check_float8
from olmo_ds.eval.preference import compute_pair_logprobs
from olmo_ds.weights import MODEL_CONFIG_FILE, save_model_dir
from olmo_ds.train.trainer import Trainer

log = logging.getLogger("olmo_ds")


# --- experiment switches -------------------------------------------------------------------------


def _swiglu(gate, up):
    return torch.nn.functional.silu(gate) * up


def apply_experiments(exp: Experiments) -> list[str]:
    """Patch the model classes for the switches that are on; returns their names for the report."""
    applied = []
    compile_kw = dict(dynamic=False, backend=exp.compile_backend)
    if exp.compile_pointwise:
        rms_norm_c = torch.compile(model_mod.rms_norm, **compile_kw)
        swiglu_c = torch.compile(_swiglu, **compile_kw)
        model_mod.RMSNorm.forward = lambda self, x: rms_norm_c(x, self.weight, self.eps)
        model_mod.MLP.forward = lambda self, x: self.down_proj(swiglu_c(self.gate_proj(x), self.up_proj(x)))
        model_mod.apply_rope = torch.compile(model_mod.apply_rope, **compile_kw)
        applied.append(f"compile_pointwise({exp.compile_backend})")
    if exp.loss_chunk:
        chunk = int(exp.loss_chunk)
        original = model_mod.fused_linear_cross_entropy

        def chunked(hidden, weight, labels, z_loss_coef=0.0, chunk_size=None, **kw):
            return original(hidden, weight, labels, z_loss_coef, chunk, **kw)  # kw: fine-tuning's divisor=

        model_mod.fused_linear_cross_entropy = chunked
        applied.append(f"loss_chunk={chunk}")
    if exp.cuda_graphs:
        model_mod._compiled_block_math = functools.cache(
            lambda: torch.compile(model_mod.block_math, dynamic=False, mode="reduce-overhead"))
        applied.append("cuda_graphs")
    if exp.deepcompile:
        applied.append("deepcompile")
    if exp.engine_compile:
        applied.append("engine_compile")
    return applied


# --- set-up --------------------------------------------------------------------------------------


def flops_report(model_cfg, seq_len: int) -> dict:
    return {"flops_per_token": model_cfg.flops_per_token(seq_len), "formula": model_cfg.flops_formula(seq_len)}


# --- timing --------------------------------------------------------------------------------------


def _peak_memory_reset() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def _peak_memory_gib() -> dict:
    if torch.cuda.is_available():
        return {"peak_alloc_gib": torch.cuda.max_memory_allocated() / 2**30,
                "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
                "host_peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}  # ru_maxrss is KiB
    return {"peak_alloc_gib": memory_gib(), "peak_reserved_gib": None}  # CPU: peak RSS of the process


def _summarise(step_s: list[float], wait_s: float, tokens_per_step: int, flops: dict, peak: float | None, losses: list[float]) -> dict:
    med = statistics.median(step_s)
    tps = tokens_per_step / med
    tflops = tps * flops["flops_per_token"] / 1e12
    return {
        "tokens_per_s": tps,
        "tokens_per_s_mean": tokens_per_step * len(step_s) / sum(step_s),
        "step_s_median": med,
        "step_s_min": min(step_s),
        "step_s_max": max(step_s),
        "tflops": tflops,
        "mfu": tflops / peak if peak else None,
        "data_wait_fraction": wait_s / sum(step_s),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        **_peak_memory_gib(),
    }


def run_reference(cfg, model_cfg, opts: BenchOptions, flops: dict, peak: float | None, fp32_master: bool = False) -> dict:
    """The same model and batches in plain PyTorch: parameters in the run's precision (bf16 on a GPU),
    fused AdamW, clipping.

    With `fp32_master` the optimizer keeps DeepSpeed's precision recipe instead: fp32 master weights
    and fp32 AdamW moments, gradients accumulated in the model's dtype over the micro-batches (as
    DeepSpeed does without `data_types.grad_accum_dtype`) and copied to fp32 for clipping and the
    update, the updated master copied back into the model's weights.
    """
    device = current_device()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.precision]
    torch.manual_seed(cfg.seed)
    with torch.device(device):
        model = OLMo(model_cfg).to(dtype)
    o = cfg.optim
    groups = param_groups(model, o)
    pairs = []  # (model weight, fp32 master) with fp32_master
    if fp32_master:
        for g in groups:
            masters = [w.detach().float().requires_grad_(True) for w in g["params"]]
            pairs += zip(g["params"], masters)
            g["params"] = masters
        for _, m in pairs:
            m.grad = torch.zeros_like(m)
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=o.betas, eps=o.eps, fused=True)
    updated = [m for _, m in pairs] or list(model.parameters())
    loader = DataLoader(cfg.data, seq_len=cfg.batch.seq_len, global_batch_size=cfg.batch.global_batch_size, dp_rank=0, dp_world_size=1)
    micro = cfg.batch.micro_batch_size

    def step() -> float:
        batch = loader.next_batch()
        n_micro = batch["input_ids"].shape[0] // micro
        loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}  # as the trainer does
        for i in range(n_micro):
            mb = {k: v[i * micro:(i + 1) * micro] for k, v in batch.items()}
            with record_function("olmo_ds.forward"):  # the trainer's labels, for traces side by side
                out = model(mb["input_ids"], labels=mb["labels"], doc_lens=mb.get("doc_lens"), z_loss_coef=o.z_loss)
                loss_sum += out.ce_loss.detach().double()
            with record_function("olmo_ds.backward"):
                (out.loss / n_micro).backward()
        with record_function("olmo_ds.step"):
            for w, m in pairs:
                m.grad.copy_(w.grad)
                w.grad = None
            if o.grad_clip:
                torch.nn.utils.clip_grad_norm_(updated, o.grad_clip, foreach=True)
            optimizer.step()
            if pairs:
                with torch.no_grad():
                    torch._foreach_copy_([w for w, _ in pairs], [m for _, m in pairs])
            else:
                optimizer.zero_grad(set_to_none=True)
        return (loss_sum / n_micro).item()  # synchronises, as the trainer's step does

    try:
        result = _time_steps(step, loader, opts, flops, peak, cfg.batch.global_batch_size * cfg.batch.seq_len,
                             "reference_fp32_master" if fp32_master else "reference")
    finally:
        loader.close()
    del model, optimizer, groups, pairs, updated
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals: time in which at least one of them runs."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def _profile(step, name: str, opts: BenchOptions) -> dict:
    """Two more steps under torch.profiler: the op table and a Chrome trace (`trace_<name>.json.gz`,
    open in Perfetto) go to `profile_dir`. Reports, over the span from the first kernel to the last,
    the share of time in which the device ran at least one kernel or copy (well under 1 means the host
    or a synchronisation starves it) and their summed time (above the busy share when streams overlap)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    t0 = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(2):
            step()
        sync()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    sort = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    directory = Path(opts.profile_dir)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"profile_{name}.txt").write_text(
        events.table(sort_by=sort, row_limit=40, max_name_column_width=70) + "\n"
        + events.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
    prof.export_chrome_trace(str(directory / f"trace_{name}.json.gz"))
    # Kernels, copies and memsets; not the device-side ranges of record_function labels.
    kernels_and_copies = [e for e in prof.events() if str(getattr(e, "device_type", "")).endswith("CUDA")
                          and not getattr(e, "is_user_annotation", False) and e.time_range.end > e.time_range.start]
    if not kernels_and_copies:
        return {"profile_wall_s": wall, "device_busy_fraction": None, "kernel_time_fraction": None}
    # Over the span from the first kernel to the last, which leaves out the profiler's own start and stop.
    spans = [(e.time_range.start, e.time_range.end) for e in kernels_and_copies]
    span_us = max(end for _, end in spans) - min(start for start, _ in spans)
    return {"profile_wall_s": wall, "device_busy_fraction": _busy_us(spans) / span_us,
            "kernel_time_fraction": sum(end - start for start, end in spans) / span_us}


def _time_steps(step, loader, opts: BenchOptions, flops: dict, peak: float | None, tokens_per_step: int, name: str = "") -> dict:
    losses = [step() for _ in range(opts.warmup)]
    sync()
    _peak_memory_reset()
    wait0, graphs0 = loader.wait_seconds, dynamo_graphs()
    times = []
    for _ in range(opts.steps):
        t0 = time.perf_counter()
        losses.append(step())
        sync()
        times.append(time.perf_counter() - t0)
    result = _summarise(times, loader.wait_seconds - wait0, tokens_per_step, flops, peak, losses)
    result["dynamo_graphs_while_timed"] = dynamo_graphs() - graphs0  # new graphs = recompiles after warm-up
    if opts.profile_dir:
        result.update(_profile(step, name, opts))
    return result


def run_deepspeed(cfg, opts: BenchOptions, flops: dict, peak: float | None) -> dict:
    """The real pretrain path: `Trainer` (engine, ZeRO config, data loader) and its `train_step`."""
    t0 = time.perf_counter()
    trainer = Trainer.from_config(cfg)
    if opts.experiments.deepcompile or opts.experiments.engine_compile:
        trainer.engine.compile(backend=opts.experiments.compile_backend)
    init_s = time.perf_counter() - t0
    try:
        seen = {"_trained": 0, "_positions": 0}

        def step() -> float:
            m = trainer.train_step(trainer.loader.next_batch())
            seen["_trained"] += m.get("trained_tokens", 0)
            seen["_positions"] += m["tokens"]
            return m["loss"]

        result = _time_steps(step, trainer.loader, opts, flops, peak, cfg.batch.global_batch_size * cfg.batch.seq_len, "deepspeed")
        if getattr(trainer.objective, "masked", False):
            result.update(seen)
        if cfg.dpo is not None:
            result["reference_pass"] = _time_reference_pass(trainer, cfg)
    finally:
        trainer.loader.close()
    result["init_s"] = init_s
    result["counters"] = block_counts()
    zero = trainer.plan.deepspeed.zero
    estimate = estimate_peak_memory(
        trainer.model_cfg, micro_batch=cfg.batch.micro_batch_size, seq_len=cfg.batch.seq_len, precision=cfg.precision,
        zero_stage=zero.stage, dp_world_size=1, compiled=trainer.model_cfg.compiles_blocks(trainer.device.type),
        reduce_bucket_size=zero.reduce_bucket_size, optimizer_on_host=zero.optimizer_on_host, params_on_host=zero.params_on_host)
    result["estimated_peak_gib"] = estimate.total / 2**30  # olmo_ds/train/memory.py, what `micro_batch_size: auto` uses
    result["blocks_compiled"] = trainer.model_cfg.compiles_blocks(trainer.device.type)
    result["zero_stage"] = zero.stage
    result["ds_zero_config"] = trainer.ds_config["zero_optimization"]
    placement = getattr(trainer.engine.optimizer, "subgroup_to_device", None)
    if placement:
        result["offload_subgroups_on_host"] = [sum(d == "cpu" for d in placement.values()), len(placement)]
    return result


def write_sft_shards(opts: BenchOptions, directory: Path, vocab_size: int, seed: int = 0) -> Path:
    """Synthetic fine-tuning data for `--sft`: random-id conversations (never zeros) with a loss mask, written as a
    masked source (`shards.write_shard` with a mask). Lengths are log-normal, median a quarter row, the longest cut
    to the row, so packing leaves some padding as real chat data does; each conversation's second half is trained
    (answers after a prompt). Enough rows for warm-up and timed steps."""
    meta_file = directory / shards.MANIFEST
    rows = (opts.warmup + opts.steps + 2) * opts.micro_batch_size * opts.grad_accum
    if meta_file.exists() and shards.Manifest.load(directory).extra.get("bench_rows") == rows:
        return directory
    rng = np.random.default_rng(seed)
    lens = []
    while sum(lens) < rows * opts.seq_len * 1.05:
        lens.append(int(np.clip(rng.lognormal(np.log(opts.seq_len / 4), 0.8), 8, opts.seq_len)))
    lens = np.asarray(lens, dtype=np.int64)
    tokens = rng.integers(1, vocab_size - 2, int(lens.sum())).astype(shards.dtype_for_vocab(vocab_size))
    mask = np.zeros(len(tokens), dtype=bool)
    ends = np.cumsum(lens)
    for start, n in zip(ends - lens, lens):
        mask[start + n // 2:start + n] = True
    directory.mkdir(parents=True, exist_ok=True)
    meta = shards.write_shard(directory, 0, tokens, np.concatenate([[0], ends]), vocab_size=vocab_size, eos_id=vocab_size - 2, mask=mask)

    class _Ids:  # what write_manifest reads of a tokenizer
        fingerprint, eos_id, pad_id = "sha256:random-ids", vocab_size - 2, vocab_size - 1

    _Ids.vocab_size = vocab_size
    shards.write_manifest(directory, _Ids, "train", {"bench_rows": rows, "generated_by": "olmo_ds.tools.bench_train --sft"}, [meta])
    return directory


def run_sft(opts: BenchOptions, work: Path, vocab: int, flops: dict, peak: float | None) -> dict:
    """The DeepSpeed trainer on packed rows of masked conversations at the same row length (`--sft`)."""
    data_dir = write_sft_shards(opts, work / f"sft-shards-v{vocab}-t{opts.seq_len}", vocab)
    cfg = build_train_config(opts, data_dir, work)
    cfg.data.document_masking = None  # masked data turns it on
    cfg.run_dir = str(work / "run-sft")
    result = run_deepspeed(cfg, opts, flops, peak)
    result["packing"] = TokenSource(data_dir).packing(opts.seq_len).summary()
    result["trained_fraction"] = result.pop("_trained", 0) / max(result.pop("_positions", 1), 1)
    return result


def write_pair_shards(opts: BenchOptions, directory: Path, vocab_size: int, *, preference: bool, seed: int = 0) -> Path:
    """Synthetic preference data for `--dpo`: random-id pairs (never zeros) of one prompt and two replies, each side
    masked to its reply; prompt and replies log-normal around an eighth of a row, a pair at most one row. With
    `preference=False` the same documents as a plain masked source: the SFT step on the same data shape."""
    meta_file = directory / shards.MANIFEST
    rows = (opts.warmup + opts.steps + 2) * opts.micro_batch_size * opts.grad_accum
    if meta_file.exists() and shards.Manifest.load(directory).extra.get("bench_rows") == rows:
        return directory
    rng = np.random.default_rng(seed)
    docs, total = [], 0
    while total < rows * opts.seq_len * 1.05:
        prompt, chosen, rejected = (int(np.clip(rng.lognormal(np.log(opts.seq_len / 8), 0.7), 4, opts.seq_len // 4)) for _ in range(3))
        ids = rng.integers(1, vocab_size - 2, prompt + chosen + rejected)
        for reply in (ids[prompt:prompt + chosen], ids[prompt + chosen:]):
            docs.append((np.concatenate([ids[:prompt], reply]), np.arange(prompt + len(reply)) >= prompt))
        total += 2 * prompt + chosen + rejected
    directory.mkdir(parents=True, exist_ok=True)
    writer = shards.ShardedWriter(directory, max(total, 1), vocab_size=vocab_size, eos_id=vocab_size - 2, masked=True, preference=preference)
    writer.add(np.concatenate([d[0] for d in docs]).astype(shards.dtype_for_vocab(vocab_size)), np.array([len(d[0]) for d in docs]),
               mask=np.concatenate([d[1] for d in docs]))
    writer.finish()

    class _Ids:  # what write_manifest reads of a tokenizer
        fingerprint, eos_id, pad_id = "sha256:random-ids", vocab_size - 2, vocab_size - 1

    _Ids.vocab_size = vocab_size
    shards.write_manifest(directory, _Ids, "train", {"bench_rows": rows, "generated_by": "olmo_ds.tools.bench_train --dpo"})
    return directory


def _starting_model(opts: BenchOptions, directory: Path, model_cfg) -> Path:
    """The DPO run's init_from (and so its reference): the preset's randomly initialised weights, saved once."""
    if not (directory / MODEL_CONFIG_FILE).exists():
        torch.manual_seed(0)
        save_model_dir(directory, model_cfg, OLMo(model_cfg).state_dict())
    return directory


def _time_reference_pass(trainer, cfg) -> dict:
    """The reference pass again, timed after the one the trainer ran at start (which absorbed compilation): the
    engine over every training pair, forward only, as `olmo_ds.train.reference` runs it."""
    stream = validation_batches(cfg.data.sources[0], cfg.batch.seq_len, cfg.batch.micro_batch_size, 0, 1,
                                long_pairs=cfg.data.long_pairs)
    batches = list(stream)
    sync()
    t0 = time.perf_counter()
    _, forwarded = compute_pair_logprobs(trainer.engine, batches, trainer.loader.num_pairs, trainer.device)
    sync()
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "row_tokens": forwarded, "tokens_per_s": forwarded / seconds, "batches": len(batches),
            "first_pass": trainer.objective.reference.stats}


def run_dpo(opts: BenchOptions, work: Path, vocab: int, flops: dict, peak: float | None) -> dict:
    """`--dpo`: the trainer's DPO step (dpo_norm, both sides of each pair, reference cached), its reference pass, and
    the SFT step on the same documents packed into rows of the same length."""
    pairs = write_pair_shards(opts, work / f"dpo-shards-v{vocab}-t{opts.seq_len}", vocab, preference=True)
    docs = write_pair_shards(opts, work / f"dpo-sft-shards-v{vocab}-t{opts.seq_len}", vocab, preference=False)
    cfg = build_train_config(opts, pairs, work)
    init = _starting_model(opts, work / f"dpo-init-{opts.preset}", cfg.model.build(vocab_size=vocab))
    out = {}
    for name, data in (("dpo", pairs), ("sft", docs)):
        cfg = build_train_config(opts, data, work)
        cfg.data.document_masking = None  # masked data turns it on
        cfg.run_dir = str(work / f"run-{name}")
        shutil.rmtree(cfg.run_dir, ignore_errors=True)  # a fresh run each time: the reference pass runs at start
        cfg.init_from = InitFromConfig(path=str(init))
        if name == "dpo":
            cfg.dpo = DPOConfig(loss="dpo_norm", beta=5.0)
        log.info("DeepSpeed trainer, %s step on %s (seq %d): %d warm-up + %d timed steps", name.upper(), data, opts.seq_len,
                 opts.warmup, opts.steps)
        out[name] = run_deepspeed(cfg, opts, flops, peak)
    out["ratio_dpo_to_sft"] = out["dpo"]["tokens_per_s"] / out["sft"]["tokens_per_s"]
    out["ratio_reference_pass_to_dpo_step"] = out["dpo"]["reference_pass"]["tokens_per_s"] / out["dpo"]["tokens_per_s"]
    return out


def run_bench(opts: BenchOptions, sft: bool = False, dpo: bool = False) -> dict:
    """Reference step first (it needs the device to itself), then the DeepSpeed trainer; one result dict."""
    setup_console_logging(0)
    normalize_cuda_arch_list()
    if opts.grad_accum < 1 or opts.steps < 1 or opts.warmup < 0:
        raise ConfigError(f"bench: grad_accum >= 1, steps >= 1, warmup >= 0 required (got {opts.grad_accum}, {opts.steps}, {opts.warmup})")
    work = Path(opts.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    applied = apply_experiments(opts.experiments)
    vocab = model_preset(opts.preset).vocab_size
    data_dir = write_bench_shards(opts, work / f"shards-v{vocab}-t{opts.seq_len}", vocab)
    cfg = build_train_config(opts, data_dir, work)
    model_cfg = cfg.model.build(vocab_size=vocab)
    check_float8(cfg, "cuda" if torch.cuda.is_available() else "cpu", *(gpu_identity() if torch.cuda.is_available() else ()))
    if opts.deepspeed:
        resolve_ds_config(cfg, model_cfg, 1)  # a bad DeepSpeed JSON fails here, before the reference run
    flops = flops_report(model_cfg, opts.seq_len)
    peak = peak_tflops(None)
    result = {
        "options": dataclasses.asdict(opts),
        "experiments_applied": applied,
        "environment": environment(),
        "model": {"preset": opts.preset, "params": model_cfg.num_params(), "non_embedding_params": model_cfg.num_params(False),
                  "attention_backend": model_cfg.attention_backend, "compile": model_cfg.compile,
                  "sliding_window": model_cfg.sliding_window,
                  "sliding_layers": sum(model_cfg.layer_is_sliding(i) for i in range(model_cfg.n_layers)),
                  "activation_checkpointing": model_cfg.activation_checkpointing,
                  "document_masking": cfg.data.document_masking, "float8": model_cfg.float8},
        "precision": cfg.precision,
        "tokens_per_step": cfg.batch.global_batch_size * opts.seq_len,
        "peak_tflops": peak,
        **flops,
    }
    log.info("%s", flops["formula"])
    if opts.reference:
        log.info("plain-PyTorch reference: %d warm-up + %d timed steps", opts.warmup, opts.steps)
        result["reference"] = run_reference(cfg, model_cfg, opts, flops, peak)
        result["reference"]["counters"] = block_counts()
        BLOCK_CALLS.clear()
    if opts.reference_fp32_master:
        log.info("plain-PyTorch reference with fp32 master weights: %d warm-up + %d timed steps", opts.warmup, opts.steps)
        result["reference_fp32_master"] = run_reference(cfg, model_cfg, opts, flops, peak, fp32_master=True)
        result["reference_fp32_master"]["counters"] = block_counts()
        BLOCK_CALLS.clear()
    if opts.deepspeed:
        log.info("DeepSpeed trainer (%s): %d warm-up + %d timed steps", cfg.deepspeed_config, opts.warmup, opts.steps)
        result["deepspeed"] = run_deepspeed(cfg, opts, flops, peak)
    if sft:
        log.info("DeepSpeed trainer on fine-tuning data (packed masked conversations, seq %d): %d warm-up + %d timed steps",
                 opts.seq_len, opts.warmup, opts.steps)
        result["deepspeed_sft"] = run_sft(opts, work, vocab, flops, peak)
        if opts.deepspeed:
            result["ratio_sft_to_pretraining"] = result["deepspeed_sft"]["tokens_per_s"] / result["deepspeed"]["tokens_per_s"]
    if dpo:
        result["dpo"] = run_dpo(opts, work, vocab, flops, peak)
    if opts.reference and opts.deepspeed:
        result["ratio_deepspeed_to_reference"] = result["deepspeed"]["tokens_per_s"] / result["reference"]["tokens_per_s"]
    if opts.reference_fp32_master and opts.deepspeed:
        result["ratio_deepspeed_to_reference_fp32_master"] = result["deepspeed"]["tokens_per_s"] / result["reference_fp32_master"]["tokens_per_s"]
    return result


# --- reporting -----------------------------------------------------------------------------------


def _fmt(value, width: int, spec: str, scale: float = 1.0, suffix: str = "") -> str:
    """`value * scale` formatted and right-aligned in `width` columns; "-" when there is no value."""
    text = "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value * scale, spec) + suffix
    return text.rjust(width)


def _attention_text(m: dict) -> str:
    text = (f"window {m['sliding_window']} on {m['sliding_layers']} layers" if m["sliding_layers"] else "full") + " causal"
    return text + (", document-masked" if m["document_masking"] else "") + f", backend {m['attention_backend']}"


def _float8_text(counters: dict, recipe: str, precision: str) -> str:
    """How many block matmuls ran in FP8, from the counters (`block_counts`): the report's proof that FP8 ran."""
    done, total = counters.get("float8_matmuls", 0), counters.get("block_matmuls", 0)
    if recipe == "off":
        return f"FP8 off: {done} of {total:,} block matmuls in FP8, all in {precision}"
    return (f"FP8 {recipe}: {done:,} of {total:,} block matmuls in FP8 (forward, recomputation included; each with its 2 "
            f"backward matmuls); LM head and embedding in {precision}")


def format_report(r: dict) -> str:
    o = r["options"]
    lines = [
        f"bench_train: {o['preset']} seq {o['seq_len']} micro-batch {o['micro_batch_size']} x accum {o['grad_accum']} "
        f"({r['tokens_per_step']:,} tokens/step), {r['precision']}, {r['environment']['device']}, "
        f"torch {r['environment']['torch']}, deepspeed {r['environment']['deepspeed']}",
        r["formula"],
        f"MFU vs {r['peak_tflops']} TFLOP/s peak" if r["peak_tflops"] else
        "MFU: no known peak for this device" + ("; CPU timings show only that the path runs" if r["environment"]["device"] == "cpu" else ""),
        f"attention: {_attention_text(r['model'])}; activation checkpointing {r['model']['activation_checkpointing']}",
        f"model.compile {r['model']['compile']}; model.float8 {r['model'].get('float8', 'off')}; "
        f"experiments: {', '.join(r['experiments_applied']) or 'none'}; "
        f"ds overrides: {', '.join(o['ds_set']) or 'none'}; "
        f"model overrides: {', '.join(o['model_set']) or 'none'}",
        f"{'run':<28} {'tokens/s':>10} {'TFLOP/s':>8} {'MFU':>6} {'step ms':>8} {'data wait':>9} {'peak GiB':>8} {'loss':>14}",
    ]
    for name, key in (("plain PyTorch (fused AdamW)", "reference"), ("plain PyTorch, fp32 master", "reference_fp32_master"),
                      (f"DeepSpeed {Path(o['ds_config']).name}", "deepspeed"), ("DeepSpeed, SFT packed rows", "deepspeed_sft")):
        m = r.get(key)
        if m is None:
            continue
        lines.append(
            f"{name:<28} {m['tokens_per_s']:>10,.0f} {m['tflops']:>8.1f} {_fmt(m['mfu'], 6, '.1f', 100, '%')} "
            f"{1000 * m['step_s_median']:>8.1f} "
            f"{100 * m['data_wait_fraction']:>8.2f}% {m['peak_alloc_gib']:>8.1f} {m['loss_first']:>6.3f}->{m['loss_last']:<6.3f}"
        )
    for key in ("reference", "reference_fp32_master", "deepspeed"):
        if r.get(key, {}).get("device_busy_fraction") is not None:
            lines.append(f"{key}: device busy {100 * r[key]['device_busy_fraction']:.1f}% of 2 profiled steps, "
                         f"kernel time {100 * r[key]['kernel_time_fraction']:.1f}% of it summed over streams "
                         f"(op table and trace in {o['profile_dir']})")
        if r.get(key, {}).get("counters"):
            lines.append(f"{key} block calls: {r[key]['counters']}; graphs built while timed: {r[key]['dynamo_graphs_while_timed']}")
            lines.append(f"{key}: {_float8_text(r[key]['counters'], r['model'].get('float8', 'off'), r['precision'])}")
    if r.get("deepspeed_sft"):
        sft = r["deepspeed_sft"]
        pk = sft["packing"]
        ratio = r.get("ratio_sft_to_pretraining")
        lines.append(f"SFT (--sft): {sft['tokens_per_s']:,.0f} row tokens/s (padding included), "
                     f"{sft['tokens_per_s'] * pk['efficiency']:,.0f} conversation tokens/s, "
                     f"{sft['tokens_per_s'] * sft['trained_fraction']:,.0f} trained tokens/s; packing efficiency {pk['efficiency']:.4f} "
                     f"({pk['documents']:,} conversations in {pk['rows']:,} rows of {pk['seq_len']}), trained fraction {sft['trained_fraction']:.3f}"
                     + (f"; SFT / pretraining tokens/s at seq {pk['seq_len']}: {ratio:.3f}" if ratio is not None else ""))
    if r.get("dpo"):
        d = r["dpo"]
        lines.append(f"DPO (--dpo, dpo_norm, reference cached): DPO step {d['dpo']['tokens_per_s']:,.0f} row tokens/s, SFT step on the "
                     f"same documents {d['sft']['tokens_per_s']:,.0f}: DPO / SFT {d['ratio_dpo_to_sft']:.3f} (target >= 0.95); "
                     f"reference pass {d['dpo']['reference_pass']['tokens_per_s']:,.0f} row tokens/s, "
                     f"{d['ratio_reference_pass_to_dpo_step']:.2f}x the DPO step (target >= 2)")
    ds = r.get("deepspeed", {})
    if ds.get("estimated_peak_gib") is not None:
        lines.append(f"DeepSpeed peak memory: {ds['peak_alloc_gib']:.1f} GiB measured, {ds['estimated_peak_gib']:.1f} GiB estimated "
                     f"(olmo_ds/train/memory.py, what batch.micro_batch_size auto plans with)")
    if ds.get("host_peak_gib") is not None:
        lines.append(f"host memory: peak RSS {ds['host_peak_gib']:.1f} GiB"
                     + (" (optimizer state of {} of {} sub-groups on the host)".format(*ds["offload_subgroups_on_host"])
                        if ds.get("offload_subgroups_on_host") else ""))
    if "ratio_deepspeed_to_reference" in r:
        lines.append(f"ratio DeepSpeed / plain PyTorch: {r['ratio_deepspeed_to_reference']:.3f}")
    if "ratio_deepspeed_to_reference_fp32_master" in r:
        lines.append(f"ratio DeepSpeed / plain PyTorch with fp32 master weights: {r['ratio_deepspeed_to_reference_fp32_master']:.3f}")
    return "\n".join(lines)


# --- sweeps --------------------------------------------------------------------------------------

# Named variants for one-call sweeps on a GPU machine: extra command-line arguments of
# scripts/bench_train.py, each one lever on top of the defaults; "a+b" combines variants. The defaults
# are what the trainer runs: on a GPU, compiled blocks as ZeRO-3 leaf modules with reduce_bucket_size
# 5e8 and memory_efficient_linear false (the measured `tuned_leaf` levers, folded in).
PERSIST_ALL = ["--ds-set", "zero_optimization.stage3_param_persistence_threshold=1000000000000"]
VARIANTS: dict[str, list[str]] = {
    "baseline": [],
    # The eager path: no compiled blocks, hence no leaf blocks, reduce bucket d^2, DeepSpeed's linear.
    "eager": ["--model-set", "compile=eager"],
    # One folded lever undone at a time, blocks still compiled:
    "small_buckets": ["--ds-set", "zero_optimization.reduce_bucket_size=4194304"],  # d^2 of olmo2-1b (2048^2)
    # zero.Init replaces torch.nn.functional.linear process-wide with DeepSpeed's own autograd function
    # (memory_efficient_linear), which torch.compile cannot fuse through.
    "ds_linear": ["--ds-set", "zero_optimization.memory_efficient_linear=true"],
    "zero1": ["--ds-config", "ds_configs/zero1_bf16.json"],
    "zero2": ["--ds-config", "ds_configs/zero2_bf16.json"],
    "persist_all": PERSIST_ALL,
    "prefetch_big": ["--ds-set", "zero_optimization.stage3_prefetch_bucket_size=500000000"],
    "no_overlap": ["--ds-set", "zero_optimization.overlap_comm=false"],
    # DeepSpeed's default gradient path, which "auto" turns off for ZeRO-3 on one rank (ds_config.zero3_knobs).
    "rs_on": ["--ds-set", "zero_optimization.reduce_scatter=true"],
    # DeepSpeed's throughput timer as DeepSpeed defaults it (on, synchronizing); olmo-ds turns it off.
    "ds_timers": ["--ds-set", "timers.throughput.enabled=true", "--ds-set", "timers.throughput.synchronized=true"],
    "attn_flash": ["--model-set", "attention_backend=sdpa_flash"],
    "attn_flex": ["--model-set", "attention_backend=flex"],
    "compile_pointwise": ["--compile-pointwise"],  # with `eager`: compiled blocks bypass it
    "loss_chunk_1k": ["--loss-chunk", "1024"],
    "loss_chunk_2k": ["--loss-chunk", "2048"],
    "loss_chunk_4k": ["--loss-chunk", "4096"],
    "loss_chunk_8k": ["--loss-chunk", "8192"],
    "mb2": ["--micro-batch-size", "2"],
    "mb8": ["--micro-batch-size", "8"],
    "mb16": ["--micro-batch-size", "16"],
    "accum2": ["--grad-accum", "2"],
    "accum4": ["--grad-accum", "4"],
    "accum8": ["--grad-accum", "8"],
    "ckpt": ["--model-set", "activation_checkpointing=true"],
    "ckpt_every2": ["--model-set", "activation_checkpointing=every_k:2"],
    # OLMo 3's attention: a 4096-token window on 3 of every 4 layers; documents of the generated data masked.
    "olmo3_window": ["--window", "4096"],
    "docs": ["--document-masking"],
    "noref": ["--no-reference"],
    "ref_master": ["--reference-fp32-master"],
    # DeepSpeed with the pure-bf16 reference's precision: bf16 master weights, gradients and AdamW moments.
    "ds_bf16_state": ["--ds-set", "bf16.bf16_master_weights_and_grads=true", "--ds-set", "bf16.bf16_optimizer_states=true"],
    "deepcompile": ["--deepcompile"],
    "cuda_graphs": ["--cuda-graphs"],  # compiled blocks replayed as CUDA graphs (mode "reduce-overhead")
    "engine_compile": ["--engine-compile"],
    # FP8 matmuls in the blocks (model.float8; torchao), beside the bf16 row of the same sweep (`--float8`).
    "fp8_tensorwise": ["--model-set", "float8=tensorwise"],
    "fp8_rowwise": ["--model-set", "float8=rowwise"],
}


def variant_args(name: str) -> list[str]:
    parts = name.split("+")
    unknown = [p for p in parts if p not in VARIANTS]
    if unknown:
        raise ConfigError(f"unknown bench variant(s) {unknown} in {name!r}; known: {', '.join(VARIANTS)} (combine with '+')")
    return [a for p in parts for a in VARIANTS[p]]


def run_sweep(names: list[str], base_args: list[str], out_dir: Path, timeout_s: float | None = None) -> list[dict]:
    """Run each named variant in its own process (base args + the variant's); returns one row per variant."""
    commands = {name: variant_args(name) for name in names}  # all names checked before the first run
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for name, extra in commands.items():
        json_path = out_dir / f"{name}.json"
        json_path.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "olmo_ds.tools.bench_train", *base_args, *extra, "--json", str(json_path)]
        print(f"=== {name}: {shlex.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, env=package_env(), timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        row = {"variant": name, "rc": rc, "wall_s": time.perf_counter() - t0}
        if json_path.exists():
            row["result"] = json.loads(json_path.read_text())
        rows.append(row)
        print(format_sweep(rows[-1:]), flush=True)
    return rows


def format_sweep(rows: list[dict]) -> str:
    lines = [f"{'variant':<34} {'DS tok/s':>9} {'MFU':>6} {'ref tok/s':>9} {'ratio':>6} {'vs fp32m':>8} {'DS GiB':>7} {'est GiB':>7} {'ref GiB':>7} {'host':>6} {'wait':>6} {'wall s':>6} {'blocks c/e':>11} {'fp8 matmuls':>13} {'recomp':>6}"]
    for row in rows:
        r = row.get("result")
        if r is None or "deepspeed" not in r:
            lines.append(f"{row['variant']:<34} failed (rc {row['rc']}), see its log above")
            continue
        ds, ref = r["deepspeed"], r.get("reference")
        lines.append(
            f"{row['variant']:<34} {ds['tokens_per_s']:>9,.0f} {_fmt(ds['mfu'], 6, '.1f', 100, '%')} "
            f"{_fmt(ref and ref['tokens_per_s'], 9, ',.0f')} {_fmt(r.get('ratio_deepspeed_to_reference'), 6, '.3f')} "
            f"{_fmt(r.get('ratio_deepspeed_to_reference_fp32_master'), 8, '.3f')} "
            f"{ds['peak_alloc_gib']:>7.1f} {_fmt(ds.get('estimated_peak_gib'), 7, '.1f')} {_fmt(ref and ref['peak_alloc_gib'], 7, '.1f')} "
            f"{_fmt(ds.get('host_peak_gib'), 6, '.1f')} {100 * ds['data_wait_fraction']:>5.2f}% {row['wall_s']:>6.0f} "
            f"{ds['counters']['blocks_compiled']:>5}/{ds['counters']['blocks_eager']:<5} "
            f"{ds['counters'].get('float8_matmuls', 0):>6}/{ds['counters'].get('block_matmuls', 0):<6} {ds['dynamo_graphs_while_timed']:>6}"
        )
    lines += _float8_ratios(rows)
    return "\n".join(lines)


def _float8_ratios(rows: list[dict]) -> list[str]:
    """For each FP8 row of a sweep whose twin in the training dtype (the same variant without `+fp8_*`) ran too: tokens/s and
    peak memory against it, DeepSpeed's and, where both ran one, plain PyTorch's."""
    results = {row["variant"]: row.get("result") for row in rows}
    out = []
    for name, r in results.items():
        parts = name.split("+")
        recipes = [p for p in parts if p.startswith("fp8_")]
        twin_name = "+".join(p for p in parts if not p.startswith("fp8_")) or "baseline"
        twin = results.get(twin_name)
        if not recipes or not r or not twin or "deepspeed" not in r or "deepspeed" not in twin:
            continue
        text = (f"{name} / {twin_name}: DeepSpeed tokens/s {r['deepspeed']['tokens_per_s'] / twin['deepspeed']['tokens_per_s']:.3f}, "
                f"peak {r['deepspeed']['peak_alloc_gib']:.1f} vs {twin['deepspeed']['peak_alloc_gib']:.1f} GiB")
        if r.get("reference") and twin.get("reference"):
            text += f"; plain PyTorch tokens/s {r['reference']['tokens_per_s'] / twin['reference']['tokens_per_s']:.3f}"
        out.append(text)
    return out


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="olmo2-1b" if gpu else "tiny", help="model preset (default: olmo2-1b on GPU, tiny on CPU)")
    p.add_argument("--seq-len", type=int, default=4096 if gpu else 128)
    p.add_argument("--micro-batch-size", type=int, default=4 if gpu else 2)
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--ds-config", default="ds_configs/zero3_bf16.json")
    p.add_argument("--ds-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a DeepSpeed JSON field, e.g. zero_optimization.reduce_bucket_size=500000000")
    p.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model config field, e.g. compile=eager (no compiled blocks) or attention_backend=sdpa_flash")
    p.add_argument("--window", type=int, default=None, help="sliding-window attention of this many tokens (model.sliding_window)")
    p.add_argument("--window-pattern", default=BenchOptions.window_pattern,
                   help="with --window: T (sliding) / F (full) per layer, repeated; the last layer is always full (default: OLMo 3's TTTF)")
    p.add_argument("--document-masking", action="store_true", help="attend only within documents (data.document_masking)")
    p.add_argument("--precision", choices=["bf16", "fp16", "fp32"], default=None, help="default: bf16 on GPU, fp32 on CPU")
    p.add_argument("--warmup", type=int, default=5 if gpu else 1)
    p.add_argument("--steps", type=int, default=20 if gpu else 3)
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip the plain-PyTorch step")
    p.add_argument("--reference-fp32-master", action="store_true",
                   help="also time a plain-PyTorch step with DeepSpeed's precision recipe: fp32 master weights and AdamW moments")
    p.add_argument("--no-deepspeed", dest="deepspeed", action="store_false", help="only the plain-PyTorch step")
    p.add_argument("--work-dir", default=BenchOptions.work_dir, help="generated shards (reused) and the resolved DeepSpeed JSON")
    g = p.add_argument_group("experiment switches (patch this process only; see olmo_ds.tools.bench_train.Experiments)")
    g.add_argument("--compile-pointwise", action="store_true", help="torch.compile RMSNorm, RoPE and SwiGLU math")
    g.add_argument("--loss-chunk", type=int, default=None, help="tokens per chunk of the fused head + loss")
    g.add_argument("--deepcompile", action="store_true", help="DeepSpeed DeepCompile (engine.compile with deepcompile on)")
    g.add_argument("--engine-compile", action="store_true", help="engine.compile(): torch.compile under DeepSpeed's hooks")
    g.add_argument("--cuda-graphs", action="store_true", help="compiled blocks as CUDA graphs (torch.compile mode reduce-overhead)")
    g.add_argument("--compile-backend", default="inductor", help="for --compile-pointwise and engine.compile()")
    p.add_argument("--profile-dir", default=None, help="profile two extra steps of each path; op tables and Chrome traces (trace_<path>.json.gz) go here")
    p.add_argument("--json", type=Path, default=None, help="also write the full result as JSON here")
    p.add_argument("--sweep", default=None, metavar="V1,V2,...",
                   help=f"run named variants, one process each, and print a table; known: {', '.join(VARIANTS)}")
    p.add_argument("--sweep-timeout", type=float, default=None, help="seconds per variant before it is killed")
    p.add_argument("--float8", default=None, metavar="RECIPE[,RECIPE]",
                   help="bf16 and FP8 side by side: each variant (or `baseline`) again with model.float8 = each recipe "
                        "(tensorwise, rowwise), one process per row, ratios to the bf16 rows at the end")
    p.add_argument("--sft", action="store_true",
                   help="also time the trainer on fine-tuning data (synthetic masked conversations packed into rows of the same "
                        "--seq-len: packing, document masking, the global token-mean loss) and print SFT vs pretraining tokens/s")
    p.add_argument("--dpo", action="store_true",
                   help="also time the trainer's DPO step (synthetic pairs packed whole into rows of --seq-len, dpo_norm, reference "
                        "cached), its reference pass, and the SFT step on the same documents; print DPO vs SFT tokens/s")
    p.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)  # passed by the deepspeed launcher
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)

    try:
        if args.sweep or args.float8:
            # Everything after the script name except the sweep's own options is passed on to each variant.
            own = ("--sweep", "--json", "--sweep-timeout", "--float8")
            base, skip = [], False
            for a in argv:
                if skip:
                    skip = False
                elif a in own:
                    skip = True
                elif not a.startswith(tuple(f"{o}=" for o in own)):
                    base.append(a)
            names = args.sweep.split(",") if args.sweep else ["baseline"]
            if args.float8:
                recipes = args.float8.split(",")
                bad = [r for r in recipes if f"fp8_{r}" not in VARIANTS]
                if bad:
                    raise ConfigError(f"--float8 {args.float8}: unknown recipe(s) {bad}; choose from tensorwise, rowwise")
                names += [f"{n}+fp8_{r}" for r in recipes for n in names]
            out_dir = Path(args.work_dir) / "sweep"
            rows = run_sweep(names, base, out_dir, args.sweep_timeout)
            if args.json:
                args.json.write_text(json.dumps(rows, indent=2))
            print(format_sweep(rows))
            return 0 if all(r.get("result") for r in rows) else 1
        opts = BenchOptions(
            preset=args.preset, seq_len=args.seq_len, micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum,
            ds_config=args.ds_config, ds_set=args.ds_set, model_set=args.model_set, precision=args.precision,
            window=args.window, window_pattern=args.window_pattern, document_masking=args.document_masking,
            warmup=args.warmup, steps=args.steps, reference=args.reference, reference_fp32_master=args.reference_fp32_master, deepspeed=args.deepspeed, work_dir=args.work_dir,
            profile_dir=args.profile_dir,
            experiments=Experiments(compile_pointwise=args.compile_pointwise, loss_chunk=args.loss_chunk, deepcompile=args.deepcompile,
                                    engine_compile=args.engine_compile, compile_backend=args.compile_backend,
                                    cuda_graphs=args.cuda_graphs),
        )
        result = run_bench(opts, sft=args.sft, dpo=args.dpo)
    except (ConfigError, LaunchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    print(format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
