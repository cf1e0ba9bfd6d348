"""Evaluate a checkpoint, a run or an exported model: perplexity/bits-per-byte, multiple-choice and generative tasks.

    python scripts/eval.py runs/demo                                    # newest checkpoint, run's val shards
    python scripts/eval.py runs/demo/checkpoints/step-0000200 --tasks piqa_rc_0shot arc_easy_rc_0shot
    python scripts/eval.py runs/demo --tasks olmes-core                 # OLMES's ten tasks, RC and MC, 5-shot
    python scripts/eval.py runs/sft --tasks gsm8k ifeval                # generative: from the HF cache (openai/gsm8k, google/IFEval)
    python scripts/eval.py runs/sft --tasks gsm8k=my/gsm8k.jsonl        # ... or from local JSON lines in the dataset's layout
    python scripts/eval.py runs/base --tasks gsm8k:n8                   # OLMo 3's base-model GSM8K: 8 samples, pass@1
    python scripts/eval.py runs/sft --tasks gsm8k --chat-template olmo3 # through a chat template the weights do not carry
    python scripts/eval.py runs/demo --all-checkpoints                  # every checkpoint + comparison plot
    python scripts/eval.py runs/demo --all-checkpoints --skip-evaluated # only the new ones, then compare all
    python scripts/eval.py exported/ --data c4=data/c4-val.jsonl.gz     # a transformers directory, raw text
    python scripts/eval.py runs/rl                                      # an RL run: its validation prompts' greedy solve rate
    python scripts/eval.py runs/rl --data rl=data/rl/val --samples 8 --temperature 1.0   # pass@1 .. pass@8 per verifier
    torchrun --nproc_per_node 8 scripts/eval.py RUN --tasks ...         # split across GPUs, same numbers

Normally run through `bash scripts/eval.sh`, which picks the launcher.
"""

import argparse
import sys

from olmo_ds.eval.runner import EvalOptions, run
from olmo_ds.eval.tasks import TASK_DIRS_ENV


def parse_args(argv=None) -> EvalOptions:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", nargs="?", default="runs/demo", help="checkpoint dir (RUN/checkpoints/step-N), run dir (its newest checkpoint) or exported transformers dir (default: runs/demo)")
    p.add_argument("--data", nargs="+", action="extend", default=[], metavar="[NAME=]PATH",
                   help="perplexity sources: shard directories (or their parent with val/) or JSON-lines files tokenized on the fly; RL "
                        "prompt shards (prepare_data.py --format rl): each prompt answered and scored by its verifier (solve rate, "
                        "reward mean, per verifier); default: the run's validation sources")
    p.add_argument("--tasks", nargs="+", action="extend", default=[], metavar="TASK",
                   help="multiple-choice tasks: OLMES request directories, plain JSON-lines files, task names in --task-dir, "
                        "or olmes-core (the OLMES suite from the datasets in the HF cache; docs/evaluation.md); generative "
                        "tasks: gsm8k or ifeval, alone (the hub's dataset) or as KIND=FILE.jsonl / KIND=ORG/NAME, with options as "
                        "KIND:OPTION (gsm8k:n8: 8 samples at temperature 0.6, top-p 0.6, pass@1; gsm8k:answer-is: the answer "
                        "after 'So the answer is' instead of OLMES's last number)")
    p.add_argument("--task-dir", dest="task_dirs", action="append", default=None, metavar="DIR",
                   help=f"where task names are looked up (repeatable; default: ${TASK_DIRS_ENV}, paths separated by ':')")
    p.add_argument("--out", help="where results.json goes (default: RUN/eval/step-N/, or DIR/eval/ for an exported model)")
    p.add_argument("--all-checkpoints", action="store_true", help="evaluate every complete checkpoint of the run, then compare them")
    p.add_argument("--skip-evaluated", action="store_true", help="with --all-checkpoints: only checkpoints without a results.json yet")
    p.add_argument("--seq-len", type=int, help="perplexity window (default: the model's max_seq_len)")
    p.add_argument("--batch-tokens", type=int, help="padded tokens per forward pass (default: 4096 on CPU, 32768 on GPU)")
    p.add_argument("--max-tokens", type=int, help="evaluate at most this many tokens of each perplexity source")
    p.add_argument("--limit", type=int, help="score only the first N questions of each task")
    p.add_argument("--uncond", action="store_true", help="also score OLMES unconditional requests (acc_uncond)")
    p.add_argument("--device", help="default: cuda:LOCAL_RANK when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on CPU, bfloat16 on GPU")
    p.add_argument("--backend", choices=["olmo", "transformers"], default="olmo", help="for an exported dir: run our model (default) or transformers' class")
    p.add_argument("--text-field", default="text", help="JSON key of the text in JSON-lines sources")
    p.add_argument("--batching", choices=["packed", "exact"], default="packed",
                   help="packed (default): rows of one width in batches of one shape, compiled on GPU; exact: the earlier "
                        "batches of one exact context length, eager (the reference; same numbers up to float rounding)")
    p.add_argument("--gen-batch-size", type=int, metavar="N",
                   help="generative tasks and RL prompts: sequences decoded at once (default: an RL run's rl.generation_batch_size for "
                        "its prompts, else 64 on GPU, 8 on CPU; fewer where their KV cache would not fit)")
    p.add_argument("--chat-template", metavar="SPEC",
                   help="generative tasks: evaluate through this chat template (olmo3, a tokenizer_config.json or .jinja file), as "
                        "generate.py --chat-template; 'none' for plain text; default: the template saved with the weights or "
                        "their tokenizer, if any")
    p.add_argument("--reference", metavar="PATH",
                   help="preference sources: the model they are compared with (the DPO run's starting model; default: the run's "
                        "cached reference of its validation pairs)")
    p.add_argument("--samples", type=int, default=1, metavar="K",
                   help="RL prompt sources: K answers a prompt at --temperature, reported as pass@1, pass@2, pass@4, ... pass@K "
                        "(default 1: one greedy answer, the solve rate the run's in-loop evaluation logs)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="RL prompt sources: sampling temperature (default 0: greedy)")
    p.add_argument("--seed", type=int, default=0, help="RL prompt sources, sampled: the seed every (prompt, sample) stream is keyed with")
    p.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="RL prompt sources: an answer's new tokens at most (default: the run's rl.max_new_tokens; needed for a model "
                        "not from an RL run)")
    p.add_argument("--no-tensorboard", dest="tensorboard", action="store_false", help="do not add scalars to RUN/tb")
    a = p.parse_args(argv)
    return EvalOptions(
        target=a.target, data=a.data, tasks=a.tasks, task_dirs=a.task_dirs or [], out=a.out,
        all_checkpoints=a.all_checkpoints, skip_evaluated=a.skip_evaluated, seq_len=a.seq_len, batch_tokens=a.batch_tokens, max_tokens=a.max_tokens, limit=a.limit,
        uncond=a.uncond, device=a.device, dtype=a.dtype, backend=a.backend, text_field=a.text_field, tensorboard=a.tensorboard,
        batching=a.batching, gen_batch_size=a.gen_batch_size, reference=a.reference, chat_template=a.chat_template,
        samples=a.samples, temperature=a.temperature, seed=a.seed, max_new_tokens=a.max_new_tokens,
    )


def main(argv=None) -> int:
    options = parse_args(argv)
    try:
        run(options)
    except (ValueError, FileNotFoundError) as e:
        print(f"eval: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
