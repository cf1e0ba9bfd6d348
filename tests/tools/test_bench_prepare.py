"""bench_prepare runs end to end on a small corpus (the figures themselves are for BENCHMARKS.md)."""

import re
import subprocess
import sys
import time

import pytest

from olmo_ds.tools import package_env
from olmo_ds.tools.bench_prepare import _phases, format_phases, run
from testdata import SHARED

DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"


def test_the_phases_account_for_the_whole_wall_time(tmp_path):
    """A real prepare_data.py run's summary read back into the breakdown the many-core runs are
    judged by: every step in run order (the final validation last), and together the process's wall time."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "olmo_ds.cli.prepare_data", "--input", str(SHARED / "data" / "c4-sample"), "--output", str(tmp_path / "out"),
                           "--tokenizer", str(DOLMA2), "--workers", "2", "--work-unit", "files", "--no-progress"],
                          capture_output=True, text=True, check=True, env=package_env())
    wall = time.perf_counter() - t0
    phases = _phases(proc.stdout, wall)
    # Whole files: the fast backend's check runs beside the tokenizing ("of which", not a step); choosing it is a step.
    assert list(phases) == ["python, imports, exit", "inputs", "tokenizer", "output", "fast backend", "workers", "backend", "resume", "tokenizing",
                            "manifests", "stop workers", "validate"]
    assert abs(sum(phases.values()) - wall) < 0.01 and all(v >= 0 for v in phases.values())
    assert phases["python, imports, exit"] > 0.05 and phases["tokenizer"] > 0
    assert re.search(r"^    of which the backend check [\d.,]+ s  \(fastokens against HF", proc.stdout, re.M)  # dolma2: the fast backend is checked
    line = format_phases({"workers": 2, "phases": phases, "seconds": wall, "outside_loop_seconds": wall - phases["tokenizing"]})
    assert line.startswith("--workers 2 phases (wall s): python, imports, exit ") and f", validate {phases['validate']:.3f}; outside the tokenizing loop " in line


@pytest.mark.slow
def test_bench_prepare_small(tmp_path):
    lines = []
    r = run(DOLMA2.resolve(), tmp_path, 2, [1, 2], ["fast"], log=lines.append, big_file_mb=6)
    one, two = r["prepare"]
    assert one["tokens"] == two["tokens"] > 100_000 and one["docs"] == two["docs"]
    assert r["scaling_fast_2_over_1"] > 0 and r["scaling_fast_2_over_1_steady"] > 0
    assert r["ceiling_together"]["processes"] == 2 and r["ceiling_together"]["over_one"] > 0
    assert r["ceiling"]["fast"]["tokens"] > 0 and abs(sum(v["share"] for v in r["stages_fast_1_worker"].values()) - 1) < 1e-6
    assert all(r["decompression"][k] > 0 for k in ("gzip_isal_mb_per_s", "gzip_stdlib_mb_per_s", "zstd_mb_per_s"))
    m = r["memory_over_time"]
    assert m["file_mb"] >= 6 and m["tokens"] > 2 * one["tokens"]
    assert "main" in m["rss"] and any(k.startswith("worker") for k in m["rss"]), m["rss"]
    assert [b["workers"] for b in r["big_file_prepare"]] == [1, 2]
    assert all(b["tokens"] == m["tokens"] for b in r["big_file_prepare"])  # the same file, every worker count
    assert any("2 workers / 1 worker" in line for line in lines) and any(line.startswith("big file, --workers 2") for line in lines)


@pytest.mark.slow
def test_bench_prepare_many_files(tmp_path):
    from olmo_ds.tools.bench_prepare import run_many_files

    lines = []
    r = run_many_files(DOLMA2.resolve(), tmp_path, gz_mb=1, files=8, workers=[1, 2], pool_mb=1, log=lines.append)
    assert r["corpus"]["files"] == len(list((tmp_path / "corpus-gz").glob("*.json.gz"))) == 8
    assert r["corpus"]["gz_bytes"] >= 900_000 and r["corpus"]["text_bytes"] > 2 * r["corpus"]["gz_bytes"]
    one, two = r["prepare"]
    assert one["tokens"] == two["tokens"] and r["identical"] == {2: True}
    assert one["layout"] == "fastokens, run by this process" and "taking whole files" in two["layout"]  # auto: 8 files, 2 workers
    assert r["ceiling_2"]["tokens"] + two["docs"] == two["tokens"] and 0 < r["ceiling_1"]["tokens"] < r["ceiling_2"]["tokens"]  # 1 process: half the files
    assert r["disk"]["processes"] == 2 and r["disk"]["bytes"] >= 4 * two["tokens"] and not list((tmp_path / "disk-floor").iterdir())
    ind = r["independent"]
    assert ind["jobs"] == 2 and ind["tokens"] == two["tokens"] and [p["tokens"] > 0 for p in ind["parts"]] == [True, True]
    assert not (tmp_path / "independent").exists()  # deleted once measured
    for x in ("end_to_end_over_1", "over_independent", "over_read_and_encode", "over_independent_jobs", "end_to_end_over_independent_jobs", "disk_over_independent"):
        assert r[x] > 0, x
    assert two["prepare_cores_busy"] > 0 and two["output_bytes"] > 4 * two["tokens"]
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 8 and "the disk's bound" in table[4] and "--partition i/2 --workers 1" in table[5]
    assert lines[-3].startswith("--workers 2 / --workers 1, end to end:") and "identical output: yes" in lines[-3]
    assert "/ 2 independent prepare jobs: " in lines[-2] and lines[-1].startswith("the disk: 2 writers wrote + fsynced the output at ")
    assert not (tmp_path / "shards-w1").exists()  # deleted after the comparison
    assert [line.split(" phases")[0] for line in lines if " phases (wall s): python, imports, exit " in line] == ["--workers 1", "--workers 2"]
    assert all(abs(sum(run["phases"].values()) - run["seconds"]) < 0.01 for run in r["prepare"]), [(run["phases"], run["seconds"]) for run in r["prepare"]]
