"""Model weights as files, and the one path that loads them: training checkpoints, our model
directory, transformers directories.

Every consumer of weights — evaluation, generation, HF export and import, a run that starts from
existing weights — goes through here, and each question is answered in one function:
- what a path is: `resolve_weights` (a checkpoint, a run's newest complete checkpoint, our model
  directory, a transformers directory);
- which tokenizer belongs to the weights: `tokenizer_beside`;
- what the weights are, without a tensor read: `describe_weights` (`inspect_weights` also takes a hub
  id from the HF cache, for `init_from`) -> `Provenance`;
- the weights themselves: `load_weights` -> `Weights`; a model to run: `load_model` -> `LoadedModel`
  (model, tokenizer, provenance).

The kinds of weights:
- a checkpoint `RUN/checkpoints/step-NNNNNNN/` (or a run `RUN/`: its newest complete checkpoint):
  consolidated fp32 weights from the ZeRO files of however many ranks wrote them (`olmo_ds.checkpoint`);
- our model directory, as `scripts/import_hf.py` writes it:
      model_config.json         ModelConfig.to_dict()
      model.safetensors         fp32 weights under our parameter names (or model-0000i-of-0000n.safetensors
                                + model.safetensors.index.json when larger than the shard size)
      tokenizer.json            when the source had one
- a transformers directory of an Olmo2/Olmo3 model (config.json + safetensors, as `export_hf` writes or
  `save_pretrained` saves), converted exactly by `olmo_ds.model.hf`.
Every kind is checked against its config: names and shapes exactly those of `OLMo(cfg)`.

No code runs from weight files: the model directory and transformers kinds are read as safetensors only
(a pickled `.bin`/`.pt` beside them is never opened), and a checkpoint is verified against its manifest
(sizes, checksums, no pickled code) and read weights-only (`olmo_ds.checkpoint.safe_load`). A damaged or
unsafe file is a `CheckpointFileError` (a ValueError) naming it.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch

from olmo_ds import checkpoint as ckpt
from olmo_ds import hub
from olmo_ds.chat import ChatEncoder, ChatTemplate, load_chat_template, template_beside
from olmo_ds.model import hf
from olmo_ds.model.config import ModelConfig
from olmo_ds.model.model import OLMo
from olmo_ds.tokenizer import Tokenizer, load_tokenizer

MODEL_CONFIG_FILE = "model_config.json"
HF_CONFIG_FILE = "config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
HF_MODEL_TYPES = ("olmo2", "olmo3")
KINDS = ("checkpoint", "model_dir", "hf")
BACKENDS = ("olmo", "transformers")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Provenance:
    """What a weights source is, read without loading a tensor: enough to check a run against it, to
    label an evaluation's results, and to build the model the weights go into."""

    kind: str  # one of KINDS
    directory: Path  # the checkpoint or model directory actually read
    cfg: ModelConfig
    tokenizer: Tokenizer | None = field(repr=False)  # the one saved beside the weights (`tokenizer_beside`), if any
    train_state: dict = field(default_factory=dict, repr=False)  # a checkpoint's train_state.json (or an export's copy); {} if none

    @property
    def step(self) -> int | None:
        """The training step the weights are from, where known."""
        if self.kind == "checkpoint":
            return self.train_state.get("step", ckpt.step_of(self.directory))
        return self.train_state.get("step")

    @property
    def tokens_seen(self) -> int | None:
        return self.train_state.get("tokens_seen")

    @property
    def run_dir(self) -> Path | None:
        """The run a checkpoint belongs to (for TensorBoard, comparisons); None for other kinds."""
        return ckpt.run_dir_of(self.directory) if self.kind == "checkpoint" else None

    @property
    def train_config(self) -> dict:
        """The resolved training config the run recorded (data sources, ...); {} when unknown."""
        return self.train_state.get("config", {})

    @property
    def tokenizer_fingerprint(self) -> str | None:
        """The tokenizer the weights were trained with: the one a checkpoint's run recorded, else the
        fingerprint of the tokenizer beside them; None when the source carries no tokenizer."""
        if self.kind == "checkpoint":
            return self.train_state.get("tokenizer_fingerprint")
        return self.tokenizer.fingerprint if self.tokenizer is not None else None


@dataclass
class Weights:
    provenance: Provenance
    state_dict: dict[str, torch.Tensor]  # fp32 on CPU, keyed like OLMo(cfg).state_dict()


class LoadedModel(NamedTuple):
    model: torch.nn.Module  # in eval mode, on the device and in the dtype asked for
    tokenizer: Tokenizer
    provenance: Provenance


def resolve_weights(path: str | Path) -> tuple[str, Path]:
    """(kind, directory) of a path holding weights; a run directory resolves to its newest complete checkpoint."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such checkpoint, run or model directory")
    if ckpt.is_complete(path):
        return "checkpoint", path
    if (path / ckpt.CHECKPOINTS).is_dir():
        latest = ckpt.latest_checkpoint(ckpt.checkpoints_dir(path))
        if latest is None:
            raise FileNotFoundError(f"{path}: run directory has no complete checkpoint under {ckpt.CHECKPOINTS}/ (none with {ckpt.TRAIN_STATE})")
        return "checkpoint", latest
    if (path / HF_CONFIG_FILE).is_file():
        return "hf", path
    if (path / MODEL_CONFIG_FILE).is_file():
        return "model_dir", path
    if ckpt.step_of(path) is not None:
        raise ValueError(f"{path}: checkpoint is incomplete (no {ckpt.TRAIN_STATE}; the save was interrupted)")
    raise ValueError(f"{path}: not a checkpoint (no {ckpt.TRAIN_STATE}), run (no {ckpt.CHECKPOINTS}/), transformers "
                     f"({HF_CONFIG_FILE}) or olmo-ds model directory ({MODEL_CONFIG_FILE})")


def tokenizer_beside(directory: str | Path) -> Tokenizer | None:
    """The tokenizer saved with the weights in `directory`: its tokenizer.json, else its one sentencepiece
    .model (a checkpoint's copy of the run's tokenizer, an import's or an export's); None when it has neither.

    The one place that decides it: evaluation, generation, export and `init_from` all get the tokenizer
    of weights from here, so the same weights never meet two different tokenizers.
    """
    directory = Path(directory)
    if not (directory / "tokenizer.json").is_file() and not any(directory.glob("*.model")):
        return None
    return load_tokenizer(directory)


def describe_weights(path: str | Path) -> Provenance:
    """What the weights at `path` are (see the module docstring), from their config and train_state alone."""
    kind, directory = resolve_weights(path)
    tokenizer = tokenizer_beside(directory)
    if kind == "checkpoint":
        ckpt.check_checkpoint(directory)  # sizes, small files' checksums, no pickled code: a CheckpointFileError names the file
        train_state = ckpt.read_train_state(directory)
        return Provenance(kind, directory, ModelConfig.from_dict(train_state["model"]), tokenizer, train_state)
    if kind == "model_dir":
        return Provenance(kind, directory, read_model_config(directory), tokenizer)
    cfg = model_config_from_hf(directory, read_hf_config(directory), tokenizer)
    return Provenance(kind, directory, cfg, tokenizer, export_provenance(directory))


# The files of a hub repo that starting from its weights needs (resolve_snapshot's allow_patterns).
HUB_WEIGHT_FILES = [HF_CONFIG_FILE, "*.safetensors", SAFETENSORS_INDEX, "tokenizer.json", "tokenizer_config.json",
                    MODEL_CONFIG_FILE]


def inspect_weights(spec: str | Path, *, what: str = "") -> Provenance:
    """`describe_weights` of `spec`, which may also be a hub id from the HF cache (what `init_from` names); a missing
    path that reads as one (`runs/x`, `./x`: `hub.path_reason`) is reported missing, not as a hub id that is not cached."""
    path = Path(str(spec)).expanduser()
    if not path.exists():
        if missing := hub.missing_path(spec):
            raise FileNotFoundError(f"{what + ': ' if what else ''}{spec}: {missing}")
        if hub.parse_hub_id(str(spec)) is not None:
            path = hub.resolve_snapshot(str(spec), HUB_WEIGHT_FILES, what=what)
    return describe_weights(path)


def load_weights(source: str | Path | Provenance) -> Weights:
    """The weights at `source` (a path, or what `describe_weights` made of one), checked against their config."""
    provenance = source if isinstance(source, Provenance) else describe_weights(source)
    kind, directory, cfg = provenance.kind, provenance.directory, provenance.cfg
    if kind == "checkpoint":
        _, state, _ = ckpt.load_model_state(directory)
        check_state_dict(cfg, state, f"{directory} (consolidated checkpoint)")
    elif kind == "model_dir":
        state = _model_dir_state(directory, cfg)
    else:
        state = {k: v.float() for k, v in hf.from_hf_state_dict(cfg, load_safetensors(directory)).items()}
        padded = read_hf_config(directory).get("vocab_size", 0)
        check_state_dict(cfg, state, f"{directory} (vocab_size {padded} must be a multiple of 128)" if padded % 128 else str(directory))
    return Weights(provenance, state)


def load_model(source: str | Path | Provenance, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
               backend: str = "olmo", tokenizer: Tokenizer | None = None) -> LoadedModel:
    """The model of the weights at `source` in eval mode, on `device`, in `dtype`, with its tokenizer and provenance.

    The tokenizer is the one beside the weights (`tokenizer_beside`), checked against them: its ids fit
    the model, and a checkpoint's is the one its run trained with. `tokenizer` replaces it when a user
    names another (scripts/generate.py --tokenizer). `backend="transformers"` loads an exported
    directory into transformers' own class, which is how the agreement of the two is checked.
    """
    provenance = source if isinstance(source, Provenance) else describe_weights(source)
    kind, directory, cfg = provenance.kind, provenance.directory, provenance.cfg
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'olmo' or 'transformers', got {backend!r}")
    if backend == "transformers" and kind != "hf":
        raise ValueError(f"{directory}: backend 'transformers' needs an exported transformers directory (scripts/export_hf.py)")
    if tokenizer is None:
        tokenizer = own_tokenizer(provenance)
        recorded = provenance.tokenizer_fingerprint if kind == "checkpoint" else None
        if recorded and not tokenizer.matches(recorded):
            raise ValueError(f"{directory}: tokenizer.json ({tokenizer.fingerprint}) is not the one the run trained with ({recorded})")
    if tokenizer.vocab_size > cfg.vocab_size:
        raise ValueError(f"{directory}: tokenizer has {tokenizer.vocab_size} ids but the model only {cfg.vocab_size}; they do not belong together")
    if backend == "transformers":
        import transformers  # optional, and seconds to import: only for this check of agreement

        # safetensors only: a pickled pytorch_model.bin beside an export is never read
        model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32, use_safetensors=True)
    else:
        model = OLMo(cfg)
        model.load_state_dict(load_weights(provenance).state_dict)
    return LoadedModel(model.to(device=device, dtype=dtype).eval(), tokenizer, provenance)


def own_tokenizer(provenance: Provenance) -> Tokenizer:
    """The tokenizer beside the weights, which evaluation requires (cheap: check it before loading tensors)."""
    if provenance.tokenizer is None:
        raise FileNotFoundError(f"{provenance.directory}: no tokenizer.json beside the weights; evaluation must use the model's own tokenizer")
    return provenance.tokenizer


def chat_template_of(provenance: Provenance, tokenizer: Tokenizer | None = None) -> ChatTemplate | None:
    """The chat template that belongs to the weights, or None: the one saved beside them
    (`chat_template.jinja` or tokenizer_config.json's `chat_template`, as `chat.template_beside` finds it),
    else the one beside their tokenizer (`tokenizer`, else the one beside the weights), else, for a
    checkpoint, the one beside the tokenizer file its run was configured with."""
    tokenizer = tokenizer if tokenizer is not None else provenance.tokenizer
    places = [provenance.directory]
    if tokenizer is not None:
        places.append(tokenizer.path.parent)
    configured = provenance.train_config.get("tokenizer") if provenance.kind == "checkpoint" else None
    if isinstance(configured, str) and Path(configured).is_file():
        places.append(Path(configured).parent)
    for place in dict.fromkeys(Path(p).resolve() for p in places):
        template = template_beside(place, tokenizer)
        if template is not None:
            return template
    return None


def export_provenance(directory: Path) -> dict:
    """A transformers directory's copy of its run's train_state.json (step, tokens seen, config), or {}."""
    path = Path(directory) / ckpt.TRAIN_STATE
    return json.loads(path.read_text()) if path.is_file() else {}


def read_hf_config(directory: Path) -> dict:
    """A transformers directory's config.json, which must describe an Olmo2 or Olmo3 model."""
    config_path = Path(directory) / HF_CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory}: no {HF_CONFIG_FILE}; expected a transformers model directory")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: invalid JSON: {e}") from None
    if hf_config.get("model_type") not in HF_MODEL_TYPES:
        raise ValueError(f"{config_path}: model_type {hf_config.get('model_type')!r} is not one of {HF_MODEL_TYPES}")
    return hf_config


def model_config_from_hf(directory: Path, hf_config: dict, tokenizer: Tokenizer | None) -> ModelConfig:
    """Our ModelConfig for a transformers directory. Its config.json records only the padded vocabulary:
    the unpadded one is the size of the tokenizer beside the weights, else the padded size."""
    config_path = Path(directory) / HF_CONFIG_FILE
    try:
        return hf.from_hf_config(hf_config, vocab_size=tokenizer.vocab_size if tokenizer else None, where=str(config_path))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{config_path}: missing or invalid key {e}") from e


# ---- starting a run from weights ----------------------------------------------------------------

def weights_fingerprint(state_dict: dict[str, torch.Tensor], samples_per_tensor: int = 1 << 16) -> str:
    """A content fingerprint of a state dict that reads at most `samples_per_tensor` evenly spaced values
    of each tensor (names, shapes and dtypes in full): two different sets of weights differ in it with
    near certainty, and fingerprinting a 32B model costs a fraction of a second, not a pass over 128 GB."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name].detach().reshape(-1)
        h.update(f"{name}:{tuple(state_dict[name].shape)}:{t.dtype};".encode())
        stride = max(1, t.numel() // samples_per_tensor)
        h.update(t[::stride].float().cpu().numpy().tobytes())
    return "sha256:" + h.hexdigest()


def load_weights_into(model, state_dict: dict[str, torch.Tensor] | None) -> int:
    """Copy rank 0's `state_dict` into `model` on every rank; collective. Returns the number of elements
    of the largest tensor this rank received.

    Only rank 0 needs the weights (other ranks pass None: they never read a weight file). Under ZeRO-3
    (parameters built under `deepspeed.zero.Init`) each parameter goes out as a scatter of its
    partitions, so rank r receives only its own slice and no rank but 0 ever holds a full tensor;
    other parameters (ZeRO-1/2, where every rank holds the whole model anyway) are broadcast. Call it
    after building the model and before `deepspeed.initialize`, so the optimizer's fp32 master copies
    are made from the loaded weights.
    """
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if rank == 0:
        check_state_dict(model.cfg, state_dict, "weights to load")
    largest = 0
    for name, param in model.named_parameters():  # de-duplicates tied weights
        if hasattr(param, "ds_tensor"):  # ZeRO-3: this rank's flat, padded partition
            part = param.ds_tensor
            chunks = None
            if rank == 0:
                flat = state_dict[name].to(part.dtype).reshape(-1)
                padded = torch.zeros(part.numel() * world, dtype=part.dtype)
                padded[: flat.numel()] = flat
                chunks = [c.to(part.device) for c in padded.split(part.numel())]
            received = torch.empty(part.numel(), dtype=part.dtype, device=part.device)
            dist.scatter(received, chunks, src=0)
            with torch.no_grad():
                part.copy_(received.view_as(part))
        else:
            received = state_dict[name].to(device=param.device, dtype=param.dtype) if rank == 0 else torch.empty_like(param.data)
            dist.broadcast(received, src=0)
            with torch.no_grad():
                param.data.copy_(received)
        largest = max(largest, received.numel())
    return largest


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, from a model built on the meta device (no memory, any size)."""
    with torch.device("meta"):
        model = OLMo(cfg)
    return {name: tuple(p.shape) for name, p in model.state_dict(keep_vars=True).items()}


def check_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """Names and shapes of `state` are exactly those of `OLMo(cfg)`; the error names the first mismatches."""
    shapes = expected_shapes(cfg)
    hf.check_keys(set(state), set(shapes), where)
    wrong = [f"{k}: {tuple(state[k].shape)} != {shapes[k]}" for k in shapes if tuple(state[k].shape) != shapes[k]]
    if wrong:
        raise ValueError(f"{where}: tensor shapes do not match the model config: {wrong[:6]}")


# ---- safetensors directories ----------------------------------------------------------------------

def save_safetensors(directory: Path, state: dict[str, torch.Tensor], metadata: dict | None = None,
                     max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[Path]:
    """`model.safetensors`, or numbered shards plus the index transformers reads, when larger."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards, current, size = [], {}, 0
    for name in sorted(state):
        tensor = state[name].detach().cpu().contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    metadata = {"format": "pt", **(metadata or {})}
    if len(shards) == 1:
        path = directory / SAFETENSORS_FILE
        save_file(shards[0], str(path), metadata=metadata)
        return [path]
    paths, weight_map, total = [], {}, 0
    for n, shard in enumerate(shards, 1):
        path = directory / f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path), metadata=metadata)
        paths.append(path)
        for name, tensor in shard.items():
            weight_map[name] = path.name
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return paths


def load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file or sharded safetensors model directory."""
    from safetensors.torch import load_file

    directory = Path(directory)
    single, index = directory / SAFETENSORS_FILE, directory / SAFETENSORS_INDEX
    if single.is_file():
        return load_file(str(single))
    if not index.is_file():
        raise FileNotFoundError(f"{directory}: neither {SAFETENSORS_FILE} nor {SAFETENSORS_INDEX} found")
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    state = {}
    for name in files:
        state.update(load_file(str(directory / name)))
    return state


def save_model_dir(directory, cfg: ModelConfig, state_dict: dict[str, torch.Tensor],
                   tokenizer_dir: Path | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> None:
    """Write our model directory (see the module docstring); fp32 weights under our names."""
    directory = Path(directory)
    check_state_dict(cfg, state_dict, "model state dict")
    state = {k: v.float() for k, v in state_dict.items() if not (cfg.tie_embeddings and k == "head.weight")}
    save_safetensors(directory, state, max_shard_bytes=max_shard_bytes)
    (directory / MODEL_CONFIG_FILE).write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer_files(Path(tokenizer_dir), directory)


def read_model_config(directory) -> ModelConfig:
    """The ModelConfig of our model directory."""
    directory = Path(directory)
    config_path = directory / MODEL_CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory}: no {MODEL_CONFIG_FILE}; not an olmo-ds model directory "
                                f"(make one with scripts/import_hf.py)")
    try:
        return ModelConfig.from_dict(json.loads(config_path.read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{config_path}: {e}") from e


def _model_dir_state(directory: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = load_safetensors(directory)
    if cfg.tie_embeddings:
        state["head.weight"] = state["embed.weight"]
    check_state_dict(cfg, state, str(directory))
    return state


def load_model_dir(directory) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, state dict) from our model directory."""
    cfg = read_model_config(directory)
    return cfg, _model_dir_state(Path(directory), cfg)


def copy_tokenizer_files(src: Path, dst: Path) -> list[Path]:
    """Copy the tokenizer files found in `src` (a directory) into `dst`."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            copied.append(Path(shutil.copy2(src / name, dst / name)))
    return copied


# ---- export / import --------------------------------------------------------------------------------

def _tokenizer_config(tok, max_len: int) -> dict:
    def token(i):
        return tok.decode([i]) if i is not None else None

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": token(tok.eos_id),
        "pad_token": token(tok.pad_id),
        "bos_token": token(tok.eos_id),  # OLMo documents are separated by EOS; there is no separate BOS
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }


def export_hf(source, out_dir, dtype: str = "float32", max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              chat_template: str | Path | None = None) -> Path:
    """Write a transformers model directory from anything `load_weights` reads (a checkpoint, a run, our model directory),
    with the tokenizer beside the weights (`tokenizer_beside`).

    config.json (Olmo2ForCausalLM or Olmo3ForCausalLM), generation_config.json, model.safetensors (or
    shards with an index), and the tokenizer: tokenizer.json plus a tokenizer_config.json naming its
    EOS and PAD tokens, so `AutoTokenizer.from_pretrained(out_dir)` works.

    A chat model's template goes into tokenizer_config.json's `chat_template`, so `apply_chat_template`
    works in the export and gives the ids olmo-ds's `ChatEncoder` gives: `chat_template` (a spec for
    `load_chat_template`: "olmo3", a tokenizer_config.json, a directory, a Jinja file), else the one that
    belongs to the weights (`chat_template_of`). generation_config.json's `eos_token_id` then lists the
    template's turn ends before the EOS (`[<|im_end|>, <|endoftext|>]` for OLMo 3, as OLMo 3's chat
    releases list them), so `generate()` in transformers stops at the end of the assistant's turn.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    provenance = describe_weights(source)
    cfg = provenance.cfg
    # transformers reads an HF tokenizer.json; a sentencepiece model beside the weights is not converted.
    tok = provenance.tokenizer if provenance.tokenizer is not None and provenance.tokenizer.kind == "hf" else None
    if tok is not None and tok.vocab_size > cfg.padded_vocab_size:
        raise ValueError(f"{tok.path}: vocab {tok.vocab_size} exceeds the model's embedding rows {cfg.padded_vocab_size}")
    out_dir = Path(out_dir)
    template, stop_ids = _export_chat_template(provenance, tok, chat_template, out_dir)
    state = load_weights(provenance).state_dict
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_state = {k: v.to(_DTYPES[dtype]) for k, v in hf.to_hf_state_dict(cfg, state).items()}
    save_safetensors(out_dir, hf_state, max_shard_bytes=max_shard_bytes)
    eos = tok.eos_id if tok else None
    pad = tok.pad_id if tok else None
    hf_cfg = hf.to_hf_config(cfg, eos_token_id=eos, pad_token_id=pad, dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    generation = {"eos_token_id": stop_ids if template is not None else eos, "pad_token_id": pad, "bos_token_id": None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tok is not None:
        shutil.copy2(tok.path, out_dir / "tokenizer.json")
        tokenizer_config = _tokenizer_config(tok, cfg.max_seq_len)
        if template is not None:
            tokenizer_config["chat_template"] = template.text
        (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    return out_dir


def _export_chat_template(provenance: Provenance, tok: Tokenizer | None, spec, out_dir: Path) -> tuple[ChatTemplate | None, list[int]]:
    """The chat template an export writes and its turn-end ids, checked before any weight is read."""
    if spec is not None and tok is None:
        raise ValueError(f"{provenance.directory}: a chat template needs the HF tokenizer.json beside the weights, and there is none")
    template = load_chat_template(spec, tok) if spec is not None else chat_template_of(provenance, tok) if tok is not None else None
    foreign = out_dir / "chat_template.jinja"
    if foreign.is_file():  # transformers would read it in place of tokenizer_config.json's chat_template
        raise ValueError(f"{foreign}: the output directory already holds a chat template that transformers prefers to the "
                         "exported one; remove it or export to a new directory")
    if template is None:
        return None, []
    encoder = ChatEncoder(template, tok)  # a ValueError when the template's eos_token is not the tokenizer's EOS
    exported = _tokenizer_config(tok, provenance.cfg.max_seq_len)
    for key in ("bos_token", "pad_token"):
        theirs = template.tokens.get(key)
        if key in template.text and theirs is not None and exported[key] is not None and theirs != exported[key]:
            raise ValueError(f"{template.source}: the template uses {key} {theirs!r}, but the export names {exported[key]!r} "
                             f"({tok.path}); apply_chat_template would render other text than olmo-ds")
    return template, encoder.turn_end_ids()


def import_hf(hf_dir, out_dir, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> tuple[ModelConfig, Path]:
    """Our model directory (fp32) from a transformers OLMo-2/3 directory, to continue pretraining it."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    read_hf_config(hf_dir)  # a clear error when hf_dir is not a transformers Olmo2/Olmo3 directory
    weights = load_weights(hf_dir)
    cfg = weights.provenance.cfg
    save_model_dir(out_dir, cfg, weights.state_dict, tokenizer_dir=hf_dir, max_shard_bytes=max_shard_bytes)
    return cfg, out_dir
