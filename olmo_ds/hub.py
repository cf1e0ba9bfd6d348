"""Files named by a local path or a Hugging Face hub id, resolved through the standard HF cache.

Tokenizers today, model weights and evaluation datasets next: anything a config or flag names may be a
path (`data/tokenizer.json`, `models/olmo2-1b/`) or a hub id (`allenai/dolma2-tokenizer`, optionally
`@revision`). A path that exists always wins. A hub id is looked up in the local cache first (the
cache huggingface_hub and transformers share: `HF_HUB_CACHE`, `HF_HOME`), so a filled cache works on
machines without network, such as compute nodes; only when the file is not cached and
`HF_HUB_OFFLINE` is not set is it downloaded. Otherwise the error names the one command that fetches
it, to run where there is network (the login node) with the same cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# org/name with an optional @revision; what huggingface_hub accepts as a repo id, minus a bare name
# (a bare word is far more likely a misspelt local file than a hub repo).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+))?$")
_FILE_SUFFIXES = (".json", ".model", ".safetensors", ".yaml", ".yml", ".gz", ".jsonl", ".txt", ".bin", ".npy")


class HubError(FileNotFoundError):
    """Neither a local path nor a cached (or downloadable) hub file; the message says how to fetch it."""


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo_id, revision) when `spec` reads as a hub id rather than a path, else None."""
    m = _HUB_ID.match(str(spec))
    if m is None or str(spec).startswith((".", "/")) or str(spec).lower().endswith(_FILE_SUFFIXES):
        return None
    return m.group("repo"), m.group("revision")


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def fetch_command(repo_id: str, filenames: list[str] | None = None, revision: str | None = None) -> str:
    """The command that puts these files into the HF cache (run it where there is network)."""
    parts = ["hf", "download", repo_id, *(filenames or [])]
    if revision:
        parts += ["--revision", revision]
    return " ".join(parts)


def resolve_file(spec: str | Path, filename: str, *, what: str = "") -> Path:
    """The local file that `spec` names: the path itself (a directory: `filename` inside it), or
    `filename` of hub repo `spec` from the HF cache (downloaded when allowed and not cached).

    `what` prefixes errors with the setting that named `spec`, e.g. "--init-from" (callers that wrap
    the error with their own context leave it empty).
    """
    path = Path(spec)
    if path.is_file():
        return path
    if path.is_dir():
        if (path / filename).is_file():
            return path / filename
        raise HubError(f"{_prefix(what)}directory {path} has no {filename}")
    hub = parse_hub_id(str(spec))
    if hub is None:
        raise HubError(f"{_prefix(what)}{spec} does not exist (and is not a Hugging Face hub id such as allenai/dolma2-tokenizer)")
    repo_id, revision = hub
    return Path(_download(repo_id, revision, filename, what=what, spec=str(spec)))


def resolve_snapshot(spec: str | Path, allow_patterns: list[str], *, what: str = "") -> Path:
    """A local directory for `spec`: the directory itself, or the cached snapshot of hub repo `spec`
    holding the files that match `allow_patterns` (downloaded when allowed and not cached)."""
    path = Path(spec)
    if path.is_dir():
        return path
    hub = parse_hub_id(str(spec))
    if hub is None:
        raise HubError(f"{_prefix(what)}{spec} does not exist (and is not a Hugging Face hub id such as allenai/OLMo-2-0425-1B)")
    repo_id, revision = hub
    from huggingface_hub import snapshot_download

    return Path(_cache_first(lambda local: snapshot_download(repo_id, revision=revision, allow_patterns=allow_patterns,
                                                             local_files_only=local),
                             what=what, spec=str(spec), repo_id=repo_id, revision=revision, files=None))


def _download(repo_id: str, revision: str | None, filename: str, *, what: str, spec: str) -> str:
    from huggingface_hub import hf_hub_download

    return _cache_first(lambda local: hf_hub_download(repo_id, filename, revision=revision, local_files_only=local),
                        what=what, spec=spec, repo_id=repo_id, revision=revision, files=[filename])


def _cache_first(fetch, *, what: str, spec: str, repo_id: str, revision: str | None, files: list[str] | None) -> str:
    """`fetch(local_files_only)`: from the cache first (no network round-trip when it is there), then from
    the hub unless HF_HUB_OFFLINE is set; otherwise one HubError naming the command that fetches it."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return fetch(True)
    except LocalEntryNotFoundError:
        pass
    if offline():
        raise HubError(_not_cached(what, spec, repo_id, revision, files)) from None
    try:
        return fetch(False)
    except Exception as e:  # no network, no such repo or file, gated: the library's message says which
        raise HubError(_not_cached(what, spec, repo_id, revision, files, reason=f"{type(e).__name__}: {e}")) from None


def _not_cached(what: str, spec: str, repo_id: str, revision: str | None, files: list[str] | None, reason: str | None = None) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    why = f"the download failed ({reason.splitlines()[0][:300]})" if reason else "HF_HUB_OFFLINE is set"
    return (f"{_prefix(what)}{spec} is a Hugging Face hub id, not a local path; {', '.join(files or ['its files'])} "
            f"is not in the HF cache ({HF_HUB_CACHE}) and {why}. Fetch it once where there is network, "
            f"into the same cache: {fetch_command(repo_id, files, revision)}")


def _prefix(what: str) -> str:
    return f"{what}: " if what else ""
