"""One way from weights to a model: `olmo_ds.weights.load_model` reads a checkpoint, a run, our model
directory and a transformers directory into the same model, and every tool that needs the tokenizer of
weights (evaluation, generation, export, `init_from`) gets the same one, from `tokenizer_beside`.

The checkpoint here is a run directory's layout around weights consolidated by a stand-in for
`checkpoint.load_model_state`; real ZeRO consolidation is tests/eval/test_checkpoints.py and
tests/model/test_zero3.py.
"""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest
import torch

from olmo_ds import checkpoint as ckpt
from olmo_ds import weights
from olmo_ds.eval.runner import EvalOptions, run
from olmo_ds.model import OLMo, preset
from olmo_ds.model.decode import Request, generate
from olmo_ds.tokenizer import load_tokenizer
from testdata import SHARED

NEOX = SHARED / "tokenizers" / "gpt-neox-olmo-dolma-v1_5.json"
DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"
ROOT = Path(__file__).resolve().parents[1]
KINDS = ["checkpoint", "run", "model_dir", "hf"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """The same tiny model as each kind of weights, each with the OLMo-1 tokenizer beside it."""
    tmp = tmp_path_factory.mktemp("weights")
    tok = load_tokenizer(NEOX)
    torch.manual_seed(0)
    cfg = preset("tiny", vocab_size=tok.vocab_size, d_model=32, n_heads=4, n_kv_heads=2, mlp_hidden=64, n_layers=2,
                 max_seq_len=128, init_std=0.2)
    model = OLMo(cfg).eval()
    ours = tmp / "ours"
    weights.save_model_dir(ours, cfg, model.state_dict())
    shutil.copy(NEOX, ours / "tokenizer.json")
    weights.export_hf(ours, tmp / "hf")
    step = ckpt.checkpoints_dir(tmp / "run") / ckpt.step_tag(3)
    step.mkdir(parents=True)
    shutil.copy(NEOX, step / ckpt.TOKENIZER_COPY)
    train_state = {"step": 3, "tokens_seen": 384, "model": cfg.to_dict(), "tokenizer_fingerprint": tok.fingerprint, "config": {"data": {}}}
    (step / ckpt.TRAIN_STATE).write_text(json.dumps(train_state))
    paths = {"checkpoint": step, "run": tmp / "run", "model_dir": ours, "hf": tmp / "hf"}
    return paths, model, tok


@pytest.fixture
def consolidated(sources, monkeypatch):
    """`load_model_state` of the stand-in checkpoint: the fixture model's fp32 weights."""
    paths, model, _ = sources

    def load_model_state(ckpt_dir):
        state = ckpt.read_train_state(ckpt_dir)
        return model.cfg, {k: v.clone() for k, v in model.state_dict().items()}, state

    monkeypatch.setattr(ckpt, "load_model_state", load_model_state)
    return paths


@pytest.mark.parametrize("kind", KINDS)
def test_load_model_gives_the_same_model_and_tokenizer_from_every_kind_of_weights(sources, consolidated, kind):
    paths, reference, tok = sources
    model, tokenizer, provenance = weights.load_model(paths[kind], device="cpu", dtype=torch.float32)
    resolved = paths["checkpoint"] if kind == "run" else paths[kind]
    assert (provenance.kind, provenance.directory) == ("checkpoint" if kind == "run" else kind, resolved)
    assert provenance.cfg == reference.cfg and not model.training
    assert (tokenizer.fingerprint, tokenizer.path) == (tok.fingerprint, weights.tokenizer_beside(resolved).path)
    assert (provenance.step, provenance.tokens_seen) == ((3, 384) if kind in ("checkpoint", "run") else (None, None))
    assert provenance.run_dir == (paths["run"] if kind in ("checkpoint", "run") else None)
    ids = torch.tensor([tok.encode("The quick brown fox jumps over the lazy dog.")])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))  # the transformers conversion is exact in fp32
    half, _, _ = weights.load_model(paths[kind], dtype=torch.bfloat16)
    assert {p.dtype for p in half.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("kind", ["checkpoint", "model_dir", "hf"])
def test_every_tool_uses_the_tokenizer_beside_the_weights(sources, consolidated, tmp_path, monkeypatch, capsys, kind):
    """Evaluation, generation, export and `init_from` each ask `tokenizer_beside`, and get the same tokenizer."""
    paths, _, _ = sources
    target = paths[kind]
    beside = load_tokenizer(NEOX)
    asked, decide = [], weights.tokenizer_beside

    def spy(directory):
        asked.append(Path(directory))
        return decide(directory)

    monkeypatch.setattr(weights, "tokenizer_beside", spy)

    def used_by(tool, action):
        asked.clear()
        result = action()
        assert asked and set(asked) == {target}, f"{tool} did not take its tokenizer from beside the weights: {asked}"
        return result

    text = tmp_path / "text.jsonl"
    text.write_text("".join(json.dumps({"text": f"Sentence number {i} of a small evaluation set."}) + "\n" for i in range(4)))
    doc, = used_by("eval", lambda: run(EvalOptions(target=str(target), data=[f"c4={text}"], out=str(tmp_path / "eval"), tensorboard=False)))
    assert (doc["tokenizer"], doc["tokenizer_fingerprint"]) == (str(target / "tokenizer.json"), beside.fingerprint)

    generate_main = runpy.run_path(str(ROOT / "scripts" / "generate.py"))["main"]
    monkeypatch.setattr("sys.argv", ["generate.py", str(target), "--prompt", "The", "--max-new-tokens", "3"])
    capsys.readouterr()
    assert used_by("generate", generate_main) == 0
    model, tokenizer, _ = weights.load_model(target)
    expected = generate(model, [Request(beside.encode("The"), 3)], stop_ids=[beside.eos_id], tokenizer=beside).completions[0].text
    assert capsys.readouterr().out == f"=== 'The'\nThe{expected}\n\n"
    assert tokenizer.fingerprint == beside.fingerprint

    out = used_by("export", lambda: weights.export_hf(target, tmp_path / "export"))
    assert load_tokenizer(out / "tokenizer.json").fingerprint == beside.fingerprint

    assert used_by("init_from", lambda: weights.inspect_weights(target)).tokenizer_fingerprint == beside.fingerprint


def test_evaluation_refuses_weights_without_their_tokenizer(sources, tmp_path):
    paths, _, _ = sources
    bare = tmp_path / "bare"
    shutil.copytree(paths["model_dir"], bare)
    (bare / "tokenizer.json").unlink()
    assert weights.describe_weights(bare).tokenizer is None
    with pytest.raises(FileNotFoundError, match="no tokenizer.json beside the weights; evaluation must use the model's own tokenizer"):
        weights.load_model(bare)
    model, tokenizer, _ = weights.load_model(bare, tokenizer=load_tokenizer(NEOX))  # generate.py --tokenizer
    assert tokenizer.path == NEOX


def test_a_checkpoint_with_another_tokenizer_beside_it_is_refused(sources, consolidated, tmp_path, monkeypatch, capsys):
    paths, _, _ = sources
    moved = tmp_path / "run" / "checkpoints" / "step-0000003"
    shutil.copytree(paths["checkpoint"], moved)
    shutil.copy(DOLMA2, moved / ckpt.TOKENIZER_COPY)
    with pytest.raises(ValueError, match=r"tokenizer.json \(sha256:\w+\) is not the one the run trained with"):
        weights.load_model(moved)
    with pytest.raises(ValueError, match="ids but the model only"):  # dolma2's 100k ids do not fit a 50k-row model
        weights.load_model(moved, tokenizer=load_tokenizer(DOLMA2))
    generate_main = runpy.run_path(str(ROOT / "scripts" / "generate.py"))["main"]  # the same check, through the script
    monkeypatch.setattr("sys.argv", ["generate.py", str(moved), "--prompt", "The", "--max-new-tokens", "2"])
    capsys.readouterr()
    assert generate_main() == 2 and "is not the one the run trained with" in capsys.readouterr().err
