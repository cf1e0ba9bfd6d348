"""lm-evaluation-harness scores like olmo-ds does: on an export (its `hf` model), and on our weights
unexported (the `olmo-ds` model of olmo_ds/eval/lm_eval_model.py).

lm-eval is not a dependency (it brings ~45 packages: datasets, pandas, pyarrow, scipy, ...), so
this runs only where it is installed with its hf model's needs, `pip install "lm-eval[hf]"`; see
docs/evaluation.md.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from olmo_ds import weights
from olmo_ds.eval.loglikelihood import score_requests
from olmo_ds.eval.multiple_choice import evaluate_tasks, prepare_tasks
from olmo_ds.eval.tasks import load_task

from eval_testlib import ARC_EASY, NEOX, export_hf

pytest.importorskip("lm_eval")
pytest.importorskip("accelerate", reason="lm-eval's hf model needs accelerate: pip install \"lm-eval[hf]\"")

TASK_YAML = """task: arc_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""


def _lm_eval(tmp_path, module, model, model_args, tasks_dir, out, task="arc_local"):
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", module, "--model", model, "--model_args", model_args, "--tasks", task,
                           "--include_path", str(tasks_dir), "--device", "cpu", "--batch_size", "8",
                           "--output_path", str(out), "--log_samples"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def _samples(out):
    return sorted((json.loads(line) for line in next(out.rglob("samples_arc_local_*.jsonl")).open()), key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def arc_local(model, tmp_path_factory):
    """16 arc_easy questions as a local lm-eval task, the model exported (and as our model dir), lm-eval's hf run on the export."""
    tmp = tmp_path_factory.mktemp("lm_eval")
    arc = load_task(ARC_EASY)
    data = tmp / "arc.jsonl"
    data.write_text("".join(json.dumps({"context": q.choices[0][0], "choices": [c for _, c in q.choices], "gold": q.gold}) + "\n" for q in arc.questions[:16]))
    (tmp / "tasks").mkdir()
    (tmp / "tasks" / "arc_local.yaml").write_text(TASK_YAML.format(data=data))
    exported = export_hf(model, NEOX, tmp / "hf")
    proc = _lm_eval(tmp, "lm_eval", "hf", f"pretrained={exported},dtype=float32", tmp / "tasks", tmp / "out-hf")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {"tmp": tmp, "data": data, "tasks": tmp / "tasks", "model_dir": exported.with_name(exported.name + "-olmo"), "hf": _samples(tmp / "out-hf")}


def test_lm_eval_on_the_export_agrees_with_our_scores(model, neox, arc_local):
    samples = arc_local["hf"]
    theirs = np.array([resp[0] for s in samples for resp in s["filtered_resps"]], dtype=np.float64)
    task = load_task(arc_local["data"])
    prepared = prepare_tasks(neox, [task])
    ours = score_requests(model, prepared.requests, max_len=model.cfg.max_seq_len)
    np.testing.assert_allclose(ours.logprob, theirs, rtol=0, atol=1e-4)
    result = evaluate_tasks(model, neox, prepared, 0, 1, max_len=model.cfg.max_seq_len).tasks["arc"]
    assert result["acc"] == pytest.approx(np.mean([s["acc"] for s in samples]))
    assert result["acc_per_char"] == pytest.approx(np.mean([s["acc_norm"] for s in samples]))  # lm-eval's acc_norm


def test_olmo_ds_model_without_export_agrees_with_the_export(arc_local, tmp_path):
    """`--model olmo-ds` on our model directory vs `--model hf` on its export: per item within 1e-4
    (fp32), is_greedy and accuracies identical."""
    proc = _lm_eval(tmp_path, "olmo_ds.eval.lm_eval_model", "olmo-ds", f"checkpoint={arc_local['model_dir']}", arc_local["tasks"], tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-4000:]
    ours, theirs = _samples(tmp_path / "out"), arc_local["hf"]
    assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] and len(ours) == 16
    lp = lambda samples: np.array([r[0] for s in samples for r in s["filtered_resps"]], dtype=np.float64)  # noqa: E731
    np.testing.assert_allclose(lp(ours), lp(theirs), rtol=0, atol=1e-4)
    assert [r[1] for s in ours for r in s["filtered_resps"]] == [r[1] for s in theirs for r in s["filtered_resps"]]
    for metric in ("acc", "acc_norm"):
        assert [s[metric] for s in ours] == [s[metric] for s in theirs]


def test_olmo_ds_model_errors_name_the_bad_value(arc_local, tmp_path):
    proc = _lm_eval(tmp_path, "olmo_ds.eval.lm_eval_model", "olmo-ds", f"checkpoint={tmp_path / 'no-such-run'}", arc_local["tasks"], tmp_path / "out")
    assert proc.returncode == 2 and f"{tmp_path / 'no-such-run'}: no such checkpoint, run or model directory" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = _lm_eval(tmp_path, "olmo_ds.eval.lm_eval_model", "olmo-ds", f"checkpoint={arc_local['model_dir']}", arc_local["tasks"], tmp_path / "out", task="arc_locl")
    assert proc.returncode == 2 and "Tasks not found: arc_locl" in proc.stderr


def test_skipped_not_failed_without_accelerate(tmp_path):
    """lm-eval without its [hf] extra: this file skips (it used to fail in lm-eval's hf model)."""
    (tmp_path / "accelerate.py").write_text("raise ModuleNotFoundError(\"No module named 'accelerate'\", name='accelerate')\n")  # as if not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "agrees_with_our_scores"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=Path(__file__).parents[2])
    assert proc.returncode == 5 and "1 skipped" in proc.stdout, proc.stdout[-2000:]  # 5: pytest ran no test


GEN_YAML = """task: gen_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[gold]}}}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
"""


def test_generate_until_is_batched_and_cut_at_the_stop_strings(arc_local, model, neox, tmp_path):
    """`generate_until` through `--model olmo-ds` (decoded in batches of gen_batch_size) writes transformers'
    greedy text on the export, one request at a time, cut at the first of the `until` strings as lm-eval cuts
    it. (transformers may pick a padded vocabulary id, which a trained model never favours and olmo-ds never
    picks; they are suppressed on its side.)"""
    import torch
    import transformers

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gen_local.yaml").write_text(GEN_YAML.format(data=arc_local["data"]))
    ours = _lm_eval(tmp_path, "olmo_ds.eval.lm_eval_model", "olmo-ds", f"checkpoint={arc_local['model_dir']},gen_batch_size=5", tasks,
                    tmp_path / "ours", task="gen_local")
    assert ours.returncode == 0, ours.stderr[-4000:]
    samples = sorted((json.loads(line) for line in next((tmp_path / "ours").rglob("samples_gen_local_*.jsonl")).open()), key=lambda s: s["doc_id"])
    assert len(samples) == 16
    exported = arc_local["model_dir"].with_name(arc_local["model_dir"].name.removesuffix("-olmo"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32).eval()
    padded = list(range(neox.vocab_size, model.cfg.padded_vocab_size))
    for s in samples:
        ids = neox.encode(s["arguments"]["gen_args_0"]["arg_0"])
        out = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=neox.eos_id,
                          suppress_tokens=padded)
        text = neox.decode(out[0, len(ids):].tolist())
        for stop in ("\n", "."):
            text = text.split(stop)[0]
        assert s["resps"][0][0] == text, s["doc_id"]
    assert any(s["resps"][0][0] for s in samples)


def test_apply_chat_template_renders_with_the_checkpoints_template(arc_local, tmp_path):
    """`--apply_chat_template` through `--model olmo-ds`: each context is the checkpoint's template rendering of one
    user turn with the generation prompt, and its markers are encoded as the special ids."""
    import shutil

    from olmo_ds.chat import load_chat_template
    from olmo_ds.model import OLMo, preset
    from olmo_ds.tokenizer import load_tokenizer

    from eval_testlib import DOLMA2
    from testdata import SHARED

    directory = tmp_path / "chat-model"
    cfg = preset("tiny", vocab_size=100278, max_seq_len=512)
    weights.save_model_dir(directory, cfg, OLMo(cfg).state_dict())
    shutil.copy(DOLMA2, directory / "tokenizer.json")
    config = SHARED / "tokenizers" / "olmo3-instruct-tokenizer_config.json"
    shutil.copy(config, directory / "tokenizer_config.json")
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "gen_local.yaml").write_text(GEN_YAML.format(data=arc_local["data"]))
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "olmo_ds.eval.lm_eval_model", "--model", "olmo-ds", "--model_args", f"checkpoint={directory}",
                           "--tasks", "gen_local", "--include_path", str(tasks), "--device", "cpu", "--limit", "2", "--apply_chat_template",
                           "--output_path", str(tmp_path / "out"), "--log_samples"], capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    samples = [json.loads(line) for line in next((tmp_path / "out").rglob("samples_gen_local_*.jsonl")).open()]
    questions = [json.loads(line)["context"] for line in arc_local["data"].read_text().splitlines()]
    tok = load_tokenizer(DOLMA2)
    template = load_chat_template(config, tok)
    for s in samples:
        context = s["arguments"]["gen_args_0"]["arg_0"]
        assert context == template.render([{"role": "user", "content": questions[s["doc_id"]]}], add_generation_prompt=True)
        assert tok.encode(context).count(100264) == 3  # <|im_start|> of the system, user and assistant turns, as ids
