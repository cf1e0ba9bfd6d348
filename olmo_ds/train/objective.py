"""What a training step optimises: a micro-batch's loss, the counts the whole step needs first, and what it logs.

    objective = NextTokenLoss(masked=loader.masked, sp=sp, layout=layout, z_loss_coef=cfg.optim.z_loss, device=device)
    batch = objective.begin(batch, n_micro)            # this rank's rows on the device; the step's counts (collective)
    loss, stats = objective.forward(engine, micro_batch)   # per micro-batch: back-propagate `loss`, sum `stats`
    metrics = objective.end(all_reduced_stats, n_micro=..., world_size=...)

`build_objective` picks the objective the data trains with: preference pairs -> `PreferenceLoss` (train/preference.py),
RL prompts -> `RLObjective` (train/rl/grpo.py, which also has `rollout`: the trainer turns a step's prompts into rows
with it before `begin`), else `NextTokenLoss`.

The trainer's step (`Trainer.train_step`) is the same for every objective: cut the rows into micro-batches, forward,
backward, step at the accumulation boundary, all-reduce the summed `stats` once. What differs lives here.

Pretraining rows: the loss is each micro-batch's mean cross-entropy (+ z-loss), and the logged loss the mean of those.

Fine-tuning (masked data, `DataLoader.masked`): the loss is the mean over the trained tokens of the whole GLOBAL
batch. Before the first forward the step's targets (labels != -100 over all micro-batches of the rank) and its rows'
conversation tokens are summed and all-reduced, one collective; every micro-batch's summed loss is divided by
`token_mean_divisor` of that count (which undoes DeepSpeed's division by the accumulation steps and its averaging
over ranks), so the gradient is the same however the step is split into micro-batches and ranks, and the logged
loss is that token mean.

Sequence parallelism (`parallel.sequence_parallel_size` N, `olmo_ds.train.parallel`): each rank of a sequence group
trains on its 1/N slice of every row's tokens and labels (`local_rows`, cut before the copy to the device), with the
rows' whole document lengths and positions for the masks (`olmo_ds.model.sequence_parallel`). The loss then takes the
fine-tuning path above for pretraining rows too: a slice's share of the step's token mean, counted over all ranks; a
row's conversation tokens are counted by the first rank of its sequence group only.
"""

from __future__ import annotations

import torch

from olmo_ds.model.loss import count_targets, token_mean_divisor
from olmo_ds.model.sequence_parallel import SequenceParallel
from olmo_ds.train.config import ConfigError
from olmo_ds.train.rl import RLEvaluator, rl_objective
from olmo_ds.train.rl.actors import actor_loop, split_roles
from olmo_ds.train.parallel import ParallelLayout, local_rows
from olmo_ds.train.preference import PreferenceLoss


def build_objective(plan, *, sp: SequenceParallel | None, device: torch.device):
    """The run's objective (module docstring); the plan has checked that its data and its config section agree."""
    cfg = plan.cfg
    if cfg.dpo is not None:
        return PreferenceLoss(cfg, world_size=plan.world_size, device=device)
    if cfg.rl is not None:
        return rl_objective(plan, sp=sp, device=device)
    return NextTokenLoss(masked=bool(getattr(plan.loader, "masked", False)), sp=sp, layout=plan.layout,
                         z_loss_coef=cfg.optim.z_loss, device=device)


def actor_role(cfg):
    """Before anything else of a run starts: with `rl.actor_ranks`, an actor rank's work as a function (call it: it runs
    the actor until the learners stop, and returns the exit status); None on a learner, whose launch now counts only
    the learners (`olmo_ds.train.rl.actors.split_roles`), and on every rank of a run without actors."""
    if cfg.rl is None or not cfg.rl.actor_ranks:
        return None
    if cfg.parallel.sequence_parallel_size > 1:
        raise ConfigError(f"{cfg.source}: rl.actor_ranks {cfg.rl.actor_ranks} with parallel.sequence_parallel_size "
                          f"{cfg.parallel.sequence_parallel_size}: actor ranks are not built for sequence parallelism; set one of them off")
    role = split_roles(cfg.rl.actor_ranks, where=f"{cfg.source}: rl.actor_ranks")
    return (lambda: actor_loop(cfg, role)) if role.actor else None


def build_evaluator(cfg, tokenizer, rank: int, world_size: int):
    """The objective's own in-loop evaluation, or None for the trainer's (`InLoopEvaluator`): an RL run's greedy answers
    to its validation prompts, scored by the verifiers (`olmo_ds.train.rl.RLEvaluator`)."""
    return RLEvaluator(cfg, tokenizer, rank, world_size) if cfg.rl is not None else None


class NextTokenLoss:
    """Next-token cross-entropy (+ z-loss) for pretraining and fine-tuning rows; see the module docstring."""

    stats = ("ce", "z")  # what `forward` returns per micro-batch, summed over the step's micro-batches and ranks

    def __init__(self, *, masked: bool, sp: SequenceParallel | None, layout: ParallelLayout, z_loss_coef: float,
                 device: torch.device):
        self.masked, self.sp, self.layout, self.z_loss_coef, self.device = masked, sp, layout, z_loss_coef, device
        self.trained_tokens_seen = 0  # fine-tuning: loss targets trained on so far (global)
        self._kwargs: dict = {}
        self._counts: torch.Tensor | None = None

    def begin(self, batch: dict[str, torch.Tensor], n_micro: int) -> dict[str, torch.Tensor]:
        """This rank's rows of a step, on the device. Collective with fine-tuning rows or sequence parallelism:
        the step's trained and conversation tokens over all ranks, one all-reduce before the first forward."""
        if self.sp is not None:
            batch = local_rows(batch, self.sp)
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        self._kwargs = {"sequence_parallel": self.sp} if self.sp is not None else {}
        self._counts = None
        if self.masked or self.sp is not None:
            targets = count_targets(batch["labels"])
            real = batch["row_tokens"].sum() if self.masked and self.layout.sp_rank == 0 else targets.new_zeros(())
            self._counts = torch.stack([targets, real.to(targets.dtype)])
            torch.distributed.all_reduce(self._counts)
            self._kwargs["loss_divisor"] = token_mean_divisor(self._counts[0], self.layout.world_size, n_micro)
        return batch

    def forward(self, engine, mb: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(the micro-batch's loss to back-propagate, its float64 `stats`)."""
        kwargs = {**self._kwargs, "positions": mb["positions"]} if self.masked else self._kwargs
        out = engine(mb["input_ids"], labels=mb["labels"], doc_lens=mb.get("doc_lens"), z_loss_coef=self.z_loss_coef, **kwargs)
        z = out.z_loss.detach().double() if out.z_loss is not None else torch.zeros((), dtype=torch.float64, device=self.device)
        return out.loss, torch.stack([out.ce_loss.detach().double(), z])

    def end(self, sums: torch.Tensor, *, n_micro: int, world_size: int, tokens: int) -> dict:
        """The step's metrics from its all-reduced `stats` sums; `tokens`: the step's row positions over all ranks.

        Pretraining: the mean of the micro-batch means. Fine-tuning and sequence parallelism: micro-batch k returned
        S_k / d (its summed loss over d = N / (world * n_micro), N the step's global targets), so this is sum_k S_k / N,
        the step's token mean (for pretraining rows, whose targets per row are all alike, the same number as the mean
        of micro-batch means)."""
        ce_loss, z_loss = (sums / (n_micro * world_size)).tolist()
        metrics = {"loss": ce_loss, "z_loss": z_loss}
        if self.masked:
            trained, real = (int(c) for c in self._counts.tolist())
            self.trained_tokens_seen += trained
            metrics.update(trained_tokens=trained, packing_efficiency=real / tokens, trained_fraction=trained / tokens)
        return metrics

    def log_metrics(self, m: dict) -> dict:
        """What the progress line and metrics.jsonl add for this objective, from the last step's `end`."""
        if not self.masked:
            return {}
        # this step's (global): loss targets, and the shares of its row positions holding conversations / targets
        return {"train/trained_tokens": m["trained_tokens"], "train/trained_tokens_seen": self.trained_tokens_seen,
                "data/packing_efficiency": m["packing_efficiency"], "data/trained_fraction": m["trained_fraction"]}

    def state_dict(self) -> dict:
        """What `train_state.json` keeps of this objective (nothing for pretraining: its files stay as they were)."""
        return {"trained_tokens_seen": self.trained_tokens_seen} if self.masked else {}

    def load_state_dict(self, state: dict) -> None:
        self.trained_tokens_seen = state.get("trained_tokens_seen", 0)
