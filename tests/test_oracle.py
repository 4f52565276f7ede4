"""The oracle: the same model on both sides with an identity translator reproduces native prefill exactly."""

import pytest
from conftest import CONTEXTS, char_tokenizer, identity_translator, native_and_translated, tiny_model

PROMPT = " Question: what is this about? Answer:"


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "gpt2", "opt"])
@pytest.mark.parametrize("mode", ["full", "window"])
def test_tiny_identity_oracle(family, mode):
    model, tokenizer = tiny_model(family), char_tokenizer()
    options = {"injection_mode": mode}
    if mode == "window":
        options.update(injection_start=1, injection_layers=1)
    translator = identity_translator(model, tokenizer, **options)
    for context in CONTEXTS:
        native, translated = native_and_translated(
            model, tokenizer, translator, context, PROMPT, max_new_tokens=32, do_sample=False
        )
        assert translated.tolist() == native.tolist(), context


@pytest.mark.real_models
@pytest.mark.parametrize("model_fixture", ["smollm2", "gemma3"])
@pytest.mark.parametrize("mode", ["full", "window"])
def test_real_identity_oracle(model_fixture, mode, request):
    model, tokenizer = request.getfixturevalue(model_fixture)
    options = {"injection_mode": mode}
    if mode == "window":
        options.update(injection_start=2, injection_layers=6)
    translator = identity_translator(model, tokenizer, **options)
    for context in CONTEXTS:
        native, translated = native_and_translated(
            model, tokenizer, translator, context, PROMPT, max_new_tokens=32, do_sample=False
        )
        assert translated.tolist() == native.tolist(), context
