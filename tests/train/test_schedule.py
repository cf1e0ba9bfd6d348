"""Learning-rate schedules: warmup, then cosine / linear / WSD down to the final fraction."""

import math

import pytest

from olmo_ds.train.config import ScheduleConfig
from olmo_ds.train.schedule import lr_at


def lrs(max_steps=100, **kw):
    cfg = ScheduleConfig(**kw)
    return [lr_at(s, peak_lr=1.0, max_steps=max_steps, cfg=cfg) for s in range(max_steps)]


@pytest.mark.parametrize("kind", ["cosine", "linear"])
def test_warmup_then_decay_to_the_final_fraction(kind):
    v = lrs(kind=kind, warmup_steps=10, final_lr_fraction=0.1)
    assert v[0] == pytest.approx(0.1) and v[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(v[9:], v[10:]))
    assert v[-1] == pytest.approx(0.1)
    if kind == "cosine":
        assert v[10 + 45 - 1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))


def test_wsd_is_flat_then_decays_over_the_last_steps():
    v = lrs(kind="wsd", warmup_steps=10, decay_steps=20, final_lr_fraction=0.0)
    assert v[10:80] == [1.0] * 70
    assert v[80] < 1.0 and v[-1] == pytest.approx(0.0)


def test_constant():
    assert lrs(kind="constant", warmup_steps=0) == [1.0] * 100
