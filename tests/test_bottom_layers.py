"""The dial's `strategy="bottom"` (`hf_mot.bottom_layers`): the target reads its bottom layers itself and the
translation fills the layers above."""

import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer, identity_translator, native_and_translated, tiny_model
from test_recompute import PROMPT, _pair, _same_cache, _translate
from transformers import DynamicCache

from hf_mot import MoTConfig, MoTTranslator
from hf_mot.alignment import encode_contexts
from hf_mot.bottom_layers import bottom_layer_share, bottom_layers_within, read_bottom_layers
from hf_mot.pipeline import build_translated_cache, encode_pair, read_into_cache, read_source_and_align
from hf_mot.training.layer_fit import with_dedicated_layers


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


@pytest.mark.parametrize(("strategy", "too_small", "message"), [
    ("bottom", 0.01, "does not pay for the target's first layer"),
    ("deviation", 0.001, "does not pay for the target's layer-0 keys"),  # the layer-0 read it chooses tokens by
])
def test_bad_strategy_settings_are_refused(strategy, too_small, message):
    source, target, translator = _pair()
    with pytest.raises(ValueError, match="`strategy` must be"):
        _translate(CONTEXTS[0], translator, source, target, recompute=0.5, strategy="sideways")
    with pytest.raises(ValueError, match="not `native_tail`"):
        _translate(CONTEXTS[0], translator, source, target, native_tail=4, strategy=strategy)
    with pytest.raises(ValueError, match=message):
        _translate(CONTEXTS[0], translator, source, target, recompute=too_small, strategy=strategy)


def test_gemma3_cost_model(gemma3):
    """Gemma 3's five sliding layers below its first full-attention layer cost about a quarter of a prefill."""
    config = gemma3[0].config
    shares = [bottom_layer_share(config, k, 2048) for k in range(len(config.layer_types) - 1)]
    assert shares == sorted(shares) and shares[-1] < 1
    assert 0.2 < shares[5] < 0.35
    assert bottom_layers_within(config, shares[5], 2048) == 5
    assert bottom_layers_within(config, shares[5] - 1e-6, 2048) == 4


def _conditioned():
    """A translator (far from the identity) whose dedicated map for layer 3 reads the residual stream entering
    layer 2 of a tiny Gemma 3 with full-attention layers 1 and 3."""
    source, target = tiny_model("llama", seed=3), tiny_model("gemma3-deep", seed=4)
    torch.manual_seed(5)
    plain = MoTTranslator(MoTConfig.from_models(source.config, target.config, hidden_size=16)).eval()
    translator = with_dedicated_layers(plain, [3], [0, 1], key_norm=True, bottom_layers=2,
                                       target_config=target.config)
    with torch.no_grad():
        for param in translator.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return source, target, translator


def test_dedicated_maps_read_the_targets_residual_stream():
    source, target, translator = _conditioned()
    contexts = CONTEXTS[:2]  # a left-padded batch
    tokens = encode_contexts(char_tokenizer(), contexts).input_ids.shape[1]
    assert bottom_layer_share(target.config, 2, tokens) <= translator.config.recompute < 1
    cache = _translate(contexts, translator, source, target)  # the recommended recompute, strategy "bottom"
    native = _translate(contexts, translator, source, target, recompute=1)
    assert cache.native_layers == 3
    for index in range(3):
        assert torch.equal(cache.layers[index].keys, native.layers[index].keys)

    source_enc, target_enc = encode_pair(contexts, translator, source, bpe_tokenizer(), target, char_tokenizer())
    kv, alignment = read_source_and_align(source, bpe_tokenizer(), char_tokenizer(), source_enc, target_enc)
    with torch.no_grad():
        states = target.model(input_ids=target_enc.input_ids, attention_mask=target_enc.attention_mask,
                              position_ids=target_enc.position_ids, output_hidden_states=True).hidden_states

    def layer_3(residual):
        built = build_translated_cache(translator, kv, alignment, target, target_enc, target_residual=residual)
        return built.layers[3]

    expected = layer_3(states[2])  # the input of layer 2
    torch.testing.assert_close(cache.layers[3].keys, expected.keys)
    torch.testing.assert_close(cache.layers[3].values, expected.values)
    assert not torch.allclose(cache.layers[3].keys, layer_3(states[1]).keys)


def test_a_conditioned_translator_saves_and_loads(tmp_path):
    source, target, translator = _conditioned()
    translator.save_pretrained(tmp_path)
    loaded = MoTTranslator.from_pretrained(tmp_path).eval()
    assert loaded.config.dedicated_bottom_layers == 2 and loaded.config.recompute == translator.config.recompute
    _same_cache(_translate(CONTEXTS[0], loaded, source, target), _translate(CONTEXTS[0], translator, source, target))


def test_a_conditioned_translator_refuses_what_cannot_feed_it():
    source, target, translator = _conditioned()
    with pytest.raises(ValueError, match="Raise `recompute`"):
        _translate(CONTEXTS[0], translator, source, target, recompute=0)
    with pytest.raises(ValueError, match="Raise `recompute`"):
        _translate(CONTEXTS[0], translator, source, target, recompute=0.1)
    with pytest.raises(ValueError, match="`strategy='bottom'` only"):
        _translate(CONTEXTS[0], translator, source, target, recompute=0.5, strategy="tail")
    with pytest.raises(ValueError, match="not `native_tail`"):
        _translate(CONTEXTS[0], translator, source, target, native_tail=3)
    source_enc, target_enc = encode_pair(CONTEXTS[0], translator, source, bpe_tokenizer(), target, char_tokenizer())
    kv, alignment = read_source_and_align(source, bpe_tokenizer(), char_tokenizer(), source_enc, target_enc)
    with pytest.raises(ValueError, match="read the target's residual stream entering layer 2"):
        build_translated_cache(translator, kv, alignment, target, target_enc)
    with pytest.raises(ValueError, match="`target_residual` must be"):
        build_translated_cache(translator, kv, alignment, target, target_enc,
                               target_residual=torch.zeros(1, 3, target.config.hidden_size))

    def config(**options):
        return MoTConfig.from_models(source.config, target.config, dedicated_source_layers=[0], **options)

    with pytest.raises(ValueError, match="not above"):
        config(dedicated_layers=[1, 3], dedicated_bottom_layers=2)
    with pytest.raises(ValueError, match=r"layer index in \[1, 2\]"):
        config(dedicated_layers=[3], dedicated_bottom_layers=3)
    with pytest.raises(ValueError, match="needs `target_embedding_size`"):
        config(dedicated_layers=[3], dedicated_bottom_layers=2, target_tokens=False)


def test_vllm_store_refuses_a_conditioned_translator(tmp_path):
    from hf_mot.integrations.vllm_store import write_store_entries

    source, target, translator = _conditioned()
    with pytest.raises(ValueError, match="residual stream"):
        write_store_entries(tmp_path, CONTEXTS[0], translator=translator, source_model=source,
                            source_tokenizer=bpe_tokenizer(), target_model=target, target_tokenizer=char_tokenizer())
    assert not any(tmp_path.iterdir())
