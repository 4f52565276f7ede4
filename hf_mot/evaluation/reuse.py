"""Multi-agent memory reuse: agent A (the source model) has read a document; agent B (the target model) answers
several questions about it, three ways:

- `translated`: B continues from A's cache, translated once;
- `reread`: B reads the document itself (one prefill) and answers from its own cache;
- `summary`: A writes a summary of the document from its cache; B reads the summary and answers from that.

A's reading of the document is not counted (A has done it in every case). For each way: the mean F1 of the
answers, the total time (giving B its context, once, plus answering every question) and the peak memory it
added, with the size of the KV cache B holds.
"""

from __future__ import annotations

import copy
import time

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from .._compat import cache_kwarg
from ..alignment import encode_contexts
from ..modeling_mot import MoTTranslator
from ..pipeline import prefill_source, translate_context
from .cost import PeakRSS
from .qa import answer, native_cache
from .tasks import QAExample

WAYS = ("translated", "reread", "summary")


def _cache_mb(cache) -> float:
    return sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers) / 2**20


def _summarize_with_source(source_model, source_tokenizer, document: str, source_cache, tokens: int) -> str:
    prompt = source_tokenizer("\n\nSummary of the facts above:", add_special_tokens=False, return_tensors="pt")
    encoded = encode_contexts(source_tokenizer, [document])
    mask = torch.cat([encoded.attention_mask, torch.ones_like(prompt.input_ids)], 1)
    out = source_model.generate(input_ids=prompt.input_ids, attention_mask=mask, max_new_tokens=tokens,
                                do_sample=False, **{cache_kwarg(source_model): copy.deepcopy(source_cache)})
    return source_tokenizer.decode(out[0, prompt.input_ids.shape[1]:], skip_special_tokens=True).strip()


@torch.no_grad()
def multi_agent_reuse(
    documents: list[tuple[str, list[tuple[str, str]]]],
    *,
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    source_tokenizer: PreTrainedTokenizerBase,
    target_model: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
    summary_tokens: int = 64,
    max_new_tokens: int = 12,
    progress: bool = True,
) -> list[dict]:
    """Run the three ways on each `(document, [(question, answer), ...])`; one result dict per document."""
    rows = []
    for document, qa in tqdm(documents, desc="reuse", disable=not progress):
        examples = [QAExample("reuse", document, q, answers=[a]) for q, a in qa]
        source_cache = prefill_source(source_model, encode_contexts(source_tokenizer, [document]))
        row = {"questions": len(qa)}
        for way in WAYS:
            with PeakRSS() as rss:
                start = time.perf_counter()
                if way == "translated":
                    cache = translate_context(
                        document, translator=translator, source_model=source_model,
                        source_tokenizer=source_tokenizer, target_model=target_model,
                        target_tokenizer=target_tokenizer, source_cache=source_cache, recompute=0.0,
                    )
                    mask = cache.attention_mask
                elif way == "reread":
                    cache, mask = native_cache(target_model, target_tokenizer, document)
                else:
                    summary = _summarize_with_source(source_model, source_tokenizer, document, source_cache,
                                                     summary_tokens)
                    cache, mask = native_cache(target_model, target_tokenizer, summary or " ")
                    row["summary_text"] = summary
                context_seconds = time.perf_counter() - start
                answers = [
                    answer(e, target_model, target_tokenizer, copy.deepcopy(cache), mask, max_new_tokens)
                    for e in examples
                ]
                seconds = time.perf_counter() - start
            row[way] = {
                "f1": sum(a["score"] for a in answers) / len(answers),
                "exact_match": sum(a["exact_match"] for a in answers) / len(answers),
                "context_seconds": context_seconds, "total_seconds": seconds,
                "peak_added_mb": rss.added_mb, "cache_mb": _cache_mb(cache),
                "predictions": [a["prediction"] for a in answers],
            }
        rows.append(row)
    return rows


def summarize_reuse(rows: list[dict]) -> dict:
    """Means over documents for each way."""
    out = {"documents": len(rows), "questions": sum(r["questions"] for r in rows)}
    for way in WAYS:
        out[way] = {
            key: sum(r[way][key] for r in rows) / len(rows)
            for key in ("f1", "exact_match", "context_seconds", "total_seconds", "peak_added_mb", "cache_mb")
        }
    return out
