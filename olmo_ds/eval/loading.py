"""Load what `scripts/eval.sh` is pointed at as a model in eval mode with its own tokenizer.

The weights come through `olmo_ds.weights.load_weights` (a checkpoint, a run's newest checkpoint,
our model directory or a transformers directory); the tokenizer is the one saved beside them, and
a checkpoint's step and tokens seen come from its `train_state.json`.

Exported weights are loaded into our OLMo by default (no transformers needed at run time; the
conversion is exact), or into transformers' own class with `backend="transformers"`, which is how
the agreement between the two is checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from olmo_ds import checkpoint as ckpt
from olmo_ds import weights
from olmo_ds.eval.scoring import DistContext
from olmo_ds.model import ModelConfig, OLMo
from olmo_ds.tokenizer import Tokenizer, load_tokenizer


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
    return weights.resolve_weights(path)


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
    if backend == "transformers":  # transformers' own class: how the agreement of the two is checked
        import transformers

        cfg = weights.model_config_from_hf(directory, weights.read_hf_config(directory), tokenizer.vocab_size)
        _check_vocab(cfg, tokenizer, directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
        provenance = weights.export_provenance(directory)
        return LoadedModel(model=model, tokenizer=tokenizer, max_len=cfg.max_seq_len, path=directory, kind=kind,
                           step=provenance.get("step"), tokens_seen=provenance.get("tokens_seen"),
                           model_config=cfg.to_dict(), train_config=provenance.get("config", {}))
    w = weights.load_weights(directory, vocab_size=tokenizer.vocab_size if kind == "hf" else None)
    _check_vocab(w.cfg, tokenizer, directory)
    recorded = w.train_state.get("tokenizer_fingerprint") if kind == "checkpoint" else None
    if recorded and recorded != tokenizer.fingerprint:
        raise ValueError(f"{directory}: tokenizer.json ({tokenizer.fingerprint}) is not the one the run trained with ({recorded})")
    model = OLMo(w.cfg)
    model.load_state_dict(w.state_dict)
    step = w.train_state.get("step", ckpt.step_of(directory)) if kind == "checkpoint" else w.train_state.get("step")
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        max_len=w.cfg.max_seq_len,
        path=directory,
        kind=kind,
        run_dir=ckpt.run_dir_of(directory) if kind == "checkpoint" else None,
        step=step,
        tokens_seen=w.train_state.get("tokens_seen"),
        model_config=w.cfg.to_dict(),
        train_config=w.train_state.get("config", {}),
    )


def _load_broadcast(kind: str, directory: Path, tokenizer: Tokenizer, device, dtype: torch.dtype, dist_ctx: DistContext) -> LoadedModel:
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


def read_train_config(checkpoint: Path) -> dict:
    """The resolved training config recorded in a checkpoint's train_state.json (data sources, ...)."""
    return ckpt.read_train_state(checkpoint).get("config", {})
