"""Everything a run decides before a DeepSpeed engine exists: `plan_run(cfg, resume=..., start_over=...) -> RunPlan`.

    plan = plan_run(load_config("configs/demo.yaml"), resume="auto")   # every refusal happens here
    Trainer(plan).fit()                                                # olmo_ds/train/trainer.py

In the order it runs: the run dir is claimed and, on rank 0, locked for the process's life (`claim_run_dir`:
one live run per run dir) and the launch checked; the tokenizer and the
data are opened and checked against the config and each other (`check_run`); the resume point is found (the
run's own checkpoint wins over `init_from`); `init_from`'s weights are described and checked
(`check_init_from`); the DeepSpeed JSON is read once and resolved, with `batch.micro_batch_size: auto` chosen
between its ZeRO section and its batch fields (`plan_deepspeed`); the checkpoint or optimizer state the run
continues is checked against all that (`check_resume`); and the data loader is put at the checkpoint's
position (`restore_data_position`). Both checks of a model against the state it takes over follow one rule,
`olmo_ds.model.config.model_differences`.

Why a plan: a run that cannot work must fail in seconds, before a process group, a model or a 1,000-GPU
allocation exists, with a `ConfigError` naming both sides of the mismatch; and what was decided is then one
typed record that the trainer, the memory estimate and the tools read, instead of each re-reading the JSON.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from olmo_ds import checkpoint as ckpt
from olmo_ds.checkpoint import METRICS
from olmo_ds import weights
from olmo_ds.data.loader import DataLoader
from olmo_ds.model.config import INIT_CHANGEABLE, ModelConfig, model_differences
from olmo_ds.tokenizer import Tokenizer, load_tokenizer, same_tokenizer
from olmo_ds.train.config import ConfigError, TrainConfig
from olmo_ds.train.ds_config import ZeroLayout, device_type, fill_train_fields, optimizer_op, read_ds_config, resolve_zero
from olmo_ds.train.evaluation import InLoopEvaluator, val_sources
from olmo_ds.train.launch import DistEnv, detect_environment, normalize_cuda_arch_list
from olmo_ds.train.objective import build_evaluator
from olmo_ds.train.memory import MicroBatchChoice, choose_micro_batch
from olmo_ds.train.metrics import roll_back_metrics, setup_console_logging
from olmo_ds.train.parallel import ParallelLayout
from olmo_ds.train.preference import reference_identity
from olmo_ds.train.preflight import check_launch
from olmo_ds.checkpoint.reference import ReferenceCacheError, load_reference, reference_dir, reference_exists
from olmo_ds.train.run_lock import RunDirLock, lock_run_dir

log = logging.getLogger("olmo_ds")


@dataclass(frozen=True)
class DeepSpeedPlan:
    """The run's DeepSpeed config, resolved once (`plan_deepspeed`): `config` is the dict DeepSpeed is given and
    every checkpoint records; the rest is what olmo-ds itself reads of it."""

    config: dict
    zero: ZeroLayout  # ZeRO stage, reduce bucket, what CPU offload puts on the host
    micro_batch: MicroBatchChoice
    accumulation_steps: int  # at step 0 (a batch-size schedule raises it later; RL: 1, each rollout sets its own)
    precision: str
    optimizer_op: str | None  # the op builder deepspeed.initialize runs for the optimizer (`ds_config.optimizer_op`)


@dataclass
class RunPlan:
    """What `plan_run` decided: everything `Trainer(plan)` needs besides the engine it builds."""

    cfg: TrainConfig  # batch.micro_batch_size is a number here
    env: DistEnv
    layout: ParallelLayout  # data parallel x sequence parallel
    run_dir: Path
    model: ModelConfig
    tokenizer: Tokenizer | None
    loader: DataLoader  # at the resume point's data position, or at the start
    deepspeed: DeepSpeedPlan
    resume_dir: Path | None  # the checkpoint this run continues; None for a new run
    resume_state: dict | None  # its train_state.json
    init_from: weights.Provenance | None  # the weights a new run starts from (`init_from`); None when resuming
    init_state_fingerprint: str | None  # with init_from.load_optimizer: the source's train_state.json's, recorded by the run
    evaluator: object | None  # InLoopEvaluator, or the objective's own (`objective.build_evaluator`)
    run_lock: RunDirLock | None = None  # rank 0's lock on the run dir (`claim_run_dir`), held while the process lives

    @property
    def rank(self) -> int:
        return self.env.rank

    def abandon(self) -> None:
        """This start ends before training (Ctrl-C or an error while the engine is built or the reference computed):
        rank 0 gives up the run dir as a refused start does (`RunDirLock.abandon`); other ranks hold nothing."""
        if self.run_lock is not None:
            self.run_lock.abandon()

    @property
    def world_size(self) -> int:
        return self.env.world_size


def plan_run(cfg: TrainConfig, *, resume: str | None = None, start_over: bool = False, env: DistEnv | None = None) -> RunPlan:
    """Check and decide everything about the run `cfg` describes that needs no engine (module docstring).
    `resume`: None, "auto" or a checkpoint directory (`--resume`); `env`: rank and world size (default: the launcher's)."""
    env = env or detect_environment()
    setup_console_logging(env.rank)
    normalize_cuda_arch_list()  # before DeepSpeed builds any op; logs what it changed
    for warning in cfg.warnings():
        log.warning(warning)
    run_dir = Path(cfg.run_dir)
    run_lock = claim_run_dir(run_dir, resume, start_over, env.rank)
    try:
        return _plan(cfg, env, run_dir, run_lock, resume)
    except BaseException:
        if run_lock is not None:  # a refused start leaves the run dir as it found it
            run_lock.abandon()
        raise


def _plan(cfg: TrainConfig, env: DistEnv, run_dir: Path, run_lock: RunDirLock | None, resume: str | None) -> RunPlan:
    check_launch(cfg, env.rank, env.local_rank, env.world_size)
    layout = ParallelLayout.of(cfg, rank=env.rank, world_size=env.world_size)
    tokenizer, loader = open_tokenizer_and_data(cfg, layout)
    vocab = tokenizer.vocab_size if tokenizer is not None else loader.vocab_size
    model = cfg.model.build(vocab_size=vocab)
    check_run(cfg, model, loader, tokenizer, env.world_size)
    for warning in split_template_warnings(loader):
        log.warning(warning)
    check_rl(cfg, loader, tokenizer)

    # The run's own checkpoint is where a continued run starts; weights from elsewhere (`init_from`)
    # may only seed a run that has none, so they are consulted after this, never instead.
    resume_dir, resume_state = find_resume_point(resume, run_dir)
    init_from = None
    if cfg.init_from.path and resume_state is not None:
        log.info("resuming %s: init_from %s is not used (a run's own checkpoint wins)", resume_dir, cfg.init_from.path)
    elif cfg.init_from.path:
        init_from = check_init_from(cfg, model, tokenizer if tokenizer is not None else loader.tokenizer_fingerprint)
    load_optimizer = init_from is not None and cfg.init_from.load_optimizer

    cfg, deepspeed = plan_deepspeed(cfg, model, layout.dp_size, resumed=resume_state.get("ds_config") if resume_state else None)
    if resume_state is not None:
        check_resume(resume_state, model, env.world_size, resume_dir, deepspeed.zero)
        restore_data_position(loader, resume_dir, resume_state)
        saved_sp = resume_state.get("sequence_parallel_size", 1)
        if saved_sp != layout.sp_size:  # checkpoints do not depend on it (olmo_ds/train/parallel.py)
            log.info("resuming %s, saved at parallel.sequence_parallel_size %d, at %d", resume_dir, saved_sp, layout.sp_size)
    elif load_optimizer:  # the optimizer state must fit as a resume's would
        check_resume(init_from.train_state, model, env.world_size, init_from.directory, deepspeed.zero,
                     frozenset(cfg.init_from.allow_changes))
    check_preference(cfg, loader, run_dir, resume_dir, resume_state)
    evaluator = None
    if cfg.eval.every:  # RL prompts: greedy answers scored by the verifiers
        # every rank its own validation prompts, the ranks of a sequence group too (generation is per rank)
        evaluator = build_evaluator(cfg, tokenizer, env.rank, env.world_size) or InLoopEvaluator(cfg, tokenizer, vocab, env.rank,
                                                                                                  env.world_size)
    if env.rank == 0 and resume not in (None, "none"):  # last: a refused resume moves nothing
        continue_metrics(run_dir, resume_state["step"] if resume_state else 0, resume_dir)
    if layout.sp_size > 1:
        log.info("parallel: %s", layout.describe())
    return RunPlan(cfg=cfg, env=env, layout=layout, run_dir=run_dir, model=model, tokenizer=tokenizer, loader=loader, deepspeed=deepspeed,
                   resume_dir=resume_dir, resume_state=resume_state, init_from=init_from,
                   init_state_fingerprint=_file_fingerprint(init_from.directory / ckpt.TRAIN_STATE) if load_optimizer else None,
                   evaluator=evaluator, run_lock=run_lock)


def check_preference(cfg: TrainConfig, loader: DataLoader, run_dir: Path, resume_dir: Path | None, resume_state: dict | None) -> None:
    """Preference data and the `dpo:` section come together, and the reference is decided: a resume reuses the run's
    cache, verified here against the data and the starting model its checkpoint records (never recomputed); a new
    run needs `init_from` (the starting model is the reference) and computes it once its weights are loaded
    (`olmo_ds.train.preference.prepare_reference`, which reuses a cache it verifies, e.g. of a start that stopped
    before its first checkpoint)."""
    where = cfg.source
    sources = ", ".join(s.path for s in cfg.data.sources)
    if loader.preference and cfg.dpo is None:
        raise ConfigError(f"{where}: data.sources ({sources}) are preference pairs, which train with DPO: add a dpo: section "
                          f"(e.g. dpo: {{loss: dpo, beta: 0.1}}; docs/training.md, 'Preference-tune a fine-tuned model')")
    if cfg.dpo is None:
        return
    if not loader.preference:
        raise ConfigError(f"{where}: the dpo: section needs preference data, but data.sources ({sources}) are "
                          f"{'fine-tuning conversations' if loader.masked else 'pretraining text'}; prepare pairs with "
                          f"prepare_data.py --format preference, or remove dpo:")
    if not cfg.dpo.needs_reference:
        return
    cache = reference_dir(run_dir)
    if resume_state is not None:
        if not reference_exists(cache):
            raise ConfigError(f"{cache}: missing, but {resume_dir} continues a dpo.loss {cfg.dpo.loss} run; a resume never recomputes "
                              f"the reference (the weights are no longer the starting model's): restore {cache}")
        started = (resume_state.get("init_from") or {}).get("fingerprint") or ""
        try:
            load_reference(cache, reference_identity(cfg, loader.fingerprint, started))
        except ReferenceCacheError as e:
            raise ConfigError(f"{cfg.source}: resuming {resume_dir}: {e}") from None
        log.info("reference: %s verified against %s; the resume reuses it", cache, resume_dir)
    elif not cfg.init_from.path:
        raise ConfigError(f"{where}: dpo.loss {cfg.dpo.loss} compares the policy with the model it starts from: set init_from.path "
                          f"to an SFT checkpoint or released weights (or use dpo.loss simpo, which has no reference)")


def check_rl(cfg: TrainConfig, loader: DataLoader, tokenizer: Tokenizer | None) -> None:
    """RL prompts and the `rl:` section come together; the verifiers need the tokenizer (they read the samples' text,
    and `check_run` has checked it is the data's); in-loop evaluation has validation prompts (`check_rl_eval`); every
    prompt leaves room for `rl.max_new_tokens` in a row."""
    where = cfg.source
    sources = ", ".join(s.path for s in cfg.data.sources)
    prompts = bool(getattr(loader, "prompts", False))
    if prompts and cfg.rl is None:
        raise ConfigError(f"{where}: data.sources ({sources}) are RL prompts, which train with GRPO: add an rl: section "
                          f"(e.g. rl: {{samples_per_prompt: 8, max_new_tokens: 512}}; docs/training.md, 'Reinforcement learning "
                          f"with verifiable rewards (GRPO)')")
    if cfg.rl is None:
        return
    if not prompts:
        raise ConfigError(f"{where}: the rl: section needs RL prompts, but data.sources ({sources}) are not: prepare them with "
                          f"prepare_data.py --format rl, or remove rl:")
    if tokenizer is None:
        raise ConfigError(f"{where}: rl needs `tokenizer` (the one the prompts were prepared with): the verifiers score the "
                          f"samples' decoded text")
    if cfg.eval.every:
        check_rl_eval(cfg)
    longest, source = max(((int(s.prompt_len.max()), s.directory) for s in loader.sources if len(s.prompt_len)),
                          default=(0, None), key=lambda x: x[0])
    if longest + cfg.rl.max_new_tokens > cfg.batch.seq_len:
        raise ConfigError(f"{where}: a prompt of {longest} tokens ({source}) plus rl.max_new_tokens {cfg.rl.max_new_tokens} "
                          f"exceeds batch.seq_len {cfg.batch.seq_len} (a prompt and its sample are one training row): raise "
                          f"batch.seq_len to {longest + cfg.rl.max_new_tokens}, lower rl.max_new_tokens, or prepare the prompts "
                          f"with a lower --max-tokens")


def check_rl_eval(cfg: TrainConfig) -> None:
    """An RL run's in-loop evaluation (`eval.every` > 0) has validation prompts to answer, as pretraining's has rows
    to score (`InLoopEvaluator`): prompts, not `eval.tasks`, which it does not run."""
    where, every = cfg.source, cfg.eval.every
    if cfg.eval.tasks:
        raise ConfigError(f"{where}: eval.tasks ({', '.join(cfg.eval.tasks)}) with rl: an RL run's in-loop evaluation answers "
                          f"validation prompts greedily and scores them with their verifiers; it runs no eval.tasks. Remove "
                          f"eval.tasks (score tasks afterwards: bash scripts/eval.sh RUN)")
    if not val_sources(cfg):
        sources = ", ".join(s.path for s in cfg.data.sources)
        raise ConfigError(f"{where}: eval.every is {every} but there is nothing to evaluate: no RL prompt source ({sources}) has "
                          f"a validation split (SOURCE/val/, which `prepare_data.py --format rl --val-fraction 0.01` writes) and "
                          f"data.val_sources is empty. Prepare the prompts with --val-fraction, set data.val_sources, or turn "
                          f"in-loop evaluation off with --set eval.every=0")


def claim_run_dir(run_dir: Path, resume: str | None, start_over: bool, rank: int) -> RunDirLock | None:
    """Refuse to start a second run in a run directory that holds one, unless told what to do with it; on rank 0,
    lock it for this process's life (`olmo_ds.train.run_lock`), so that no second start or resume runs beside a live one.

    A run dir holds a run when it has any checkpoint directory, `metrics.jsonl` or `wandb_id`
    (`olmo_ds.checkpoint.run_markers`). Then `--resume` continues that run; `--start-over` moves it
    aside (rank 0, before any rank writes) and starts a new one; neither is an error that changes no file.
    Two runs therefore never share metrics, a W&B id or checkpoint names. A live run's lock is checked first,
    so a dir in use is refused as such (naming the holder) whatever the flags; `--start-over` moves a run
    aside only under the lock. Returns rank 0's lock (None on other ranks).
    """
    if start_over and resume not in (None, "none"):
        raise ConfigError(f"--start-over and --resume {resume} exclude each other: one starts a new run, the other continues one")
    lock = lock_run_dir(run_dir) if rank == 0 else None
    try:
        if _claim(run_dir, resume, start_over, rank) and lock is not None:
            lock.release()  # it moved aside with the old run; the new run dir gets its own
            lock = lock_run_dir(run_dir)
    except BaseException:
        if lock is not None:
            lock.release()  # a refused start leaves the lock file as it found it
        raise
    if lock is not None:
        lock.record()
    return lock


def _claim(run_dir: Path, resume: str | None, start_over: bool, rank: int) -> bool:
    """`claim_run_dir`'s decision; True when rank 0 moved an earlier run aside."""
    markers = ckpt.run_markers(run_dir)
    if not markers:
        return False
    if start_over:
        if rank == 0:
            moved = ckpt.move_run_aside(run_dir)
            log.info("--start-over: moved the earlier run in %s to %s", run_dir, moved)
            return True
        return False
    held = f"run_dir {run_dir} already holds a run ({', '.join(markers[:4])}{', ...' if len(markers) > 4 else ''})"
    if resume in (None, "none"):
        raise ConfigError(f"{held}; continue it with --resume auto, or start a new run there with --start-over "
                          f"(moves the old one to {run_dir.name}.replaced-<time>, deletes nothing), or choose another run_dir")
    if resume != "auto" and ckpt.checkpoints_dir(run_dir).resolve() != Path(resume).resolve().parent:
        raise ConfigError(f"--resume {resume}: a checkpoint of another run, and {held}; resume it into a new run_dir, "
                          f"or start over here with --start-over (and without --resume)")
    return False


def continue_metrics(run_dir: Path, step: int, resume_dir: Path | None) -> None:
    """A run continued from `step` (0: `--resume auto` found no checkpoint) logs each step once: metrics.jsonl lines
    past it, from a process that went on after its last checkpoint, are moved aside (`metrics.roll_back_metrics`)."""
    rolled = roll_back_metrics(run_dir, step)
    if rolled is not None:
        aside, lines, steps = rolled
        log.info("%s: %d line%s (%s) logged after %s moved to %s; the run logs those steps again", run_dir / METRICS, lines,
                 "s" if lines != 1 else "", steps, f"{resume_dir.name}, where the run continues" if resume_dir else
                 "its start (no complete checkpoint: the run starts again at step 1)", aside.name)


def open_tokenizer_and_data(cfg: TrainConfig, layout: ParallelLayout) -> tuple[Tokenizer | None, DataLoader]:
    """The run's tokenizer (None without `tokenizer`) and this rank's data loader (its data-parallel rank's rows: the
    ranks of a sequence group read the same ones); a missing or bad file is a ConfigError."""
    try:
        tokenizer = load_tokenizer(cfg.tokenizer) if cfg.tokenizer else None
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{cfg.source}: tokenizer: {e}") from None
    try:
        loader = DataLoader(cfg.data, seq_len=cfg.batch.seq_len, global_batch_size=cfg.batch.size_schedule(),
                            dp_rank=layout.dp_rank, dp_world_size=layout.dp_size)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"{cfg.source}: data: {e}") from None
    return tokenizer, loader


def check_run(cfg: TrainConfig, model: ModelConfig, loader: DataLoader, tokenizer: Tokenizer | None, world_size: int) -> None:
    """Cross-checks between the config, the model, the tokenizer and the data; each error names both sides."""
    manifest = loader.sources[0].directory / "manifest.json"
    if tokenizer is not None:
        if model.vocab_size < tokenizer.vocab_size:
            raise ConfigError(f"model vocab_size {model.vocab_size} is smaller than tokenizer vocab {tokenizer.vocab_size} ({cfg.tokenizer})")
        if not tokenizer.matches(loader.tokenizer_fingerprint):
            given = cfg.tokenizer if str(tokenizer.path) == str(cfg.tokenizer) else f"{cfg.tokenizer} (file {tokenizer.path})"
            prepared_with = loader.sources[0].manifest.extra.get("arguments", {}).get("tokenizer")
            raise ConfigError(
                f"tokenizer {given}, content {tokenizer.fingerprint}, is not the tokenizer the data was prepared with: "
                f"{manifest} records {loader.tokenizer_fingerprint}"
                + (f" (prepare_data.py --tokenizer {prepared_with})" if prepared_with else "")
                + "; re-tokenize the data or point `tokenizer` at the file it was prepared with"
            )
    if model.vocab_size < loader.vocab_size:
        raise ConfigError(f"model vocab_size {model.vocab_size} is smaller than tokenizer vocab {loader.vocab_size} ({manifest})")
    try:
        loader.check_vocab(model.vocab_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.batch.seq_len > model.max_seq_len:
        raise ConfigError(
            f"batch.seq_len {cfg.batch.seq_len} exceeds model.max_seq_len {model.max_seq_len} "
            f"(model preset {cfg.model.preset!r}); lower batch.seq_len or set model.max_seq_len"
        )
    log.info("%s", run_length(cfg, loader))


def split_template_warnings(loader: DataLoader) -> list[str]:
    """One line per source prepared with `--allow-split-template-tokens` (its manifest's `chat.split_template_tokens`
    lists the chat template's markers the tokenizer has no special id for): what that means for the model trained."""
    found = []
    for src in loader.sources:
        split = (src.manifest.extra.get("chat") or {}).get("split_template_tokens")
        if split:
            found.append(f"{src.directory}: prepared with --allow-split-template-tokens: its tokenizer has no special id for "
                         f"{', '.join(split)} (manifest.json chat.split_template_tokens), so each is several ordinary tokens at "
                         f"every turn: the model learns where a turn starts and ends as that text, not as one token, and a turn's end "
                         f"is no single id for generation to stop on. Meant only with a tokenizer that cannot have them; "
                         f"otherwise prepare the data again with one that has them (docs/troubleshooting.md)")
    return found


def run_length(cfg: TrainConfig, loader: DataLoader) -> str:
    """How much of the data `max_steps` reads, in epochs (SFT recipes are given in epochs: max_steps from them)."""
    epoch, schedule = loader.mixture.epoch_size, cfg.batch.size_schedule()
    total = schedule.instances_before(cfg.max_steps)
    first = schedule.at(0)
    what = "packed rows" if loader.masked else "instances"
    line = (f"max_steps {cfg.max_steps} reads {total:,} {what} of {cfg.batch.seq_len} tokens: {total / epoch:.2f} epochs of the "
            f"data (an epoch is {epoch:,} {what}")
    if len(schedule.points) > 1:
        return line + ")"
    return line + f", {epoch / first:,.2f} steps at global batch {first}: N epochs are max_steps = ceil(N x {epoch / first:,.2f}))"


def find_resume_point(resume: str | None, run_dir: Path) -> tuple[Path | None, dict | None]:
    """The checkpoint `resume` names ("auto": the run's newest complete one) and its train_state.json, or (None, None)."""
    try:
        resume_dir = ckpt.resolve_resume(resume, run_dir)
        return resume_dir, ckpt.read_train_state(resume_dir) if resume_dir else None
    except (FileNotFoundError, ValueError) as e:  # a bad --resume path, an interrupted save, a damaged train_state.json
        raise ConfigError(str(e)) from None


def restore_data_position(loader: DataLoader, resume_dir: Path, state: dict) -> None:
    """Put the loader right after the last batch the checkpoint trained on; other data or another seed is refused."""
    try:
        loader.load_state_dict(state["data"])
    except ValueError as e:  # different data or seed: a user decision, not a crash
        raise ConfigError(f"{resume_dir}: {e}") from None


def check_init_from(cfg: TrainConfig, model: ModelConfig, tokenizer: Tokenizer | str | None) -> weights.Provenance:
    """Describe `init_from`'s weights and check this run against them; every mismatch in one error."""
    spec = cfg.init_from
    try:
        info = weights.inspect_weights(spec.path)
    except (FileNotFoundError, ValueError, KeyError) as e:
        raise ConfigError(f"{cfg.source}: init_from.path: {e}") from None
    where = f"{cfg.source}: init_from.path {spec.path} ({info.kind} {info.directory})"
    if spec.load_optimizer and info.kind != "checkpoint":
        raise ConfigError(f"{where}: init_from.load_optimizer needs an olmo-ds checkpoint (its optimizer state); a {info.kind} holds "
                          f"weights only. Drop load_optimizer to start with a fresh optimizer")
    found = model_differences(info.cfg, model, allow_changes=set(spec.allow_changes), weights_only=True)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}  # named model.FIELD; the shapes compared instead, as they are
    diffs = [f"{'model.' + what if what in fields else what}: source {src!r}, this run {this!r}" for what, src, this in found]
    source_tokenizer = info.tokenizer if info.kind != "checkpoint" and info.tokenizer else info.tokenizer_fingerprint
    if source_tokenizer and tokenizer and not same_tokenizer(source_tokenizer, tokenizer):
        diffs.append(f"tokenizer: source {info.tokenizer_fingerprint}, this run {getattr(tokenizer, 'fingerprint', tokenizer)}")
    if diffs:
        changeable = any(what in INIT_CHANGEABLE for what, _, _ in found)
        raise ConfigError(f"{where} does not match this run: {'; '.join(diffs)}. Set the model section (or the tokenizer) to the "
                          f"source's" + (f"; a deliberate change of {', '.join(INIT_CHANGEABLE)} goes in init_from.allow_changes"
                                         if changeable else ""))
    return info


def plan_deepspeed(cfg: TrainConfig, model: ModelConfig, dp_world_size: int, *, ds: dict | None = None, device: str | None = None,
                   resumed: dict | None = None, memory: tuple[int | None, str] | None = None,
                   offload_env: dict | None = None) -> tuple[TrainConfig, DeepSpeedPlan]:
    """The DeepSpeed JSON read once and resolved for this run, and `cfg` with its micro-batch a number.

    The ZeRO section is resolved first (stage, buckets, offload sized to the node: `ds_config.resolve_zero`),
    so that `batch.micro_batch_size: auto` is chosen for the layout the run will have (`memory.choose_micro_batch`);
    then the batch fields are filled from the chosen number. `ds` replaces the file, `device` the run's device type,
    `memory` the device's (bytes, description) and `offload_env` what offload reads of the machine (tests);
    `resumed`: the DeepSpeed config the checkpoint being resumed saved (its offload choices and micro-batch are kept).
    `dp_world_size` ranks read rows, and `parallel.sequence_parallel_size` ranks hold each row: ZeRO partitions over both.
    """
    sp_size = cfg.parallel.sequence_parallel_size
    device = device or device_type()
    ds = read_ds_config(cfg, ds)
    host = resolve_zero(ds, cfg, model, dp_world_size * sp_size, device=device, offload_env=offload_env, resumed=resumed)
    zero = ZeroLayout.of(ds)
    # `batch.micro_batch_size: auto` becomes a number here, before anything reads it (olmo_ds/train/memory.py).
    micro_batch = choose_micro_batch(cfg, model, dp_world_size, zero, device=device, memory=memory,
                                     resumed_micro_batch=(resumed or {}).get("train_micro_batch_size_per_gpu"))
    if micro_batch.chosen_by != "config":
        log.info("%s", micro_batch.describe())
        cfg = cfg.with_micro_batch_size(micro_batch.size)
    if host is not None:
        log.info("%s: %s", cfg.deepspeed_config, host.describe())
    ds = exact_resume_optimizer(fill_train_fields(ds, cfg, dp_world_size), zero, device)
    return cfg, DeepSpeedPlan(config=ds, zero=zero, micro_batch=micro_batch, accumulation_steps=ds["gradient_accumulation_steps"],
                              precision=cfg.precision, optimizer_op=optimizer_op(ds, zero))


def exact_resume_optimizer(ds_config: dict, zero: ZeroLayout, device: str) -> dict:
    """On the CPU accelerator, train with torch's AdamW instead of DeepSpeed's CPU FusedAdam.

    DeepSpeed's CPU Adam kernel keeps beta**step in C++ state, multiplying it by beta once per step,
    and recomputes it with pow() after a restart, so the first update after a resume differs in the
    last bits and the run drifts from the uninterrupted one. torch's AdamW derives the bias correction
    from the step count in the optimizer state, which the checkpoint holds, so resume is bitwise exact.
    (GPUs use DeepSpeed's CUDA FusedAdam, which also computes it from the step; CPU offload must keep
    DeepSpeedCPUAdam, which DeepSpeed requires there.)
    """
    if device == "cpu" and not zero.optimizer_offloaded:
        ds_config["optimizer"]["params"].setdefault("torch_adam", True)
    return ds_config


def check_resume(state: dict, model: ModelConfig, world_size: int, ckpt_dir: Path, zero: ZeroLayout,
                 allow_changes: frozenset[str] = frozenset()) -> None:
    """The checkpoint (its train_state.json, `state`) fits this run, whose ZeRO layout is `zero`; a different
    data-parallel size is fine unless it cannot be converted. `allow_changes`: model fields a run started from
    this checkpoint's optimizer state may change (init_from)."""
    saved = ModelConfig.from_dict(state["model"])
    saved_values, values = saved.to_dict(), model.to_dict()
    diffs = [f"{what}: checkpoint {saved_values[what]!r}, config {values[what]!r}"
             for what, _, _ in model_differences(saved, model, allow_changes=allow_changes)]
    if diffs:
        raise ConfigError(f"{ckpt_dir}: the checkpoint's model differs from the configured one ({'; '.join(diffs)})")
    if state["world_size"] == world_size:
        return
    where = f"{ckpt_dir} was written by {state['world_size']} data-parallel ranks, this run has {world_size}"
    saved_stage = state.get("zero_stage")
    if saved_stage != zero.stage:
        raise ConfigError(f"{where} and ZeRO stage {zero.stage} (the checkpoint's is {saved_stage}); "
                          f"resume on another number of ranks with the checkpoint's ZeRO stage")
    if ZeroLayout.of(state.get("ds_config", {})).offloaded or zero.offloaded:
        # Refused rather than tried: loading DeepSpeed's universal form into the offloaded optimizer
        # (DeepSpeedCPUAdam, whose bias correction lives in C++ state) is not verified to resume correctly.
        raise ConfigError(f"{where}; a CPU-offloaded ZeRO run resumes only on its checkpoint's number of ranks "
                          f"(the universal-checkpoint conversion used for another size is not supported with offload)")


def _file_fingerprint(path: Path) -> str:
    return "sha256:" + hashlib.sha256(Path(path).read_bytes()).hexdigest()
