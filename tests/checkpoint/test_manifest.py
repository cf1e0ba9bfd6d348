"""Checkpoint files that prove themselves and run no code: the manifest (sizes and checksums computed while
writing), verification, the resume point that skips a damaged checkpoint, weights-only loading of every
file (ours and DeepSpeed's readers), and RNG files in either format. (Real runs: tests/faults/test_checkpoint_files.py.)"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from olmo_ds import checkpoint as ckpt
from olmo_ds.checkpoint import manifest, verify
from olmo_ds.checkpoint.save import _torch_bytes, write_rng


class Payload:
    """A pickle that writes `marker` when loaded by an unpickler that runs code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture
def log_lines():
    handler, logger = Lines(), logging.getLogger("olmo_ds")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler.lines
    logger.removeHandler(handler)
    logger.setLevel(level)


def make_checkpoint(run_dir: Path, step: int, *, ranks: int = 2, size: int = 1000) -> Path:
    """A complete checkpoint written as a save writes one: each rank's files through `write_torch` and
    `write_rng` into its part of the manifest, then `finalize_checkpoint`."""
    d = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(step)
    d.mkdir(parents=True)
    for rank in range(ranks):
        files = {}
        for kind in ("model", "optim"):
            name = f"zero_pp_rank_{rank}_mp_rank_00_{kind}_states.pt"
            files[name] = manifest.write_torch({"w": torch.full((size,), float(step + rank)), "step": step}, d / name)
        files.update(write_rng(d, rank))
        manifest.write_part(d, rank, files)
    ckpt.finalize_checkpoint(d, step, {"world_size": ranks}, tokenizer_path=None)
    return d


def test_a_save_records_every_files_size_and_the_checksum_of_the_bytes_written(tmp_path):
    d = make_checkpoint(tmp_path, 4)
    files = json.loads((d / ckpt.MANIFEST).read_text())["files"]
    assert sorted(files) == sorted(p.name for p in d.glob("*.pt")) and len(files) == 6  # 2 ranks x (model, optim, rng)
    for name, entry in files.items():
        assert entry["size"] == (d / name).stat().st_size
        assert entry["checksum"] == manifest.file_checksum(d / name, manifest.algorithm())  # hashed while written = the file
    assert not list(d.glob("manifest-rank*.json"))  # the parts were merged
    assert verify.verify_checkpoint(d, "full").ok


@pytest.mark.parametrize("damage, reason", [
    ("truncate", r"[\d,]+ bytes, the manifest records [\d,]+ \(truncated or an incomplete copy\)"),
    ("missing", r"missing \(the manifest lists it\)"),
    ("flip", r"checksum \S+ differs from the manifest's \S+"),
    ("payload", r"its pickle asks for builtins.exec"),
])
def test_resume_auto_skips_a_damaged_checkpoint_naming_the_file_and_an_explicit_one_is_an_error(tmp_path, damage, reason, log_lines):
    older, newest = make_checkpoint(tmp_path, 2), make_checkpoint(tmp_path, 4)
    target = newest / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "missing":
        target.unlink()
    elif damage == "flip":
        target.write_bytes(data[:-300] + bytes([data[-300] ^ 1]) + data[-299:])  # inside the tensor's bytes: still loads
    else:
        torch.save({"w": torch.zeros(3), "x": Payload(tmp_path / "ran")}, target)
        entries = json.loads((newest / ckpt.MANIFEST).read_text())
        entries["files"][target.name] = {"size": target.stat().st_size, "checksum": manifest.file_checksum(target, manifest.algorithm())}
        (newest / ckpt.MANIFEST).write_text(json.dumps(entries))  # a manifest that agrees: the pickle itself must be refused
    assert ckpt.resolve_resume("auto", tmp_path) == older
    assert any(line.startswith("--resume auto: skipping step-0000004: ") and str(target) in line for line in log_lines), log_lines
    assert any(line.startswith(f"--resume auto: resuming from {older}, the newest checkpoint that verifies") for line in log_lines)
    with pytest.raises(ValueError, match=rf"--resume {newest}: {target}: {reason}"):
        ckpt.resolve_resume(str(newest), tmp_path)
    assert newest.is_dir() and ckpt.is_complete(newest)  # nothing moved or deleted
    assert not (tmp_path / "ran").exists()


def test_when_no_checkpoint_verifies_resume_auto_stops_instead_of_starting_over(tmp_path):
    only = make_checkpoint(tmp_path, 2)
    (only / "rng-rank00001.pt").unlink()
    with pytest.raises(ValueError, match=r"--resume auto: none of the 1 complete checkpoints .* verifies \(newest: .*rng-rank00001.pt: missing"):
        ckpt.resolve_resume("auto", tmp_path)


def test_a_large_files_checksum_is_checked_where_it_is_loaded_and_before_choosing_with_full(tmp_path, monkeypatch):
    older, newest = make_checkpoint(tmp_path, 2, ranks=1), make_checkpoint(tmp_path, 4, ranks=1)
    target = newest / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = target.read_bytes()
    target.write_bytes(data[:-300] + bytes([data[-300] ^ 1]) + data[-299:])
    monkeypatch.setattr(verify, "SMALL_BYTES", 100)  # every file counts as large
    assert ckpt.resolve_resume("auto", tmp_path) == newest  # `auto` compared sizes only before choosing...
    with pytest.raises(ckpt.DamagedCheckpointError, match=rf"{target}: checksum"):
        ckpt.load_file(target)  # ...and the file's checksum as it is loaded
    monkeypatch.setenv(manifest.VERIFY_ENV, "full")
    assert ckpt.resolve_resume("auto", tmp_path) == older
    monkeypatch.setenv(manifest.VERIFY_ENV, "sizes")
    assert torch.is_tensor(ckpt.load_file(target)["w"])  # sizes only: the flipped byte goes through
    monkeypatch.setenv(manifest.VERIFY_ENV, "bogus")
    with pytest.raises(ValueError, match="OLMO_DS_CHECKPOINT_VERIFY='bogus': expected one of sizes, auto, full"):
        ckpt.resolve_resume("auto", tmp_path)


def test_a_checkpoint_of_the_previous_version_without_a_manifest_still_resumes_and_says_so(tmp_path, log_lines):
    d = make_checkpoint(tmp_path, 2)
    (d / ckpt.MANIFEST).unlink()
    assert ckpt.resolve_resume("auto", tmp_path) == d
    assert any("no manifest.json (written by an earlier olmo-ds)" in line for line in log_lines)
    result = ckpt.check_checkpoint(d)
    assert result.legacy and result.files == 6


def test_the_verify_tool_reports_each_checkpoint(tmp_path, capsys):
    good, bad = make_checkpoint(tmp_path, 2), make_checkpoint(tmp_path, 4)
    (bad / "rng-rank00000.pt").write_bytes(b"")
    assert verify.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{good}: ok (6 files, 6 checksummed, none holds code)"
    assert out[1].startswith(f"{bad}: FAILED: {bad / 'rng-rank00000.pt'}: 0 bytes, the manifest records")
    assert verify.main([str(good)]) == 0


# --- no code from files ---------------------------------------------------------------------------

def test_a_payload_is_refused_by_every_reader_naming_the_file_and_never_runs(tmp_path):
    """`load_file`, and DeepSpeed's own readers (they ask torch.load for weights_only=False) inside
    `weights_only_loads`: the checkpoint engine, zero_to_fp32's loads."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    marker = tmp_path / "ran"
    path = tmp_path / "zero_pp_rank_0_mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.zeros(2)}, "x": Payload(marker)}, path)
    refusal = rf"{path}: refused: its pickle holds more than tensors and plain data \(Unsupported global: GLOBAL (builtins\.)?exec"
    with pytest.raises(ckpt.UnsafeCheckpointError, match=refusal):
        ckpt.load_file(path)
    with ckpt.weights_only_loads():
        with pytest.raises(ckpt.UnsafeCheckpointError, match=refusal):
            torch.load(path, map_location="cpu", weights_only=False)  # what DeepSpeed's readers call
        with pytest.raises(ckpt.UnsafeCheckpointError, match=refusal):
            TorchCheckpointEngine().load(str(path), map_location="cpu")
        with pytest.raises(ckpt.UnsafeCheckpointError, match=refusal):
            torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    assert torch.load is ckpt.safe_load._TORCH_LOAD  # put back
    assert not marker.exists()
    with pytest.raises(ckpt.UnsafeCheckpointError, match=r"builtins.exec"):
        ckpt.check_checkpoint(_legacy_checkpoint_with(path, tmp_path))
    assert not marker.exists()


def _legacy_checkpoint_with(path: Path, tmp_path: Path) -> Path:
    d = tmp_path / "checkpoints" / "step-0000001"
    d.mkdir(parents=True)
    (d / path.name).write_bytes(path.read_bytes())
    (d / ckpt.TRAIN_STATE).write_text("{}")
    return d


def test_deepspeeds_optimizer_states_load_weights_only():
    """The classes a ZeRO optimizer-states file holds besides tensors are allowed by name, and nothing else."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    names = ckpt.safe_load.allowed_global_names()
    assert names == {"deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
                     "deepspeed.runtime.zero.config.ZeroStageEnum", "deepspeed.utils.tensor_fragment.fragment_address"}
    import io

    buf = io.BytesIO()
    torch.save({"optimizer_state_dict": {"zero_stage": ZeroStageEnum.weights, "loss_scaler": LossScaler(1.0)}}, buf)
    buf.seek(0)
    state = ckpt.load_file(buf)["optimizer_state_dict"]
    assert state["zero_stage"] == ZeroStageEnum.weights and state["loss_scaler"].cur_scale == 1.0


def test_rng_state_loads_weights_only_and_restores_every_stream(tmp_path):
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    random.random(), np.random.normal(), torch.rand(1)  # numpy's cached gaussian is part of the state
    d = tmp_path / "step"
    d.mkdir()
    write_rng(d, 0)
    expected = (random.random(), np.random.normal(), torch.rand(3))
    state = torch.load(ckpt.rng_file(d, 0), weights_only=True)  # plain torch, no allowances: tensors and plain values only
    assert state["format"] == 2
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ckpt.load_rng(d, 0, seed=1, step=1)
    got = (random.random(), np.random.normal(), torch.rand(3))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])


def test_rng_files_of_the_previous_version_still_load_and_one_with_a_payload_is_refused(tmp_path):
    """Format 1 pickled numpy's state tuple (an ndarray): its few numpy globals are allowed for RNG files only."""
    d = tmp_path / "step"
    d.mkdir()
    random.seed(8), np.random.seed(9), torch.manual_seed(10)
    old = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    ckpt.rng_file(d, 0).write_bytes(_torch_bytes(old))
    expected = (random.random(), np.random.random(), torch.rand(2))
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    ckpt.load_rng(d, 0, seed=1, step=1)
    got = (random.random(), np.random.random(), torch.rand(2))
    assert got[:2] == expected[:2] and torch.equal(got[2], expected[2])
    with pytest.raises(ckpt.UnsafeCheckpointError):  # the numpy allowance is for RNG files only
        ckpt.load_file(ckpt.rng_file(d, 0))
    ckpt.rng_file(d, 0).write_bytes(_torch_bytes({**old, "x": Payload(tmp_path / "ran")}))
    with pytest.raises(ckpt.UnsafeCheckpointError, match=rf"{ckpt.rng_file(d, 0)}: refused"):
        ckpt.load_rng(d, 0, seed=1, step=1)
    assert not (tmp_path / "ran").exists()


def test_a_truncated_or_empty_file_without_a_manifest_is_named_as_damaged(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.zeros(100)}, path)
    data = path.read_bytes()
    for cut in (data[: len(data) // 2], b""):
        path.write_bytes(cut)
        with pytest.raises(ckpt.DamagedCheckpointError, match=rf"{path}: cannot be read \(.*\): the file is truncated or damaged"):
            ckpt.load_file(path)


def test_a_large_record_hashed_while_it_is_written_gives_the_files_checksum(tmp_path, monkeypatch):
    # Records from OVERLAP_BYTES up are hashed on a second thread during the write: lowered here so the test's
    # tensors take that path beside small records that do not.
    monkeypatch.setattr(manifest, "OVERLAP_BYTES", 4096)
    state = {"big": torch.arange(100_000, dtype=torch.float32), "small": torch.ones(3), "step": 7}
    entry = manifest.write_torch(state, tmp_path / "f.pt")
    assert entry["size"] == (tmp_path / "f.pt").stat().st_size
    assert entry["checksum"] == manifest.file_checksum(tmp_path / "f.pt", manifest.algorithm())
    assert torch.equal(torch.load(tmp_path / "f.pt", weights_only=True)["big"], state["big"])
