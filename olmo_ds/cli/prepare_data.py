"""Raw text (JSON lines, optionally gzip/zstd, .txt, or Parquet) → token shards + manifest.

    python scripts/prepare_data.py --input data/raw --output data/shards --tokenizer tokenizer.json --workers 8

Conversations (`messages` lists) → masked shards for fine-tuning:

    python scripts/prepare_data.py --format chat --chat-template olmo3 --input chats.jsonl --output data/sft --tokenizer dolma2-tokenizer.json

RL prompts (`messages` ending on a user turn, `ground_truth`, `dataset` naming the verifier) → prompt shards for GRPO:

    python scripts/prepare_data.py --format rl --chat-template olmo3 --input prompts.jsonl --output data/rl --tokenizer dolma2-tokenizer.json --max-tokens 512

Preference pairs (`chosen` and `rejected` conversations) → shards of pairs for DPO:

    python scripts/prepare_data.py --format preference --chat-template olmo3 --input prefs.jsonl --output data/dpo --tokenizer dolma2-tokenizer.json

See olmo_ds/data/prepare/pipeline.py for what the output promises; validate it with scripts/validate_shards.py.
"""

import argparse
import sys

from olmo_ds.fast_parse import FastParse, local_tokenizer_json  # the standard library only: see main


def _partition(text: str) -> tuple[int, int]:
    try:
        i, m = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected I/M, e.g. 0/16 for the first of 16 parts") from None
    if not (m >= 1 and 0 <= i < m):
        raise argparse.ArgumentTypeError(f"{text!r}: expected 0 <= I < M")
    return i, m


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help="files, directories (recursive) or globs: .jsonl, .jsonl.gz, .json.gz, .jsonl.zst, .txt, .parquet (needs pyarrow)")
    p.add_argument("--output", required=True, help="shard directory (created; a validation split goes to OUTPUT/val/)")
    p.add_argument("--tokenizer", required=True, help="HF tokenizer.json (or a directory holding one) or a sentencepiece .model")
    p.add_argument("--text-field", default="text", help="JSON key (Parquet: column) of the document text (default: text)")
    p.add_argument("--eos-token", default=None, help="token appended after every document (default: the tokenizer's EOS)")
    p.add_argument("--workers", type=int, default=1, help="cores that tokenize (default: 1); see --work-unit for how they share the work")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="close a shard before it would exceed this many tokens (default: 100,000,000)")
    p.add_argument("--val-fraction", type=float, default=0.0, help="fraction of documents, chosen by a hash of their text, written to OUTPUT/val/")
    p.add_argument("--dry-run", action="store_true", help="tokenize and report per-file counts; write nothing")
    p.add_argument("--verbose", action="store_true", help="print per-file counts as each file finishes")
    p.add_argument("--strict", action="store_true", help="stop at the first bad record (file:line) instead of skipping and counting it")
    p.add_argument("--overwrite", action="store_true", help="delete existing shards in OUTPUT and start over instead of resuming")
    p.add_argument("--tokenizer-backend", choices=("auto", "fast", "hf"), default="auto", help="auto (default): fastokens when it matches HF tokenizers on a sample of the input and an adversarial set, else HF with a warning; fast: fastokens or stop; hf: HF tokenizers only")
    p.add_argument("--match-special-tokens", action="store_true", help="match special-token text inside documents (a literal '<|endoftext|>') as the special token, as HF tokenizers does and olmo-ds did before; by default it is encoded as ordinary text so that EOS only ever ends a document")
    p.add_argument("--partition", type=_partition, default=None, metavar="I/M", help="prepare only part I of M (0-based) of the sorted input list, cut into M contiguous ranges of about equal bytes, into --output; join the M part directories with scripts/merge_shards.py (docs/data.md, 'Preparing a large corpus')")
    p.add_argument("--work-unit", choices=("auto", "files", "blocks"), default="auto", help="what a worker takes: files (whole files, decompressing them itself; the shards are cut from its pieces), blocks (~1 MiB blocks handed out by this process, which decompresses compressed files itself), or auto (default): files when there are at least 4 input files per worker; the output is the same bytes either way")
    p.add_argument("--format", choices=("text", "chat", "preference", "rl"), default="text", help="text (default): one document per record's --text-field; chat: one conversation per record's 'messages' list, rendered with a chat template, written as masked shards (a loss mask beside each shard; docs/data.md, 'Conversations'); preference: two conversations per record ('chosen', 'rejected'), each masked to its final reply, written as shards of pairs for DPO (docs/data.md, 'Preference pairs'); rl: one prompt per record ('messages' with the generation prompt appended), its 'ground_truth' checked by the verifier its 'dataset' names and kept beside the shard (docs/data.md, 'RL prompts')")
    p.add_argument("--chat-template", default=None, metavar="SPEC", help="--format chat: olmo3 (OLMo 3's template, built in), a tokenizer_config.json, a directory holding one or chat_template.jinja, or a Jinja file (default: the tokenizer_config.json beside --tokenizer, if it has a chat_template)")
    p.add_argument("--allow-split-template-tokens", action="store_true", help="--format chat or preference: prepare even though the tokenizer has no special token for some of the chat template's markers (e.g. <|im_start|>), each then split into ordinary tokens; refused by default (docs/troubleshooting.md)")
    p.add_argument("--mask", default=None, choices=("assistant", "all", "last"), help="--format chat: the tokens trained: every assistant turn (default), all turns, or the last assistant turn only")
    p.add_argument("--max-tokens", type=int, default=None, metavar="N", help="--format chat: conversations longer than N tokens are dropped or truncated (--long-conversations), counted; --format rl: prompts longer than N tokens are skipped and counted (prompt_too_long; --strict stops); --format preference: pairs longer than N tokens (both sides together) are refused or dropped (--long-pairs)")
    p.add_argument("--long-conversations", default=None, choices=("drop", "truncate"), help="--format chat with --max-tokens: drop (default) or truncate to the first N tokens, as open-instruct does (no EOS appended: the document then ends without EOS)")
    p.add_argument("--long-pairs", default=None, choices=("refuse", "drop"), help="--format preference with --max-tokens: refuse (default: the run stops, naming file:line) or drop (skipped and counted as too_long); a pair is never truncated")
    p.add_argument("--no-progress", action="store_true", help="no progress output (default: a bar when stderr is a terminal, else a plain line every --progress-every seconds, e.g. in a Slurm log)")
    p.add_argument("--progress-every", type=float, default=60.0, metavar="SECONDS", help="seconds between plain progress lines when stderr is not a terminal (default: 60)")
    a = p.parse_args(argv)
    # fastokens starts parsing the tokenizer.json now, so that the imports below (numpy, the readers, the tokenizer
    # module: ~0.2 s) and HF's load run while it does (`olmo_ds.fast_parse`). Chat formats and `--tokenizer-backend
    # hf` do not use it; a hub id or a directory without a tokenizer.json is resolved by `prepare` first.
    path = local_tokenizer_json(a.tokenizer) if a.format == "text" and a.tokenizer_backend != "hf" else None
    parse = FastParse(path) if path else None
    from olmo_ds.data.prepare.pipeline import PrepareConfig, PrepareError, prepare
    from olmo_ds.data.prepare.readers import CorruptInputError
    from olmo_ds.data.prepare.report import format_summary
    from olmo_ds.data.validate import format_report
    from olmo_ds.eval import verifiers

    cfg = PrepareConfig(
        inputs=a.input, output=a.output, tokenizer=a.tokenizer, text_field=a.text_field, workers=a.workers,
        shard_tokens=a.shard_tokens, val_fraction=a.val_fraction, eos_token=a.eos_token, dry_run=a.dry_run,
        verbose=a.verbose, strict=a.strict, overwrite=a.overwrite, progress=False if a.no_progress else None, progress_every=a.progress_every,
        tokenizer_backend=a.tokenizer_backend, match_special_tokens=a.match_special_tokens, partition=a.partition,
        work_unit=a.work_unit, format=a.format, chat_template=a.chat_template, chat_mask=a.mask, max_tokens=a.max_tokens,
        long_conversations=a.long_conversations, long_pairs=a.long_pairs, allow_split_template_tokens=a.allow_split_template_tokens,
        check_ground_truth=verifiers.check if a.format == "rl" else None,
    )
    try:
        result = prepare(cfg, parse=parse)
    except PrepareError as e:
        print(f"prepare_data: error: {e}", file=sys.stderr)
        return 2
    except CorruptInputError as e:  # found where decompression fails, maybe after hours of work
        print(f"prepare_data: error: {e}. Complete shards in {a.output} are kept", file=sys.stderr)
        return 1
    except OSError as e:  # mid-run: a full disk, a vanished input; what was written so far stays valid
        print(f"prepare_data: error: {e}. Complete shards in {a.output} are kept: fix this and rerun the same "
              f"command to resume", file=sys.stderr)
        return 1
    finally:
        if parse is not None:  # a run that stopped early (an error, a complete output): the parse ends before this process does
            parse.join()
    if not result.already_complete:
        print(format_summary(result, dry_run=a.dry_run))
    if result.validation is not None and not result.validation.ok:
        problems = [line for line in format_report(result.validation).splitlines() if "FAIL" in line or line.startswith("error:")]
        print(f"prepare_data: error: the output {a.output} failed validation:\n" + "\n".join(problems), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
