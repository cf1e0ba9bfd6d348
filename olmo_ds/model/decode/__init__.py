"""Generation: batched decoding with a per-sequence KV cache (`engine`), its cache (`cache`), token choice (`sampling`)."""

from olmo_ds.model.decode.cache import SlotCache, bytes_per_sequence, check_fits, sequences_that_fit
from olmo_ds.model.decode.engine import Completion, Decoder, Generation, GenerationInterrupted, Request, check_requests, generate
from olmo_ds.model.decode.sampling import Sampling, filtered_logits, next_tokens, stream_key, token_logprobs

__all__ = ["Completion", "Decoder", "Generation", "GenerationInterrupted", "Request", "Sampling", "SlotCache", "bytes_per_sequence", "check_fits",
           "check_requests", "filtered_logits", "generate", "next_tokens", "sequences_that_fit", "stream_key", "token_logprobs"]
