"""The programs `bench_prepare` times in fresh processes, each printing one line of JSON:

    python -m olmo_ds.tools.prepare_probes ceiling TOKENIZER CORPUS_DIR {hf,fast}
    python -m olmo_ds.tools.prepare_probes files-ceiling TOKENIZER FILE...
    python -m olmo_ds.tools.prepare_probes write PATH NBYTES START_AT

A fresh process each, so that one run's memory, caches and threads cannot flatter or slow the next,
and so that many can run at once as independent processes (`bench_prepare._run_together`).

The package's imports are made inside each probe, not at the top: `files-ceiling` times its own
start-up (importing the readers and the tokenizer, loading it), and `write` must be ready to write
at `START_AT` however many writers start at once, without importing a tokenizer it never uses.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def encode_corpus(tokenizer: str, corpus: str, backend: str) -> dict:
    """The encoder alone on one thread over the corpus's `part-*.jsonl` texts, already in memory."""
    import orjson

    from olmo_ds.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer, backend=backend)  # the fast backend pins itself to one thread
    tok.split_special_tokens = True  # special-token strings in a document are text, as prepare_data.py encodes them by default
    texts = []
    for f in sorted(Path(corpus).glob("part-*.jsonl")):
        with open(f, "rb") as fh:
            texts += [orjson.loads(line)["text"] for line in fh]
    nbytes = sum(len(t.encode()) for t in texts)
    t0 = time.perf_counter()
    c0 = time.process_time()
    n = 0
    for i in range(0, len(texts), 256):
        if backend == "hf":  # HF tokenizers' fastest batch call, as a user would write it
            n += sum(len(e.ids) for e in tok._tok.encode_batch_fast(texts[i:i + 256], add_special_tokens=False))
        else:
            n += len(tok.encode_batch_flat(texts[i:i + 256])[0])
    return {"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0, "tokens": n, "text_bytes": nbytes, "docs": len(texts)}


def read_and_encode_files(tokenizer: str, files: list[str]) -> dict:
    """Load the fast tokenizer, read the files (decompress and parse), then encode the texts; each timed apart."""
    t0 = time.perf_counter()  # from before the imports: a job's start-up, as the module docstring says
    from olmo_ds.data import shards
    from olmo_ds.data.prepare import readers
    from olmo_ds.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer, backend="fast")
    tok.split_special_tokens = True  # special-token strings in a document are text, as prepare_data.py encodes them by default
    t1 = time.perf_counter()
    texts = [t for f in files for t in readers.read_documents(f)]  # decompress and parse
    t2 = time.perf_counter()
    n = 0
    for i in range(0, len(texts), 256):
        n += len(tok.encode_batch_flat(texts[i:i + 256])[0])
    t3 = time.perf_counter()
    return {"load_tokenizer": t1 - t0, "read_seconds": t2 - t1, "seconds": t3 - t2, "tokens": n, "docs": len(texts),
            "itemsize": shards.dtype_for_vocab(tok.vocab_size).itemsize}


def write_file(path: str, nbytes: int, start_at: float) -> dict:
    """Write `nbytes` of random bytes to `path` in 16 MB steps, each handed to the disk at once (as the shard
    writers do), fsync, delete; starting at the wall-clock time `start_at`. Returns when it started and ended."""
    from olmo_ds.data.shards import start_writeback

    block = memoryview(os.urandom(16 << 20))  # random bytes: no filesystem can compress or skip them
    time.sleep(max(start_at - time.time(), 0))  # every writer starts at the same moment
    t0 = time.time()
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < nbytes:
            n = f.write(block[: nbytes - done])
            start_writeback(f.fileno(), done, n)  # as the shard writers do
            done += n
        os.fsync(f.fileno())
    t1 = time.time()
    os.unlink(path)
    return {"start": t0, "end": t1}


def main(argv: list[str] | None = None) -> int:
    # Before any tokenizer exists: each probe is one process on one thread.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="probe", required=True)
    c = sub.add_parser("ceiling", help="the encoder alone, one thread, the corpus's texts in memory")
    c.add_argument("tokenizer")
    c.add_argument("corpus")
    c.add_argument("backend", choices=("hf", "fast"))
    f = sub.add_parser("files-ceiling", help="load the fast tokenizer, read and parse the files, encode; each timed")
    f.add_argument("tokenizer")
    f.add_argument("files", nargs="+")
    w = sub.add_parser("write", help="write and fsync NBYTES to PATH from the wall-clock time START_AT")
    w.add_argument("path")
    w.add_argument("nbytes", type=int)
    w.add_argument("start_at", type=float)
    a = p.parse_args(argv)
    if a.probe == "ceiling":
        result = encode_corpus(a.tokenizer, a.corpus, a.backend)
    elif a.probe == "files-ceiling":
        result = read_and_encode_files(a.tokenizer, a.files)
    else:
        result = write_file(a.path, a.nbytes, a.start_at)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
