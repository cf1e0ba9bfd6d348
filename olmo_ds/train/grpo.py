"""RL with verifiable rewards (GRPO, open-instruct's OlmoRL semantics), for the trainer: the rollout, a micro-batch's
loss, the step's metrics (`olmo_ds.train.objective`'s interface: `rollout`, `begin`, `forward`, `end`,
`log_metrics`, `state_dict`).

One step (a rollout, then one optimizer update, or `rl.updates_per_rollout` of them):
1. `rollout(engine, batch, step=...)`: this rank's prompts (the loader's prompt batch) -> G samples each from the
   current policy (`olmo_ds.train.rollout`: the ZeRO-3 weights gathered once into a plain model, the decode engine,
   each sample keyed by (step, prompt, sample)), rewards from each prompt's verifier, advantages per group, groups
   without a reward spread dropped (counted), the rest packed into rows. With `rl.beta > 0` the reference model
   (init_from's weights, frozen, on every rank) scores each sampled token there too ("cached": once per rollout,
   no gradient). Every rank ends with the same number of rows, a multiple of the micro-batch. With
   `rl.updates_per_rollout` K > 1 the rows are K blocks, one per optimizer update (`olmo_ds.train.rollout.pack_rows`:
   update k trains the groups of the rank's prompts k, k + K, ...), each a multiple of the micro-batch, and the old
   policy's log-probabilities are scored here (`old_logprobs`, below).
   With sequence parallelism (N ranks a row) the ranks of a sequence group hold the same prompts: each draws and
   scores its 1/N of the group's samples, the group all-gathers them, and every rank of it packs the same rows
   (`olmo_ds.train.rollout`); the reference (and the old policy) scores each rank's slice of them.
2. `updates(rows)`: the rows cut into the step's K updates; the trainer runs steps 3-4 once for each, each its own
   optimizer update (its accumulation boundary at the update's last micro-batch).
3. `begin(rows, n_micro)`: the update's generated tokens over every rank (one all-reduce, before the first forward)
   give the divisor: each micro-batch's summed token loss is divided by `token_mean_divisor(N, world, n_micro)`,
   which undoes DeepSpeed's division by the accumulation steps and its average over ranks, so the gradient is the
   token mean over ALL generated tokens of the step (open-instruct's `loss_denominator: token` over the
   accumulation group, grpo_fast.py l.655-719) and equal for 1 x 8, 8 x 1 or 2 ranks x 4 micro-batches. With K
   updates, each update's own tokens (open-instruct's accumulation group is a mini-batch: grpo_utils.py l.651-671).
   With sequence parallelism each rank keeps its 1/N slice of every row's per-token tensors (`local_rows`) and counts
   the generated tokens of its slices, so the count holds each token once, as the fine-tuning loss's does.
4. `forward(engine, mb)`: the training forward's logits at the sampled positions, their log-probabilities at the
   sampling temperature (`olmo_ds.model.loss.sampled_logprobs`), `grpo_loss` (PPO-clip with clip-higher, truncated
   importance sampling, optional KL). The old policy is the one that generated: with one update per rollout its
   log-probabilities are this forward's own, detached (open-instruct's `resolve_old_logprob` with one mini-batch,
   grpo_utils.py l.475-502), so the ratio is 1 in value and the importance weight exp(old - sampled) measures the
   decode/training mismatch alone. With K > 1 updates, updates 2..K must see the policy before update 1: the rollout
   scores their rows once with a no-grad forward of the engine, micro-batch by micro-batch as they will train, before
   any update (`rows["old_logprobs"]`; open-instruct's old-logprob pass with several mini-batches, grpo_fast.py
   l.618-636), and update 1 keeps its own forward's, detached, which are the same numbers without the extra forward
   (1/K of it saved). The forward returns the micro-batch's whole logits (the head is not fused with
   this loss yet) and the log-probabilities are taken on the generated positions only. With sequence parallelism
   the forward is spread over the group (`sequence_parallel=`) and returns this rank's slice's logits, whose labels
   are the slice of the rows' labels (a position's label is the next token already, so no shift crosses a slice).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch

from olmo_ds.data.loader import validation_prompts
from olmo_ds.eval.rl import Decoding, evaluate_prompts
from olmo_ds.eval.scoring import DistContext
from olmo_ds.eval.verifiers import reward
from olmo_ds.model.loss import IGNORE_INDEX, grpo_loss, sampled_logprobs, token_mean_divisor
from olmo_ds.model.sequence_parallel import SequenceParallel
from olmo_ds.train.config import ConfigError, RLConfig
from olmo_ds.train.evaluation import val_sources
from olmo_ds.train.memory import estimate_rollout_memory
from olmo_ds.data.dataset import Prompt
from olmo_ds.train.parallel import local_rows
from olmo_ds.train.rollout import (gather_samples, gathered_policy, group_advantages, group_share, pack_rows, rows_needed,
                                   sample_groups, score_samples)
from olmo_ds.weights import load_model

log = logging.getLogger("olmo_ds")


def default_reward(verifier: str, text: str, ground_truth: Any):
    return reward(verifier, text, ground_truth)


class RLObjective:
    """GRPO's step (module docstring)."""

    stats = ("loss", "tokens", "clipped", "ratio", "capped", "tis", "entropy", "kl", "policy_ratio")

    def __init__(self, rl: RLConfig, *, seq_len: int, micro_batch: int, world_size: int, vocab_size: int,
                 device: torch.device, tokenizer=None, stop_ids=(), reward_fn: Callable | None = None,
                 reference=None, decode_dtype: torch.dtype | None = None, sp: SequenceParallel | None = None):
        self.rl, self.seq_len, self.micro, self.world_size = rl, seq_len, micro_batch, world_size
        self.vocab_size, self.device, self.tokenizer = vocab_size, device, tokenizer
        self.stop_ids = list(stop_ids) or ([tokenizer.eos_id] if tokenizer is not None else [])
        self.reward_fn = reward_fn or default_reward
        self.reference = reference  # a frozen plain OLMo (beta > 0), else None
        self.decode_dtype = decode_dtype
        self.sp = sp  # this rank's sequence group (None without sequence parallelism)
        self.samples_seen = 0
        self._divisor = None
        self.last_rollout: dict = {}  # this rank's counts and times of the step's rollout (`rollout`), for `end`
        self._ratio_max = None
        self._t_train: float | None = None  # when the step's first update began

    # --- the rollout phase --------------------------------------------------------------------

    def rollout(self, engine, batch: dict, *, step: int) -> dict[str, torch.Tensor]:
        """This rank's prompts -> its training rows for this step (collective: the gathering, the row count)."""
        rl = self.rl
        prompts = [Prompt(list(ids), v, gt, int(i)) for ids, i, v, gt in
                   zip(batch["prompt_ids"], batch["prompt_index"].tolist(), batch["verifier"], batch["ground_truth"])]
        timings: dict = {}
        module = engine.module if hasattr(engine, "module") else engine
        dtype = self.decode_dtype or (torch.bfloat16 if self.device.type == "cuda" else next(module.parameters()).dtype)
        sp = self.sp
        pairs = len(prompts) * rl.samples_per_prompt
        mine = group_share(pairs, sp.size, sp.rank) if sp is not None else range(pairs)  # a sequence group splits its samples
        with gathered_policy(module, dtype, timings) as policy:
            t0 = time.perf_counter()
            samples = sample_groups(policy, prompts, samples_per_prompt=rl.samples_per_prompt, max_new_tokens=rl.max_new_tokens,
                                    temperature=rl.temperature, seed=rl.seed, step=step, stop_ids=self.stop_ids,
                                    tokenizer=self.tokenizer, batch_size=rl.generation_batch_size, pairs=mine)
            timings["generation"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        score_samples(samples, prompts, self.reward_fn)
        timings["reward"] = time.perf_counter() - t0
        if sp is not None:
            t0 = time.perf_counter()
            samples = gather_samples(samples, sp.group)
            timings["generation"] += time.perf_counter() - t0
        groups = group_advantages(samples, prompts, samples_per_prompt=rl.samples_per_prompt, normalize_std=rl.normalize_advantage_std)
        k = rl.updates_per_rollout
        need = torch.tensor(rows_needed(groups.kept, prompts, self.seq_len, updates=k), device=self.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(need, op=torch.distributed.ReduceOp.MAX)
        n_rows = max(1, -(-int(need.item()) // self.micro)) * self.micro  # per update: whole micro-batches
        rows = pack_rows(groups.kept, prompts, self.seq_len, rows=n_rows, updates=k)
        if self.reference is not None:
            rows["reference"] = self.logprobs(self.reference, rows)
        if k > 1:  # updates 2..K's old policy: the weights before this step's first update (module docstring)
            t0 = time.perf_counter()
            rows["old_logprobs"] = self.logprobs(engine, rows, first_row=n_rows)
            timings["old_logprobs"] = time.perf_counter() - t0
        lengths = [len(s.tokens) for s in samples]
        counts = {
            "samples": len(samples), "reward_sum": sum(s.reward for s in samples),
            "solved": sum(s.reward >= 1.0 for s in samples), "groups": groups.groups, "dropped": groups.dropped,
            "reward_errors": groups.reward_errors, "length_sum": sum(lengths), "length_max": max(lengths, default=0),
            "truncated": sum(s.finish == "length" for s in samples),
            "by_verifier": {v: (sum(r), len(r)) for v, r in groups.by_verifier.items()},
        }
        # every rank of a sequence group holds all of the group's samples: its first rank counts them, once
        self.last_rollout = {**(counts if sp is None or sp.rank == 0 else {}), "time": timings}
        return rows

    @torch.no_grad()
    def logprobs(self, model, rows: dict[str, torch.Tensor], first_row: int = 0) -> torch.Tensor:
        """`model`'s log-probability (at the sampling temperature) of every labelled position of rows `first_row` on,
        [R, T] (0 elsewhere), a micro-batch at a time: the reference model, or the engine itself (collective). With
        sequence parallelism the group spreads the forward as the training forward's (collective over the group):
        each rank fills its slice of every row, the one `begin` keeps, and leaves the rest 0."""
        out = torch.zeros(rows["labels"].shape, dtype=torch.float32)
        sp = self.sp
        kwargs = {"sequence_parallel": sp} if sp is not None else {}
        for r in range(first_row, rows["labels"].shape[0], self.micro):
            part = {k: v[r:r + self.micro] for k, v in rows.items()}
            # the reference skips rows without samples, decided on whole rows so a group's ranks skip the same
            # forwards; the engine forwards on every rank alike (ZeRO-3 gathers its weights in the forward)
            if model is self.reference and not (part["labels"] != IGNORE_INDEX).any():
                continue
            mine = out[r:r + self.micro]
            if sp is not None:
                part, mine = local_rows(part, sp), sp.local(mine)
            part = {k: v.to(self.device) for k, v in part.items()}
            keep = part["labels"] != IGNORE_INDEX
            logits = model(part["input_ids"], doc_lens=part["doc_lens"], positions=part["positions"], **kwargs)
            lp, _ = sampled_logprobs(logits[keep], part["labels"][keep], temperature=self.rl.temperature, vocab_size=self.vocab_size)
            mine[keep.cpu()] = lp.float().cpu()
        return out

    # --- the training phase ---------------------------------------------------------------------

    def updates(self, rows: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """The rollout's rows as the step's `rl.updates_per_rollout` optimizer updates: K equal blocks (`rollout`).
        The first update's old policy is its own forward's (module docstring): its block has no `old_logprobs`."""
        k = self.rl.updates_per_rollout
        if k == 1:
            return [rows]
        n = rows["input_ids"].shape[0] // k
        parts = [{key: v[u * n:(u + 1) * n] for key, v in rows.items()} for u in range(k)]
        del parts[0]["old_logprobs"]
        return parts

    def begin(self, batch: dict[str, torch.Tensor], n_micro: int) -> dict[str, torch.Tensor]:
        """An update's rows on the device (with sequence parallelism this rank's slice of them); its generated tokens
        over every rank give the loss divisor (one all-reduce)."""
        if self._t_train is None:  # the step's first update (`end` closes the step)
            self._t_train = time.perf_counter()
            self._ratio_max = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.sp is not None:
            batch = local_rows(batch, self.sp)
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        count = (batch["labels"] != IGNORE_INDEX).sum()
        torch.distributed.all_reduce(count)
        self._divisor = token_mean_divisor(count, self.world_size, n_micro)
        return batch

    def forward(self, engine, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's summed token loss over the step's divisor, its float64 `stats` sums)."""
        kwargs = {"sequence_parallel": self.sp} if self.sp is not None else {}
        logits = engine(mb["input_ids"], doc_lens=mb["doc_lens"], positions=mb["positions"], **kwargs)
        keep = mb["labels"] != IGNORE_INDEX
        logprob, entropy = sampled_logprobs(logits[keep], mb["labels"][keep], temperature=self.rl.temperature,
                                            vocab_size=self.vocab_size)
        rl = self.rl
        old = mb["old_logprobs"][keep] if "old_logprobs" in mb else logprob.detach()
        terms = grpo_loss(logprob, old, mb["sampled"][keep], mb["advantages"][keep],
                          mb["reference"][keep] if "reference" in mb else None, clip_low=rl.clip_low, clip_high=rl.clip_high,
                          tis_cap=rl.cap, beta=rl.beta, kl_estimator=rl.kl_estimator)
        total = terms.loss.sum()
        if terms.ratio.numel():
            self._ratio_max = torch.maximum(self._ratio_max, terms.importance.max().double())
        stats = torch.stack([total.detach().double(), keep.sum().double(), terms.clipped.sum().double(),
                             terms.importance.sum().double(), terms.capped.sum().double(), terms.tis.sum().double(),
                             entropy.sum().double(), terms.kl.sum().double(), terms.ratio.sum().double()])
        return total / self._divisor, stats

    def end(self, sums: torch.Tensor, *, n_micro: int, world_size: int, tokens: int) -> dict:
        """The step's metrics, over all its updates (collective: the ratio's max and the rollout's counts over every rank)."""
        train_s, self._t_train = time.perf_counter() - self._t_train, None
        loss, n, clipped, ratio, capped, tis, entropy, kl, policy_ratio = sums.tolist()
        t = max(n, 1.0)
        metrics = {"loss": loss / t, "generated_tokens": int(n), "clip_fraction": clipped / t,
                   "importance_ratio_mean": ratio / t, "tis_capped_fraction": capped / t, "tis_weight_mean": tis / t,
                   "entropy": entropy / t}
        if self.rl.beta:
            metrics["kl"] = kl / t
        if self.rl.updates_per_rollout > 1:  # exp(lp - old): 1 on the first update, moved by the earlier ones after
            metrics["policy_ratio_mean"] = policy_ratio / t
        ratio_max = self._ratio_max.clone()
        rollouts = [None] * (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(ratio_max, op=torch.distributed.ReduceOp.MAX)
            torch.distributed.all_gather_object(rollouts, {**self.last_rollout, "train_s": train_s})
        else:
            rollouts = [{**self.last_rollout, "train_s": train_s}]
        metrics["importance_ratio_max"] = float(ratio_max)
        metrics.update(self.rollout_metrics(rollouts))
        self.samples_seen += metrics["rollout/samples"]
        return metrics

    @staticmethod
    def rollout_metrics(rollouts: list[dict]) -> dict:
        """All ranks' rollout counts as the step's metrics (times: the slowest rank's)."""
        total = lambda k: sum(r.get(k, 0) for r in rollouts)  # noqa: E731
        samples = max(total("samples"), 1)
        out = {"rollout/samples": total("samples"), "rollout/reward_mean": total("reward_sum") / samples,
               "rollout/solve_rate": total("solved") / samples, "rollout/groups": total("groups"),
               "rollout/dropped_groups": total("dropped"), "rollout/reward_errors": total("reward_errors"),
               "rollout/response_length_mean": total("length_sum") / samples,
               "rollout/response_length_max": max(r.get("length_max", 0) for r in rollouts),
               "rollout/truncated_fraction": total("truncated") / samples}
        verifiers: dict[str, list[float]] = {}
        for r in rollouts:
            for v, (s, c) in r.get("by_verifier", {}).items():
                acc = verifiers.setdefault(v, [0.0, 0])
                acc[0] += s
                acc[1] += c
        out.update({f"rollout/reward_mean/{v}": s / max(c, 1) for v, (s, c) in sorted(verifiers.items())})
        old = ("old_logprobs",) if any("old_logprobs" in r.get("time", {}) for r in rollouts) else ()
        for phase in ("gather", "generation", "reward", *old):
            out[f"time/{phase}_s"] = max(r.get("time", {}).get(phase, 0.0) for r in rollouts)
        out["time/training_s"] = max(r.get("train_s", 0.0) for r in rollouts)
        return out

    def log_metrics(self, m: dict) -> dict:
        keys = ("clip_fraction", "importance_ratio_mean", "importance_ratio_max", "tis_capped_fraction", "entropy", "kl",
                "policy_ratio_mean", "generated_tokens")
        return {**{f"rl/{k}": m[k] for k in keys if k in m}, **{k: v for k, v in m.items() if k.startswith(("rollout/", "time/"))},
                "rl/samples_seen": self.samples_seen}

    def state_dict(self) -> dict:
        return {"rl_samples_seen": self.samples_seen}

    def load_state_dict(self, state: dict) -> None:
        self.samples_seen = state.get("rl_samples_seen", 0)


def stop_ids(tokenizer) -> list[int]:
    """The ids that end a sample: the tokenizer's EOS and, where the vocabulary has it, the chat turn end."""
    ids = [tokenizer.eos_id]
    turn_end = tokenizer.token_to_id("<|im_end|>")
    if turn_end is not None:
        ids.append(turn_end)
    return list(dict.fromkeys(ids))


def rl_objective(plan, *, sp: SequenceParallel | None, device: torch.device) -> RLObjective:
    """The RL objective of a planned run (`sp`: this rank's sequence group, or None): its tokenizer (the verifiers read the samples' text), and with `rl.beta > 0`
    the reference: init_from's weights, frozen, in the decode dtype on every rank (a resume reads them from
    init_from.path again: they never change)."""
    cfg = plan.cfg
    rl = cfg.rl
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    reference = None
    if rl.beta > 0:
        reference = load_model(cfg.init_from.path, device=device, dtype=dtype, tokenizer=plan.tokenizer).model.eval()
        for p in reference.parameters():
            p.requires_grad_(False)
    estimate = estimate_rollout_memory(plan.model, generation_batch=rl.generation_batch_size, max_len=cfg.batch.seq_len,
                                       precision=cfg.precision, zero_stage=plan.deepspeed.zero.stage, dp_world_size=plan.world_size,
                                       decode_bytes=2 if dtype == torch.bfloat16 else 4)
    log.info("rl: a rollout's peak per rank ~%s; %d samples of %d prompts a step, up to %d new tokens each",
             estimate.describe(), rl.samples_per_prompt * cfg.batch.global_batch_size, cfg.batch.global_batch_size, rl.max_new_tokens)
    return RLObjective(rl, seq_len=cfg.batch.seq_len, micro_batch=cfg.batch.micro_batch_size, world_size=plan.world_size,
                       vocab_size=plan.model.vocab_size, device=device, tokenizer=plan.tokenizer,
                       stop_ids=stop_ids(plan.tokenizer), reference=reference, decode_dtype=dtype, sp=sp)


class RLEvaluator:
    """In-loop evaluation of an RL run: each validation source's prompts (`data.val_sources`, else each training
    source's val/ split) answered greedily by the current weights (gathered as for a rollout) and scored by the same
    verifiers, through `olmo_ds.eval.rl.evaluate_prompts` (what `eval.sh` runs on a checkpoint: the same numbers).
    Returns `eval/<source>/solve_rate` (the share of prompts whose answer scores 1) and `eval/<source>/reward_mean`,
    and each per verifier (`eval/<source>/solve_rate/<verifier>`). Every rank holds every prompt and answers its waves
    of them (the ranks of a sequence group different ones: the evaluation generates per rank, never spread over a
    group). Collective: every rank calls it."""

    def __init__(self, cfg, tokenizer, rank: int, world_size: int, reward_fn: Callable | None = None):
        self.tokenizer, self.reward_fn, self.dist = tokenizer, reward_fn or default_reward, DistContext(rank, world_size)
        self.decoding = Decoding(max_new_tokens=cfg.rl.max_new_tokens, batch_size=cfg.rl.generation_batch_size)
        self.sets: list[tuple[str, list[Prompt]]] = []
        for src in val_sources(cfg):
            try:
                prompts = validation_prompts(src, 0, 1)  # all of them: `evaluate_prompts` deals them out
            except (FileNotFoundError, ValueError) as e:
                raise ConfigError(f"{cfg.source}: eval: validation source {src.path}: {e}") from None
            self.sets.append((src.name or Path(src.path).name, prompts))

    def __call__(self, engine) -> dict[str, float]:
        module = engine.module if hasattr(engine, "module") else engine
        device = next(module.parameters()).device
        dtype = torch.bfloat16 if device.type == "cuda" else next(module.parameters()).dtype
        metrics = {}
        with gathered_policy(module, dtype) as policy:
            for name, prompts in self.sets:
                result = evaluate_prompts(policy, prompts, tokenizer=self.tokenizer, decoding=self.decoding,
                                          dist_ctx=self.dist, reward_fn=self.reward_fn)
                metrics.update({f"eval/{name}/{k}": v for k, v in result.metrics.items()})
        return metrics
