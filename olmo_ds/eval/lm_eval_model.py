"""lm-evaluation-harness on an olmo-ds checkpoint, run dir or model directory, without exporting it.

    python -m olmo_ds.eval.lm_eval_model --model olmo-ds --model_args checkpoint=runs/demo --tasks arc_easy

`OlmoDsLM` is an lm-eval model ("olmo-ds"): the model comes from `olmo_ds.weights.load_model` (a
checkpoint's ZeRO shards consolidated on CPU, a run's newest checkpoint, our model directory or an
export), the tokenizer is the one saved with the weights, and
log-likelihoods are computed by `olmo_ds.eval.loglikelihood.score_requests` (each distinct context
run once into a KV cache). Strings become tokens exactly as lm-eval's `hf` model makes them
(`TemplateLM`: the context's trailing whitespace moved to the continuation, the pair encoded whole
and split; an empty context replaced by EOS), so scores agree with `--model hf` on the export of the
same weights (tests/eval/test_lm_eval.py).

Registration: importing this module registers the name with lm-eval's registry. lm-eval releases
up to 0.4.13 (the newest on PyPI when this was written) find models only in their own source tree,
so `lm_eval --model olmo-ds` does not know the name; `python -m olmo_ds.eval.lm_eval_model` takes
lm-eval's own arguments, registers the model and runs lm-eval's command line.
"""

from __future__ import annotations

import sys

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from olmo_ds import weights
from olmo_ds.chat import ChatEncoder
from olmo_ds.eval.loglikelihood import score_requests
from olmo_ds.model.decode import Request, Sampling, generate, sequences_that_fit

NAME = "olmo-ds"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's own default for generate_until


@register_model(NAME)
class OlmoDsLM(TemplateLM):
    """`--model_args checkpoint=PATH[,dtype=float32|bfloat16|float16][,batch_tokens=N][,gen_batch_size=N]`;
    `--device` as lm-eval's. `gen_batch_size`: sequences `generate_until` decodes at once (fewer where the KV
    cache of that many would not fit)."""

    def __init__(self, checkpoint: str | None = None, dtype: str = "float32", batch_tokens: int | str = 4096,
                 gen_batch_size: int | str = 64, device: str | None = None, batch_size=None, max_batch_size=None, **unknown) -> None:
        super().__init__()
        # lm-eval passes batch_size/max_batch_size to every model; scoring batches here are sized in tokens instead.
        if unknown:
            raise ValueError(f"--model_args: unknown argument(s) {', '.join(sorted(unknown))} for --model {NAME} "
                             f"(it takes checkpoint, dtype, batch_tokens, gen_batch_size)")
        if not checkpoint:
            raise ValueError(f"--model {NAME} needs --model_args checkpoint=RUN_OR_CHECKPOINT_OR_MODEL_DIR")
        if dtype not in DTYPES:
            raise ValueError(f"--model_args dtype={dtype!r}: expected one of {', '.join(DTYPES)}")
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.model, self.tokenizer, provenance = weights.load_model(checkpoint, device=device, dtype=DTYPES[dtype])
        # lm-eval's --apply_chat_template renders with the template saved with the weights (or their tokenizer);
        # once it has, generation also stops at the end of an assistant's turn (`apply_chat_template`).
        self.template = weights.chat_template_of(provenance, self.tokenizer)
        self.turn_end_ids: list[int] | None = None
        self.max_length = provenance.cfg.max_seq_len
        self.path = provenance.directory
        self.batch_tokens = int(batch_tokens)
        self.gen_batch_size = int(gen_batch_size)
        self._device = torch.device(device)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.path)

    def chat_template(self, chat_template: bool | str = False) -> str:
        return self.template.text if self.template is not None else ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The conversation rendered with the checkpoint's template; its markers become special ids when encoded,
        as transformers' tokenizer encodes the rendering of its own `apply_chat_template`."""
        if self.template is None:
            raise ValueError(f"--apply_chat_template: {self.path} has no chat template beside the weights or their tokenizer "
                             "(tokenizer_config.json's chat_template, chat_template.jinja)")
        if self.turn_end_ids is None:  # the first rendering: the template's turn closers end generation from now on
            self.turn_end_ids = ChatEncoder(self.template, self.tokenizer).turn_end_ids()
        return self.template.render(chat_history, add_generation_prompt=add_generation_prompt)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)  # our tokenizers add no special tokens (no BOS in OLMo)

    def tok_decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _score(self, pairs: list[tuple[list[int], list[int]]]):
        return score_requests(self.model, pairs, max_len=self.max_length, batch_tokens=self.batch_tokens, pad_id=self.tokenizer.pad_id or 0)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        scored = self._score([(context, continuation) for _, context, continuation in requests])
        results = [(float(lp), bool(top)) for lp, top in zip(scored.logprob, scored.greedy)]
        for (strings, _, _), result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", strings, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Whole-document log-likelihood in windows of the model's length, each token scored once (lm-eval's rule)."""
        windows, owner = [], []
        for n, request in enumerate(requests):
            (text,) = request.args
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id, max_seq_len=self.max_length, context_len=1)):
                windows.append((context, continuation))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, lp in zip(owner, self._score(windows).logprob):
            totals[n] += float(lp)
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Every request decoded in batches (`olmo_ds.model.decode`), each stopping at its first stop string
        (`until`), the EOS or `max_gen_toks`; greedy unless the task's generation kwargs sample. Requests that
        sample alike run together; the text is cut before the stop string, as lm-eval's hf model cuts it."""
        groups: dict[Sampling, list[int]] = {}
        prepared = []
        for n, request in enumerate(requests):
            context, kwargs = request.args
            kwargs = dict(kwargs)
            until = kwargs.pop("until", None) or [self.tok_decode([self.eot_token_id])]
            until = [until] if isinstance(until, str) else list(until)
            max_new = min(int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS)), self.max_length - 1)
            sample = kwargs.pop("do_sample", False) or float(kwargs.get("temperature", 0.0)) > 0
            sampling = Sampling(temperature=float(kwargs.pop("temperature", 1.0)) if sample else 0.0,
                                top_p=float(kwargs.pop("top_p", 1.0) or 1.0) if sample else 1.0,
                                top_k=int(kwargs.pop("top_k", 0) or 0) if sample else 0)
            # The prompt is cut from the left so prompt and answer fit the window, as lm-eval's hf model does.
            prompt = self.tok_encode(context)[-(self.max_length - max_new):] or [self.eot_token_id]
            prepared.append(Request(prompt, max_new, tuple(s for s in until if s)))
            groups.setdefault(sampling, []).append(n)
        outputs = [""] * len(requests)
        for sampling, members in groups.items():
            batch = [prepared[n] for n in members]
            longest = max(len(r.prompt) + r.max_new_tokens for r in batch)
            fit = sequences_that_fit(self.model.cfg, longest, next(self.model.parameters()).dtype, self._device)
            done = generate(self.model, batch, batch_size=max(1, min(self.gen_batch_size, fit)), sampling=sampling,
                            stop_ids=self.turn_end_ids or [self.eot_token_id], tokenizer=self.tokenizer)
            for n, completion in zip(members, done.completions):
                outputs[n] = completion.text
                self.cache_hook.add_partial("generate_until", requests[n].args, completion.text)
        return outputs


def main() -> None:
    """lm-eval's command line with the olmo-ds model registered (see the module docstring)."""
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm_eval"
    try:
        cli_evaluate()
    except (FileNotFoundError, ValueError) as e:  # a bad checkpoint or --model_args: the message, not a traceback
        print(f"lm_eval --model {NAME}: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
