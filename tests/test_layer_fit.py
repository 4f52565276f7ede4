"""Dedicated layers (`MoTConfig.dedicated_layers`) and their fit (`hf_mot.training.layer_fit`), on tiny models."""

import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer, identity_translator, tiny_model

from hf_mot import MoTConfig, MoTTranslator, translate_context
from hf_mot.kv import decoder_layers
from hf_mot.training.layer_fit import (
    LayerFitRecord,
    attention_error,
    check_fit_layers,
    fit_dedicated_layers,
    record_pair,
    ridge_start,
    suffix_attention,
    with_dedicated_layers,
)

FULL = [1]  # the tiny Gemma 3's one full-attention layer


def _pair_translator():
    char, bpe = char_tokenizer(), bpe_tokenizer()
    source, target = tiny_model("llama"), tiny_model("gemma3", seed=1)
    torch.manual_seed(0)
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=char,
                                   target_tokenizer=bpe, hidden_size=16, expert_hidden_size=16)
    return source, target, MoTTranslator(config).eval(), char, bpe


def _cache_layers(cache):
    return [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]


def test_dedicated_layers_start_as_the_translator_they_extend():
    source, target, translator, char, bpe = _pair_translator()
    models = dict(source_model=source, source_tokenizer=char, target_model=target, target_tokenizer=bpe)
    before = _cache_layers(translate_context(CONTEXTS[0], translator=translator, **models))
    plain = with_dedicated_layers(translator, FULL, [0, 1], key_norm=False)
    assert sum(p.numel() for p in plain.key_mixture.dedicated.parameters()) > 0
    for (k, v), (k2, v2) in zip(before, _cache_layers(translate_context(CONTEXTS[0], translator=plain, **models)),
                                strict=True):
        torch.testing.assert_close(k2, k)
        torch.testing.assert_close(v2, v)

    # Normalised keys: only the dedicated layer's keys change, to unit RMS per head before the key norm's scale.
    normed = with_dedicated_layers(translator, FULL, [0, 1], key_norm=True)
    with torch.no_grad():
        normed.key_mixture.dedicated.bias.normal_()  # something to normalise away
        normed.value_mixture.dedicated.bias.normal_()
    out = normed(*_source_kv(source, char, bpe, target, normed))
    for layers, block in zip(out.block_layers, out.key_blocks, strict=True):
        for j, layer in enumerate(layers):
            rms = block[j, :, :, 1:].pow(2).mean(-1).sqrt()  # the first token is placed later
            if layer in FULL:
                torch.testing.assert_close(rms, torch.ones_like(rms), atol=1e-4, rtol=0)
    after = _cache_layers(translate_context(CONTEXTS[0], translator=normed, **models))
    for index, ((k, v), (k2, v2)) in enumerate(zip(before, after, strict=True)):
        assert torch.equal(k, k2) == (index not in FULL)
        assert torch.equal(v, v2) == (index not in FULL)


def _source_kv(source, source_tokenizer, target_tokenizer, target, translator):
    from hf_mot.alignment import encode_contexts
    from hf_mot.pipeline import read_source_and_align

    source_enc = encode_contexts(source_tokenizer, [CONTEXTS[0]])
    target_enc = encode_contexts(target_tokenizer, [CONTEXTS[0]])
    kv, alignment = read_source_and_align(source, source_tokenizer, target_tokenizer, source_enc, target_enc)
    embeddings = target.get_input_embeddings()(target_enc.input_ids)
    return kv.keys, kv.values, alignment, embeddings


def test_config_refuses_bad_dedicated_layers():
    config = tiny_model("llama").config
    target = tiny_model("gemma3").config
    with pytest.raises(ValueError, match="dedicated_source_layers"):
        MoTConfig.from_models(config, target, dedicated_layers=[1])
    with pytest.raises(ValueError, match=r"in \[0, 3\)"):
        MoTConfig.from_models(config, target, dedicated_layers=[3], dedicated_source_layers=[0])
    with pytest.raises(ValueError, match="increasing"):
        MoTConfig.from_models(config, target, dedicated_layers=[1], dedicated_source_layers=[1, 0])
    with pytest.raises(ValueError, match="need `dedicated_layers`"):
        MoTConfig.from_models(config, target, dedicated_key_norm=True)
    translator = MoTTranslator(MoTConfig.from_models(config, target, dedicated_layers=[0],
                                                     dedicated_source_layers=[0]))
    with pytest.raises(ValueError, match="sliding_attention layers"):
        check_fit_layers(translator)
    plain = MoTTranslator(MoTConfig.from_models(config, target))
    with pytest.raises(ValueError, match="no `dedicated_layers` to fit"):
        check_fit_layers(plain)
    with pytest.raises(ValueError, match="already has dedicated layers"):
        with_dedicated_layers(with_dedicated_layers(plain, FULL, [0], key_norm=True), FULL, [0], key_norm=True)


@pytest.mark.parametrize("family, layer, source_layers", [("gemma3", FULL[0], [0, 2]), ("smollm3", 0, [0, 1])])
def test_record_reads_the_targets_own_attention(family, layer, source_layers):
    """The queries the fit captures, with the target's own keys and values, give the layer's own attention output
    (also in SmolLM3's NoPE layer, whose queries are not rotated); and an exact translation (the identity) has no
    attention error."""
    tokenizer = bpe_tokenizer()
    model = tiny_model(family)
    translator = with_dedicated_layers(identity_translator(model, tokenizer), [layer], source_layers, key_norm=False)
    suffix = "\n\nQuestion: what was it?\nAnswer: the cat"
    seen = {}
    attention = decoder_layers(model)[layer].self_attn
    with torch.no_grad():  # sharp attention, so that queries rotated wrongly would change its output
        attention.q_proj.weight.mul_(20)
        attention.k_proj.weight.mul_(20)

    def keep(module, args, out):  # the longest call is the pass over context and suffix
        if "in" not in seen or args[0].shape[1] > seen["in"].shape[1]:
            seen["in"] = args[0]

    handle = attention.o_proj.register_forward_hook(keep)
    try:
        record = record_pair(translator, model, tokenizer, model, tokenizer, CONTEXTS[1], suffix)
    finally:
        handle.remove()
    tokens, heads = record.context_tokens, attention.config.num_attention_heads
    assert record.queries.shape[2] == len(tokenizer(suffix, add_special_tokens=False).input_ids)
    values = record.native_values.float().unflatten(-1, (model.config.num_key_value_heads, -1)).transpose(1, 2)
    _, out = suffix_attention(model, layer, record.queries, record.finished_keys.float(), values)
    own = seen["in"][0, tokens:].unflatten(-1, (heads, -1)).transpose(0, 1)
    torch.testing.assert_close(out[0], own, atol=2e-3, rtol=2e-3)  # the record keeps keys and values in float16

    kl, error = attention_error(translator, model, record)
    assert kl.abs().max() < 1e-4 and error.max() < 1e-4


def test_ridge_start_recovers_a_planted_map():
    _, _, translator, _, _ = _pair_translator()
    translator = with_dedicated_layers(translator, FULL, [0, 1], key_norm=False)
    path = translator.key_mixture.dedicated
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(path.weight.shape, generator=generator)
    bias = torch.randn(path.bias.shape, generator=generator)
    records = []
    for tokens in (40, 50, 60):
        inputs = torch.randn(tokens, path.in_features, generator=generator).half()
        base = torch.randn(1, tokens, path.weight.shape[2], generator=generator)
        native = base + (torch.einsum("tf,lfo->lto", inputs.float(), weight) + bias[:, None])
        records.append(LayerFitRecord(
            key_inputs=inputs, value_inputs=inputs, base_keys=base, base_values=base, native_keys=native,
            native_values=native, finished_keys=torch.zeros(1), queries=torch.zeros(1), query_inputs=torch.zeros(1),
            query_cos=torch.zeros(1), query_sin=torch.zeros(1),
        ))
    ridge_start(translator, records, ridge=1e-9)
    for fitted in (translator.key_mixture.dedicated, translator.value_mixture.dedicated):
        torch.testing.assert_close(fitted.weight, weight, atol=2e-3, rtol=0)
        torch.testing.assert_close(fitted.bias, bias, atol=2e-3, rtol=0)


def test_fit_lowers_the_attention_error():
    source, target, translator, char, bpe = _pair_translator()
    translator = with_dedicated_layers(translator, FULL, [0, 1], key_norm=True)
    report = fit_dedicated_layers(translator, source, char, target, bpe, pairs=12,
                                  validation_pairs=4, context_words=(20, 40), epochs=3, learning_rate=1e-3,
                                  progress=False)

    def loss(stage):
        return report[stage]["kl"][0] + report[stage]["output_error"][0]

    assert loss("distilled") < 0.9 * loss("without")
    assert loss("distilled") <= min(epoch["loss"] for epoch in report["epochs"]) + 1e-6
    assert torch.count_nonzero(translator.key_mixture.dedicated.weight) > 0


def test_fit_of_maps_that_read_the_residual_stream():
    """With `bottom_layers`, the record's map inputs end with the target's residual stream entering that layer
    (RMS-normalised), not its token embeddings; the fit lowers the error of the layer above."""
    from hf_mot.alignment import encode_contexts

    char, bpe = char_tokenizer(), bpe_tokenizer()
    source, target = tiny_model("llama"), tiny_model("gemma3-deep", seed=1)
    torch.manual_seed(0)
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=char, target_tokenizer=bpe,
                                   hidden_size=16, expert_hidden_size=16)
    translator = with_dedicated_layers(MoTTranslator(config).eval(), [3], [0, 1], key_norm=True, bottom_layers=2,
                                       target_config=target.config)
    record = record_pair(translator, source, char, target, bpe, CONTEXTS[1], "\n\nQuestion: who?\nAnswer: the cat")
    ids = encode_contexts(bpe, [CONTEXTS[1]]).input_ids
    with torch.no_grad():
        residual = target.model(input_ids=ids, output_hidden_states=True).hidden_states[2][0]
    normed = residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + 1e-6)
    width = target.config.hidden_size
    torch.testing.assert_close(record.key_inputs[:, -width:].float(), normed, atol=5e-3, rtol=5e-3)  # float16

    report = fit_dedicated_layers(translator, source, char, target, bpe, pairs=12, validation_pairs=4,
                                  context_words=(20, 40), epochs=3, learning_rate=1e-3, progress=False)
    loss = {stage: report[stage]["kl"][0] + report[stage]["output_error"][0] for stage in ("without", "distilled")}
    assert loss["distilled"] < 0.9 * loss["without"]


def test_maps_that_read_the_tokens_before(tmp_path):
    """With `previous_tokens`, the maps also read the target's embeddings of the tokens before each one (zeros before
    the first); a left-padded row reads what it reads alone, even where the pad token's embedding is not zero; and
    the setting survives saving."""
    from hf_mot.alignment import encode_contexts

    source, target, translator, char, bpe = _pair_translator()
    with torch.no_grad():
        target.get_input_embeddings().weight[bpe.pad_token_id].normal_()
    translator = with_dedicated_layers(translator, FULL, [0, 1], key_norm=True, previous_tokens=2)
    with torch.no_grad():
        for path in (translator.key_mixture.dedicated, translator.value_mixture.dedicated):
            path.weight.normal_(std=0.05)
    width = target.config.hidden_size
    source_features = translator.config.source_layout.feature_size
    assert translator.key_mixture.dedicated.in_features == 2 * source_features + 3 * width  # two source layers

    record = record_pair(translator, source, char, target, bpe, CONTEXTS[1], "\n\nQuestion: who?\nAnswer: the cat")
    with torch.no_grad():
        embedded = target.get_input_embeddings()(encode_contexts(bpe, [CONTEXTS[1]]).input_ids)[0]
    for shift in (1, 2):
        before = torch.cat([embedded.new_zeros(shift, width), embedded[:-shift]])
        start = record.key_inputs.shape[1] - (3 - shift) * width
        torch.testing.assert_close(record.key_inputs[:, start:start + width].float(), before, atol=5e-3, rtol=5e-3)

    models = dict(source_model=source, source_tokenizer=char, target_model=target, target_tokenizer=bpe)
    contexts = [CONTEXTS[0], "Short."]
    batched = translate_context(contexts, translator=translator, **models)
    alone = translate_context(contexts[1], translator=translator, **models)
    tokens = alone.num_context_tokens
    for layer in range(len(alone.layers)):
        torch.testing.assert_close(batched.layers[layer].keys[1:, :, -tokens:], alone.layers[layer].keys,
                                   atol=1e-5, rtol=1e-4)

    translator.save_pretrained(tmp_path)
    loaded = MoTTranslator.from_pretrained(tmp_path)
    assert loaded.config.dedicated_previous_tokens == 2
    again = translate_context(contexts[1], translator=loaded, **models)
    torch.testing.assert_close(again.layers[FULL[0]].keys, alone.layers[FULL[0]].keys)


def test_previous_tokens_in_the_key_maps_only(tmp_path):
    """`previous_tokens_keys_only` widens the key maps alone: the value maps and what the fit records for them read
    each token as before, and the setting survives saving."""
    source, target, translator, char, bpe = _pair_translator()
    plain = with_dedicated_layers(translator, FULL, [0, 1], key_norm=True)
    keys_only = with_dedicated_layers(translator, FULL, [0, 1], key_norm=True, previous_tokens=2,
                                      previous_tokens_keys_only=True)
    width = target.config.hidden_size
    assert keys_only.key_mixture.dedicated.in_features == plain.key_mixture.dedicated.in_features + 2 * width
    assert keys_only.value_mixture.dedicated.in_features == plain.value_mixture.dedicated.in_features
    record = record_pair(keys_only, source, char, target, bpe, CONTEXTS[1], "\n\nQuestion: who?\nAnswer: the cat")
    assert record.key_inputs.shape[1] == keys_only.key_mixture.dedicated.in_features
    assert record.value_inputs.shape[1] == plain.value_mixture.dedicated.in_features
    keys_only.save_pretrained(tmp_path)
    loaded = MoTTranslator.from_pretrained(tmp_path)
    assert loaded.config.dedicated_previous_tokens_keys_only
    assert loaded.value_mixture.dedicated.in_features == plain.value_mixture.dedicated.in_features


def test_config_refuses_previous_tokens_without_token_embeddings():
    config, target = tiny_model("llama").config, tiny_model("gemma3-deep").config
    with pytest.raises(ValueError, match="need `dedicated_layers`"):
        MoTConfig.from_models(config, target, dedicated_previous_tokens=1)
    with pytest.raises(ValueError, match="whole number >= 0"):
        MoTConfig.from_models(config, target, dedicated_layers=[3], dedicated_source_layers=[0],
                              dedicated_previous_tokens=-1)
    with pytest.raises(ValueError, match="needs `dedicated_previous_tokens` >= 1"):
        MoTConfig.from_models(config, target, dedicated_layers=[3], dedicated_source_layers=[0],
                              dedicated_previous_tokens_keys_only=True)
    with pytest.raises(ValueError, match="read the target's token embeddings"):
        MoTConfig.from_models(config, target, target_tokens=False, dedicated_layers=[3], dedicated_source_layers=[0],
                              dedicated_previous_tokens=1)
    with pytest.raises(ValueError, match="read the target's token embeddings"):
        MoTConfig.from_models(config, target, dedicated_layers=[3], dedicated_source_layers=[0],
                              dedicated_bottom_layers=2, dedicated_previous_tokens=1)
