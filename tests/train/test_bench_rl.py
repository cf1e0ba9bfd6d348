"""scripts/bench_rl.py's CPU dry run: a tiny model's GRPO steps on a ZeRO-3 engine, the time split reported, the
rollout's generation against the decode engine alone on the same requests, the training part against SFT on the
same rows, synchronous and in-flight rollouts side by side on OLMo 3-like lengths; the table comes last and --out
holds the numbers. And the imposed lengths' spread."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from olmo_ds.tools.bench_rl import realistic_length
from train_testlib import ROOT


@pytest.mark.slow  # ~10 s of CPU, most of it DeepSpeed's start
def test_cpu_dry_run_reports_the_split_and_both_comparisons(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "scripts/bench_rl.py", "--preset", "tiny", "--prompts", "3", "--samples", "4",
                           "--new-tokens", "6", "--steps", "2", "--lengths", "realistic", "--async-steps", "0,1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(out.read_text())
    step = got["step"]
    assert 12 <= step["generated_tokens"] < 72  # each sample 1 to 6 tokens, not all 6
    assert step["trained_tokens"] <= step["generated_tokens"] and step["rows"] % 2 == 0
    for key in ("gather_s", "generation_s", "reward_s", "training_s"):
        assert step[key] >= 0
    for key in ("rollout_tokens_per_s", "generate_tokens_per_s", "training_row_tokens_per_s", "sft_row_tokens_per_s"):
        assert got[key] > 0
    sync, ahead = got["async_steps"]["0"], got["async_steps"]["1"]
    assert 0 < sync["occupancy"] < 1 and 0 < ahead["occupancy"] <= 1 and ahead["staleness_mean"] <= 1
    for run in (sync, ahead):
        assert run["step_s"] > 0 and run["step_tokens_per_s"] > 0 and run["decode_tokens_per_s"] > 0 and len(run["steps"]) == 2
    table = proc.stdout.strip().splitlines()
    assert [line.split(" | ")[0] for line in table[-9:-7]] == ["| 0", "| 1"]
    assert table[-6].startswith("| part | seconds | share | tokens/s | against |")
    assert [line.split(" | ")[0] for line in table[-4:]] == ["| weight gathering", "| generation", "| reward", "| training"]


def test_realistic_lengths_spread_as_olmo_3s():
    """A mean near 40% of the limit, 15% of samples at it, every length in 1 .. the limit, keyed by the sample."""
    length = realistic_length(0, 1000)
    got = [length(step, prompt, 0) for step in range(40) for prompt in range(100)]
    assert min(got) >= 1 and max(got) == 1000 and length(3, 4, 0) == got[3 * 100 + 4]
    assert abs(sum(got) / len(got) / 1000 - 0.40) < 0.02 and abs(sum(x == 1000 for x in got) / len(got) - 0.15) < 0.02
