"""Scores of the QA tasks: SQuAD-style normalised exact match and token F1, whether the reply contains an answer,
and closed-set choice accuracy."""

from __future__ import annotations

import re
import string
from collections import Counter

_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    """Lower-case, drop punctuation and the articles a/an/the, collapse whitespace (as the SQuAD script does)."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, answers: list[str]) -> float:
    """1.0 if the normalised prediction equals any normalised answer."""
    return float(any(normalize_answer(prediction) == normalize_answer(a) for a in answers))


def token_f1(prediction: str, answers: list[str]) -> float:
    """Best token-overlap F1 of the normalised prediction against the answers."""
    predicted = normalize_answer(prediction).split()
    best = 0.0
    for answer in answers:
        gold = normalize_answer(answer).split()
        if not predicted or not gold:
            best = max(best, float(predicted == gold))
            continue
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common == 0:
            continue
        precision, recall = common / len(predicted), common / len(gold)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def answer_found(prediction: str, answers: list[str]) -> float:
    """1.0 if a normalised answer appears in the normalised prediction as whole words.

    Lenient where token F1 is strict: "He works as a ferry captain." finds "ferry captain" (F1 0.57). Beside F1 it
    tells a reply that retrieved the fact but phrased it otherwise from one that missed it (the accuracy of
    Liu et al., "Lost in the Middle", 2023).
    """
    predicted = f" {normalize_answer(prediction)} "
    return float(any(gold and f" {gold} " in predicted for gold in map(normalize_answer, answers)))


def choice_correct(log_probs: list[float], label: int) -> float:
    """1.0 if the highest log-probability is the labelled option (ties count as wrong)."""
    best = max(log_probs)
    winners = [i for i, value in enumerate(log_probs) if value == best]
    return float(winners == [label])
