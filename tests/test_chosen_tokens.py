"""The dial's `strategy="deviation"` (`hf_mot.chosen_tokens`): the target reads its layer-0 keys and values for
every token and recomputes the tokens whose translation deviates most from them, each at its place."""

import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer, identity_translator, native_and_translated, tiny_model
from test_recompute import PROMPT, _pair, _translate
from transformers import DynamicCache

from hf_mot.alignment import encode_contexts
from hf_mot.bottom_layers import bottom_layer_share, read_bottom_layers
from hf_mot.chosen_tokens import chosen_token_count
from hf_mot.pipeline import encode_pair, fill_translated_cache, read_into_cache, read_source_and_align, run_translator

# Left-padded, and longer than the tiny Gemma 3's sliding window (8): chosen tokens early in a row look back
# through translated and recomputed tokens alike, inside and outside the window.
BATCH = [CONTEXTS[0], CONTEXTS[2][:30], CONTEXTS[4]]


@pytest.mark.parametrize("family", ["gemma3", "llama", "opt", "qwen2"])  # qwen2: one key/value head, as Gemma-3-270M
@pytest.mark.parametrize("recompute", [0.2, 0.7])
def test_identity_oracle_the_cache_is_the_targets_own(family, recompute):
    """With an exact translation, recomputing chosen tokens in place gives exactly the target's own cache: a
    chosen token that saw a superseded translated copy of another, a key outside its window, a padding column or a
    wrong position would move its states."""
    model, tokenizer = tiny_model(family), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    cache = translate_with(model, tokenizer, translator, BATCH, recompute)
    encoded = encode_contexts(tokenizer, BATCH)
    native = DynamicCache(config=model.config)
    with torch.no_grad():
        read_into_cache(model, native, encoded.input_ids, encoded.attention_mask, encoded.position_ids)
    real = encoded.attention_mask.bool()
    for mine, own in zip(cache.layers, native.layers, strict=True):
        assert mine.keys.shape == own.keys.shape
        kept = real[:, None, -own.keys.shape[2] :, None]  # padding columns hold whatever the reader left there
        for a, b in ((mine.keys, own.keys), (mine.values, own.values)):
            assert torch.allclose(a * kept, b * kept, atol=1e-5)


def translate_with(model, tokenizer, translator, contexts, recompute):
    from hf_mot import translate_context

    return translate_context(contexts, translator=translator, source_model=model, source_tokenizer=tokenizer,
                             target_model=model, target_tokenizer=tokenizer, recompute=recompute,
                             strategy="deviation")


def test_identity_oracle_generates_the_native_tokens():
    model, tokenizer = tiny_model("gemma3"), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    native, translated = native_and_translated(model, tokenizer, translator, BATCH, PROMPT, recompute=0.4,
                                               strategy="deviation", max_new_tokens=12, do_sample=False)
    assert translated.tolist() == native.tolist()


def test_the_most_deviating_tokens_are_recomputed_and_the_rest_translated():
    source, target, translator = _pair()  # a translator far from the identity
    contexts = BATCH[:2]
    share = 0.4
    chosen = _translate(contexts, translator, source, target, recompute=share, strategy="deviation")
    pure = _translate(contexts, translator, source, target, recompute=0)
    own = _translate(contexts, translator, source, target, recompute=1)
    real = encode_contexts(char_tokenizer(), contexts).attention_mask.bool()
    tokens = real.shape[1]
    count = chosen_token_count(target.config, share, tokens)
    assert count == int((share - bottom_layer_share(target.config, 0, tokens)) * tokens) > 0
    assert chosen.native_layers == 1 and chosen.native_tokens == 0
    assert torch.equal(chosen.layers[0].keys, own.layers[0].keys)  # layer 0 is the target's own, every token
    assert torch.equal(chosen.layers[0].values, own.layers[0].values)
    # The full-attention layer keeps every token: exactly `count` per row differ from the pure translation there,
    # and they are those whose translated layer-0 states were furthest from the target's own.
    layer = target.config.layer_types.index("full_attention")
    changed = (chosen.layers[layer].keys != pure.layers[layer].keys).any(dim=3).any(dim=1)
    assert changed.sum(dim=1).tolist() == [count] * len(contexts)
    assert not (changed & ~real).any()
    for row in range(len(contexts)):
        assert not changed[row, int(real[row].long().argmax())]  # the first token is the target's own already
    # Computed here from the whole translation of layer 0 (the cache keeps only the window of that sliding layer).
    source_enc, target_enc = encode_pair(contexts, translator, source, bpe_tokenizer(), target, char_tokenizer())
    kv, alignment = read_source_and_align(source, bpe_tokenizer(), char_tokenizer(), source_enc, target_enc)
    with torch.no_grad():
        translated = run_translator(translator, kv, alignment, target, target_enc.input_ids, target_enc.attention_mask)
    _, whole = fill_translated_cache(translated, target, target_enc)
    own_first = read_bottom_layers(target, target_enc.input_ids, target_enc.attention_mask, target_enc.position_ids,
                                   0, keep_all=True).layers[0]
    score = sum(((mine - theirs) ** 2).mean(dim=(1, 3)) / (theirs**2).mean()
                for mine, theirs in zip(whole[0], (own_first.keys, own_first.values), strict=True))
    for row in range(len(contexts)):
        first = int(real[row].long().argmax())
        tail = list(range(tokens - count // 2, tokens))  # half the count: the last tokens
        score[row, first] = -1
        score[row, ~real[row]] = -2
        score[row, tail] = -3
        expected = set(score[row].topk(count - len(tail)).indices.tolist()) | set(tail)
        assert set(changed[row].nonzero().flatten().tolist()) == expected
