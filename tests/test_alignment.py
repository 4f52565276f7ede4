"""Token alignment across tokenizers, from character offsets."""

import numpy as np
import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from hf_mot.alignment import align_contexts, build_alignment, encode_contexts, span_overlaps
from hf_mot.models import convert_embedded_model


def align_spans(*spans_and_specials):
    """`span_overlaps` as lists: for each target token, its `(source_index, weight)` pairs in source order."""
    index, weight = span_overlaps(*spans_and_specials)
    return [[(int(i), float(w)) for i, w in zip(r, v, strict=True) if w > 0] for r, v in zip(index, weight,
                                                                                            strict=True)]


@pytest.fixture(scope="module")
def real_tokenizers():
    names = ("smollm2-135m", "gemma3-270m")
    return {name: AutoTokenizer.from_pretrained(convert_embedded_model(name)) for name in names}


def _check_alignment(alignment, source, target):
    dense = alignment.to_dense()
    mask = target.attention_mask.bool()
    sums = dense.sum(-1)
    assert torch.allclose(sums[mask], torch.ones_like(sums[mask]), atol=1e-6)
    assert (sums[~mask] == 0).all()
    # Only real (non-padding) source tokens are used.
    assert (dense * (1 - source.attention_mask[:, None, :]) == 0).all()
    for b in range(dense.shape[0]):
        pad_t = target.input_ids.shape[1] - len(target.spans[b])
        pad_s = source.input_ids.shape[1] - len(source.spans[b])
        for t, ((a, e), special) in enumerate(zip(target.spans[b], target.special[b], strict=True)):
            used = dense[b, pad_t + t].nonzero().flatten().tolist()
            if special:
                continue
            # Every used source token overlaps the target token's text, or is its fallback neighbour.
            overlapping = [
                pad_s + i for i, (c, d) in enumerate(source.spans[b])
                if not source.special[b][i] and min(max(e, a + 1), d) - max(a, c) > 0
            ]
            if overlapping:
                assert sorted(used) == sorted(overlapping)
            else:
                assert len(used) == 1


# Pieces that stress offsets: emoji (one, and a ZWJ sequence), CJK, whitespace runs, accents, any unicode.
pieces = st.one_of(
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=8),
    st.sampled_from(["🙂", "👩\u200d💻", "東京", "  ", "\n", "\t", "   x", "é", "ß", " the", "ing"]),
)
text_strategy = st.lists(pieces, min_size=1, max_size=10).map("".join).filter(lambda s: s.strip())


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(texts=st.lists(text_strategy, min_size=1, max_size=3))
def test_real_tokenizers_property(real_tokenizers, texts):
    for src_name, tgt_name in (("smollm2-135m", "gemma3-270m"), ("gemma3-270m", "smollm2-135m")):
        source = encode_contexts(real_tokenizers[src_name], texts)
        target = encode_contexts(real_tokenizers[tgt_name], texts)
        _check_alignment(align_contexts(source, target), source, target)


@settings(max_examples=40, deadline=None)
@given(texts=st.lists(st.text(alphabet=st.sampled_from(list("abc XYZ.,!?\n09")), min_size=1, max_size=40)
                      .filter(lambda s: s.strip()), min_size=1, max_size=3))
def test_tiny_tokenizers_property(texts):
    source, target = encode_contexts(char_tokenizer(), texts), encode_contexts(bpe_tokenizer(), texts)
    _check_alignment(align_contexts(source, target), source, target)


def test_same_tokenizer_is_exact_identity(real_tokenizers):
    tokenizer = real_tokenizers["gemma3-270m"]
    encoded = encode_contexts(tokenizer, [CONTEXTS[0], "short 🙂"])
    alignment = align_contexts(encoded, encoded, same_tokenizer=True)
    assert alignment.is_identity
    dense = alignment.to_dense()
    expected = torch.diag_embed(encoded.attention_mask.float())
    assert torch.equal(dense, expected)
    features = torch.randn(2, 2, encoded.input_ids.shape[1], 4)
    assert alignment.apply(features) is features


def test_bos_maps_to_bos_and_words_to_words(real_tokenizers):
    text = "Paris is big."
    source = encode_contexts(real_tokenizers["gemma3-270m"], [text])
    target = encode_contexts(real_tokenizers["smollm2-135m"], [text])
    dense = align_contexts(source, target).to_dense()[0]
    # Gemma adds <bos>; SmolLM2's GGUF tokenizer may or may not: whichever target tokens are special map to
    # Gemma's BOS, and the first word maps onto the first word.
    for t, special in enumerate(target.special[0]):
        if special:
            assert dense[t].argmax().item() == 0
    first_word = target.special[0].index(False)
    assert source.special[0][0] and dense[first_word, 1] > 0


def test_gather_matches_dense_matrix():
    texts = CONTEXTS[:3]
    source, target = encode_contexts(char_tokenizer(), texts), encode_contexts(bpe_tokenizer(), texts)
    alignment = align_contexts(source, target)
    features = torch.randn(4, len(texts), source.input_ids.shape[1], 6)
    expected = torch.einsum("bts,lbsf->lbtf", alignment.to_dense(), features)
    assert torch.allclose(alignment.apply(features), expected, atol=1e-5)


def test_uncovered_text_falls_back_to_nearest_source_token():
    # Source covers "ab" and "d"; the target token over "c" overlaps nothing and takes "ab" (the one before).
    rows = align_spans([(0, 2), (3, 4)], [(0, 1), (2, 3), (3, 4)], [False, False], [False, False, False])
    assert rows == [[(0, 1.0)], [(0, 1.0)], [(1, 1.0)]]


def test_weights_follow_overlap_length():
    rows = align_spans([(0, 3), (3, 4)], [(1, 4)], [False, False], [False])
    assert rows == [[(0, 2 / 3), (1, 1 / 3)]]


def test_source_tokens_whose_ends_go_back_still_align():
    # Source token 2 lies inside token 1, so the ends go back (10, then 6). A bisect over the ends would skip
    # token 1 for the target token over 7-9 and fall back to a neighbour that does not overlap it.
    rows = align_spans([(0, 3), (3, 10), (4, 6), (10, 12)], [(7, 9), (2, 5)], [False] * 4, [False] * 2)
    assert rows == [[(1, 1.0)], [(0, 0.25), (1, 0.5), (2, 0.25)]]


def test_build_alignment_left_pads():
    rows = [(np.array([[0], [1]]), np.array([[1.0], [1.0]])), (np.array([[0]]), np.array([[1.0]]))]
    alignment = build_alignment(rows, num_source_tokens=[2, 1], num_target_tokens=[2, 1])
    dense = alignment.to_dense()
    assert dense[1].tolist() == [[0.0, 0.0], [0.0, 1.0]]
