"""Conversion between our model and transformers' Olmo2ForCausalLM / Olmo3ForCausalLM, and the model
directory format that `scripts/import_hf.py` writes and the trainer starts from.

Parameter names map one to one (no tensor is split, fused or transposed), so conversion is exact in
both directions. The exported `vocab_size` is our padded vocabulary (as in allenai's released
OLMo 2/3 configs, e.g. 100352); on import the unpadded size is taken from the tokenizer when the
directory has one.

Our model directory (the import format; also accepted by `scripts/export_hf.py`):
    model_config.json         ModelConfig.to_dict()
    model.safetensors         fp32 weights under our parameter names (or model-0000i-of-0000n.safetensors
                              + model.safetensors.index.json when larger than the shard size)
    tokenizer.json            when the source had one
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from olmo_ds.model.config import ModelConfig, YarnConfig

MODEL_CONFIG_FILE = "model_config.json"
SAFETENSORS_FILE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 5 * 1024**3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# (our name pattern, HF name pattern); {i} is the layer index.
_LAYER_NAMES = [
    ("blocks.{i}.attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("blocks.{i}.attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("blocks.{i}.attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("blocks.{i}.attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("blocks.{i}.attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("blocks.{i}.attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("blocks.{i}.attn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("blocks.{i}.mlp.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("blocks.{i}.mlp.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("blocks.{i}.mlp.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("blocks.{i}.mlp_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
]
_GLOBAL_NAMES = [
    ("embed.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("head.weight", "lm_head.weight"),
]


def name_map(cfg: ModelConfig) -> dict[str, str]:
    """Our parameter name -> transformers' name, for every parameter of `cfg`'s model."""
    names = dict(_GLOBAL_NAMES)
    for i in range(cfg.n_layers):
        names.update({ours.format(i=i): theirs.format(i=i) for ours, theirs in _LAYER_NAMES})
    return names


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Our parameter name -> shape, from a model built on the meta device (no memory, any size)."""
    from olmo_ds.model.model import OLMo

    with torch.device("meta"):
        model = OLMo(cfg)
    return {name: tuple(p.shape) for name, p in model.state_dict(keep_vars=True).items()}


def check_state_dict(cfg: ModelConfig, state: dict[str, torch.Tensor], where: str) -> None:
    """Names and shapes of `state` are exactly those of `OLMo(cfg)`; the error names the first mismatches."""
    shapes = expected_shapes(cfg)
    _check_keys(set(state), set(shapes), where)
    wrong = [f"{k}: {tuple(state[k].shape)} != {shapes[k]}" for k in shapes if tuple(state[k].shape) != shapes[k]]
    if wrong:
        raise ValueError(f"{where}: tensor shapes do not match the model config: {wrong[:6]}")


def _check_keys(have, want, what: str) -> None:
    missing, unexpected = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or unexpected:
        raise ValueError(f"{what}: missing keys {missing[:8]}{'...' if len(missing) > 8 else ''}, "
                         f"unexpected keys {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}")


def to_hf_state_dict(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our state dict -> transformers' names. With tied embeddings `lm_head.weight` is left out."""
    names = name_map(cfg)
    want = set(names) - ({"head.weight"} if cfg.tie_embeddings else set())
    have = set(state_dict) - ({"head.weight"} if cfg.tie_embeddings else set())
    _check_keys(have, want, "model state dict")
    return {names[k]: state_dict[k] for k in want}


def from_hf_state_dict(cfg: ModelConfig, hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' state dict -> ours (`head.weight` is the embedding when tied)."""
    inverse = {theirs: ours for ours, theirs in name_map(cfg).items()}
    have = set(hf_state) - {k for k in hf_state if k.endswith("rotary_emb.inv_freq")}
    if cfg.tie_embeddings:
        have.discard("lm_head.weight")
        inverse.pop("lm_head.weight")
    _check_keys(have, inverse, "transformers state dict")
    out = {inverse[k]: hf_state[k] for k in inverse}
    if cfg.tie_embeddings:
        out["head.weight"] = out["embed.weight"]
    return out


def to_hf_config(cfg: ModelConfig, eos_token_id: int | None = None, pad_token_id: int | None = None,
                 bos_token_id: int | None = None, dtype: str = "float32") -> dict:
    """config.json for Olmo2ForCausalLM (no sliding window, no YaRN) or Olmo3ForCausalLM.

    RoPE is written in the legacy `rope_theta` / `rope_scaling` keys, which transformers 4.x and 5.x
    and vLLM all read.
    """
    olmo3 = bool(cfg.sliding_window) or cfg.yarn is not None
    hf = {
        "architectures": ["Olmo3ForCausalLM" if olmo3 else "Olmo2ForCausalLM"],
        "model_type": "olmo3" if olmo3 else "olmo2",
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_hidden,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "vocab_size": cfg.padded_vocab_size,
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
        "bos_token_id": bos_token_id,
        "torch_dtype": dtype,
    }
    if olmo3:
        hf["sliding_window"] = cfg.sliding_window or cfg.max_seq_len
        hf["layer_types"] = [
            "sliding_attention" if cfg.layer_is_sliding(i) else "full_attention" for i in range(cfg.n_layers)
        ]
    if cfg.yarn is not None:
        hf["rope_scaling"] = {
            "rope_type": "yarn",
            "factor": cfg.yarn.factor,
            "beta_fast": cfg.yarn.beta_fast,
            "beta_slow": cfg.yarn.beta_slow,
            "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
            "attention_factor": cfg.yarn.attention_factor,
        }
    return hf


def _rope_from_hf(hf: dict, where: str) -> tuple[float, dict | None]:
    """(rope_theta, yarn scaling dict or None) from either the legacy or the transformers-5 keys."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        params = params["full_attention"]
    theta = hf.get("rope_theta") or (params or {}).get("rope_theta") or 500_000.0
    scaling = hf.get("rope_scaling") or params
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return float(theta), None
    if rope_type != "yarn":
        raise ValueError(f"{where}: rope type {rope_type!r} is not supported (only default and yarn)")
    return float(theta), scaling


def from_hf_config(hf: dict, vocab_size: int | None = None, where: str = "config.json") -> ModelConfig:
    """ModelConfig from a transformers OLMo-2/3 config.json; `vocab_size` = the tokenizer's, if known."""
    model_type = hf.get("model_type")
    if model_type not in ("olmo2", "olmo3"):
        raise ValueError(f"{where}: model_type {model_type!r} is not an OLMo 2 or OLMo 3 model")
    for key in ("attention_bias", "clip_qkv"):
        if hf.get(key):
            raise ValueError(f"{where}: {key}={hf[key]!r} is not part of the OLMo 2/3 architecture")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act {hf['hidden_act']!r}; OLMo uses silu (SwiGLU)")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        raise ValueError(f"{where}: head_dim {hf['head_dim']} != hidden_size / num_attention_heads")
    theta, scaling = _rope_from_hf(hf, where)
    yarn = None
    if scaling is not None:
        yarn = YarnConfig(
            factor=float(scaling["factor"]), beta_fast=float(scaling.get("beta_fast") or 32),
            beta_slow=float(scaling.get("beta_slow") or 1),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
        unsupported = {k: scaling[k] for k in ("mscale", "mscale_all_dim", "partial_rotary_factor") if scaling.get(k)}
        if scaling.get("truncate") is False:
            unsupported["truncate"] = False
        if unsupported:
            raise ValueError(f"{where}: YaRN options {unsupported} are not supported (OLMo 3 uses none of them)")
        given = scaling.get("attention_factor")
        if given is not None and not math.isclose(given, yarn.attention_factor, rel_tol=1e-6):
            raise ValueError(f"{where}: YaRN attention_factor {given} differs from 0.1*ln(factor)+1 = "
                             f"{yarn.attention_factor}; only the standard mscale is supported")
    window, pattern = None, []
    if model_type == "olmo3":
        types = hf.get("layer_types") or [
            "sliding_attention" if (i + 1) % 4 else "full_attention" for i in range(hf["num_hidden_layers"])
        ]
        sliding = [t == "sliding_attention" for t in types]
        if any(sliding):
            window, pattern = hf.get("sliding_window", 4096), _shortest_period(sliding[:-1] or sliding)
            expected = [pattern[i % len(pattern)] for i in range(len(types) - 1)] + [False]
            if sliding != expected:
                raise ValueError(f"{where}: layer_types {types} is not a repeating pattern with a full last layer")
    hf_vocab = hf["vocab_size"]
    if vocab_size is not None and not (hf_vocab - 128 < vocab_size <= hf_vocab):
        vocab_size = None  # the tokenizer does not describe this embedding; keep the embedding's size
    return ModelConfig(
        d_model=d, n_layers=hf["num_hidden_layers"], n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads, mlp_hidden=hf["intermediate_size"],
        vocab_size=vocab_size or hf_vocab, max_seq_len=hf["max_position_embeddings"], rope_theta=theta,
        norm_eps=hf.get("rms_norm_eps", 1e-6), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        init_std=hf.get("initializer_range", 0.02), sliding_window=window, sliding_window_pattern=pattern,
        yarn=yarn,
    )


def _shortest_period(flags: list[bool]) -> list[bool]:
    for period in range(1, len(flags) + 1):
        if all(flags[i] == flags[i % period] for i in range(len(flags))):
            return flags[:period]
    return flags


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


def load_model_dir(directory) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(ModelConfig, state dict) from our model directory."""
    directory = Path(directory)
    config_path = directory / MODEL_CONFIG_FILE
    if not config_path.is_file():
        raise FileNotFoundError(f"{directory}: no {MODEL_CONFIG_FILE}; not an olmo-ds model directory "
                                f"(make one with scripts/import_hf.py)")
    try:
        cfg = ModelConfig.from_dict(json.loads(config_path.read_text()))
    except (ValueError, TypeError) as e:
        raise ValueError(f"{config_path}: {e}") from e
    state = load_safetensors(directory)
    if cfg.tie_embeddings:
        state["head.weight"] = state["embed.weight"]
    check_state_dict(cfg, state, str(directory))
    return cfg, state


def load_weights_into(model, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a full state dict into `model`, also when its parameters are ZeRO-3 partitioned.

    For starting a run from imported weights: build the model under `deepspeed.zero.Init`, then call
    this on every rank (collective under ZeRO-3: each parameter is gathered, overwritten on rank 0
    and broadcast back into its partitions).
    """
    check_state_dict(model.cfg, state_dict, "state dict to load")
    for name, param in model.named_parameters():  # de-duplicates tied weights
        source = state_dict[name]
        if hasattr(param, "ds_id"):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    param.data.copy_(source)
        else:
            with torch.no_grad():
                param.copy_(source)


def copy_tokenizer_files(src: Path, dst: Path) -> list[Path]:
    """Copy the tokenizer files found in `src` (a directory) into `dst`."""
    import shutil

    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            copied.append(Path(shutil.copy2(src / name, dst / name)))
    return copied




# ---- export / import --------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model_weights(path) -> tuple[ModelConfig, dict[str, torch.Tensor], Path]:
    """(config, fp32 state dict, directory holding its tokenizer) from our model directory or a
    training checkpoint (`RUN/checkpoints/step-NNNNNNN`, consolidated on CPU from its ZeRO shards)."""
    path = Path(path)
    if (path / MODEL_CONFIG_FILE).is_file():
        cfg, state = load_model_dir(path)
        return cfg, state, path
    from olmo_ds.train.checkpoint import TRAIN_STATE, load_model_state

    if not (path / TRAIN_STATE).is_file():
        raise FileNotFoundError(f"{path}: neither an olmo-ds model directory ({MODEL_CONFIG_FILE}) nor a complete "
                                f"training checkpoint ({TRAIN_STATE})")
    cfg, state, _ = load_model_state(path)
    check_state_dict(cfg, state, f"{path} (consolidated checkpoint)")
    return cfg, state, path


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


def export_hf(source, out_dir, dtype: str = "float32", max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write a transformers model directory from a checkpoint or one of our model directories.

    config.json (Olmo2ForCausalLM or Olmo3ForCausalLM), generation_config.json, model.safetensors (or
    shards with an index), and the tokenizer: tokenizer.json plus a tokenizer_config.json naming its
    EOS and PAD tokens, so `AutoTokenizer.from_pretrained(out_dir)` works.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    cfg, state, src = load_model_weights(source)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = None
    if (src / "tokenizer.json").is_file():
        from olmo_ds.tokenizer import load_tokenizer

        tok = load_tokenizer(src / "tokenizer.json")
        if tok.vocab_size > cfg.padded_vocab_size:
            raise ValueError(f"{src / 'tokenizer.json'}: vocab {tok.vocab_size} exceeds the model's "
                             f"embedding rows {cfg.padded_vocab_size}")
    hf_state = {k: v.to(_DTYPES[dtype]) for k, v in to_hf_state_dict(cfg, state).items()}
    save_safetensors(out_dir, hf_state, max_shard_bytes=max_shard_bytes)
    eos = tok.eos_id if tok else None
    pad = tok.pad_id if tok else None
    hf_cfg = to_hf_config(cfg, eos_token_id=eos, pad_token_id=pad, dtype=dtype)
    (out_dir / "config.json").write_text(json.dumps(hf_cfg, indent=2) + "\n")
    generation = {"eos_token_id": eos, "pad_token_id": pad, "bos_token_id": None}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if tok is not None:
        import shutil

        shutil.copy2(src / "tokenizer.json", out_dir / "tokenizer.json")
        (out_dir / "tokenizer_config.json").write_text(json.dumps(_tokenizer_config(tok, cfg.max_seq_len), indent=2) + "\n")
    return out_dir


def import_hf(hf_dir, out_dir, max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> tuple[ModelConfig, Path]:
    """Our model directory (fp32) from a transformers OLMo-2/3 directory, to continue pretraining it."""
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{hf_dir}: no config.json; expected a transformers model directory")
    try:
        hf_cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path}: invalid JSON: {e}") from e
    vocab = None
    if (hf_dir / "tokenizer.json").is_file():
        from olmo_ds.tokenizer import load_tokenizer

        vocab = load_tokenizer(hf_dir / "tokenizer.json").vocab_size
    try:
        cfg = from_hf_config(hf_cfg, vocab_size=vocab, where=str(config_path))
    except (KeyError, TypeError) as e:
        raise ValueError(f"{config_path}: missing or invalid key {e}") from e
    state = {k: v.float() for k, v in from_hf_state_dict(cfg, load_safetensors(hf_dir)).items()}
    check_state_dict(cfg, state, f"{hf_dir} (vocab_size {hf_cfg.get('vocab_size')} must be a multiple of 128)"
                     if hf_cfg.get("vocab_size", 0) % 128 else str(hf_dir))
    save_model_dir(out_dir, cfg, state, tokenizer_dir=hf_dir, max_shard_bytes=max_shard_bytes)
    return cfg, out_dir
