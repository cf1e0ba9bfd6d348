"""generate(): KV-cached greedy decoding equals transformers' greedy decoding and uncached recomputation."""

from __future__ import annotations

import pytest
import torch

from olmo_ds.model import ModelConfig
from olmo_ds.model.generate import generate, sample_next

from model_testlib import OLMO3_TINY, hf_model_from, random_model
from testdata import SHARED


def test_greedy_with_kv_cache_matches_transformers_and_recomputation():
    transformers = pytest.importorskip("transformers")
    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=384))  # sliding windows shorter than the generation
    model = random_model(cfg, seed=3)
    prompts = [[5, 17, 99, 3], list(range(20, 31))]
    ours = generate(model, prompts, max_new_tokens=12)
    hf = hf_model_from(model)
    for prompt, new in zip(prompts, ours):
        seq = list(prompt)
        for _ in range(12):  # uncached: the whole sequence each step
            with torch.no_grad():
                seq.append(int(model(torch.tensor([seq]))[0, -1, :cfg.vocab_size].argmax()))
        assert new == seq[len(prompt):]
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               generation_config=transformers.GenerationConfig(pad_token_id=0, eos_token_id=None))
        assert new == expected[0, len(prompt):].tolist()


def test_top_p_samples_only_from_the_nucleus_and_is_seeded():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, 1.0, 0.75, g) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 + 0.3 reaches 0.75; ids 2 and 3 are outside the nucleus
    assert sample_next(logits, 1.0, 1e-6, g) == 0
    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=384))
    model = random_model(cfg)
    a = generate(model, [[1, 2, 3]], 10, temperature=1.0, top_p=0.9, seed=4)
    b = generate(model, [[1, 2, 3]], 10, temperature=1.0, top_p=0.9, seed=4)
    assert a == b and all(0 <= i < cfg.vocab_size for i in a[0])
    with pytest.raises(ValueError, match="max_seq_len"):
        generate(model, [[1] * 100], 50)


def test_generate_script_reads_a_model_directory(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from olmo_ds.weights import save_model_dir

    root = Path(__file__).resolve().parents[2]
    cfg = ModelConfig(**dict(OLMO3_TINY, vocab_size=100278))
    save_model_dir(tmp_path, cfg, random_model(cfg).state_dict())
    (tmp_path / "tokenizer.json").write_bytes((SHARED / "tokenizers" / "dolma2-tokenizer.json").read_bytes())
    proc = subprocess.run([sys.executable, "scripts/generate.py", str(tmp_path), "--prompt", "Once upon a time",
                           "--max-new-tokens", "5", "--temperature", "0.7", "--top-p", "0.9"],
                          capture_output=True, text=True, timeout=120, cwd=root)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "=== 'Once upon a time'\nOnce upon a time" in proc.stdout
