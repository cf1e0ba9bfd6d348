"""What a start says before training (issue 58, item 6): a missing `--init-from` / `init_from.path` that reads as a path
is "no such checkpoint, run or model directory", not a hub id missing from the cache (a hub id keeps the hub's message); data prepared with
`--allow-split-template-tokens` trains with a warning naming the source; the optimizer op a start builds is decided in
the plan, where the DeepSpeed JSON is read, not in launch.py; and a run's process ends without nanobind's ~100 lines
about triton's objects."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

from olmo_ds import hub, weights
from olmo_ds.train import launch
from olmo_ds.train.config import ConfigError, config_from_dict
from olmo_ds.train.ds_config import SHIPPED_DIR, ZeroLayout, optimizer_op
from olmo_ds.train.launch import DistEnv
from olmo_ds.train.plan import plan_run, split_template_warnings

from train_testlib import ROOT, launch_env, tiny_config, write_config, write_markov_shards

ONE_RANK = DistEnv("single", rank=0, local_rank=0, world_size=1)
NEOX = "/work/shared/tokenizers/gpt-neox-olmo-dolma-v1_5.json"  # has no <|im_start|> / <|im_end|> special tokens


def pretrain(*args: str, cwd=ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain.py"), *args], cwd=cwd, env=launch_env(),
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("spec, reason", [
    ("runs/first-sft", "it starts with runs/"), ("./x/y", "it starts with ./"), ("../x", "it starts with ../"),
    ("/abs/x", "it starts with /"), ("~/ckpt", "it starts with ~"), ("data/tokenizer.json", "it names a file"),
    ("allenai/OLMo-2-0425-1B", None), ("allenai/OLMo-2-0425-1B@stage1", None),
])
def test_what_reads_as_a_path(spec, reason):
    assert hub.path_reason(spec) == reason
    assert (hub.parse_hub_id(spec) is None) == (reason is not None)


def test_a_missing_init_from_path_is_no_such_directory_and_a_hub_id_stays_one(tmp_path, monkeypatch, hf_cache):
    result = pretrain("--config", str(ROOT / "configs" / "demo.yaml"), "--init-from", "runs/no-such-run", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: --init-from runs/no-such-run: no such checkpoint, run or model directory ({tmp_path / 'runs' / 'no-such-run'}; it "
                                     f"starts with runs/, so it is a local path, not a Hugging Face hub id such as "
                                     f"allenai/OLMo-2-0425-1B)"), result.stderr
    monkeypatch.chdir(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(FileNotFoundError, match=r"^checkpoints/step-9: no such checkpoint, run or model directory \(.*; directory checkpoints/ exists here"):
        weights.inspect_weights("checkpoints/step-9")
    with pytest.raises(FileNotFoundError, match=r"someorg/somemodel is a Hugging Face hub id, not a local path; .* is not in the HF cache"):
        weights.inspect_weights("someorg/somemodel")


def test_a_missing_init_from_in_the_config_names_the_key(tmp_path):
    data = write_markov_shards(tmp_path / "shards", 5_000)
    cfg = config_from_dict(tiny_config(tmp_path, data, init_from={"path": str(tmp_path / "runs" / "gone")}), source="run.yaml")
    with pytest.raises(ConfigError, match=rf"run.yaml: init_from.path: {tmp_path}/runs/gone: no such checkpoint, run or model directory \(.*it starts with /"):
        plan_run(cfg, env=ONE_RANK)


def test_the_optimizer_op_is_decided_in_the_plan_not_read_by_the_launch(tmp_path):
    adamw = {"optimizer": {"type": "AdamW", "params": {}}}
    assert optimizer_op(adamw, ZeroLayout.of({"zero_optimization": {"stage": 3}})) == "FusedAdamBuilder"  # a GPU's
    assert optimizer_op({"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}, ZeroLayout.of({})) is None  # CPU
    offload = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    assert optimizer_op({**adamw, **offload}, ZeroLayout.of(offload)) == "CPUAdamBuilder"
    data = write_markov_shards(tmp_path / "shards", 5_000)
    for json_name, op in (("zero3_bf16.json", None), ("zero3_bf16_offload.json", "CPUAdamBuilder")):
        made = plan_run(config_from_dict(tiny_config(tmp_path / json_name, data, deepspeed_config=str(SHIPPED_DIR / json_name)),
                                         source="run.yaml"), env=ONE_RANK)
        made.loader.close()
        assert made.deepspeed.optimizer_op == op, json_name
    source = inspect.getsource(launch)  # architecture.md: the JSON is read once, in the plan
    assert not any(key in source for key in ("zero_optimization", "offload_optimizer", '"optimizer"', "ds_config"))


@pytest.fixture(scope="module")
def split_chat(tmp_path_factory):
    """Chat data prepared with a tokenizer that lacks OLMo 3's turn markers, so with --allow-split-template-tokens."""
    out = tmp_path_factory.mktemp("split") / "chat"
    result = subprocess.run([sys.executable, "scripts/prepare_data.py", "--format", "chat", "--chat-template", "olmo3", "--input",
                             str(ROOT.parent / "shared" / "data" / "chat-sample" / "val.jsonl"), "--tokenizer", NEOX, "--output",
                             str(out), "--allow-split-template-tokens", "--no-progress"],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def split_config(tmp_path, data) -> dict:
    return tiny_config(tmp_path, data, tokenizer=NEOX, max_steps=1, batch={"global_batch_size": 2, "micro_batch_size": 1, "seq_len": 64},
                       logging={"every": 1, "tensorboard": False}, checkpoint={"every": 0, "keep_last": 1})


def test_split_template_tokens_are_named_per_source(tmp_path, split_chat):
    made = plan_run(config_from_dict(split_config(tmp_path, split_chat), source="run.yaml"), env=ONE_RANK)
    made.loader.close()
    [warning] = split_template_warnings(made.loader)
    assert warning.startswith(f"{split_chat}: prepared with --allow-split-template-tokens: its tokenizer has no special id for "
                              f"<|im_start|>, <|im_end|> (manifest.json chat.split_template_tokens)")
    data = write_markov_shards(tmp_path / "shards", 5_000)
    plain = plan_run(config_from_dict(tiny_config(tmp_path / "plain", data), source="run.yaml"), env=ONE_RANK)
    plain.loader.close()
    assert split_template_warnings(plain.loader) == []


@pytest.mark.slow  # a one-step fine-tuning run through the command line, ~25 s on 2 cores
def test_a_run_on_split_template_data_warns_once_and_exits_without_leak_reports(tmp_path, split_chat):
    result = pretrain("--config", str(write_config(tmp_path / "sft.yaml", split_config(tmp_path, split_chat))))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout + result.stderr
    assert out.count("prepared with --allow-split-template-tokens") == 1 and "step 1/1" in out, out[-3000:]
    assert "leaked" not in result.stderr, result.stderr[-3000:]  # nanobind's check of triton's bindings at exit
