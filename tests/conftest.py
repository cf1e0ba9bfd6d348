"""Fixtures every test directory shares."""

from __future__ import annotations

from pathlib import Path

import pytest

from testdata import DOLMA2_HUB_ID, SHARED, fill_hf_cache


@pytest.fixture
def hf_cache(tmp_path, monkeypatch) -> Path:
    """An offline HF cache holding allenai/dolma2-tokenizer's tokenizer.json (the shared OLMo 2/3 file),
    set for this process (huggingface_hub read its environment at import) and for processes it starts."""
    import huggingface_hub.constants

    cache = tmp_path / "hf-cache"
    fill_hf_cache(cache, DOLMA2_HUB_ID, {"tokenizer.json": SHARED / "tokenizers" / "dolma2-tokenizer.json"})
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache
