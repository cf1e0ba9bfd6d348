"""The `dpo:` train-config section: typed, optional, and every bad value refused naming its key."""

import pytest

from olmo_ds.train.config import ConfigError, load_config

BASE = """\
run_dir: runs/x
data:
  sources:
    - path: data/pairs
batch:
  global_batch_size: 8
  seq_len: 128
"""


def load(tmp_path, extra: str = "", overrides=()):
    path = tmp_path / "run.yaml"
    path.write_text(BASE + extra)
    return load_config(path, list(overrides))


def test_absent_section_is_none_and_a_present_one_is_typed(tmp_path):
    assert load(tmp_path).dpo is None
    cfg = load(tmp_path, "dpo:\n  loss: dpo_norm\n  beta: 5\n")
    assert (cfg.dpo.loss, cfg.dpo.beta, cfg.dpo.label_smoothing) == ("dpo_norm", 5.0, 0.0)
    assert cfg.dpo.needs_reference
    assert not load(tmp_path, "dpo:\n  loss: simpo\n  beta: 2\n  simpo_gamma: 1\n").dpo.needs_reference
    assert load(tmp_path, "dpo: {}\n").dpo.beta == 0.1  # the section alone turns the defaults on
    assert load(tmp_path, overrides=["dpo.beta=0.2"]).dpo.beta == 0.2
    assert load(tmp_path, "dpo:\n  loss: dpo\n").to_dict()["dpo"]["loss"] == "dpo"


@pytest.mark.parametrize("extra, words", [
    ("dpo:\n  beta: 0\n", ["dpo.beta", "> 0", "0.0"]),
    ("dpo:\n  beta: -1\n", ["dpo.beta", "-1.0"]),
    ("dpo:\n  loss: kto\n", ["dpo.loss", "'kto'", "dpo_norm"]),
    ("dpo:\n  label_smoothing: 0.5\n", ["dpo.label_smoothing", "[0, 0.5)"]),
    ("dpo:\n  loss: ipo\n  label_smoothing: 0.1\n", ["dpo.label_smoothing", "ipo"]),
    ("dpo:\n  simpo_gamma: 1\n", ["dpo.simpo_gamma", "simpo only"]),
    ("dpo:\n  loss: simpo\n  simpo_gamma: -1\n", ["dpo.simpo_gamma", ">= 0"]),
    ("dpo:\n  betta: 1\n", ["dpo.betta", "dpo.beta", "run.yaml:9"]),
    ("dpo:\n  beta: 1\nparallel:\n  sequence_parallel_size: 2\n", ["sequence_parallel_size 2", "dpo"]),
])
def test_bad_values_are_refused_naming_the_key(tmp_path, extra, words):
    with pytest.raises(ConfigError) as e:
        load(tmp_path, extra)
    for w in words:
        assert w in str(e.value), (w, str(e.value))
