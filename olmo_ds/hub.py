"""Files named by a local path or a Hugging Face hub id, resolved through the standard HF cache.

Tokenizers, model weights and evaluation datasets: anything a config or flag names may be a
path (`data/tokenizer.json`, `models/olmo2-1b/`) or a hub id (`allenai/dolma2-tokenizer`, optionally
`@revision`). A path that exists always wins. A hub id is looked up in the local cache first (the
cache huggingface_hub and transformers share: `HF_HUB_CACHE`, `HF_HOME`), so a filled cache works on
machines without network, such as compute nodes; only when the file is not cached and
`HF_HUB_OFFLINE` is not set is it downloaded. Otherwise the error names the one command that fetches
it, to run where there is network (the login node) with the same cache.

Before the first download a process asks the hub once whether it answers at all (`hub_unreachable`: one HEAD
request, `PROBE_TIMEOUT_S` at most). Without it, a machine with no network and HF_HUB_OFFLINE unset waits through
huggingface_hub's five retries (about 25 s of "Retrying in 8s" lines) for the same error.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
from pathlib import Path

# org/name with an optional @revision; what huggingface_hub accepts as a repo id, minus a bare name
# (a bare word is far more likely a misspelt local file than a hub repo).
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+?)(?:@(?P<revision>[\w./-]+))?$")
_FILE_SUFFIXES = (".json", ".model", ".safetensors", ".yaml", ".yml", ".gz", ".jsonl", ".txt", ".bin", ".npy")
PROBE_TIMEOUT_S = 3.0  # how long the one connectivity check waits for the hub to answer


class HubError(FileNotFoundError):
    """Neither a local path nor a cached (or downloadable) hub file; the message says how to fetch it.

    `commands` (the fetch commands) and `why` (why it was not downloaded) stand alone too, for a caller that
    reports several missing repos at once."""

    def __init__(self, message: str, commands: list[str] | None = None, why: str = ""):
        super().__init__(message)
        self.commands = commands or []
        self.why = why


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo_id, revision) when `spec` reads as a hub id rather than a path, else None."""
    m = _HUB_ID.match(str(spec))
    if m is None or path_reason(spec) is not None:
        return None
    return m.group("repo"), m.group("revision")


# Where this project's runs live (`run_dir: runs/NAME` in every shipped config): `runs/x` names a run, never a hub repo.
_PATH_PREFIXES = ("./", "../", "/", "~", "runs/")


def path_reason(spec: str | Path) -> str | None:
    """Why `spec` reads as a local path and not as a hub id (`org/name`), whether or not it exists; None when it
    may be a hub id. A path: it starts with ./ ../ / ~ or runs/, names a file (.json, .safetensors, ...), or its
    parent directory exists here (`checkpoints/x` beside a `checkpoints/` directory)."""
    text = str(spec)
    prefix = next((p for p in _PATH_PREFIXES if text.startswith(p)), None) or (text[:1] if text.startswith(".") else None)
    if prefix:
        return f"it starts with {prefix}"
    if text.lower().endswith(_FILE_SUFFIXES):
        return "it names a file"
    parent = Path(text).parent
    if parent != Path(".") and parent.is_dir():
        return f"directory {parent}/ exists here"
    return None


def missing_path(spec: str | Path) -> str | None:
    """"no such checkpoint, run or model directory (...)" when `spec` reads as a local path (`path_reason`) that does
    not exist, so that it is reported as the missing path it is, never as a hub id that is not cached; None otherwise."""
    path = Path(str(spec)).expanduser()
    if path.exists():
        return None
    reason = path_reason(spec)
    if reason is None:
        return None
    return (f"no such checkpoint, run or model directory ({path.resolve()}; {reason}, so it is a local path, not a Hugging "
            f"Face hub id such as allenai/OLMo-2-0425-1B)")


def offline(repo_type: str = "model") -> bool:
    """HF_HUB_OFFLINE is set (for datasets also HF_DATASETS_OFFLINE, the `datasets` library's own switch)."""
    names = ["HF_HUB_OFFLINE"] + (["HF_DATASETS_OFFLINE"] if repo_type == "dataset" else [])
    return any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes", "on") for n in names)


def fetch_command(repo_id: str, filenames: list[str] | None = None, revision: str | None = None, *,
                  repo_type: str = "model", include: str | None = None) -> str:
    """The command that puts these files (or those matching the glob `include`) into the HF cache (run it
    where there is network). One `--include` per command: `hf download` of huggingface_hub before 1.0
    keeps only the last of several."""
    parts = ["hf", "download", repo_id, *(filenames or [])]
    if repo_type != "model":
        parts += ["--repo-type", repo_type]
    if revision:
        parts += ["--revision", revision]
    if include:
        parts += ["--include", include]
    return shlex.join(parts)


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
                             what=what, spec=str(spec), files=None, commands=[fetch_command(repo_id, revision=revision)]))


def resolve_dataset(repo_id: str, revision: str, patterns: list[str], *, what: str = "") -> Path:
    """The cached snapshot of dataset repo `repo_id` at `revision` (a branch such as
    `refs/convert/parquet`, or a commit) in which every glob of `patterns` matches a file; downloaded
    when allowed and not cached (or cached without some of those files)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    def snapshot(local: bool) -> tuple[str, list[str]]:
        found = snapshot_download(repo_id, repo_type="dataset", revision=revision, allow_patterns=patterns, local_files_only=local)
        return found, [p for p in patterns if not any(Path(found).glob(p))]

    def fetch(local: bool) -> str:
        found, missing = snapshot(local)
        if missing:
            raise LocalEntryNotFoundError(f"{found} holds no file matching {', '.join(missing)}")
        return found

    try:
        found, absent = snapshot(True)
        if not absent:
            return Path(found)
    except LocalEntryNotFoundError:
        absent = list(patterns)
    commands = [fetch_command(repo_id, revision=revision, repo_type="dataset", include=p) for p in absent]
    return Path(_cache_first(fetch, what=what, spec=f"{repo_id}@{revision}", files=absent, commands=commands, repo_type="dataset"))


def _download(repo_id: str, revision: str | None, filename: str, *, what: str, spec: str) -> str:
    from huggingface_hub import hf_hub_download

    return _cache_first(lambda local: hf_hub_download(repo_id, filename, revision=revision, local_files_only=local),
                        what=what, spec=spec, files=[filename], commands=[fetch_command(repo_id, [filename], revision)])


def _cache_first(fetch, *, what: str, spec: str, files: list[str] | None, commands: list[str], repo_type: str = "model") -> str:
    """`fetch(local_files_only)`: from the cache first (no network round-trip when it is there), then from
    the hub unless offline; otherwise one HubError naming the commands that fetch it."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return fetch(True)
    except LocalEntryNotFoundError:
        pass
    if offline(repo_type):
        why = f"{'HF_HUB_OFFLINE or HF_DATASETS_OFFLINE' if repo_type == 'dataset' else 'HF_HUB_OFFLINE'} is set"
        raise HubError(_not_cached(what, spec, files, commands, repo_type, why), commands, why) from None
    from huggingface_hub.constants import ENDPOINT

    if why := hub_unreachable(ENDPOINT):
        raise HubError(_not_cached(what, spec, files, commands, repo_type, why), commands, why) from None
    try:
        return fetch(False)
    except Exception as e:  # no network, no such repo or file, gated: the library's message says which
        why = f"the download failed ({f'{type(e).__name__}: {e}'.splitlines()[0][:300]})"
        raise HubError(_not_cached(what, spec, files, commands, repo_type, why), commands, why) from None


@functools.lru_cache(maxsize=None)
def hub_unreachable(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why `endpoint` cannot be reached, or None when it answers (any HTTP status counts: it is there). Asked once per
    process and endpoint; a proxy set in the environment is used as huggingface_hub would use it."""
    import urllib.error
    import urllib.request

    try:
        urllib.request.urlopen(urllib.request.Request(endpoint, method="HEAD"), timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        return (f"the hub ({endpoint}) cannot be reached ({reason}; one try of at most {timeout:g} s); on a machine without "
                f"network set HF_HUB_OFFLINE=1 to skip the try")
    return None


def _not_cached(what: str, spec: str, files: list[str] | None, commands: list[str], repo_type: str, why: str) -> str:
    from huggingface_hub.constants import HF_HUB_CACHE

    what_it_is = f"dataset {spec}:" if repo_type == "dataset" else f"{spec} is a Hugging Face hub id, not a local path;"
    return (f"{_prefix(what)}{what_it_is} {', '.join(files or ['its files'])} is not in the HF cache ({HF_HUB_CACHE}) "
            f"and {why}. Fetch it once where there is network, into the same cache: {' && '.join(commands)}")


def _prefix(what: str) -> str:
    return f"{what}: " if what else ""
