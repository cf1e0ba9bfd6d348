"""Checkpoint files from elsewhere and damaged checkpoints, against every tool, on a real 1-rank run (CPU).

A payload (a pickle whose `__reduce__` writes a marker file) in each kind of file (an RNG file, ZeRO model
states, optimizer states, a `.bin`/`.pt` beside an export), the manifest rewritten to agree, so that the
pickle itself must be refused: `--resume auto` passes over the checkpoint, `--resume PATH`, `init_from`,
evaluation, export and generation refuse naming the file, and the marker never appears. Then the damage of
a partial copy or a bad disk (a truncated model file, a truncated optimizer file, a missing file, one
flipped byte): `--resume auto` resumes from the previous checkpoint saying which file failed and why, an
explicit path is refused, and evaluation and export refuse naming the file. Nothing is deleted or changed.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import logging
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from olmo_ds import checkpoint as ckpt
from olmo_ds.checkpoint import manifest
from olmo_ds.data import shards
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.train.config import ConfigError, config_from_dict
from olmo_ds.train.launch import DistEnv
from olmo_ds.train.plan import plan_run
from olmo_ds.weights import export_hf
from tests.faults.faultlib import C4_DIR, NEOX, ROOT, base_env, dir_bytes, record
from tests.train.train_testlib import tiny_config, write_config

ONE_RANK = DistEnv("single", rank=0, local_rank=0, world_size=1)
MODEL = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIM = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
RNG = "rng-rank00000.pt"
PAYLOAD_FAULT = "payload in a checkpoint file (rng, model, optimizer states, .bin beside an export)"


class Payload:
    """Writes `marker` when unpickled by a loader that runs code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """C4 in the OLMo-1 tokenizer; 4 steps on one rank with checkpoints at steps 2 and 4; an export of step 2."""
    tmp = tmp_path_factory.mktemp("ckpt_files")
    tok = load_tokenizer(NEOX)
    texts = [json.loads(line)["text"] for p in sorted(C4_DIR.glob("*.json.gz")) for line in gzip.open(p, "rt")]
    ids = [tok.encode(t) + [tok.eos_id] for t in texts[:20]]
    tokens = np.concatenate([np.array(i) for i in ids])
    (tmp / "c4").mkdir()
    meta = shards.write_shard(tmp / "c4", 0, tokens, np.concatenate([[0], np.cumsum([len(i) for i in ids])]),
                              vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    shards.Manifest(num_tokens=len(tokens), num_docs=len(ids), shards=[meta.bin], dtype=meta.dtype, vocab_size=tok.vocab_size,
                    eos_id=tok.eos_id, tokenizer_fingerprint=tok.fingerprint).save(tmp / "c4")
    cfg = tiny_config(tmp, tmp / "c4", tokenizer=str(NEOX), max_steps=4, checkpoint={"every": 2, "keep_last": 3},
                      batch={"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64}, logging={"every": 1, "tensorboard": False})
    write_config(tmp / "run.yaml", cfg)
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(tmp / "run.yaml")], cwd=ROOT,
                          env=base_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    export_hf(tmp / "run" / "checkpoints" / "step-0000002", tmp / "export")
    return tmp


@pytest.fixture
def run(source, tmp_path) -> Path:
    """A copy of the run (and its config), for one test to damage."""
    shutil.copytree(source / "run", tmp_path / "run")
    cfg = tiny_config(source, source / "c4", tokenizer=str(NEOX), max_steps=4, checkpoint={"every": 2, "keep_last": 3},
                      batch={"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64},
                      logging={"every": 1, "tensorboard": False}, run_dir=str(tmp_path / "run"))
    write_config(tmp_path / "run.yaml", cfg)
    return tmp_path / "run"


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    """olmo-ds's log lines during the test (its console handler holds whatever stdout it was created with)."""
    handler = Lines()
    logging.getLogger("olmo_ds").addHandler(handler)
    yield handler.lines
    logging.getLogger("olmo_ds").removeHandler(handler)


def step_dir(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:07d}"


def config_of(run: Path, **sections):
    raw = yaml.safe_load((run.parent / "run.yaml").read_text())
    raw.update(sections)
    return config_from_dict(raw, source=str(run.parent / "run.yaml"))


def plant(path: Path, marker: Path, *, agree: bool = True) -> None:
    """Add a payload to the torch file at `path` (read as the trusted test data it is); with `agree`, rewrite
    the manifest's entry to match, as a crafted checkpoint would."""
    state = torch.load(path, weights_only=False)
    state["extra"] = Payload(marker)
    torch.save(state, path)
    listing = path.parent / ckpt.MANIFEST
    if agree and listing.is_file():
        entries = json.loads(listing.read_text())
        entries["files"][path.name] = {"size": path.stat().st_size, "checksum": manifest.file_checksum(path, manifest.algorithm())}
        listing.write_text(json.dumps(entries))


def damage(path: Path, kind: str) -> None:
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif kind == "missing":
        path.unlink()
    elif kind == "flipped":
        i = len(data) // 2  # inside the tensors' bytes: torch would load it without a word
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:])


def script(name: str, *argv: str) -> tuple[int, str]:
    """scripts/NAME.py's main in this process, with its exit code and stderr."""
    module = runpy.run_path(str(ROOT / "scripts" / f"{name}.py"))
    err = io.StringIO()
    saved = sys.argv
    sys.argv = [name, *argv]
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = module["main"](list(argv)) if name == "eval" else module["main"]()
    finally:
        sys.argv = saved
    return rc, err.getvalue()


def refusals(run: Path, bad: Path, target: Path, pattern: str) -> dict[str, str]:
    """Every tool on the checkpoint `target` that holds `bad`: each must refuse naming `bad` (the tool's message)."""
    found = {}
    with pytest.raises(ConfigError) as e:
        plan_run(config_of(run), resume=str(target), env=ONE_RANK).loader.close()
    found["resume PATH"] = str(e.value)
    fresh = run.parent / "fresh"
    with pytest.raises(ConfigError) as e:
        plan_run(config_of(run, run_dir=str(fresh), init_from={"path": str(target)}), env=ONE_RANK).loader.close()
    found["init_from"] = str(e.value)
    data = yaml.safe_load((run.parent / "run.yaml").read_text())["data"]["sources"][0]["path"]
    for tool, argv in [("eval", (str(target), "--data", data, "--max-tokens", "64")),
                       ("export_hf", (str(target), str(run.parent / "out"))),
                       ("generate", (str(target), "--prompt", "Hello"))]:
        rc, err = script(tool, *argv)
        assert rc == 2, f"{tool}: exit {rc}: {err[-2000:]}"
        found[tool] = err
    for tool, message in found.items():
        assert str(bad) in message and re.search(pattern, message), f"{tool} does not name {bad}: {message[-1500:]}"
    assert not (run.parent / "out").exists() and not fresh.exists()
    return found


def auto_resume_picks(run: Path) -> Path:
    made = plan_run(config_of(run), resume="auto", env=ONE_RANK)
    made.loader.close()
    return made.resume_dir


@pytest.mark.parametrize("name", [RNG, MODEL, OPTIM])
def test_a_payload_in_any_checkpoint_file_never_runs_and_every_tool_names_the_file(run, name, log_lines):
    marker = run.parent / "payload-ran"
    good = dir_bytes(step_dir(run, 2))
    bad = step_dir(run, 4) / name
    plant(bad, marker)
    ok = auto_resume_picks(run) == step_dir(run, 2)
    assert f"--resume auto: skipping step-0000004: {bad}: its pickle asks for builtins.exec" in "\n".join(log_lines), log_lines
    refusals(run, bad, step_dir(run, 4), r"pickle asks for builtins.exec|refused")
    record(PAYLOAD_FAULT, survived=ok and not marker.exists(), data_lost=dir_bytes(step_dir(run, 2)) != good)
    assert ok and not marker.exists()


def test_a_payload_in_a_checkpoint_without_a_manifest_is_refused_by_the_loader(run):
    """A checkpoint as the previous version wrote it (no manifest): the same refusals, from the pickle scan and the loader."""
    marker = run.parent / "payload-ran"
    (step_dir(run, 4) / ckpt.MANIFEST).unlink()
    bad = step_dir(run, 4) / MODEL
    plant(bad, marker, agree=False)
    assert auto_resume_picks(run) == step_dir(run, 2)
    refusals(run, bad, step_dir(run, 4), r"pickle asks for builtins.exec|refused")
    with pytest.MonkeyPatch.context() as m:  # the loader's own refusal, with the scan before it out of the way
        m.setattr(ckpt.load, "check_checkpoint", lambda d: None)
        with pytest.raises(ckpt.UnsafeCheckpointError, match=rf"{bad}: refused"):
            ckpt.load_model_state(step_dir(run, 4))
    record(PAYLOAD_FAULT, survived=not marker.exists())
    assert not marker.exists()


def test_a_pickle_beside_an_export_is_never_read(source, tmp_path):
    """An export (safetensors) with pickled `pytorch_model.bin` and `training_args.pt` beside it: evaluation
    (both backends), generation and `init_from` read the safetensors and never open the pickles."""
    export = tmp_path / "export"
    shutil.copytree(source / "export", export)
    marker = tmp_path / "payload-ran"
    state = {"payload": Payload(marker)}
    torch.save(state, export / "pytorch_model.bin")
    torch.save(state, export / "training_args.pt")
    from olmo_ds.weights import load_model

    for backend in ("olmo", "transformers"):
        load_model(export, backend=backend)
    shutil.copytree(source / "run", tmp_path / "run")
    cfg = tiny_config(source, source / "c4", tokenizer=str(NEOX), max_steps=4, batch={"global_batch_size": 4, "micro_batch_size": 2, "seq_len": 64},
                      run_dir=str(tmp_path / "new"), init_from={"path": str(export)})
    plan_run(config_from_dict(cfg, source="test"), env=ONE_RANK).loader.close()
    record(PAYLOAD_FAULT, survived=not marker.exists())
    assert not marker.exists()


@pytest.mark.parametrize("kind, name, pattern", [
    ("truncated", MODEL, r"bytes, the manifest records [\d,]+ \(truncated or an incomplete copy\)"),
    ("truncated", OPTIM, r"bytes, the manifest records [\d,]+ \(truncated or an incomplete copy\)"),
    ("missing", OPTIM, r"missing \(the manifest lists it\)"),
    ("flipped", MODEL, r"checksum \S+ differs from the manifest's"),
])
def test_a_damaged_newest_checkpoint_resume_auto_falls_back_and_every_tool_names_the_file(run, kind, name, pattern, log_lines):
    good = dir_bytes(step_dir(run, 2))
    bad = step_dir(run, 4) / name
    damage(bad, kind)
    damaged = dir_bytes(step_dir(run, 4))
    picked = auto_resume_picks(run)
    out = "\n".join(log_lines)
    line = [x for x in log_lines if "--resume auto: skipping step-0000004" in x]
    refusals(run, bad, step_dir(run, 4), pattern)
    intact = dir_bytes(step_dir(run, 2)) == good and dir_bytes(step_dir(run, 4)) == damaged
    survived = picked == step_dir(run, 2) and len(line) == 1 and str(bad) in line[0]
    what = {"truncated": "truncated", "missing": "missing", "flipped": "one flipped byte in the"}[kind]
    record(f"damaged checkpoint: {what} {'model' if name == MODEL else 'optimizer'} file", survived=survived, data_lost=not intact)
    assert survived, out[-2000:]
    assert intact


@pytest.mark.parametrize("fault", [
    pytest.param("payload", id="payload-in-rng"),
    pytest.param("truncated", id="truncated-model", marks=pytest.mark.slow),
])
def test_resume_auto_end_to_end_continues_from_the_previous_checkpoint(run, fault):
    """`scripts/pretrain.py --resume auto` as a user runs it: the payload in the newest checkpoint's RNG file
    (the reported case) or its truncated model file; the run resumes at step 2, trains to 4 and saves a
    good step 4, having moved the bad one aside whole."""
    marker = run.parent / "payload-ran"
    if fault == "payload":
        plant(step_dir(run, 4) / RNG, marker)
    else:
        damage(step_dir(run, 4) / MODEL, "truncated")
    bad_bytes = dir_bytes(step_dir(run, 4))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "pretrain.py"), "--config", str(run.parent / "run.yaml"), "--resume", "auto"],
                          cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    ok = (proc.returncode == 0 and not marker.exists() and f"resumed from {step_dir(run, 2)} at step 2" in out
          and "--resume auto: skipping step-0000004: " in out and ckpt.verify_checkpoint(step_dir(run, 4), "full").ok)
    kept = list((run / "checkpoints").glob("step-0000004.replaced-*"))  # the bad one, moved aside whole by the new save of step 4
    record(PAYLOAD_FAULT if fault == "payload" else "damaged checkpoint: truncated model file", survived=ok,
           data_lost=len(kept) != 1 or dir_bytes(kept[0]) != bad_bytes)
    assert len(kept) == 1 and dir_bytes(kept[0]) == bad_bytes
    assert not marker.exists(), out[-3000:]
    assert ok, out[-3000:]
