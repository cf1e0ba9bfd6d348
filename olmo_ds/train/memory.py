"""Peak device memory of a training step, estimated from the model's shape, and `batch.micro_batch_size: auto`.

Why: DeepSpeed ZeRO-2/3 waits for its gradient stream at the end of every micro-batch's backward, and the
host then needs ~5-7 ms to start the next forward (BENCHMARKS.md, "The host between micro-batches"); fewer,
larger micro-batches pay that less often (0.966 of plain PyTorch at micro-batch 4 x 8, 0.979-0.984 at 8 x 4
for the 1B on an H200). The largest micro-batch is the one whose activations still fit, and that depends on
the model, the sequence length, the ZeRO layout and the GPU: `auto` works it out at start-up.

The estimate of one rank's peak (`estimate_peak_memory`), in bytes, is the sum of
- model state: weights and gradients in the training dtype, fp32 master weights and AdamW's two moments,
  partitioned as the ZeRO stage does (stage 3: all of it over the data-parallel ranks) and less what CPU
  offload puts on the host;
- activations, per token: what a block keeps for its backward, 2 bytes x (4 d_model + 3 q + 3 kv + 3 mlp_hidden)
  in bf16 for the compiled block (its input, the residual after attention, the o-projection and MLP outputs
  under their norms; q, k before and after RoPE and attention's output; k, v likewise; gate, up and their
  product), 1.75x that on the eager path (fp32 norm intermediates, measured), per layer; a checkpointed block
  keeps its input only, and one block's recomputation adds half a block's set; plus 6 d_model bytes per token
  outside the blocks (embedding output, final norm, the loss's hidden-state gradient);
- the head and loss: the fp32 gradient of the head weight the fused loss accumulates, the gathered bf16 head
  weight, and one chunk of fp32 logits with its bf16 gradient (`olmo_ds.model.loss`);
- ZeRO buffers: two reduce buckets and two gathered blocks (the running one and the prefetched one).

With sequence parallelism (`parallel.sequence_parallel_size` N) a rank holds seq_len / N tokens of each row, so the
activations are those of a micro-batch of that many tokens, plus attention's inputs and output in their exchanged
form (`sequence_parallel_bytes_per_token`); the state partitions over all the ranks. `scripts/memory_plan.py` prints
the estimate of a config for every N and checkpointing choice on 80 and 141 GB cards. The sequence-parallel term is
not calibrated: sequence parallelism has run on CPU ranks only.

Attention kernels that do not store the score matrix are assumed (flash, cuDNN, flex: what runs on GPUs).
With `model.float8` the bf16 estimate is used: FP8 keeps no more (plain PyTorch measured 12% less at the 1B).

Calibration, one H200 (ZeRO-3 bf16, compiled blocks, one rank; `tests/train/test_memory.py` holds the points):
olmo2-1b at seq 4096 with micro-batch 4, 8 and 16: 48.6, 71.0, 115.8 GiB measured, 48.7, 70.9, 115.3 estimated;
the 1B at seq 8192 x 2: 48.6 (none), 38.1 (every_k:2), 28.8 (full checkpointing) measured, 48.7, 38.9, 28.4
estimated; olmo3-7b at 8192 x 1 with full checkpointing 116.0 measured, 117.6 estimated; the 1B at 65,536 x 1
with full checkpointing 34.3 measured, 34.0 estimated.

An RL rollout (`estimate_rollout_memory`) holds, beside the resident model state, a whole-weights copy for the
decode engine and its KV cache: the trainer logs that estimate at start-up (not calibrated on a GPU).

`auto` (`choose_micro_batch`) takes the largest power of two that divides every per-rank batch of the run
(`batch.global_batch_size` and the `batch.schedule` sizes over the ranks) whose estimate fits `MEMORY_FRACTION`
of the device: 80 %, the 10-20 % docs/training.md tells users to leave for the allocator's fragmentation
(reserved memory ran 8 % above allocated in the 7B offload run), communication buffers and the CUDA context,
none of which a peak-allocated figure includes. The 1B at seq 4096 on an H200 (140 GiB) gets 8: 16 would need
115 GiB of the 112 GiB budget. On CPU the budget is the host's available memory shared by the node's ranks.
A resumed run keeps the micro-batch its checkpoint ran with (the saved DeepSpeed config holds it) as long as it
still divides the per-rank batch; an explicit number always wins. The run's plan (`olmo_ds.train.plan`) calls it
between resolving the DeepSpeed JSON's ZeRO section and filling its batch fields.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from olmo_ds.model.config import ModelConfig
from olmo_ds.model.decode import bytes_per_sequence
from olmo_ds.model.loss import CHUNK_SIZE as LOSS_CHUNK
from olmo_ds.train.config import TrainConfig
from olmo_ds.train.ds_config import AUTO, ZeroLayout, device_type
from olmo_ds.train.offload import gpu_memory, host_memory_available, local_ranks

log = logging.getLogger("olmo_ds")

GiB = 2**30
MEMORY_FRACTION = 0.80  # of the device's memory that the estimated peak may take
EAGER_ACTIVATION_FACTOR = 1.75  # eager blocks keep more for backward: 63.7 vs 48.6 GiB at the 1B's micro-batch 4
RECOMPUTE_SHARE = 0.5  # of a block's activations alive while a checkpointed block is recomputed and run backward
OUTSIDE_BLOCKS = 6  # bytes x d_model per token outside the blocks, in bf16
STATE_BYTES = 12  # fp32 master weight + AdamW's two moments, per parameter


@dataclass
class MemoryEstimate:
    """One rank's estimated peak, in bytes, by part."""

    model_state: int
    activations: int
    head: int
    buffers: int

    @property
    def total(self) -> int:
        return self.model_state + self.activations + self.head + self.buffers

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
        return (f"{g(self.total)} GiB (model state {g(self.model_state)} + activations {g(self.activations)} + "
                f"head and loss {g(self.head)} + ZeRO buffers {g(self.buffers)})")


def block_bytes_per_token(model: ModelConfig, dtype_bytes: int, compiled: bool) -> int:
    """What one block keeps for its backward, per token (see the module docstring)."""
    q, kv = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    kept = dtype_bytes * (4 * model.d_model + 3 * q + 3 * kv + 3 * model.mlp_hidden)
    return kept if compiled else int(EAGER_ACTIVATION_FACTOR * kept)


def sequence_parallel_bytes_per_token(model: ModelConfig, dtype_bytes: int, size: int) -> int:
    """What Ulysses adds to a block's kept activations per local token (0 at size 1): attention's inputs and output
    in their exchanged form ([T, H/N] for q and the output, [T, H_kv/N or 1] for k and v, the same bytes per local
    token as [T/N, H]), kept for attention's backward beside the pre-exchange q, k, v the estimate already counts.
    Not calibrated on a GPU: sequence parallelism has run on CPU ranks only."""
    if size == 1:
        return 0
    q, kv = model.n_heads * model.head_dim, max(model.n_kv_heads, size) * model.head_dim
    return dtype_bytes * (2 * q + 2 * kv)


def block_params(model: ModelConfig) -> int:
    """Parameters of one block (its four projections, three MLP matrices and four norms)."""
    return (model.num_params(include_embedding=False) - model.d_model) // model.n_layers


def estimate_peak_memory(model: ModelConfig, *, micro_batch: int, seq_len: int, precision: str = "bf16", zero_stage: int = 3,
                         dp_world_size: int = 1, compiled: bool = True, reduce_bucket_size: int = 500_000_000,
                         optimizer_on_host: float = 0.0, params_on_host: bool = False, sequence_parallel: int = 1) -> MemoryEstimate:
    """One rank's peak memory in a training step (see the module docstring). `dp_world_size`: the ranks ZeRO
    partitions over (all of them, sequence-parallel ones included); `optimizer_on_host`: the share of the optimizer
    state CPU offload keeps on the host; `params_on_host`: the weights offloaded too; `sequence_parallel`: N ranks
    hold each row, this one seq_len / N tokens of it (`sequence_parallel_bytes_per_token` adds the exchange's)."""
    lp = 4 if precision == "fp32" else 2
    n, world = model.num_params(), dp_world_size
    weights, grads, state = lp * n, lp * n, STATE_BYTES * n * (1 - optimizer_on_host)
    if zero_stage == 3:
        model_state = (0 if params_on_host else weights / world) + grads / world + state / world
    elif zero_stage == 2:
        model_state = weights + grads / world + state / world
    else:
        model_state = weights + grads + state / world

    tokens = micro_batch * seq_len // sequence_parallel
    block = block_bytes_per_token(model, lp, compiled) + sequence_parallel_bytes_per_token(model, lp, sequence_parallel)
    kept_input = lp * model.d_model
    interval = model.checkpoint_interval()
    if interval is None:
        per_token = model.n_layers * block
    else:
        recomputed = sum(model.checkpoints_block(i) for i in range(model.n_layers))
        per_token = recomputed * kept_input + (model.n_layers - recomputed) * block + RECOMPUTE_SHARE * block
    per_token += OUTSIDE_BLOCKS * lp // 2 * model.d_model
    activations = per_token * tokens

    vocab, d = model.padded_vocab_size, model.d_model
    head = 4 * vocab * d + lp * vocab * d + min(LOSS_CHUNK, tokens) * vocab * (4 + lp)
    buffers = 2 * lp * reduce_bucket_size + (2 * lp * block_params(model) if zero_stage == 3 else 0)
    return MemoryEstimate(int(model_state), int(activations), int(head), int(buffers))


@dataclass
class MicroBatchChoice:
    """The micro-batch a run trains with and how it was decided (recorded in train_state.json)."""

    size: int
    chosen_by: str  # "config" (an explicit number), "auto" (the estimate), "checkpoint" (auto, kept on resume)
    estimate: MemoryEstimate | None = None  # of `size`
    larger: tuple[int, MemoryEstimate] | None = None  # the next candidate that did not fit, if any
    budget: int | None = None  # bytes the estimate had to fit
    device: str = ""  # what the budget is of
    note: str = ""

    def record(self) -> dict:
        return {"size": self.size, "chosen_by": self.chosen_by, "estimate_bytes": self.estimate.total if self.estimate else None,
                "budget_bytes": self.budget, "device": self.device}

    def describe(self) -> str:
        if self.chosen_by == "config":
            return f"batch.micro_batch_size {self.size} (the config's)"
        if self.chosen_by == "checkpoint":
            return (f"batch.micro_batch_size auto: {self.size}, kept from the checkpoint this run resumes ({self.note}); "
                    f"estimated peak {self.estimate.describe()}")
        text = (f"batch.micro_batch_size auto: {self.size} per rank; estimated peak {self.estimate.describe()}, "
                f"budget {self.budget / GiB:.1f} GiB = {MEMORY_FRACTION:.0%} of {self.device}")
        if self.larger:
            text += f"; {self.larger[0]} would need {self.larger[1].total / GiB:.1f} GiB"
        return text + (f"; {self.note}" if self.note else "")


def per_rank_batches(cfg: TrainConfig, dp_world_size: int) -> list[int]:
    """Every per-rank batch size (rows per rank per optimizer step) the run's batch schedule has."""
    return sorted({size // dp_world_size for _, size in cfg.batch.size_schedule().points})


def device_memory(device: str, dp_world_size: int) -> tuple[int | None, str]:
    """(bytes the micro-batch must fit, what they are): this rank's GPU's total memory, or on CPU the host's
    available memory shared by the node's ranks."""

    if device == "cuda":
        import torch

        total = gpu_memory()
        index = int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)
        return total, f"{torch.cuda.get_device_name(index)}'s {total / GiB:.1f} GiB" if total else "an unknown GPU"
    ranks = local_ranks(dp_world_size)
    available = host_memory_available()
    return available // ranks, f"the host's {available / GiB:.1f} GiB available / {ranks} rank(s) (CPU run)"


def choose_micro_batch(cfg: TrainConfig, model: ModelConfig, dp_world_size: int, zero: ZeroLayout, *, device: str | None = None,
                       memory: tuple[int | None, str] | None = None, resumed_micro_batch: int | None = None) -> MicroBatchChoice:
    """The run's micro-batch: the config's number, or for `auto` the checkpoint's (`resumed_micro_batch`, from its
    saved DeepSpeed config) while it still divides the per-rank batch, else the largest power of two dividing every
    per-rank batch whose `estimate_peak_memory` fits `MEMORY_FRACTION` of `memory` ((bytes, description);
    default: `device_memory`) under `zero`, the ZeRO layout (stage, reduce bucket, offload) the run will have.
    `dp_world_size` ranks read rows; with N = `parallel.sequence_parallel_size` ranks holding each row there are
    dp_world_size x N ranks in all, each with seq_len / N tokens of its micro-batch's rows."""
    sp_size = cfg.parallel.sequence_parallel_size
    size = cfg.batch.micro_batch_size
    if size != AUTO:
        return MicroBatchChoice(size=size, chosen_by="config")
    device = device or device_type()

    def estimate(m: int) -> MemoryEstimate:
        return estimate_peak_memory(model, micro_batch=m, seq_len=cfg.batch.seq_len, precision=cfg.precision,
                                    zero_stage=zero.stage, dp_world_size=dp_world_size * sp_size,
                                    compiled=model.compiles_blocks(device), reduce_bucket_size=zero.reduce_bucket_size,
                                    optimizer_on_host=zero.optimizer_on_host, params_on_host=zero.params_on_host,
                                    sequence_parallel=sp_size)

    total, description = memory or device_memory(device, dp_world_size * sp_size)
    budget = int(MEMORY_FRACTION * total) if total else None
    rows = per_rank_batches(cfg, dp_world_size)
    divisor = math.gcd(*rows)
    saved = resumed_micro_batch
    if isinstance(saved, int) and saved > 0:
        if divisor % saved == 0:
            return MicroBatchChoice(size=saved, chosen_by="checkpoint", estimate=estimate(saved), budget=budget, device=description,
                                    note="an explicit batch.micro_batch_size changes it")
        log.info("batch.micro_batch_size auto: the checkpoint's %d does not divide this run's %s rows per rank; choosing again",
                 saved, "/".join(map(str, rows)))
    candidates = [1 << k for k in range(divisor.bit_length()) if divisor % (1 << k) == 0]
    if budget is None:
        return MicroBatchChoice(size=1, chosen_by="auto", estimate=estimate(1), budget=None, device=description,
                                note="the device's memory is unknown, so the smallest")
    fitting = [m for m in candidates if estimate(m).total <= budget]
    chosen = fitting[-1] if fitting else 1
    larger = next((m for m in candidates if m > chosen), None)
    note = ""
    if not fitting:
        note = ("even 1 exceeds the budget: expect to run out of memory unless the estimate is pessimistic; "
                "model.activation_checkpointing, more GPUs or CPU offload reduce it")
    elif larger is None and divisor == chosen:
        note = f"all {chosen} rows per rank in one micro-batch"
    return MicroBatchChoice(size=chosen, chosen_by="auto", estimate=estimate(chosen),
                            larger=(larger, estimate(larger)) if larger else None, budget=budget, device=description, note=note)


@dataclass
class RolloutEstimate:
    """One rank's estimated peak during an RL rollout (`olmo_ds.train.rl.rollout`), in bytes, by part: the training
    state that stays resident, the whole-weights copy the decode engine runs on, its KV cache, and the largest module
    gathered while the copy is built."""

    model_state: int
    decode_copy: int
    kv_cache: int
    gathered: int

    @property
    def total(self) -> int:
        return self.model_state + self.decode_copy + self.kv_cache + self.gathered

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.1f}"  # noqa: E731
        return (f"{g(self.total)} GiB (resident model state {g(self.model_state)} + the decode copy {g(self.decode_copy)} + "
                f"KV cache {g(self.kv_cache)} + one gathered module {g(self.gathered)})")


def estimate_rollout_memory(model: ModelConfig, *, generation_batch: int, max_len: int, precision: str = "bf16",
                            zero_stage: int = 3, dp_world_size: int = 1, decode_bytes: int = 2) -> RolloutEstimate:
    """The rollout's peak on one rank: ZeRO's partitioned weights, gradients and optimizer state stay where they are
    (`estimate_peak_memory`'s model state), the decode copy holds every parameter in `decode_bytes` (bf16 on a GPU),
    the KV cache holds `generation_batch` sequences of up to `max_len` tokens (the decode engine's
    `bytes_per_sequence`), and gathering the copy holds one module's whole weights in the training dtype at a time
    (the largest: the embedding or the head)."""
    state = estimate_peak_memory(model, micro_batch=1, seq_len=1, precision=precision, zero_stage=zero_stage,
                                 dp_world_size=dp_world_size).model_state
    lp = 4 if precision == "fp32" else 2
    kv = generation_batch * bytes_per_sequence(model, max_len, torch.bfloat16 if decode_bytes == 2 else torch.float32)
    gathered = lp * max(model.padded_vocab_size * model.d_model, block_params(model)) if zero_stage == 3 else 0
    return RolloutEstimate(int(state), decode_bytes * model.num_params(), int(kv), int(gathered))
