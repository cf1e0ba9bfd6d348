"""Data preparation throughput against the tokenizer's own ceiling (`scripts/bench_prepare.py`).

The question users ask is how much of the tokenizer's speed the pipeline keeps: so one run
measures the raw ceiling (HF `tokenizers` batch-encoding the corpus's texts, already in memory,
on one thread) and `scripts/prepare_data.py` end to end (read, decompress, parse, tokenize, write,
checksum) at 1 and 2 workers on the same corpus, each in a fresh process, and prints the ratios.
"""

from __future__ import annotations

import ast
import gzip
import json
import os
import random
import resource
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path

import orjson

REPO = Path(__file__).resolve().parents[2]


def _pool_documents() -> list[str]:
    """Real prose and code that every Python installation carries: docstrings and module sources
    of the standard library, plus the C4 web sample when ../shared is present."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            source = path.read_text(encoding="utf-8")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        docs.append(source)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 200:
                    docs.append(doc)
    c4 = REPO / ".." / "shared" / "data" / "c4-sample"
    for f in sorted(c4.glob("*.json.gz")):
        with gzip.open(f, "rt") as fh:
            docs += [json.loads(line)["text"] for line in fh]
    return docs


def generate_corpus(directory: Path, size_mb: int, files: int = 8) -> Path:
    """JSON-lines files holding about `size_mb` MB of text; reused when already there.

    The pool of real documents (~tens of MB) is repeated in seeded random orders to reach the size.
    """
    directory = Path(directory)
    marker = directory / f"corpus-{size_mb}mb.done"
    if marker.exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("part-*.jsonl"):
        old.unlink()
    pool = _pool_documents()
    rng = random.Random(0)
    target = size_mb * 1_000_000
    per_file = target // files
    written, part = 0, 0
    out = open(directory / f"part-{part:03d}.jsonl", "wb")
    while written < target:
        rng.shuffle(pool)
        for doc in pool:
            line = orjson.dumps({"text": doc}) + b"\n"
            out.write(line)
            written += len(line)
            if written >= per_file * (part + 1) and part + 1 < files:
                out.close()
                part += 1
                out = open(directory / f"part-{part:03d}.jsonl", "wb")
            if written >= target:
                break
    out.close()
    marker.touch()
    return directory


_CEILING = r"""
import os, sys, time, json
os.environ["TOKENIZERS_PARALLELISM"] = "false"
import orjson, tokenizers
from pathlib import Path
tok = tokenizers.Tokenizer.from_file(sys.argv[1])
texts = []
for f in sorted(Path(sys.argv[2]).glob("part-*.jsonl")):
    with open(f, "rb") as fh:
        texts += [orjson.loads(line)["text"] for line in fh]
nbytes = sum(len(t.encode()) for t in texts)
t0 = time.perf_counter(); c0 = time.process_time()
n = 0
for i in range(0, len(texts), 256):
    n += sum(len(e.ids) for e in tok.encode_batch_fast(texts[i:i + 256], add_special_tokens=False))
print(json.dumps({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "tokens": n, "text_bytes": nbytes, "docs": len(texts)}))
"""


def measure_ceiling(tokenizer: Path, corpus: Path) -> dict:
    """HF `tokenizers`' `encode_batch_fast` on one thread over the corpus, texts already in memory."""
    proc = subprocess.run([sys.executable, "-c", _CEILING, str(tokenizer), str(corpus)], capture_output=True, text=True, check=True)
    r = json.loads(proc.stdout)
    r["tokens_per_s"] = r["tokens"] / r["seconds"]
    r["mb_per_s"] = r["text_bytes"] / r["seconds"] / 1e6
    return r


def measure_prepare(tokenizer: Path, corpus: Path, output: Path, workers: int, extra_args: list[str] = ()) -> dict:
    """`scripts/prepare_data.py` end to end in a fresh process; wall and CPU time, largest process RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    cmd = [
        sys.executable, str(REPO / "scripts" / "prepare_data.py"), "--input", str(corpus), "--output", str(output),
        "--tokenizer", str(tokenizer), "--workers", str(workers), "--overwrite", "--no-progress", *extra_args,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"prepare_data.py failed:\n{proc.stderr}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    manifest = json.loads((Path(output) / "manifest.json").read_text())
    return {
        "workers": workers,
        "seconds": seconds,
        "cpu_seconds": (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime),
        "tokens": manifest["num_tokens"],
        "docs": manifest["num_docs"],
        "tokens_per_s": manifest["num_tokens"] / seconds,
        "input_mb_per_s": sum(i["bytes"] for i in manifest["inputs"]) / seconds / 1e6,
        # ru_maxrss is the largest single descendant's peak (KiB on Linux): the main process or a worker.
        "peak_rss_mb": after.ru_maxrss / 1024,
    }


def run(tokenizer: Path, corpus_dir: Path, size_mb: int, workers: list[int], log=print) -> dict:
    corpus = generate_corpus(corpus_dir, size_mb)
    mb = sum(f.stat().st_size for f in corpus.glob("part-*.jsonl")) / 1e6
    log(f"corpus: {corpus} ({mb:,.0f} MB of JSON lines), tokenizer: {tokenizer}, cpus: {os.cpu_count()}")
    ceiling = measure_ceiling(tokenizer, corpus)
    log(f"raw ceiling (encode_batch_fast, 1 thread, in memory): {ceiling['tokens_per_s'] / 1e6:.3f}M tokens/s, {ceiling['mb_per_s']:.2f} MB/s of text")
    results = {"corpus_mb": mb, "tokenizer": str(tokenizer), "ceiling": ceiling, "prepare": []}
    for w in workers:
        r = measure_prepare(tokenizer, corpus, corpus_dir / f"shards-w{w}", w)
        r["vs_ceiling"] = r["tokens_per_s"] / ceiling["tokens_per_s"]
        results["prepare"].append(r)
        log(
            f"prepare_data --workers {w}: {r['seconds']:.1f} s, {r['tokens_per_s'] / 1e6:.3f}M tokens/s, {r['input_mb_per_s']:.2f} MB/s, "
            f"peak RSS {r['peak_rss_mb']:.0f} MB, {r['vs_ceiling']:.2f}x ceiling"
        )
    by_w = {r["workers"]: r for r in results["prepare"]}
    if 1 in by_w and 2 in by_w:
        results["scaling_2_over_1"] = by_w[2]["tokens_per_s"] / by_w[1]["tokens_per_s"]
        log(f"2 workers / 1 worker: {results['scaling_2_over_1']:.2f}x (target >= 1.7); 1 worker / ceiling: {by_w[1]['vs_ceiling']:.2f} (target >= 0.9)")
    return results
