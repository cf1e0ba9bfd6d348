"""`scripts/eval.py`'s work: evaluate checkpoints of a run (or an exported model) and report.

Order of work: resolve every target, load the tokenizer, read and check every task file and data
source, and only then load weights and run the model, so bad input fails in seconds. Inputs are
tokenized once per tokenizer and reused for every checkpoint evaluated (`--all-checkpoints`).

Launched by torchrun (or deepspeed) the evaluation set is split across the ranks; rank 0 writes
results.json, TensorBoard and the comparison, and prints the table.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from olmo_ds import checkpoint as ckpt
from olmo_ds import weights
from olmo_ds.chat import ChatEncoder, load_chat_template
from olmo_ds.checkpoint.reference import PairLogprobs, ReferenceCacheError, load_reference, reference_dir, reference_exists
from olmo_ds.data.dataset import TokenSource
from olmo_ds.data.loader import validation_batches
from olmo_ds.eval import olmes_suite
from olmo_ds.eval import results as res
from olmo_ds.eval.generative import GenerativeTask, Progress, evaluate_generative, is_generative, load_generative
from olmo_ds.eval.multiple_choice import PreparedTasks, evaluate_tasks, prepare_tasks
from olmo_ds.eval.perplexity import TextSource, conversation_batches, evaluate_perplexity, load_source, token_byte_lengths, window_batches
from olmo_ds.eval.preference import compute_pair_logprobs, evaluate_preference
from olmo_ds.eval.rl import Decoding, RLSource, evaluate_prompts, is_rl_source, load_rl_source
from olmo_ds.eval.scoring import DistContext, check_batching
from olmo_ds.eval.tasks import Task, load_task, resolve_task
from olmo_ds.model import OLMo
from olmo_ds.model.config import INIT_CHANGEABLE
from olmo_ds.model.decode import sequences_that_fit
from olmo_ds.ranks import check_host, rendezvous


@dataclass
class EvalOptions:
    target: str  # checkpoint dir, run dir, or exported model dir
    data: list[str] = field(default_factory=list)  # NAME=PATH or PATH; empty = the run's validation sources
    tasks: list[str] = field(default_factory=list)  # task paths or names, the suite olmes-core, or generative KIND[=SOURCE]
    task_dirs: list[str] = field(default_factory=list)  # where task names are looked up (default: $OLMO_DS_TASK_DIRS)
    out: str | None = None
    all_checkpoints: bool = False
    skip_evaluated: bool = False  # with all_checkpoints: leave out checkpoints that already have results.json
    seq_len: int | None = None  # default: the model's max_seq_len
    batch_tokens: int | None = None  # padded tokens per forward; default by device
    max_tokens: int | None = None  # per perplexity source
    limit: int | None = None  # questions per task
    uncond: bool = False
    device: str | None = None
    dtype: str | None = None  # float32 | bfloat16 | float16; default float32 on CPU, bfloat16 on GPU
    backend: str = "olmo"
    text_field: str = "text"
    tensorboard: bool = True
    batching: str = "packed"  # packed | exact (olmo_ds.eval.loglikelihood)
    gen_batch_size: int | None = None  # sequences generated at once (generative tasks); default 64 on GPU, 8 on CPU
    chat_template: str | None = None  # generative tasks: a template (olmo3, a file) or "none"; default: the checkpoint's
    reference: str | None = None  # preference sources: the starting model to compare with (default: the run's cache)
    samples: int = 1  # RL prompt sources: answers a prompt (> 1: pass@k, needs temperature > 0)
    temperature: float = 0.0  # RL prompt sources: 0 = greedy (the in-loop evaluation's solve rate)
    seed: int = 0  # RL prompt sources, sampled: keys every sample's stream with (prompt, sample)
    max_new_tokens: int | None = None  # RL prompt sources: default the run's rl.max_new_tokens


def _init_distributed(device_name: str | None) -> tuple[DistContext, torch.device]:
    """As training starts (olmo_ds/ranks.py): this host's ranks against its GPUs before any CUDA call, then a
    rendezvous with a short timeout whose store becomes the process group's."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_name:
        device = torch.device(device_name)
    elif torch.cuda.is_available():
        check_host(rank, local_rank, world, torch.cuda.device_count())  # one GPU per local rank: it must exist
        device = torch.device(f"cuda:{local_rank}")
    else:
        device = torch.device("cpu")
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        store = rendezvous(rank, world, pg_timeout=timedelta(minutes=30))  # torch's default for a process group
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    return DistContext.current(), device


def _default_sources(train_config: dict) -> list[str]:
    """The run's validation sources: `data.val_sources`, else each training source's `val/` split, each named as the
    in-loop evaluation names it (its `name`, else its directory's), so offline and in-loop tags are the same."""
    data = train_config.get("data", {})
    specs = [f"{s.get('name') or Path(s['path']).name}={s['path']}" for s in data.get("val_sources", [])]
    if specs:
        return specs
    for s in data.get("sources", []):
        val = Path(s["path"]) / "val"
        if (val / "manifest.json").is_file():
            specs.append(f"{s.get('name') or Path(s['path']).name}={val}")
    return specs


def _targets(options: EvalOptions) -> list[tuple[str, Path]]:
    """(kind, directory) of each target: the one given, resolved, or every checkpoint of its run."""
    path = Path(options.target)
    if options.all_checkpoints:
        if not (path / ckpt.CHECKPOINTS).is_dir():
            raise ValueError(f"--all-checkpoints needs a run directory (with {ckpt.CHECKPOINTS}/), got {path}")
        found = ckpt.list_checkpoints(ckpt.checkpoints_dir(path))
        if not found:
            raise FileNotFoundError(f"{path}: no complete checkpoint under {ckpt.CHECKPOINTS}/")
        targets = [("checkpoint", d) for _, d in found]
        if options.skip_evaluated:
            targets = [(k, d) for k, d in targets if not (_out_dir(options, k, d, True) / res.RESULTS).is_file()]
        return targets
    return [weights.resolve_weights(path)]


def _dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"--dtype must be float32, bfloat16 or float16, got {name!r}") from None


def _out_dir(options: EvalOptions, kind: str, directory: Path, multiple: bool) -> Path:
    """`--out` (a step-N folder in it per checkpoint when there are several); else RUN/eval/step-N
    for a checkpoint of a run, else DIR/eval."""
    if options.out:
        return Path(options.out) / directory.name if multiple else Path(options.out)
    run_dir = ckpt.run_dir_of(directory) if kind == "checkpoint" else None
    return run_dir / res.EVAL_DIR / directory.name if run_dir else directory / res.EVAL_DIR


@dataclass
class _Inputs:
    """Everything tokenized for one tokenizer, reused by every checkpoint that shares it."""

    sources: list[TextSource]
    tasks: PreparedTasks | None
    token_bytes: np.ndarray
    generative: list[GenerativeTask] = field(default_factory=list)
    rl: list[RLSource] = field(default_factory=list)  # RL prompt sources: answered and scored by their verifiers


def _prepare_inputs(options: EvalOptions, target: weights.Provenance, tokenizer, tasks: list[Task],
                    generative: list[GenerativeTask]) -> _Inputs:
    specs = options.data
    if not specs and target.kind == "checkpoint":
        specs = _default_sources(target.train_config)
    rl = [load_rl_source(s, tokenizer) for s in specs if is_rl_source(s)]
    sources = [load_source(s, tokenizer, max_tokens=options.max_tokens, text_field=options.text_field) for s in specs if not is_rl_source(s)]
    names = [s.name for s in [*sources, *rl]]
    if len(set(names)) != len(names):
        raise ValueError(f"--data: two sources are named alike ({', '.join(names)}); name them with NAME=PATH")
    clash = sorted({s.name for s in rl} & {g.name for g in generative})
    if clash:
        raise ValueError(f"--data {clash[0]}=...: an RL prompt source is named as the generative task {clash[0]}, whose outputs file "
                         f"it would share; name it otherwise with NAME=PATH")
    if not rl and (options.samples != 1 or options.temperature or options.seed or options.max_new_tokens is not None):
        raise ValueError("--samples, --temperature, --seed and --max-new-tokens apply to RL prompt sources (shards of prepare_data.py "
                         "--format rl), and --data names none")
    if not sources and not rl and not tasks and not generative:
        raise ValueError(f"{target.directory}: nothing to evaluate: give --data (validation shards, RL prompt shards or JSON lines) "
                         "and/or --tasks")
    prepared = prepare_tasks(tokenizer, tasks, uncond=options.uncond, limit=options.limit) if tasks else None
    return _Inputs(sources, prepared, token_byte_lengths(tokenizer), generative, rl)


def _rl_decoding(options: EvalOptions, target: weights.Provenance, rl: list[RLSource], device: torch.device) -> Decoding | None:
    """How RL prompts are answered, settled before any weights load: the run's `rl.max_new_tokens` and
    `rl.generation_batch_size` (the in-loop evaluation's) unless `--max-new-tokens` / `--gen-batch-size` say otherwise,
    greedy unless `--temperature`; a prompt whose answer would not fit the model's window is refused here."""
    if not rl:
        return None
    if options.backend != "olmo":
        raise ValueError(f"--data {rl[0].name}={rl[0].path}: RL prompts are answered by our decode engine, which runs our OLMo: "
                         f"leave out --backend {options.backend}")
    trained = (target.train_config or {}).get("rl") or {}
    max_new = options.max_new_tokens or trained.get("max_new_tokens")
    if max_new is None:
        raise ValueError(f"--data {rl[0].name}={rl[0].path}: RL prompts need a new-token limit: {target.directory} is not from an RL "
                         "run (no rl.max_new_tokens in its config); pass --max-new-tokens N")
    batch = options.gen_batch_size or trained.get("generation_batch_size") or (64 if device.type == "cuda" else 8)
    decoding = Decoding(max_new_tokens=max_new, batch_size=batch, samples=options.samples, temperature=options.temperature,
                        seed=options.seed)
    window = target.cfg.max_seq_len
    for source in rl:
        if source.longest + max_new > window:
            raise ValueError(f"--data {source.name}={source.path}: its longest prompt ({source.longest} tokens) and {max_new} new tokens "
                             f"exceed the model's window of {window}; pass --max-new-tokens {window - source.longest} or less")
    return decoding


def _rl(loaded: weights.LoadedModel, source: RLSource, decoding: Decoding, dist_ctx: DistContext) -> tuple[dict, list[dict], dict]:
    """An RL prompt source's metrics (`olmo_ds.eval.rl`, as the in-loop evaluation computes them), its per-prompt records
    and this rank's generation stats. The batch is cut to what the KV cache holds on every rank: the ranks deal out
    waves of one batch size."""
    model, tokenizer = loaded.model, loaded.tokenizer
    param = next(model.parameters())
    fit = min(dist_ctx.all_gather(sequences_that_fit(model.cfg, source.longest + decoding.max_new_tokens, param.dtype, param.device)))
    if fit < decoding.batch_size:
        decoding = dataclasses.replace(decoding, batch_size=max(1, fit))
    result = evaluate_prompts(model, source.prompts, tokenizer=tokenizer, decoding=decoding, dist_ctx=dist_ctx,
                              progress=Progress(source.name) if dist_ctx.rank == 0 else None)
    metrics = {**result.metrics, "prompts": len(source.prompts), "verifiers": source.verifiers, "path": str(source.path),
               "kind": source.kind, "decoding": decoding.describe(), "outputs": f"{source.name}.outputs.jsonl"}
    return metrics, result.records, result.stats


def _load_model(target: weights.Provenance, device: torch.device, dtype: torch.dtype, backend: str, dist_ctx: DistContext) -> weights.LoadedModel:
    """`weights.load_model` on every rank, the files read once: with several ranks only rank 0 reads and
    consolidates the weights and broadcasts them, as eight ranks of one node would otherwise hold eight
    fp32 copies in host memory at once. Evaluation is the one place that runs a plain model (no
    DeepSpeed engine) on several ranks, so this stays here rather than in `olmo_ds.weights`."""
    if dist_ctx.world == 1 or backend != "olmo":
        return weights.load_model(target, device=device, dtype=dtype, backend=backend)
    loaded, error = None, None
    if dist_ctx.rank == 0:
        try:
            loaded = weights.load_model(target, device=device, dtype=dtype)
        except (ValueError, FileNotFoundError) as e:
            error = e
    # Every rank described the target itself; only rank 0's error (or none) travels: it stops every rank alike.
    box = [error]
    torch.distributed.broadcast_object_list(box, src=0)
    if box[0] is not None:
        raise box[0]
    if dist_ctx.rank != 0:
        with torch.device("meta"):  # no random initialisation of weights about to be overwritten
            model = OLMo(target.cfg).to(dtype)
        loaded = weights.LoadedModel(model.to_empty(device=device), weights.own_tokenizer(target), target)
    with torch.no_grad():
        for tensor in loaded.model.state_dict().values():
            torch.distributed.broadcast(tensor, src=0)
    loaded.model.eval()
    return loaded


def _chat_encoder(options: EvalOptions, target, tokenizer) -> ChatEncoder | None:
    """The chat template generative tasks go through: --chat-template's (none: plain text), else the one saved
    with the weights or their tokenizer, else none. Resolved with the tokenizer, before any weight is loaded."""
    if options.chat_template == "none":
        return None
    if options.chat_template is not None:
        try:
            template = load_chat_template(options.chat_template, tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise type(e)(f"--chat-template {options.chat_template}: {e} (or 'none' for plain text)") from None
    else:
        template = weights.chat_template_of(target, tokenizer)
    return ChatEncoder(template, tokenizer) if template is not None else None


def _evaluate(loaded: weights.LoadedModel, inputs: _Inputs, options: EvalOptions, dist_ctx: DistContext,
              batch_tokens: int, references: dict[str, _Reference], chat: ChatEncoder | None = None,
              decoding: Decoding | None = None) -> tuple[dict, dict, dict, dict]:
    """(perplexity per source, metrics per task, stats, per-example outputs of generative tasks and RL prompt
    sources) of one loaded model; stats["preference"] and stats["rl"] hold those sources' metrics."""
    max_len = loaded.provenance.cfg.max_seq_len  # the model's window: longer inputs are truncated from the left
    seq_len = options.seq_len or max_len
    if seq_len > max_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's window {max_len}")
    ppl, pref = {}, {}
    for source in inputs.sources:
        rows = max(1, batch_tokens // seq_len)
        if source.kind == "preference":  # at the run's row length: the pairs its reference pass kept
            pair_len = _pair_len(options, loaded.provenance)
            pref[source.name] = _preference(loaded, source, pair_len, max(1, batch_tokens // pair_len), references[source.name],
                                            dist_ctx)
            continue
        batches = (conversation_batches(source.path, seq_len, rows, options.max_tokens) if source.kind == "conversations"
                   else window_batches(source.tokens, seq_len, rows))
        r = evaluate_perplexity(loaded.model, batches, inputs.token_bytes, dist_ctx=dist_ctx, batching=options.batching).to_dict()
        ppl[source.name] = {**r, "path": str(source.path), "kind": source.kind, "documents": source.documents, "seq_len": seq_len}
    rl, outputs, rl_stats = {}, {}, {"requests": 0, "new_tokens": 0, "seconds": 0.0}
    for source in inputs.rl:
        rl[source.name], outputs[source.name], st = _rl(loaded, source, decoding, dist_ctx)
        rl_stats = {k: rl_stats[k] + st[k] for k in rl_stats}
    task_metrics, stats = {}, {"preference": pref, "rl": rl}
    if rl:
        stats["rl_generation"] = {**rl_stats, "new_tokens_per_second": rl_stats["new_tokens"] / max(rl_stats["seconds"], 1e-9)}
    if inputs.tasks is not None:
        mc = evaluate_tasks(loaded.model, loaded.tokenizer, inputs.tasks, dist_ctx.rank, dist_ctx.world, max_len=max_len,
                            batch_tokens=batch_tokens, batching=options.batching)
        if dist_ctx.rank == 0 and mc.stats["truncated_contexts"]:
            per_task = ", ".join(f"{name} {r['truncated_contexts']}" for name, r in mc.tasks.items() if r["truncated_contexts"])
            print(f"eval: warning: {mc.stats['truncated_contexts']} contexts longer than the model's window of {max_len} tokens "
                  f"were cut from the left ({per_task})", file=sys.stderr, flush=True)
        task_metrics, stats = mc.tasks, {**stats, "tasks": mc.stats}
    if inputs.generative:
        device = next(loaded.model.parameters()).device
        batch = options.gen_batch_size or (64 if device.type == "cuda" else 8)
        gen = evaluate_generative(loaded.model, loaded.tokenizer, inputs.generative, chat=chat, dist_ctx=dist_ctx,
                                  batch_size=batch, limit=options.limit)
        task_metrics, stats, outputs = {**task_metrics, **gen.tasks}, {**stats, "generation": gen.stats}, {**outputs, **gen.outputs}
    return ppl, task_metrics, stats, outputs


def _pair_len(options: EvalOptions, target: weights.Provenance) -> int:
    """The row length preference pairs are packed into: `--seq-len`, else the run's `batch.seq_len` (the pairs its
    reference pass kept), within the model's window."""
    trained = (target.train_config or {}).get("batch", {}).get("seq_len")
    return options.seq_len or min(trained or target.cfg.max_seq_len, target.cfg.max_seq_len)


def _dpo_settings(target: weights.Provenance) -> dict:
    """The loss's settings: the run's `dpo:` section's (dpo, beta 0.1 for a model that has none)."""
    dpo = (target.train_config or {}).get("dpo") or {}
    return {"loss": dpo.get("loss", "dpo"), "beta": dpo.get("beta", 0.1), "label_smoothing": dpo.get("label_smoothing", 0.0),
            "simpo_gamma": dpo.get("simpo_gamma", 0.0)}


@dataclass
class _Reference:
    """Where a preference source's reference comes from, settled before any weights load: the run's cache of it
    (`pairs`), a pass of `--reference`'s weights (`model`, described, set to read rows as the run did), or none (simpo)."""

    origin: str
    pairs: PairLogprobs | None = None
    model: weights.Provenance | None = None


def _references(options: EvalOptions, target: weights.Provenance, sources: list[TextSource]) -> dict[str, _Reference]:
    """Each preference source's `_Reference`, or the error that stops the evaluation, before any weights load.

    `--reference`: its weights are read with the run's context where the run changed it against them
    (`init_from.allow_changes`: max_seq_len, RoPE scaling), as training's init_from read them into the run's model;
    else rows longer than its window are refused here, naming both. Without it: the run's cache (RUN/reference/)
    of the same pairs, found by the source's content fingerprint under whatever name `--data` gives it."""
    pref = [s for s in sources if s.kind == "preference"]
    if not pref:
        return {}
    if _dpo_settings(target)["loss"] == "simpo":
        return {s.name: _Reference("none (simpo)") for s in pref}
    if options.reference:
        return {s.name: _Reference(f"{options.reference} (a pass of it)", model=model)
                for model in [_reference_model(options, target, pref)] for s in pref}
    cache_dir = reference_dir(target.run_dir) if target.run_dir is not None else None
    if cache_dir is None or not reference_exists(cache_dir):
        source = pref[0]
        raise ValueError(f"--data {source.name}={source.path}: a preference source needs a reference: {target.directory} "
                         f"has no run's reference cache{f' ({cache_dir})' if cache_dir else ''}; pass --reference PATH "
                         f"(the model it started from)")
    try:
        cache = load_reference(cache_dir)
    except ReferenceCacheError as e:
        raise ValueError(str(e)) from None
    found = {}
    for source in pref:
        data = TokenSource(source.path)
        match = cache.val_for(data.content_fingerprint(), source.name, data.num_pairs)
        if match is None:
            held = ", ".join(f"{k} ({v.num_pairs} pairs)" for k, v in cache.val.items()) or "none"
            how = ("this cache predates fingerprints (format 1) and is matched by name and pair count: name the source as the "
                   "run did (--data NAME=PATH)" if cache.identity.val is None else "it is matched by the pairs' content, whatever the name")
            raise ValueError(f"{cache_dir}: no reference for the {data.num_pairs} pairs of --data {source.name}={source.path} (the cache "
                             f"has the run's validation sources: {held}; {how}). For other pairs pass --reference PATH (the model "
                             f"the run started from)")
        name, pairs = match
        found[source.name] = _Reference(str(cache_dir) if name == source.name else f"{cache_dir} (as {name})", pairs=pairs)
    return found


def _reference_model(options: EvalOptions, target: weights.Provenance, pref: list[TextSource]) -> weights.Provenance:
    """`--reference`'s weights, described (no tensor read), with the fields the run changed against its starting model
    (`init_from.allow_changes`) taken from the run's model: the model training computed its reference with."""
    try:
        reference = weights.describe_weights(options.reference)
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"--reference {options.reference}: {e}") from None
    allowed = set(((target.train_config or {}).get("init_from") or {}).get("allow_changes") or []) & set(INIT_CHANGEABLE)
    taken = {f: getattr(target.cfg, f) for f in sorted(allowed) if getattr(reference.cfg, f) != getattr(target.cfg, f)}
    if taken:
        reference = dataclasses.replace(reference, cfg=dataclasses.replace(reference.cfg, **taken))
    pair_len = _pair_len(options, target)
    if pair_len > reference.cfg.max_seq_len:
        names = " ".join(f"{s.name}={s.path}" for s in pref)
        raise ValueError(f"--reference {options.reference}: its model.max_seq_len is {reference.cfg.max_seq_len}, but the pairs of "
                         f"--data {names} are read in rows of {pair_len} tokens ({'--seq-len' if options.seq_len else f'{target.directory}: batch.seq_len'}), "
                         f"and {target.directory} records no init_from.allow_changes [max_seq_len] that would read it at {pair_len}. "
                         f"Pass the model the run started from as --reference, or --seq-len {reference.cfg.max_seq_len} (pairs "
                         f"longer than that are dropped and counted)")
    return reference


def _preference(loaded: weights.LoadedModel, source: TextSource, seq_len: int, rows: int, reference: _Reference,
                dist_ctx: DistContext) -> dict:
    """A preference source's metrics (`olmo_ds.eval.preference`), its pairs packed whole into rows of `seq_len` (longer
    pairs dropped and counted), against its `_Reference`: a pass of the starting model over the same pairs, or the
    run's cache of this source (`RUN/reference/`, written by the run's reference pass)."""
    settings = _dpo_settings(loaded.provenance)
    device = next(loaded.model.parameters()).device

    def batches():
        return validation_batches(str(source.path), seq_len, rows, dist_ctx.rank, dist_ctx.world, long_pairs="drop")

    pairs = reference.pairs
    if reference.model is not None:
        starting = weights.load_model(reference.model, device=device, dtype=next(loaded.model.parameters()).dtype,
                                      tokenizer=loaded.tokenizer)  # the pairs' ids are the evaluated model's
        pairs, _ = compute_pair_logprobs(starting.model, batches(), TokenSource(source.path).num_pairs, device)
        del starting
    metrics = evaluate_preference(loaded.model, batches(), pairs.lookup if pairs is not None else None, device=device, **settings)
    return {**metrics, "dpo": settings, "reference": reference.origin, "path": str(source.path), "kind": "preference", "seq_len": seq_len}


def _load_tasks(options: EvalOptions) -> tuple[list[Task], list[GenerativeTask], list[str]]:
    """Every task of `--tasks` (a path, a name in the task dirs, the suite olmes-core, or a generative task),
    each record checked: the multiple-choice ones, the generative ones, and what each argument resolved to."""
    tasks, generative, sources = [], [], []
    for spec in options.tasks:
        if is_generative(spec):
            task = load_generative(spec)
            if any(g.name == task.name for g in generative):
                raise ValueError(f"--tasks: {task.name} is given twice ({spec})")
            generative.append(task)
            sources.append(task.source)
            continue
        if spec == olmes_suite.SUITE_NAME and not Path(spec).exists():
            tasks += olmes_suite.load_suite()
            sources.append(spec)
            continue
        path = resolve_task(spec, [Path(d) for d in options.task_dirs])
        tasks.append(load_task(path))
        sources.append(str(path))
    return tasks, generative, sources


def _suites(tasks: list[Task], task_metrics: dict[str, dict]) -> dict:
    """The suite tables of the suites whose tasks were scored; each member's metrics get its place in
    the suite ("olmes": task, formulation, shots[, subtask]), so results.json alone rebuilds the table."""
    members = [t for t in tasks if t.config.get("suite") == olmes_suite.SUITE_NAME and t.name in task_metrics]
    if not members:
        return {}
    for t in members:
        task_metrics[t.name]["olmes"] = t.config["olmes"]
    datasets = {f"{t.config['repo']}/{t.config['config']}": {"revision": t.config["revision"], "commit": t.config["commit"]} for t in members}
    return {olmes_suite.SUITE_NAME: {"rows": olmes_suite.suite_rows(task_metrics), "datasets": datasets}}


def run(options: EvalOptions) -> list[dict]:
    """Evaluate every target; returns each target's results document (on every rank)."""
    check_batching(options.batching)
    if options.gen_batch_size is not None and options.gen_batch_size < 1:
        raise ValueError(f"--gen-batch-size must be >= 1, got {options.gen_batch_size}")
    dist_ctx, device = _init_distributed(options.device)
    dtype = _dtype(options.dtype, device)
    batch_tokens = options.batch_tokens or (32768 if device.type == "cuda" else 4096)
    is_main = dist_ctx.rank == 0

    targets = _targets(options)
    if not targets and is_main:
        print("eval: every checkpoint of the run already has results (--skip-evaluated)", file=sys.stderr, flush=True)
    tasks, generative, task_sources = _load_tasks(options)  # every record checked before any weight is loaded
    if options.chat_template is not None and not generative:
        raise ValueError(f"--chat-template {options.chat_template}: it applies to generative tasks (gsm8k, ifeval), and "
                         "--tasks names none")
    inputs_for: dict[str, _Inputs] = {}  # by tokenizer fingerprint: nothing is tokenized twice
    documents = []
    for kind, directory in targets:
        # A directory `_targets` resolved resolves to itself; the tokenizer beside it is loaded here, once.
        target = weights.describe_weights(directory)
        tokenizer = weights.own_tokenizer(target)
        if tokenizer.fingerprint not in inputs_for:
            inputs_for[tokenizer.fingerprint] = _prepare_inputs(options, target, tokenizer, tasks, generative)
        references = _references(options, target, inputs_for[tokenizer.fingerprint].sources)
        chat = _chat_encoder(options, target, tokenizer) if generative else None
        decoding = _rl_decoding(options, target, inputs_for[tokenizer.fingerprint].rl, device)
        loaded = _load_model(target, device, dtype, options.backend, dist_ctx)
        ppl, task_metrics, stats, outputs = _evaluate(loaded, inputs_for[tokenizer.fingerprint], options, dist_ctx, batch_tokens,
                                                      references, chat, decoding)
        preference, rl = stats.pop("preference"), stats.pop("rl")
        suites = _suites(tasks, task_metrics)

        labels = {"path": str(target.directory), "kind": target.kind, "run_dir": str(target.run_dir) if target.run_dir else None,
                  "step": target.step, "tokens_seen": target.tokens_seen, "tokenizer": str(tokenizer.path),
                  "tokenizer_fingerprint": tokenizer.fingerprint}
        config = {"eval": {**asdict(options), "device": str(device), "dtype": str(dtype).replace("torch.", ""), "world_size": dist_ctx.world,
                           "batch_tokens": batch_tokens, "tasks": task_sources},
                  "model": target.cfg.to_dict(), "train": target.train_config}
        document = res.build_results(target=labels, perplexity=ppl, tasks=task_metrics, stats=stats, config=config, suites=suites,
                                     preference=preference, rl=rl)
        if is_main:
            path = res.write_results(_out_dir(options, kind, directory, len(targets) > 1), document, outputs)
            if options.tensorboard and target.run_dir is not None and target.step is not None:
                res.write_tensorboard(target.run_dir / res.TB_DIR, target.step, res.scalars(ppl, task_metrics) | res.suite_scalars(suites)
                                      | res.preference_scalars(preference) | res.rl_scalars(rl))
            print(res.markdown(document), flush=True)
            print(f"\nresults: {path}", flush=True)
        documents.append(document)
        del loaded

    if is_main and not options.out:
        run_dirs = {Path(d["run_dir"]) for d in documents if d["run_dir"]} | ({Path(options.target)} if options.all_checkpoints else set())
        for run_dir in sorted(run_dirs):
            table, png = res.compare_run(run_dir)
            if png is not None:
                print(f"\n**{run_dir}: evaluated checkpoints**\n\n{table}\n\nplot: {png}", flush=True)
    if dist.is_initialized():
        dist.barrier()
    return documents
