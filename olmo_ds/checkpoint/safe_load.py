"""Reading checkpoint files without running code from them: `torch.load(weights_only=True)`, always.

A `.pt` file is a pickle, and a pickle may call any function while it loads (`__reduce__`); a checkpoint
copied from elsewhere is input, not code. Every checkpoint file olmo-ds or DeepSpeed reads for resume,
`init_from`, evaluation, generation and export is loaded here (`load_file`) with torch's weights-only
unpickler, which builds tensors, containers and plain values, and, named one by one, the few classes
DeepSpeed's states hold (`SAFE_TYPES`). Anything else is refused with an `UnsafeCheckpointError` naming
the file and the global it asked for; a file that cannot be parsed is a `DamagedCheckpointError` naming it.

DeepSpeed's own readers (its checkpoint engine, `zero_to_fp32`, the universal-checkpoint conversion and
load) call `torch.load` asking for full unpickling (weights-only off); `weights_only_loads()` routes every
`torch.load` of the process through `load_file` while they run (`safe_engine` also hands an engine a
checkpoint engine whose `load` is ours). Before any of that, `unsafe_globals` reads a file's pickle
without executing it, so a checkpoint holding code is skipped or refused before a tensor is loaded.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import threading
import zipfile
from pathlib import Path

import numpy as np
import torch

from olmo_ds.checkpoint.manifest import DamagedCheckpointError, UnsafeCheckpointError, check_file

_TORCH_LOAD = torch.load  # the real one, whatever `weights_only_loads` puts in its place


def _deepspeed_types() -> list:
    """The classes DeepSpeed's checkpoint states hold besides tensors and plain data, named one by one: ZeRO's
    stage enum and its loss scalers (every optimizer-states file), and the (numel, start) records of ZeRO-1/2's
    and the bf16 optimizer's parameter slices. Each is built from its fields; none runs code when loaded."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _numpy_rng_types() -> list:
    """numpy's RNG state as `np.random.get_state()` returns it (a uint32 array), which RNG files written by
    olmo-ds before checkpoint format 2 hold; allowed only when those files are read."""
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


_lock = threading.Lock()
_SAFE: list | None = None


def safe_types() -> list:
    global _SAFE
    with _lock:
        if _SAFE is None:
            _SAFE = _deepspeed_types()
    return _SAFE


def _qualname(obj) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def allowed_global_names(numpy_rng: bool = False) -> set[str]:
    """The `module.name`s of the globals `load_file` allows besides torch's own weights-only set."""
    names = {_qualname(t) for t in safe_types()}
    if numpy_rng:
        names |= {_qualname(t) for t in _numpy_rng_types()}
    return names


def unsafe_globals(path: str | Path, *, numpy_rng: bool = False) -> list[str]:
    """The globals `path`'s pickle would import that `load_file` does not allow, read without executing it
    ([] for a clean file). A file torch cannot open as a zip archive raises DamagedCheckpointError."""
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    except FileNotFoundError:
        raise DamagedCheckpointError(path, "missing") from None
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile) as e:
        raise DamagedCheckpointError(path, f"cannot be read as a torch file ({_first_line(e)})") from None
    allowed = allowed_global_names(numpy_rng)
    return [g for g in found if g not in allowed]


def load_file(f, map_location=None, *, mmap: bool | None = None, numpy_rng: bool = False, verify: bool = True):
    """`torch.load(f, weights_only=True)` with DeepSpeed's few state classes allowed (`numpy_rng`: also the
    numpy array of an RNG file of the previous format). Where `f` is a path inside a checkpoint with a
    manifest, its size (and checksum, unless OLMO_DS_CHECKPOINT_VERIFY=sizes) is checked first."""
    if verify and isinstance(f, (str, Path)):
        check_file(Path(f))
    types = safe_types() + (_numpy_rng_types() if numpy_rng else [])
    try:
        with torch.serialization.safe_globals(types):
            return _TORCH_LOAD(f, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise UnsafeCheckpointError(_name(f), f"refused: {_refusal(e)}. olmo-ds loads checkpoint files with torch.load("
                                    f"weights_only=True) and runs no code from them; share weights as a safetensors export "
                                    f"(scripts/export_hf.py)") from None
    except FileNotFoundError:
        raise DamagedCheckpointError(_name(f), "missing") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile) as e:
        if isinstance(e, RuntimeError) and not _looks_damaged(e):
            raise
        raise DamagedCheckpointError(_name(f), f"cannot be read ({_first_line(e)}): the file is truncated or damaged") from None


def _name(f) -> str:
    return str(f) if isinstance(f, (str, Path)) else getattr(f, "name", repr(f))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:160]}" if text else type(e).__name__


def _looks_damaged(e: RuntimeError) -> bool:
    return bool(re.search(r"PytorchStreamReader|zip|archive|mmap can only|unexpected EOF|storage|magic number|invalid load key", str(e), re.I))


def _refusal(e: pickle.UnpicklingError) -> str:
    """The one useful line of torch's weights-only refusal ("Unsupported global: GLOBAL posix.system ...")."""
    m = re.search(r"(Unsupported global: GLOBAL [\w.]+|Unsupported operand \w+|Trying to [^.\n]+)", str(e))
    return f"its pickle holds more than tensors and plain data ({m.group(1) if m else _first_line(e)})"


def _guarded_load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **kwargs):
    """What `torch.load` is while `weights_only_loads` lasts: `load_file`, whatever the caller asked."""
    return load_file(f, map_location=map_location, mmap=mmap)


_depth = 0


@contextlib.contextmanager
def weights_only_loads():
    """Every `torch.load` of the process goes through `load_file` (weights-only, checked against the
    manifest) while this lasts: for DeepSpeed's readers, which ask for full unpickling. Reentrant."""
    global _depth
    with _lock:
        _depth += 1
        torch.load = _guarded_load
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.load = _TORCH_LOAD


class SafeLoadEngine:
    """A DeepSpeed checkpoint engine as it is, except that `load` is `load_file`."""

    def __init__(self, inner):
        self.inner = inner

    def load(self, path, map_location=None):
        return load_file(path, map_location=map_location)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@contextlib.contextmanager
def safe_engine(engine):
    """While DeepSpeed loads a checkpoint into `engine`: its checkpoint engine loads through `load_file`,
    and so does every other `torch.load` it makes (`weights_only_loads`)."""
    previous = engine.checkpoint_engine
    engine.checkpoint_engine = SafeLoadEngine(previous)
    try:
        with weights_only_loads():
            yield
    finally:
        engine.checkpoint_engine = previous
