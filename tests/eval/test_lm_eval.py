"""An exported directory under lm-evaluation-harness scores like olmo-ds does.

lm-eval is not a dependency (it brings ~45 packages: datasets, pandas, pyarrow, scipy, ...), so
this runs only where it is installed, e.g. `pip install lm-eval`; see docs/evaluation.md.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from olmo_ds.eval.loglikelihood import score_requests
from olmo_ds.eval.multiple_choice import evaluate_tasks, prepare_tasks
from olmo_ds.eval.tasks import load_task

from eval_testlib import ARC_EASY, NEOX, export_hf

pytest.importorskip("lm_eval")

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


def test_lm_eval_on_the_export_agrees_with_our_scores(model, neox, tmp_path):
    arc = load_task(ARC_EASY)
    data = tmp_path / "arc.jsonl"
    data.write_text("".join(json.dumps({"context": q.choices[0][0], "choices": [c for _, c in q.choices], "gold": q.gold}) + "\n" for q in arc.questions[:16]))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "arc_local.yaml").write_text(TASK_YAML.format(data=data))
    exported = export_hf(model, NEOX, tmp_path / "hf")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={exported},dtype=float32",
                           "--tasks", "arc_local", "--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "8",
                           "--output_path", str(tmp_path / "out"), "--log_samples"], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    samples = sorted((json.loads(line) for line in next((tmp_path / "out").rglob("samples_arc_local_*.jsonl")).open()), key=lambda s: s["doc_id"])
    theirs = np.array([resp[0] for s in samples for resp in s["filtered_resps"]], dtype=np.float64)

    task = load_task(data)
    prepared = prepare_tasks(neox, [task])
    ours = score_requests(model, prepared.requests, max_len=model.cfg.max_seq_len)
    np.testing.assert_allclose(ours.logprob, theirs, rtol=0, atol=1e-4)
    result = evaluate_tasks(model, neox, prepared, 0, 1, max_len=model.cfg.max_seq_len).tasks["arc"]
    assert result["acc"] == pytest.approx(np.mean([s["acc"] for s in samples]))
    assert result["acc_per_char"] == pytest.approx(np.mean([s["acc_norm"] for s in samples]))  # lm-eval's acc_norm
