"""The speed/quality dial `translate_context(..., recompute=r)`: its ends are pure translation and the target's
own prefill, the identity oracle holds at every `r`, and the budget is spent as documented."""

import math

import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer, identity_translator, native_and_translated, tiny_model

from hf_mot import MoTConfig, MoTTranslator, translate_context

PROMPT = " Question: what is this about? Answer:"


def _pair():
    source, target = tiny_model("llama", seed=3), tiny_model("gemma3", seed=4)
    config = MoTConfig.from_models(source.config, target.config, hidden_size=16, depth_matched_layers=1)
    torch.manual_seed(5)
    translator = MoTTranslator(config).eval()
    with torch.no_grad():
        for param in translator.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return source, target, translator


def _translate(contexts, translator, source, target, **options):
    return translate_context(contexts, translator=translator, source_model=source, source_tokenizer=bpe_tokenizer(),
                             target_model=target, target_tokenizer=char_tokenizer(), **options)


def _same_cache(a, b):
    assert len(a.layers) == len(b.layers)
    for x, y in zip(a.layers, b.layers, strict=True):
        assert x.get_seq_length() == y.get_seq_length()
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.parametrize("recompute", [0.0, 0.25, 0.6, 1.0])
def test_identity_oracle_at_every_recompute(family, recompute):
    model, tokenizer = tiny_model(family), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    for contexts in (CONTEXTS[0], CONTEXTS[:3]):
        native, translated = native_and_translated(model, tokenizer, translator, contexts, PROMPT,
                                                   recompute=recompute, max_new_tokens=16, do_sample=False)
        assert translated.tolist() == native.tolist()


def test_recompute_one_is_the_targets_own_prefill():
    """At r=1 a translator that is far from the identity gives exactly the target's native greedy tokens."""
    source, target, translator = _pair()
    native, translated = native_and_translated(
        source, bpe_tokenizer(), translator, CONTEXTS[:2], PROMPT, recompute=1, target=target,
        target_tokenizer=char_tokenizer(), max_new_tokens=12, do_sample=False,
    )
    assert translated.tolist() == native.tolist()
    _, zero = native_and_translated(
        source, bpe_tokenizer(), translator, CONTEXTS[:2], PROMPT, recompute=0, target=target,
        target_tokenizer=char_tokenizer(), max_new_tokens=12, do_sample=False,
    )
    assert zero.tolist() != native.tolist()  # the dial's other end does translate


def test_recompute_reads_the_share_of_tokens_as_a_native_tail():
    source, target, translator = _pair()
    contexts = [CONTEXTS[0], CONTEXTS[2][:30]]  # a left-padded batch, longer than Gemma 3's sliding window
    share = 0.3
    dial = _translate(contexts, translator, source, target, recompute=share)
    tail = _translate(contexts, translator, source, target, native_tail=math.floor(share * dial.num_context_tokens))
    _same_cache(dial, tail)
    _same_cache(_translate(contexts, translator, source, target, recompute=0),
                _translate(contexts, translator, source, target))


def test_recompute_none_takes_the_translators_recommendation(tmp_path):
    source, target, translator = _pair()
    translator.config.recompute = 0.4
    translator.save_pretrained(tmp_path / "t")
    loaded = MoTTranslator.from_pretrained(tmp_path / "t").eval()
    assert loaded.config.recompute == 0.4
    _same_cache(_translate(CONTEXTS[1], loaded, source, target),
                _translate(CONTEXTS[1], loaded, source, target, recompute=0.4))


@pytest.mark.parametrize(("recompute", "error"), [
    (-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError), (True, TypeError), ("0.5", TypeError),
])
def test_recompute_outside_the_dial_is_refused(recompute, error):
    source, target, translator = _pair()
    with pytest.raises(error, match="recompute"):
        _translate(CONTEXTS[0], translator, source, target, recompute=recompute)
    with pytest.raises(error, match="recompute"):
        MoTConfig.from_models(source.config, target.config, recompute=recompute)


def test_recompute_with_native_tail_is_refused():
    source, target, translator = _pair()
    with pytest.raises(ValueError, match="pass one of them"):
        _translate(CONTEXTS[0], translator, source, target, recompute=0.2, native_tail=3)


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_beams=3, num_return_sequences=2, do_sample=False), dict(do_sample=True, top_k=20, seed=7)],
    ids=["beam-n-return", "sampling"],
)
def test_decoding_strategies_at_a_middle_recompute(kwargs):
    """Beam search with several returns and seeded sampling from a cache half read natively (Gemma 3's sliding
    window shorter than both parts) give the native tokens through the identity."""
    model, tokenizer = tiny_model("gemma3"), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    native, translated = native_and_translated(model, tokenizer, translator, CONTEXTS[:2], PROMPT, recompute=0.5,
                                               max_new_tokens=8, **kwargs)
    assert translated.tolist() == native.tolist()


def test_save_and_load_keep_what_was_read_natively(tmp_path):
    """A cache saved at `recompute=r` loads with the same tokens, the same count of natively read tokens, and
    continues (a second turn) as the live one does."""
    from hf_mot import TranslatedCache
    from hf_mot._compat import cache_kwarg

    source, target, translator = _pair()
    live = _translate(CONTEXTS[:2], translator, source, target, recompute=0.3)
    live.save(tmp_path / "cache.safetensors")
    loaded = TranslatedCache.load(tmp_path / "cache.safetensors", target.config)
    assert loaded.native_tokens == live.native_tokens > 0
    _same_cache(loaded, live)
    prompt = char_tokenizer()([PROMPT] * 2, return_tensors="pt", add_special_tokens=False).input_ids
    outs = [target.generate(input_ids=prompt, attention_mask=cache.generation_mask(prompt.shape[1]),
                            max_new_tokens=6, do_sample=False, **{cache_kwarg(target): cache})
            for cache in (live, loaded)]
    assert torch.equal(outs[0], outs[1])
