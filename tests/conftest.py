"""The device tier a test session runs, decided before torch or DeepSpeed pick a device.

OLMO_DS_TEST_DEVICE=cpu (the default; `make test`): every test runs on CPU, on GPU hosts too. The
DeepSpeed accelerator is forced to CPU and CUDA is hidden here, so the rank processes the tests launch
inherit both: their ranks are CPU ranks over gloo, as on the development machines, instead of
claiming cuda:1 on a one-GPU host. Tests marked `gpu` skip.
OLMO_DS_TEST_DEVICE=cuda (`make test-gpu`, with `-m gpu`): the devices stay as the host has them.

Tests skipped because the host lacks GPUs are counted at the end, so a GPU run that quietly tested
nothing shows.

Also the fixtures every test directory shares.
"""

import os
from collections import Counter
from pathlib import Path

import pytest

from testdata import DOLMA2_HUB_ID, SHARED, fill_hf_cache

DEVICE = os.environ.get("OLMO_DS_TEST_DEVICE", "cpu")
if DEVICE not in ("cpu", "cuda"):
    raise pytest.UsageError(f"OLMO_DS_TEST_DEVICE={DEVICE!r}: expected 'cpu' or 'cuda'")
if DEVICE == "cpu":
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


def pytest_collection_modifyitems(config, items):
    if DEVICE == "cpu":
        skip = pytest.mark.skip(reason="GPU tier: runs with `make test-gpu` (OLMO_DS_TEST_DEVICE=cuda)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    reasons = Counter(r.longrepr[2].removeprefix("Skipped: ") if isinstance(r.longrepr, tuple) else str(r.longrepr) for r in skipped)
    terminalreporter.write_line(f"olmo-ds test device {DEVICE}: {len(skipped)} skipped: "
                                + "; ".join(f"{n} x {reason}" for reason, n in reasons.most_common()))


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
