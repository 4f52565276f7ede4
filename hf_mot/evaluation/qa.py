"""Run QA tasks side by side: the target with no context (floor), reading the context natively (ceiling),
and continuing from translated caches (one or more conditions, e.g. `full` and `window` mode).

Every condition answers the same prompt tokens after its context, and the source reads each context once (it
already has its cache in the settings translation is for), so the time of a condition is what it takes to give
the target its context: the native prefill, or the translation.
"""

from __future__ import annotations

import copy
import statistics
import time

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from .._compat import cache_kwarg
from ..alignment import encode_contexts
from ..modeling_mot import MoTTranslator
from ..pipeline import prefill_source, read_into_cache, translate_context
from ..target_adapter import reading_translated
from .injection import translate_with_window
from .metrics import answer_found, choice_correct, exact_match, token_f1
from .tasks import QAExample


def native_cache(target_model: PreTrainedModel, target_tokenizer: PreTrainedTokenizerBase, context: str):
    """The target's own cache of `context` (the re-prefill that translation replaces), and its mask."""
    encoded = encode_contexts(target_tokenizer, [context], target_model.device)
    cache = DynamicCache(config=target_model.config)
    read_into_cache(target_model, cache, encoded.input_ids, encoded.attention_mask)
    return cache, encoded.attention_mask


def answer(
    example: QAExample,
    target_model: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
    cache=None,
    context_mask: torch.Tensor | None = None,
    max_new_tokens: int = 12,
) -> dict:
    """The target's answer to `example` after the context in `cache` (no context when `cache` is None).

    Closed-set examples: the log-probabilities of each choice's first token and whether the best is right (as
    `score` and `found`). Extractive ones: the greedy answer up to the first newline, its F1, exact match and
    whether it contains an answer (`found`).
    """
    prompt = target_tokenizer(example.prompt, add_special_tokens=False, return_tensors="pt").input_ids
    if cache is None:
        bos = target_tokenizer.bos_token_id
        prompt = torch.cat([torch.tensor([[bos]]), prompt], 1) if bos is not None else prompt
        mask, kwargs = torch.ones_like(prompt), {}
    else:
        mask = torch.cat([context_mask, torch.ones_like(prompt)], 1)
        kwargs = {cache_kwarg(target_model): cache}
    prompt, mask = prompt.to(target_model.device), mask.to(target_model.device)
    if example.choices is not None:
        with reading_translated(cache, target_model):
            log_probs = [_choice_log_prob(target_model, target_tokenizer, prompt, mask, cache, choice)
                         for choice in example.choices]
        label = example.choices.index(example.answers[0])
        correct = choice_correct(log_probs, label)
        return {"log_probs": log_probs, "score": correct, "found": correct}
    with reading_translated(cache, target_model):
        out = target_model.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=max_new_tokens,
                                    do_sample=False, **kwargs)
    text = target_tokenizer.decode(out[0, prompt.shape[1]:], skip_special_tokens=True).split("\n")[0].strip()
    return {"prediction": text, "score": token_f1(text, example.answers),
            "exact_match": exact_match(text, example.answers), "found": answer_found(text, example.answers)}


def _choice_log_prob(model, tokenizer, prompt, mask, cache, choice: str) -> float:
    """Summed log-probability of the tokens of `choice` after the prompt (on a copy of the cache)."""
    ids = torch.tensor([tokenizer(choice, add_special_tokens=False).input_ids], device=prompt.device)
    inputs = torch.cat([prompt, ids], 1)
    mask = torch.cat([mask, torch.ones_like(ids)], 1)
    kwargs = {} if cache is None else {cache_kwarg(model): copy.deepcopy(cache)}
    positions = mask.sum(1, keepdim=True) - inputs.shape[1] + torch.arange(inputs.shape[1], device=mask.device)
    logits = model(input_ids=inputs, attention_mask=mask, position_ids=positions, logits_to_keep=ids.shape[1] + 1,
                   use_cache=cache is not None, **kwargs).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(1, ids[0][:, None]).sum().item()


def translated_conditions(
    context: str,
    conditions: dict[str, dict],
    *,
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    source_tokenizer: PreTrainedTokenizerBase,
    target_model: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
):
    """Yield `(name, cache, seconds)` for each translated condition of one context.

    The source reads the context once (in the settings translation is for, it already has its cache); each
    condition translates that same cache, and `seconds` is the translation alone. `conditions` maps a name to
    keyword arguments of `translate_context`; a `"translator"` entry overrides `translator`, so several
    translators share one pass. A `"window": (start, count)` entry builds the window-injection diagnostic
    instead (`hf_mot.evaluation.injection`).
    """
    source_cache = prefill_source(source_model, encode_contexts(source_tokenizer, [context]))
    for name, options in conditions.items():
        options = dict(options)
        start = time.perf_counter()
        build = translate_with_window if "window" in options else translate_context
        cache = build(
            context, translator=options.pop("translator", translator), source_model=source_model,
            source_tokenizer=source_tokenizer, target_model=target_model, target_tokenizer=target_tokenizer,
            source_cache=source_cache, **options,
        )
        yield name, cache, time.perf_counter() - start


@torch.no_grad()
def evaluate_qa(
    examples: list[QAExample],
    *,
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    source_tokenizer: PreTrainedTokenizerBase,
    target_model: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
    conditions: dict[str, dict],
    max_new_tokens: int = 12,
    progress: bool = True,
) -> list[dict]:
    """Answer every example with no context, natively, and under each translated condition.

    Args:
        conditions: name -> keyword arguments of `translate_context` (e.g. `{"recompute": 0.1}`), as
            for `translated_conditions`.

    Returns:
        One dict per example (`task`, `meta`, `context_tokens`) with, per condition, its answer and score and
        `context_seconds`: the time to give the target its context (native prefill or translation).
    """
    rows = []
    for example in tqdm(examples, desc="QA", disable=not progress):
        row = {"task": example.task, "meta": example.meta, "question": example.question,
               "answers": example.answers}
        row["no_context"] = answer(example, target_model, target_tokenizer, max_new_tokens=max_new_tokens)
        start = time.perf_counter()
        cache, mask = native_cache(target_model, target_tokenizer, example.context)
        seconds = time.perf_counter() - start
        row["context_tokens"] = mask.shape[1]
        row["native"] = {**answer(example, target_model, target_tokenizer, cache, mask, max_new_tokens),
                         "context_seconds": seconds}
        translated = translated_conditions(
            example.context, conditions, translator=translator, source_model=source_model,
            source_tokenizer=source_tokenizer, target_model=target_model, target_tokenizer=target_tokenizer,
        )
        for name, cache, seconds in translated:
            row[name] = {**answer(example, target_model, target_tokenizer, cache, cache.attention_mask,
                                  max_new_tokens), "context_seconds": seconds}
        rows.append(row)
    return rows


def summarize_qa(rows: list[dict], conditions: list[str]) -> dict:
    """Mean score per condition, retention (translated / native score), and median context time."""
    if not rows:
        raise ValueError("No rows to summarize.")
    out = {"examples": len(rows), "context_tokens": statistics.median(r["context_tokens"] for r in rows)}
    for name in ["no_context", "native", *conditions]:
        scores = [r[name]["score"] for r in rows]
        entry = {"score": sum(scores) / len(scores)}
        for metric in ("exact_match", "found"):
            if metric in rows[0][name]:
                entry[metric] = sum(r[name][metric] for r in rows) / len(rows)
        if "context_seconds" in rows[0][name]:
            entry["context_seconds"] = statistics.median(r[name]["context_seconds"] for r in rows)
        out[name] = entry
    native = out["native"]["score"]
    for name in conditions:
        out[name]["retention"] = out[name]["score"] / native if native else float("nan")
    return out
