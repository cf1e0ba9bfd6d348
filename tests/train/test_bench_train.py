"""scripts/bench_train.py on CPU: the real trainer step and the plain-PyTorch reference, through a sweep.

The tiny preset runs in seconds. Both paths must train the same model on the same batches (their first
losses agree: same seed, same data order), report positive throughput and a data-wait share in [0, 1],
and compiled blocks and the experiment switches must leave the step's math unchanged.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from olmo_ds.model import float8 as fp8
from tests.train.train_testlib import ROOT, run

SCRIPT = ROOT / "scripts" / "bench_train.py"
# The block shapes of tests/model/test_compile.py, so compiled blocks reuse the graphs inductor cached there.
TINY = ["--preset", "tiny", "--seq-len", "32", "--micro-batch-size", "2", "--grad-accum", "2", "--warmup", "1", "--steps", "2",
        "--model-set", "d_model=32", "--model-set", "n_heads=2", "--model-set", "n_kv_heads=1", "--model-set", "mlp_hidden=64"]


# With torchao, the sweep also runs the baseline with FP8 block matmuls (`--float8`), a second process.
FLOAT8 = ["--float8", "tensorwise"] if fp8.unavailable() is None else []


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    out = work / "rows.json"
    proc = run([sys.executable, str(SCRIPT), *TINY, "--work-dir", str(work), "--sweep", "baseline", *FLOAT8, "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), work


def test_cpu_sweep_reports_both_paths(sweep):
    proc, rows, _ = sweep
    row = rows[0]
    assert row["variant"] == "baseline" and row["rc"] == 0
    r = row["result"]
    assert r["tokens_per_step"] == 2 * 2 * 32
    assert r["flops_per_token"] > 0 and "FLOPs/token = 6 x" in r["formula"] and "output head included" in r["formula"]
    for key in ("reference", "deepspeed"):
        m = r[key]
        assert m["tokens_per_s"] > 0 and m["tflops"] > 0
        assert 0.0 <= m["data_wait_fraction"] <= 1.0
        assert m["peak_alloc_gib"] > 0
        assert math.isfinite(m["loss_first"]) and math.isfinite(m["loss_last"])
    assert r["deepspeed"]["zero_stage"] == 3
    # `compile: auto` on CPU: eager blocks, and the ZeRO-3 knobs that go with them.
    assert r["model"]["compile"] == "auto" and not r["deepspeed"]["blocks_compiled"]
    assert r["deepspeed"]["counters"]["blocks_compiled"] == 0 and r["deepspeed"]["counters"]["blocks_eager"] > 0
    assert r["deepspeed"]["ds_zero_config"]["memory_efficient_linear"] is True
    # Same seed, same model code, same batches: the first step's loss (before any update) is the same.
    assert r["deepspeed"]["loss_first"] == pytest.approx(r["reference"]["loss_first"], rel=1e-5)
    assert r["ratio_deepspeed_to_reference"] == pytest.approx(r["deepspeed"]["tokens_per_s"] / r["reference"]["tokens_per_s"])
    assert "ratio DeepSpeed / plain PyTorch" in proc.stdout
    assert r["deepspeed"]["counters"]["float8_matmuls"] == 0 and r["deepspeed"]["counters"]["block_matmuls"] > 0
    assert r["deepspeed"]["estimated_peak_gib"] > 0 and "GiB estimated (olmo_ds/train/memory.py" in proc.stdout
    table = proc.stdout.strip().splitlines()
    table = table[:-1] if FLOAT8 else table  # the FP8 row's ratio line closes the table
    assert table[-2 - len(rows) + 1].startswith("variant") and table[-len(rows)].startswith("baseline")


@pytest.mark.skipif(not FLOAT8, reason=f"model.float8: {fp8.unavailable()}")
def test_float8_rows_beside_the_baseline_count_their_fp8_matmuls(sweep):
    """`--float8 tensorwise`: the same bench with FP8 block matmuls in its own process; its report counts the
    block matmuls that ran in FP8 (all of them, in plain PyTorch and under DeepSpeed), the table shows them
    beside the baseline's none, and the last line compares the two."""
    proc, rows, _ = sweep
    assert [row["variant"] for row in rows] == ["baseline", "baseline+fp8_tensorwise"]
    r = rows[1]["result"]
    assert r["model"]["float8"] == "tensorwise"
    for key in ("reference", "deepspeed"):
        counters = r[key]["counters"]
        assert counters["float8_matmuls"] == counters["block_matmuls"] == 7 * counters["blocks_eager"] > 0, counters
    # FP8 rounds differently: the first loss moves a little from the baseline's (same weights, same batch).
    base = rows[0]["result"]["deepspeed"]["loss_first"]
    assert r["deepspeed"]["loss_first"] != base and r["deepspeed"]["loss_first"] == pytest.approx(base, rel=0.01)
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("baseline+fp8_tensorwise / baseline: DeepSpeed tokens/s ")
    assert lines[-2].startswith("baseline+fp8_tensorwise") and f"{r['deepspeed']['counters']['block_matmuls']}/" in lines[-2]
    assert "deepspeed: FP8 tensorwise: 84 of 84 block matmuls in FP8" in proc.stdout


def test_compiled_blocks_and_experiment_switches_keep_the_loss(sweep):
    """`compile=blocks` (what `auto` is on a GPU) runs the trainer's real compiled path: leaf blocks, the
    matching ZeRO-3 knobs, every block call compiled; with the experiment switches on top, the losses
    are the eager baseline's."""
    _, rows, work = sweep
    out = work / "switches.json"
    proc = run([sys.executable, str(SCRIPT), *TINY, "--work-dir", str(work), "--model-set", "compile=blocks", "--compile-pointwise",
                "--compile-backend", "eager", "--loss-chunk", "48", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["experiments_applied"] == ["compile_pointwise(eager)", "loss_chunk=48"]
    assert r["model"]["compile"] == "blocks" and r["deepspeed"]["blocks_compiled"]
    zero = r["deepspeed"]["ds_zero_config"]
    assert (zero["reduce_bucket_size"], zero["memory_efficient_linear"]) == (500_000_000, False)
    base = rows[0]["result"]
    for key in ("reference", "deepspeed"):
        # Every block call compiled (ZeRO-3 gathers each leaf block's weights, then releases them) ...
        assert r[key]["counters"]["blocks_compiled"] > 0 and r[key]["counters"]["blocks_eager"] == 0, r[key]["counters"]
        # ... and computes what the eager model computes, through the optimizer updates too.
        assert r[key]["loss_first"] == pytest.approx(base[key]["loss_first"], rel=1e-5)
        assert r[key]["loss_last"] == pytest.approx(base[key]["loss_last"], rel=1e-4)


def test_one_rank_gradient_path_without_reduce_scatter_trains_the_same(sweep):
    """On one rank the trainer's ZeRO-3 skips DeepSpeed's reduce-scatter path (`reduce_scatter` false);
    DeepSpeed's default path trains to the same losses, bit for bit, through the optimizer updates."""
    _, rows, work = sweep
    base = rows[0]["result"]["deepspeed"]
    assert base["ds_zero_config"]["reduce_scatter"] is False
    out = work / "rs_on.json"
    proc = run([sys.executable, str(SCRIPT), *TINY, "--work-dir", str(work), "--no-reference",
                "--ds-set", "zero_optimization.reduce_scatter=true", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())["deepspeed"]
    assert r["ds_zero_config"]["reduce_scatter"] is True
    assert (r["loss_first"], r["loss_last"]) == (base["loss_first"], base["loss_last"])


def test_device_busy_is_the_union_of_kernel_intervals():
    from olmo_ds.tools.bench_train import _busy_us

    assert _busy_us([]) == 0
    assert _busy_us([(5, 6), (0, 2), (1, 3), (1.5, 2.5)]) == 4  # overlapping streams count once
    assert _busy_us([(0, 10), (2, 3)]) == 10


def test_bad_ds_override_is_reported(tmp_path):
    proc = run([sys.executable, str(SCRIPT), *TINY, "--work-dir", str(tmp_path), "--no-reference",
                "--ds-set", "zero_optimization.stage=5"], timeout=300)
    assert proc.returncode == 2
    assert "zero_optimization.stage must be 1, 2 or 3" in proc.stderr


def test_reference_with_fp32_master_weights(tmp_path):
    """`--reference-fp32-master` times plain PyTorch with DeepSpeed's precision recipe: in bf16 its
    first loss is the pure-bf16 reference's (same model, same batch), and its updates differ (fp32
    master weights and moments instead of bf16 ones)."""
    out = tmp_path / "r.json"
    proc = run([sys.executable, str(SCRIPT), *TINY, "--work-dir", str(tmp_path), "--no-deepspeed", "--precision", "bf16",
                "--steps", "4", "--reference-fp32-master", "--json", str(out)], timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    bf16, master = r["reference"], r["reference_fp32_master"]
    assert master["tokens_per_s"] > 0 and master["peak_alloc_gib"] > 0
    assert master["loss_first"] == bf16["loss_first"]
    assert math.isfinite(master["loss_last"]) and master["loss_last"] != bf16["loss_last"]
    assert "plain PyTorch, fp32 master" in proc.stdout


def test_window_and_document_masking_switches_run_compiled_under_zero3(tmp_path):
    """`--window` / `--document-masking` make one-command rows of OLMo 3's attention; with compiled blocks
    under ZeRO-3 every block call, windowed and document-masked, takes the compiled path (no recompiles
    once warm) and trains to the eager blocks' losses. Selective checkpointing (`every_k:2`, a string where
    the key also takes true/false) passes through the train config."""
    results = {}
    for mode in ("blocks", "eager"):
        out = tmp_path / f"{mode}.json"
        proc = run([sys.executable, str(SCRIPT), *TINY, "--work-dir", str(tmp_path), "--no-reference", "--window", "8",
                    "--window-pattern", "TF", "--document-masking", "--model-set", f"compile={mode}",
                    "--model-set", "activation_checkpointing=every_k:2", "--json", str(out)], timeout=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        results[mode] = json.loads(out.read_text())
    r = results["blocks"]
    assert (r["model"]["sliding_window"], r["model"]["sliding_layers"], r["model"]["document_masking"]) == (8, 1, True)
    assert r["model"]["activation_checkpointing"] == "every_k:2"
    ds = r["deepspeed"]
    # 2 layers, block 0 recomputed in backward: 3 calls per micro-batch, 2 micro-batches, 1 + 2 steps.
    assert ds["counters"] == {"blocks_compiled": 3 * 2 * 3, "blocks_eager": 0, "block_matmuls": 7 * 3 * 2 * 3, "float8_matmuls": 0,
                              "dynamo_graphs": ds["counters"]["dynamo_graphs"]}
    assert ds["dynamo_graphs_while_timed"] == 0
    eager = results["eager"]["deepspeed"]
    assert eager["counters"]["blocks_compiled"] == 0
    assert ds["loss_first"] == pytest.approx(eager["loss_first"], rel=1e-5)
    assert ds["loss_last"] == pytest.approx(eager["loss_last"], rel=1e-4)


def test_window_pattern_must_be_t_and_f(tmp_path):
    proc = run([sys.executable, str(SCRIPT), *TINY, "--work-dir", str(tmp_path), "--window", "8", "--window-pattern", "TX"], timeout=300)
    assert proc.returncode == 2 and "--window-pattern 'TX' must be letters T (sliding) and F (full)" in proc.stderr
