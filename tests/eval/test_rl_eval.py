"""RL prompts scored offline (issue 58, item 2): a tiny RL run through scripts/pretrain.py (prompts from
scripts/make_rl_prompts.py, prepared by prepare_data.py --format rl with the dolma2 tokenizer and OLMo 3's template)
evaluates its validation prompts in the loop; `eval.sh` on its checkpoint reports the same numbers, overall and per
verifier; sampled pass@k is the same on one and two ranks; the estimator against hand-computed values;
`generate.py --prompts` on RL rows prints each answer's reward and reason; bad rows and options are refused."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from olmo_ds.eval import rl
from olmo_ds.eval.runner import EvalOptions, run as run_eval
from olmo_ds.eval.verifiers import reward
from olmo_ds.model import OLMo
from olmo_ds.model.config import preset
from olmo_ds.weights import save_model_dir

from eval_testlib import DOLMA2

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "train"))
from train_testlib import read_metrics, run, write_config  # noqa: E402

torch.set_num_threads(1)  # as every rank of a launch (and the test's subprocesses: OMP_NUM_THREADS=1)
SEQ = 160


def script(*args):
    proc = subprocess.run([sys.executable, *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def generate_py(monkeypatch, capsys, *args) -> tuple[int, str, str]:
    """scripts/generate.py's main in this process (its start-up is most of its time here): (exit code, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location("generate_script", REPO / "scripts" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["generate.py", *map(str, args)])
    rc = module.main()
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.fixture(scope="module")
def rl_run(tmp_path_factory):
    """IFEval-style and arithmetic prompts (a random model's text meets some IFEval constraints: rewards between 0
    and 1, some prompts solved), a validation split, and one GRPO step from a random tiny model with eval.every 1 and
    a checkpoint at that step."""
    root = tmp_path_factory.mktemp("rl_eval")
    rows = []
    for task, count in (("ifeval", 40), ("arithmetic", 8)):
        script(REPO / "scripts" / "make_rl_prompts.py", "--task", task, "--count", count, "--output", root / f"{task}.jsonl")
        rows += (root / f"{task}.jsonl").read_text().splitlines()
    (root / "prompts.jsonl").write_text("\n".join(rows) + "\n")
    script(REPO / "scripts" / "prepare_data.py", "--format", "rl", "--chat-template", "olmo3", "--input", root / "prompts.jsonl",
           "--tokenizer", DOLMA2, "--output", root / "data", "--val-fraction", "0.5", "--max-tokens", "128", "--no-progress")
    model = {"preset": "tiny", "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1, "mlp_hidden": 64, "max_seq_len": SEQ}
    torch.manual_seed(7)
    cfg = preset("tiny", **{k: v for k, v in model.items() if k != "preset"}, vocab_size=100278)
    save_model_dir(root / "init", cfg, OLMo(cfg).state_dict())
    config = {"run_dir": str(root / "run"), "seed": 1, "max_steps": 1, "precision": "fp32", "deterministic": True,
              "deepspeed_config": str(REPO / "ds_configs" / "zero3_bf16.json"), "model": model, "tokenizer": str(DOLMA2),
              "data": {"sources": [{"path": str(root / "data")}], "seed": 3, "prefetch": 1}, "init_from": {"path": str(root / "init")},
              "batch": {"global_batch_size": 2, "micro_batch_size": 2, "seq_len": SEQ},
              "optim": {"lr": 1e-3, "weight_decay": 0.0, "grad_clip": 1.0}, "schedule": {"kind": "constant", "warmup_steps": 0},
              "rl": {"samples_per_prompt": 2, "max_new_tokens": 12, "generation_batch_size": 5, "seed": 5},
              "eval": {"every": 1}, "checkpoint": {"every": 1, "keep_last": 1}, "logging": {"every": 1, "tensorboard": False}}
    proc = run([sys.executable, str(REPO / "scripts" / "pretrain.py"), "--config", str(write_config(root / "run.yaml", config))])
    assert proc.returncode == 0, proc.stderr[-4000:]
    return root


def eval_sh(args, nproc=1):
    env = {**os.environ, "NPROC": str(nproc), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "eval.sh"), *map(str, args)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def test_eval_sh_on_an_rl_checkpoint_reports_the_in_loop_numbers(rl_run):
    """`eval.sh RUN` with no --data: the run's validation prompts, greedy, as the trainer evaluated them at step 1."""
    in_loop = {k.removeprefix("eval/data/"): v for r in read_metrics(rl_run / "run") for k, v in r.items() if k.startswith("eval/data/")}
    assert {"solve_rate", "reward_mean", "solve_rate/ifeval", "reward_mean/gsm8k"} <= set(in_loop)
    assert 0 < in_loop["reward_mean/ifeval"] < 1 and in_loop["solve_rate/ifeval"] > 0  # the comparison below means something
    proc = eval_sh([rl_run / "run"])
    result = json.loads((rl_run / "run" / "eval" / "step-0000001" / "results.json").read_text())
    got = result["rl"]["data"]
    assert {k: got[k] for k in in_loop} == in_loop  # equal, not close: the same code on the same weights
    assert got["decoding"] == {"samples": 1, "temperature": 0.0, "seed": 0, "max_new_tokens": 12, "batch_size": 5}
    assert result["perplexity"] == {} and "| data | all |" in proc.stdout and "| data | ifeval |" in proc.stdout
    records = [json.loads(line) for line in (rl_run / "run" / "eval" / "step-0000001" / "data.outputs.jsonl").read_text().splitlines()]
    assert [r["index"] for r in records] == list(range(got["prompts"])) and sum(got["verifiers"].values()) == got["prompts"]
    for r in records:  # each reward is the verifier's on the text written beside it
        assert r["rewards"] == [reward(r["verifier"], r["completions"][0], r["ground_truth"]).score]
    assert sum(r["solved"] for r in records) / len(records) == got["solve_rate"]


@pytest.mark.slow
@pytest.mark.multirank
def test_sampled_pass_at_k_is_the_same_on_one_and_two_ranks(rl_run, tmp_path):
    args = ["--data", f"heldout={rl_run / 'data' / 'val'}", "--samples", "4", "--temperature", "1.0", "--seed", "3", "--gen-batch-size", "6",
            "--max-new-tokens", "4"]
    eval_sh([rl_run / "run", *args, "--out", tmp_path / "two"], nproc=2)
    (one,) = run_eval(EvalOptions(target=str(rl_run / "run"), data=args[1:2], samples=4, temperature=1.0, seed=3, gen_batch_size=6,
                                  max_new_tokens=4, out=str(tmp_path / "one"), tensorboard=False))
    two = json.loads((tmp_path / "two" / "results.json").read_text())
    assert two["config"]["eval"]["world_size"] == 2 and two["rl"]["heldout"] == json.loads(json.dumps(one["rl"]["heldout"]))
    records = [json.loads(line) for line in (tmp_path / "two" / "heldout.outputs.jsonl").read_text().splitlines()]
    assert (tmp_path / "two" / "heldout.outputs.jsonl").read_text() == (tmp_path / "one" / "heldout.outputs.jsonl").read_text()
    got = two["rl"]["heldout"]
    assert {k for k in got if k.startswith("pass_at_")} >= {"pass_at_1", "pass_at_2", "pass_at_4", "pass_at_4/ifeval"}
    assert "solve_rate" not in got  # a sampled evaluation reports pass@k, not the greedy solve rate
    ifeval = [r for r in records if r["verifier"] == "ifeval"]
    assert len({tuple(r["completions"]) for r in records}) == len(records) and len(set(records[0]["completions"])) == 4
    assert got["pass_at_1/ifeval"] == sum(r["solved"] / 4 for r in ifeval) / len(ifeval)
    assert got["pass_at_4/ifeval"] == sum(r["solved"] > 0 for r in ifeval) / len(ifeval)


def test_pass_at_k_is_the_unbiased_estimator():
    # 1 - C(n - c, k) / C(n, k), by hand
    assert rl.pass_at_k(4, 1, 1) == 0.25
    assert rl.pass_at_k(4, 1, 2) == 0.5  # 1 - 3/6
    assert rl.pass_at_k(5, 2, 3) == 0.9  # 1 - 1/10
    assert rl.pass_at_k(10, 3, 5) == 1 - 21 / 252  # C(7,5) = 21, C(10,5) = 252
    assert rl.pass_at_k(8, 0, 8) == 0.0 and rl.pass_at_k(8, 8, 1) == 1.0 and rl.pass_at_k(4, 1, 4) == 1.0
    with pytest.raises(ValueError, match="1 <= k <= n"):
        rl.pass_at_k(4, 1, 5)
    assert rl.pass_ks(1) == [1] and rl.pass_ks(8) == [1, 2, 4, 8] and rl.pass_ks(6) == [1, 2, 4, 6]


def test_metrics_overall_and_per_verifier():
    def record(verifier, rewards):
        return {"verifier": verifier, "rewards": rewards, "solved": sum(r >= 1.0 for r in rewards)}

    sampled = [record("gsm8k", [1.0, 0.0, 0.0, 0.0]), record("gsm8k", [0.0] * 4), record("ifeval", [1.0, 0.5, 1.0, 0.5])]
    m = rl.metrics(sampled, rl.Decoding(8, 4, samples=4, temperature=1.0))
    # pass@2: gsm8k 1 - C(3,2)/C(4,2) = 1/2 and 0; ifeval 1 - C(2,2)/C(4,2) = 5/6
    assert m["pass_at_1"] == pytest.approx((1 / 4 + 0 + 1 / 2) / 3, abs=1e-15) and m["pass_at_4"] == pytest.approx(2 / 3, abs=1e-15)
    assert m["pass_at_2"] == pytest.approx((1 / 2 + 0 + 5 / 6) / 3, abs=1e-15) and m["pass_at_2/gsm8k"] == 0.25
    assert m["reward_mean"] == 4.0 / 12 and m["pass_at_1/gsm8k"] == 0.125 and m["pass_at_4/ifeval"] == 1.0
    assert m["reward_mean/ifeval"] == 0.75 and "solve_rate" not in m
    greedy = [record("ifeval", [0.5]), record("ifeval", [1.0]), record("math", [0.0])]
    assert rl.metrics(greedy, rl.Decoding(8, 4)) == {"solve_rate": 1 / 3, "reward_mean": 0.5, "solve_rate/ifeval": 0.5,
                                                      "reward_mean/ifeval": 0.75, "solve_rate/math": 0.0, "reward_mean/math": 0.0}
    with pytest.raises(ValueError, match="need a temperature above 0"):
        rl.Decoding(8, 4, samples=4)


def test_generate_scores_rl_prompt_rows(rl_run, tmp_path, monkeypatch, capsys):
    rows = (rl_run / "prompts.jsonl").read_text().splitlines()
    prompts = tmp_path / "rl.jsonl"
    prompts.write_text("\n".join([rows[0], rows[1], rows[-1], json.dumps({"prompt": "Hello"})]) + "\n")
    rc, stdout, stderr = generate_py(monkeypatch, capsys, rl_run / "run", "--chat", "--chat-template", "olmo3", "--prompts", prompts,
                                     "--max-new-tokens", "8")
    assert rc == 0, stderr
    out = [json.loads(line) for line in stdout.splitlines()]
    assert [r.get("dataset") for r in out] == ["ifeval", "ifeval", "gsm8k", None]
    for r in out[:3]:
        assert r["reward"] == reward(r["dataset"], r["completion"], r["ground_truth"]).score and "reason" in r
    assert "reward" not in out[3]
    assert "generate: rewards of 3 RL prompt rows: solve_rate" in stderr and "; gsm8k (1): solve_rate" in stderr


def test_bad_rl_rows_and_options_are_refused_before_any_weight_is_read(rl_run, tmp_path, monkeypatch, capsys):
    row = {"messages": [{"role": "user", "content": "What is 1 + 1?"}], "ground_truth": "2", "dataset": "gsm8k"}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(row) + "\n" + json.dumps({**row, "dataset": "nope"}) + "\n")
    rc, stdout, stderr = generate_py(monkeypatch, capsys, rl_run / "run", "--chat", "--chat-template", "olmo3", "--prompts", bad)
    assert rc == 2 and f"{bad}:2: unknown verifier 'nope'" in stderr and stdout == ""

    from olmo_ds.eval.rl import check_rows
    from olmo_ds.model.decode.prompts import read_prompts
    from olmo_ds.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(DOLMA2)
    text_row = {"prompt": "What is 1 + 1?", "ground_truth": "2", "dataset": "gsm8k"}
    bad.write_text(json.dumps(text_row) + "\n" + json.dumps({"prompt": "x", "dataset": "gsm8k"}) + "\n")
    with pytest.raises(ValueError, match=f"{bad}:2: an RL prompt row has both \"dataset\" .* has only dataset"):
        read_prompts(bad, tokenizer, None)
    bad.write_text(json.dumps(text_row) + "\n" + json.dumps({**text_row, "ground_truth": "two", "constraint_type": "kept"}) + "\n")
    prompts = read_prompts(bad, tokenizer, None)  # a mix's other keys are ignored
    assert check_rows([(p.where, p.verifier, p.ground_truth) for p in prompts[:1]]) == ["gsm8k"]
    with pytest.raises(ValueError, match=f"{bad}:2: the gsm8k ground truth 'two' is not a number"):
        check_rows([(p.where, p.verifier, p.ground_truth) for p in prompts])

    val = f"rl={rl_run / 'data' / 'val'}"
    text = tmp_path / "text.jsonl"
    text.write_text(json.dumps({"text": "Some text to score."}) + "\n")
    for options, message in [
        ({"data": [val], "samples": 4}, "4 samples a prompt need a temperature above 0"),
        ({"data": [val], "max_new_tokens": SEQ}, f"exceed the model's window of {SEQ}; pass --max-new-tokens"),
        ({"data": [f"text={text}"], "temperature": 1.0}, "--data names none"),
    ]:
        with pytest.raises(ValueError, match=message):
            run_eval(EvalOptions(target=str(rl_run / "run"), tensorboard=False, out=str(tmp_path / "never"), **options))
    assert not (tmp_path / "never").exists()
