"""The programs bench_prepare times in fresh processes run as `python -m olmo_ds.tools.prepare_probes`, each
printing the JSON line bench_prepare reads: the tokenizer ceilings count the same tokens for the same texts,
and a disk writer writes its bytes, says when, and leaves no file behind."""

import gzip
import json
import subprocess
import sys
import time

from olmo_ds.tools import package_env
from olmo_ds.tools.bench_prepare import PROBES
from testdata import SHARED

DOLMA2 = SHARED / "tokenizers" / "dolma2-tokenizer.json"


def probe(*args) -> dict:
    proc = subprocess.run([sys.executable, "-m", PROBES, *map(str, args)], env=package_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_ceilings_count_the_same_tokens(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines = [line for f in sorted((SHARED / "data" / "c4-sample").glob("*.json.gz")) for line in gzip.open(f, "rt")]
    (corpus / "part-000.jsonl").write_text("".join(lines))
    fast = probe("ceiling", DOLMA2, corpus, "fast")
    assert fast["docs"] == len(lines) and fast["tokens"] > 0 and fast["seconds"] > 0 and fast["cpu_seconds"] >= 0
    assert fast["text_bytes"] == sum(len(json.loads(line)["text"].encode()) for line in lines)
    hf = probe("ceiling", DOLMA2, corpus, "hf")
    assert hf["docs"] == fast["docs"] and hf["tokens"] > 0
    files = probe("files-ceiling", DOLMA2, corpus / "part-000.jsonl")
    assert (files["tokens"], files["docs"]) == (fast["tokens"], fast["docs"]) and files["itemsize"] == 4
    assert files["load_tokenizer"] > 0 and files["read_seconds"] >= 0


def test_writer_starts_at_the_given_time(tmp_path):
    start_at = time.time() + 0.5
    r = probe("write", tmp_path / "w.tmp", 3 << 20, start_at)
    assert start_at <= r["start"] <= r["end"]
    assert not list(tmp_path.iterdir())  # written, fsynced, removed
