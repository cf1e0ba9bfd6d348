"""`make flash-attn`'s checks and messages on a machine without a GPU: the tools it reads (nvcc, ninja, free
memory, torch's CUDA version, the GPU's capability) are faked, each failure must be one line naming the cause
and the fix, and nothing may be built when a check fails. The build itself ran on an H100 (BENCHMARKS.md)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from olmo_ds.tools import flash_attn_build as fab

from tests.train.train_testlib import ROOT


def fake_tool(bin_dir: Path, name: str, output: str) -> Path:
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\necho '{output}'\n")
    path.chmod(0o755)
    return path


NVCC_13 = "Cuda compilation tools, release 13.0, V13.0.88"


@pytest.fixture
def host(tmp_path, monkeypatch):
    """An H100 with torch CUDA 13.0, nvcc 13.0, ninja, 128 GB available and 16 cores: every check passes."""
    bin_dir = tmp_path / "bin"
    fake_tool(bin_dir, "nvcc", NVCC_13)
    fake_tool(bin_dir, "ninja", "1.13.0")
    fake_tool(bin_dir, "c++", "c++ (GCC) 13.3.0")
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       131072000 kB\nMemAvailable:   128000000 kB\n")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(fab.os, "cpu_count", lambda: 16)
    real_mem = fab.mem_available_gb
    monkeypatch.setattr(fab, "mem_available_gb", lambda: real_mem(str(meminfo)))
    env = {"PATH": str(bin_dir), "TORCH_CUDA_ARCH_LIST": "9.0a"}
    return bin_dir, meminfo, env


def test_a_hopper_host_gets_jobs_from_memory_and_a_normalised_arch(host):
    bin_dir, meminfo, env = host
    probe = fab.read_probe(env)
    assert probe.nvcc == str(bin_dir / "nvcc") and probe.nvcc_version == (13, 0) and probe.gpu == (9, 0)
    assert probe.mem_available_gb == pytest.approx(128.0) and probe.arch_list == "9.0a"
    build_env = fab.check(probe, max_jobs=None)
    assert build_env["MAX_JOBS"] == "16" and build_env["TORCH_CUDA_ARCH_LIST"] == "9.0"
    assert build_env["FLASH_ATTENTION_FORCE_BUILD"] == "TRUE" and build_env["CUDA_HOME"] == str(bin_dir.parent)
    disabled = {k for k, v in build_env.items() if k.startswith("FLASH_ATTENTION_DISABLE_") and v == "TRUE"}
    # What OLMo's attention calls stays: bf16, head dim 128, local windows, varlen, backward, packed GQA.
    for kept in ("HDIM128", "LOCAL", "VARLEN", "BACKWARD", "PACKGQA"):
        assert f"FLASH_ATTENTION_DISABLE_{kept}" not in disabled
    assert {"FLASH_ATTENTION_DISABLE_FP8", "FLASH_ATTENTION_DISABLE_HDIM256", "FLASH_ATTENTION_DISABLE_SM80"} <= disabled
    meminfo.write_text("MemAvailable:   40000000 kB\n")  # 40 GB: five 8 GB jobs, not one per core
    assert fab.check(fab.read_probe(env), max_jobs=None)["MAX_JOBS"] == "5"
    assert fab.check(fab.read_probe(env), max_jobs="2")["MAX_JOBS"] == "2"


@pytest.mark.parametrize("change, message", [
    (lambda mp, b, m: mp.setattr(torch.cuda, "is_available", lambda: False),
     r"no CUDA GPU is visible .* nothing to build for"),
    (lambda mp, b, m: mp.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0)),
     r"is sm80; FlashAttention-3 is built and verified here for Hopper \(sm90: H100, H200\) only. Use attention_backend auto"),
    (lambda mp, b, m: mp.setattr(torch.version, "cuda", None), r"this torch has no CUDA .* install a CUDA build of torch"),
    (lambda mp, b, m: (b / "nvcc").unlink(), r"nvcc not found \(CUDA_HOME, PATH\): install the CUDA 13.0 toolkit"),
    (lambda mp, b, m: fake_tool(b, "nvcc", "Cuda compilation tools, release 12.8, V12.8.93"),
     r"nvcc is CUDA 12.8 but torch was built with CUDA 13.0: .* Set CUDA_HOME to a CUDA 13.x toolkit"),
    (lambda mp, b, m: fake_tool(b, "nvcc", "nvcc: command not understood"), r"--version printed no 'release X.Y'"),
    (lambda mp, b, m: (b / "ninja").unlink(), r"ninja not found on PATH: `pip install ninja`"),
    (lambda mp, b, m: m.write_text("MemAvailable:    6000000 kB\n"),
     r"6.0 GB of memory available; one nvcc job on these kernels needs ~8 GB"),
], ids=["no-gpu", "ampere", "cpu-torch", "no-nvcc", "nvcc-major", "broken-nvcc", "no-ninja", "low-memory"])
def test_each_failed_check_is_one_line_with_cause_and_fix(host, monkeypatch, change, message):
    bin_dir, meminfo, env = host
    change(monkeypatch, bin_dir, meminfo)
    with pytest.raises(fab.BuildError, match=message) as err:
        fab.check(fab.read_probe(env), max_jobs=None)
    assert "\n" not in str(err.value)


def test_nvcc_minor_versions_may_differ_and_cuda_home_wins_over_path(host, tmp_path):
    bin_dir, _, env = host
    fake_tool(bin_dir, "nvcc", "Cuda compilation tools, release 13.1, V13.1.2")
    assert fab.check(fab.read_probe(env), max_jobs=None)["MAX_JOBS"] == "16"  # torch's extension builder accepts a minor skew
    home = tmp_path / "cuda-13.0"
    fake_tool(home / "bin", "nvcc", NVCC_13)
    probe = fab.read_probe({**env, "CUDA_HOME": str(home)})
    assert probe.nvcc == str(home / "bin" / "nvcc") and probe.nvcc_version == (13, 0)
    with pytest.raises(fab.BuildError, match=r"MAX_JOBS='lots' is not a positive integer"):
        fab.check(probe, max_jobs="lots")


@pytest.mark.parametrize("log, answer", [
    ("#error -- unsupported GNU version! gcc versions later than 13 are not supported!", "host compiler (gcc) is newer"),
    ("nvcc error   : 'cicc' died due to signal 9 (Kill signal)\nKilled signal terminated program cicc", "set MAX_JOBS lower"),
    ("flash_fwd_launch_template.h:9:10: fatal error: cute/tensor.hpp: No such file or directory", "git submodule update --init csrc/cutlass"),
    ("urllib.error.URLError: <urlopen error [Errno -3] Temporary failure in name resolution>", "tried to download"),
    ("OSError: CUDA_HOME environment variable is not set. Please set it to your CUDA install root.", "set CUDA_HOME"),
    ("FileNotFoundError: [Errno 2] No such file or directory: 'git'", "install git"),
])
def test_known_build_failures_are_answered_in_one_line(log, answer):
    assert answer in fab.diagnose("building...\n" + log + "\nerror: subprocess-exited-with-error")
    assert fab.diagnose("error: something nobody has seen") is None


def test_a_source_tree_without_hopper_or_cutlass_is_refused(tmp_path):
    with pytest.raises(fab.BuildError, match=r"no hopper/setup.py there"):
        fab.source_tree(str(tmp_path), tmp_path / "cache")
    (tmp_path / "hopper").mkdir()
    (tmp_path / "hopper" / "setup.py").write_text("")
    with pytest.raises(fab.BuildError, match=r"csrc/cutlass/include is empty: run `git -C .* submodule update --init csrc/cutlass`"):
        fab.source_tree(str(tmp_path), tmp_path / "cache")


def test_a_failing_build_is_diagnosed_from_its_log(tmp_path):
    """A real `pip install` of a source whose setup.py fails as an out-of-memory nvcc does: the log is kept and the
    one-line answer printed."""
    src = tmp_path / "flash-attention"
    (src / "hopper").mkdir(parents=True)
    (src / "hopper" / "setup.py").write_text(
        "import sys\nprint('Killed signal terminated program cicc', flush=True)\nsys.exit(1)\n")
    log = tmp_path / "build.log"
    with pytest.raises(fab.BuildError, match=r"build failed \(exit 1\): the compiler ran out of memory: set MAX_JOBS lower"):
        fab.build(src, {"MAX_JOBS": "1"}, log)
    assert "Killed signal" in log.read_text()


def test_make_flash_attn_without_a_gpu_says_so_and_builds_nothing(tmp_path):
    assert not torch.cuda.is_available()
    make = subprocess.run(["make", "-n", "flash-attn", "OFFLINE=1", "FLASH_ATTN_SRC=/src/fa"], cwd=ROOT,
                          capture_output=True, text=True)
    assert "scripts/build_flash_attn.py --src /src/fa" in make.stdout, make.stdout + make.stderr
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "build_flash_attn.py"), "--src", str(tmp_path / "none"),
                           "--log", str(tmp_path / "build.log")], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2 and proc.stderr.startswith("error: no CUDA GPU is visible"), proc.stderr
    assert not (tmp_path / "build.log").exists()
