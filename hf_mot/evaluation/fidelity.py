"""Language-modelling fidelity: does the target continue from a translated cache as it does after reading?

For held-out (context, continuation) pairs, the target scores the continuation three ways: with no context
(floor), after reading the context natively (ceiling), and from the translated cache. All three are fed the
same continuation tokens and score tokens 2..n (the first continuation token is the input that starts every
condition, as a prompt does at generation time).

- gap closed = (NLL without context - NLL translated) / (NLL without context - NLL native);
- top-1 agreement = share of positions where the translated and native next-token argmax agree;
- KL = mean KL(native || translated) of the next-token distributions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .._compat import cache_kwarg
from ..data import training_documents, wikipedia_articles
from ..modeling_mot import MoTTranslator
from ..target_adapter import reading_translated
from ..training.data import document_split
from .qa import translated_conditions

HELDOUT_PARTS = ("test", "selection")
# Where held-out pairs come from: the corpus's validation split (same domains as training), or long Wikipedia
# articles (gensim's test data), a domain no training document comes from.
HELDOUT_DOMAINS = ("corpus", "wikipedia")
# Wikipedia articles are long: without a cap a few of them would give every pair of a length.
PAIRS_PER_ARTICLE = 4


@dataclass
class FidelityExample:
    context: str
    continuation_ids: list[int]
    context_tokens: int
    corpus: str
    document: int = -1  # index of its document among the shuffled validation documents (-1: made by hand)


def heldout_examples(
    tokenizer: PreTrainedTokenizerBase,
    lengths: tuple[int, ...] = (64, 128, 256, 512),
    per_length: int = 60,
    continuation_tokens: int = 32,
    validation_percent: int = 5,
    seed: int = 0,
    part: str = "test",
    domain: str = "corpus",
) -> list[FidelityExample]:
    """Pairs cut from the validation documents (never trained on), `per_length` for each context length in
    target tokens (BOS included).

    The documents are shuffled once (`seed`); `part="test"` takes them from the front, `part="selection"` from
    the back, so that choosing a checkpoint or a setting on the selection part leaves the test pairs unseen as
    long as the two parts together need no more documents than there are (`FidelityExample.document` says
    which document a pair came from, to check). `domain="wikipedia"` cuts them from long Wikipedia articles instead,
    at most `PAIRS_PER_ARTICLE` per article and length: a domain no training document comes from."""
    if part not in HELDOUT_PARTS:
        raise ValueError(f"`part` must be one of {HELDOUT_PARTS}, got {part!r}.")
    if domain not in HELDOUT_DOMAINS:
        raise ValueError(f"`domain` must be one of {HELDOUT_DOMAINS}, got {domain!r}.")
    if domain == "wikipedia":
        documents = [("wikipedia", article) for article in wikipedia_articles()]
    else:
        documents = [
            (corpus, doc)
            for corpus, docs in sorted(training_documents().items())
            for doc in docs
            if document_split(doc, validation_percent) == "validation"
        ]
    cap = PAIRS_PER_ARTICLE if domain == "wikipedia" else None
    random.Random(seed).shuffle(documents)
    order = range(len(documents)) if part == "test" else range(len(documents) - 1, -1, -1)
    tokenized = [(i, documents[i][0], tokenizer(documents[i][1], add_special_tokens=False).input_ids) for i in order]
    examples = []
    for length in lengths:
        found = []
        for document, corpus, ids in tokenized:
            span = (length - 1) + continuation_tokens
            for start in list(range(0, len(ids) - span + 1, span))[:cap]:
                context = tokenizer.decode(ids[start : start + length - 1])
                continuation = ids[start + length - 1 : start + span]
                found.append(FidelityExample(context, continuation, length, corpus, document))
                if len(found) == per_length:
                    break
            if len(found) == per_length:
                break
        if len(found) < per_length:
            raise ValueError(
                f"The validation documents give only {len(found)} pairs of {length} context tokens; "
                f"asked for {per_length}. Lower `per_length` or the length."
            )
        examples.extend(found)
    return examples


def _continuation_logits(model: PreTrainedModel, ids: torch.Tensor, prefix: int, cache=None, prefix_mask=None):
    """Logits predicting continuation tokens 2..n, given `prefix` tokens (in `ids` or in `cache`) before them."""
    continuation = ids.shape[1] - (0 if cache is not None else prefix)
    kwargs = {"logits_to_keep": continuation}  # the 262k-token output layer only where it is scored
    if cache is not None:
        kwargs[cache_kwarg(model)] = cache
        kwargs["attention_mask"] = torch.cat([prefix_mask, torch.ones_like(ids)], 1)
        kwargs["position_ids"] = prefix + torch.arange(ids.shape[1]).unsqueeze(0)
    with reading_translated(cache, model):
        logits = model(input_ids=ids, use_cache=cache is not None, **kwargs).logits
    return logits[0, :-1].float()


@torch.no_grad()
def evaluate_fidelity(
    examples: list[FidelityExample],
    *,
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    source_tokenizer: PreTrainedTokenizerBase,
    target_model: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
    conditions: dict[str, dict],
    tail_only: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Score every example natively, without context, and under each translated condition.

    Args:
        conditions: name -> keyword arguments of `translate_context` (e.g. `{"recompute": 0.1}`); a
            `"translator"` entry overrides `translator` (see `qa.translated_conditions`).
        tail_only: if > 0, also score condition `"tail_only"`: the target reads only the last `tail_only`
            context tokens, no translation. It is the floor a `native_tail` of that length has to beat, so that
            what the tail itself brings is not credited to translation.

    Returns:
        One dict per example: `context_tokens`, `corpus`, and per condition the summed NLL, the number of
        scored tokens, the top-1 agreements with native and the summed KL to native.
    """
    bos = [target_tokenizer.bos_token_id] if target_tokenizer.bos_token_id is not None else []
    rows = []
    for example in tqdm(examples, desc="fidelity", disable=not progress):
        continuation = torch.tensor([example.continuation_ids])
        targets = continuation[0, 1:]
        context_ids = target_tokenizer(example.context, add_special_tokens=True, return_tensors="pt").input_ids
        native = _continuation_logits(
            target_model, torch.cat([context_ids, continuation], 1), context_ids.shape[1]
        )
        alone = _continuation_logits(target_model, torch.tensor([bos + example.continuation_ids]), len(bos))
        native_logp = native.log_softmax(-1)
        row = {"context_tokens": example.context_tokens, "corpus": example.corpus, "scored": len(targets)}
        row["native"] = {"nll": F.cross_entropy(native, targets, reduction="sum").item()}
        row["no_context"] = {"nll": F.cross_entropy(alone, targets, reduction="sum").item()}
        translated = translated_conditions(
            example.context, conditions, translator=translator, source_model=source_model,
            source_tokenizer=source_tokenizer, target_model=target_model, target_tokenizer=target_tokenizer,
        )
        for name, cache, _ in translated:
            logits = _continuation_logits(
                target_model, continuation, cache.get_seq_length(), cache=cache, prefix_mask=cache.attention_mask
            )
            row[name] = _against_native(logits, targets, native, native_logp)
        if tail_only:
            tail = context_ids[0, -tail_only:].tolist()
            ids = torch.tensor([bos + tail + example.continuation_ids])
            logits = _continuation_logits(target_model, ids, len(bos) + len(tail))
            row["tail_only"] = _against_native(logits, targets, native, native_logp)
        rows.append(row)
    return rows


def _against_native(logits, targets, native, native_logp) -> dict:
    logp = logits.log_softmax(-1)
    kl = (native_logp.exp() * (native_logp - logp)).sum(-1)
    return {
        "nll": F.cross_entropy(logits, targets, reduction="sum").item(),
        "top1_agree": (logits.argmax(-1) == native.argmax(-1)).sum().item(),
        "kl": kl.sum().item(),
        # Position 0 is the first prediction after the context: where last-state shift shows.
        "kl_by_position": kl.tolist(),
    }


def summarize(rows: list[dict], conditions: list[str]) -> dict:
    """Token-weighted NLLs, the share of the gap closed, top-1 agreement and KL, for a set of rows."""
    scored = sum(r["scored"] for r in rows)
    none = sum(r["no_context"]["nll"] for r in rows) / scored
    native = sum(r["native"]["nll"] for r in rows) / scored
    out = {"examples": len(rows), "scored_tokens": scored, "nll_no_context": none, "nll_native": native}
    for name in conditions:
        nll = sum(r[name]["nll"] for r in rows) / scored
        out[name] = {
            "nll": nll,
            "gap_closed": (none - nll) / (none - native) if none != native else float("nan"),
            "top1_agreement": sum(r[name]["top1_agree"] for r in rows) / scored,
            "kl": sum(r[name]["kl"] for r in rows) / scored,
        }
        if all("kl_by_position" in r[name] for r in rows):
            out[name]["kl_by_position"] = [
                sum(values) / len(values)
                for values in zip(*(r[name]["kl_by_position"] for r in rows), strict=False)
            ]
    return out


def paired_difference(rows: list[dict], baseline: str, other: str, resamples: int = 2000, seed: int = 0) -> dict:
    """`other` minus `baseline` in gap closed and top-1 agreement (fractions, as `summarize` gives them), each
    with a 95% bootstrap interval from resampling the examples (one resample for both conditions: paired), so
    that two translators measured on the same pairs can be told apart from noise."""
    columns = {name: torch.tensor(values, dtype=torch.float64) for name, values in {
        "scored": [r["scored"] for r in rows], "none": [r["no_context"]["nll"] for r in rows],
        "native": [r["native"]["nll"] for r in rows],
        **{f"{key}_{c}": [r[c][key] for r in rows] for c in (baseline, other) for key in ("nll", "top1_agree")},
    }.items()}

    def stats(weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # weights: (resamples, examples) counts of each example in each resample.
        total = {name: weights @ column for name, column in columns.items()}
        gap = [(total["none"] - total[f"nll_{c}"]) / (total["none"] - total["native"]) for c in (baseline, other)]
        top1 = [total[f"top1_agree_{c}"] / total["scored"] for c in (baseline, other)]
        return gap[1] - gap[0], top1[1] - top1[0]

    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(len(rows), (resamples, len(rows)), generator=generator)
    weights = torch.zeros(resamples, len(rows), dtype=torch.float64).scatter_add_(
        1, draws, torch.ones_like(draws, dtype=torch.float64))
    gap, top1 = stats(torch.ones(1, len(rows), dtype=torch.float64))
    gap_draws, top1_draws = stats(weights)
    return {"examples": len(rows), "gap_closed": gap.item(), "gap_closed_interval": _interval(gap_draws),
            "top1_agreement": top1.item(), "top1_agreement_interval": _interval(top1_draws)}


def _interval(draws: torch.Tensor) -> list[float]:
    return [draws.quantile(0.025).item(), draws.quantile(0.975).item()]
