"""MoTPair: the translator and its two models given once; `generate` answers as the functional form does."""

import pytest
import torch
from conftest import CONTEXTS, char_tokenizer, identity_translator, native_and_translated, tiny_model

from hf_mot import MoTConfig, MoTPair, MoTTranslator, TranslatedCache

PROMPT = " Question: what is this about? Answer:"


@pytest.fixture(scope="module")
def pair():
    model, tokenizer = tiny_model("gemma3"), char_tokenizer()
    return MoTPair(identity_translator(model, tokenizer), model, tokenizer, model, tokenizer)


def test_generate_matches_native_reading_through_the_identity(pair):
    """With the identity translator the pair's answer is the target's own greedy answer after reading the context,
    for one context, a padded batch, and at every dial setting."""
    model, tokenizer = pair.target_model, pair.target_tokenizer
    for recompute in (0.0, 0.4, 1.0):
        native, _ = native_and_translated(model, tokenizer, pair.translator, CONTEXTS[0], PROMPT,
                                          max_new_tokens=10, do_sample=False)
        answer = pair.generate(CONTEXTS[0], PROMPT, recompute=recompute, max_new_tokens=10)
        assert answer == tokenizer.decode(native[0], skip_special_tokens=True)
    natives, _ = native_and_translated(model, tokenizer, pair.translator, CONTEXTS[:3], PROMPT,
                                       max_new_tokens=6, do_sample=False)
    answers = pair.generate(CONTEXTS[:3], PROMPT, max_new_tokens=6)
    assert answers == tokenizer.batch_decode(natives, skip_special_tokens=True)


def test_translate_and_generate_from_a_cache(pair):
    cache = pair.translate(CONTEXTS[1])
    assert isinstance(cache, TranslatedCache) and cache.num_context_tokens == cache.get_seq_length()
    assert pair.generate(cache, PROMPT, max_new_tokens=8) == pair.generate(CONTEXTS[1], PROMPT, max_new_tokens=8)


def test_from_pretrained_takes_loaded_models_or_refuses_them_by_name(tmp_path):
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    translator.save_pretrained(tmp_path / "oracle")
    pair = MoTPair.from_pretrained(tmp_path / "oracle", source=(model, tokenizer), target=(model, tokenizer))
    assert torch.equal(pair.translator.key_mixture.in_proj.weight, translator.key_mixture.in_proj.weight)
    with pytest.raises(TypeError, match="`source` must be a name or path, or a \\(model, tokenizer\\) pair"):
        MoTPair.from_pretrained(tmp_path / "oracle", source=(tokenizer, model), target=(model, tokenizer))
    # The tiny models record no loadable name: the pair says which argument to pass.
    with pytest.raises(ValueError, match="pass `source=NAME_OR_PATH`"):
        MoTPair.from_pretrained(tmp_path / "oracle", target=(model, tokenizer))
    other = tiny_model("qwen2")
    with pytest.raises(ValueError, match="This translator was built for target_model"):
        MoTPair(MoTTranslator(MoTConfig.from_models(model.config, model.config)), model, tokenizer, other, tokenizer)


def test_generate_needs_one_prompt_or_one_per_context(pair):
    with pytest.raises(ValueError, match="`prompt` has 2 entries for 3 contexts: pass one, or one each"):
        pair.generate(CONTEXTS[:3], [PROMPT, PROMPT])
