"""The LM-fidelity metrics, on hand-made rows and on the identity oracle."""

import math

import pytest
from conftest import CONTEXTS, char_tokenizer, identity_translator, tiny_model

from hf_mot.evaluation import FidelityExample, evaluate_fidelity, summarize
from hf_mot.evaluation.fidelity import paired_difference


def test_summary_of_known_rows():
    rows = [
        {"scored": 2, "no_context": {"nll": 8.0}, "native": {"nll": 4.0},
         "full": {"nll": 5.0, "top1_agree": 1, "kl": 0.5}},
        {"scored": 2, "no_context": {"nll": 4.0}, "native": {"nll": 2.0},
         "full": {"nll": 2.0, "top1_agree": 2, "kl": 0.1}},
    ]
    summary = summarize(rows, ["full"])
    assert summary["nll_no_context"] == 3.0 and summary["nll_native"] == 1.5
    assert summary["full"]["nll"] == 1.75
    assert math.isclose(summary["full"]["gap_closed"], (3.0 - 1.75) / (3.0 - 1.5))
    assert summary["full"]["top1_agreement"] == 0.75
    assert math.isclose(summary["full"]["kl"], 0.15)


def test_paired_difference_of_known_rows():
    rows = [
        {"scored": 4, "no_context": {"nll": 8.0 + i % 3}, "native": {"nll": 4.0},
         "a": {"nll": 6.0, "top1_agree": 2, "kl": 0.5}, "b": {"nll": 5.0 + (i % 2), "top1_agree": 3, "kl": 0.4}}
        for i in range(40)
    ]
    summary = summarize(rows, ["a", "b"])
    d = paired_difference(rows, "a", "b")
    # b minus a, as the summaries of each give them
    assert math.isclose(d["gap_closed"], summary["b"]["gap_closed"] - summary["a"]["gap_closed"])
    assert math.isclose(d["top1_agreement"], 0.25)
    low, high = d["gap_closed_interval"]
    assert 0 < low < d["gap_closed"] < high  # b is better on every row, yet the rows vary
    assert d["top1_agreement_interval"] == pytest.approx([0.25, 0.25])  # the same difference on every row
    same = paired_difference(rows, "a", "a")
    assert same["gap_closed"] == 0 and same["gap_closed_interval"] == [0, 0]


@pytest.mark.parametrize("mode", ["full", "window"])
def test_identity_translator_closes_the_whole_gap(mode):
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    examples = [
        FidelityExample(c[:40], tokenizer(c[40:60], add_special_tokens=False).input_ids, 41, "test")
        for c in CONTEXTS
    ]
    options = {"window": (1, 1)} if mode == "window" else {}
    rows = evaluate_fidelity(
        examples, translator=translator, source_model=model, source_tokenizer=tokenizer, target_model=model,
        target_tokenizer=tokenizer, conditions={mode: options}, progress=False,
    )
    summary = summarize(rows, [mode])
    assert summary["nll_no_context"] != summary["nll_native"]
    assert math.isclose(summary[mode]["gap_closed"], 1.0, abs_tol=1e-4)
    assert summary[mode]["top1_agreement"] == 1.0
    assert abs(summary[mode]["kl"]) < 1e-5


def test_tail_only_floor():
    """The tail-only floor is the target reading just the last tokens: a tail as long as the whole context is
    native reading (the gap closes), a shorter one is not."""
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    examples = [
        FidelityExample(c[:40], tokenizer(c[40:60], add_special_tokens=False).input_ids, 41, "test")
        for c in CONTEXTS
    ]
    kwargs = dict(translator=translator, source_model=model, source_tokenizer=tokenizer, target_model=model,
                  target_tokenizer=tokenizer, conditions={"full+tail": {"native_tail": 8}}, progress=False)
    whole = summarize(evaluate_fidelity(examples, tail_only=40, **kwargs), ["tail_only"])
    assert math.isclose(whole["tail_only"]["gap_closed"], 1.0, abs_tol=1e-4)  # 40 tokens after BOS: everything
    rows = evaluate_fidelity(examples, tail_only=8, **kwargs)
    short = summarize(rows, ["tail_only", "full+tail"])
    assert short["tail_only"]["kl"] > 1e-6  # the tiny model reads little, but not nothing, from the rest
    assert math.isclose(short["full+tail"]["gap_closed"], 1.0, abs_tol=1e-4)  # exact translation + tail


@pytest.mark.real_models
def test_selection_pairs_come_from_other_documents_than_the_test_pairs(gemma3):
    from hf_mot.evaluation import heldout_examples

    _, tokenizer = gemma3
    test = heldout_examples(tokenizer, lengths=(64, 512), per_length=8)
    selection = heldout_examples(tokenizer, lengths=(64, 512), per_length=8, part="selection")
    assert len(selection) == len(test) == 16
    assert min(e.document for e in selection) > max(e.document for e in test)
    assert not {e.context for e in test} & {e.context for e in selection}
    with pytest.raises(ValueError, match="part"):
        heldout_examples(tokenizer, lengths=(64,), per_length=1, part="validation")


@pytest.mark.real_models
def test_wikipedia_pairs_are_another_domain_spread_over_articles(gemma3):
    from collections import Counter

    from hf_mot.evaluation import heldout_examples
    from hf_mot.evaluation.fidelity import PAIRS_PER_ARTICLE

    _, tokenizer = gemma3
    pairs = heldout_examples(tokenizer, lengths=(64, 256), per_length=12, domain="wikipedia")
    corpus = heldout_examples(tokenizer, lengths=(64,), per_length=12)
    assert len(pairs) == 24 and {e.corpus for e in pairs} == {"wikipedia"}
    assert max(Counter((e.document, e.context_tokens) for e in pairs).values()) <= PAIRS_PER_ARTICLE
    assert not {e.context for e in pairs} & {e.context for e in corpus}
    with pytest.raises(ValueError, match="domain"):
        heldout_examples(tokenizer, lengths=(64,), per_length=1, domain="news")
