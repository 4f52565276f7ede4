"""TranslatedCache in generate(): decoding strategies, padded batches, a second turn, sliding windows."""

import pytest
import torch
from conftest import CONTEXTS, char_tokenizer, identity_translator, native_and_translated, tiny_model
from transformers import DynamicCache

from hf_mot import TranslatedCache, translate_context
from hf_mot._compat import cache_kwarg
from hf_mot.alignment import encode_contexts

PROMPT = " Q: and then? A:"


@pytest.fixture(params=["llama", "gemma3"])
def setup(request):
    model, tokenizer = tiny_model(request.param), char_tokenizer()
    return model, tokenizer, identity_translator(model, tokenizer)


def test_returns_translated_cache_with_metadata(setup):
    model, tokenizer, translator = setup
    cache = translate_context(
        CONTEXTS[0], translator=translator, source_model=model, source_tokenizer=tokenizer,
        target_model=model, target_tokenizer=tokenizer,
    )
    assert isinstance(cache, TranslatedCache)
    assert cache.get_seq_length() == cache.num_context_tokens == len(CONTEXTS[0]) + 1  # characters + BOS
    assert cache.attention_mask.shape == (1, cache.num_context_tokens)
    assert cache.target_id == model.config.name_or_path


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(do_sample=False),
        dict(do_sample=True, top_k=5, seed=7),
        dict(do_sample=False, num_beams=3),
        dict(do_sample=False, num_beams=3, num_return_sequences=2),
        dict(do_sample=True, num_return_sequences=3, seed=3),
    ],
    ids=["greedy", "sampling", "beam", "beam-n-return", "sampling-n-return"],
)
def test_decoding_strategies_match_native(setup, kwargs):
    model, tokenizer, translator = setup
    native, translated = native_and_translated(
        model, tokenizer, translator, CONTEXTS[1], PROMPT, max_new_tokens=12, **kwargs
    )
    assert translated.shape == native.shape
    assert translated.tolist() == native.tolist()


@pytest.mark.parametrize("recompute", [0.0, 0.3, 1.0])
def test_padded_batch_matches_native_batch(setup, recompute):
    model, tokenizer, translator = setup
    contexts = [CONTEXTS[0], "Short.", CONTEXTS[3][:40]]
    native, translated = native_and_translated(
        model, tokenizer, translator, contexts, PROMPT, recompute=recompute, max_new_tokens=16, do_sample=False
    )
    assert translated.tolist() == native.tolist()


def test_padded_rows_match_unpadded_runs(setup):
    model, tokenizer, translator = setup
    contexts = [CONTEXTS[2], "Tiny."]
    _, batched = native_and_translated(model, tokenizer, translator, contexts, PROMPT, max_new_tokens=10)
    for row, context in enumerate(contexts):
        _, alone = native_and_translated(model, tokenizer, translator, context, PROMPT, max_new_tokens=10)
        assert batched[row].tolist() == alone[0].tolist()


def _two_turns(model, tokenizer, cache, context_mask):
    turn1 = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    mask = torch.cat([context_mask, torch.ones_like(turn1)], dim=1)
    out1 = model.generate(
        input_ids=turn1, attention_mask=mask, max_new_tokens=6, do_sample=False, **{cache_kwarg(model): cache}
    )
    turn2 = tokenizer(" Q: why? A:", return_tensors="pt", add_special_tokens=False).input_ids
    history = torch.cat([out1, turn2], dim=1)  # generate() wants every token not yet in the cache
    mask = torch.cat([context_mask, torch.ones_like(history)], dim=1)
    out2 = model.generate(
        input_ids=history, attention_mask=mask, max_new_tokens=6, do_sample=False, **{cache_kwarg(model): cache}
    )
    return out1, out2


def test_second_turn_on_the_same_cache(setup):
    """Two turns on a translated cache give the tokens of two turns on the target's own cache."""
    model, tokenizer, translator = setup
    cache = translate_context(
        CONTEXTS[4], translator=translator, source_model=model, source_tokenizer=tokenizer,
        target_model=model, target_tokenizer=tokenizer,
    )
    translated = _two_turns(model, tokenizer, cache, cache.attention_mask)

    context = encode_contexts(tokenizer, [CONTEXTS[4]])
    native_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=context.input_ids, use_cache=True, **{cache_kwarg(model): native_cache})
    native = _two_turns(model, tokenizer, native_cache, context.attention_mask)
    assert [t.tolist() for t in translated] == [n.tolist() for n in native]


def test_past_key_values_keyword_still_works(setup):
    model, tokenizer, translator = setup
    cache = translate_context(
        CONTEXTS[0], translator=translator, source_model=model, source_tokenizer=tokenizer,
        target_model=model, target_tokenizer=tokenizer,
    )
    prompt = tokenizer(PROMPT, return_tensors="pt", add_special_tokens=False).input_ids
    with pytest.warns(FutureWarning) if cache_kwarg(model) == "cache" else _nullcontext():
        out = model.generate(
            input_ids=prompt, attention_mask=cache.generation_mask(prompt.shape[1]), past_key_values=cache,
            max_new_tokens=4, do_sample=False,
        )
    assert out.shape == (1, prompt.shape[1] + 4)


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()


def test_gemma_sliding_layers_keep_the_window_only():
    model, tokenizer = tiny_model("gemma3"), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    cache = translate_context(
        CONTEXTS[0], translator=translator, source_model=model, source_tokenizer=tokenizer,
        target_model=model, target_tokenizer=tokenizer,
    )
    window = model.config.sliding_window
    sliding, full = cache.layers[0], cache.layers[1]
    assert sliding.is_sliding and sliding.keys.shape[-2] == window - 1
    assert not full.is_sliding and full.keys.shape[-2] == cache.get_seq_length()


def test_a_given_source_cache_is_reused(setup):
    model, tokenizer, translator = setup
    contexts = [CONTEXTS[0], CONTEXTS[2][:30]]
    kwargs = dict(translator=translator, source_model=model, source_tokenizer=tokenizer, target_model=model,
                  target_tokenizer=tokenizer)
    from hf_mot.pipeline import prefill_source

    source_cache = prefill_source(model, encode_contexts(tokenizer, contexts))
    reused = translate_context(contexts, source_cache=source_cache, **kwargs)
    fresh = translate_context(contexts, **kwargs)
    for a, b in zip(reused.layers, fresh.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
