"""Background checkpoint saves keep the blocking save's guarantees: the snapshot is the step's state whatever
training does next; a save in flight is never `latest`, never resumed from, pruned, evaluated or exported;
a failed write leaves the previous checkpoint `latest` and is raised at the next collective point. And the
host memory behind the snapshots is allocated once and reused. (Kills, full disks and preemption during a
real run's background save: tests/faults.)"""

from __future__ import annotations

import collections
import errno
import json
import threading
from pathlib import Path

import pytest
import torch

from olmo_ds import checkpoint as ckpt
from olmo_ds.checkpoint.async_save import AsyncSaveError, AsyncSaver, HostSnapshotEngine, host_copy_fits, written_marker
from olmo_ds.checkpoint.manifest import algorithm, file_checksum
from olmo_ds.weights import resolve_weights


class Gate:
    """A state value whose pickling waits for `release` (a write in flight), or fails like a full disk."""

    release = threading.Event()
    fail = False

    def __reduce__(self):
        if Gate.fail:
            raise OSError(errno.ENOSPC, "No space left on device")
        assert Gate.release.wait(30), "test never released the write"
        return (collections.OrderedDict, ())  # a type weights-only loading allows, so the file verifies


class FakeEngine:
    """What AsyncSaver needs of a DeepSpeed engine: a checkpoint engine it hands every file to."""

    def __init__(self, weights: torch.Tensor):
        self.checkpoint_engine = None
        self.weights = weights

    def save_checkpoint(self, save_dir, tag, save_latest=False):
        self.checkpoint_engine.makedirs(Path(save_dir) / tag, exist_ok=True)  # as DeepSpeed creates the tag's directory
        self.checkpoint_engine.save({"w": self.weights, "gate": Gate()}, str(Path(save_dir) / tag / "zero_states.pt"))
        self.checkpoint_engine.commit(None)


def test_the_snapshot_is_the_steps_state_not_what_training_does_next():
    engine = HostSnapshotEngine()
    w = torch.arange(6.0)
    engine.save({"optimizer": {"w": w, "step": 3}, "list": [w]}, "file.pt")
    w.add_(100)  # the next optimizer step, in place
    (path, snap), = engine.take()
    assert path == "file.pt" and torch.equal(snap["optimizer"]["w"], torch.arange(6.0)) and snap["optimizer"]["step"] == 3
    assert torch.equal(snap["list"][0], torch.arange(6.0))


def test_host_memory_is_allocated_once_and_reused_while_the_files_keep_their_shapes():
    """The first save pays for the host memory (`alloc_s`); later ones copy into the same bytes."""
    engine = HostSnapshotEngine()
    w, m = torch.arange(6.0), torch.zeros(2, 3, dtype=torch.bfloat16)
    state = {"w": w, "groups": [{"m": m, "step": torch.tensor(3)}], "empty": torch.empty(0)}
    engine.create(None)
    engine.save(state, "optim.pt")
    engine.save({"module": {"b": torch.ones(5)}}, "model.pt")
    first = engine.take()
    assert engine.alloc_s > 0 and engine.held_bytes == 3 * 4096 + 4096
    pointers = [first[0][1]["w"].data_ptr(), first[0][1]["groups"][0]["m"].data_ptr(), first[1][1]["module"]["b"].data_ptr()]
    w.add_(1), m.add_(2)
    engine.create(None)
    engine.save(state, "optim.pt")
    engine.save({"module": {"b": torch.ones(5)}}, "model.pt")
    (_, snap), (_, model) = engine.take()
    assert engine.alloc_s == 0, "the second save allocated again"
    assert [snap["w"].data_ptr(), snap["groups"][0]["m"].data_ptr(), model["module"]["b"].data_ptr()] == pointers
    assert torch.equal(snap["w"], torch.arange(6.0) + 1) and torch.equal(snap["groups"][0]["m"], m) and snap["groups"][0]["m"].dtype == torch.bfloat16
    assert snap["groups"][0]["step"].item() == 3 and snap["empty"].shape == (0,)
    engine.create(None)
    engine.save({"w": torch.arange(7.0)}, "optim.pt")  # another shape: that file's memory is allocated anew
    assert engine.alloc_s > 0 and torch.equal(engine.take()[0][1]["w"], torch.arange(7.0))
    engine.release()
    assert engine.held_bytes == 0


def test_a_snapshot_file_holds_only_its_tensors_and_loads_like_the_blocking_saves(tmp_path):
    """Each snapshot tensor is its own storage over a slice of the arena: torch.save writes its bytes, not the arena's."""
    state = {"a": torch.randn(1000), "b": torch.randn(3, 7).to(torch.bfloat16), "n": 5}
    torch.save(state, tmp_path / "blocking.pt")
    saver = AsyncSaver(FakeEngine(torch.ones(3)), tmp_path, rank=0, world_size=1)
    saver.snapshots.save(state, str(tmp_path / "background.pt"))
    Gate.fail = False
    saver._write(saver.snapshots.take(), tmp_path, {})
    assert written_marker(tmp_path, 0).exists()
    part = json.loads((tmp_path / "manifest-rank00000.json").read_text())["files"]  # its size and checksum, computed while written
    assert part["background.pt"] == {"size": (tmp_path / "background.pt").stat().st_size,
                                     "checksum": file_checksum(tmp_path / "background.pt", algorithm())}
    loaded = torch.load(tmp_path / "background.pt", weights_only=False)
    assert loaded["n"] == 5 and all(torch.equal(loaded[k], state[k]) and loaded[k].dtype == state[k].dtype for k in ("a", "b"))
    assert abs((tmp_path / "background.pt").stat().st_size - (tmp_path / "blocking.pt").stat().st_size) < 1024


def make_complete(run_dir: Path, step: int) -> Path:
    d = ckpt.checkpoints_dir(run_dir) / ckpt.step_tag(step)
    d.mkdir(parents=True)
    ckpt.finalize_checkpoint(d, step, {"data": {}}, tokenizer_path=None)
    return d


def test_a_save_in_flight_is_not_latest_resumed_or_pruned_until_every_rank_wrote(tmp_path):
    previous = make_complete(tmp_path, 4)
    saver = AsyncSaver(FakeEngine(torch.ones(3)), tmp_path, rank=0, world_size=1)
    Gate.fail, _ = False, Gate.release.clear()
    ckpt_dir = saver.start(8, {"data": {}}, tokenizer_path=None)
    assert saver.in_flight == ckpt_dir and not ckpt.is_complete(ckpt_dir)
    assert (ckpt.checkpoints_dir(tmp_path) / ckpt.LATEST).read_text().strip() == previous.name
    assert ckpt.resolve_resume("auto", tmp_path) == previous
    # evaluation and export: a run dir resolves to the previous checkpoint, `--all-checkpoints` lists only it,
    # and the directory in flight named explicitly is refused as incomplete
    assert resolve_weights(tmp_path) == ("checkpoint", previous)
    assert ckpt.list_checkpoints(ckpt.checkpoints_dir(tmp_path)) == [(4, previous)]
    with pytest.raises(ValueError, match="checkpoint is incomplete"):
        resolve_weights(ckpt_dir)
    ckpt.prune_checkpoints(ckpt.checkpoints_dir(tmp_path), keep_last=1)
    assert ckpt_dir.is_dir() and previous.is_dir()
    saver._last_poll = 0.0
    assert saver.poll() is None  # the rank has not written its part yet
    Gate.release.set()
    saver._thread.join()
    assert written_marker(ckpt_dir, 0).exists()
    summary = saver.poll()  # the first poll after this rank's write looks at once (polls during it looked at nothing)
    assert summary["ckpt_dir"] == ckpt_dir and ckpt.is_complete(ckpt_dir) and saver.in_flight is None
    assert ckpt.resolve_resume("auto", tmp_path) == ckpt_dir
    assert torch.equal(torch.load(ckpt_dir / "zero_states.pt", weights_only=False)["w"], torch.ones(3))


def test_a_failed_background_write_leaves_the_previous_checkpoint_and_is_raised_at_the_next_save(tmp_path):
    previous = make_complete(tmp_path, 4)
    saver = AsyncSaver(FakeEngine(torch.ones(3)), tmp_path, rank=0, world_size=1)
    Gate.fail = True
    try:
        ckpt_dir = saver.start(8, {"data": {}}, tokenizer_path=None)
        saver._thread.join()
        with pytest.raises(AsyncSaveError, match="No space left on device") as e:
            saver.start(12, {"data": {}}, tokenizer_path=None)  # the next save waits for the last one first
    finally:
        Gate.fail = False
    assert e.value.ckpt_dir == ckpt_dir and not ckpt.is_complete(ckpt_dir)
    assert ckpt.latest_checkpoint(ckpt.checkpoints_dir(tmp_path)) == previous
    assert (ckpt.checkpoints_dir(tmp_path) / ckpt.LATEST).read_text().strip() == previous.name


def test_a_host_copy_that_does_not_fit_is_refused_with_the_numbers():
    fits, why = host_copy_fits(10 * 2**40, 8)
    assert not fits and "host copy of 10240.0 GiB x 8 rank(s) on this node against" in why
    assert host_copy_fits(1, 1)[0]
    fits, why = host_copy_fits(10 * 2**40, 8, held=10 * 2**40)  # the memory of earlier saves is reused
    assert fits and "(10240.0 GiB each already held)" in why
