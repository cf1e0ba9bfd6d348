"""An embedded sample corpus: text every Python installation carries, so the demo needs no download.

Documents are the docstrings of the standard library's modules, classes and functions (English
prose) and the source of its modules (code), read in sorted path order so that the corpus is the
same on every run with the same Python.
"""

from __future__ import annotations

import ast
import gzip
import json
import sysconfig
import warnings
from pathlib import Path


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip", "__pycache__"}
    return sorted(p for p in root.rglob("*.py") if not skip.intersection(p.relative_to(root).parts))


def _docstrings(tree: ast.AST) -> list[str]:
    docs = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node)
            if doc and len(doc) >= 80:
                docs.append(doc)
    return docs


def write_sample_corpus(out_dir: Path, max_bytes: int = 4_000_000) -> dict:
    """Write `prose.jsonl` (docstrings) and `code.jsonl.gz` (module sources) under `out_dir`.

    Each file gets about half of `max_bytes` of text. Returns counts per file.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    budget = max_bytes // 2
    prose, code = [], []
    prose_bytes = code_bytes = 0
    for path in _stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # old escape sequences in some stdlib files
                tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        if prose_bytes < budget:
            for doc in _docstrings(tree):
                prose.append(doc)
                prose_bytes += len(doc.encode())
        if code_bytes < budget and len(source) < 200_000:
            code.append(source)
            code_bytes += len(source.encode())
        if prose_bytes >= budget and code_bytes >= budget:
            break
    with open(out_dir / "prose.jsonl", "w", encoding="utf-8") as f:
        for text in prose:
            f.write(json.dumps({"text": text}) + "\n")
    with gzip.open(out_dir / "code.jsonl.gz", "wt", encoding="utf-8") as f:
        for text in code:
            f.write(json.dumps({"text": text}) + "\n")
    return {"prose.jsonl": (len(prose), prose_bytes), "code.jsonl.gz": (len(code), code_bytes)}
