"""RL with verifiable rewards (GRPO, open-instruct's OlmoRL): the trainer reaches it only through
`olmo_ds.train.objective` (`build_objective`, `build_evaluator`).

- `grpo`: `RLObjective`, the step's rollout, loss and metrics;
- `rollout`: gathering the policy, sampling, scoring, group advantages, packed rows;
- `samples_log`: the RUN/samples/ files;
- `evaluator`: the in-loop greedy evaluation.
"""

from olmo_ds.train.rl.evaluator import RLEvaluator
from olmo_ds.train.rl.grpo import RLObjective, rl_objective

__all__ = ["RLEvaluator", "RLObjective", "rl_objective"]
