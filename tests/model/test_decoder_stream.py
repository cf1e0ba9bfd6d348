"""The decode engine over a stream (`olmo_ds.model.decode.Decoder`): requests submitted while others decode, weights
swapped in place mid-flight, the in-flight state saved and restored. On CPU a sample's numbers do not depend on what
shares its forwards, so a streamed sample is the same bits as the one `generate` returns alone."""

from __future__ import annotations

import pytest
import torch

from olmo_ds.model import ModelConfig
from olmo_ds.model.decode import Decoder, GenerationInterrupted, Request, Sampling, generate

from model_testlib import OLMO3_TINY, random_model

SAMPLING = Sampling(temperature=1.0, seed=5)


@pytest.fixture(scope="module")
def model():
    return random_model(ModelConfig(**dict(OLMO3_TINY, vocab_size=384, max_seq_len=128)), seed=3)


def requests(vocab: int, n: int, seed: int, first_key: int = 0) -> list[Request]:
    g = torch.Generator().manual_seed(seed)
    return [Request(torch.randint(0, vocab, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist(),
                    int(torch.randint(2, 30, (1,), generator=g)), seed=first_key + k) for k in range(n)]


def by_key(pairs) -> dict:
    return {k: (c.tokens, c.logprobs, c.finish) for k, c in pairs}


def test_a_stream_decodes_what_generate_decodes_alone(model):
    """Requests submitted in three waves, the later ones while the first decode (`run(until=...)` stops early): every
    completion is generate's for that request, bit for bit, and the decoder counts its slots' occupancy."""
    first, second, third = (requests(model.cfg.vocab_size, n, s, k) for n, s, k in ((6, 1, 0), (5, 2, 100), (4, 3, 200)))
    decoder = Decoder(model, slots=4, max_len=64, sampling=SAMPLING)
    decoder.submit(first, keys=[("a", k) for k in range(6)])
    got = decoder.run(until=lambda: True)  # returns at the first finished sequence, the rest in flight
    assert len(got) >= 1 and decoder.pending == 6 - len(got)
    decoder.submit(second, keys=[("b", k) for k in range(5)])
    got += decoder.run(until=lambda: sum(k[0] == "a" for k, _ in got) == 6)
    decoder.submit(third, keys=[("c", k) for k in range(4)])
    got += decoder.run()
    assert decoder.pending == 0 and len(got) == 15
    alone = {}
    for tag, reqs in (("a", first), ("b", second), ("c", third)):
        for k, c in enumerate(generate(model, reqs, batch_size=3, sampling=SAMPLING).completions):
            alone[(tag, k)] = (c.tokens, c.logprobs, c.finish)
    assert by_key(got) == alone
    assert 0 < decoder.occupancy() <= 1


def test_swapped_weights_decode_on_in_place_and_completions_record_their_versions(model):
    """`load_weights` between two runs: sequences in flight keep their cache and go on under the new weights; their
    versions say so, and the new weights really decode (the tokens after the swap differ from an unswapped run's)."""
    other = random_model(model.cfg, seed=11)
    reqs = [Request(r.prompt, 40, seed=r.seed) for r in requests(model.cfg.vocab_size, 3, 4)]
    plain = generate(model, reqs, batch_size=3, sampling=SAMPLING).completions
    policy = random_model(model.cfg, seed=3)  # the same weights as `model`, swapped later
    decoder = Decoder(policy, slots=3, max_len=64, sampling=SAMPLING)
    decoder.submit(reqs)
    with pytest.raises(GenerationInterrupted) as stopped:
        decoder.run(interrupt=_after(5))
    assert stopped.value.finished == []  # nothing finishes in 5 forwards of 40 new tokens
    decoder.load_weights(other)
    assert decoder.version == 1
    done = dict(decoder.run())
    for k, c in done.items():
        assert c.versions == (0, 1)
        assert c.tokens[:5] == plain[k].tokens[:5] and c.tokens != plain[k].tokens
    assert torch.equal(policy.embed.weight, other.embed.weight)


def test_an_interrupted_run_hands_back_what_it_finished_before_it_stopped(model):
    """Sequences a `run` finished before `interrupt()` stopped it come with the exception, and only there: the rest
    decodes on, and both together are the uninterrupted run's completions."""
    reqs = [Request(r.prompt, n, seed=r.seed) for r, n in zip(requests(model.cfg.vocab_size, 5, 4), (2, 3, 30, 30, 30))]
    decoder = Decoder(model, slots=5, max_len=64, sampling=SAMPLING)
    decoder.submit(reqs)
    with pytest.raises(GenerationInterrupted) as stopped:
        decoder.run(interrupt=_after(6))
    early = stopped.value.finished
    assert sorted(k for k, _ in early) == [0, 1] and decoder.pending == 3
    reference = Decoder(model, slots=5, max_len=64, sampling=SAMPLING)
    reference.submit(reqs)
    assert by_key(early + decoder.run()) == by_key(reference.run())


def _after(n: int):
    calls = iter(range(10 ** 9))
    return lambda: next(calls) >= n


@pytest.mark.parametrize("sampling", [SAMPLING, Sampling()], ids=["sampled", "greedy"])
def test_a_restored_decoder_decodes_on_as_the_saved_one_would(model, sampling, tmp_path):
    """`state_dict` mid-flight (some sequences done, some decoding, some waiting), through `torch.save` and
    `torch.load(weights_only=True)`, into a fresh decoder: the rest decodes the same bits as the original's rest."""
    reqs = requests(model.cfg.vocab_size, 9, 6)
    original = Decoder(model, slots=4, max_len=64, sampling=sampling)
    original.submit(reqs)
    original.run(until=lambda: True)
    assert original.active and original.waiting
    torch.save(original.state_dict(), tmp_path / "decoder.pt")
    rest = by_key(original.run())
    restored = Decoder(model, slots=4, max_len=64, sampling=sampling)
    restored.load_state_dict(torch.load(tmp_path / "decoder.pt", weights_only=True))
    assert by_key(restored.run()) == rest
    with pytest.raises(ValueError, match="4 slots of 64 positions; this one has 2 of 64"):
        Decoder(model, slots=2, max_len=64, sampling=sampling).load_state_dict(original.state_dict())


def test_a_request_longer_than_the_decoders_cache_is_refused_at_submit(model):
    decoder = Decoder(model, slots=2, max_len=16)
    with pytest.raises(ValueError, match=r"prompt 1: 10 tokens \+ max_new_tokens 7 exceed the decoder's max_len 16"):
        decoder.submit([Request([1] * 3, 4), Request([1] * 10, 7)])
    assert decoder.pending == 0
