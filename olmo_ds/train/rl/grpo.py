"""RL with verifiable rewards (GRPO, open-instruct's OlmoRL semantics), for the trainer: the rollout, a micro-batch's
loss, the step's metrics (`olmo_ds.train.objective`'s interface: `rollout`, `begin`, `forward`, `end`,
`log_metrics`, `state_dict`).

One step (a rollout, then one optimizer update, or `rl.updates_per_rollout` of them):
1. `rollout(engine, batch, step=...)`: this rank's prompts (the loader's prompt batch) -> G samples each from the
   current policy (`olmo_ds.train.rl.rollout`: the ZeRO-3 weights gathered once into a plain model, the decode engine,
   each sample keyed by (step, prompt, sample)), rewards from each prompt's verifier, advantages per group, groups
   without a reward spread dropped (counted), the rest packed into rows. With `rl.beta > 0` the reference model
   (init_from's weights, frozen, on every rank) scores each sampled token there too ("cached": once per rollout,
   no gradient). Every rank ends with the same number of rows, a multiple of the micro-batch. With
   `rl.updates_per_rollout` K > 1 the rows are K blocks, one per optimizer update (`olmo_ds.train.rl.rollout.pack_rows`:
   update k trains the groups of the rank's prompts k, k + K, ...), each a multiple of the micro-batch, and the old
   policy's log-probabilities are scored here (`old_logprobs`, below).
   With `rl.async_steps` A >= 1 the policy is a decode copy kept across steps and updated in place, and the samples
   come from a decode engine that runs up to A steps ahead of training (`olmo_ds.train.rl.inflight`); the rest is
   the same.
   With sequence parallelism (N ranks a row) the ranks of a sequence group hold the same prompts: each draws and
   scores its 1/N of the group's samples, the group all-gathers them, and every rank of it packs the same rows
   (`olmo_ds.train.rl.rollout`); the reference (and the old policy) scores each rank's slice of them.
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
from typing import Callable

import torch

from olmo_ds.data.dataset import Prompt
from olmo_ds.eval.rl import stop_ids
from olmo_ds.model.decode import GenerationInterrupted
from olmo_ds.model.loss import IGNORE_INDEX, grpo_loss, sampled_logprobs, token_mean_divisor
from olmo_ds.model.sequence_parallel import SequenceParallel
from olmo_ds.train.config import RLConfig
from olmo_ds.train.memory import estimate_rollout_memory
from olmo_ds.train.parallel import local_rows
from olmo_ds.train.rl.actors import ActorClient, split_roles
from olmo_ds.train.rl.inflight import InflightRollouts, inflight_file, restore_inflight
from olmo_ds.train.rl.rollout import (Groups, Sample, gather_samples, gathered_policy, group_advantages, group_share, pack_rows,
                                   rows_needed, sample_groups, score_samples, update_of)
from olmo_ds.train.rl.samples_log import SamplesPlace, prune_samples, wanted, write_samples
from olmo_ds.weights import load_model

log = logging.getLogger("olmo_ds")


class RLObjective:
    """GRPO's step (module docstring)."""

    stats = ("loss", "tokens", "clipped", "ratio", "capped", "tis", "entropy", "kl", "policy_ratio")

    def __init__(self, rl: RLConfig, *, seq_len: int, micro_batch: int, world_size: int, vocab_size: int,
                 device: torch.device, tokenizer=None, stop_ids=(), reward_fn: Callable | None = None,
                 reference=None, decode_dtype: torch.dtype | None = None, sp: SequenceParallel | None = None,
                 draw_prompts: Callable[[int, int], dict] | None = None, samples: SamplesPlace | None = None, actors=None,
                 prompts_at: Callable[[int], dict] | None = None, sample_lengths: Callable | None = None):
        self.rl, self.seq_len, self.micro, self.world_size = rl, seq_len, micro_batch, world_size
        self.vocab_size, self.device, self.tokenizer = vocab_size, device, tokenizer
        self.stop_ids = list(stop_ids) or ([tokenizer.eos_id] if tokenizer is not None else [])
        self.reward_fn = reward_fn  # None: the verifiers, in `olmo_ds.eval.scorer`'s workers under rl.verifier_timeout
        self.reference = reference  # a frozen plain OLMo (beta > 0), else None
        self.decode_dtype = decode_dtype
        self.sp = sp  # this rank's sequence group (None without sequence parallelism)
        self.sp_size = sp.size if sp is not None else 1
        self.dp_size = world_size // self.sp_size
        rank = torch.distributed.get_rank() if torch.distributed.is_available() and torch.distributed.is_initialized() else 0
        self.rank, self.dp_rank = rank, rank // self.sp_size
        self.draw_prompts = draw_prompts  # (step, draw) -> this rank's share of an extra draw (active sampling)
        self.samples = samples  # where the samples files go (None: not written)
        self.actors = actors  # `rl.actor_ranks`: the link to the actor ranks, which draw the samples (`actors.ActorClient`)
        self.sample_lengths = sample_lengths  # benchmarks only: each sample's own limit (`rollout.sample_requests`)
        # rl.async_steps >= 1: the decode copy, decoder and queue kept across steps (`olmo_ds.train.rl.inflight`)
        if rl.async_steps and prompts_at is None:
            raise ValueError("rl.async_steps needs prompts_at (the loader's prompts of any step): it decodes steps ahead of training")
        steps_ahead = (lambda step: self._prompts(prompts_at(step))) if prompts_at is not None else None  # noqa: E731
        self.inflight = InflightRollouts(rl, max_len=seq_len, stop_ids=self.stop_ids, tokenizer=tokenizer, lengths=sample_lengths,
                                         prompts_at=steps_ahead) if rl.async_steps and actors is None else None
        if actors is not None:  # the actors decode the steps ahead; the learners post those steps' prompts
            actors.prompts_at = steps_ahead
        self.samples_seen = 0
        self.idle_steps = 0  # steps in a row that trained nothing (every group dropped)
        self._divisor = None
        self.last_rollout: dict = {}  # this rank's counts and times of the step's rollout (`rollout`), for `end`
        self.last_samples: tuple = ([], [], 1)  # (samples, prompts, prompts a draw) of the step, for its samples file
        self._ratio_max = None
        self._t_train: float | None = None  # when the step's first update began

    # --- the rollout phase --------------------------------------------------------------------

    def rollout(self, engine, batch: dict, *, step: int, should_stop: Callable[[], bool] | None = None) -> dict[str, torch.Tensor] | None:
        """This rank's prompts -> its training rows for this step (collective: the gathering, each draw's agreement, the
        row count). None when `should_stop()` turned True during the rollout on any rank: the step is abandoned on
        every rank alike (its samples are keyed by step, so a resumed run draws them again; with rl.async_steps they stay
        queued, saved with the checkpoint, and the resumed run decodes on from them)."""
        rl = self.rl
        prompts = self._prompts(batch)
        per_draw = len(prompts)
        timings: dict = {"generation": 0.0, "reward": 0.0}
        module = engine.module if hasattr(engine, "module") else engine
        dtype = self.decode_dtype or (torch.bfloat16 if self.device.type == "cuda" else next(module.parameters()).dtype)
        target = per_draw * self.dp_size  # groups a step trains: the global batch of prompts
        samples: list[Sample] = []
        draws = 0
        self._decode: dict = {}  # the step's decode rows and slots (occupancy), in-flight staleness
        # with actor ranks only learner 0 keeps the gathered copy (it sends it to the actors); the others take part in the
        # gathering; in-flight rollouts keep theirs across steps and gather into it in place
        policy_at = (self.inflight.policy_at(module, dtype, step, timings) if self.inflight is not None else
                     gathered_policy(module, dtype, timings, keep=self.actors is None or self.rank == 0))
        with policy_at as policy:
            while True:
                new, stopping = self._draw(policy, prompts, draws * per_draw, step, timings, should_stop)
                samples += new
                groups = group_advantages(samples, prompts, samples_per_prompt=rl.samples_per_prompt, normalize_std=rl.normalize_advantage_std)
                agree = torch.tensor([groups.groups - groups.dropped, float(stopping)], dtype=torch.float64, device=self.device)
                if torch.distributed.is_available() and torch.distributed.is_initialized():
                    torch.distributed.all_reduce(agree)
                if agree[1].item():
                    return None
                if self.inflight is not None:
                    self.inflight.commit(step)
                draws += 1
                if draws > rl.active_sampling_draws or agree[0].item() / self.sp_size >= target:
                    break
                prompts += self._prompts(self.draw_prompts(step, draws))
        surplus = self._keep_first(groups, target, per_draw) if rl.active_sampling_draws else 0
        k = rl.updates_per_rollout
        kept = [s for s in groups.kept if s.dropped is None]
        need = torch.tensor(rows_needed(kept, prompts, self.seq_len, updates=k), device=self.device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(need, op=torch.distributed.ReduceOp.MAX)
        n_rows = max(1, -(-int(need.item()) // self.micro)) * self.micro  # per update: whole micro-batches
        rows = pack_rows(kept, prompts, self.seq_len, rows=n_rows, updates=k)
        if self.reference is not None:
            rows["reference"] = self.logprobs(self.reference, rows)
        if k > 1:  # updates 2..K's old policy: the weights before this step's first update (module docstring)
            t0 = time.perf_counter()
            rows["old_logprobs"] = self.logprobs(engine, rows, first_row=n_rows)
            timings["old_logprobs"] = time.perf_counter() - t0
        self.last_samples = (samples, prompts, per_draw)
        self.last_rollout = {**(self._counts(samples, prompts, groups, draws, surplus) if self.sp is None or self.sp.rank == 0 else {}),
                             "time": timings, "decode": self._decode}
        return rows

    def close(self) -> None:
        """The run is over: with actor ranks, tell them to stop (every learner calls it)."""
        if self.actors is not None:
            self.actors.close()

    def _prompts(self, batch: dict) -> list[Prompt]:
        return [Prompt(list(ids), v, gt, int(i)) for ids, i, v, gt in
                zip(batch["prompt_ids"], batch["prompt_index"].tolist(), batch["verifier"], batch["ground_truth"])]

    def _draw(self, policy, prompts: list[Prompt], first: int, step: int, timings: dict, should_stop) -> tuple[list[Sample], bool]:
        """G scored samples of each of prompts `first`.. (with sequence parallelism this rank's share, then the group's
        all of them); (samples, whether a stop request interrupted the generation: then no samples)."""
        rl, sp = self.rl, self.sp
        pairs = (len(prompts) - first) * rl.samples_per_prompt
        mine = group_share(pairs, sp.size, sp.rank) if sp is not None else range(pairs)  # a sequence group splits its samples
        t0 = time.perf_counter()
        if self.actors is not None:  # the actor ranks draw them (olmo_ds/train/rl/actors.py)
            drawn = self.actors.draw(policy, prompts[first:], step=step, samples_per_prompt=rl.samples_per_prompt)
            samples = [Sample(prompt=first + k // rl.samples_per_prompt, index=k % rl.samples_per_prompt, tokens=d["tokens"],
                              logprobs=d["logprobs"], finish=d["finish"], text=d["text"], versions=tuple(d["versions"]))
                       for k, d in enumerate(drawn)]
            self._actor_stats(step, samples)
            timings["actor_wait"] = timings.get("actor_wait", 0.0) + self.actors.stats["weights_wait"]
            stopping = False
        else:
            samples, stopping = self._generate(policy, prompts, first, mine, step, should_stop)
        timings["generation"] += time.perf_counter() - t0
        t0 = time.perf_counter()
        score_samples(samples, prompts, self.reward_fn, timeout_s=rl.verifier_timeout, truncated=rl.truncated,
                      truncated_reward=rl.truncated_reward)
        timings["reward"] += time.perf_counter() - t0
        if sp is not None:
            t0 = time.perf_counter()
            samples = gather_samples(samples, sp.group)
            timings["generation"] += time.perf_counter() - t0
        return samples, stopping

    def _actor_stats(self, step: int, samples: list[Sample]) -> None:
        """The actors' decode rows and slots since their last step (occupancy), and the step's staleness (each sample's
        first version against the step's: at most rl.async_steps, as the actors submit no prompt earlier)."""
        stats, staleness = self.actors.stats, [step - s.versions[0] for s in samples]
        d = self._decode
        if self.rank == 0:  # every learner gets the same actors' counts; one counts them
            d["decode_rows"], d["slot_steps"] = stats["decode_rows"], stats["slot_steps"]
        d.update(stale_dropped=0, staleness_sum=sum(staleness), staleness_n=len(staleness), staleness_max=max(staleness, default=0))

    def _generate(self, policy, prompts: list[Prompt], first: int, pairs: range, step: int, should_stop) -> tuple[list[Sample], bool]:
        """This rank's samples `pairs` of prompts `first`.. from its decode copy (in-flight rollouts: all of the step's,
        from the decoder running ahead; no sequence parallelism or extra draws there, `RLConfig.validate`); (samples,
        whether a stop request interrupted the generation: then none)."""
        rl = self.rl
        try:
            if self.inflight is not None:
                return self.inflight.collect(step, prompts, should_stop, self._decode), False
            return sample_groups(policy, prompts, samples_per_prompt=rl.samples_per_prompt, max_new_tokens=rl.max_new_tokens,
                                 temperature=rl.temperature, seed=rl.seed, step=step, stop_ids=self.stop_ids,
                                 tokenizer=self.tokenizer, batch_size=rl.generation_batch_size, pairs=pairs, top_p=rl.top_p,
                                 stop=rl.stop, first=first, should_stop=should_stop, lengths=self.sample_lengths,
                                 stats=self._decode), False
        except GenerationInterrupted:
            return [], True

    def _keep_first(self, groups: Groups, target: int, per_draw: int) -> int:
        """Active sampling: of the groups with signal on every rank, the first `target` in the step's global order
        (draw, then global prompt position) train; the rest are marked "surplus" (collective). The same groups train
        on any number of ranks. Returns the surplus groups counted on this rank."""
        g = self.rl.samples_per_prompt
        key = lambda p: self._global_place(p, per_draw)  # noqa: E731
        mine = sorted({key(s.prompt) for s in groups.all if s.dropped is None})
        everyone = [None] * (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        if torch.distributed.is_initialized():
            torch.distributed.all_gather_object(everyone, mine)
        else:
            everyone = [mine]
        chosen = set(sorted({k for part in everyone for k in part})[:target])
        surplus = 0
        for start in range(0, len(groups.all), g):
            group = groups.all[start:start + g]
            if group[0].dropped is None and key(group[0].prompt) not in chosen:
                surplus += 1
                for s in group:
                    s.dropped = "surplus"
        return surplus

    def _global_place(self, prompt: int, per_draw: int) -> tuple[int, int]:
        """(draw, place in the draw's global batch) of this rank's prompt `prompt`: rank r's prompt j of a draw is the
        draw's global prompt r x per_draw + j, on any number of ranks."""
        return prompt // per_draw, self.dp_rank * per_draw + prompt % per_draw

    def _counts(self, samples: list[Sample], prompts: list[Prompt], groups: Groups, draws: int, surplus: int) -> dict:
        """This rank's rollout counts, for `end` (which sums them over ranks); each rank of a sequence group holds the
        group's samples, so only its first rank counts them."""
        lengths = [len(s.tokens) for s in samples]
        by_verifier: dict = {}
        for s in samples:
            acc = by_verifier.setdefault(prompts[s.prompt].verifier, [0.0, 0, 0, 0, 0])
            acc[0] += s.reward
            acc[1] += 1
            acc[2] += s.finish == "length"
            acc[3] += len(s.tokens)
            acc[4] += s.score >= 1.0
        return {
            "samples": len(samples), "reward_sum": sum(s.reward for s in samples), "solved": sum(s.score >= 1.0 for s in samples),
            "groups": groups.groups, "dropped": groups.dropped, "surplus": surplus, "draws": draws - 1, "nonfinite": groups.nonfinite,
            "reward_errors": groups.reward_errors, "length_sum": sum(lengths), "length_max": max(lengths, default=0),
            "truncated": sum(s.finish == "length" for s in samples), "by_verifier": by_verifier,
            "trained_samples": sum(s.dropped is None and s.trained for s in samples), "prompts": len(prompts),
            "row_tokens": sum(len(prompts[s.prompt].ids) + len(s.tokens) for s in samples if s.dropped is None and s.trained),
        }

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

    def end(self, sums: torch.Tensor, *, n_micro: int, world_size: int, tokens: int, step: int | None = None,
            per_update: tuple[torch.Tensor, list] | None = None) -> dict:
        """The step's metrics, over all its updates, and with K > 1 each update's (`per_update`: each update's all-reduced
        `stats` sums and grad norm); step `step`'s samples file. Collective: the ratio's max, the rollout's counts and the
        samples over every rank. A metric with nothing to measure (no token trained) is left out, not 0."""
        train_s, self._t_train = time.perf_counter() - self._t_train, None
        metrics = self._loss_metrics(sums)
        if per_update is not None and self.rl.updates_per_rollout > 1:
            for u, (part, norm) in enumerate(zip(per_update[0], per_update[1])):
                m = self._loss_metrics(part)
                metrics.update({f"update_{u + 1}/{k}": m.get(k) for k in ("loss", "clip_fraction", "generated_tokens")})
                metrics[f"update_{u + 1}/grad_norm"] = None if norm is None else float(norm)
        ratio_max = self._ratio_max.clone()
        mine = {**self.last_rollout, "train_s": train_s}
        rollouts = [None] * (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(ratio_max, op=torch.distributed.ReduceOp.MAX)
            torch.distributed.all_gather_object(rollouts, mine)
        else:
            rollouts = [mine]
        if metrics["generated_tokens"]:
            metrics["importance_ratio_max"] = float(ratio_max)
        metrics.update(self.rollout_metrics(rollouts))
        metrics["tokens"] = sum(r.get("row_tokens", 0) for r in rollouts)  # the rows' real tokens (the trainer's tokens/s)
        self.samples_seen += metrics["rollout/samples"]
        self.idle_steps = 0 if metrics["generated_tokens"] else self.idle_steps + 1
        if self.idle_steps:
            log.warning("step %s trained nothing: every group's rewards were equal (%d steps in a row); the rewards or the "
                        "prompts' difficulty give no signal%s", step, self.idle_steps,
                        "" if self.rl.active_sampling_draws else " (rl.active_sampling_draws draws more prompts to fill a step)")
        if step is not None and self.samples is not None and wanted(step, self.rl.samples_every):
            self._write_samples(step)
        return metrics

    def _loss_metrics(self, sums: torch.Tensor) -> dict:
        loss, n, clipped, ratio, capped, tis, entropy, kl, policy_ratio = sums.tolist()
        metrics = {"loss": loss / max(n, 1.0), "generated_tokens": int(n)}
        if not n:  # no token trained: nothing to measure
            return metrics
        metrics.update(clip_fraction=clipped / n, importance_ratio_mean=ratio / n, tis_capped_fraction=capped / n,
                       tis_weight_mean=tis / n, entropy=entropy / n)
        if self.rl.beta:
            metrics["kl"] = kl / n
        if self.rl.updates_per_rollout > 1:  # exp(lp - old): 1 on the first update, moved by the earlier ones after
            metrics["policy_ratio_mean"] = policy_ratio / n
        return metrics

    def _write_samples(self, step: int) -> None:
        """Step `step`'s samples file (`olmo_ds.train.rl.samples_log`): every rank's records to rank 0, which writes."""
        samples, prompts, per_draw = self.last_samples
        k = self.rl.updates_per_rollout
        records = [] if self.sp is not None and self.sp.rank else [{
            "step": step, "draw": s.prompt // per_draw, "prompt_index": prompts[s.prompt].index, "sample": s.index,
            "prompt": self.tokenizer.decode(list(prompts[s.prompt].ids)) if self.tokenizer is not None else None,
            "completion": s.text, "verifier": prompts[s.prompt].verifier, "score": s.score, "reward": s.reward,
            "reason": s.error or s.detail, "advantage": s.advantage, "finish": s.finish, "length": len(s.tokens),
            "logprob_mean": sum(s.logprobs) / max(len(s.logprobs), 1), "dropped": s.dropped,
            "versions": list(s.versions) if s.versions is not None else [step - 1, step - 1],
            "trained": s.dropped is None and s.trained, "update": update_of(s, k),
            "order": (*self._global_place(s.prompt, per_draw), s.index)} for s in samples]
        parts = [None] * (torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1)
        if torch.distributed.is_initialized():
            torch.distributed.gather_object(records, parts if self.rank == 0 else None, dst=0)
        else:
            parts = [records]
        if self.rank == 0:
            ordered = sorted((r for part in parts for r in part), key=lambda r: r.pop("order"))
            write_samples(self.samples.run_dir, step, ordered)
            prune_samples(self.samples.run_dir, self.samples.keep_last, self.samples.keep_every)

    @staticmethod
    def rollout_metrics(rollouts: list[dict]) -> dict:
        """All ranks' rollout counts as the step's metrics (times: the slowest rank's)."""
        total = lambda k: sum(r.get(k, 0) for r in rollouts)  # noqa: E731
        samples = max(total("samples"), 1)
        out = {"rollout/prompts": total("prompts"), "rollout/samples": total("samples"), "rollout/trained_samples": total("trained_samples"),
               "rollout/reward_mean": total("reward_sum") / samples,
               "rollout/solve_rate": total("solved") / samples, "rollout/groups": total("groups"),
               "rollout/dropped_groups": total("dropped"), "rollout/reward_errors": total("reward_errors"),
               "rollout/generated_tokens": total("length_sum"), "rollout/response_length_mean": total("length_sum") / samples,
               "rollout/response_length_max": max(r.get("length_max", 0) for r in rollouts),
               "rollout/truncated_fraction": total("truncated") / samples}
        if total("nonfinite"):
            out["rollout/nonfinite_groups"] = total("nonfinite")
        if any("draws" in r and r["draws"] for r in rollouts) or any(r.get("surplus") for r in rollouts):
            out["rollout/extra_draws"] = max(r.get("draws", 0) for r in rollouts)
            out["rollout/surplus_groups"] = total("surplus")
        verifiers: dict[str, list] = {}
        for r in rollouts:
            for v, acc in r.get("by_verifier", {}).items():
                mine = verifiers.setdefault(v, [0.0] * len(acc))
                for i, x in enumerate(acc):
                    mine[i] += x
        for v, (reward_sum, n, truncated, length, solved) in sorted(verifiers.items()):
            n = max(n, 1)
            out.update({f"rollout/reward_mean/{v}": reward_sum / n, f"rollout/solve_rate/{v}": solved / n,
                        f"rollout/response_length_mean/{v}": length / n, f"rollout/truncated_fraction/{v}": truncated / n})
        extra = tuple(k for k in ("old_logprobs", "actor_wait") if any(k in r.get("time", {}) for r in rollouts))
        for phase in ("gather", "generation", "reward", *extra):
            out[f"time/{phase}_s"] = max(r.get("time", {}).get(phase, 0.0) for r in rollouts)
        decode = lambda k: sum(r.get("decode", {}).get(k, 0) for r in rollouts)  # noqa: E731
        if decode("slot_steps"):
            out["rollout/occupancy"] = decode("decode_rows") / decode("slot_steps")  # the slots' mean share in use
        if decode("staleness_n"):  # in-flight rollouts (rl.async_steps)
            out.update({"rollout/stale_dropped": decode("stale_dropped"), "rollout/staleness_mean": decode("staleness_sum") / decode("staleness_n"),
                        "rollout/staleness_max": max(r.get("decode", {}).get("staleness_max", 0) for r in rollouts)})
        # what the learner waited for its samples (colocated: its own decoding; with actor ranks: the actors), and with
        # actor ranks `time/actor_wait_s`, the time the actors sat idle for the learners' next weights (0 without actors)
        out["time/learner_wait_s"] = out["time/generation_s"]
        out.setdefault("time/actor_wait_s", 0.0)
        out["time/training_s"] = max(r.get("train_s", 0.0) for r in rollouts)
        return out

    def log_metrics(self, m: dict) -> dict:
        """RL's step metrics, and the trainer's that mean something else here: the global batch counts prompts
        (`train/prompts`), samples and packed rows apart; `train/ppl` (exp of the GRPO loss) is left out."""
        keys = ("clip_fraction", "importance_ratio_mean", "importance_ratio_max", "tis_capped_fraction", "entropy", "kl",
                "policy_ratio_mean", "generated_tokens")
        return {**{f"rl/{k}": m[k] for k in keys if k in m}, **{f"rl/{k}": v for k, v in m.items() if k.startswith("update_")},
                **{k: v for k, v in m.items() if k.startswith(("rollout/", "time/"))},
                "rl/samples_seen": self.samples_seen, "train/ppl": None, "train/global_batch_size": None,
                "train/rows": m.get("global_batch_size")}

    def state_dict(self) -> dict:
        """What train_state.json holds (with samples in flight: their async_steps and world size, for `restore_inflight`)."""
        state = {"rl_samples_seen": self.samples_seen}
        if self.inflight is not None and self.inflight.holds:
            state["rl_inflight"] = {"async_steps": self.rl.async_steps, "world_size": self.world_size}
        return state

    def rank_files(self) -> dict[str, dict]:
        """This rank's files of a checkpoint beyond the engine's: the samples in flight (`olmo_ds.train.rl.inflight`)."""
        state = self.inflight.state_dict() if self.inflight is not None else None
        return {inflight_file(self.rank): state} if state is not None else {}

    def load_state_dict(self, state: dict) -> None:
        self.samples_seen = state.get("rl_samples_seen", 0)


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
    saved = restore_inflight(plan.resume_dir, plan.resume_state, rank=plan.rank, world_size=plan.world_size, async_steps=rl.async_steps)
    if rl.async_steps:
        log.info("rl.async_steps %d: each rank keeps its decode copy and cache across steps; prompts enter up to %d steps ahead of "
                 "training%s", rl.async_steps, rl.async_steps, "" if rl.cap else " (rl.tis_cap is off: nothing corrects their staleness)")
    objective = RLObjective(rl, seq_len=cfg.batch.seq_len, micro_batch=cfg.batch.micro_batch_size, world_size=plan.world_size,
                            vocab_size=plan.model.vocab_size, device=device, tokenizer=plan.tokenizer,
                            stop_ids=stop_ids(plan.tokenizer), reference=reference, decode_dtype=dtype, sp=sp,
                            draw_prompts=plan.loader.prompt_draw if rl.active_sampling_draws else None,
                            samples=SamplesPlace(plan.run_dir, cfg.checkpoint.keep_last, cfg.checkpoint.keep_every),
                            actors=ActorClient(split_roles(rl.actor_ranks), device, ahead=rl.async_steps) if rl.actor_ranks else None,
                            prompts_at=plan.loader.prompts_at if rl.async_steps else None)
    if saved is not None:
        objective.inflight.load_state_dict(saved)
        log.info("rl.async_steps: the samples in flight at %s restored (%d waiting or decoding, %d finished, prompts submitted "
                 "up to step %d)", plan.resume_dir, len(saved["decoder"]["waiting"]) + len(saved["decoder"]["active"]),
                 len(saved["done"]), saved["submitted"])
    return objective
