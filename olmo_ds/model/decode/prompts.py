"""Prompt files for generation (`scripts/generate.py --prompts FILE.jsonl`): one JSON object per line.

    {"prompt": "The capital of France is"}                                   text, continued as written
    {"messages": [{"role": "user", "content": "Name three primes."}]}        chat, rendered with the chat template
    optional on either: "id" (echoed back), "max_new_tokens" (this prompt's limit), "stop" (a list of strings)
    {"messages": [...], "ground_truth": "6", "dataset": "gsm8k"}             an RL prompt row: answered, then scored

An RL prompt row is the layout of `scripts/make_rl_prompts.py`, `prepare_data.py --format rl` and the public RLVR
mixes (allenai/RLVR-GSM-MATH-IF-Mixed-Constraints): "dataset" names the verifier that scores the answer against
"ground_truth"; both come together, and other keys such a mix carries ("constraint_type", ...) are ignored, as data
preparation ignores them. Decoding only carries them (`Prompt.verifier`, `Prompt.ground_truth`): the verifiers are
evaluation's (`olmo_ds.eval.rl.check_rows` checks them, `score_answer` scores), which generation may not import.

A `prompt` record in a chat run (`--chat`) becomes a user turn (after the system turn, if one is given); a
`messages` record needs a chat template. Every record is read, checked and encoded before any weight is
loaded; a bad one is an error naming the file and line.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import orjson

from olmo_ds.chat import ChatEncoder


@dataclass
class Prompt:
    where: str  # "FILE:LINE" or "--prompt N", for messages
    echo: dict  # what the output line repeats of the record: id, prompt or messages
    ids: list[int]
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ()
    verifier: str | None = None  # an RL prompt row's "dataset": the verifier of its answer (None: not an RL row)
    ground_truth: object = None  # ... and what the verifier checks the answer against


def text_prompt(text: str, where: str, tokenizer, encoder: ChatEncoder | None, system: str | None) -> Prompt:
    """A prompt's text: encoded as written, or (chat) as a user turn after the system turn."""
    if encoder is None:
        return Prompt(where, {"prompt": text}, tokenizer.encode(text))
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [{"role": "user", "content": text}]
    return Prompt(where, {"prompt": text}, encoder.encode_prompt(messages))


def read_prompts(path: str | Path, tokenizer, encoder: ChatEncoder | None, system: str | None = None) -> list[Prompt]:
    """Every record of a prompt file (see the module docstring), checked and encoded."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"--prompts {path}: no such file") from None
    prompts = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise ValueError(f"{where}: malformed JSON ({e})") from None
        if not isinstance(record, dict) or ("prompt" in record) == ("messages" in record):
            raise ValueError(f"{where}: expected an object with either \"prompt\" (text) or \"messages\" (chat)")
        rl_row = "ground_truth" in record or "dataset" in record
        if rl_row and not ("ground_truth" in record and "dataset" in record):
            raise ValueError(f"{where}: an RL prompt row has both \"dataset\" (the verifier) and \"ground_truth\"; this one has only "
                             f"{'dataset' if 'dataset' in record else 'ground_truth'}")
        unknown = set(record) - {"prompt", "messages", "id", "max_new_tokens", "stop"}
        if unknown and not rl_row:
            raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (a record has prompt or messages, "
                             "and optionally id, max_new_tokens, stop; an RL prompt row also dataset and ground_truth)")
        try:
            if "prompt" in record:
                if not isinstance(record["prompt"], str):
                    raise ValueError(f"\"prompt\" must be a string, got {type(record['prompt']).__name__}")
                prompt = text_prompt(record["prompt"], where, tokenizer, encoder, system)
            else:
                if encoder is None:
                    raise ValueError("a \"messages\" record needs a chat template: pass --chat (and --chat-template if the "
                                     "weights carry none)")
                prompt = Prompt(where, {"messages": record["messages"]}, encoder.encode_prompt(record["messages"]))
        except ValueError as e:  # ChatError is a ValueError
            raise ValueError(f"{where}: {e}") from None
        if "id" in record:
            prompt.echo = {"id": record["id"], **prompt.echo}
        limit = record.get("max_new_tokens")
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"{where}: \"max_new_tokens\" must be an integer >= 1, got {limit!r}")
        stop = record.get("stop", [])
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"{where}: \"stop\" must be a list of non-empty strings, got {stop!r}")
        prompt.max_new_tokens, prompt.stop = limit, tuple(stop)
        if rl_row:
            prompt.verifier, prompt.ground_truth = record["dataset"], record["ground_truth"]
        prompts.append(prompt)
    if not prompts:
        raise ValueError(f"--prompts {path}: no prompts in the file")
    return prompts
