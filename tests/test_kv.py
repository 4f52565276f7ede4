"""Reading source caches: RoPE and key-norm round trips, head layouts, sliding windows."""

import pytest
import torch
from conftest import CONTEXTS, char_tokenizer, tiny_model

from hf_mot.alignment import encode_contexts
from hf_mot.kv import KVLayout, apply_rope, finish_target_keys, read_source_cache, undo_rope
from hf_mot.pipeline import prefill_source


def _round_trip_error(model, tokenizer, contexts):
    encoded = encode_contexts(tokenizer, contexts)
    cache = prefill_source(model, encoded)
    source = read_source_cache(cache, model, encoded.attention_mask, encoded.position_ids)
    worst = 0.0
    for layer_idx in range(len(cache.layers)):
        keys, values = source.layer(layer_idx)
        redone = finish_target_keys(model, layer_idx, keys, encoded.position_ids)
        real = encoded.attention_mask.bool()[:, None, :, None].expand_as(redone)
        worst = max(worst, (redone - cache.layers[layer_idx].keys)[real].abs().max().item())
        assert torch.equal(values, cache.layers[layer_idx].values)
    return worst


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3", "gpt2"])
def test_tiny_rope_round_trip(family):
    assert _round_trip_error(tiny_model(family), char_tokenizer(), CONTEXTS[:2]) < 1e-5


@pytest.mark.real_models
@pytest.mark.parametrize("model_fixture", ["smollm2", "gemma3"])
def test_real_rope_round_trip(model_fixture, request):
    model, tokenizer = request.getfixturevalue(model_fixture)
    assert _round_trip_error(model, tokenizer, CONTEXTS[:2]) < 1e-5


def test_undo_rope_inverts_apply_rope_with_scaling():
    x = torch.randn(2, 3, 5, 8)
    angle = torch.rand(2, 5, 4) * 6
    cos, sin = torch.cat([angle.cos()] * 2, -1) * 1.3, torch.cat([angle.sin()] * 2, -1) * 1.3
    assert torch.allclose(undo_rope(apply_rope(x, cos, sin), cos, sin), x, atol=1e-5)
    # Rotation changes the keys, so the test above is not vacuous.
    assert not torch.allclose(apply_rope(x, cos, sin), x, atol=1e-2)


def test_rope_keys_become_position_free():
    """The same token at two positions gives the same position-free key (first layer: no context mixing)."""
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    encoded = encode_contexts(tokenizer, ["aaaa"])
    cache = prefill_source(model, encoded)
    keys = read_source_cache(cache, model, encoded.attention_mask).layer(0)[0]
    assert torch.allclose(keys[:, :, 1], keys[:, :, 4], atol=1e-5)
    assert not torch.allclose(cache.layers[0].keys[:, :, 1], cache.layers[0].keys[:, :, 4], atol=1e-3)


def test_nope_layers_are_read_unrotated():
    """SmolLM3's NoPE layer caches keys without RoPE: they are position-free as they are, and undoing RoPE there
    would make the same token's keys differ between positions; translated keys stay unrotated there."""
    model, tokenizer = tiny_model("smollm3"), char_tokenizer()
    encoded = encode_contexts(tokenizer, ["aaaa"])
    cache = prefill_source(model, encoded)
    assert torch.allclose(cache.layers[0].keys[:, :, 1], cache.layers[0].keys[:, :, 4], atol=1e-5)
    keys = read_source_cache(cache, model, encoded.attention_mask).layer(0)[0]
    assert torch.allclose(keys[:, :, 1], keys[:, :, 4], atol=1e-5)
    # Finishing translated keys: the same position-free key at every position stays unrotated in the NoPE layer
    # and is rotated by position in the RoPE layer.
    same = torch.randn(1, 2, 1, 8).expand(1, 2, 5, 8)
    positions = torch.arange(5)[None]
    nope, rope = finish_target_keys(model, [0, 1], torch.stack([same, same]), positions)
    assert torch.allclose(nope[:, :, 1], nope[:, :, 4], atol=1e-5)
    assert not torch.allclose(rope[:, :, 1], rope[:, :, 4], atol=1e-3)


def test_head_layout_recorded():
    layout = KVLayout.from_config(tiny_model("gemma3").config)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (3, 2, 8)
    assert layout.sliding_window == 8 and layout.layer_types[1] == "full_attention"
    gpt2 = KVLayout.from_config(tiny_model("gpt2").config)
    assert (gpt2.num_kv_heads, gpt2.head_dim) == (4, 8)


def test_sliding_window_source_cache_keeps_every_token():
    model, tokenizer = tiny_model("gemma3"), char_tokenizer()
    encoded = encode_contexts(tokenizer, [CONTEXTS[0]])
    source = read_source_cache(prefill_source(model, encoded), model, encoded.attention_mask)
    assert source.keys.shape[:3] == (1, encoded.input_ids.shape[1], len(model.model.layers))
