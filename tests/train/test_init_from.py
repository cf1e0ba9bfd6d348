"""Starting a run from existing weights (`init_from`): transformers directories, olmo-ds checkpoints, their checks.

The check that matters: a tiny Olmo2 and a tiny Olmo3 saved by transformers' `save_pretrained`, used as
`init_from`, give a first-step loss equal to transformers' own loss on the same batch (fp32, CPU) on 1 and
2 ranks, and under ZeRO-3 no rank but 0 ever receives a whole tensor.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from olmo_ds.data.config import DataConfig, SourceConfig
from olmo_ds.data.loader import DataLoader
from olmo_ds.train.config import ConfigError, config_from_dict
from olmo_ds.train.trainer import Trainer

from train_testlib import ROOT, run, tiny_config, torchrun_cmd, write_config, write_markov_shards

transformers = pytest.importorskip("transformers")
PRETRAIN = ROOT / "scripts" / "pretrain.py"
SEQ = 32
ARCH = dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, mlp_hidden=96)  # the run's model section, as for OLMO2 below


def hf_model(kind: str, directory: Path) -> Path:
    """A random tiny Olmo2 / Olmo3 written by transformers itself (padded vocab 384 > the data's 256 ids)."""
    common = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                  vocab_size=384, max_position_embeddings=64, rope_theta=500_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False)
    torch.manual_seed(7)
    if kind == "olmo2":
        model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**common))
    else:
        config = transformers.Olmo3Config(**common, sliding_window=6,
                                          layer_types=["sliding_attention", "sliding_attention", "full_attention"])
        model = transformers.Olmo3ForCausalLM(config)
    with torch.no_grad():  # random norm weights too, so a swapped norm cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    return directory


def model_section(kind: str) -> dict:
    section = {"preset": "tiny", **ARCH, "vocab_size": 384, "max_seq_len": 64}
    if kind == "olmo3":
        section.update(sliding_window=6, sliding_window_pattern=[True, True, False])
    return section


def run_config(tmp_path: Path, data: Path, kind: str, source: Path, micro: int) -> Path:
    cfg = tiny_config(tmp_path, data, model=model_section(kind), max_steps=1, init_from={"path": str(source)},
                      batch={"global_batch_size": 4, "micro_batch_size": micro, "seq_len": SEQ},
                      optim={"lr": 1e-3, "z_loss": 0.0}, checkpoint={"every": 0, "keep_last": 1}, logging={"every": 1, "tensorboard": False})
    return write_config(tmp_path / "run.yaml", cfg)


def transformers_loss(source: Path, data: Path) -> float:
    """transformers' mean cross-entropy on the run's first global batch (the loader's labels, -100 ignored)."""
    loader = DataLoader(DataConfig(sources=[SourceConfig(path=str(data))], seed=3, prefetch=0), seq_len=SEQ, global_batch_size=4,
                        dp_rank=0, dp_world_size=1)
    batch = loader.next_batch()
    loader.close()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(batch["input_ids"]).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1), ignore_index=-100).item()


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_markov_shards(tmp_path_factory.mktemp("init") / "shards", 20_000)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.multirank)])
@pytest.mark.parametrize("kind", ["olmo2", "olmo3"])
def test_first_step_loss_equals_transformers(kind, ranks, tmp_path, data):
    source = hf_model(kind, tmp_path / "hf")
    config = run_config(tmp_path, data, kind, source, micro=2)
    cmd = torchrun_cmd(PRETRAIN, "--config", str(config), nproc=ranks) if ranks > 1 else [sys.executable, str(PRETRAIN), "--config", str(config)]
    result = run(cmd, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ours = next(r["train/loss"] for r in rows if r["step"] == 1)
    assert abs(ours - transformers_loss(source, data)) < 1e-5
    log = result.stdout + result.stderr
    received = json.loads(re.search(r"largest tensor received per rank (\[[\d, ]+\]) elements \(largest parameter ([\d,]+)\)", log).group(1))
    largest_param = int(re.search(r"\(largest parameter ([\d,]+)\)", log).group(1).replace(",", ""))
    assert len(received) == ranks and all(r < largest_param for r in received[1:]), (received, largest_param)
    state = json.loads((tmp_path / "run" / "checkpoints" / "step-0000001" / "train_state.json").read_text())
    assert state["init_from"]["path"] == str(source) and state["init_from"]["kind"] == "hf"
    assert state["init_from"]["fingerprint"].startswith("sha256:") and state["init_from"]["load_optimizer"] is False


def fails(cfg: dict, message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message):
        Trainer.from_config(config_from_dict(cfg, source=str(tmp_path / "run.yaml")))
    assert not torch.distributed.is_initialized(), "the check ran after the process group was created"


@pytest.fixture
def one_rank(monkeypatch):
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}.items():
        monkeypatch.setenv(key, value)


def test_every_bad_source_fails_before_any_heavy_work(tmp_path, data, one_rank):
    source = hf_model("olmo2", tmp_path / "hf")
    base = tiny_config(tmp_path, data, model=model_section("olmo2"), init_from={"path": str(source)})
    fails({**base, "init_from": {"path": str(tmp_path / "missing")}}, r"init_from.path: .*missing: no such checkpoint, run or model directory", tmp_path)
    fails({**base, "init_from": {"path": "allenai/not-cached-model"}},
          r"init_from.path: allenai/not-cached-model is a Hugging Face hub id.*hf download allenai/not-cached-model", tmp_path)
    wrong = {**base, "model": {**model_section("olmo2"), "d_model": 32, "n_heads": 2, "n_kv_heads": 2, "sliding_window": 6,
                                 "sliding_window_pattern": [True, False]}}
    fails(wrong, r"does not match this run: model.d_model: source 64, this run 32; model.n_heads: source 4, this run 2; "
                 r"model.sliding_window: source None, this run 6; sliding-window layers: source \[\], this run \[0\]", tmp_path)
    fails({**base, "init_from": {"path": str(source), "load_optimizer": True}},
          r"init_from.load_optimizer needs an olmo-ds checkpoint .* a hf holds weights only", tmp_path)
    fails({**base, "init_from": {"path": str(source), "allow_changes": ["d_model"]}}, r"only max_seq_len, yarn, rope_theta, sliding_rope_theta, sliding_yarn may differ", tmp_path)


def test_a_different_tokenizer_is_refused(tmp_path, one_rank):
    from testdata import SHARED

    neox, dolma2 = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json", SHARED / "tokenizers" / "dolma2-tokenizer.json"
    from olmo_ds.tokenizer import load_tokenizer

    tok = load_tokenizer(neox)
    data = write_markov_shards(tmp_path / "shards", 5000, fingerprint=tok.fingerprint, vocab_size=tok.vocab_size)
    source = hf_model("olmo2", tmp_path / "hf")
    (source / "tokenizer.json").write_bytes(dolma2.read_bytes())
    cfg = tiny_config(tmp_path, data, tokenizer=str(neox), model={**model_section("olmo2"), "vocab_size": 50280},
                      init_from={"path": str(source)})
    fails(cfg, r"embedding rows \(padded vocab\): source 384, this run 50304; tokenizer: source sha256:\w+, this run sha256:\w+", tmp_path)


def test_checkpoint_chain_weights_only_optimizer_too_and_resume_wins(tmp_path, data):
    """Stage 1 trains; stage 2 starts from its checkpoint (weights only: fresh optimizer and data position);
    a third run loads the optimizer state too; a resumed stage 2 ignores init_from."""
    py = lambda *a: run([sys.executable, str(PRETRAIN), *a], timeout=600)  # noqa: E731
    one = tiny_config(tmp_path / "one", data, max_steps=3, checkpoint={"every": 0}, logging={"every": 1, "tensorboard": False})
    (tmp_path / "one").mkdir()
    assert py("--config", str(write_config(tmp_path / "one" / "run.yaml", one))).returncode == 0
    final = tmp_path / "one" / "run" / "checkpoints" / "step-0000003"
    two = tiny_config(tmp_path / "two", data, max_steps=2, checkpoint={"every": 0}, logging={"every": 1, "tensorboard": False})
    (tmp_path / "two").mkdir()
    config_two = write_config(tmp_path / "two" / "run.yaml", two)
    result = py("--config", str(config_two), "--init-from", str(tmp_path / "one" / "run"))  # a run dir: its newest checkpoint
    assert result.returncode == 0, result.stdout[-3000:]
    state = json.loads((tmp_path / "two" / "run" / "checkpoints" / "step-0000002" / "train_state.json").read_text())
    assert state["init_from"]["directory"] == str(final) and state["init_from"]["step"] == 3
    assert state["data"]["step"] == 2 and state["step"] == 2  # a fresh data position and schedule
    first = json.loads((tmp_path / "one" / "run" / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]
    started = json.loads((tmp_path / "two" / "run" / "metrics.jsonl").read_text().splitlines()[0])["train/loss"]
    # Same seed and data position: from scratch, `started` would be `first` to the last bit; trained weights score lower.
    assert started < first - 1e-3, (first, started)

    resumed = py("--config", str(config_two), "--set", "max_steps=3", "--resume", "auto", "--init-from", str(tmp_path / "missing"))
    assert resumed.returncode == 0 and "init_from" in resumed.stdout and "is not used" in resumed.stdout, resumed.stdout[-3000:]

    three = tiny_config(tmp_path / "three", data, max_steps=1, init_from={"path": str(final), "load_optimizer": True},
                        checkpoint={"every": 0}, logging={"every": 1, "tensorboard": False})
    (tmp_path / "three").mkdir()
    result = py("--config", str(write_config(tmp_path / "three" / "run.yaml", three)))
    assert result.returncode == 0 and "optimizer state loaded" in result.stdout, result.stdout[-3000:]
