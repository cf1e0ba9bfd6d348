"""Data preparation throughput: each tokenizer backend's raw ceiling vs prepare_data.py (which validates its output)
end to end at 1 and 2 workers, and where the fast path's time goes.

    python scripts/bench_prepare.py                          # 256 MB generated corpus, OLMo 2/3 tokenizer, both backends
    python scripts/bench_prepare.py --size-mb 16             # a quick run
    python scripts/bench_prepare.py --backends fast          # only fastokens
    python scripts/bench_prepare.py --backends fast --big-file-mb 4000   # and on one 4 GB file: RSS over time, speed
    python scripts/bench_prepare.py --many-files --workers 1 16   # >= 2 GB of .json.gz in 128 files: 1 vs 16 workers, against
                                                                   # 16 independent fastokens processes, 16 writers on the
                                                                   # disk and 16 independent single-worker prepare jobs
    python scripts/bench_prepare.py --long-document-mb 50         # peak RSS on one 50 MB document (one line), per backend

Prints tokens/s, MB/s, peak RSS and the ratios against the targets.

Data preparation throughput against the tokenizer's own ceiling (`scripts/bench_prepare.py`).

The question users ask is how much of the tokenizer's speed the pipeline keeps: so one run
measures, for each backend (HF `tokenizers`, `fastokens`), the raw ceiling (the encoder alone on
the corpus's texts, already in memory, one thread) and `scripts/prepare_data.py`, which validates its
output at the end (read, parse, tokenize, write, checksum, verify) at 1 and 2 workers on
the same corpus, each in a fresh process, prints the ratios, and splits the fast path's CPU time
into its stages, since once tokenizing is fast the rest of the pipeline is what is left.

`--many-files` asks the corpus-scale question instead: on >= 2 GB of .json.gz in 128 files
(generated in parallel from the installed text, `generate_gz_corpus`), prepare + validate with 1
worker and with all cores (whole-file mode), all in one call, against three bounds: as many
independent fastokens processes each on its share of the files (`measure_files_ceiling`), as many
processes writing and fsyncing the output's bytes to the same disk (`measure_disk_floor`), and as
many independent single-worker prepare + validate jobs, one per `--partition` part
(`measure_independent`). It checks that the outputs are the same bytes (`same_output`), says how
busy the cores were and how much reached the disk during each prepare, and prints a table last.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import zlib
from pathlib import Path

import orjson

from olmo_ds import hub
from olmo_ds.tools import package_env

# The tokenizer, the readers and zstandard are imported inside the measures that use them (measure_stages,
# measure_decompression), not here: this process starts the timed prepare runs, and a child's peak RSS
# (ru_maxrss) counts what its parent held at fork, so it loads nothing it does not need before them.

# The programs timed in fresh processes (tokenizer ceilings, disk writers), started as `python -m PROBES ...`.
PROBES = "olmo_ds.tools.prepare_probes"


def _unique_documents(limit: int, extra_text: Path | None = None) -> list[str]:
    """Real code and prose that every installation of the project carries, no text twice: the
    Python sources (code with docstrings) and the .md/.rst/.txt files of the standard library and
    the installed packages, after the web text of `extra_text`'s .json.gz files (e.g. the C4 sample
    beside a clone, ../shared/data/c4-sample) when given; up to `limit` bytes.

    Repeated documents would flatter any tokenizer with a cache, so a document is taken once.
    """
    seen, docs, total = set(), [], 0
    for f in sorted(Path(extra_text).glob("*.json.gz")) if extra_text else []:
        with gzip.open(f, "rt") as fh:
            docs += [json.loads(line)["text"] for line in fh]
    roots = {Path(sysconfig.get_paths()[k]) for k in ("stdlib", "purelib")}
    paths = sorted({p for root in roots for p in root.rglob("*") if p.suffix in (".py", ".md", ".rst", ".txt") and p.is_file()})
    random.Random(0).shuffle(paths)  # mix code and prose, and packages with each other
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.blake2b(text.encode(), digest_size=16).digest()
        if len(text) < 200 or digest in seen:
            continue
        seen.add(digest)
        docs.append(text)
        total += len(text.encode())
        if total >= limit:
            break
    return docs


def _fresh(directory: Path, marker: Path, pattern: str) -> bool:
    """False when `marker` says the corpus in `directory` is complete; else empty it of `pattern` and say True."""
    if marker.exists():
        return False
    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob(pattern):
        old.unlink()
    return True


def generate_corpus(directory: Path, size_mb: int, files: int = 8, extra_text: Path | None = None) -> Path:
    """JSON-lines files holding about `size_mb` MB of distinct real documents; reused when present.

    If the installation holds less text than asked for, the corpus is what there is (it says so).
    """
    directory = Path(directory)
    marker = directory / f"corpus-{size_mb}mb.done"
    if not _fresh(directory, marker, "part-*.jsonl"):
        return directory
    lines = [orjson.dumps({"text": d}) + b"\n" for d in _unique_documents(size_mb * 1_000_000, extra_text)]
    per_file = -(-len(lines) // files)
    for i in range(files):
        with open(directory / f"part-{i:03d}.jsonl", "wb") as out:
            out.writelines(lines[i * per_file : (i + 1) * per_file])
    marker.touch()
    return directory


def _ceiling_cmd(tokenizer: Path, corpus: Path, backend: str) -> list[str]:
    return [sys.executable, "-m", PROBES, "ceiling", str(tokenizer), str(corpus), backend]


def measure_ceiling(tokenizer: Path, corpus: Path, backend: str) -> dict:
    """The encoder alone on one thread over the corpus, texts already in memory (fresh process)."""
    proc = subprocess.run(_ceiling_cmd(tokenizer, corpus, backend), capture_output=True, text=True, check=True, env=package_env())
    r = json.loads(proc.stdout)
    r["tokens_per_s"] = r["tokens"] / r["seconds"]
    r["tokens_per_cpu_s"] = r["tokens"] / r["cpu_seconds"]
    r["mb_per_s"] = r["text_bytes"] / r["seconds"] / 1e6
    return r


def _run_together(cmds: list[list[str]]) -> list[dict]:
    """Start every command at once; the JSON each prints, in order."""
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=package_env()) for cmd in cmds]
    runs = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"ceiling run failed (exit {p.returncode})")
        runs.append(json.loads(out))
    return runs


def measure_ceiling_together(tokenizer: Path, corpus: Path, backend: str, n: int) -> dict:
    """`n` ceiling runs started at once, each in its own process on the whole corpus: how much `n`
    independent tokenizers get out of this machine together, the upper bound for `n` workers over one
    (cores that share a physical core, memory bandwidth or a noisy neighbour all show up here)."""
    runs = _run_together([_ceiling_cmd(tokenizer, corpus, backend)] * n)
    return {"processes": n, "tokens_per_s": sum(r["tokens"] / r["seconds"] for r in runs)}


def _timed(cmd: list[str]) -> dict:
    """Run a command to completion: wall seconds, CPU seconds (user and system) and peak RSS of it and its workers."""
    with tempfile.TemporaryFile() as err:
        started = time.time()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, env=package_env())
        out = proc.stdout.read().decode()  # a short summary: reading it to the end cannot block the child
        # wait4 reports the child's own usage plus that of the children it reaped (the pool
        # workers); ru_maxrss is the largest of those processes' peaks (KiB on Linux).
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            err.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{err.read().decode()}")
    proc.stdout.close()
    return {"seconds": seconds, "cpu_seconds": usage.ru_utime + usage.ru_stime, "sys_seconds": usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1024,
            "stdout": out, "started": started}


def disk_written() -> int | None:
    """Bytes the kernel has written back to disk since boot, all processes and devices together
    (Linux's /proc/vmstat `nr_written`, counted when a page's write completes); None elsewhere."""
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("nr_written "):
                    return int(line.split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        pass
    return None


def _output_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in Path(directory).rglob("*") if p.is_file())


def measure_prepare(tokenizer: Path, corpus: Path, output: Path, workers: int, backend: str, extra: tuple[str, ...] = ()) -> dict:
    """`prepare_data.py` in a fresh process, to validated shards: it validates its output at the end (its `validate`
    step: each shard's reading from the check record the process that wrote it made, the rest as validate_shards.py
    checks it), so that step is the "validate" of prepare + validate, and no second process reads the shards again.
    `extra`: more arguments for prepare_data.py (`--partition I/M`)."""
    written = disk_written()
    prep = _timed([
        sys.executable, "-m", "olmo_ds.cli.prepare_data", "--input", str(corpus), "--output", str(output),
        "--tokenizer", str(tokenizer), "--workers", str(workers), "--overwrite", "--no-progress", "--tokenizer-backend", backend, *extra,
    ])
    written = disk_written() - written if written is not None else None
    validated = re.search(r"^validated\s+(\S+): .*?(\d[\d,]*) read again", prep["stdout"], re.M)
    if validated is None or validated.group(1) != "OK" or validated.group(2) != "0":
        raise RuntimeError(f"prepare_data.py on {corpus}: its output validated as {validated and validated.group(0)!r}, expected every shard OK "
                           "from its check record")
    manifest = json.loads((Path(output) / "manifest.json").read_text())
    ran = manifest["tokenizer_backend"]["name"]
    if (backend == "fast") != (ran == "fastokens"):
        raise RuntimeError(f"asked for backend {backend}, prepare_data.py ran {ran}")
    seconds = prep["seconds"]
    phases = _phases(prep["stdout"], prep["seconds"])
    validate_seconds = phases.get("validate", 0.0)
    # prepare_data.py's own figure (its `tokenizing` line): from the first block read to the last shard written, without
    # start-up (imports, tokenizer loading, the backend guard), which a long run amortizes.
    steady = float(re.search(r"tokenizing\s+([\d.,]+) s", prep["stdout"]).group(1).replace(",", ""))
    if steady <= 0:  # printed to the millisecond: only a corpus far too small to measure rounds to 0
        raise RuntimeError(f"prepare_data.py on {corpus} took under a millisecond; use a larger --size-mb")
    return {
        "backend": backend, "workers": workers, "tokens": manifest["num_tokens"], "docs": manifest["num_docs"],
        "prepare_seconds": prep["seconds"] - validate_seconds, "validate_seconds": validate_seconds, "seconds": seconds, "loop_seconds": steady,
        "loop_tokens_per_s": manifest["num_tokens"] / steady,
        "cpu_seconds": prep["cpu_seconds"], "prepare_peak_rss_mb": prep["peak_rss_mb"], "validate_peak_rss_mb": prep["peak_rss_mb"],
        # Cores busy on average while prepare_data.py ran (start-up included), and how much of that the kernel spent.
        "prepare_cores_busy": prep["cpu_seconds"] / prep["seconds"], "prepare_sys_share": prep["sys_seconds"] / max(prep["cpu_seconds"], 1e-9),
        # Written to disk while it ran, against the size of what it wrote (system-wide: it counts
        # anything else writing then, and scratch files whose pages reached the disk before deletion).
        "prepare_disk_written": written, "output_bytes": _output_bytes(output),
        "started": prep["started"], "ended": prep["started"] + prep["seconds"],
        "tokens_per_s": manifest["num_tokens"] / seconds,
        "tokens_per_cpu_s": manifest["num_tokens"] / prep["cpu_seconds"],
        "input_mb_per_s": sum(i["bytes"] for i in manifest["inputs"]) / seconds / 1e6,
        "layout": re.search(r"^tokenizer\s+(.*)$", prep["stdout"], re.M).group(1),  # who tokenized, as the summary says
        "phases": phases, "outside_loop_seconds": seconds - phases["tokenizing"],
    }


# The steps of a prepare_data.py run in the order they run (its summary shows the backend check and the
# tokenizing loop above the others, which it lists under "the rest"; a run without a check lists "backend" there).
_STEPS = ("inputs", "tokenizer", "output", "fast backend", "workers", "backend check", "backend", "resume", "tokenizing", "manifests", "stop workers",
          "validate")


def _phases(summary: str, prepare_seconds: float) -> dict[str, float]:
    """Where the wall time of prepare + validate went, in order, from prepare_data.py's `time` lines:
    the Python start, imports and exit (the process's wall time less the run's own), each step of the
    run (start-up, the backend check, the tokenizing loop, the manifests, the final validation)."""
    times = summary[summary.index("\ntime "):]  # the summary's last lines
    total = float(re.search(r"^time\s+([\d.,]+) s in all$", times, re.M).group(1).replace(",", ""))
    # "of which ..." is inside the step above it (the backend check beside the tokenizing): not a step of its own.
    steps = {m.group(1): float(m.group(2).replace(",", "")) for m in re.finditer(r"^ {2,4}(\S.*?)\s+([\d.,]+) s", times, re.M)
             if not m.group(1).startswith("of which")}
    steps.pop("the rest", None)
    phases = {"python, imports, exit": max(prepare_seconds - total, 0.0)}
    phases |= {k: steps.pop(k) for k in _STEPS if k in steps} | steps  # a step this list lacks still shows, last
    return phases


def format_phases(r: dict) -> str:
    """One line: where a prepare + validate run's wall time went (`_phases`), and all but the loop together."""
    steps = ", ".join(f"{k} {v:.3f}" for k, v in r["phases"].items())
    return f"--workers {r['workers']} phases (wall s): {steps}; outside the tokenizing loop {r['outside_loop_seconds']:.3f} s of {r['seconds']:.3f}"


def measure_stages(tokenizer: Path, corpus: Path, output: Path) -> dict:
    """Where one worker's time goes on the fast path: read+split, JSON parse, tokenize, EOS/dtype, write+hash."""
    from olmo_ds.data import shards
    from olmo_ds.data.prepare import readers
    from olmo_ds.data.prepare.worker import append_eos
    from olmo_ds.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer, backend="fast")
    tok.split_special_tokens = True  # as prepare_data.py encodes document text by default
    dtype = shards.dtype_for_vocab(tok.vocab_size)
    shutil.rmtree(output, ignore_errors=True)
    output.mkdir(parents=True)
    writer = shards.ShardedWriter(output, 100_000_000, vocab_size=tok.vocab_size, eos_id=tok.eos_id)
    t = dict.fromkeys(("read", "parse", "tokenize", "assemble", "write"), 0.0)
    clock = time.process_time
    for f in sorted(corpus.glob("part-*.jsonl")):
        c = clock()
        for first_line, data, _ in readers.iter_chunks(f):
            c1 = clock()
            t["read"] += c1 - c
            texts = [x for _, x, _ in readers.parse_chunk(data, first_line, False) if x is not None]
            c2 = clock()
            ids, offsets = tok.encode_batch_flat(texts)
            c3 = clock()
            tokens, lens = append_eos(ids, offsets, tok.eos_id, dtype)
            c4 = clock()
            writer.add(tokens, lens)
            c = clock()
            t["parse"] += c2 - c1
            t["tokenize"] += c3 - c2
            t["assemble"] += c4 - c3
            t["write"] += c - c4
    c = clock()
    writer.finish()
    t["write"] += clock() - c
    total = sum(t.values())
    return {k: {"cpu_seconds": v, "share": v / total} for k, v in t.items()}


def measure_decompression(corpus: Path, directory: Path, files: int = 2) -> dict:
    """MB/s of output of one decompressing stream, as the main process reads compressed inputs:
    gzip through python-isal (what `readers.open_binary` uses) and through Python's `gzip`, and zstd,
    on the first `files` corpus files compressed at the tools' default levels."""
    import zstandard

    from olmo_ds.data.prepare import readers

    directory.mkdir(parents=True, exist_ok=True)
    data = b"".join(p.read_bytes() for p in sorted(corpus.glob("part-*.jsonl"))[:files])
    (directory / "c.jsonl.gz").write_bytes(gzip.compress(data, compresslevel=6))
    (directory / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))

    def rate(open_stream) -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            with open_stream() as f:
                n = sum(len(b) for b in iter(lambda: f.read(1 << 20), b""))
            best = min(best, time.perf_counter() - t0)
        assert n == len(data)
        return n / best / 1e6

    return {
        "mb": len(data) / 1e6,
        "gzip_isal_mb_per_s": rate(lambda: readers.open_binary(directory / "c.jsonl.gz")[0]),
        "gzip_stdlib_mb_per_s": rate(lambda: gzip.GzipFile(directory / "c.jsonl.gz", "rb")),
        "zstd_mb_per_s": rate(lambda: readers.open_binary(directory / "c.jsonl.zst")[0]),
    }


def big_file(corpus: Path, directory: Path, size_mb: int) -> Path:
    """One JSON-lines file of `size_mb` MB: the corpus's lines over and over (memory, not speed, is
    measured on it, so repeats do not matter); reused when present."""
    path = Path(directory) / f"big-{size_mb}mb.jsonl"
    if path.exists() and path.stat().st_size >= size_mb * 1_000_000:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    parts = sorted(corpus.glob("part-*.jsonl"))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as out:
        while out.tell() < size_mb * 1_000_000:
            for part in parts:
                out.write(part.read_bytes())
                if out.tell() >= size_mb * 1_000_000:
                    break
    os.replace(tmp, path)
    return path


def measure_memory_over_time(tokenizer: Path, path: Path, output: Path, workers: int, backend: str = "fast") -> dict:
    """`prepare_data.py` on one big file, sampling every process's RSS as it runs: a streaming
    pipeline's memory must not grow with the file, so each process's RSS in the last quarter of the
    run should equal that in the first."""
    import psutil

    cmd = [sys.executable, "-m", "olmo_ds.cli.prepare_data", "--input", str(path), "--output", str(output),
           "--tokenizer", str(tokenizer), "--workers", str(workers), "--overwrite", "--no-progress", "--tokenizer-backend", backend]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=package_env())
    main = psutil.Process(proc.pid)
    samples: dict[int, list[tuple[float, float]]] = {}
    while proc.poll() is None:
        try:
            family = [main, *main.children()]
        except psutil.NoSuchProcess:
            break
        for p in family:
            try:
                samples.setdefault(p.pid, []).append((time.perf_counter() - t0, p.memory_info().rss / 2**20))
            except psutil.NoSuchProcess:
                pass
        time.sleep(0.05)
    out = proc.stdout.read().decode()
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out}")
    seconds = time.perf_counter() - t0
    # Quarters of the tokenizing loop: from when the workers exist to the end (start-up excluded).
    workers_start = min((s[0][0] for pid, s in samples.items() if pid != proc.pid), default=0.0)
    rows = {}
    for i, (pid, s) in enumerate(sorted(samples.items(), key=lambda kv: kv[0] != proc.pid)):
        span = [r for t, r in s if t >= workers_start]
        q = len(span) // 4
        rows["main" if pid == proc.pid else f"worker {i}"] = {
            "quarters_mb": [max(span[k * q : (k + 1) * q]) for k in range(4)] if q else None, "peak_mb": max(r for _, r in s),
        }
    manifest = json.loads((Path(output) / "manifest.json").read_text())
    shutil.rmtree(output, ignore_errors=True)
    return {"file_mb": path.stat().st_size / 1e6, "workers": workers, "seconds": seconds, "tokens": manifest["num_tokens"], "rss": rows}


def run(tokenizer: Path, corpus_dir: Path, size_mb: int, workers: list[int], backends: list[str], log=print, big_file_mb: int = 0, repeats: int = 1,
        extra_text: Path | None = None) -> dict:
    # The corpus, the big file and the outputs in separate directories: prepare_data.py reads its
    # input directory recursively, so anything else left there would be tokenized too.
    corpus = corpus_dir / "corpus"
    # Generated in a child process: this one must stay small, because Linux counts a parent's memory
    # at fork time in the peak RSS (ru_maxrss) of every child it starts, so the prepare runs timed
    # below would report this process's size instead of their own.
    gen = mp.get_context("fork").Process(target=generate_corpus, args=(corpus, size_mb), kwargs={"extra_text": extra_text})
    gen.start()
    gen.join()
    if gen.exitcode != 0:
        raise RuntimeError(f"generating the corpus in {corpus} failed (exit code {gen.exitcode})")
    mb = sum(f.stat().st_size for f in corpus.glob("part-*.jsonl")) / 1e6
    log(f"corpus: {corpus} ({mb:,.0f} MB of JSON lines), tokenizer: {tokenizer}, cpus: {os.cpu_count()}")
    results = {"corpus_mb": mb, "tokenizer": str(tokenizer), "ceiling": {}, "prepare": []}
    for backend in backends:
        c = results["ceiling"][backend] = measure_ceiling(tokenizer, corpus, backend)
        log(f"ceiling {backend:4s} (1 thread, texts in memory): {c['tokens_per_s'] / 1e6:.3f}M tokens/s wall, {c['tokens_per_cpu_s'] / 1e6:.3f}M per CPU-s, {c['mb_per_s']:.1f} MB/s")
    if "fast" in backends and max(workers) > 1:
        n = max(workers)
        t = results["ceiling_together"] = measure_ceiling_together(tokenizer, corpus, "fast", n)
        t["over_one"] = t["tokens_per_s"] / results["ceiling"]["fast"]["tokens_per_s"]
        log(f"ceiling fast, {n} processes at once: {t['tokens_per_s'] / 1e6:.3f}M tokens/s together = {t['over_one']:.2f}x one "
            f"(what {n} independent tokenizers get from this machine: the bound on {n} workers over 1)")
    for backend in backends:
        for w in workers:
            # The fastest of `repeats` runs: a shared machine only ever makes a run slower.
            r = min((measure_prepare(tokenizer, corpus, corpus_dir / f"shards-{backend}-w{w}", w, backend) for _ in range(repeats)), key=lambda r: r["seconds"])
            c = results["ceiling"][backend]
            if r["tokens"] != c["tokens"] + r["docs"]:  # every kept document's ids plus its EOS, nothing else
                raise RuntimeError(f"prepare_data.py wrote {r['tokens']:,} tokens for {r['docs']:,} documents; the ceiling run encoded {c['tokens']:,}")
            r["vs_ceiling"] = r["tokens_per_s"] / c["tokens_per_s"]
            results["prepare"].append(r)
            log(
                f"prepare+validate {backend:4s} --workers {w}: {r['seconds']:.1f} s ({r['prepare_seconds']:.1f} + {r['validate_seconds']:.1f}), "
                f"{r['tokens_per_s'] / 1e6:.3f}M tokens/s, {r['input_mb_per_s']:.1f} MB/s, {r['tokens_per_cpu_s'] / 1e6:.3f}M per CPU-s, "
                f"{r['loop_tokens_per_s'] / 1e6:.3f}M tokens/s without start-up, peak RSS prepare {r['prepare_peak_rss_mb']:.0f} MB / validate {r['validate_peak_rss_mb']:.0f} MB, "
                f"{r['vs_ceiling']:.2f}x its ceiling"
            )
            log(format_phases(r))
    by = {(r["backend"], r["workers"]): r for r in results["prepare"]}
    for backend in backends:
        if (backend, 1) in by and (backend, 2) in by:
            results[f"scaling_{backend}_2_over_1"] = s = by[backend, 2]["tokens_per_s"] / by[backend, 1]["tokens_per_s"]
            results[f"scaling_{backend}_2_over_1_steady"] = ss = by[backend, 2]["loop_tokens_per_s"] / by[backend, 1]["loop_tokens_per_s"]
            log(f"{backend}: 2 workers / 1 worker = {ss:.2f}x tokenizing (target >= 1.7), {s:.2f}x end to end with start-up and validation; 1 worker / ceiling = {by[backend, 1]['vs_ceiling']:.2f}")
    if ("fast", 1) in by and "hf" in results["ceiling"]:
        results["fast_1_worker_over_hf_ceiling"] = x = by["fast", 1]["tokens_per_s"] / results["ceiling"]["hf"]["tokens_per_s"]
        log(f"fast, 1 worker, end to end / HF encode_batch_fast ceiling = {x:.1f}x (target >= 6)")
    if "fast" in backends:
        results["stages_fast_1_worker"] = st = measure_stages(tokenizer, corpus, corpus_dir / "shards-stages")
        log("fast path, one worker, CPU share: " + ", ".join(f"{k} {v['share']:.0%}" for k, v in st.items()))
    d = results["decompression"] = measure_decompression(corpus, corpus_dir / "compressed")
    log(f"decompressing one stream ({d['mb']:.0f} MB of JSON lines), MB/s of output: gzip via python-isal {d['gzip_isal_mb_per_s']:,.0f}, "
        f"via Python's gzip {d['gzip_stdlib_mb_per_s']:,.0f}; zstd {d['zstd_mb_per_s']:,.0f}")
    if big_file_mb:
        path = big_file(corpus, corpus_dir / "big", big_file_mb)
        backend = "fast" if "fast" in backends else backends[0]
        m = results["memory_over_time"] = measure_memory_over_time(tokenizer, path, corpus_dir / "shards-big", max(workers), backend)
        log(f"memory on one {m['file_mb']:,.0f} MB file, --workers {m['workers']}, {m['tokens'] / 1e6:,.0f}M tokens in {m['seconds']:.1f} s: RSS (MB) by quarter of the run")
        for name, r in m["rss"].items():
            log(f"  {name:<10}" + "".join(f"{x:>8.0f}" for x in r["quarters_mb"] or []) + f"   peak {r['peak_mb']:.0f}")
        # Speed on the big file too, where start-up and validation weigh less than on the corpus.
        rows = results["big_file_prepare"] = [measure_prepare(tokenizer, path.parent, corpus_dir / f"shards-big-{w}", w, backend)
                                              for w in workers]
        for r in rows:
            log(f"big file, --workers {r['workers']}: prepare {r['prepare_seconds']:.1f} s + validate {r['validate_seconds']:.1f} s, "
                f"{r['tokens_per_s'] / 1e6:.2f}M tokens/s end to end ({r['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}x), "
                f"{r['loop_tokens_per_s'] / 1e6:.2f}M without start-up ({r['loop_tokens_per_s'] / rows[0]['loop_tokens_per_s']:.2f}x)")
    return results


# ---------------------------------------------------------------------------------------------
# Many files: a corpus of .json.gz files, prepared whole-file by many workers.


def _varied(doc: str, k: int) -> str:
    """The document with its lines (a one-line document: its words) rotated by k: the same words
    in another text, so no document of the corpus is another's copy."""
    sep = "\n" if "\n" in doc else " "
    parts = doc.split(sep)
    k %= len(parts)
    return sep.join(parts[k:] + parts[:k]) if k else doc


_POOL: list[str] = []  # the distinct documents, inherited by the forked writers


def _write_gz(args: tuple[Path, int, int]) -> tuple[int, int]:
    """One .json.gz file of about `gz_bytes` on disk: the pool's documents in a file-own order, each
    rotated by a file-own amount; returns (bytes on disk, bytes of JSON lines)."""
    path, seed, gz_bytes = args
    rng = random.Random(seed)
    order = list(range(len(_POOL)))
    rng.shuffle(order)
    # gzip level 1: 5x faster to write than the default 6 (which would hold ~25 % more text per byte
    # on disk); reading costs the same per byte of text either way.
    comp = zlib.compressobj(1, zlib.DEFLATED, 31)
    tmp = path.with_suffix(".tmp")
    text = 0
    with open(tmp, "wb") as f:
        i = 0
        while f.tell() < gz_bytes:
            batch = b"".join(orjson.dumps({"text": _varied(_POOL[order[j % len(order)]], rng.randrange(1 << 20))}) + b"\n" for j in range(i, i + 256))
            i += 256
            text += len(batch)
            f.write(comp.compress(batch))
        f.write(comp.flush())
    os.replace(tmp, path)
    return path.stat().st_size, text


def generate_gz_corpus(directory: Path, gz_mb: int, files: int, pool_mb: int, extra_text: Path | None = None) -> Path:
    """`files` .json.gz files of `gz_mb` MB together, written in parallel (one process per core):
    every file draws from one pool of `pool_mb` MB of distinct real documents (`_unique_documents`),
    in its own order and with its own rotation of each document's lines (`_varied`), so the
    tokenizer sees real text and no file repeats another. Reused when present."""
    directory = Path(directory)
    marker = directory / f"corpus-{gz_mb}mb-{files}files.done"
    if not _fresh(directory, marker, "*"):
        return directory
    global _POOL
    _POOL = _unique_documents(pool_mb * 1_000_000, extra_text)
    with mp.get_context("fork").Pool(os.cpu_count()) as pool:
        sizes = pool.map(_write_gz, [(directory / f"part-{i:04d}.json.gz", i, gz_mb * 1_000_000 // files) for i in range(files)], chunksize=1)
    (directory / "corpus.json").write_text(json.dumps({"gz_bytes": sum(s for s, _ in sizes), "text_bytes": sum(t for _, t in sizes), "files": files,
                                                      "pool_docs": len(_POOL), "pool_bytes": sum(len(d.encode()) for d in _POOL)}))
    marker.touch()
    return directory


def measure_files_ceiling(tokenizer: Path, groups: list[list[Path]]) -> dict:
    """One process per group of files, all at once: each loads its tokenizer, reads its files
    (decompressing and parsing) and then encodes the texts, timed apart. Throughput is the sum over
    the processes of tokens over encode seconds (fastokens alone), and of tokens over read + encode
    seconds (a whole job without coordination or output)."""
    runs = _run_together([[sys.executable, "-m", PROBES, "files-ceiling", str(tokenizer), *map(str, g)] for g in groups])
    return {
        "processes": len(groups), "tokens": sum(r["tokens"] for r in runs), "docs": sum(r["docs"] for r in runs),
        "tokens_per_s": sum(r["tokens"] / r["seconds"] for r in runs),
        "read_and_encode_tokens_per_s": sum(r["tokens"] / (r["read_seconds"] + r["seconds"]) for r in runs),
        "slowest_seconds": max(r["seconds"] for r in runs), "itemsize": runs[0]["itemsize"],
    }


def measure_disk_floor(directory: Path, nbytes: int, n: int) -> dict:
    """`n` processes at once, each writing and fsyncing its share of `nbytes` to its own file in
    `directory` (written in 16 MB steps, each handed to the disk at once, as the shard writers do):
    the least time in which this disk takes prepare's output, read nowhere near the CPU."""
    directory.mkdir(parents=True, exist_ok=True)
    start_at = time.time() + 1.0  # after every writer has started and imported (a late one only makes the span longer)
    runs = _run_together([[sys.executable, "-m", PROBES, "write", str(directory / f"write-{i:02d}.tmp"), str(nbytes // n), str(start_at)]
                          for i in range(n)])
    seconds = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    return {"processes": n, "bytes": nbytes // n * n, "seconds": seconds, "bytes_per_s": nbytes // n * n / seconds}


def measure_independent(tokenizer: Path, corpus: Path, directory: Path, n: int) -> dict:
    """`n` independent jobs at once, job i `prepare_data.py --partition i/n --workers 1` (its share
    of the files, in blocks, writing each shard once, validating it at the end) on its
    part: what `n` processes that share nothing get from this machine, the realistic bound on `n`
    workers of one run. (One directory would need `merge_shards.py` besides, not counted.)"""
    runs: list = [None] * n

    def job(i: int) -> None:
        try:
            runs[i] = measure_prepare(tokenizer, corpus, directory / f"part-{i:02d}", 1, "fast", ("--partition", f"{i}/{n}"))
        except Exception as e:  # noqa: BLE001 - reported below, with the part
            runs[i] = e

    written = disk_written()
    threads = [threading.Thread(target=job, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    written = disk_written() - written if written is not None else None
    for i, r in enumerate(runs):
        if isinstance(r, Exception):
            raise RuntimeError(f"independent job {i}/{n} failed: {r}") from r
    seconds = max(r["ended"] for r in runs) - min(r["started"] for r in runs)
    tokens = sum(r["tokens"] for r in runs)
    shutil.rmtree(directory, ignore_errors=True)
    return {
        "jobs": n, "tokens": tokens, "docs": sum(r["docs"] for r in runs), "seconds": seconds,
        "prepare_seconds": max(r["started"] + r["prepare_seconds"] for r in runs) - min(r["started"] for r in runs),
        "tokens_per_s": tokens / seconds, "loop_tokens_per_s": sum(r["loop_tokens_per_s"] for r in runs),
        "output_bytes": sum(r["output_bytes"] for r in runs), "disk_written": written, "parts": runs,
    }


def same_output(a: Path, b: Path) -> tuple[bool, str]:
    """Whether two validated output directories are the same bytes: every file but the `.bin`s
    compared byte for byte (offsets, every shard's metadata with its sha256, manifests, val/,
    .prepare.json, each shard's check record), and the `.bin`s by size, their sha256 being the metadata's (the process
    that wrote each read it back and checked it, and prepare_data.py's final validation held that record to the
    metadata). Reading 2 x 7 GB once more would double validation's time."""
    files = lambda d: {str(p.relative_to(d)): p for p in sorted(d.rglob("*")) if p.is_file()}  # noqa: E731
    fa, fb = files(a), files(b)
    if set(fa) != set(fb):
        return False, f"different files: {sorted(set(fa) ^ set(fb))[:5]}"
    for name, p in fa.items():
        if name.endswith(".bin"):
            if p.stat().st_size != fb[name].stat().st_size:
                return False, f"{name}: sizes differ"
        elif p.read_bytes() != fb[name].read_bytes():
            return False, f"{name} differs"
    return True, f"{len(fa)} files, {sum(n.endswith('.bin') for n in fa)} shards"


def run_many_files(tokenizer: Path, directory: Path, gz_mb: int, files: int, workers: list[int], pool_mb: int, log=print,
                   extra_text: Path | None = None, keep: bool = False) -> dict:
    """The corpus-scale case, in one call: a corpus of many .json.gz files, `prepare_data.py` (to
    validated shards) at each worker count (the most in whole-file mode, 1 worker in blocks: the
    defaults), against three bounds for n = the most workers: n independent fastokens processes
    (the tokenizer's), n processes writing and fsyncing the output's bytes (the disk's), and n
    independent single-worker prepare + validate jobs on 1/n of the files each (what n processes
    that share nothing get). Each step starts with nothing left dirty by the one before."""
    t0 = time.perf_counter()
    corpus = directory / "corpus-gz"
    gen = mp.get_context("fork").Process(target=generate_gz_corpus, args=(corpus, gz_mb, files, pool_mb), kwargs={"extra_text": extra_text})
    gen.start()
    gen.join()
    if gen.exitcode != 0:
        raise RuntimeError(f"generating the corpus in {corpus} failed (exit code {gen.exitcode})")
    info = json.loads((corpus / "corpus.json").read_text())
    log(f"corpus: {corpus}: {info['files']} .json.gz files, {info['gz_bytes'] / 1e9:.2f} GB on disk, {info['text_bytes'] / 1e9:.2f} GB of JSON lines "
        f"(from {info['pool_bytes'] / 1e6:.0f} MB of distinct documents), made in {time.perf_counter() - t0:.0f} s; cpus: {os.cpu_count()}")
    paths = sorted(corpus.glob("*.json.gz"))
    n = max(workers)
    groups = [paths[k::n] for k in range(n)]
    results = {"corpus": info, "tokenizer": str(tokenizer), "workers": workers}
    os.sync()  # a corpus just written goes to disk now, not while the first measure runs
    one = results["ceiling_1"] = measure_files_ceiling(tokenizer, groups[:1])
    log(f"fastokens, 1 process on 1/{n} of the files: {one['tokens_per_s'] / 1e6:.1f}M tokens/s encoding, {one['read_and_encode_tokens_per_s'] / 1e6:.1f}M with reading")
    many = results[f"ceiling_{n}"] = measure_files_ceiling(tokenizer, groups)
    log(f"fastokens, {n} processes at once, 1/{n} of the files each: {many['tokens_per_s'] / 1e6:.1f}M tokens/s encoding "
        f"({many['tokens_per_s'] / one['tokens_per_s']:.2f}x one), {many['read_and_encode_tokens_per_s'] / 1e6:.1f}M with reading")
    out_tokens = many["tokens"] + many["docs"]  # every document's ids and its EOS
    os.sync()
    disk = results["disk"] = measure_disk_floor(directory / "disk-floor", out_tokens * many["itemsize"] + many["docs"] * 8, n)  # ids and document offsets
    disk["tokens_per_s"] = out_tokens / disk["seconds"]
    log(f"write + fsync of the output's {disk['bytes'] / 1e9:.2f} GB, {n} processes at once: {disk['seconds']:.1f} s, {disk['bytes_per_s'] / 1e9:.2f} GB/s, "
        f"so at most {disk['tokens_per_s'] / 1e6:.1f}M tokens/s whatever the CPUs do")
    os.sync()
    ind = results["independent"] = measure_independent(tokenizer, corpus, directory / "independent", n)
    if ind["tokens"] != out_tokens:
        raise RuntimeError(f"the {n} independent jobs wrote {ind['tokens']:,} tokens; the ceiling runs encoded {many['tokens']:,} in {many['docs']:,} documents")
    log(f"{n} independent prepare + validate jobs (--partition i/{n} --workers 1) at once: {ind['seconds']:.1f} s (prepare {ind['prepare_seconds']:.1f}), "
        f"{ind['tokens_per_s'] / 1e6:.1f}M tokens/s end to end, {ind['loop_tokens_per_s'] / 1e6:.1f}M without start-up; {_written(ind['disk_written'], ind['output_bytes'])}")
    runs = results["prepare"] = []
    for w in workers:
        out = directory / f"shards-w{w}"
        os.sync()
        r = measure_prepare(tokenizer, corpus, out, w, "fast")
        if r["tokens"] != out_tokens:
            raise RuntimeError(f"prepare_data.py --workers {w} wrote {r['tokens']:,} tokens for {r['docs']:,} documents; the ceiling runs encoded {many['tokens']:,}")
        runs.append(r)
        log(f"prepare+validate --workers {w}: {r['seconds']:.1f} s ({r['prepare_seconds']:.1f} + {r['validate_seconds']:.1f}), "
            f"{r['tokens_per_s'] / 1e6:.1f}M tokens/s end to end, {r['loop_tokens_per_s'] / 1e6:.1f}M without start-up; {r['layout']}; "
            f"prepare kept {r['prepare_cores_busy']:.1f} cores busy on average ({r['prepare_sys_share']:.0%} of it in the kernel); "
            f"{_written(r['prepare_disk_written'], r['output_bytes'])}")
        log(format_phases(r))
    first = directory / f"shards-w{workers[0]}"
    for w in workers[1:]:
        ok, what = same_output(first, directory / f"shards-w{w}")
        results.setdefault("identical", {})[w] = ok
        results["identical_what"] = what
        log(f"--workers {w} output == --workers {workers[0]} output: {'yes' if ok else 'NO'} ({what})")
    if not keep:
        for w in workers:
            shutil.rmtree(directory / f"shards-w{w}", ignore_errors=True)
    base, top = runs[0], runs[-1]
    log("")
    log(f"| {info['files']} .json.gz files, {info['gz_bytes'] / 1e9:.2f} GB ({info['text_bytes'] / 1e9:.2f} GB of text, {base['tokens'] / 1e9:.2f}G tokens) "
        f"| seconds | end to end | without start-up |")
    log("|---|---|---|---|")
    log(f"| fastokens alone, 1 process, 1/{n} of the files in memory | {one['slowest_seconds']:.1f} | — | {one['tokens_per_s'] / 1e6:.1f}M |")
    log(f"| fastokens alone, {n} processes at once | {many['slowest_seconds']:.1f} | — | {many['tokens_per_s'] / 1e6:.1f}M ({many['tokens_per_s'] / one['tokens_per_s']:.2f}x) |")
    log(f"| read + parse + fastokens, {n} processes at once, no output | — | — | {many['read_and_encode_tokens_per_s'] / 1e6:.1f}M |")
    log(f"| write + fsync of the output's {disk['bytes'] / 1e9:.2f} GB, {n} processes at once (the disk's bound) | {disk['seconds']:.1f} | — | "
        f"{disk['tokens_per_s'] / 1e6:.1f}M ({disk['bytes_per_s'] / 1e9:.2f} GB/s) |")
    log(f"| {n} independent prepare + validate jobs, `--partition i/{n} --workers 1`, at once | {ind['seconds']:.1f} | {ind['tokens_per_s'] / 1e6:.1f}M | "
        f"{ind['loop_tokens_per_s'] / 1e6:.1f}M |")
    for r in runs:
        log(f"| prepare + validate, --workers {r['workers']} | {r['prepare_seconds']:.1f} + {r['validate_seconds']:.1f} | "
            f"{r['tokens_per_s'] / 1e6:.1f}M ({r['tokens_per_s'] / base['tokens_per_s']:.2f}x) | {r['loop_tokens_per_s'] / 1e6:.1f}M ({r['loop_tokens_per_s'] / base['loop_tokens_per_s']:.2f}x) |")
    results["end_to_end_over_1"] = e2e = top["tokens_per_s"] / base["tokens_per_s"]
    results["over_independent"] = ind_fast = top["loop_tokens_per_s"] / many["tokens_per_s"]
    results["over_read_and_encode"] = ind_read = top["loop_tokens_per_s"] / many["read_and_encode_tokens_per_s"]
    results["over_independent_jobs"] = ind_jobs = top["loop_tokens_per_s"] / ind["loop_tokens_per_s"]
    results["end_to_end_over_independent_jobs"] = ind_e2e = top["tokens_per_s"] / ind["tokens_per_s"]
    results["disk_over_independent"] = disk_share = disk["tokens_per_s"] / many["tokens_per_s"]
    results["scaling_over_machine"] = sc = (top["loop_tokens_per_s"] / base["loop_tokens_per_s"]) / (many["tokens_per_s"] / one["tokens_per_s"])
    identical = all(results.get("identical", {}).values())
    log(f"--workers {top['workers']} / --workers {base['workers']}, end to end: {e2e:.2f}x (target >= 8), without start-up "
        f"{top['loop_tokens_per_s'] / base['loop_tokens_per_s']:.2f}x = {sc:.2f} of the machine's {n}-over-1 for fastokens; identical output: "
        f"{'yes' if identical else 'NO'}{' (' + results['identical_what'] + ')' if 'identical_what' in results else ''}")
    log(f"--workers {top['workers']} without start-up / {n} independent fastokens processes: {ind_fast:.2f} (target >= 0.8); "
        f"/ {n} independent read + parse + fastokens processes: {ind_read:.2f}; / {n} independent prepare jobs: {ind_jobs:.2f} (end to end: {ind_e2e:.2f})")
    log(f"the disk: {n} writers wrote + fsynced the output at {disk['bytes_per_s'] / 1e9:.2f} GB/s, so no run can pass {disk['tokens_per_s'] / 1e6:.1f}M tokens/s = "
        f"{disk_share:.2f} of the {n} fastokens processes (0.8 of them needs {0.8 * many['tokens_per_s'] * disk['bytes'] / out_tokens / 1e9:.2f} GB/s); "
        f"whole call {time.perf_counter() - t0:.0f} s")
    return results


def _written(written: int | None, output: int) -> str:
    if written is None:
        return "no disk write count here"
    return f"{written / 1e9:.2f} GB written to disk meanwhile, for {output / 1e9:.2f} GB of output"


def measure_long_document(tokenizer: Path, directory: Path, mb: int, backends: list[str], extra_text: Path | None = None, log=print) -> dict:
    """Peak RSS of `prepare_data.py --workers 1` on one JSON line holding one document of `mb` MB
    (distinct real text joined by blank lines), per backend, each in a fresh process: a document is
    never cut by the reader, so this is what the tokenizer holds for it (`prepare/long_docs.py`)."""
    path = Path(directory) / "long-document" / f"doc-{mb}mb.jsonl"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "\n\n".join(_unique_documents(mb * 1_000_000, extra_text))
        path.write_bytes(orjson.dumps({"text": text[: mb * 1_000_000]}) + b"\n")
    results = {}
    for backend in backends:
        out = path.parent / f"shards-{backend}"
        shutil.rmtree(out, ignore_errors=True)
        r = _timed([sys.executable, "-m", "olmo_ds.cli.prepare_data", "--input", str(path), "--output", str(out), "--tokenizer", str(tokenizer),
                    "--tokenizer-backend", backend, "--no-progress"])
        tokens = json.loads((out / "manifest.json").read_text())["num_tokens"]
        results[backend] = {"mb": mb, "tokens": tokens, "seconds": r["seconds"], "peak_rss_mb": r["peak_rss_mb"]}
        log(f"one {mb} MB document, {backend}: {tokens:,} tokens in {r['seconds']:.1f} s, peak RSS {r['peak_rss_mb']:,.0f} MB")
        shutil.rmtree(out, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", default="allenai/dolma2-tokenizer", help="tokenizer.json, or a hub id from the HF cache (default: OLMo 2/3's)")
    p.add_argument("--extra-text", type=Path, default=None, help="a directory of .json.gz web text to put first in the corpus (the measured runs used ../shared/data/c4-sample)")
    p.add_argument("--dir", type=Path, default=Path("data/bench-prepare"), help="where the generated corpus and the shards go (corpus reused when present)")
    p.add_argument("--size-mb", type=int, default=256, help="size of the generated corpus (default: 256)")
    p.add_argument("--workers", type=int, nargs="+", default=None, help="worker counts (default: 1 2; with --many-files: 1 and this machine's cores)")
    p.add_argument("--backends", nargs="+", choices=("hf", "fast"), default=["hf", "fast"])
    p.add_argument("--repeats", type=int, default=1, help="run each prepare this many times and keep the fastest (default: 1)")
    p.add_argument("--big-file-mb", type=int, default=0, help="also run on one file of this many MB: each process's RSS over time at the most workers, and prepare+validate at every worker count (0: skip)")
    p.add_argument("--many-files", action="store_true", help="instead: a corpus of --gz-mb of .json.gz in --files files, prepare+validate at each --workers "
                   "(the most in whole-file mode) and as many independent fastokens processes, fast backend; prints a table last")
    p.add_argument("--gz-mb", type=int, default=2048, help="--many-files: MB of .json.gz to generate (default: 2048)")
    p.add_argument("--files", type=int, default=128, help="--many-files: number of files (default: 128)")
    p.add_argument("--pool-mb", type=int, default=128, help="--many-files: MB of distinct documents the files draw from (default: 128)")
    p.add_argument("--keep", action="store_true", help="--many-files: keep the shard directories (default: deleted after the comparison)")
    p.add_argument("--long-document-mb", type=int, default=0, help="instead: peak RSS of prepare_data.py on one document of this many MB on one line, per --backends")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    a = p.parse_args(argv)
    try:
        tokenizer = hub.resolve_file(a.tokenizer, "tokenizer.json", what="--tokenizer").resolve()
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.long_document_mb:
        results = measure_long_document(tokenizer, a.dir, a.long_document_mb, a.backends, extra_text=a.extra_text)
    elif a.many_files:
        workers = a.workers or [1, os.cpu_count() or 1]
        results = run_many_files(tokenizer, a.dir, a.gz_mb, a.files, workers, a.pool_mb, extra_text=a.extra_text, keep=a.keep)
    else:
        results = run(tokenizer, a.dir, a.size_mb, a.workers or [1, 2], a.backends, big_file_mb=a.big_file_mb, repeats=a.repeats, extra_text=a.extra_text)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
