"""Mixtures of sources: target ratios, repetition caps, the report, and resume over a mixture."""

import numpy as np
import pytest
from test_loader import SEQ, loader, write_source

from olmo_ds.data.config import SourceConfig

B_BASE = 50000  # source b's tokens are B_BASE + position, so a row tells its source


def src(path, **kw):
    return SourceConfig(path=str(path), **kw)


def origin(batch):
    """(source, instance) of every row."""
    first = batch["input_ids"][:, 0].numpy()
    return [("b", (int(v) - B_BASE) // SEQ) if v >= B_BASE else ("a", int(v) // SEQ) for v in first]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mix")
    a = write_source(root / "a", [10000, 10000])  # 1250 instances
    b = write_source(root / "b", [20000], values=B_BASE + np.arange(20000))  # 1250 instances
    small = write_source(root / "small", [200], values=B_BASE + np.arange(200))  # 12 instances
    return a, b, small


def test_weights_set_the_share_of_every_stretch_of_batches(pair):
    a, b, _ = pair
    ld = loader([src(a, weight=3), src(b, weight=1)], bs=50, prefetch=0)
    # No repetition by default: b is the limit... a is (3/4 of the epoch), so the epoch is 1250 / 0.75.
    assert [s.per_epoch for s in ld.mixture.sources] == [1250, 416]
    rows = []
    for step in range(ld.mixture.epoch_size // 50):
        rows += origin(ld.next_batch())
        if step == 7:  # the first 400 instances already follow the weights
            assert abs(sum(s == "b" for s, _ in rows) / len(rows) - 0.25) < 0.05
    counts = {name: sum(s == name for s, _ in rows) for name in "ab"}
    assert counts["a"] + counts["b"] == 1650
    assert len(set(rows)) == len(rows), "no instance repeats within an epoch"


def test_a_small_source_is_upsampled_only_as_far_as_its_cap(pair):
    a, _, small = pair
    capped = loader([src(a), src(small)], bs=8, prefetch=0)
    # Equal weights, no repetition allowed: the 12-instance source limits the epoch to 24.
    assert [s.per_epoch for s in capped.mixture.sources] == [12, 12]
    up = loader([src(a), src(small, max_epochs=3)], bs=8, prefetch=0)
    assert [s.per_epoch for s in up.mixture.sources] == [36, 36]
    epoch0 = [o for _ in range(9) for o in origin(up.next_batch())]
    small_rows = [i for s, i in epoch0 if s == "b"]
    assert sorted(small_rows) == sorted(list(range(12)) * 3), "each small instance exactly 3 times"
    # a is downsampled: 36 of its 1250 instances per epoch, none repeated before all were shown.
    a_rows = [i for s, i in epoch0 if s == "a"]
    assert len(set(a_rows)) == 36
    report = {r["name"]: r for r in up.mixture_report(total_instances=72 * 10)}
    assert report["small"]["source_epochs_per_epoch"] == 3.0
    assert report["small"]["run_source_epochs"] == pytest.approx(30.0)
    assert report["a"]["actual_share"] == 0.5 and report["a"]["tokens_per_epoch"] == 36 * SEQ
    assert report["a"]["run_tokens"] == 360 * SEQ


def test_a_downsampled_source_shows_every_instance_before_repeating(pair):
    a, _, small = pair
    ld = loader([src(a, weight=1), src(small, weight=1, max_epochs=100)], bs=100, prefetch=0)
    assert ld.mixture.sources[0].per_epoch == 1200  # the small source's 100 passes cap the epoch at 2400
    epochs = []
    for _ in range(2):
        epochs.append([i for _ in range(24) for s, i in origin(ld.next_batch()) if s == "a"])
    assert len(epochs[0]) == len(set(epochs[0])) == 1200
    # Epoch 1 first shows the 50 instances epoch 0 left out, then starts a second pass.
    assert set(range(1250)) - set(epochs[0]) <= set(epochs[1])
    counts = np.bincount(epochs[0] + epochs[1], minlength=1250)
    assert counts.min() == 1 and counts.max() == 2


def test_mixture_resume_on_another_world_size(pair):
    a, b, _ = pair
    cfg = [src(a, weight=2), src(b, weight=1)]
    ref = loader(cfg, bs=12, prefetch=0)
    expected = [origin(ref.next_batch()) for _ in range(8)]
    first = loader(cfg, bs=12, world=3, rank=1, prefetch=0)
    for _ in range(5):
        first.next_batch()
    resumed = [loader(cfg, bs=12, world=2, rank=r, prefetch=2) for r in range(2)]
    for ld in resumed:
        ld.load_state_dict(first.state_dict())
    for step in range(5, 8):
        assert origin(resumed[0].next_batch()) + origin(resumed[1].next_batch()) == expected[step]
    for ld in resumed:
        ld.close()


def test_changing_the_weights_changes_the_fingerprint(pair):
    a, b, _ = pair
    one = loader([src(a, weight=2), src(b, weight=1)])
    two = loader([src(a, weight=1), src(b, weight=1)])
    assert one.fingerprint != two.fingerprint
    with pytest.raises(ValueError, match="refusing to resume on different data"):
        two.load_state_dict(one.state_dict())


def test_a_weight_too_small_for_one_instance_is_refused(pair):
    a, _, small = pair
    with pytest.raises(ValueError, match="small: its weight gives it 0 instances"):
        loader([src(a, weight=10000), src(small, weight=1)])
    with pytest.raises(ValueError, match="duplicate names"):
        loader([src(a), src(a)])


def test_the_order_is_the_same_on_every_numpy_release():
    """Exact resume needs the same order from the same seed years later: these ids were produced by
    numpy 2.x's PCG64 + Generator.shuffle; a release that changes that stream must fail here, not in a
    resumed run."""
    from olmo_ds.data.mixture import Mixture
    from olmo_ds.data.order import GlobalOrder

    mixture = Mixture(["a", "b"], [3, 1], [None, 2], [1000, 100])
    order = GlobalOrder(mixture, seed=1234)
    assert mixture.epoch_size == 800
    assert order.ids(0, 12).tolist() == [609, 74, 768, 436, 960, 1057, 118, 1007, 746, 630, 180, 1076]
    assert order.ids(800, 6).tolist() == [124, 734, 330, 1027, 94, 840]
