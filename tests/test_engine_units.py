"""Engines on the shipped weights: scoring, batching, the prefix cache, precision, sampling and
detokenizing (engines/)."""

from __future__ import annotations

import pytest
import torch

from engines.detokenizer import IncrementalDetokenizer
from target.decoding import Generation
from engines.sampling import probabilities, sample
from engines.types import GenerateRequest, SamplingParams
from tests.conftest import prompt_ids


@pytest.fixture(scope="module")
def serve_file(exact_serve_file):
    """The `transformers` target (float32, drafted by llama.cpp): configs/cpu-exact.yaml."""
    return exact_serve_file


def test_score_k_tokens_matches_stepwise_decoding_and_rolls_back(engine):
    ids = prompt_ids(engine)
    seq = engine.new_sequence()
    logits = engine.prefill(seq, ids)
    proposal = [int(torch.argmax(logits)), 578, 1500, 42]
    scored = engine.score(seq, proposal)
    assert scored.shape[0] == len(proposal)
    engine.rollback(seq, len(ids))
    assert seq.length == len(ids)
    for i, tok in enumerate(proposal):
        step = engine.decode_step(seq, tok)
        assert torch.allclose(step, scored[i], atol=1e-3), f"position {i}"
    engine.rollback(seq, len(ids) + 1)
    again = engine.decode_step(seq, proposal[1])
    assert torch.allclose(again, scored[1], atol=1e-3)


def test_prefix_cache_hits_shared_prefixes_and_keeps_greedy_output_identical(engine, serve_file):
    from engines.transformers_engine import TransformersEngine

    config = serve_file.args.target.engine.model_copy(deep=True)
    config.prefix_cache.enabled = False
    plain = TransformersEngine(config)
    assert engine.prefix_cache is not None and plain.prefix_cache is None
    system = "You are a careful assistant for a bank. Answer in one sentence. " * 6
    before = engine.prefix_cache.stats()
    for question in ["How do I open an account?", "What is an overdraft?", "How do I open an account?"]:
        ids = _prompt_with_system(engine, system, question)
        params = SamplingParams(max_tokens=16, temperature=0.0)
        cached_text, cached_last = _run(engine, params, ids)
        plain_text, _ = _run(plain, params, ids)
        assert cached_text == plain_text, question
    after = engine.prefix_cache.stats()
    assert after["prefix_hit_tokens"] - before["prefix_hit_tokens"] >= 2 * 64, after  # requests 2 and 3 reuse the system prompt
    seq = engine.new_sequence()
    ids = _prompt_with_system(engine, system, "How do I open an account?")
    engine.prefill(seq, ids)
    block = engine.prefix_cache.block_size
    assert seq.reused == (len(ids) - 1) // block * block, "all full blocks but the last token come from the cache"


def test_batched_decode_matches_one_sequence_at_a_time(engine):
    prompts = ["What is the capital of France?", "Write a poem about the sea, the wind and the moon.", "Hi"]
    single, batched = [], []
    for group in (single, batched):
        for text in prompts:
            seq = engine.new_sequence()
            group.append((seq, int(engine.prefill(seq, prompt_ids(engine, text)).argmax())))
    for _ in range(8):  # different lengths: the batch is left-padded and masked
        one = torch.stack([engine.decode_step(seq, tok) for seq, tok in single])
        many = engine.decode_batch([seq for seq, _ in batched], [tok for _, tok in batched])
        assert torch.allclose(one, many, atol=1e-3), (one - many).abs().max()
        assert one.argmax(-1).tolist() == many.argmax(-1).tolist()
        single = [(seq, int(t)) for (seq, _), t in zip(single, one.argmax(-1))]
        batched = [(seq, int(t)) for (seq, _), t in zip(batched, many.argmax(-1))]
    assert [s.length for s, _ in single] == [s.length for s, _ in batched]


# int8 costs this 135M model real quality (bench ttft: ~70% teacher-forced agreement); the
# floor here only tells "degraded" from "broken" (a broken model agrees on ~0%).
@pytest.mark.parametrize("dtype, floor", [("bfloat16", 0.8), ("int8", 0.3)])
def test_reduced_precision_engines_load_and_agree_with_float32(engine, serve_file, dtype, floor):
    from engines.transformers_engine import TransformersEngine

    config = serve_file.args.target.engine.model_copy(deep=True, update={"dtype": dtype})
    config.prefix_cache.enabled = False
    reduced = TransformersEngine(config)
    linear = reduced.model.get_decoder().layers[0].mlp.up_proj
    assert ("quantized" in type(linear).__module__) if dtype == "int8" else linear.weight.dtype == torch.bfloat16
    ids = prompt_ids(engine, "Name three primary colours.")
    text, _ = _run(engine, SamplingParams(max_tokens=12, temperature=0.0), ids)
    reference = engine.tokenizer.encode(text, add_special_tokens=False)
    seq = reduced.new_sequence()
    first = int(reduced.prefill(seq, ids).argmax())
    predicted = [first, *reduced.score(seq, reference[:-1]).argmax(-1).tolist()]
    agreement = sum(p == r for p, r in zip(predicted, reference)) / len(reference)
    assert agreement >= floor, f"{dtype} agrees with float32 on {agreement:.0%} of next tokens"


def _prompt_with_system(engine, system, question):
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return engine.tokenizer.encode(
        engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )


def test_prefix_cache_evicts_leaves_first_and_checks_tokens():
    from engines.prefix_cache import PrefixCache

    def kv(n):  # one layer, n tokens, 4 bytes per value
        return [(torch.arange(n, dtype=torch.float32).view(1, 1, n, 1), torch.zeros(1, 1, n, 1))]

    cache = PrefixCache(block_size=2, max_bytes=6 * 16)  # room for 6 blocks of (2 keys + 2 values) floats
    cache.insert([1, 2, 3, 4, 5, 6, 7], kv(7))  # 3 full blocks
    reused, layers = cache.match([1, 2, 3, 4, 9, 9])
    assert reused == 4 and torch.equal(layers[0][0].flatten(), torch.tensor([0.0, 1, 2, 3]))
    assert cache.match([1, 2])[0] == 0, "the last prompt token is always computed"
    cache.insert([8, 8, 8, 8, 8, 8, 8, 8], kv(8))  # 4 more blocks: over budget, the oldest go
    assert cache.bytes <= cache.max_bytes
    assert cache.match([1, 2, 3, 4, 5, 6, 0])[0] in (0, 2, 4)  # evicted from the leaf back, never a hole
    assert cache.match([8] * 9)[0] == 8


def _run(engine, params, ids):
    gen = Generation(engine, GenerateRequest("t", ids, params))
    chunks = [gen.prefill()]
    while not gen.finished:
        chunks.append(gen.step())
    return "".join(c.text for c in chunks), chunks[-1]


def test_greedy_generation_is_deterministic_and_real(engine):
    ids = prompt_ids(engine)
    text1, last1 = _run(engine, SamplingParams(max_tokens=20, temperature=0.0), ids)
    text2, _ = _run(engine, SamplingParams(max_tokens=20, temperature=0.0), ids)
    assert text1 == text2 and "Paris" in text1
    assert last1.finish_reason == "stop" and last1.prompt_tokens == len(ids)


def test_seeded_sampling_reproducible_and_seed_sensitive(engine):
    ids = prompt_ids(engine, "Write a poem.")
    a, _ = _run(engine, SamplingParams(max_tokens=16, temperature=1.0, seed=7), ids)
    b, _ = _run(engine, SamplingParams(max_tokens=16, temperature=1.0, seed=7), ids)
    c, _ = _run(engine, SamplingParams(max_tokens=16, temperature=1.0, seed=8), ids)
    assert a == b and a != c


def test_max_tokens_is_clamped_to_the_context_window(engine):
    ids = prompt_ids(engine)
    gen = Generation(engine, GenerateRequest("t", ids, SamplingParams(max_tokens=10**6, temperature=0.0)))
    assert gen.max_tokens == engine.max_model_len - len(ids)


def _stream(detok, tokenizer, text):
    out = [detok.add(t) for t in tokenizer.encode(text, add_special_tokens=False)]
    out.append(detok.flush())
    return out


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "emoji 🙂🚀 end", "plain ascii text"])
def test_detokenizer_never_emits_broken_utf8(engine, text):
    pieces = _stream(IncrementalDetokenizer(engine.tokenizer), engine.tokenizer, text)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_detokenizer_cuts_at_stop_and_holds_back_partial_stops(engine):
    detok = IncrementalDetokenizer(engine.tokenizer, stop=("STOP here",))
    pieces = _stream(detok, engine.tokenizer, "alpha beta STOP here gamma")
    assert "".join(pieces) == "alpha beta "
    assert detok.stopped


def test_detokenizer_releases_partial_stop_at_the_end(engine):
    detok = IncrementalDetokenizer(engine.tokenizer, stop=("xyz!",))
    assert "".join(_stream(detok, engine.tokenizer, "ends with xy")) == "ends with xy"
    assert not detok.stopped


def test_stop_string_spanning_a_multibyte_character(engine):
    detok = IncrementalDetokenizer(engine.tokenizer, stop=("🚀",))
    assert "".join(_stream(detok, engine.tokenizer, "go 🚀 now")) == "go "


def test_top_p_keeps_the_smallest_covering_set():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = probabilities(logits, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), atol=1e-6)
    probs = probabilities(logits, SamplingParams(max_tokens=1, temperature=1.0, top_p=0.01))
    assert probs[0] == 1.0


@pytest.mark.parametrize("temperature, top_p", [(1.0, 5e-324), (5e-324, 1.0), (1e-300, 1e-300), (2.0, 1e-45)])
def test_extreme_sampling_values_stay_finite_and_pick_the_top_token(temperature, top_p):
    # Found by the schemathesis fuzzer: these made softmax/top-p return NaN and crashed the replica.
    logits = torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 10
    params = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p)
    probs = probabilities(logits, params)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-4
    assert sample(logits, params, torch.Generator().manual_seed(1)) == int(logits.argmax())


def test_a_kv_state_relaid_for_the_other_attention_layout_round_trips_byte_for_byte():
    """engines/kv_state.py re-lays V between llama.cpp's two layouts: rows per cell and the
    same values transposed; twice gives the buffer back, and a buffer already in the wanted
    layout is left alone. A truncated buffer is refused, never restored half."""
    import struct

    import numpy as np

    from engines.kv_state import KVStateFormatError, relayout

    cells, channels, layers = 5, 6, 2
    rng = np.random.default_rng(0)
    v = [rng.standard_normal((cells, channels)).astype(np.float16) for _ in range(layers)]
    k = [rng.standard_normal((cells, channels)).astype(np.float16) for _ in range(layers)]

    def buffer(transposed: bool) -> bytes:
        out = [struct.pack("<Ii", 0xABCD, 3), struct.pack("<I", 2), struct.pack("<I", 0), struct.pack("<I", cells)]
        out += [struct.pack("<iIi", pos, 1, 3) for pos in range(cells)]
        out.append(struct.pack("<II", int(transposed), layers))
        out += [struct.pack("<iQ", 1, 2 * channels) + layer.tobytes() for layer in k]
        for layer in v:
            if transposed:
                out.append(struct.pack("<iII", 1, 2, channels) + np.ascontiguousarray(layer.T).tobytes())
            else:
                out.append(struct.pack("<iQ", 1, 2 * channels) + layer.tobytes())
        return b"".join(out)

    rows, columns = buffer(False), buffer(True)
    assert relayout(rows, True) == columns and relayout(columns, False) == rows
    assert relayout(rows, False) is None and relayout(columns, True) is None
    try:
        relayout(rows[:-3], True)
    except KVStateFormatError:
        pass
    else:
        raise AssertionError("a truncated KV state was re-laid")
