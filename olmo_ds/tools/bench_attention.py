"""Forward+backward speed of each attention backend on one GPU, at OLMo's shapes, through `attention.attend`.

    python scripts/bench_attention.py                    # seq 4096 and 8192: causal, OLMo 3's window, documents
    python scripts/bench_attention.py --seq-lens 8192 --backends flex,flash_attn3 --json out.json

Each case is the same 32,768 tokens a batch (batch = 32768 / seq), 16 heads of 128 (the 1B's), bf16, random
inputs, and the masks the model builds (`AttentionMask`: a flex BlockMask, a boolean matrix for SDPA, varlen
lengths for FlashAttention-3), made before timing as the model makes them once per forward. TFLOP/s count the
(query, key) pairs each mask allows, forward 4 * head_dim * heads * pairs and backward 2.5x that (flash-attn's
convention), so a window or documents, which allow fewer pairs, are not credited with work they skip. Timed with
CUDA events: medians of `--iters` forward+backward passes after `--warmup`. A backend that refuses a case (the
flash SDPA kernel takes no mask) or fails is reported with its reason, not timed. The last lines are a table;
`auto` names what it resolves to for that case.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from olmo_ds.model.attention import AttentionMask, attend, resolve_backend

BACKENDS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flex", "flash_attn3")
TOKENS, HEADS, HEAD_DIM, WINDOW = 32768, 16, 128, 4096
CASES = ("causal", "window", "documents", "window+documents")


def doc_lens(batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    """Per row, documents of 200 to 2,200 tokens (mean ~1,200, as bench_train's generated data), the last cut to fit."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(batch):
        lens, left = [], seq
        while left:
            n = min(left, int(torch.randint(200, 2201, (1,), generator=g)))
            lens.append(n)
            left -= n
        rows.append(lens)
    width = max(map(len, rows))
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32)


def causal_pairs(length: int, window: int | None) -> int:
    """(query, key) pairs causal attention over `length` tokens allows, with keys limited to `window` back."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def pairs(batch: int, seq: int, window: int | None, lens: torch.Tensor | None) -> int:
    if lens is None:
        return batch * causal_pairs(seq, window)
    return sum(causal_pairs(int(n), window) for n in lens.flatten() if n > 0)


def time_case(backend: str, batch: int, seq: int, window: int | None, lens, warmup: int, iters: int) -> float:
    """Median milliseconds of one forward+backward."""
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(batch, seq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    grad = torch.randn(batch, seq, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=g)
    mask = AttentionMask(batch, seq, q.device, lens)
    resolved = resolve_backend(backend, q.device, window is not None or lens is not None)
    if resolved != "flash_attn3":
        mask.kernel_mask(resolved, window)  # built once per forward in the model, outside the layers
    times = []
    for i in range(warmup + iters):
        for t in (q, k, v):
            t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        attend(q, k, v, mask, window, resolved, HEAD_DIM ** -0.5).backward(grad)
        end.record()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def run(seq_lens: list[int], backends: list[str], warmup: int, iters: int) -> list[dict]:
    rows = []
    for seq in seq_lens:
        batch = TOKENS // seq
        lens = doc_lens(batch, seq)
        for case in CASES:
            window = WINDOW if "window" in case else None
            docs = lens if "documents" in case else None
            flops = 3.5 * 4 * HEAD_DIM * HEADS * pairs(batch, seq, window, docs)
            auto = resolve_backend("auto", torch.device("cuda"), window is not None or docs is not None)
            row = {"seq": seq, "batch": batch, "case": case, "auto": auto, "results": {}}
            for backend in backends:
                try:
                    ms = time_case(backend, batch, seq, window, docs, warmup, iters)
                    row["results"][backend] = {"ms": ms, "tflops": flops / ms / 1e9}
                except Exception as e:  # a backend that refuses the case or fails is reported, not timed
                    row["results"][backend] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"}
                    torch.cuda.empty_cache()
                print(json.dumps({k: row[k] for k in ("seq", "case")} | {backend: row["results"][backend]}), flush=True)
            rows.append(row)
    return rows


def table(rows: list[dict], backends: list[str]) -> str:
    lines = ["| seq | case | " + " | ".join(backends) + " | auto picks |", "|---|---|" + "---|" * (len(backends) + 1)]
    for r in rows:
        cells = []
        for b in backends:
            res = r["results"][b]
            cells.append(f"{res['tflops']:.0f}" if "tflops" in res else "n/a")
        lines.append(f"| {r['seq']} | {r['case']} | " + " | ".join(cells) + f" | {r['auto']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="4096,8192")
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: bench_attention times GPU kernels; no CUDA device is visible", file=sys.stderr)
        return 2
    backends = args.backends.split(",")
    rows = run([int(s) for s in args.seq_lens.split(",")], backends, args.warmup, args.iters)
    print(f"\n{torch.cuda.get_device_name(0)}, torch {torch.__version__}; forward+backward TFLOP/s over allowed pairs")
    print(table(rows, backends))
    for r in rows:
        for b, res in r["results"].items():
            if "error" in res:
                print(f"{r['seq']} {r['case']} {b}: {res['error']}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
