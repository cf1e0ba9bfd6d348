"""The train config: one YAML file plus dotted `--set a.b=c` overrides, parsed into typed dataclasses.

Every number a run depends on lives here once (batch sizes, precision, clipping, optimizer fields);
the DeepSpeed JSON's `"auto"` fields are filled from it (see `ds_config.py`). Parsing is strict: an
unknown key is an error that names the file, the line and the nearest valid key, because a typo in a
1,000-GPU job's config should cost seconds, not a run.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from olmo_ds.data.config import DataConfig
from olmo_ds.data.order import BatchSizeSchedule
from olmo_ds.model.config import INIT_CHANGEABLE, PRESETS, ModelConfig, preset
from olmo_ds.model.loss import KL_ESTIMATORS, PREFERENCE_LOSSES
from olmo_ds.model.sequence_parallel import sequence_parallel_problems

PRECISIONS = ("bf16", "fp16", "fp32")
SCHEDULES = ("cosine", "linear", "wsd", "constant")


class ConfigError(ValueError):
    """A train config that cannot run; the message names the key, file and line where known."""


@dataclass
class ModelSpec:
    """A named preset plus field overrides; `vocab_size` defaults to the tokenizer's."""

    preset: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)

    def build(self, vocab_size: int | None = None) -> ModelConfig:
        fields = dict(self.overrides)
        if "vocab_size" not in fields and vocab_size is not None:
            fields["vocab_size"] = vocab_size
        return preset(self.preset, **fields)


@dataclass
class BatchRamp:
    """One step of the global batch-size schedule: from optimizer step `step` on, use `global_batch_size`."""

    step: int
    global_batch_size: int


@dataclass
class BatchConfig:
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks (RL: prompts, G samples each)
    # Sequences per rank per forward/backward, or auto: the largest power of two that divides the rows per rank and
    # whose estimated peak memory fits 80% of the GPU (olmo_ds/train/memory.py); chosen at start, logged, kept on resume.
    # RL: packed rows of samples; each rollout pads its rows to whole micro-batches, so any number divides them.
    micro_batch_size: int | str = 1
    seq_len: int = 256
    # Optional batch-size warm-up, e.g. [{step: 0, global_batch_size: 4}, {step: 100, global_batch_size: 8}];
    # the last entry's size must equal global_batch_size (the size the run ends with).
    schedule: list[BatchRamp] = field(default_factory=list)

    def size_schedule(self) -> BatchSizeSchedule:
        """The global batch size per step: the one rule the data order, the loader and DeepSpeed's config share."""
        return BatchSizeSchedule.parse([(r.step, r.global_batch_size) for r in self.schedule] or self.global_batch_size)


@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    z_loss: float = 0.0  # coefficient of the z-loss (OLMo 2 uses 1e-5)
    decay_embeddings: bool = False  # OLMo 2: no weight decay on embeddings
    decay_norms: bool = False  # nor on norm weights
    max_nonfinite_in_a_row: int = 5  # abort after this many consecutive skipped (non-finite) steps


@dataclass
class ScheduleConfig:
    kind: str = "cosine"  # cosine | linear | wsd | constant (each after linear warmup)
    warmup_steps: int = 0
    decay_steps: int = 0  # wsd only: length of the final decay phase
    final_lr_fraction: float = 0.1  # lr at the end, as a fraction of optim.lr


@dataclass
class CheckpointConfig:
    every: int = 1000  # save every N optimizer steps (0 = only at the end)
    keep_last: int = 3  # keep the newest N checkpoints
    keep_every: int = 0  # additionally keep every checkpoint whose step is a multiple of this (0 = none)
    save_final: bool = True
    # auto: on GPUs, write in the background (training blocked only for the copy to host memory) when every
    # rank's copy fits in host memory, else block | always | never (olmo_ds/checkpoint/async_save.py)
    async_save: str = "auto"


ASYNC_SAVE = ("auto", "always", "never")


@dataclass
class LoggingConfig:
    every: int = 10  # console line, metrics.jsonl and TensorBoard every N steps
    tensorboard: bool = True
    wandb: bool = False  # also log to Weights & Biases (rank 0; `pip install -e '.[wandb]'`); one W&B run per run directory, across resumes
    wandb_project: str = "olmo-ds"  # the W&B project; entity, mode and key come from WANDB_* environment variables
    peak_tflops: float | None = None  # per-device peak for MFU; None = from the device name


@dataclass
class EvalConfig:
    every: int = 0  # in-loop evaluation every N steps and at the end (0 = never)
    at_start: bool = False  # also evaluate before step 1 (logged at step 0) when the run starts fresh (not on resume)
    max_batches: int = 8  # validation batches (of batch.micro_batch_size rows) per rank and source
    tasks: list[str] = field(default_factory=list)  # task directories/files, or names under task_dirs
    task_dirs: list[str] = field(default_factory=list)  # where task names are looked up (default: $OLMO_DS_TASK_DIRS)
    task_limit: int = 200  # first N questions of each task (0 = all)
    batching: str = "packed"  # packed (rows of one shape, compiled blocks) | exact (the earlier eager path, same numbers)


@dataclass
class ParallelConfig:
    # Ranks that hold each row between them (Ulysses sequence parallelism, olmo_ds/model/sequence_parallel.py): each
    # keeps seq_len / N tokens of every row and attention trades tokens for heads by all-to-all. The world size is
    # data-parallel x this; 1 = every rank holds whole rows.
    sequence_parallel_size: int = 1


@dataclass
class InitFromConfig:
    """Start a new run from existing weights (fine-tuning, mid-training, context extension).

    A run's own checkpoint always wins: `--resume auto` on a run dir that has one ignores this.
    """

    path: str | None = None  # an olmo-ds checkpoint or run dir, our model dir (import_hf.py), a transformers dir, or a hub id
    load_optimizer: bool = False  # also the optimizer state (olmo-ds checkpoints only); schedule and data still start fresh
    allow_changes: list[str] = field(default_factory=list)  # model fields that may differ from the source: max_seq_len, yarn, rope_theta, sliding_rope_theta, sliding_yarn


@dataclass
class DPOConfig:
    """Preference tuning (`olmo_ds/model/loss.py: preference_loss` has the formulas). A run on preference data needs
    this section, and this section needs preference data (`olmo_ds/train/plan.py`)."""

    loss: str = "dpo"  # dpo | dpo_norm (length-normalised, OLMo 3 Instruct's) | ipo | simpo (no reference pass)
    beta: float = 0.1  # the KL penalty's inverse temperature: > 0
    label_smoothing: float = 0.0  # conservative DPO's eps, in [0, 0.5): the chance a preference label is flipped
    simpo_gamma: float = 0.0  # simpo only: the target reward margin gamma (>= 0)

    def validate(self, where: str) -> None:
        if self.loss not in PREFERENCE_LOSSES:
            raise ConfigError(f"{where}: dpo.loss {self.loss!r} is not one of {', '.join(PREFERENCE_LOSSES)}")
        if not self.beta > 0:
            raise ConfigError(f"{where}: dpo.beta must be > 0, got {self.beta} (it scales the reward; OLMo 3 Instruct used 5 with dpo_norm)")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise ConfigError(f"{where}: dpo.label_smoothing must be in [0, 0.5), got {self.label_smoothing}")
        if self.label_smoothing and self.loss == "ipo":
            raise ConfigError(f"{where}: dpo.label_smoothing {self.label_smoothing} has no meaning for dpo.loss ipo (a squared loss)")
        if self.simpo_gamma < 0:
            raise ConfigError(f"{where}: dpo.simpo_gamma must be >= 0, got {self.simpo_gamma}")
        if self.simpo_gamma and self.loss != "simpo":
            raise ConfigError(f"{where}: dpo.simpo_gamma {self.simpo_gamma} is used by dpo.loss simpo only (loss is {self.loss!r})")

    @property
    def needs_reference(self) -> bool:
        """Whether the loss compares against the starting model (every kind but simpo)."""
        return self.loss != "simpo"


TRUNCATED = ("keep", "mask", "penalty")


@dataclass
class RLConfig:
    """Reinforcement learning with verifiable rewards: GRPO as open-instruct's OlmoRL (`olmo_ds/train/rl/grpo.py`; the loss's
    formulas in `olmo_ds/model/loss.py: grpo_loss`). A run on RL prompts needs this section, and this section needs them
    (`olmo_ds/train/plan.py`). The global batch size counts prompts; each gets `samples_per_prompt` samples."""

    samples_per_prompt: int = 8  # G samples per prompt (>= 2: the advantage is a reward minus its group's mean)
    max_new_tokens: int = 512  # a sample's generated tokens at most; a prompt plus these must fit batch.seq_len
    temperature: float = 1.0  # sampling temperature (> 0); the training forward's log-probabilities use it too
    updates_per_rollout: int = 1  # optimizer updates per rollout, each on 1/K of its prompts (open-instruct's num_mini_batches)
    clip_low: float | None = 0.2  # PPO clip: the ratio is kept >= 1 - clip_low, in [0, 1); null with clip_high: no clip
    clip_high: float | None = 0.272  # ... and <= 1 + clip_high, > 0 (DAPO's clip-higher: above clip_low)
    tis_cap: float | None = 2.0  # truncated importance sampling's cap on pi_train_old / pi_decode (> 1); null or 0: off
    beta: float = 0.0  # the KL penalty's weight (OLMo 3: 0); > 0 holds init_from's weights as the reference, scored per rollout
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman's estimators; open-instruct's kl_estimator 0 | 1 | 2)
    normalize_advantage_std: bool = False  # divide each group's advantages by its reward std (+1e-8): open-instruct's "standard"
    generation_batch_size: int = 64  # sequences the decode engine holds at once
    seed: int = 0  # keys every sample's random stream with (step, prompt, sample): the same samples on resume
    top_p: float = 1.0  # nucleus sampling for rollouts, in (0, 1]; the importance weight divides by the nucleus's probability
    stop: list[str] = field(default_factory=list)  # strings that end a sample (finish "stop"), besides the EOS and turn end
    truncated: str = "keep"  # samples cut at max_new_tokens (finish "length"): keep | mask (no gradient) | penalty
    truncated_reward: float = 0.0  # with truncated: penalty, a cut sample's reward (open-instruct's non_stop_penalty_value)
    active_sampling_draws: int = 0  # 0: off; N: up to N more draws of prompts a step until it holds a full batch of groups with signal
    verifier_timeout: float = 30.0  # seconds a verifier may take on one sample before it scores 0 (reason "timeout")
    samples_every: int = 10  # write RUN/samples/step-N.jsonl at steps 1-5, then every this many steps; 0: never
    actor_ranks: int = 0  # the launch's last N ranks only generate (olmo_ds/train/rl/actors.py); 0: every rank learns and generates
    async_steps: int = 0  # 0: synchronous steps; A: in-flight rollouts, prompts decoded up to A steps ahead of training

    def validate(self, where: str) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{where}: rl.{key} {why}")

        for key in ("samples_per_prompt", "max_new_tokens", "updates_per_rollout", "generation_batch_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad(key, f"must be a positive integer, got {value!r}")
        if self.samples_per_prompt < 2:
            raise bad("samples_per_prompt", f"must be >= 2, got {self.samples_per_prompt}: a sample's advantage is its reward "
                      f"minus its group's mean, which one sample alone makes 0 (OLMo 3 used 8)")
        if not self.temperature > 0:
            raise bad("temperature", f"must be > 0, got {self.temperature} (a rollout samples; OLMo 3 used 1.0)")
        if (self.clip_low is None) != (self.clip_high is None):
            raise bad("clip_low" if self.clip_low is None else "clip_high", "is null but the other clip bound is set: "
                      "set both (e.g. clip_low: 0.2, clip_high: 0.272) or both null (no clipping)")
        if self.clip_low is not None and not 0 <= self.clip_low < 1:
            raise bad("clip_low", f"must be in [0, 1), got {self.clip_low} (the ratio's floor is 1 - clip_low)")
        if self.clip_high is not None and not self.clip_high > 0:
            raise bad("clip_high", f"must be > 0, got {self.clip_high} (the ratio's ceiling is 1 + clip_high)")
        if self.tis_cap is not None and self.tis_cap != 0 and not self.tis_cap > 1:
            raise bad("tis_cap", f"must be > 1, or 0 / null to turn truncated importance sampling off, got {self.tis_cap}")
        if not self.beta >= 0:
            raise bad("beta", f"must be >= 0, got {self.beta} (0: no KL penalty, as OLMo 3)")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise bad("kl_estimator", f"{self.kl_estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
        if not 0 <= self.seed < 2 ** 31:
            raise bad("seed", f"must be in [0, 2**31), got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1] (1: no nucleus), got {self.top_p}")
        if not isinstance(self.stop, list) or not all(isinstance(x, str) and x for x in self.stop):
            raise bad("stop", f"must be a list of non-empty strings, got {self.stop!r}")
        if self.truncated not in TRUNCATED:
            raise bad("truncated", f"{self.truncated!r} is not one of {', '.join(TRUNCATED)} (what a sample cut at max_new_tokens trains as)")
        for key in ("active_sampling_draws", "samples_every", "actor_ranks", "async_steps"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(key, f"must be an integer >= 0 (0: off), got {value!r}")
        if not self.verifier_timeout > 0:
            raise bad("verifier_timeout", f"must be > 0 seconds, got {self.verifier_timeout}")
        if self.actor_ranks and self.active_sampling_draws:
            raise bad("actor_ranks", f"{self.actor_ranks} with rl.active_sampling_draws {self.active_sampling_draws}: actor ranks draw "
                      "a step's prompts once; set one of them to 0")
        if self.async_steps and self.active_sampling_draws:
            raise bad("async_steps", f"{self.async_steps} with rl.active_sampling_draws {self.active_sampling_draws}: an extra draw "
                      f"decides its prompts from the step's rewards, after its samples are in, which samples decoded ahead of "
                      f"training cannot wait for; set one of them to 0")

    @property
    def cap(self) -> float | None:
        """The truncated importance sampling cap, None when off."""
        return self.tis_cap or None


@dataclass
class TrainConfig:
    run_dir: str = "runs/default"
    seed: int = 0
    max_steps: int = 1000
    tokenizer: str | None = None  # tokenizer.json / .model / hub id (allenai/dolma2-tokenizer); its vocab sizes the model when unset
    deepspeed_config: str = "ds_configs/zero3_bf16.json"
    # KEY=VALUE edits of the DeepSpeed JSON as it is read, e.g. "zero_optimization.reduce_bucket_size=500000000"
    # (to try a knob without copying the file); the train config's own fields are still checked against them.
    deepspeed_overrides: list[str] = field(default_factory=list)
    precision: str = "bf16"  # bf16 | fp16 | fp32 (fills the DeepSpeed config's "auto" fields)
    deterministic: bool = False  # bitwise-reproducible kernels (slower on GPU; CPU runs are anyway)
    model: ModelSpec = field(default_factory=ModelSpec)
    init_from: InitFromConfig = field(default_factory=InitFromConfig)
    data: DataConfig = field(default_factory=DataConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    dpo: DPOConfig | None = None  # preference tuning; required with (and only with) preference data
    rl: RLConfig | None = None  # RL with verifiable rewards (GRPO); required with (and only with) RL prompt data
    source: str = field(default="<defaults>", metadata={"internal": True})  # where it was read from, for messages
    path: str | None = field(default=None, metadata={"internal": True})  # the YAML file, when read from one

    def with_micro_batch_size(self, size: int) -> "TrainConfig":
        """This config with `batch.micro_batch_size` set (what `auto` resolved to)."""
        return dataclasses.replace(self, batch=dataclasses.replace(self.batch, micro_batch_size=size))

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        d.pop("path")
        model = d.pop("model")
        d["model"] = {"preset": model["preset"], **model["overrides"]}
        return d

    def warnings(self) -> list[str]:
        """Settings that run, but probably not as meant; the trainer logs them at start-up."""
        found = []
        s = self.schedule
        if s.warmup_steps > self.max_steps and s.kind != "wsd":
            found.append(f"{self.source}: schedule.warmup_steps {s.warmup_steps} exceeds max_steps {self.max_steps}: the run ends "
                         f"during warm-up, at {self.max_steps / s.warmup_steps:.1%} of optim.lr (a short trial of a long config?)")
        return found

    def validate(self) -> None:
        """Checks that need only the config itself (no files, no devices)."""
        where = self.source
        if self.precision not in PRECISIONS:
            raise ConfigError(f"{where}: precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        if self.model.preset not in PRESETS:
            raise ConfigError(f"{where}: model.preset {self.model.preset!r} is unknown; choose one of: {', '.join(PRESETS)}")
        if self.max_steps <= 0:
            raise ConfigError(f"{where}: max_steps must be > 0, got {self.max_steps}")
        b = self.batch
        for name in ("global_batch_size", "seq_len"):
            if getattr(b, name) <= 0:
                raise ConfigError(f"{where}: batch.{name} must be > 0, got {getattr(b, name)}")
        if b.micro_batch_size != "auto":
            if not isinstance(b.micro_batch_size, int):
                raise ConfigError(f"{where}: batch.micro_batch_size must be a positive integer or auto, got {b.micro_batch_size!r}")
            if b.micro_batch_size <= 0:
                raise ConfigError(f"{where}: batch.micro_batch_size must be > 0, got {b.micro_batch_size} (or auto: chosen from memory)")
        try:
            b.size_schedule()
        except ValueError as e:
            raise ConfigError(f"{where}: batch.schedule: {e}") from None
        if b.schedule and b.schedule[-1].global_batch_size != b.global_batch_size:
            raise ConfigError(
                f"{where}: the last batch.schedule entry's global_batch_size {b.schedule[-1].global_batch_size} "
                f"differs from batch.global_batch_size {b.global_batch_size}; the run ends at batch.global_batch_size"
            )
        if self.checkpoint.async_save not in ASYNC_SAVE:
            raise ConfigError(f"{where}: checkpoint.async_save {self.checkpoint.async_save!r} is not one of {', '.join(ASYNC_SAVE)}")
        bad = sorted(set(self.init_from.allow_changes) - set(INIT_CHANGEABLE))
        if bad:
            raise ConfigError(f"{where}: init_from.allow_changes {bad}: only {', '.join(INIT_CHANGEABLE)} may differ from the "
                              f"weights a run starts from (the rest shape the weights or what they compute)")
        if self.init_from.load_optimizer and not self.init_from.path:
            raise ConfigError(f"{where}: init_from.load_optimizer is set but init_from.path is not")
        s = self.schedule
        if s.kind not in SCHEDULES:
            raise ConfigError(f"{where}: schedule.kind {s.kind!r} is not one of {', '.join(SCHEDULES)}")
        if not 0.0 <= s.final_lr_fraction <= 1.0:
            raise ConfigError(f"{where}: schedule.final_lr_fraction must be in [0, 1], got {s.final_lr_fraction}")
        if s.warmup_steps < 0 or s.decay_steps < 0:
            raise ConfigError(f"{where}: schedule.warmup_steps and schedule.decay_steps must be >= 0")
        if s.kind == "wsd":
            if s.decay_steps <= 0:
                raise ConfigError(f"{where}: schedule.kind wsd needs schedule.decay_steps > 0")
            if s.warmup_steps + s.decay_steps > self.max_steps:
                raise ConfigError(
                    f"{where}: schedule.warmup_steps {s.warmup_steps} + schedule.decay_steps {s.decay_steps} "
                    f"exceeds max_steps {self.max_steps}"
                )
        elif s.decay_steps:
            raise ConfigError(f"{where}: schedule.decay_steps is only used by schedule.kind wsd (kind is {s.kind!r})")
        o = self.optim
        if o.lr <= 0:
            raise ConfigError(f"{where}: optim.lr must be > 0, got {o.lr}")
        if o.grad_clip < 0:
            raise ConfigError(f"{where}: optim.grad_clip must be >= 0, got {o.grad_clip}")
        if o.max_nonfinite_in_a_row < 1:
            raise ConfigError(f"{where}: optim.max_nonfinite_in_a_row must be >= 1")
        c = self.checkpoint
        if c.every < 0 or c.keep_last < 1 or c.keep_every < 0:
            raise ConfigError(f"{where}: checkpoint.every >= 0, checkpoint.keep_last >= 1, checkpoint.keep_every >= 0 required")
        if self.eval.every < 0 or self.eval.max_batches < 1 or self.eval.task_limit < 0:
            raise ConfigError(f"{where}: eval.every >= 0, eval.max_batches >= 1, eval.task_limit >= 0 required")
        if self.eval.batching not in ("packed", "exact"):
            raise ConfigError(f"{where}: eval.batching must be packed or exact, got {self.eval.batching!r}")
        if self.logging.every <= 0:
            raise ConfigError(f"{where}: logging.every must be > 0")
        if not self.data.sources:
            raise ConfigError(f"{where}: data.sources is empty; list at least one shard directory (data.sources: [{{path: ...}}])")
        try:
            model = self.model.build()
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: model: {e}") from None
        sp = self.parallel.sequence_parallel_size
        if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1:
            raise ConfigError(f"{where}: parallel.sequence_parallel_size must be a positive integer, got {sp!r}")
        if self.dpo is not None:
            self.dpo.validate(where)
            if sp > 1:
                raise ConfigError(f"{where}: dpo with parallel.sequence_parallel_size {sp}: a reply's log-probability is a sum over "
                                  f"its whole row, which sequence parallelism splits over ranks; use 1")
        if self.rl is not None:
            self.rl.validate(where)
            if self.dpo is not None:
                raise ConfigError(f"{where}: rl and dpo are both set: a run trains one objective; keep the one its data is for")
            fewest = min([b.global_batch_size] + [r.global_batch_size for r in b.schedule])
            if self.rl.updates_per_rollout > fewest:
                raise ConfigError(f"{where}: rl.updates_per_rollout {self.rl.updates_per_rollout} exceeds the {fewest} prompts of a "
                                  f"step (batch.global_batch_size{' schedule' if b.schedule else ''}): each update trains 1/K of "
                                  f"the step's prompts, so some would have none; lower it or raise the batch")
            if self.rl.max_new_tokens >= b.seq_len:
                raise ConfigError(f"{where}: rl.max_new_tokens {self.rl.max_new_tokens} leaves no room for a prompt in batch.seq_len "
                                  f"{b.seq_len} (a prompt plus its sample is one training row): raise batch.seq_len or lower rl.max_new_tokens")
            if self.rl.async_steps and sp > 1:
                raise ConfigError(f"{where}: rl.async_steps {self.rl.async_steps} with parallel.sequence_parallel_size {sp}: the "
                                  f"ranks of a sequence group split each step's samples and gather them, which a decoder running "
                                  f"ahead on each rank does not; use rl.async_steps 0 or parallel.sequence_parallel_size 1")
            if not self.init_from.path:
                raise ConfigError(f"{where}: rl needs init_from.path: RL starts from a model that can already answer (an SFT or "
                                  f"DPO run's checkpoint, or released weights), not from random weights")
        problems = sequence_parallel_problems(sp, n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, seq_len=b.seq_len)
        if problems:
            raise ConfigError(f"{where}: parallel.sequence_parallel_size {sp}: " + "; ".join(problems))
        if model.float8 != "off":
            if self.precision == "fp16":
                raise ConfigError(f"{where}: model.float8 {model.float8!r} with precision fp16: torchao's float8 recipes are made "
                                  f"for bf16 training, and fp16 adds DeepSpeed's loss scaling, which olmo-ds has not verified "
                                  f"with FP8; use precision bf16 (or model.float8: \"off\")")
            if b.seq_len % (16 * sp):
                spread = f" / parallel.sequence_parallel_size {sp}, a rank's share of a row," if sp > 1 else ""
                raise ConfigError(f"{where}: model.float8 {model.float8!r} needs batch.seq_len{spread} to be a multiple of 16 (a "
                                  f"micro-batch's tokens are the inner dimension of the FP8 weight-gradient matmul), got {b.seq_len}")


# --- parsing -------------------------------------------------------------------------------------


def _key_lines(node: yaml.Node, prefix: str = "") -> dict[str, int]:
    """Dotted key -> 1-based line number, from the YAML node tree (for error messages)."""
    lines: dict[str, int] = {}
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            path = f"{prefix}{k.value}"
            lines[path] = k.start_mark.line + 1
            lines.update(_key_lines(v, path + "."))
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            lines.update(_key_lines(v, f"{prefix[:-1]}[{i}]."))
    return lines


class _Parser:
    def __init__(self, source: str, lines: dict[str, int]):
        self.source = source
        self.lines = lines

    def where(self, path: str) -> str:
        line = self.lines.get(path)
        return f"{self.source}:{line}" if line else self.source

    def error(self, path: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.where(path)}: {path}: {msg}")

    def unknown(self, path: str, key: str, valid: list[str]) -> ConfigError:
        full = f"{path}{key}"
        near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
        hint = f"; did you mean '{path}{near[0]}'?" if near else f"; valid keys here: {', '.join(sorted(valid))}"
        return ConfigError(f"{self.where(full)}: unknown key {full!r}{hint}")

    def value(self, tp, raw, path: str):
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            if raw is None and type(None) in args:
                return None
            inner = [a for a in args if a is not type(None)]
            # The first member type that takes the value (`bool | str`: true, or "every_k:2"), else the first's error.
            errors = []
            for member in inner:
                try:
                    return self.value(member, raw, path)
                except ConfigError as e:
                    errors.append(e)
            raise errors[0]
        if tp is Any:
            return raw
        if dataclasses.is_dataclass(tp):
            return self.dataclass(tp, raw, path)
        if origin is list:
            if not isinstance(raw, list):
                raise self.error(path, f"expected a list, got {raw!r}")
            return [self.value(args[0], item, f"{path}[{i}]") for i, item in enumerate(raw)]
        if origin is tuple:
            if not isinstance(raw, (list, tuple)) or len(raw) != len(args):
                raise self.error(path, f"expected a list of {len(args)} values, got {raw!r}")
            return tuple(self.value(a, r, f"{path}[{i}]") for i, (a, r) in enumerate(zip(args, raw)))
        if origin is dict:
            if not isinstance(raw, dict):
                raise self.error(path, f"expected a mapping, got {raw!r}")
            return dict(raw)
        if tp is bool:
            if not isinstance(raw, bool):
                raise self.error(path, f"expected true or false, got {raw!r}")
            return raw
        if tp is int:
            if isinstance(raw, bool) or not isinstance(raw, int):
                if isinstance(raw, float) and raw.is_integer():
                    return int(raw)
                raise self.error(path, f"expected an integer, got {raw!r}")
            return raw
        if tp is float:
            # YAML 1.1 reads `3e-4` (no dot) as a string: accept any numeric spelling.
            if isinstance(raw, bool):
                raise self.error(path, f"expected a number, got {raw!r}")
            try:
                return float(raw)
            except (TypeError, ValueError):
                raise self.error(path, f"expected a number, got {raw!r}") from None
        if tp is str:
            if isinstance(raw, bool):
                # YAML 1.1 reads an unquoted on/off/yes/no as a boolean (`document_masking: yes`).
                raise self.error(path, f"expected a string, got {raw!r}; quote the value (e.g. \"off\")")
            if not isinstance(raw, (str, int, float)):
                raise self.error(path, f"expected a string, got {raw!r}")
            return str(raw)
        raise self.error(path, f"unsupported type {tp}")

    def dataclass(self, cls, raw, path: str):
        prefix = f"{path}." if path else ""
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise self.error(path, f"expected a mapping, got {raw!r}")
        if cls is ModelSpec:
            return self.model(raw, prefix)
        hints = typing.get_type_hints(cls)
        fields = [f for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
        names = [f.name for f in fields]
        kwargs = {}
        for key, val in raw.items():
            if key not in names:
                raise self.unknown(prefix, str(key), names)
            kwargs[key] = self.value(hints[key], val, f"{prefix}{key}")
        try:
            return cls(**kwargs)
        except (TypeError, ValueError) as e:
            raise self.error(path, str(e)) from None

    def model(self, raw: dict, prefix: str) -> ModelSpec:
        hints = typing.get_type_hints(ModelConfig)
        names = ["preset", *hints]
        overrides = {}
        for key, val in raw.items():
            if key not in names:
                raise self.unknown(prefix, str(key), names)
            if key != "preset":
                overrides[key] = self.value(hints[key], val, f"{prefix}{key}")
        name = self.value(str, raw.get("preset", "tiny"), f"{prefix}preset")
        return ModelSpec(preset=name, overrides=overrides)


def apply_override(tree: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` (value parsed as YAML) to a nested dict, creating mappings as needed."""
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set optim.lr=3e-4")
    key, _, text = assignment.partition("=")
    parts = key.strip().split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {assignment!r}: {part!r} is not a mapping")
        node = child
    node[parts[-1]] = yaml.safe_load(text) if text.strip() else None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read a train config YAML (or the defaults) and apply `--set` overrides; validate it."""
    tree: dict = {}
    lines: dict[str, int] = {}
    source = "<defaults>"
    if path is not None:
        path = Path(path)
        source = str(path)
        if not path.is_file():
            raise ConfigError(f"train config {path} does not exist")
        text = path.read_text()
        try:
            node = yaml.compose(text)
            tree = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, batch:, ...)")
        lines = _key_lines(node) if node is not None else {}
    for assignment in overrides:
        apply_override(tree, assignment)
    if overrides:
        source += " (with --set overrides)"
    cfg = _Parser(source, lines).dataclass(TrainConfig, tree, "")
    cfg.source = source
    cfg.path = str(path) if path is not None else None
    cfg.validate()
    return cfg


def config_from_dict(tree: dict, source: str = "<dict>") -> TrainConfig:
    """A TrainConfig from an already-parsed mapping (e.g. the resolved config in train_state.json)."""
    cfg = _Parser(source, {}).dataclass(TrainConfig, tree, "")
    cfg.source = source
    cfg.validate()
    return cfg
