"""Actor ranks (`rl.actor_ranks` N): the last N ranks of the launch only generate; the others train under ZeRO-3.

    deepspeed --hostfile hostfile scripts/pretrain.py --config rl.yaml --set rl.actor_ranks=2 --set rl.async_steps=1

Roles are decided before anything else starts (`split_roles`, called by `scripts/pretrain.py` through
`olmo_ds.train.objective.actor_role`): of the launcher's W ranks, ranks 0 .. W-N-1 are the learners, and for them the
launch is rewritten to a world of W-N ranks (WORLD_SIZE), so the trainer, DeepSpeed and the data loader see only
learners and run exactly as a W-N rank run does. Ranks W-N .. W-1 are actors: they never build a DeepSpeed engine;
each holds a plain `OLMo` in the decode dtype and one `olmo_ds.model.decode.Decoder`, and runs `actor_loop`.

Learners and actors meet on a link of their own (`Link`): a TCP store at MASTER_ADDR, port MASTER_PORT + 1 (hosted by
learner 0), and two process groups on it:
- the store carries the small messages an actor reads between two decode forwards without waiting: each learner's
  prompts of a step (`prompts/<step>/<learner>`), learner 0's word that a step's weights are coming
  (`step/<step>`), and the word to stop;
- `weights` (NCCL on GPUs, gloo on CPU; learner 0 and the actors): the policy's weights, once per step, in ONE
  broadcast of a flat buffer in the decode dtype from learner 0, which gathered them from ZeRO-3 (`flat_weights`);
- `objects` (gloo, every rank): a step's samples, from the actors to every learner (`all_gather_objects`).

A step s (`ActorClient.draw`, from `RLObjective.rollout`; the weights have had s updates, "version s"): every learner
posts its prompts of the steps not yet posted, up to s + `rl.async_steps` (the loader gives any step's prompts:
`prompts_at`); learner 0 says step s and broadcasts version s's weights; then every learner waits for step s's samples.
An actor (`_Actor`), between any two decode forwards: starts receiving weights a step announced and, once they are in,
copies them into its decode copy in place (`Decoder.load_weights`: the sequences in flight keep their cache and go on
under the new weights); submits the prompts of step t once its weights are version t - A or newer, so that no sample
trains more than A versions after it started (A = `rl.async_steps`); and sends its share of step s's samples once they
have all finished and the learners have said step s. Each actor draws a contiguous share of a step's (prompt, sample)
pairs in the step's global prompt order (`group_share`), keyed by (step, prompt, sample) as a colocated rank keys them
(`rollout.sample_requests`).

At A = 0 an actor submits step s's prompts only once it holds version s, so every token of step s is drawn by
version s: the samples are the colocated run's, bit for bit on CPU, where decoding is batch-invariant (1 actor + 2
learners against 2 colocated ranks: tests/train/test_rl_ranks.py). At A >= 1 the actors decode the next steps' samples
while the learners train, and new weights land between two forwards whenever the broadcast completes: which tokens a
version draws depends on timing, so such a run is not reproducible token for token (as open-instruct's actors are
not), and a resume regenerates the steps ahead from the checkpoint's weights (the actors' queues are not saved).
Costs and what each layout buys: docs/training.md, "Actor ranks".
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import sys
import time
from dataclasses import dataclass

import torch

from olmo_ds.data.dataset import Prompt
from olmo_ds.eval.rl import stop_ids
from olmo_ds.model import OLMo
from olmo_ds.model.decode import Decoder, GenerationInterrupted, Sampling
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.train.config import ConfigError
from olmo_ds.train.rl.rollout import group_share, sample_requests

log = logging.getLogger("olmo_ds")

LINK_ENV = "OLMO_DS_RL_LINK"  # set by `split_roles` on every rank: "learners,actors,rank" of the whole launch
TIMEOUT = datetime.timedelta(minutes=30)  # a collective of the link waits this long (a learner's update, a long rollout)
POLL_S = 0.002  # an idle actor looks for news this often


@dataclass(frozen=True)
class Role:
    actor: bool
    rank: int  # in the whole launch
    learners: int
    actors: int


def split_roles(actor_ranks: int, environ: dict | None = None, where: str = "rl.actor_ranks") -> Role | None:
    """This rank's role in a launch with `actor_ranks` actors (None without actors). A learner's WORLD_SIZE is rewritten
    to the learners' count (the trainer's world); an actor's is left as launched. Refuses N >= the launch's ranks."""
    env = os.environ if environ is None else environ
    if not actor_ranks:
        return None
    if LINK_ENV in env:  # split already (a second call in the same process)
        learners, actors, rank = (int(x) for x in env[LINK_ENV].split(","))
        return Role(rank >= learners, rank, learners, actors)
    world, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    if actor_ranks >= world:
        raise ConfigError(f"{where} {actor_ranks}: the launch has {world} rank{'s' * (world != 1)}, and at least one must "
                          f"learn; launch more ranks (deepspeed --num_gpus / the hostfile's slots) or lower {where}")
    learners = world - actor_ranks
    env[LINK_ENV] = f"{learners},{actor_ranks},{rank}"
    if rank < learners:
        env["WORLD_SIZE"] = str(learners)
    return Role(rank >= learners, rank, learners, actor_ranks)


class Link:
    """The learners' and actors' store and process groups (module docstring), at MASTER_PORT + 1."""

    def __init__(self, role: Role, device: torch.device):
        env = os.environ
        world = role.learners + role.actors
        self.store = torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]) + 1, world, role.rank == 0,
                                                timeout=TIMEOUT)
        self.role = role
        self.messages = torch.distributed.PrefixStore("messages", self.store)
        self.objects = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("objects", self.store), role.rank, world, TIMEOUT)
        self.weights = None  # learner 0 is its rank 0, actor a its rank 1 + a; other learners are not in it
        if role.rank == 0 or role.actor:
            wrank = 0 if role.rank == 0 else 1 + role.rank - role.learners
            wstore = torch.distributed.PrefixStore("weights", self.store)
            if device.type == "cuda":
                self.weights = torch.distributed.ProcessGroupNCCL(wstore, wrank, 1 + role.actors)
            else:
                self.weights = torch.distributed.ProcessGroupGloo(wstore, wrank, 1 + role.actors, TIMEOUT)

    def all_gather_objects(self, obj) -> list:
        """Every rank's `obj` on the objects group, in link-rank order (learners, then actors)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        n = self.objects.size()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
        self.objects.allgather([sizes], [torch.tensor([data.numel()])]).wait()
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[:data.numel()] = data
        parts = [torch.empty(longest, dtype=torch.uint8) for _ in range(n)]
        self.objects.allgather([parts], [padded]).wait()
        return [pickle.loads(p[:int(s)].numpy().tobytes()) for p, s in zip(parts, sizes)]

    def broadcast_weights(self, flat: torch.Tensor):
        """Learner 0's `flat` into every actor's (the same shape and dtype), one broadcast; returns its work (`.wait()`,
        `.is_completed()`)."""
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        return self.weights.broadcast([flat], opts)

    def has(self, *keys: str) -> bool:
        return self.messages.check(list(keys))


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters and buffers (its state dict, in order) as one flat tensor of their dtype."""
    return torch.cat([t.reshape(-1) for t in model.state_dict().values()])


def unflat(model: torch.nn.Module, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    """`flat_weights`'s inverse: the model's state dict as views of `flat`."""
    out, at = {}, 0
    for name, t in model.state_dict().items():
        out[name] = flat[at:at + t.numel()].view_as(t)
        at += t.numel()
    return out


class ActorClient:
    """A learner's side of the link: `draw` gets a step's samples from the actors (module docstring)."""

    def __init__(self, role: Role, device: torch.device, ahead: int = 0, prompts_at=None):
        self.role, self.link, self.ahead, self.prompts_at = role, Link(role, device), ahead, prompts_at
        self.posted = -1  # the last step whose prompts this learner posted
        self.stats: dict = {}  # the last draw's: the actors' decode rows and slots, their wait for weights, staleness

    def draw(self, policy, prompts: list[Prompt], *, step: int, samples_per_prompt: int) -> list[dict]:
        """The samples of this rank's `prompts` at `step`: one dict per (prompt, sample), prompt-major, with the decode
        engine's tokens, logprobs, finish, text and versions. `policy`: learner 0's gathered decode copy (None elsewhere)."""
        link, me = self.link, self.role.rank
        if me == 0 and self.posted < 0:
            link.messages.set("first", str(step).encode())
        for t in range(max(self.posted + 1, step), step + self.ahead + 1):
            part = prompts if t == step else self.prompts_at(t)
            link.messages.set(f"prompts/{t}/{me}", pickle.dumps([(p.index, list(p.ids)) for p in part]))
            self.posted = t
        if me == 0:
            link.messages.set(f"step/{step}", b"1")
            flat = flat_weights(policy)
            link.broadcast_weights(flat).wait()
            del flat
        parts = link.all_gather_objects(None)
        if me == 0:  # every actor took them before it could send this step's samples
            for r in range(self.role.learners):
                link.messages.delete_key(f"prompts/{step}/{r}")
            link.messages.delete_key(f"step/{step}")
        got = {(s["place"], s["sample"]): s for part in parts if part for s in part["samples"]}
        actors = [part for part in parts if part]
        self.stats = {"decode_rows": sum(a["decode_rows"] for a in actors), "slot_steps": sum(a["slot_steps"] for a in actors),
                      "weights_wait": max(a["weights_wait"] for a in actors)}
        first = me * len(prompts)
        return [got[(first + j, k)] for j in range(len(prompts)) for k in range(samples_per_prompt)]

    def close(self) -> None:
        """The run is over: learner 0 tells the actors to stop."""
        if self.role.rank == 0:
            self.link.messages.set("stop", b"1")


class _Actor:
    """An actor's decoder and what it knows of the learners' steps (module docstring)."""

    def __init__(self, cfg, role: Role, link: Link, policy: OLMo, tokenizer):
        rl = self.rl = cfg.rl
        self.role, self.link, self.policy, self.me = role, link, policy, role.rank - role.learners
        self.decoder = Decoder(policy, slots=rl.generation_batch_size, max_len=cfg.batch.seq_len,
                               sampling=Sampling(temperature=rl.temperature, top_p=rl.top_p, seed=rl.seed),
                               stop_ids=stop_ids(tokenizer), tokenizer=tokenizer)
        self.flat = torch.empty_like(flat_weights(policy))
        self.version: int | None = None  # the step whose weights the decoder holds (None: none yet)
        self.receiving: tuple[int, object] | None = None  # (step, the broadcast's work) while weights come in
        self.next_weights: int | None = None  # the next step whose weights to take (None: the first announced)
        self.prompts: dict[int, list[Prompt]] = {}  # step -> its prompts in global order, read and not yet submitted
        self.next_submit: int | None = None
        self.share: dict[int, int] = {}  # step submitted -> pairs of this actor's share
        self.done: dict[int, list] = {}  # step -> its finished samples of this actor's share
        self.next_reply: int | None = None
        self.weights_wait = 0.0  # since the last reply: time idle, waiting for the learners' next weights
        self.rows0 = self.slots0 = 0
        self._asked = 0.0  # when `_news` last asked the store

    def serve(self) -> int:
        link = self.link
        while True:
            if link.has("stop"):
                return 0
            self._take_weights()
            self._take_prompts()
            self._submit()
            if self.next_reply is not None and self.share.get(self.next_reply) == len(self.done.get(self.next_reply, ())) \
                    and link.has(f"step/{self.next_reply}"):
                self._reply(self.next_reply)
                continue
            if self.decoder.pending:
                try:  # one finishing forward a run: an interruption (news) before a forward loses nothing finished
                    for key, completion in self.decoder.run(until=lambda: True, interrupt=self._news):
                        self.done.setdefault(key[0], []).append((key, completion))
                except GenerationInterrupted:
                    pass
            else:  # nothing to decode until the learners' next weights (and with them the next step's prompts)
                t0 = time.perf_counter()
                time.sleep(POLL_S)
                self.weights_wait += time.perf_counter() - t0

    def _news(self) -> bool:
        """Asked before every decode forward: whether weights came in, or a step was said (the store is asked at most
        every POLL_S), so that `serve` looks before the next forward."""
        if self.receiving is not None:
            return self.receiving[1].is_completed()
        now = time.perf_counter()
        if now - self._asked < POLL_S:
            return False
        self._asked = now
        step = self.next_weights
        return step is not None and self.link.has(f"step/{step}")

    def _take_weights(self) -> None:
        if self.receiving is not None and self.receiving[1].is_completed():
            step, work = self.receiving
            work.wait()
            self.decoder.load_weights(unflat(self.policy, self.flat))
            self.decoder.version = self.version = step
            self.receiving, self.next_weights = None, step + 1
        if self.receiving is None:
            if self.next_weights is None and self.link.has("first"):  # the first step the learners draw (a resume's too)
                self.next_weights = int(self.link.messages.get("first"))
            step = self.next_weights
            if step is not None and self.link.has(f"step/{step}"):
                self.receiving = (step, self.link.broadcast_weights(self.flat))
                if self.next_submit is None:
                    self.next_submit = self.next_reply = step

    def _take_prompts(self) -> None:
        if self.next_submit is None:
            return
        t = max([self.next_submit - 1, *self.prompts]) + 1
        while all(self.link.has(f"prompts/{t}/{r}") for r in range(self.role.learners)):
            self.prompts[t] = [Prompt(ids, None, None, index) for r in range(self.role.learners)
                               for index, ids in pickle.loads(self.link.messages.get(f"prompts/{t}/{r}"))]
            t += 1

    def _submit(self) -> None:
        rl, g = self.rl, self.rl.samples_per_prompt
        while self.version is not None and self.next_submit in self.prompts and self.next_submit <= self.version + rl.async_steps:
            t = self.next_submit
            prompts = self.prompts.pop(t)
            share = group_share(len(prompts) * g, self.role.actors, self.me)
            pairs = [(prompts[k // g], k % g) for k in share]
            self.share[t] = len(pairs)
            if pairs:
                self.decoder.submit(sample_requests(pairs, step=t, seed=rl.seed, max_new_tokens=rl.max_new_tokens, stop=rl.stop),
                                    keys=[(t, k // g, k % g) for k in share])
            self.next_submit = t + 1

    def _reply(self, step: int) -> None:
        stats = self.decoder.stats
        samples = [{"place": key[1], "sample": key[2], "tokens": list(c.tokens), "logprobs": [float(x) for x in c.logprobs],
                    "finish": c.finish, "text": c.text or "", "versions": tuple(c.versions)} for key, c in self.done.pop(step, [])]
        self.link.all_gather_objects({"samples": samples, "decode_rows": stats["decode_rows"] - self.rows0,
                                      "slot_steps": stats["slot_steps"] - self.slots0, "weights_wait": self.weights_wait})
        self.rows0, self.slots0, self.weights_wait = stats["decode_rows"], stats["slot_steps"], 0.0
        del self.share[step]
        self.next_reply = step + 1


def actor_loop(cfg, role: Role) -> int:
    """An actor rank's life (module docstring): until the learners say stop. Returns the process's exit status."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokenizer = load_tokenizer(cfg.tokenizer)
    with torch.device("meta"):
        policy = OLMo(cfg.model.build(vocab_size=tokenizer.vocab_size))
    policy = policy.to_empty(device=device).to(dtype).eval()
    link = Link(role, device)
    log.info("rl: actor rank %d (actor %d of %d) ready", role.rank, role.rank - role.learners + 1, role.actors)
    try:
        return _Actor(cfg, role, link, policy, tokenizer).serve()
    except KeyboardInterrupt:  # the launcher's Ctrl-C reaches every rank: the learners save, the actors just stop
        print(f"actor rank {role.rank}: interrupted", file=sys.stderr, flush=True)
        return 130
    except RuntimeError as e:  # a learner died or stopped answering: nothing of an actor needs saving
        print(f"error: actor rank {role.rank}: the link to the learners broke ({str(e).splitlines()[0][:200]}); stopping",
              file=sys.stderr, flush=True)
        return 3
