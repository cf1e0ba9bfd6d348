"""Actor ranks' parts that need no launch (`olmo_ds.train.rl.actors`): who is an actor, what a learner's launch becomes,
what is refused, and the weights' one flat buffer. The launch itself (1 actor + 2 learners against 2 colocated ranks,
bit for bit): tests/train/test_rl_ranks.py."""

from __future__ import annotations

import pytest
import torch

from olmo_ds.model import OLMo, preset
from olmo_ds.train.config import ConfigError, RLConfig
from olmo_ds.train.rl.actors import LINK_ENV, flat_weights, split_roles, unflat


def test_the_last_ranks_act_and_a_learners_launch_counts_only_learners():
    learner = {"RANK": "1", "WORLD_SIZE": "8"}
    role = split_roles(2, learner)
    assert (role.actor, role.learners, role.actors) == (False, 6, 2) and learner["WORLD_SIZE"] == "6"
    assert split_roles(2, learner) == role  # a second call in the same process keeps the split
    actor = {"RANK": "7", "WORLD_SIZE": "8"}
    assert split_roles(2, actor).actor and actor["WORLD_SIZE"] == "8" and actor[LINK_ENV] == "6,2,7"
    assert split_roles(0, {"RANK": "0", "WORLD_SIZE": "8"}) is None


def test_actor_ranks_that_leave_no_learner_or_come_with_active_sampling_are_refused():
    with pytest.raises(ConfigError, match=r"rl.actor_ranks 2: the launch has 2 ranks, and at least one must learn"):
        split_roles(2, {"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(ConfigError, match=r"rl.actor_ranks 1 with rl.active_sampling_draws 2"):
        RLConfig(actor_ranks=1, active_sampling_draws=2).validate("x.yaml")
    with pytest.raises(ConfigError, match=r"rl.actor_ranks must be an integer >= 0"):
        RLConfig(actor_ranks=-1).validate("x.yaml")


def test_weights_travel_as_one_flat_buffer_and_land_bit_for_bit():
    torch.manual_seed(0)
    a, b = OLMo(preset("tiny")), OLMo(preset("tiny"))
    flat = flat_weights(a)
    assert flat.numel() == sum(p.numel() for p in a.parameters())
    b.load_state_dict(unflat(b, flat))
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
