"""The dial's `strategy="bottom"` (`hf_mot.bottom_layers`): the target reads its bottom layers itself and the
translation fills the layers above."""

import pytest
import torch
from conftest import CONTEXTS, char_tokenizer, identity_translator, native_and_translated, tiny_model
from test_recompute import PROMPT, _pair, _translate
from transformers import DynamicCache

from hf_mot.alignment import encode_contexts
from hf_mot.bottom_layers import bottom_layer_share, bottom_layers_within, read_bottom_layers
from hf_mot.pipeline import read_into_cache


def test_bottom_read_is_the_targets_own_cache():
    model, tokenizer = tiny_model("gemma3"), char_tokenizer()
    encoded = encode_contexts(tokenizer, CONTEXTS[:3])  # a left-padded batch
    native = DynamicCache(config=model.config)
    with torch.no_grad():
        read_into_cache(model, native, encoded.input_ids, encoded.attention_mask, encoded.position_ids)
        bottom = read_bottom_layers(model, encoded.input_ids, encoded.attention_mask, encoded.position_ids, 1)
    for index in (0, 1):
        assert torch.equal(bottom.layers[index].keys, native.layers[index].keys)
        assert torch.equal(bottom.layers[index].values, native.layers[index].values)
    assert not bottom.layers[2].is_initialized  # it stopped in layer 1


def test_bottom_layers_are_own_and_the_rest_translated():
    source, target, translator = _pair()  # a translator far from the identity
    tokens = encode_contexts(char_tokenizer(), CONTEXTS[:2]).input_ids.shape[1]
    layers = bottom_layers_within(target.config, 0.9, tokens)
    assert layers == 1
    bottom = _translate(CONTEXTS[:2], translator, source, target, recompute=0.9, strategy="bottom")
    pure = _translate(CONTEXTS[:2], translator, source, target, recompute=0)
    native = _translate(CONTEXTS[:2], translator, source, target, recompute=1)
    assert bottom.native_layers == layers + 1 and bottom.native_tokens == 0
    for index, layer in enumerate(bottom.layers):
        expected = native.layers[index] if index <= layers else pure.layers[index]
        assert torch.equal(layer.keys, expected.keys) and torch.equal(layer.values, expected.values)


@pytest.mark.parametrize("recompute", [0.3, 0.9])
def test_identity_oracle_with_the_bottom_strategy(recompute):
    model, tokenizer = tiny_model("gemma3"), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    native, translated = native_and_translated(model, tokenizer, translator, CONTEXTS[:3], PROMPT,
                                               recompute=recompute, strategy="bottom", max_new_tokens=16,
                                               do_sample=False)
    assert translated.tolist() == native.tolist()


def test_bad_strategy_settings_are_refused():
    source, target, translator = _pair()
    with pytest.raises(ValueError, match="`strategy` must be"):
        _translate(CONTEXTS[0], translator, source, target, recompute=0.5, strategy="sideways")
    with pytest.raises(ValueError, match="not `native_tail`"):
        _translate(CONTEXTS[0], translator, source, target, native_tail=4, strategy="bottom")
    with pytest.raises(ValueError, match="does not pay for the target's first layer"):
        _translate(CONTEXTS[0], translator, source, target, recompute=0.01, strategy="bottom")


def test_gemma3_cost_model(gemma3):
    """Gemma 3's five sliding layers below its first full-attention layer cost about a quarter of a prefill."""
    config = gemma3[0].config
    shares = [bottom_layer_share(config, k, 2048) for k in range(len(config.layer_types) - 1)]
    assert shares == sorted(shares) and shares[-1] < 1
    assert 0.2 < shares[5] < 0.35
    assert bottom_layers_within(config, shares[5], 2048) == 5
    assert bottom_layers_within(config, shares[5] - 1e-6, 2048) == 4
