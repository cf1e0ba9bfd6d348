"""Train config parsing: typed sections, --set overrides, and errors that name the key, file and line."""

import pytest

from olmo_ds.train.config import ConfigError, load_config

GOOD = """\
run_dir: runs/x
model:
  preset: tiny
  n_layers: 3
data:
  sources:
    - path: data/demo/shards
batch:
  global_batch_size: 8
  micro_batch_size: 2
  seq_len: 128
optim:
  lr: 3e-4
"""


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_yaml_and_overrides_become_typed_values(tmp_path):
    cfg = load_config(write(tmp_path, GOOD), ["optim.lr=1e-3", "schedule.kind=wsd", "schedule.decay_steps=100", "optim.betas=[0.9, 0.99]"])
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)
    assert cfg.optim.betas == (0.9, 0.99)
    assert cfg.schedule.kind == "wsd"
    assert cfg.data.sources[0].path == "data/demo/shards"
    model = cfg.model.build(vocab_size=4000)
    assert (model.n_layers, model.vocab_size, model.d_model) == (3, 4000, 64)
    assert load_config(write(tmp_path, GOOD)).optim.lr == 3e-4  # YAML 1.1 reads 3e-4 as a string


@pytest.mark.parametrize(
    "text, overrides, message",
    [
        (GOOD.replace("  lr: 3e-4", "  lr: 3e-4\n  wieght_decay: 0.1"), [], r"run.yaml:14: unknown key 'optim.wieght_decay'; did you mean 'optim.weight_decay'\?"),
        (GOOD.replace("  n_layers: 3", "  n_layer: 3"), [], r"run.yaml:4: unknown key 'model.n_layer'; did you mean 'model.n_layers'\?"),
        (GOOD.replace("    - path: data/demo/shards", "    - path: data/demo/shards\n      wieght: 2"), [], r"run.yaml:8: unknown key 'data.sources\[0\].wieght'; did you mean 'data.sources\[0\].weight'\?"),
        (GOOD, ["batch.micro_batch_sz=4"], r"unknown key 'batch.micro_batch_sz'; did you mean 'batch.micro_batch_size'\?"),
        (GOOD, ["batch.seq_len=long"], r"batch.seq_len: expected an integer, got 'long'"),
        (GOOD, ["precision=fp8"], r"precision 'fp8' is not one of bf16, fp16, fp32"),
        (GOOD, ["model.preset=olmo9"], r"model.preset 'olmo9' is unknown"),
        (GOOD, ["schedule.kind=wsd"], r"schedule.kind wsd needs schedule.decay_steps > 0"),
        (GOOD, ["schedule.kind=wsd", "schedule.decay_steps=900", "schedule.warmup_steps=200"], r"schedule.warmup_steps 200 \+ schedule.decay_steps 900 exceeds max_steps 1000"),
        (GOOD, ["batch.schedule=[{step: 0, global_batch_size: 4}, {step: 10, global_batch_size: 16}]"], r"last batch.schedule entry's global_batch_size 16 differs from batch.global_batch_size 8"),
        (GOOD, ["data.sources=[]"], r"data.sources is empty"),
        (GOOD, ["optim.lr"], r"expected KEY=VALUE"),
        # YAML 1.1 reads an unquoted off as false; the message says to quote it.
        (GOOD, ["model.attention_backend=off"], r"model.attention_backend: expected a string, got False; quote the value"),
        (GOOD, ["model.compile=always"], r"model: model.compile 'always' is not one of: auto, blocks, eager"),
    ],
)
def test_config_errors_name_the_key(tmp_path, text, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(write(tmp_path, text), overrides)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_shipped_configs_parse():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for path in sorted((root / "configs").glob("*.yaml")):
        load_config(path)


def test_warmup_longer_than_the_run_is_a_warning_not_an_error(tmp_path):
    """A short trial of a long config (`--set max_steps=50`) must start; the log says the LR never peaks."""
    cfg = load_config(write(tmp_path, GOOD), ["schedule.warmup_steps=2000"])
    assert any("schedule.warmup_steps 2000 exceeds max_steps 1000: the run ends during warm-up, at 50.0% of optim.lr" in w
               for w in cfg.warnings())
    assert load_config(write(tmp_path, GOOD)).warnings() == []
