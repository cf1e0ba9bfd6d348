"""The pretraining loop on DeepSpeed: engine, step, checkpoints, progress, preemption.

    trainer = Trainer(plan_run(load_config("configs/demo.yaml"), resume="auto"))   # or Trainer.from_config(cfg, resume="auto")
    trainer.fit()                      # or, for a benchmark: trainer.train_step(trainer.loader.next_batch())

Everything that can be wrong with a run is checked before the model is built, by `olmo_ds.train.plan.plan_run`
(a `ConfigError` naming both sides of a mismatch), so a 1,000-GPU job fails in seconds rather than after its
first checkpoint; `Trainer(plan)` builds the engine the plan describes and trains. One optimizer step is
`train_step`: this rank's rows of the global batch are cut into micro-batches, each forward/backward through
the engine, and DeepSpeed steps at the accumulation boundary; a step whose loss or gradients are not finite is
skipped by DeepSpeed (its overflow check discards the gradients) and counted here, and never saved
(`olmo_ds.train.nonfinite` says why it probably happened when the run stops on it).

What a micro-batch's loss is, and what a step counts before its first forward and logs after it, is the
objective's (`olmo_ds.train.objective`): pretraining's mean per micro-batch, fine-tuning's trained-token mean of
the global batch, sequence parallelism's slices of every row.

SIGTERM, SIGUSR1 (preemption), SIGINT (Ctrl-C) and the launcher's exit (`launch.watch_launcher`) all stop the
run the same way: the ranks agree at the next step's start, save a checkpoint and exit.
"""

from __future__ import annotations

import collections
import gc
import logging
import math
import os
import random
import shutil
import signal
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.profiler import record_function

from olmo_ds import checkpoint as ckpt
from olmo_ds.checkpoint.async_save import AsyncSaveError, AsyncSaver, host_copy_fits, snapshot_bytes_estimate
from olmo_ds.model import OLMo
from olmo_ds.model.float8 import MATMULS_PER_BLOCK
from olmo_ds.model.model import BLOCK_CALLS, make_blocks_zero3_leaves
from olmo_ds.ranks import local_world_size
from olmo_ds.train.config import ConfigError, TrainConfig
from olmo_ds.train.ds_config import device_type
from olmo_ds.train.engine_state import init_record, init_weights, load_engine_state
from olmo_ds.train.launch import init_distributed, launcher_gone
from olmo_ds.train.metrics import MetricsLogger, console_line, memory_gib, peak_tflops, tensorboard_purge_step
from olmo_ds.train.nonfinite import nonfinite_report
from olmo_ds.train.objective import build_objective
from olmo_ds.train.optim import param_groups, set_lr
from olmo_ds.train.parallel import sequence_group
from olmo_ds.train.plan import RunPlan, plan_run
from olmo_ds.train.schedule import lr_at

log = logging.getLogger("olmo_ds")

# DeepSpeed 0.19 calls these deprecated torch collectives on every ZeRO gather/reduce-scatter; one
# warning per call would bury the progress lines, and there is nothing a user can do about it.
warnings.filterwarnings("ignore", message=r".*(reduce_scatter_tensor|all_gather_into_tensor).*deprecated", category=FutureWarning)


class NonFiniteLossError(RuntimeError):
    """The run stopped on a non-finite loss or gradient (too many in a row, or at its last step); nothing non-finite was saved."""


# Why a run stops early, as the number the ranks agree on (`_stop_requested`, the largest wins): the signal's,
# and one past every signal for the launcher's exit, which outranks them (it names the cause).
LAUNCHER_GONE = 128
STOP_STATUS = {signal.SIGINT: "interrupted"}  # the others: "preempted"


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, quota, I/O error); the previous complete one is untouched."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def configure_determinism(deterministic: bool) -> None:
    """Bitwise-repeatable kernels when asked (CPU runs are repeatable either way)."""
    if not deterministic:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False


class Trainer:
    """See the module docstring."""

    def __init__(self, plan: RunPlan):
        self.plan = plan
        self.cfg = cfg = plan.cfg
        self.rank, self.world_size, self.run_dir = plan.rank, plan.world_size, plan.run_dir
        self.model_cfg, self.tokenizer, self.loader, self.evaluator = plan.model, plan.tokenizer, plan.loader, plan.evaluator
        self.ds_config, self.micro_batch = plan.deepspeed.config, plan.deepspeed.micro_batch
        self.resume_dir, self.resume_state, self.init_info = plan.resume_dir, plan.resume_state, plan.init_from
        self.init_record = self.resume_state.get("init_from") if self.resume_state else None

        configure_determinism(cfg.deterministic)
        init_distributed(plan.deepspeed.optimizer_op)  # announces the DeepSpeed ops a first start compiles
        self.layout = plan.layout
        self.sp = sequence_group(plan.layout)  # this rank's sequence group, None without sequence parallelism
        seed_everything(cfg.seed)  # the same on every rank: ZeRO-3 initialises each weight whole, then partitions it
        self.engine = self._build_engine()
        self.device = self.engine.device
        self.remover = ckpt.BackgroundRemover()  # pruned checkpoints are deleted off the training thread
        self.saver = AsyncSaver(self.engine, self.run_dir, self.rank, self.world_size, remover=self.remover)
        self._async_fits_logged: bool | None = None

        self.step = 0
        self.tokens_seen = 0
        self.objective = build_objective(plan, sp=self.sp, device=self.device)  # next-token, preference or RL (the plan checked the data)
        self.nonfinite_in_a_row = 0
        self.nonfinite_total = 0
        self.last_finite_step: int | None = None  # this process's last step with a finite loss and gradient norm
        self.last_metrics: dict = {}
        self.flops_per_token = self.model_cfg.flops_per_token(cfg.batch.seq_len)
        self._stop_signal: int | None = None
        if self.resume_state is not None:
            self._restore()
        else:
            if self.init_info is not None and cfg.init_from.load_optimizer:
                load_engine_state(self.engine, self.init_info.directory, self.init_info.train_state, self.rank, self.world_size)
                self.init_record = init_record(cfg.init_from, self.init_info, plan.init_state_fingerprint)
            seed_everything(cfg.seed + self.rank)  # per-rank streams for anything stochastic after init
        if cfg.dpo is not None:  # the engine holds the starting weights (a new run) or the cache exists (a resume)
            self.objective.prepare(plan, self.engine, model_fingerprint=(self.init_record or {}).get("fingerprint"),
                                   resumed=self.resume_state is not None)

    @classmethod
    def from_config(cls, cfg: TrainConfig, *, resume: str | None = None, start_over: bool = False) -> Trainer:
        return cls(plan_run(cfg, resume=resume, start_over=start_over))  # `Trainer(plan_run(cfg, ...))`

    # --- construction ----------------------------------------------------------------------------

    def _build_engine(self):
        import deepspeed

        stage = self.plan.deepspeed.zero.stage
        with deepspeed.zero.Init(config_dict_or_path=self.ds_config, enabled=stage == 3):
            model = OLMo(self.model_cfg)
        if self.init_info is not None and not self.cfg.init_from.load_optimizer:
            fingerprint = init_weights(model, self.init_info.directory, self.model_cfg, self.rank, self.world_size)
            self.init_record = init_record(self.cfg.init_from, self.init_info, fingerprint)
        compiled = self.model_cfg.compiles_blocks(device_type())
        if compiled and stage == 3:  # the compiled path takes ZeRO-3 weights in leaf blocks only
            make_blocks_zero3_leaves(model)
        engine, *_ = deepspeed.initialize(model=model, model_parameters=param_groups(model, self.cfg.optim), config=self.ds_config)
        placement = getattr(engine.optimizer, "subgroup_to_device", None)  # ZeRO-3 with optimizer offload
        if placement:
            log.info("optimizer offload: %d of %d sub-groups' state on the host (offload_optimizer.ratio %s)",
                     sum(d == "cpu" for d in placement.values()), len(placement),
                     self.plan.deepspeed.zero.optimizer_on_host)
        log.info(
            "model: %s (%s parameters, %s non-embedding), ZeRO stage %d, %s, %d ranks, %s, blocks %s%s",
            self.cfg.model.preset, f"{self.model_cfg.num_params():,}", f"{self.model_cfg.num_params(False):,}",
            stage, self.cfg.precision, self.world_size, self.cfg.deepspeed_config,
            f"compiled (model.compile {self.model_cfg.compile})" if compiled else f"eager (model.compile {self.model_cfg.compile})",
            self._float8_text(),
        )
        return engine

    def _float8_text(self) -> str:
        recipe = self.model_cfg.float8
        if recipe == "off":
            return ""
        cpu = " (on CPU through torch._scaled_mm's CPU kernel: real FP8 numerics, slowly)" if device_type() == "cpu" else ""
        return (f"; model.float8 {recipe}: the {MATMULS_PER_BLOCK} matmuls of every block in FP8 in training forwards and "
                f"backwards{cpu}, LM head, embedding and evaluation in {self.cfg.precision}")

    def _restore(self) -> None:
        state = self.resume_state  # the loader is at its data position already (`plan.restore_data_position`)
        load_engine_state(self.engine, self.resume_dir, state, self.rank, self.world_size)
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.objective.load_state_dict(state)
        self.nonfinite_total = state.get("nonfinite_total", 0)
        self.last_finite_step = self.step  # a checkpoint holds a finite step (`save`)
        try:
            ckpt.load_rng(self.resume_dir, self.rank, seed=self.cfg.seed, step=self.step)
        except ckpt.CheckpointFileError as e:
            raise ConfigError(f"{self.resume_dir}: cannot be loaded: {e}") from None
        log.info("resumed from %s at step %d (%s tokens seen)", self.resume_dir, self.step, f"{self.tokens_seen:,}")

    # --- one optimizer step ----------------------------------------------------------------------

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float] | None:
        """One optimizer step on this rank's rows of a global batch (RL: a rollout's `rl.updates_per_rollout` updates,
        the objective's `updates`). Returns loss, lr, grad norm, tokens (None: an RL rollout stopped by a signal).
        Collective: every rank calls it with its own rows of the same global step."""
        cfg, engine = self.cfg, self.engine
        if hasattr(self.objective, "rollout"):  # RL: this rank's prompts become its rows of scored samples (train/rl/grpo.py)
            batch = self.objective.rollout(engine, batch, step=self.step, should_stop=lambda: self._stop_signal is not None)
            if batch is None:  # a stop request during the rollout: no step taken, on every rank (fit hands the prompts back)
                return None
        # RL's rl.updates_per_rollout: the step's rows are K equal parts, each its own optimizer update (train/rl/grpo.py)
        updates = self.objective.updates(batch) if hasattr(self.objective, "updates") else [batch]
        rows = batch["input_ids"].shape[0]
        micro = cfg.batch.micro_batch_size
        global_batch = rows * self.layout.dp_size
        n_micro = rows // len(updates) // micro  # an update's micro-batches
        if engine.gradient_accumulation_steps() != n_micro:
            # A batch-size schedule: more accumulation steps. DeepSpeed's engine counts micro-batches over all its
            # ranks (a sequence group's each as one), so it is given this rank's rows times every rank.
            engine.set_train_batch_size(rows // len(updates) * self.world_size)
        lr = lr_at(self.step, peak_lr=cfg.optim.lr, max_steps=cfg.max_steps, cfg=cfg.schedule)  # a step's updates alike
        set_lr(engine.optimizer, lr)

        assert engine.gradient_accumulation_steps() == n_micro, "engine accumulation out of step with the batch"
        # DeepSpeed ZeRO-2/3 waits for its gradient stream at the end of every backward, which empties the
        # device's queue; whatever the host does from there to the next forward's first kernel leaves the
        # device idle. So the whole batch is copied once per update, and the loss bookkeeping is queued
        # while the forward still runs (BENCHMARKS.md, "The host between micro-batches").
        sums = torch.zeros(len(updates), len(self.objective.stats) + 1, dtype=torch.float64, device=self.device)  # + non-finite
        applied, grad_norms = True, []
        for u, part in enumerate(updates):
            part = self.objective.begin(part, n_micro)
            for i in range(n_micro):
                mb = {k: v[i * micro:(i + 1) * micro] for k, v in part.items()}
                # Said explicitly: DeepSpeed's own micro-step count goes out of phase when the batch size changes.
                engine.set_gradient_accumulation_boundary(i == n_micro - 1)
                # The labels name these phases in a torch.profiler trace (scripts/bench_train.py --profile-dir).
                with record_function("olmo_ds.forward"):
                    loss, stats = self.objective.forward(engine, mb)
                    sums[u] += torch.cat([stats, (~torch.isfinite(loss.detach())).double()[None]])
                with record_function("olmo_ds.backward"):
                    engine.backward(loss)
                with record_function("olmo_ds.step"):
                    engine.step()  # applies the update only at the accumulation boundary
            applied = applied and engine.was_step_applied()  # DeepSpeed skips a step whose gradients overflow
            grad_norms.append(engine.get_global_grad_norm())
        torch.distributed.all_reduce(sums)
        per_update, sums = sums, sums.sum(0)
        finite = bool(sums[-1].item() == 0) and applied
        # several updates: their mean (open-instruct's optim/grad_norm)
        grad_norm = None if any(g is None for g in grad_norms) else sum(float(g) for g in grad_norms) / len(grad_norms)

        self.step += 1
        tokens = global_batch * cfg.batch.seq_len  # row positions (padding of packed rows included): what the model computed
        rl = {"step": self.step, "per_update": (per_update[:, :-1], grad_norms)} if hasattr(self.objective, "updates") else {}
        metrics = self.objective.end(sums[:-1], n_micro=n_micro * len(updates), world_size=self.world_size, tokens=tokens, **rl)
        tokens = metrics.get("tokens", tokens)  # RL: the rows' real tokens, not their padding
        self.tokens_seen += tokens
        ce_loss = metrics["loss"]
        self.last_metrics = {"loss": ce_loss, "grad_norm": grad_norm}
        finite = finite and (grad_norm is None or math.isfinite(grad_norm))
        if finite:
            self.nonfinite_in_a_row = 0
            self.last_finite_step = self.step
        else:
            self.nonfinite_in_a_row += 1
            self.nonfinite_total += 1
            log.warning("step %d: non-finite loss or gradient (loss %s, grad norm %s); step %s (%d in a row)", self.step, ce_loss,
                        grad_norm, "skipped" if not applied else "applied by DeepSpeed, never saved", self.nonfinite_in_a_row)
            if self.nonfinite_in_a_row >= cfg.optim.max_nonfinite_in_a_row:
                raise NonFiniteLossError(self.nonfinite_report(
                    f"{self.nonfinite_in_a_row} consecutive steps had a non-finite loss or gradient "
                    f"(optim.max_nonfinite_in_a_row = {cfg.optim.max_nonfinite_in_a_row}), so the run stops"))
        return {**metrics, "lr": lr, "grad_norm": grad_norm, "tokens": tokens, "global_batch_size": global_batch, "skipped": not finite}

    def nonfinite_report(self, why_stopped: str) -> str:
        """The message of the `NonFiniteLossError` that stops the run at this step (`olmo_ds.train.nonfinite`)."""
        newest = ckpt.latest_checkpoint(ckpt.checkpoints_dir(self.run_dir))
        return nonfinite_report(self.cfg, self.model_cfg, step=self.step, loss=self.last_metrics.get("loss", float("nan")),
                                grad_norm=self.last_metrics.get("grad_norm"), in_a_row=self.nonfinite_in_a_row,
                                last_finite_step=self.last_finite_step, newest_checkpoint=str(newest) if newest else None,
                                why_stopped=why_stopped)

    # --- checkpoints -----------------------------------------------------------------------------

    def weights_finite(self) -> bool:
        """All ranks agree whether every parameter (each rank's own ZeRO-3 partition) is finite."""
        ok = torch.ones((), device=self.device)
        for p in self.engine.module.parameters():
            local = p.ds_tensor if hasattr(p, "ds_tensor") else p.data
            if local.numel() and not torch.isfinite(local).all():
                ok.zero_()
                break
        torch.distributed.all_reduce(ok, op=torch.distributed.ReduceOp.MIN)
        return bool(ok.item())

    def train_state(self) -> dict:
        cfg = self.cfg
        return {
            "tokens_seen": self.tokens_seen,
            **self.objective.state_dict(),
            "data": self.loader.state_dict(),
            "schedule": {
                "lr": lr_at(max(self.step - 1, 0), peak_lr=cfg.optim.lr, max_steps=cfg.max_steps, cfg=cfg.schedule),
                "global_batch_size": self.loader.global_batch_size(self.step),
                "kind": cfg.schedule.kind,
            },
            "nonfinite_total": self.nonfinite_total,
            "config": cfg.to_dict(),
            "model": self.model_cfg.to_dict(),
            "ds_config": self.ds_config,
            "data_fingerprint": self.loader.fingerprint,
            "init_from": self.init_record,
            "tokenizer_fingerprint": self.loader.tokenizer_fingerprint,
            "world_size": self.world_size,
            "sequence_parallel_size": self.layout.sp_size,
            "zero_stage": self.plan.deepspeed.zero.stage,
            "micro_batch": self.micro_batch.record(),
        }

    def save(self, *, final: bool = False) -> Path | None:
        """Collective: checkpoint this step. In the background where allowed (`checkpoint.async_save`):
        then training is blocked only for the copy to host memory and the checkpoint completes later
        (`_saved`); `final` waits for it. A save still in flight completes before the next one starts.

        A step whose loss or gradient norm was not finite is not saved (None): its weights are the last
        step's (DeepSpeed skipped the update), but a model that computes non-finite losses is no checkpoint
        to resume or evaluate; the previous one stays the newest. Every rank decides alike (the check is on
        all-reduced numbers)."""
        if self.nonfinite_in_a_row:
            newest = ckpt.latest_checkpoint(ckpt.checkpoints_dir(self.run_dir))
            log.warning("step %d: no checkpoint saved: this step's loss or gradient norm is not finite (%d in a row); "
                        "the newest checkpoint stays %s", self.step, self.nonfinite_in_a_row, newest or "none")
            return None
        if not self.weights_finite():
            raise NonFiniteLossError(f"step {self.step}: the weights hold non-finite values; refusing to save them over good checkpoints")
        tokenizer_path = self.tokenizer.path if self.tokenizer else None
        rank_files = getattr(self.objective, "rank_files", dict)()  # each rank's own files (RL's samples in flight)
        try:
            if self._save_async():
                t0 = time.perf_counter()
                self._saved(self.saver.wait())  # the save in flight, if any, completes (and is pruned around) first
                if (waited := time.perf_counter() - t0) >= 1.0 and self.rank == 0:
                    log.info("checkpoint: training waited %.1fs for the previous background save to be written "
                             "(checkpoint.every is shorter than a write takes)", waited)
                path = self.saver.start(self.step, self.train_state(), tokenizer_path=tokenizer_path, rank_files=rank_files)
                if final:
                    self._saved(self.saver.wait())
                return path
            self._saved(self.saver.wait())
            self.saver.snapshots.release()  # host memory kept for background saves is not needed by this one
            self.remover.wait()
            t0 = time.perf_counter()
            path = ckpt.save_checkpoint(self.engine, self.run_dir, self.step, self.train_state(), rank=self.rank, tokenizer_path=tokenizer_path,
                                        rank_files=rank_files)
            self._saved({"ckpt_dir": path, "blocked_s": time.perf_counter() - t0, "total_s": time.perf_counter() - t0})
            return path
        except AsyncSaveError as e:
            raise self._save_failed(e.ckpt_dir, e.cause) from e
        except (OSError, RuntimeError) as e:
            raise self._save_failed(ckpt.checkpoints_dir(self.run_dir) / ckpt.step_tag(self.step), e) from e

    def _save_async(self) -> bool:
        """Whether this save goes to the background: `checkpoint.async_save`; `auto` means on GPUs, when every
        rank's host copy fits in its node's free memory (decided together: the two paths synchronise differently)."""
        mode = self.cfg.checkpoint.async_save
        if mode != "auto":
            return mode == "always"
        if self.device.type != "cuda":
            return False  # on CPU the copy is most of a save's cost, and tests time their kills against blocking saves
        local = local_world_size(os.environ) or 1
        fits, why = host_copy_fits(snapshot_bytes_estimate(self.model_cfg.num_params(), self.world_size), local,
                                   held=self.saver.snapshots.held_bytes)
        flag = torch.tensor(float(fits), device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        fits_everywhere = bool(flag.item())
        if fits_everywhere != self._async_fits_logged:  # say it once, and again when it changes
            log.info("checkpoint: %s (%s%s)", "saving in the background" if fits_everywhere else "blocking save",
                     why, "" if fits == fits_everywhere else "; another node's does not fit")
            self._async_fits_logged = fits_everywhere
        return fits_everywhere

    def _saved(self, summary: dict | None) -> None:
        """A checkpoint completed (rank 0): prune older ones, say how long training was blocked."""
        if summary is None or self.rank != 0:
            return
        c, path = self.cfg.checkpoint, summary["ckpt_dir"]
        pruned = ckpt.prune_checkpoints(ckpt.checkpoints_dir(self.run_dir), c.keep_last, c.keep_every, protect=path,
                                        remove=self.remover)
        alloc, phases = summary.get("alloc_s", 0.0), ", ".join(f"{k[:-2]} {summary[k]:.1f}s" for k in ("room_s", "write_s", "sync_s") if k in summary)
        log.info("saved %s: training blocked %.1fs%s, written in %.1fs%s%s", path, summary["blocked_s"],
                 f" ({alloc:.1f}s of it allocating host memory for background saves, once)" if alloc >= 0.05 else "",
                 summary["total_s"], f" (this rank: {phases})" if phases else "", f" (removed {len(pruned)} old)" if pruned else "")

    def _save_failed(self, ckpt_dir: Path | None, e: BaseException) -> CheckpointSaveError:
        # The half-written directory has no train_state.json, so resume skips it and the next save of
        # this step replaces it; say so, because a raw traceback from torch.save reads like corruption.
        # torch.save reports a full disk as a RuntimeError without errno, hence the free space.
        root = ckpt.checkpoints_dir(self.run_dir)
        previous = ckpt.latest_checkpoint(root)
        free = shutil.disk_usage(root).free / 2**30 if root.is_dir() else float("nan")
        return CheckpointSaveError(
            f"rank {self.rank}: saving {ckpt_dir} failed: {type(e).__name__}: {e} "
            f"({free:.2f} GiB free there; a full disk or quota?). "
            + (f"The previous checkpoint {previous} is intact; " if previous else "No earlier checkpoint exists; ")
            + "free space and rerun with --resume auto"
        )

    # --- the loop --------------------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        # The first reason stays: under the deepspeed launcher a Ctrl-C brings SIGINT, then launch.py's SIGTERM.
        if self._stop_signal is None:
            self._stop_signal = LAUNCHER_GONE if signum == signal.SIGTERM and launcher_gone() else signum
            log.info("%s: the run saves a checkpoint and exits after this step%s", self._stop_reason(self._stop_signal),
                     " (an RL rollout in progress stops now; a resume draws the same samples)" if hasattr(self.objective, "rollout") else "")

    def _stop_requested(self) -> int:
        """Why the run stops now (0: it does not): the largest of the ranks' reasons (`LAUNCHER_GONE` or a signal
        number), so that all ranks agree before their collective save, whichever of them got the signal."""
        flag = torch.tensor(float(self._stop_signal or 0), device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return int(flag.item())

    @staticmethod
    def _stop_reason(code: int) -> str:
        if code == LAUNCHER_GONE:
            return launcher_gone() or "another rank's launcher exited"
        return f"{signal.Signals(code).name} received"

    def fit(self) -> str:
        """Train to max_steps. Returns "done", or "preempted" (SIGTERM, SIGUSR1, the launcher's exit) or "interrupted"
        (SIGINT) with a checkpoint saved. Stops with `NonFiniteLossError` on non-finite steps, saving none of them."""
        cfg = self.cfg
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        logger = MetricsLogger(self.run_dir, enabled=self.rank == 0, tensorboard=cfg.logging.tensorboard,
                               wandb=cfg.logging.wandb, wandb_project=cfg.logging.wandb_project, config=cfg.to_dict(),
                               purge_step=tensorboard_purge_step(self.run_dir, self.step))
        peak = peak_tflops(cfg.logging.peak_tflops)
        log.info("%s; %s", self.model_cfg.flops_formula(cfg.batch.seq_len),
                 f"MFU against {peak:g} TFLOP/s per device" if peak else "MFU not reported (unknown device peak; set logging.peak_tflops)")
        last_saved = self.step if self.resume_dir else None
        first_step = self.step + 1  # logged whatever logging.every says: the starting loss is worth seeing
        window = self._new_window()
        status = "done"
        try:
            if self.evaluator is not None and cfg.eval.at_start and self.step == 0:
                self.evaluate(logger)  # the starting weights' numbers, logged at step 0
            while self.step < cfg.max_steps:
                if stop := self._stop_requested():
                    in_flight = self.saver.in_flight
                    log.info("%s: saving a checkpoint at step %d and exiting%s", self._stop_reason(stop), self.step,
                             f"; the background save of {in_flight.name} completes first" if in_flight else "")
                    status = STOP_STATUS.get(stop, "preempted")
                    break
                m = self.train_step(self.loader.next_batch())
                if m is None:  # an RL rollout stopped by a signal: its prompts are handed out again, on resume too
                    self.loader.give_back()
                    continue
                window["tokens"] += m["tokens"]
                window["steps"] += 1
                window["loss"] += m["loss"]
                if self.step % cfg.logging.every == 0 or self.step in (first_step, cfg.max_steps):
                    self._log(logger, m, window, peak)
                    window = self._new_window()
                paused, calls_before = time.perf_counter(), collections.Counter(BLOCK_CALLS)
                if self.evaluator is not None and (self.step % cfg.eval.every == 0 or self.step == cfg.max_steps):
                    self.evaluate(logger)
                if cfg.checkpoint.every and self.step % cfg.checkpoint.every == 0 and self.save() is not None:
                    last_saved = self.step
                self._saved(self.saver.poll())
                window["t"] += time.perf_counter() - paused  # throughput and ETA count training time only
                window["calls"] += collections.Counter(BLOCK_CALLS) - calls_before  # and block counts training's blocks
            if self.nonfinite_in_a_row and status == "done":
                raise NonFiniteLossError(self.nonfinite_report(f"the run reached max_steps {cfg.max_steps} on it"))
            final = (status != "done" or cfg.checkpoint.save_final) and last_saved != self.step
            if not (final and self.save(final=True) is not None):  # a save in flight completes before the process exits
                self._finish_saves()
        except NonFiniteLossError:
            self._finish_saves()  # a background save of an earlier, finite step completes
            raise
        finally:
            self.loader.close()
            logger.close()
            self.remover.wait()
        return status

    def _finish_saves(self) -> None:
        try:
            self._saved(self.saver.wait())
        except AsyncSaveError as e:
            raise self._save_failed(e.ckpt_dir, e.cause) from e

    def evaluate(self, logger: MetricsLogger) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.evaluator(self.engine)
        logger.log(self.step, metrics)
        shown = " | ".join(f"{k.removeprefix('eval/')} {v:.4g}" for k, v in metrics.items()
                           if k.endswith(("/loss", "/ppl", "/bpb", "/acc_per_char", "/request_tokens_per_s", "/rewards/accuracy", "/solve_rate")))
        log.info("eval step %d | %s | %.1fs", self.step, shown, time.perf_counter() - t0)
        return metrics

    def close(self) -> None:
        """End of the process's training: stop the data thread, tear down the process group. Also freezes the garbage
        collector: the interpreter's shutdown runs a full collection per module it unloads, and with DeepSpeed, TensorBoard
        and their imports loaded that re-scans every live object hundreds of times (~10 s per rank on 2 CPU cores)."""
        self.loader.close()
        self.remover.wait()
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        gc.freeze()

    def _new_window(self) -> dict:
        """What the next progress line is measured from: its start, the data wait and block calls so far."""
        return {"t": time.perf_counter(), "wait": self.loader.wait_seconds, "tokens": 0, "steps": 0, "loss": 0.0,
                "calls": collections.Counter(BLOCK_CALLS)}

    def _block_metrics(self, window: dict) -> dict:
        """How this window's training block calls ran (`BLOCK_CALLS`: compiled or eager) and, with
        `model.float8`, how many of their matmuls ran in FP8, as a count and as a share of all block matmuls
        (1.0 = every one; recomputation under activation checkpointing counts on both sides)."""
        calls = collections.Counter(BLOCK_CALLS)
        calls.subtract(window["calls"])
        out = {"perf/block_calls_compiled": calls["compiled"], "perf/block_calls_eager": calls["eager"]}
        if self.model_cfg.float8 != "off":
            matmuls = MATMULS_PER_BLOCK * (calls["compiled"] + calls["eager"])
            out["perf/float8_matmuls"] = calls["float8_matmuls"]
            out["perf/float8_matmul_fraction"] = calls["float8_matmuls"] / matmuls if matmuls else None
        return out

    def _log(self, logger: MetricsLogger, m: dict, window: dict, peak: float | None) -> None:
        elapsed = max(time.perf_counter() - window["t"], 1e-9)
        tokens_per_s = window["tokens"] / elapsed
        tflops = tokens_per_s * self.flops_per_token / self.world_size / 1e12
        loss = window["loss"] / window["steps"]
        metrics = {
            "train/loss": loss,
            "train/ppl": float(np.exp(min(loss, 50.0))),
            "train/z_loss": m.get("z_loss"),
            "train/lr": m["lr"],
            "train/grad_norm": m["grad_norm"],
            "train/global_batch_size": m["global_batch_size"],
            "train/tokens_seen": self.tokens_seen,
            "train/skipped_steps": self.nonfinite_total,
            "perf/tokens_per_s": tokens_per_s,
            "perf/tflops_per_device": tflops,
            "perf/mfu": tflops / peak if peak else None,
            "perf/memory_gib": memory_gib(),
            "perf/data_wait_fraction": (self.loader.wait_seconds - window["wait"]) / elapsed,
            **self._block_metrics(window),
        }
        metrics.update(self.objective.log_metrics(m))
        logger.log(self.step, metrics)
        if self.rank == 0:
            eta = (self.cfg.max_steps - self.step) * elapsed / window["steps"]
            log.info(console_line(self.step, self.cfg.max_steps, metrics, eta))
