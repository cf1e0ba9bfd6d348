"""The device tier a test session runs, decided before torch or DeepSpeed pick a device.

OLMO_DS_TEST_DEVICE=cpu (the default; `make test`): every test runs on CPU, on GPU hosts too. The
DeepSpeed accelerator is forced to CPU and CUDA is hidden here, so the rank processes the tests launch
inherit both: their ranks are CPU ranks over gloo, as on the development machines, instead of
claiming cuda:1 on a one-GPU host. Tests marked `gpu` skip.
OLMO_DS_TEST_DEVICE=cuda (`make test-gpu`, with `-m gpu`): the devices stay as the host has them.

Tests skipped because the host lacks GPUs are counted at the end, so a GPU run that quietly tested
nothing shows.

Tests marked `slow` (multi-rank runs of a minute or so whose subject other tests also reach) are a
sampled tier, like the fault suite's trials: `make test` runs one in `SLOW_SHARE` of them (every
`SLOW_SHARE`-th in name order, from a start drawn with `OLMO_DS_SLOW_SEED`: random by default, printed at
the end so a failure can be replayed), so one file's slow tests never run in the same session;
`OLMO_DS_SLOW_TESTS=all` (`make test-slow`) runs them all, and so does a session that selected nothing
but slow tests (a file or test named on the command line).

DeepSpeed JIT-builds its CPU ops (shared-memory collectives, Adam) into torch's extensions cache, one directory
per op name. A build is keyed by the paths of its sources and the ninja that ran it, so a run from another venv
(another checkout's tests, CI beside a developer's runs) or with another ninja overwrites the build, and the next
DeepSpeed start here compiles it again: ~30 s (shared memory) and ~60 s (Adam) on 2 cores, inside whichever test
started it. The test session therefore keeps its own cache for this venv and ninja (TORCH_EXTENSIONS_DIR, unless
set), which every process it starts inherits; it is built once, by the first test that starts DeepSpeed.

Also the fixtures every test directory shares.
"""

import hashlib
import os
import random
import shutil
import sys
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

if "TORCH_EXTENSIONS_DIR" not in os.environ:
    _builder = f"{Path(sys.prefix).resolve()}\0{Path(shutil.which('ninja') or 'no ninja').resolve()}"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
                                             / f"olmo-ds-tests-{hashlib.sha256(_builder.encode()).hexdigest()[:12]}")


SLOW_TESTS = os.environ.get("OLMO_DS_SLOW_TESTS", "sample")
if SLOW_TESTS not in ("sample", "all"):
    raise pytest.UsageError(f"OLMO_DS_SLOW_TESTS={SLOW_TESTS!r}: expected 'sample' or 'all'")
SLOW_SHARE = 5  # 50 tests, ~30-130 s each: ~10 of them a run
# pytest-xdist's workers collect separately: they share the run's id, so they draw the same sample.
_RUN_ID = os.environ.get("PYTEST_XDIST_TESTRUNUID")
SLOW_SEED = int(os.environ.get("OLMO_DS_SLOW_SEED") or (int(_RUN_ID[:8], 16) if _RUN_ID else random.SystemRandom().randrange(2**31)))
_slow_sampled: list[int] = []  # [kept, of]


@pytest.hookimpl(trylast=True)  # after `-m`/`-k` deselection: `items` is what this session runs
def pytest_collection_modifyitems(config, items):
    if DEVICE == "cpu":
        skip = pytest.mark.skip(reason="GPU tier: runs with `make test-gpu` (OLMO_DS_TEST_DEVICE=cuda)")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    slow = [item for item in items if "slow" in item.keywords and not _skips_anyway(item)]
    if SLOW_TESTS == "all" or not slow or len(slow) == len([item for item in items if not _skips_anyway(item)]):
        return
    # Every SLOW_SHARE-th test in name order, from a drawn start: each test still runs in one run of SLOW_SHARE, and a
    # file's slow tests (neighbours in that order, up to SLOW_SHARE of them) are never drawn together, so no run draws
    # the three ~100 s RL multi-rank tests at once (a draw once took 18 of a 2-core VM's minutes).
    start = random.Random(SLOW_SEED).randrange(SLOW_SHARE)
    keep = set(sorted(item.nodeid for item in slow)[start::SLOW_SHARE])
    skip = pytest.mark.skip(reason=f"slow tier: not drawn this run (OLMO_DS_SLOW_SEED={SLOW_SEED}); `make test-slow` runs all")
    for item in slow:
        if item.nodeid not in keep:
            item.add_marker(skip)
    _slow_sampled[:] = [len(keep), len(slow)]


def _skips_anyway(item) -> bool:
    """Whether a test is marked to skip whatever the draw (a `skip`, or a `skipif` whose condition is true)."""
    return item.get_closest_marker("skip") is not None or any(
        m.args and not isinstance(m.args[0], str) and m.args[0] for m in item.iter_markers("skipif"))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _slow_sampled:
        terminalreporter.write_line(f"slow tier: {_slow_sampled[0]} of {_slow_sampled[1]} drawn "
                                    f"(OLMO_DS_SLOW_SEED={SLOW_SEED}; `make test-slow` runs all)")
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
