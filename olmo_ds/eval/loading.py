"""Load what `scripts/eval.sh` is pointed at: a checkpoint, a run, or an exported model directory.

- a checkpoint `RUN/checkpoints/step-NNNNNNN/`: consolidated fp32 weights from the ZeRO files of
  however many ranks wrote them (`olmo_ds.train.checkpoint.load_model_state`), the tokenizer
  copied beside them, the step and tokens seen from `train_state.json`;
- a run directory `RUN/`: its newest complete checkpoint;
- an exported transformers directory (`config.json` of model_type olmo2/olmo3 + safetensors +
  tokenizer.json, as `scripts/export_hf.py` writes) or our own model directory
  (`model_config.json`, as `scripts/import_hf.py` writes).

Exported weights are loaded into our OLMo by default (no transformers needed at run time; the
conversion is exact), or into transformers' own class with `backend="transformers"`, which is how
the agreement between the two is checked.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from olmo_ds.eval.scoring import DistContext
from olmo_ds.tokenizer import Tokenizer, load_tokenizer

HF_MODEL_TYPES = ("olmo2", "olmo3")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    tokenizer: Tokenizer
    max_len: int  # the model's window: longer inputs are truncated from the left
    path: Path  # the checkpoint or model directory actually loaded
    kind: str  # "checkpoint" | "hf" | "model_dir"
    run_dir: Path | None = None  # the run a checkpoint belongs to (for TensorBoard, comparisons)
    step: int | None = None
    tokens_seen: int | None = None
    model_config: dict = field(default_factory=dict)
    train_config: dict = field(default_factory=dict)


def resolve_target(path: str | Path) -> tuple[str, Path]:
    """(kind, directory) of an eval target; a run directory resolves to its newest checkpoint."""
    from olmo_ds.train import checkpoint as ckpt

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint, run or model directory")
    if (path / ckpt.TRAIN_STATE).is_file():
        return "checkpoint", path
    if (path / ckpt.CHECKPOINTS).is_dir():
        latest = ckpt.latest_checkpoint(ckpt.checkpoints_dir(path))
        if latest is None:
            raise FileNotFoundError(f"{path}: run directory has no complete checkpoint under {ckpt.CHECKPOINTS}/ (none with {ckpt.TRAIN_STATE})")
        return "checkpoint", latest
    if (path / "config.json").is_file():
        return "hf", path
    from olmo_ds.model.hf import MODEL_CONFIG_FILE

    if (path / MODEL_CONFIG_FILE).is_file():
        return "model_dir", path
    if ckpt.list_checkpoints(path.parent, complete_only=False) and not (path / ckpt.TRAIN_STATE).exists():
        raise ValueError(f"{path}: checkpoint is incomplete (no {ckpt.TRAIN_STATE}; the save was interrupted)")
    raise ValueError(f"{path}: not a checkpoint (no {ckpt.TRAIN_STATE}), run (no {ckpt.CHECKPOINTS}/), transformers (no config.json) or olmo-ds model directory")


def run_dir_of(checkpoint: Path) -> Path | None:
    from olmo_ds.train import checkpoint as ckpt

    return checkpoint.parent.parent if checkpoint.parent.name == ckpt.CHECKPOINTS else None


def load_for_eval(path: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                  backend: str = "olmo", tokenizer: Tokenizer | None = None, dist_ctx: DistContext | None = None) -> LoadedModel:
    """The model (in eval mode, on `device`, in `dtype`), its tokenizer and what is known of its provenance.

    `tokenizer`: the target's tokenizer when the caller already loaded it (`target_tokenizer`).
    With several ranks (`dist_ctx`) only rank 0 reads and consolidates the weights and broadcasts
    them: eight ranks of one node would otherwise hold eight fp32 copies in host memory at once.
    """
    kind, directory = resolve_target(path)
    if backend not in ("olmo", "transformers"):
        raise ValueError(f"backend must be 'olmo' or 'transformers', got {backend!r}")
    if backend == "transformers" and kind != "hf":
        raise ValueError(f"{directory}: backend 'transformers' needs an exported transformers directory (scripts/export_hf.py)")
    tokenizer = tokenizer or target_tokenizer(directory)
    dist_ctx = dist_ctx or DistContext()
    if dist_ctx.world > 1 and backend == "olmo":
        return _load_broadcast(kind, directory, tokenizer, device, dtype, dist_ctx)
    loaded = _load(kind, directory, tokenizer, backend)
    loaded.model.to(device=device, dtype=dtype).eval()
    return loaded


def _load(kind: str, directory: Path, tokenizer: Tokenizer, backend: str) -> LoadedModel:
    if kind == "checkpoint":
        return _load_checkpoint(directory, tokenizer)
    if kind == "hf":
        return _load_hf(directory, tokenizer, backend)
    return _load_model_dir(directory, tokenizer)


def _load_broadcast(kind: str, directory: Path, tokenizer: Tokenizer, device, dtype: torch.dtype, dist_ctx: DistContext) -> LoadedModel:
    from olmo_ds.model import ModelConfig, OLMo

    loaded, error = None, None
    if dist_ctx.rank == 0:
        try:
            loaded = _load(kind, directory, tokenizer, "olmo")
            loaded.model.to(device=device, dtype=dtype)
        except (ValueError, FileNotFoundError) as e:
            error = e
    # Everything but the weights, as plain objects; an error on rank 0 stops every rank alike.
    header = [None if loaded is None else {k: getattr(loaded, k) for k in ("max_len", "path", "kind", "run_dir", "step", "tokens_seen", "model_config", "train_config")}, error]
    torch.distributed.broadcast_object_list(header, src=0)
    fields, error = header
    if error is not None:
        raise error
    if dist_ctx.rank != 0:
        with torch.device("meta"):  # no random initialisation of weights about to be overwritten
            model = OLMo(ModelConfig.from_dict(fields["model_config"])).to(dtype)
        model = model.to_empty(device=device)
        loaded = LoadedModel(model=model, tokenizer=tokenizer, **fields)
    with torch.no_grad():
        for tensor in loaded.model.state_dict().values():
            torch.distributed.broadcast(tensor, src=0)
    loaded.model.eval()
    return loaded


def target_tokenizer(directory: Path) -> Tokenizer:
    """The tokenizer saved with a checkpoint or model directory (cheap: load it before the weights)."""
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file() and not list(directory.glob("*.model")):
        raise FileNotFoundError(f"{directory}: no tokenizer.json beside the weights; evaluation must use the model's own tokenizer")
    return load_tokenizer(directory)


def _check_vocab(cfg, tokenizer: Tokenizer, where: Path) -> None:
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"{where}: tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size}; they do not belong together")


def _our_model(cfg, state_dict) -> torch.nn.Module:
    from olmo_ds.model import OLMo

    model = OLMo(cfg)
    model.load_state_dict(state_dict)
    return model


def _load_checkpoint(directory: Path, tokenizer: Tokenizer) -> LoadedModel:
    from olmo_ds.train.checkpoint import load_model_state

    # DeepSpeed's consolidation narrates on stdout; stdout is for the results table.
    with contextlib.redirect_stdout(sys.stderr):
        cfg, state_dict, train_state = load_model_state(directory)
    _check_vocab(cfg, tokenizer, directory)
    recorded = train_state.get("tokenizer_fingerprint")
    if recorded and recorded != tokenizer.fingerprint:
        raise ValueError(f"{directory}: tokenizer.json ({tokenizer.fingerprint}) is not the one the run trained with ({recorded})")
    return LoadedModel(
        model=_our_model(cfg, state_dict),
        tokenizer=tokenizer,
        max_len=cfg.max_seq_len,
        path=directory,
        kind="checkpoint",
        run_dir=run_dir_of(directory),
        step=train_state.get("step", _step_from_name(directory)),
        tokens_seen=train_state.get("tokens_seen"),
        model_config=cfg.to_dict(),
        train_config=train_state.get("config", {}),
    )


def _step_from_name(directory: Path) -> int | None:
    name = directory.name
    return int(name[len("step-") :]) if name.startswith("step-") and name[len("step-") :].isdigit() else None


def _load_hf(directory: Path, tokenizer: Tokenizer, backend: str) -> LoadedModel:
    from olmo_ds.model import hf

    config_path = directory / "config.json"
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: invalid JSON: {e}") from None
    if hf_config.get("model_type") not in HF_MODEL_TYPES:
        raise ValueError(f"{config_path}: model_type {hf_config.get('model_type')!r} is not one of {HF_MODEL_TYPES}")
    cfg = hf.from_hf_config(hf_config, vocab_size=tokenizer.vocab_size, where=str(config_path))
    _check_vocab(cfg, tokenizer, directory)
    if backend == "transformers":
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    else:
        model = _our_model(cfg, hf.from_hf_state_dict(cfg, hf.load_safetensors(directory)))
    provenance = _read_provenance(directory)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        max_len=cfg.max_seq_len,
        path=directory,
        kind="hf",
        step=provenance.get("step"),
        tokens_seen=provenance.get("tokens_seen"),
        model_config=cfg.to_dict(),
        train_config=provenance.get("config", {}),
    )


def _load_model_dir(directory: Path, tokenizer: Tokenizer) -> LoadedModel:
    from olmo_ds.model.hf import load_model_dir

    cfg, state_dict = load_model_dir(directory)
    _check_vocab(cfg, tokenizer, directory)
    return LoadedModel(model=_our_model(cfg, state_dict), tokenizer=tokenizer, max_len=cfg.max_seq_len, path=directory, kind="model_dir", model_config=cfg.to_dict())


def _read_provenance(directory: Path) -> dict:
    """An export's `train_state.json`, when the exporter copied it (step, tokens seen, config)."""
    path = directory / "train_state.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def read_train_config(checkpoint: Path) -> dict:
    """The resolved training config recorded in a checkpoint's train_state.json (data sources, ...)."""
    from olmo_ds.train.checkpoint import read_train_state

    return read_train_state(checkpoint).get("config", {})
