"""The oracle: the same model on both sides with an identity translator reproduces native prefill exactly."""

import pytest
from conftest import CONTEXTS, char_tokenizer, identity_translator, native_and_translated, tiny_model

PROMPT = " Question: what is this about? Answer:"


def _assert_oracle(model, tokenizer, window=None):
    """Exact tokens from the translated cache, or with `window` from the window-injection diagnostic's."""
    translator = identity_translator(model, tokenizer)
    for context in CONTEXTS:
        native, translated = native_and_translated(
            model, tokenizer, translator, context, PROMPT, window=window, max_new_tokens=32, do_sample=False
        )
        assert translated.tolist() == native.tolist(), context


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "gpt2", "opt"])
@pytest.mark.parametrize("window", [None, (1, 1)])
def test_tiny_identity_oracle(family, window):
    _assert_oracle(tiny_model(family), char_tokenizer(), window)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_identity_oracle_with_native_tail(family):
    """The target reading the last tokens itself on top of an exact translation is native prefill, also for a
    left-padded batch and across Gemma 3's sliding window (8 tokens, shorter than the tail's context)."""
    model, tokenizer = tiny_model(family), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    for contexts in (CONTEXTS[0], CONTEXTS[:3]):
        native, translated = native_and_translated(
            model, tokenizer, translator, contexts, PROMPT, native_tail=5, max_new_tokens=16, do_sample=False
        )
        assert translated.tolist() == native.tolist()


@pytest.mark.real_models
@pytest.mark.parametrize("model_fixture", ["smollm2", "gemma3"])
@pytest.mark.parametrize("window", [None, (2, 6)])
def test_real_identity_oracle(model_fixture, window, request):
    model, tokenizer = request.getfixturevalue(model_fixture)
    _assert_oracle(model, tokenizer, window)
