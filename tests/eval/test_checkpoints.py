"""Evaluation of real ZeRO-3 checkpoints from a 2-rank DeepSpeed run (scripts/pretrain.py on CPU):
every checkpoint of the run, TensorBoard scalars, the comparison table and plot, and agreement with
the checkpoint's transformers export."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo_ds.data import shards
from olmo_ds.eval.multiple_choice import evaluate_tasks, prepare_tasks
from olmo_ds.eval.loglikelihood import score_requests
from olmo_ds.eval.perplexity import evaluate_perplexity, load_source, token_byte_lengths, window_batches
from olmo_ds.eval.tasks import load_task
from olmo_ds.model import OLMo
from olmo_ds.model.decode import Request, generate
from olmo_ds.weights import export_hf, load_model, load_weights, resolve_weights
from olmo_ds.tokenizer import load_tokenizer

from eval_testlib import ARC_EASY, C4, NEOX, PIQA

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "train"))
from train_testlib import launch_env, run, tiny_config, torchrun_cmd, write_config  # noqa: E402

pytestmark = pytest.mark.multirank


def _write_split(directory: Path, texts: list[str], tok) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    ids = [tok.encode(t) + [tok.eos_id] for t in texts]
    tokens = np.concatenate([np.array(i) for i in ids])
    meta = shards.write_shard(directory, 0, tokens, np.concatenate([[0], np.cumsum([len(i) for i in ids])]), vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    shards.Manifest(num_tokens=len(tokens), num_docs=len(texts), shards=[meta.bin], dtype=meta.dtype, vocab_size=tok.vocab_size,
                    eos_id=tok.eos_id, tokenizer_fingerprint=tok.fingerprint).save(directory)


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """C4 text in the OLMo-1 tokenizer (train shards + a val/ split); 6 steps on 2 ranks, checkpoints at 3 and 6."""
    tmp = tmp_path_factory.mktemp("ckpt")
    tok = load_tokenizer(NEOX)
    texts = [json.loads(line)["text"] for p in C4 for line in gzip.open(p, "rt")]
    _write_split(tmp / "c4", texts[:26], tok)
    _write_split(tmp / "c4" / "val", texts[26:], tok)
    cfg = tiny_config(tmp, tmp / "c4", tokenizer=str(NEOX), max_steps=6, checkpoint={"every": 3, "keep_last": 3},
                      batch={"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64})
    proc = run(torchrun_cmd(REPO / "scripts" / "pretrain.py", "--config", str(write_config(tmp / "run.yaml", cfg))))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return tmp / "run"


def test_every_checkpoint_of_a_run_tensorboard_and_comparison(trained_run):
    # Two ranks: rank 0 consolidates each checkpoint and broadcasts it (the single-rank path is below).
    proc = subprocess.run(["bash", "scripts/eval.sh", str(trained_run), "--all-checkpoints", "--tasks", str(ARC_EASY), "--limit", "8"],
                          env={**launch_env(), "NPROC": "2"}, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Processing zero checkpoint" not in proc.stdout  # DeepSpeed's narration goes to stderr
    steps = {}
    for step in (3, 6):
        r = json.loads((trained_run / "eval" / f"step-{step:07d}" / "results.json").read_text())
        assert (r["step"], r["kind"], r["tokens_seen"]) == (step, "checkpoint", step * 4 * 64)
        assert r["config"]["eval"]["world_size"] == 2
        assert r["perplexity"]["c4"]["path"].endswith("c4/val")  # the run's validation split by default
        assert r["config"]["train"]["data"]["sources"][0]["path"].endswith("c4")
        assert 0 <= r["tasks"]["arc_easy"]["acc"] <= 1
        steps[step] = r
    assert steps[6]["perplexity"]["c4"]["ce_loss"] < steps[3]["perplexity"]["c4"]["ce_loss"]  # training helps
    # One process on the same rows: bitwise the numbers the two ranks produced.
    one = load_model(trained_run)
    tokens = load_source(str(trained_run.parent / "c4" / "val"), one.tokenizer).tokens
    single = evaluate_perplexity(one.model, window_batches(tokens, 64, 4096 // 64), token_byte_lengths(one.tokenizer))
    assert (single.ce_loss, single.bits_per_byte) == (steps[6]["perplexity"]["c4"]["ce_loss"], steps[6]["perplexity"]["c4"]["bits_per_byte"])

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(trained_run / "tb"))
    acc.Reload()
    bpb = acc.Scalars("eval/c4/bpb")
    assert [e.step for e in bpb] == [3, 6]
    assert bpb[1].value == pytest.approx(steps[6]["perplexity"]["c4"]["bits_per_byte"], rel=1e-6)
    assert [e.step for e in acc.Scalars("eval/arc_easy/acc")] == [3, 6]

    table = (trained_run / "eval" / "comparison.md").read_text()
    assert "| step | tokens seen | arc_easy acc | c4 bits/byte |" in table and "| 6 | 1,536 |" in table
    assert (trained_run / "eval" / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "plot:" in proc.stdout


def test_skip_evaluated_leaves_out_checkpoints_with_results(trained_run, tmp_path):
    from olmo_ds.eval.runner import EvalOptions, _targets

    options = EvalOptions(target=str(trained_run), all_checkpoints=True, skip_evaluated=True, out=str(tmp_path))
    assert [d.name for _, d in _targets(options)] == ["step-0000003", "step-0000006"]
    (tmp_path / "step-0000003").mkdir()
    (tmp_path / "step-0000003" / "results.json").write_text("{}")
    assert [d.name for _, d in _targets(options)] == ["step-0000006"]


def test_run_dir_resolves_to_its_newest_complete_checkpoint(trained_run, tmp_path):
    assert resolve_weights(trained_run) == ("checkpoint", trained_run / "checkpoints" / "step-0000006")
    broken = trained_run / "checkpoints" / "step-0000009"
    broken.mkdir()
    try:
        assert resolve_weights(trained_run)[1].name == "step-0000006"  # an interrupted save is never picked
        with pytest.raises(ValueError, match="incomplete"):
            resolve_weights(broken)
    finally:
        broken.rmdir()


def test_checkpoint_and_its_transformers_export_agree(trained_run, tmp_path):
    ckpt = trained_run / "checkpoints" / "step-0000006"
    export_hf(ckpt, tmp_path / "hf")  # what scripts/export_hf.py runs
    ours = load_model(ckpt)
    theirs = load_model(tmp_path / "hf", backend="transformers")
    assert type(theirs.model).__name__ == "Olmo2ForCausalLM" and ours.provenance.step == 6
    max_len = ours.provenance.cfg.max_seq_len
    tok = ours.tokenizer
    prepared = prepare_tasks(tok, [load_task(PIQA), load_task(ARC_EASY)], limit=8)
    with torch.no_grad():
        a = score_requests(ours.model, prepared.requests, max_len=max_len)
        b = score_requests(theirs.model, prepared.requests, max_len=theirs.provenance.cfg.max_seq_len)
    assert a.truncated.sum() > 0  # piqa contexts exceed the 64-token window: truncation path included
    np.testing.assert_allclose(a.logprob, b.logprob, rtol=0, atol=1e-4)
    ra = evaluate_tasks(ours.model, tok, prepared, 0, 1, max_len=max_len).tasks
    rb = evaluate_tasks(theirs.model, tok, prepared, 0, 1, max_len=theirs.provenance.cfg.max_seq_len).tasks
    assert {t: {m: r[m] for m in ("acc", "acc_per_token", "acc_per_char")} for t, r in ra.items()} == \
           {t: {m: r[m] for m in ("acc", "acc_per_token", "acc_per_char")} for t, r in rb.items()}


@pytest.mark.parametrize("script", ["export_hf", "generate"])
def test_scripts_given_a_checkpoint_print_only_their_result(trained_run, tmp_path, script):
    """Piped, stdout holds the result alone: DeepSpeed's consolidation messages go to stderr."""
    ckpt = trained_run / "checkpoints" / "step-0000006"
    args = {"export_hf": [ckpt, tmp_path / "hf"], "generate": [ckpt, "--prompt", "The", "--max-new-tokens", "4"]}[script]
    command = " ".join([sys.executable, str(REPO / "scripts" / f"{script}.py"), *map(str, args)]) + " | cat"
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if script == "export_hf":
        assert proc.stdout == f"wrote {tmp_path / 'hf'}\n"
    else:  # greedy, so the text is known: the same weights and generate() in this process
        w = load_weights(ckpt)
        model = OLMo(w.provenance.cfg)
        model.load_state_dict(w.state_dict)
        tok = load_tokenizer(ckpt / "tokenizer.json")
        new = generate(model.eval(), [Request(tok.encode("The"), 4)], stop_ids=[tok.eos_id], tokenizer=tok).completions[0]
        assert proc.stdout == f"=== 'The'\nThe{new.text}\n\n"
    assert "zero checkpoint" in proc.stderr  # consolidation did run, and spoke on stderr
