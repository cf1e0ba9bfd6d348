"""Build and install FlashAttention-3 for the GPU this machine has (`make flash-attn`).

    make flash-attn                                   # clones flash-attention at FA3_COMMIT, builds, installs, checks
    make flash-attn FLASH_ATTN_SRC=~/src/flash-attention   # a checkout you have (with csrc/cutlass), e.g. offline
    python scripts/build_flash_attn.py --check        # the checks only, no build

Why FlashAttention-3 and only for Hopper: `attention_backend: flash_attn3` is the one flash-attn backend this
project has run (BENCHMARKS.md, "flash-attn on the GPU"); flash-attn 2.x is published as source only, and its
72 kernels for one architecture were not built within the GPU host's session, so `flash_attn` is refused as
unverified (olmo_ds/model/config.py, `REFUSED_ATTENTION_BACKENDS`). FA3 is not on PyPI: it is built from the `hopper/` directory
of Dao-AILab/flash-attention, trimmed with its own `FLASH_ATTENTION_DISABLE_*` switches (hopper/setup.py) to what
OLMo runs: bf16, head dim 128, causal and sliding-window (local) masks, varlen (document masking), forward and
backward, grouped-query heads packed (PACKGQA), sm90 only: 4 CUDA files of hopper/instantiations's 451, built in
4.4 minutes on the 16-core H100 host.

Every check runs before anything is compiled, and each failure is one line naming the cause and the fix
(docs/troubleshooting.md, "flash-attn"): no CUDA GPU, a GPU that is not Hopper, a torch without CUDA, nvcc
missing or of another CUDA major than torch's, ninja missing, too little free memory for one nvcc job.
`MAX_JOBS` comes from free memory (nvcc needs up to `GB_PER_JOB` for these kernels) unless set;
`TORCH_CUDA_ARCH_LIST` is normalised for the build (`9.0a` -> `9.0`: DeepSpeed's op builder cannot parse the
suffix). A failed build's log is scanned for the failures users meet (`DIAGNOSES`) and answered the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FA3_REPO = "https://github.com/Dao-AILab/flash-attention.git"
# The commit built and measured on an H100 (BENCHMARKS.md, 2026-12-07); its csrc/cutlass submodule is pinned by it.
FA3_COMMIT = "0251105a2fb19d2957484b7f023cd8c115286ced"
GB_PER_JOB = 8  # peak resident memory of one nvcc on FA3's sm90 kernels, with margin
# hopper/setup.py's switches: everything OLMo's attention does not call is left out of the build.
TRIM = ("FP16", "FP8", "SPLIT", "PAGEDKV", "APPENDKV", "SOFTCAP", "CLUSTER", "SM80",
        "HDIM64", "HDIM96", "HDIM192", "HDIM256", "HDIMDIFF64", "HDIMDIFF192")
MIN_CUDA = (12, 3)  # hopper/setup.py refuses older toolkits


class BuildError(Exception):
    """A check or the build failed; the message is the one line a user reads (cause and fix)."""


@dataclasses.dataclass
class Probe:
    """What the build depends on, read from this machine (`read_probe`) or given by a test."""

    gpu: tuple[int, int] | None  # compute capability of cuda:0, None without a CUDA device
    gpu_name: str
    torch_cuda: str | None  # torch.version.cuda
    nvcc: str | None  # path
    nvcc_version: tuple[int, int] | None
    ninja: str | None
    cxx: str | None
    mem_available_gb: float
    cores: int
    arch_list: str | None  # TORCH_CUDA_ARCH_LIST as set


def nvcc_version(nvcc: str) -> tuple[int, int] | None:
    """(major, minor) from `nvcc --version` ("Cuda compilation tools, release 13.0, V13.0.88")."""
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+)\.(\d+)", out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def mem_available_gb(meminfo: str = "/proc/meminfo") -> float:
    """MemAvailable in GB (what the kernel can give new processes without swapping)."""
    with open(meminfo) as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1e6
    raise BuildError(f"no MemAvailable line in {meminfo}: cannot size MAX_JOBS; set MAX_JOBS=N")


def find_nvcc(env: dict) -> str | None:
    """nvcc under CUDA_HOME (as torch's extension builder uses it), else on PATH."""
    home = env.get("CUDA_HOME") or env.get("CUDA_PATH")
    if home and Path(home, "bin", "nvcc").exists():
        return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc", path=env.get("PATH"))


def read_probe(env: dict | None = None) -> Probe:
    import torch

    env = dict(os.environ) if env is None else env
    gpu, name = None, ""
    if torch.cuda.is_available():
        gpu, name = torch.cuda.get_device_capability(0), torch.cuda.get_device_name(0)
    nvcc = find_nvcc(env)
    path = env.get("PATH")
    return Probe(gpu=gpu, gpu_name=name, torch_cuda=torch.version.cuda, nvcc=nvcc,
                 nvcc_version=nvcc_version(nvcc) if nvcc else None, ninja=shutil.which("ninja", path=path),
                 cxx=env.get("CXX") or shutil.which("c++", path=path) or shutil.which("g++", path=path),
                 mem_available_gb=mem_available_gb(), cores=os.cpu_count() or 1, arch_list=env.get("TORCH_CUDA_ARCH_LIST"))


def normalise_arch_list(capability: tuple[int, int]) -> str:
    """TORCH_CUDA_ARCH_LIST for this GPU without the `a` suffix: `9.0`. (FA3's sources name sm_90a themselves.)"""
    return f"{capability[0]}.{capability[1]}"


def check(probe: Probe, max_jobs: str | None) -> dict:
    """The build environment's additions for `probe`, or BuildError with the first problem found."""
    if probe.gpu is None:
        raise BuildError("no CUDA GPU is visible (torch.cuda.is_available() is False): nothing to build for. flash-attn "
                         "is optional: attention_backend auto runs cuDNN SDPA and flex_attention without it")
    if probe.gpu[0] != 9:
        raise BuildError(f"{probe.gpu_name or 'this GPU'} is sm{probe.gpu[0]}{probe.gpu[1]}; FlashAttention-3 is built and "
                         "verified here for Hopper (sm90: H100, H200) only. Use attention_backend auto (cuDNN SDPA, "
                         "flex_attention), which needs no build")
    if probe.torch_cuda is None:
        raise BuildError("this torch has no CUDA (torch.version.cuda is None): install a CUDA build of torch first")
    if probe.nvcc is None:
        raise BuildError(f"nvcc not found (CUDA_HOME, PATH): install the CUDA {probe.torch_cuda} toolkit (or use a "
                         "*-devel image) and set CUDA_HOME to it")
    if probe.nvcc_version is None:
        raise BuildError(f"{probe.nvcc} --version printed no 'release X.Y': a broken CUDA toolkit? set CUDA_HOME to a working one")
    torch_major = int(probe.torch_cuda.split(".")[0])
    if probe.nvcc_version[0] != torch_major:
        raise BuildError(f"nvcc is CUDA {'.'.join(map(str, probe.nvcc_version))} but torch was built with CUDA "
                         f"{probe.torch_cuda}: the extension would not load. Set CUDA_HOME to a CUDA {torch_major}.x "
                         f"toolkit, or install the torch build for CUDA {probe.nvcc_version[0]}")
    if probe.nvcc_version < MIN_CUDA:
        raise BuildError(f"nvcc is CUDA {'.'.join(map(str, probe.nvcc_version))}; FlashAttention-3 needs CUDA 12.3 or newer")
    if probe.ninja is None:
        raise BuildError("ninja not found on PATH: `pip install ninja` (without it torch compiles one file at a time)")
    if probe.cxx is None:
        raise BuildError("no C++ compiler (c++/g++, or CXX): install g++ (e.g. apt-get install g++)")
    fit = int(probe.mem_available_gb // GB_PER_JOB)
    if fit < 1:
        raise BuildError(f"{probe.mem_available_gb:.1f} GB of memory available; one nvcc job on these kernels needs "
                         f"~{GB_PER_JOB} GB. Free memory (or build on a larger machine)")
    if max_jobs:
        if not max_jobs.isdigit() or int(max_jobs) < 1:
            raise BuildError(f"MAX_JOBS={max_jobs!r} is not a positive integer")
        jobs = int(max_jobs)
    else:
        jobs = max(1, min(probe.cores, fit))
    env = {"MAX_JOBS": str(jobs), "TORCH_CUDA_ARCH_LIST": normalise_arch_list(probe.gpu),
           "FLASH_ATTENTION_FORCE_BUILD": "TRUE"}  # never try to download a prebuilt wheel (none exists for FA3)
    if probe.nvcc.startswith("/") and "CUDA_HOME" not in os.environ:
        env["CUDA_HOME"] = str(Path(probe.nvcc).parent.parent)
    env.update({f"FLASH_ATTENTION_DISABLE_{name}": "TRUE" for name in TRIM})
    return env


# Known failures in a build log: (pattern, the one line that answers it).
DIAGNOSES = [
    (r"unsupported GNU version|gcc versions later than \d+ are not supported",
     "the host compiler (gcc) is newer than this nvcc supports: install an older g++ and set CXX/CC to it, "
     "or use a CUDA toolkit that supports your gcc"),
    (r"Killed signal terminated program|fatal error: Killed|\bKilled\b.*(nvcc|cicc|ptxas)|std::bad_alloc|out of memory",
     "the compiler ran out of memory: set MAX_JOBS lower (each nvcc job needs ~8 GB)"),
    (r"cute/tensor\.hpp: No such file|cutlass/\S+\.h(pp)?: No such file",
     "the cutlass headers are missing: run `git submodule update --init csrc/cutlass` in the flash-attention checkout"),
    (r"urlopen error|URLError|Temporary failure in name resolution|Network is unreachable",
     "the build tried to download (a prebuilt wheel, or for CUDA 12.x other than 12.8 hopper/setup.py fetches "
     "nvcc 12.6): give the machine network access once, or use CUDA 12.8 or 13.x"),
    (r"CUDA_HOME environment variable is not set|nvcc was not found",
     "nvcc not found by torch's extension builder: set CUDA_HOME to the CUDA toolkit's root"),
    (r"The detected CUDA version \(\S+\) mismatches the version that was used to compile",
     "nvcc's CUDA major differs from torch's: set CUDA_HOME to a toolkit of torch's CUDA version"),
    (r"No module named '?(setuptools|wheel|packaging|ninja)'?",
     "a build dependency is missing: `pip install setuptools wheel packaging ninja` (the build runs without isolation)"),
    (r"No such file or directory: 'git'",
     "hopper/setup.py runs `git submodule update` even when csrc/cutlass is there: install git"),
    (r"Ninja is required to load C\+\+ extensions|ninja: not found",
     "ninja is missing: `pip install ninja`"),
]


def diagnose(log: str) -> str | None:
    for pattern, answer in DIAGNOSES:
        if re.search(pattern, log):
            return answer
    return None


def source_tree(src: str | None, cache: Path) -> Path:
    """A flash-attention checkout with hopper/ and the cutlass headers: `src`, or a clone of FA3_COMMIT in `cache`."""
    if src is None:
        root = cache / f"flash-attention-{FA3_COMMIT[:10]}"
        if not (root / "hopper" / "setup.py").exists():
            if shutil.which("git") is None:
                raise BuildError("git not found, and no FLASH_ATTN_SRC given: install git, or pass FLASH_ATTN_SRC=DIR "
                                 "(a flash-attention checkout with csrc/cutlass)")
            tmp = Path(tempfile.mkdtemp(dir=cache.parent if cache.exists() else None))
            steps = [["git", "clone", "--filter=blob:none", FA3_REPO, str(tmp)],
                     ["git", "-C", str(tmp), "checkout", "-q", FA3_COMMIT],
                     ["git", "-C", str(tmp), "submodule", "update", "--init", "--depth", "1", "csrc/cutlass"]]
            for step in steps:
                if subprocess.run(step).returncode != 0:
                    raise BuildError(f"`{' '.join(step)}` failed: without network, clone elsewhere and pass FLASH_ATTN_SRC=DIR")
            cache.mkdir(parents=True, exist_ok=True)
            tmp.rename(root)
    else:
        root = Path(src).expanduser()
    if not (root / "hopper" / "setup.py").exists():
        raise BuildError(f"FLASH_ATTN_SRC={root}: no hopper/setup.py there; give the root of a flash-attention checkout")
    if not (root / "csrc" / "cutlass" / "include" / "cute" / "tensor.hpp").exists():
        raise BuildError(f"{root}/csrc/cutlass/include is empty: run `git -C {root} submodule update --init csrc/cutlass`")
    return root


SMOKE = """
import torch, torch.nn.functional as F
from flash_attn_interface import flash_attn_func
q, k, v = (torch.randn(1, 512, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
out = flash_attn_func(q, k, v, causal=True)
out = out[0] if isinstance(out, tuple) else out
ref = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True).transpose(1, 2)
out.sum().backward()
err = (out - ref).abs().max().item()
assert err < 2e-2, err
print(f"flash_attn_interface works: max |FA3 - SDPA| = {err:.1e} forward, backward ran")
"""


def build(root: Path, env_add: dict, log_path: Path) -> None:
    """pip-install hopper/ into this Python (no build isolation: it compiles against the torch installed here)."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "-v", str(root / "hopper")]
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"building FlashAttention-3 ({' '.join(f'{k}={v}' for k, v in env_add.items() if 'DISABLE' not in k)}, "
          f"disabled: {', '.join(TRIM)}); log: {log_path}", flush=True)
    with open(log_path, "w") as log:
        rc = subprocess.run(cmd, env={**os.environ, **env_add}, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        text = log_path.read_text(errors="replace")
        cause = diagnose(text) or f"see the last lines of {log_path}"
        raise BuildError(f"the FlashAttention-3 build failed (exit {rc}): {cause}")
    smoke = subprocess.run([sys.executable, "-c", SMOKE], capture_output=True, text=True)
    if smoke.returncode != 0:
        text = smoke.stderr
        cause = ("the extension does not match this torch: rebuild after installing torch"
                 if "undefined symbol" in text else text.strip().splitlines()[-1] if text.strip() else "no output")
        raise BuildError(f"FlashAttention-3 installed but does not run: {cause}")
    print(smoke.stdout.strip())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", default=os.environ.get("FLASH_ATTN_SRC") or None,
                   help="a flash-attention checkout with csrc/cutlass (default: clone FA3_COMMIT into --cache)")
    p.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "olmo-ds")
    p.add_argument("--log", type=Path, default=Path("build") / "flash-attn.log")
    p.add_argument("--check", action="store_true", help="run the checks and print the build's settings; build nothing")
    args = p.parse_args(argv)
    try:
        probe = read_probe()
        env_add = check(probe, os.environ.get("MAX_JOBS"))
        if probe.arch_list and probe.arch_list != env_add["TORCH_CUDA_ARCH_LIST"]:
            print(f"note: TORCH_CUDA_ARCH_LIST={probe.arch_list} is set; the build uses {env_add['TORCH_CUDA_ARCH_LIST']}. "
                  f"Export TORCH_CUDA_ARCH_LIST={env_add['TORCH_CUDA_ARCH_LIST']} for DeepSpeed too (it cannot parse "
                  "a suffix such as 9.0a)", flush=True)
        print(f"{probe.gpu_name} sm{probe.gpu[0]}{probe.gpu[1]}, torch CUDA {probe.torch_cuda}, nvcc "
              f"{'.'.join(map(str, probe.nvcc_version))} ({probe.nvcc}), ninja {probe.ninja}, "
              f"{probe.mem_available_gb:.0f} GB available, {probe.cores} cores: MAX_JOBS={env_add['MAX_JOBS']}", flush=True)
        if args.check:
            return 0
        build(source_tree(args.src, args.cache), env_add, args.log)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
