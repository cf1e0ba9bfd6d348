"""Checkpoint bookkeeping on disk: which directories count as complete, resume choice, retention."""

import pytest
import torch

from olmo_ds.checkpoint import TRAIN_STATE, latest_checkpoint, list_checkpoints, prune_checkpoints, resolve_resume, step_tag


def make(root, step, complete=True):
    d = root / "checkpoints" / step_tag(step)
    d.mkdir(parents=True)
    torch.save({"module": {"w": torch.zeros(2)}}, d / "zero_pp_rank_0_mp_rank_00_model_states.pt")
    if complete:
        (d / TRAIN_STATE).write_text("{}")
    return d


def test_resume_auto_takes_the_newest_complete_checkpoint(tmp_path):
    assert resolve_resume("auto", tmp_path) is None  # a fresh run
    make(tmp_path, 10)
    newest = make(tmp_path, 20)
    partial = make(tmp_path, 30, complete=False)  # a save interrupted by a crash
    assert resolve_resume("auto", tmp_path) == newest == latest_checkpoint(tmp_path / "checkpoints")
    assert resolve_resume(str(newest), tmp_path) == newest
    with pytest.raises(ValueError, match="incomplete checkpoint"):
        resolve_resume(str(partial), tmp_path)
    with pytest.raises(FileNotFoundError):
        resolve_resume(str(tmp_path / "nope"), tmp_path)


def test_retention_keeps_last_n_and_every_mth_and_clears_old_partials(tmp_path):
    root = tmp_path / "checkpoints"
    for s in (100, 200, 300, 400, 500):
        make(tmp_path, s)
    stale = make(tmp_path, 250, complete=False)
    in_flight = make(tmp_path, 600, complete=False)  # newer than every complete one: maybe being written now
    removed = prune_checkpoints(root, keep_last=2, keep_every=200)
    assert [s for s, _ in list_checkpoints(root)] == [200, 400, 500]
    assert not stale.exists() and in_flight.exists()
    assert sorted(p.name for p in removed) == ["step-0000100", "step-0000250", "step-0000300"]


def test_pruned_checkpoints_stop_counting_at_once_and_are_deleted_off_the_callers_thread(tmp_path, monkeypatch):
    import threading

    from olmo_ds.checkpoint import BackgroundRemover, save

    root = tmp_path / "checkpoints"
    old, new = make(tmp_path, 100), make(tmp_path, 200)
    release = threading.Event()
    real_remove = save._remove
    monkeypatch.setattr(save, "_remove", lambda d: (release.wait(10), real_remove(d)))
    remover = BackgroundRemover()
    assert prune_checkpoints(root, keep_last=1, remove=remover) == [old]  # returns while the delete is held
    assert old.is_dir() and list_checkpoints(root) == [(200, new)] and resolve_resume("auto", tmp_path) == new
    release.set()
    remover.wait()
    assert not old.exists() and new.is_dir()


def test_a_save_waits_for_pruned_deletes_only_when_the_disk_lacks_room_for_it(tmp_path, monkeypatch):
    import shutil
    import threading

    from olmo_ds.checkpoint import BackgroundRemover, save

    root = tmp_path / "checkpoints"
    old, _ = make(tmp_path, 100), make(tmp_path, 200)
    release = threading.Event()
    real_remove = save._remove
    monkeypatch.setattr(save, "_remove", lambda d: (release.wait(10), real_remove(d)))
    remover = BackgroundRemover()
    prune_checkpoints(root, keep_last=1, remove=remover)
    free = shutil.disk_usage(root).free
    assert remover.make_room(root, free // 2) == 0.0 and old.is_dir()  # room enough: the delete goes on beside the write
    threading.Timer(0.3, release.set).start()
    assert remover.make_room(root, 2 * free) >= 0.2 and not old.exists()  # not enough: the delete ends first
