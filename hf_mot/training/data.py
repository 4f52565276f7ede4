"""(context, continuation) pairs cut in text space, split by document, and their collation for both models."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from ..alignment import align_contexts, encode_contexts
from ..data import training_documents
from ..kv import tokenizer_fingerprint


def document_split(text: str, validation_percent: int) -> str:
    """`"train"` or `"validation"`, from a hash of the document: stable across runs, machines and orders."""
    bucket = int(hashlib.sha1(text.encode("utf-8")).hexdigest()[:8], 16) % 100
    return "validation" if bucket < validation_percent else "train"


def cut_chunks(
    document: str, rng: random.Random, context_words: tuple[int, int], continuation_words: int
) -> list[dict]:
    """Non-overlapping (context, continuation) pairs along one document, context lengths drawn at random."""
    words = document.split()
    chunks, start = [], 0
    while True:
        n_context = rng.randint(*context_words)
        end = start + n_context + continuation_words
        if end > len(words):
            return chunks
        chunks.append(
            {
                "context": " ".join(words[start : start + n_context]),
                "continuation": " " + " ".join(words[start + n_context : end]),
            }
        )
        start = end


def as_recall_pair(chunk: dict, rng: random.Random) -> dict:
    """The same context, with a continuation that repeats a span of it (as long as the original continuation).

    Trained with the KL term, such pairs ask the translated cache to support what the target does natively when
    text repeats (find the earlier occurrence and copy on), which is what extractive QA and fact retrieval need and
    what ordinary continuations seldom exercise.
    """
    context = chunk["context"].split()
    length = min(len(chunk["continuation"].split()), len(context))
    start = rng.randint(0, len(context) - length)
    return {**chunk, "continuation": " " + " ".join(context[start : start + length]), "recall": True}


# How question pairs ask for a span; the evaluation's QA prompts use the same frame ("\n\nQuestion: ...\nAnswer:").
QUESTION_TEMPLATE = '\n\nQuestion: In the text above, what comes after "{cue}"?\nAnswer: {answer}'


def as_question_pair(chunk: dict, rng: random.Random, cue_words: int = 4) -> dict:
    """The same context, with a continuation that asks for a span of it by the words before the span, and
    answers with the span (as many words as the original continuation).

    Recall pairs (`as_recall_pair`) only ever repeat text; a question in between is what QA and retrieval
    prompts put between a document and its answer, so the translated keys must also be found by question
    tokens. Contexts shorter than the cue and one answer word stay plain pairs.
    """
    context = chunk["context"].split()
    length = min(len(chunk["continuation"].split()), len(context) - cue_words)
    if length < 1:
        return chunk
    start = rng.randint(cue_words, len(context) - length)
    cue, answer = " ".join(context[start - cue_words : start]), " ".join(context[start : start + length])
    return {**chunk, "continuation": QUESTION_TEMPLATE.format(cue=cue, answer=answer), "question": True}


# Made-up facts for retrieval pairs. The names, places and trades share nothing with the evaluation's
# (`hf_mot.evaluation.tasks`), so a fact seen in training is never a fact asked about in evaluation.
FACT_NAMES = ("Alvaro", "Birgit", "Cosmin", "Delphine", "Emeka", "Fenna", "Gideon", "Hanne", "Ilkka", "Jovana",
              "Kasimir", "Liesel", "Marek", "Noor", "Orla", "Piet", "Radek", "Saoirse", "Teodor", "Ulla", "Viggo")
FACT_SURNAMES = ("Achterberg", "Brandauer", "Ciobanu", "Dragomir", "Esterhazy", "Fitzgerald", "Grimaldi", "Hollander",
                 "Ivanova", "Jurado", "Kettering", "Lombardi", "Marchetti", "Nieminen", "Oyelaran", "Prendergast")
FACT_PLACES = ("Antwerp", "Bratislava", "Coimbra", "Dundee", "Esbjerg", "Graz", "Halifax", "Innsbruck", "Jaipur",
               "Kaunas", "Leuven", "Malmo", "Nantes", "Oulu", "Plovdiv", "Quito", "Rotterdam", "Sapporo")
FACT_TRADES = ("surveyor", "harpist", "blacksmith", "pharmacist", "dentist", "goldsmith", "potter", "archivist",
               "brewer", "carpenter", "florist", "welder", "zoologist")


def made_up_fact(rng: random.Random) -> tuple[str, str, str]:
    """(sentence, question, answer) about a made-up person."""
    who = f"{rng.choice(FACT_NAMES)} {rng.choice(FACT_SURNAMES)}"
    kind = rng.randrange(4)
    if kind == 0:
        place = rng.choice(FACT_PLACES)
        return f"{who} moved to {place}.", f"Where did {who} move to?", place
    if kind == 1:
        trade = rng.choice(FACT_TRADES)
        return f"{who} is a {trade}.", f"What is {who}'s job?", trade
    if kind == 2:
        year = str(rng.randint(1900, 2020))
        return f"{who} retired in {year}.", f"In which year did {who} retire?", year
    count = str(rng.randint(2, 99))
    return f"{who} has {count} cats.", f"How many cats does {who} have?", count


def running_words(documents: list[str], length: int, rng: random.Random) -> list[str]:
    """`length` words from a random point of a random document, running on into further ones: most documents are
    shorter than long contexts."""
    words = rng.choice(documents).split()
    words = words[rng.randint(0, max(len(words) - length, 0)):]
    while len(words) < length:
        words += rng.choice(documents).split()
    return words[:length]


def retrieval_pairs(
    count: int, *, context_words: tuple[int, int] = (200, 1100), seed: int = 0, part: str = "fit"
) -> list[dict]:
    """(context, suffix) pairs whose suffix reads the context back from anywhere in it, for fitting the layers
    retrieval lives in (`hf_mot.training.layer_fit`).

    Contexts are cut from the training split of the corpus, never from its validation split (where the reported
    fidelity pairs come from); a context longer than its document goes on into other documents. `part="fit"` and
    `part="check"` take disjoint documents of it: 90% and 10%, by a hash. Half the pairs carry a made-up fact at a
    random depth and end in a question about it with its answer, in the evaluation's QA frame; 30% ask for the
    words after a cue (`as_question_pair`); the rest repeat a span of the context (`as_recall_pair`).
    """
    if part not in ("fit", "check"):
        raise ValueError(f"`part` must be 'fit' or 'check', got {part!r}.")
    if not 20 <= context_words[0] <= context_words[1]:
        raise ValueError(f"`context_words` must be (min, max) with 20 <= min <= max, got {context_words}.")
    rng = random.Random(seed)
    wanted = "validation" if part == "check" else "train"
    documents = [d for docs in training_documents().values() for d in docs
                 if document_split(d, 5) == "train" and document_split("fit:" + d, 10) == wanted
                 and len(d.split()) >= context_words[0]]
    pairs = []
    for _ in range(count):
        words = running_words(documents, rng.randint(*context_words), rng)
        draw = rng.random()
        if draw < 0.5:
            sentence, question, answer = made_up_fact(rng)
            at = rng.randint(0, len(words))
            words = words[:at] + sentence.split() + words[at:]
            pairs.append({"context": " ".join(words), "suffix": f"\n\nQuestion: {question}\nAnswer: {answer}"})
            continue
        chunk = {"context": " ".join(words), "continuation": " " + " ".join(words[:16])}
        pair = as_question_pair(chunk, rng, cue_words=4) if draw < 0.8 else as_recall_pair(chunk, rng)
        pairs.append({"context": pair["context"], "suffix": pair["continuation"]})
    return pairs


class ContextContinuationDataset(Dataset):
    """Pairs from the offline corpus, one split of it.

    Args:
        split (`str`): `"train"` or `"validation"` (documents are split by a hash of their text).
        context_words (`tuple[int, int]`): range of context lengths in words.
        continuation_words (`int`): continuation length in words.
        validation_percent (`int`): share of documents held out.
        max_chunks (`int`, *optional*): keep this many pairs (a seeded sample), all if `None`.
        recall_fraction (`float`): share of pairs (seeded) whose continuation repeats a span of their context
            (see `as_recall_pair`); 0 for plain continuations only.
        question_fraction (`float`): share of pairs (seeded, drawn from those not made recall pairs) whose
            continuation asks for a span of their context and answers it (see `as_question_pair`).
        retrieval_fraction (`float`): share of pairs (a seeded sample, drawn after the recall and question
            pairs) replaced by `retrieval_pairs`: contexts that run on across documents, half of them with a
            made-up fact at a random depth and a question about it. Cut chunks never cross a document, so these
            are the only pairs that reach past a document's length. Training split only.
        retrieval_context_words (`tuple[int, int]`): range of the retrieval pairs' context lengths in words.
        seed (`int`): seed of the context lengths, the sample, the recall, question and retrieval pairs.
    """

    def __init__(
        self,
        split: str = "train",
        *,
        context_words: tuple[int, int] = (48, 256),
        continuation_words: int = 24,
        validation_percent: int = 5,
        max_chunks: int | None = None,
        recall_fraction: float = 0.0,
        question_fraction: float = 0.0,
        retrieval_fraction: float = 0.0,
        retrieval_context_words: tuple[int, int] = (200, 2400),
        seed: int = 0,
    ):
        if split not in ("train", "validation"):
            raise ValueError(f"`split` must be 'train' or 'validation', got {split!r}.")
        if not 1 <= context_words[0] <= context_words[1]:
            raise ValueError(f"`context_words` must be (min, max) with 1 <= min <= max, got {context_words}.")
        if not (0.0 <= recall_fraction and 0.0 <= question_fraction and recall_fraction + question_fraction <= 1.0):
            raise ValueError(
                "`recall_fraction` and `question_fraction` must be at least 0 and add up to at most 1, got "
                f"{recall_fraction} and {question_fraction}."
            )
        if not 0.0 <= retrieval_fraction <= 1.0:
            raise ValueError(f"`retrieval_fraction` must be in [0, 1], got {retrieval_fraction}.")
        if retrieval_fraction and split != "train":
            raise ValueError("Retrieval pairs are cut from the training split only (`retrieval_pairs`); use "
                             "`retrieval_fraction=0` for the validation split.")
        rng = random.Random(seed)
        self.examples = []
        for corpus, documents in sorted(training_documents().items()):
            for document in documents:
                if document_split(document, validation_percent) != split:
                    continue
                for chunk in cut_chunks(document, rng, context_words, continuation_words):
                    self.examples.append({**chunk, "corpus": corpus})
        if max_chunks is not None and max_chunks < len(self.examples):
            self.examples = random.Random(seed + 1).sample(self.examples, max_chunks)
        if recall_fraction or question_fraction:
            # One draw per pair: below `recall_fraction` a recall pair, then a question pair, else plain.
            # Question spans have their own generator, so adding them leaves the recall pairs as they were.
            pair_rng, question_rng = random.Random(seed + 2), random.Random(seed + 3)
            examples, self.examples = self.examples, []
            for example in examples:
                draw = pair_rng.random()
                if draw < recall_fraction:
                    example = as_recall_pair(example, pair_rng)
                elif draw < recall_fraction + question_fraction:
                    example = as_question_pair(example, question_rng)
                self.examples.append(example)
        if retrieval_fraction:
            count = round(len(self.examples) * retrieval_fraction)
            chosen = random.Random(seed + 4).sample(range(len(self.examples)), count)
            pairs = retrieval_pairs(count, context_words=tuple(retrieval_context_words), seed=seed + 4)
            for index, pair in zip(chosen, pairs, strict=True):
                # Their suffixes carry a question (or a cue) before the answer: `question_nll_weight` applies.
                self.examples[index] = {"context": pair["context"], "continuation": pair["suffix"],
                                        "corpus": "retrieval", "question": True}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]


@dataclass
class MoTDataCollator:
    """Tokenizes (context, continuation) pairs for both models and aligns the contexts.

    The contexts are left-padded (as `translate_context` does), the continuations right-padded.
    """

    source_tokenizer: PreTrainedTokenizerBase
    target_tokenizer: PreTrainedTokenizerBase

    def __call__(self, examples: list[dict]) -> dict:
        contexts = [e["context"] for e in examples]
        source = encode_contexts(self.source_tokenizer, contexts)
        target = encode_contexts(self.target_tokenizer, contexts)
        same = tokenizer_fingerprint(self.source_tokenizer) == tokenizer_fingerprint(self.target_tokenizer)
        continuations = [
            self.target_tokenizer(e["continuation"], add_special_tokens=False).input_ids for e in examples
        ]
        longest = max(len(c) for c in continuations)
        continuation_ids = torch.zeros(len(examples), longest, dtype=torch.long)
        continuation_mask = torch.zeros(len(examples), longest, dtype=torch.long)
        for row, ids in enumerate(continuations):
            continuation_ids[row, : len(ids)] = torch.tensor(ids)
            continuation_mask[row, : len(ids)] = 1
        return {
            "source_input_ids": source.input_ids,
            "source_attention_mask": source.attention_mask,
            "target_input_ids": target.input_ids,
            "target_attention_mask": target.attention_mask,
            "continuation_ids": continuation_ids,
            "continuation_mask": continuation_mask,
            "alignment": align_contexts(source, target, same_tokenizer=same),
            # Which pairs are question pairs: their next-token loss has a weight of its own.
            "question": torch.tensor([bool(e.get("question")) for e in examples]),
        }
