"""RL with verifiable rewards (GRPO, open-instruct's OlmoRL): the trainer reaches it only through
`olmo_ds.train.objective` (`build_objective`, `build_evaluator`).

- `grpo`: `RLObjective`, the step's rollout, loss and metrics;
- `rollout`: gathering the policy, sampling, scoring, group advantages, packed rows;
- `inflight`: in-flight rollouts (`rl.async_steps`): the decode copy and engine kept across steps, samples decoded
  ahead of training, their versions and staleness, the queue saved with each checkpoint;
- `samples_log`: the RUN/samples/ files;
- `evaluator`: the in-loop greedy evaluation.
"""

from olmo_ds.train.rl.evaluator import RLEvaluator
from olmo_ds.train.rl.grpo import RLObjective, rl_objective

__all__ = ["RLEvaluator", "RLObjective", "rl_objective"]
