"""Actor ranks (`rl.actor_ranks` N): the last N ranks of the launch only generate; the others train under ZeRO-3.

    deepspeed --hostfile hostfile scripts/pretrain.py --config rl.yaml --set rl.actor_ranks=2     # 8 ranks: 6 learn, 2 act

Roles are decided before anything else starts (`split_roles`, called by `scripts/pretrain.py` through
`olmo_ds.train.objective.actor_role`): of the launcher's W ranks, ranks 0 .. W-N-1 are the learners, and for them the
launch is rewritten to a world of W-N ranks (WORLD_SIZE), so the trainer, DeepSpeed and the data loader see only
learners and run exactly as a W-N rank run does. Ranks W-N .. W-1 are actors: they never build a DeepSpeed engine;
they hold a plain `OLMo` in the decode dtype and run `actor_loop`.

Learners and actors meet on a link of their own (`Link`): a TCP store at MASTER_ADDR, port MASTER_PORT + 1 (hosted by
learner 0), and two process groups on it:
- `objects` (gloo, every rank: learners 0 .. L-1, then the actors): a step's prompts go to the actors and the samples
  come back, as pickled objects (`all_gather_objects`);
- `weights` (NCCL on GPUs, gloo on CPU; learner 0 and the actors): the policy's weights, once per step, in ONE
  broadcast of a flat buffer in the decode dtype from learner 0, which gathered them from ZeRO-3 (`flat_weights`).

A step (`ActorClient.draw`, from `RLObjective.rollout`): every learner sends its prompts (learner 0 also the step, or
the word to stop); learner 0 broadcasts the weights the step samples from; each actor draws its contiguous share of
the step's (prompt, sample) pairs in global prompt order (`group_share`), keyed by (step, prompt, sample) exactly as a
learner would (`rollout.sample_key`), so the samples are the ones a colocated run draws (bit for bit on CPU, where
decoding is batch-invariant); every learner takes its own prompts' samples back and goes on as a colocated rank:
scoring, advantages, packing, the update. With `rl.actor_ranks` the learners generate nothing and hold no decode copy.

Synchronous (`rl.async_steps` 0): the actors wait for each step's weights, the learners for the samples. What an actor
rank costs and buys: docs/training.md, "Actor ranks".
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
from olmo_ds.tokenizer import load_tokenizer
from olmo_ds.train.config import ConfigError
from olmo_ds.train.rl.rollout import group_share, sample_groups

log = logging.getLogger("olmo_ds")

LINK_ENV = "OLMO_DS_RL_LINK"  # set by `split_roles` on every rank: "learners,actors,rank" of the whole launch
TIMEOUT = datetime.timedelta(minutes=30)  # an actor waits this long for the next step's weights (a learner's update)


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
    """The learners' and actors' own process groups (module docstring), on a TCP store at MASTER_PORT + 1."""

    def __init__(self, role: Role, device: torch.device):
        env = os.environ
        world = role.learners + role.actors
        store = torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]) + 1, world, role.rank == 0,
                                           timeout=TIMEOUT)
        self.role, self.device = role, device
        self.objects = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("objects", store), role.rank, world, TIMEOUT)
        # the weights group: learner 0 is its rank 0, actor a its rank 1 + a; other learners are not in it
        self.in_weights = role.rank == 0 or role.actor
        self.weights = None
        if self.in_weights:
            wrank = 0 if role.rank == 0 else 1 + role.rank - role.learners
            wstore = torch.distributed.PrefixStore("weights", store)
            if device.type == "cuda":
                self.weights = torch.distributed.ProcessGroupNCCL(wstore, wrank, 1 + role.actors)
            else:
                self.weights = torch.distributed.ProcessGroupGloo(wstore, wrank, 1 + role.actors, TIMEOUT)
        self._store = store

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

    def broadcast_weights(self, flat: torch.Tensor) -> None:
        """Learner 0's `flat` into every actor's (the same shape and dtype), one broadcast."""
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = 0
        self.weights.broadcast([flat], opts).wait()
        if flat.device.type == "cuda":
            torch.cuda.current_stream(flat.device).synchronize()


def flat_weights(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters and buffers (its state dict, in order) as one flat tensor of their dtype."""
    return torch.cat([t.reshape(-1) for t in model.state_dict().values()])


def load_flat(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """`flat_weights`'s inverse, in place."""
    at = 0
    with torch.no_grad():
        for t in model.state_dict().values():
            t.copy_(flat[at:at + t.numel()].view_as(t))
            at += t.numel()


class ActorClient:
    """A learner's side of the link: `draw` gets a step's samples from the actors (module docstring)."""

    def __init__(self, role: Role, device: torch.device):
        self.role, self.link = role, Link(role, device)
        self.wait_s = 0.0  # the last draw's time waiting for the actors (the learner's wait for samples)

    def draw(self, policy, prompts, *, step: int, samples_per_prompt: int) -> list[dict]:
        """The samples of this rank's `prompts` at `step`: one dict per (prompt, sample), prompt-major, with the
        decode engine's tokens, logprobs, finish, text. `policy`: learner 0's gathered decode copy (None elsewhere)."""
        t0 = time.perf_counter()
        mine = [(p.index, list(p.ids)) for p in prompts]
        self.link.all_gather_objects({"step": step, "prompts": mine} if self.role.rank == 0 else {"prompts": mine})
        if self.role.rank == 0:
            self.link.broadcast_weights(flat_weights(policy))
        parts = self.link.all_gather_objects(None)
        # samples come keyed by their place in the step's global prompt order: learner r's prompt j is r x B + j
        got = {(s["place"], s["sample"]): s for part in parts if part for s in part}
        first = self.role.rank * len(prompts)
        self.wait_s = time.perf_counter() - t0
        return [got[(first + j, k)] for j in range(len(prompts)) for k in range(samples_per_prompt)]

    def close(self) -> None:
        """Tell the actors the run is over (learner 0 says it; every learner takes part in the exchange)."""
        self.link.all_gather_objects({"stop": True} if self.role.rank == 0 else {})


def actor_loop(cfg, role: Role) -> int:
    """An actor rank's life: take each step's prompts and weights, draw its share of the samples, send them back; until
    the learners say stop. Returns the process's exit status."""
    rl = cfg.rl
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
    flat = torch.empty_like(flat_weights(policy))
    link = Link(role, device)
    me = role.rank - role.learners
    log.info("rl: actor rank %d (actor %d of %d) ready", role.rank, me + 1, role.actors)
    try:
        return _serve(link, policy, flat, tokenizer, rl, role, me)
    except KeyboardInterrupt:  # the launcher's Ctrl-C reaches every rank: the learners save, the actors just stop
        print(f"actor rank {role.rank}: interrupted", file=sys.stderr, flush=True)
        return 130
    except RuntimeError as e:  # a learner died or stopped answering: nothing of an actor needs saving
        print(f"error: actor rank {role.rank}: the link to the learners broke ({str(e).splitlines()[0][:200]}); stopping",
              file=sys.stderr, flush=True)
        return 3


def _serve(link: Link, policy, flat: torch.Tensor, tokenizer, rl, role: Role, me: int) -> int:
    g = rl.samples_per_prompt
    while True:
        parts = link.all_gather_objects({})
        head = parts[0]
        if head.get("stop"):
            return 0
        step = head["step"]
        prompts = [Prompt(ids, None, None, index) for part in parts[:role.learners] for index, ids in part["prompts"]]
        link.broadcast_weights(flat)
        load_flat(policy, flat)
        share = group_share(len(prompts) * g, role.actors, me)
        samples = sample_groups(policy, prompts, samples_per_prompt=g, max_new_tokens=rl.max_new_tokens,
                                temperature=rl.temperature, seed=rl.seed, step=step, stop_ids=stop_ids(tokenizer),
                                tokenizer=tokenizer, batch_size=rl.generation_batch_size, pairs=share, top_p=rl.top_p,
                                stop=rl.stop)
        link.all_gather_objects([{"place": s.prompt, "sample": s.index, "tokens": s.tokens,
                                  "logprobs": s.logprobs, "finish": s.finish, "text": s.text} for s in samples])
