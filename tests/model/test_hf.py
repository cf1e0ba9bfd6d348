"""Hugging Face interchange: export -> transformers -> import is bit-identical; real HF directories import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from olmo_ds.model import ModelConfig
from olmo_ds.model.hf import from_hf_config, to_hf_config
from olmo_ds.weights import import_hf, load_model_dir, save_model_dir

from model_testlib import OLMO2_TINY, OLMO3_TINY, hf_model_from, random_model
from testdata import SHARED

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = SHARED / "tokenizers" / "dolma2-tokenizer.json"


def _run(*args):
    proc = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_export_then_import_is_bit_identical_and_loads_in_transformers(tmp_path):
    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=100278))
    model = random_model(cfg)
    src = tmp_path / "ours"
    save_model_dir(src, cfg, model.state_dict())
    (src / "tokenizer.json").write_bytes(TOKENIZER.read_bytes())

    # Shards of ~10 MB force the sharded layout (index + several files).
    _run("scripts/export_hf.py", src, tmp_path / "hf", "--max-shard-gb", 0.01)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "hf").glob("model-*.safetensors"))) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "Olmo3ForCausalLM"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert (tok.eos_token_id, tok.pad_token_id) == (100257, 100277)
    text = "Language models trained on open data."
    ids = tok(text).input_ids
    from olmo_ds.tokenizer import load_tokenizer

    assert ids == load_tokenizer(TOKENIZER).encode(text)
    with torch.no_grad():
        diff = (model(torch.tensor([ids])) - hf(torch.tensor([ids])).logits).abs().max().item()
    assert diff <= 1e-4

    _run("scripts/import_hf.py", tmp_path / "hf", tmp_path / "back")
    cfg_back, state_back = load_model_dir(tmp_path / "back")
    assert cfg_back == cfg
    original = model.state_dict()
    assert state_back.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(state_back[name], tensor), name


@pytest.mark.parametrize("spec", [OLMO2_TINY, dict(OLMO2_TINY, tie_embeddings=True), OLMO3_TINY],
                         ids=["olmo2", "olmo2-tied", "olmo3"])
def test_import_of_a_directory_written_by_transformers(spec, tmp_path):
    """transformers' own save_pretrained output (its current config keys) imports to the same logits."""
    cfg = ModelConfig(**dict(spec, vocab_size=384))
    hf = hf_model_from(random_model(cfg, seed=7))
    hf.save_pretrained(tmp_path / "hf")
    cfg_in, _ = import_hf(tmp_path / "hf", tmp_path / "ours")
    assert cfg_in == cfg
    from olmo_ds.model import OLMo

    _, state = load_model_dir(tmp_path / "ours")
    ours = OLMo(cfg_in).eval()
    ours.load_state_dict(state)
    ids = torch.randint(0, 384, (1, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() <= 1e-4


def test_config_conversion_round_trips_and_rejects_other_models():
    for spec in (OLMO2_TINY, OLMO3_TINY):
        cfg = ModelConfig(**dict(spec, vocab_size=384))
        assert from_hf_config(to_hf_config(cfg)) == cfg
    llama = dict(to_hf_config(ModelConfig(**OLMO2_TINY)), model_type="llama")
    with pytest.raises(ValueError, match="not an OLMo 2 or OLMo 3 model"):
        from_hf_config(llama, where="x/config.json")


def test_import_names_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        import_hf(tmp_path, tmp_path / "out")
    cfg = ModelConfig(**OLMO2_TINY)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_config(cfg)))
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(384, 64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing keys"):
        import_hf(tmp_path, tmp_path / "out")
