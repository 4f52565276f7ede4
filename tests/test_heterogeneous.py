"""Different models on the two sides: tokenizer, depth, head layout, RoPE and attention pattern all differ."""

import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer, tiny_model

from hf_mot import MoTConfig, MoTTranslator, TranslatedCache, translate_context
from hf_mot._compat import cache_kwarg
from hf_mot.kv import read_source_cache
from hf_mot.training.widen import widen_translator


def _check_generates(source, source_tok, target, target_tok, translator, contexts, recompute=0.0):
    cache = translate_context(
        contexts, translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
        target_tokenizer=target_tok, recompute=recompute,
    )
    assert isinstance(cache, TranslatedCache)
    layout = translator.target_layout
    batch = len(contexts)
    assert len(cache.layers) == layout.num_layers
    for layer in cache.layers:
        assert layer.keys.shape[:2] == (batch, layout.num_kv_heads) and layer.keys.shape[-1] == layout.head_dim
        assert torch.isfinite(layer.keys).all() and torch.isfinite(layer.values).all()
    prompt = target_tok([" Answer:"] * batch, return_tensors="pt", add_special_tokens=False).input_ids
    out = target.generate(
        input_ids=prompt, attention_mask=cache.generation_mask(prompt.shape[1]), max_new_tokens=5, do_sample=False,
        **{cache_kwarg(target): cache},
    )
    assert out.shape == (batch, prompt.shape[1] + 5)
    assert ((out >= 0) & (out < target.config.vocab_size)).all()


def test_per_layer_baseline_generates():
    source, target = tiny_model("opt", seed=1), tiny_model("gemma3", seed=2)
    source_tok, target_tok = char_tokenizer(), bpe_tokenizer()
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=source_tok,
                                   target_tokenizer=target_tok, architecture="per_layer", expert_hidden_size=24)
    translator = MoTTranslator(config).eval()
    assert not hasattr(translator, "key_mixture")
    assert translator.projector.source_layers == [0, 0, 1]  # 2 source layers spread over 3 target layers
    for recompute in (0.0, 0.3):
        _check_generates(source, source_tok, target, target_tok, translator, CONTEXTS[:2], recompute)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("recompute", [0.0, 0.3])
@pytest.mark.parametrize("source_family, target_family", [("llama", "gemma3"), ("gpt2", "qwen2"), ("opt", "llama")])
def test_tiny_pairs(source_family, target_family, recompute, batch):
    source, target = tiny_model(source_family, seed=1), tiny_model(target_family, seed=2)
    source_tok, target_tok = char_tokenizer(), bpe_tokenizer()
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=source_tok,
                                   target_tokenizer=target_tok, hidden_size=16, expert_hidden_size=16)
    translator = MoTTranslator(config).eval()
    _check_generates(source, source_tok, target, target_tok, translator, CONTEXTS[:batch], recompute)


@pytest.mark.real_models
@pytest.mark.parametrize("batch", [1, 3])
def test_smollm2_to_gemma3_untrained(smollm2, gemma3, batch):
    (source, source_tok), (target, target_tok) = smollm2, gemma3
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=source_tok,
                                   target_tokenizer=target_tok)
    assert config.source["num_layers"] == 30 and config.target["num_layers"] == 18
    translator = MoTTranslator(config).eval()
    contexts = ["A context with emoji 🙂, CJK 東京 and   runs of spaces.", CONTEXTS[0], CONTEXTS[1]][:batch]
    for recompute in (0.0, 0.3):
        _check_generates(source, source_tok, target, target_tok, translator, contexts, recompute)


def test_window_injection_only_replaces_the_window():
    """Below the injected window, the window-injection diagnostic's cache is exactly the target's own cache."""
    from hf_mot.evaluation.injection import translate_with_window

    target, tok = tiny_model("qwen2"), char_tokenizer()
    source = tiny_model("llama", seed=5)
    translator = MoTTranslator(MoTConfig.from_models(source.config, target.config, hidden_size=16))
    cache = translate_with_window(CONTEXTS[0], translator=translator, source_model=source, source_tokenizer=tok,
                                  target_model=target, target_tokenizer=tok, window=(1, 1))
    from transformers import DynamicCache

    from hf_mot.alignment import encode_contexts

    native = DynamicCache(config=target.config)
    with torch.no_grad():
        ids = encode_contexts(tok, [CONTEXTS[0]]).input_ids
        target(input_ids=ids, use_cache=True, **{cache_kwarg(target): native})
    assert torch.equal(cache.layers[0].keys, native.layers[0].keys)
    assert not torch.allclose(cache.layers[1].keys, native.layers[1].keys)
    assert not torch.allclose(cache.layers[2].keys, native.layers[2].keys)  # shifted by the injected layer


def test_native_tail_is_read_by_the_target():
    """With `native_tail=k`, the tokens before the tail keep their translation and the tail is the target's own
    reading of it: at layer 0 (which sees only the token and its position) exactly the target's native states."""
    target, tok = tiny_model("llama", seed=1), char_tokenizer()
    source = tiny_model("qwen2", seed=5)
    translator = MoTTranslator(MoTConfig.from_models(source.config, target.config, hidden_size=16)).eval()
    kwargs = dict(translator=translator, source_model=source, source_tokenizer=tok, target_model=target,
                  target_tokenizer=tok)
    plain = translate_context(CONTEXTS[0], **kwargs)
    tail = translate_context(CONTEXTS[0], native_tail=6, **kwargs)
    from transformers import DynamicCache

    from hf_mot.alignment import encode_contexts

    native = DynamicCache(config=target.config)
    with torch.no_grad():
        ids = encode_contexts(tok, [CONTEXTS[0]]).input_ids
        target(input_ids=ids, use_cache=True, **{cache_kwarg(target): native})
    assert tail.get_seq_length() == plain.get_seq_length() == ids.shape[1]
    assert torch.equal(tail.attention_mask, plain.attention_mask)
    for layer in range(len(tail.layers)):
        assert torch.equal(tail.layers[layer].keys[:, :, :-6], plain.layers[layer].keys[:, :, :-6])
        assert torch.equal(tail.layers[layer].values[:, :, :-6], plain.layers[layer].values[:, :, :-6])
    torch.testing.assert_close(tail.layers[0].keys[:, :, -6:], native.layers[0].keys[:, :, -6:])
    torch.testing.assert_close(tail.layers[0].values[:, :, -6:], native.layers[0].values[:, :, -6:])
    assert not torch.allclose(plain.layers[0].keys[:, :, -6:], native.layers[0].keys[:, :, -6:])
    assert not torch.allclose(tail.layers[1].keys[:, :, -6:], native.layers[1].keys[:, :, -6:])  # reads the rest


def test_first_token_is_the_targets_own():
    """The first context token of each row (BOS here) sees only itself: its states come from the target, exactly
    as native prefill caches them, also in a left-padded batch, and again after the target's weights change
    (they are computed once per model and token); the other tokens stay translated."""
    target, tok = tiny_model("gemma3", seed=1), char_tokenizer()
    source = tiny_model("llama", seed=5)
    translator = MoTTranslator(MoTConfig.from_models(source.config, target.config, hidden_size=16)).eval()
    contexts = [CONTEXTS[0], CONTEXTS[2][:30]]
    from transformers import DynamicCache

    from hf_mot.alignment import encode_contexts

    encoded = encode_contexts(tok, contexts)
    first = encoded.attention_mask.argmax(dim=1)
    for _ in range(2):
        cache = translate_context(contexts, translator=translator, source_model=source, source_tokenizer=tok,
                                  target_model=target, target_tokenizer=tok)
        for row, column in enumerate(first.tolist()):
            native = DynamicCache()
            with torch.no_grad():
                target(input_ids=encoded.input_ids[row : row + 1, column:], use_cache=True,
                       **{cache_kwarg(target): native})
            ours, own = cache.layers[1], native.layers[1]  # the global layer keeps every token
            torch.testing.assert_close(ours.keys[row, :, column], own.keys[0, :, 0])
            torch.testing.assert_close(ours.values[row, :, column], own.values[0, :, 0])
            assert not torch.allclose(ours.keys[row, :, -1], own.keys[0, :, -1])
        with torch.no_grad():
            target.model.layers[0].mlp.down_proj.weight.mul_(3.0)  # changes what layer 1 caches


@pytest.mark.parametrize("native_tail", [0, 3])
def test_sliding_layers_get_only_the_tokens_they_keep(native_tail):
    """The translator produces a sliding-window layer's last `sliding_window - 1` tokens only (plus the native
    tail's); the cache, its token counts and what generate() makes of it equal translating every token."""
    from hf_mot.alignment import align_contexts, encode_contexts
    from hf_mot.pipeline import fill_translated_cache, prefill_source, run_translator

    target, tok = tiny_model("gemma3", seed=1), char_tokenizer()  # sliding window 8, contexts of ~80 tokens
    source = tiny_model("llama", seed=5)
    translator = MoTTranslator(MoTConfig.from_models(source.config, target.config, hidden_size=16,
                                                     depth_matched_layers=1)).eval()
    with torch.no_grad():
        for param in translator.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    contexts = [CONTEXTS[0], CONTEXTS[2][:30]]
    source_tok = bpe_tokenizer()
    kwargs = dict(translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
                  target_tokenizer=tok)
    trimmed = translate_context(contexts, native_tail=native_tail, **kwargs)

    source_enc, target_enc = encode_contexts(source_tok, contexts), encode_contexts(tok, contexts)
    with torch.no_grad():
        source_kv = read_source_cache(prefill_source(source, source_enc), source, source_enc.attention_mask)
        out = run_translator(translator, source_kv, align_contexts(source_enc, target_enc), target,
                             target_enc.input_ids, target_enc.attention_mask)
    if native_tail:  # the tail as build_translated_cache reads it, on top of every token translated
        out.key_blocks, out.value_blocks = ([s[:, :, :, :-native_tail] for s in blocks]
                                            for blocks in (out.key_blocks, out.value_blocks))
        head = type(target_enc)(target_enc.input_ids[:, :-native_tail], target_enc.attention_mask[:, :-native_tail],
                                target_enc.spans, target_enc.special)
        every, _ = fill_translated_cache(out, target, head)
        every.attention_mask = target_enc.attention_mask
        with torch.no_grad():
            target.get_decoder()(input_ids=target_enc.input_ids[:, -native_tail:],
                                 attention_mask=target_enc.attention_mask,
                                 position_ids=target_enc.position_ids[:, -native_tail:], use_cache=True,
                                 **{cache_kwarg(target): every})
    else:
        every, _ = fill_translated_cache(out, target, target_enc)
    assert trimmed.layers[0].keys.shape[2] == 7 and trimmed.layers[1].keys.shape[2] == target_enc.input_ids.shape[1]
    for ours, reference in zip(trimmed.layers, every.layers, strict=True):
        assert ours.get_seq_length() == reference.get_seq_length() == target_enc.input_ids.shape[1]
        torch.testing.assert_close(ours.keys, reference.keys)
        torch.testing.assert_close(ours.values, reference.values)
    prompt = tok([" Answer:"] * 2, return_tensors="pt", add_special_tokens=False).input_ids
    generated = [
        target.generate(input_ids=prompt, attention_mask=cache.generation_mask(prompt.shape[1]), max_new_tokens=12,
                        do_sample=False, **{cache_kwarg(target): cache})
        for cache in (trimmed, every)
    ]
    assert generated[0].tolist() == generated[1].tolist()


def test_save_and_load_round_trip(tmp_path):
    source, target = tiny_model("llama"), tiny_model("gemma3")
    translator = MoTTranslator(MoTConfig.from_models(source.config, target.config, hidden_size=16))
    translator.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = MoTTranslator.from_pretrained(tmp_path)
    assert loaded.config.source == translator.config.source
    for (name, a), (_, b) in zip(translator.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # And it computes the same thing (no state outside the weights is lost or left uninitialised).
    tok = char_tokenizer()
    caches = [
        translate_context(CONTEXTS[0], translator=t, source_model=source, source_tokenizer=tok, target_model=target,
                          target_tokenizer=tok)
        for t in (translator, loaded)
    ]
    for a, b in zip(caches[0].layers, caches[1].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def _one_context_for_the_translator(source, tok):
    """The first context encoded (one tokenizer on both sides), the source's position-free KV of it and the
    alignment: the inputs of a direct `MoTTranslator` call."""
    from hf_mot.alignment import align_contexts, encode_contexts
    from hf_mot.pipeline import prefill_source

    encoded = encode_contexts(tok, [CONTEXTS[0]])
    source_kv = read_source_cache(prefill_source(source, encoded), source, encoded.attention_mask)
    return encoded, source_kv, align_contexts(encoded, encoded)


def _translate(translator, source, target, tok):
    return translate_context(CONTEXTS[:2], translator=translator, source_model=source, source_tokenizer=tok,
                             target_model=target, target_tokenizer=tok)


def _translates_alike(first, second, source, target, tok):
    """Assert that two translators give exactly the same cache; return the first's."""
    before, after = _translate(first, source, target, tok), _translate(second, source, target, tok)
    for a, b in zip(before.layers, after.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    return before


def test_added_paths_start_as_the_translator_they_extend(tmp_path):
    """`hf-mot train --init-from` adds the target-token reader and the depth-matched path to a translator
    without them: it must start as that translator (both start at zero), load no uninitialised weights, and
    then each path must be live."""
    source, target, tok = tiny_model("llama"), tiny_model("gemma3"), char_tokenizer()
    config = MoTConfig.from_models(source.config, target.config, hidden_size=16, target_tokens=False)
    assert config.target_embedding_size is None
    torch.manual_seed(0)
    without = MoTTranslator(config).eval()
    without.save_pretrained(tmp_path)
    with_reader = MoTTranslator.from_pretrained(
        tmp_path, target_embedding_size=target.config.hidden_size, depth_matched_layers=2
    ).eval()
    reader = with_reader.key_mixture.target_tokens
    assert torch.equal(reader.proj_weight, torch.zeros_like(reader.proj_weight))
    assert torch.equal(reader.norm_weight, torch.ones_like(reader.norm_weight))
    before = _translates_alike(without, with_reader, source, target, tok)
    with torch.no_grad():
        reader.proj_weight.normal_()
    changed = _translate(with_reader, source, target, tok)
    assert not torch.allclose(changed.layers[0].keys, before.layers[0].keys)
    assert torch.equal(changed.layers[0].values, before.layers[0].values)  # only the key mixture was touched
    depth = with_reader.value_mixture.depth_matched
    assert torch.equal(depth.weight, torch.zeros_like(depth.weight))
    with torch.no_grad():
        depth.weight[1].normal_()
    changed_again = _translate(with_reader, source, target, tok)
    assert torch.equal(changed_again.layers[0].values, changed.layers[0].values)  # its own weight per layer
    assert not torch.allclose(changed_again.layers[1].values, changed.layers[1].values)


def test_widened_translator_starts_as_the_one_it_widens():
    """`widen_translator` (`hf-mot train --init-from ... --hidden-size/--expert-hidden-size`) adds hidden
    dimensions and expert units: the wider translator must start as the narrow one, and the added parts must
    receive gradients (a block of zeros on both sides of a product would never learn)."""
    source, target, tok = tiny_model("llama"), tiny_model("gemma3"), char_tokenizer()
    config = MoTConfig.from_models(source.config, target.config, hidden_size=16, expert_hidden_size=8,
                                   depth_matched_layers=1)
    torch.manual_seed(0)
    narrow = MoTTranslator(config).eval()
    with torch.no_grad():  # trained-looking experts: fresh ones write nothing
        for mixture in (narrow.key_mixture, narrow.value_mixture):
            mixture.expert_out.normal_(std=0.3)
    wide = widen_translator(narrow, hidden_size=24, expert_hidden_size=12).eval()
    assert (wide.config.hidden_size, wide.config.expert_hidden_size) == (24, 12)
    assert wide.key_mixture.expert_in.shape == (config.num_experts, 24, 12)
    before, after = _translate(narrow, source, target, tok), _translate(wide, source, target, tok)
    for a, b in zip(before.layers, after.layers, strict=True):
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert (x - y).norm() < 0.05 * x.norm()  # only the layer norm's mean moves (0.07% on the shipped one)
    assert not all(torch.equal(a.keys, b.keys) for a, b in zip(before.layers, after.layers, strict=True))

    encoded, source_kv, alignment = _one_context_for_the_translator(source, tok)
    embeddings = target.get_input_embeddings()(encoded.input_ids)
    out = wide.train()(source_kv.keys, source_kv.values, alignment, target_embeddings=embeddings)
    sum(k.square().sum() + v.square().sum() for k, v in zip(out.key_blocks, out.value_blocks, strict=True)).backward()
    mixture = wide.value_mixture
    grad = mixture.in_proj.weight.grad.abs()
    # Added hidden dimensions learn at the pace of the old ones (through the layer norm alone: 0.2% of it).
    assert grad[16:].mean() > 0.1 * grad[:16].mean()
    assert mixture.expert_out.grad[:, 8:].abs().sum() > 0  # added expert units
    with pytest.raises(ValueError, match="widen"):
        widen_translator(wide, hidden_size=16)


def test_depth_matched_source_layers():
    from hf_mot.mixture import depth_matched_source_layers

    assert [depth_matched_source_layers(30, t, 18, 2) for t in (0, 9, 17)] == [[0, 1], [14, 15], [28, 29]]
    assert [depth_matched_source_layers(2, t, 3, 1) for t in range(3)] == [[0], [0], [1]]
    assert depth_matched_source_layers(4, 0, 4, 4) == [0, 1, 2, 3]


def test_reading_target_tokens_needs_their_embeddings():
    source, target, tok = tiny_model("llama"), tiny_model("gemma3"), char_tokenizer()
    config = MoTConfig.from_models(source.config, target.config, hidden_size=16)
    assert config.target_embedding_size == target.config.hidden_size  # on by default
    translator = MoTTranslator(config)
    _, source_kv, alignment = _one_context_for_the_translator(source, tok)
    with pytest.raises(ValueError, match="target_embeddings="):
        translator(source_kv.keys, source_kv.values, alignment)
    wrong = torch.zeros(1, alignment.num_target_tokens - 1, target.config.hidden_size)
    with pytest.raises(ValueError, match="must be"):
        translator(source_kv.keys, source_kv.values, alignment, target_embeddings=wrong)
    with pytest.raises(ValueError, match="per-layer baseline"):
        MoTConfig.from_models(source.config, target.config, architecture="per_layer",
                              target_embedding_size=target.config.hidden_size)
    with pytest.raises(ValueError, match="depth_matched_layers"):
        MoTConfig.from_models(source.config, target.config, depth_matched_layers=source.config.num_hidden_layers + 1)
    with pytest.raises(ValueError, match="depth_matched_layers"):
        MoTConfig.from_models(source.config, target.config, depth_matched_layers=-1)
