"""Cross-tokenizer token alignment from character offsets.

Each target token is mapped to the source tokens whose character spans overlap its own, weighted by the
length of the overlap. The result is a sparse row-stochastic matrix `(target tokens) x (source tokens)`
stored as a few (index, weight) pairs per target token, because a dense matrix of two long contexts would
cost more than the translation itself.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

Span = tuple[int, int]


@dataclass
class TokenAlignment:
    """Sparse alignment of a (left-padded) batch of target tokens onto source tokens.

    Attributes:
        index (`torch.LongTensor` of shape `(batch, target_tokens, k)`): source token positions.
        weight (`torch.FloatTensor` of shape `(batch, target_tokens, k)`): their weights; each real target row
            sums to 1, padding rows are all zero.
        num_source_tokens (`int`): length of the (padded) source sequence.
        is_identity (`bool`): both sides tokenized the text identically; `apply` returns its input unchanged.
    """

    index: torch.Tensor
    weight: torch.Tensor
    num_source_tokens: int
    is_identity: bool = False

    @property
    def num_target_tokens(self) -> int:
        return self.index.shape[1]

    def to_dense(self) -> torch.Tensor:
        """The alignment as a dense `(batch, target_tokens, source_tokens)` weight matrix."""
        batch, tokens, _ = self.index.shape
        dense = torch.zeros(batch, tokens, self.num_source_tokens, dtype=self.weight.dtype)
        return dense.scatter_add_(2, self.index, self.weight)

    def apply(self, features: torch.Tensor) -> torch.Tensor:
        """Map per-source-token features `(..., batch, source_tokens, dim)` to target tokens."""
        if self.is_identity:
            return features
        *lead, batch, _, dim = features.shape
        k = self.index.shape[-1]
        index = self.index.to(features.device).reshape(batch, -1, 1)
        index = index.expand(*lead, batch, index.shape[1], dim)
        gathered = features.gather(-2, index).reshape(*lead, batch, self.num_target_tokens, k, dim)
        weight = self.weight.to(device=features.device, dtype=features.dtype).unsqueeze(-1)
        return (gathered * weight).sum(-2)


def align_spans(
    source_spans: list[Span],
    target_spans: list[Span],
    source_special: list[bool],
    target_special: list[bool],
) -> list[list[tuple[int, float]]]:
    """Align one target sequence onto one source sequence.

    Args:
        source_spans / target_spans: `(start, end)` character offsets of each token in the shared text.
        source_special / target_special: which tokens are special (BOS and the like) and cover no text.

    Returns:
        For each target token, a non-empty list of `(source_index, weight)` with weights summing to 1.
    """
    if not source_spans:
        raise ValueError("Cannot align onto an empty source sequence: the context tokenized to no source tokens.")
    text_tokens = [i for i, special in enumerate(source_special) if not special]
    starts = [source_spans[i][0] for i in text_tokens]
    longest = max((source_spans[i][1] - source_spans[i][0] for i in text_tokens), default=0)
    first_special = next((i for i, special in enumerate(source_special) if special), None)

    rows = []
    for (a, b), special in zip(target_spans, target_special):
        if special or not text_tokens:
            # A special token (BOS) has no text: it stands for "start of sequence" on either side.
            rows.append([(first_special if first_special is not None else 0, 1.0)])
            continue
        if b <= a:
            b = a + 1
        hi = bisect.bisect_left(starts, b)
        overlaps = []
        j = hi - 1
        while j >= 0 and starts[j] + longest > a:
            c, d = source_spans[text_tokens[j]]
            overlap = min(b, d) - max(a, c)
            if overlap > 0:
                overlaps.append((text_tokens[j], float(overlap)))
            j -= 1
        if not overlaps:
            # Text the source tokenizer did not cover (e.g. whitespace it folds into a neighbour): take the
            # closest source token before it, or the first one after it.
            nearest = text_tokens[max(hi - 1, 0)]
            overlaps = [(nearest, 1.0)]
        total = sum(w for _, w in overlaps)
        rows.append(sorted((i, w / total) for i, w in overlaps))
    return rows


def build_alignment(
    source_rows: list[list[list[tuple[int, float]]]] | None,
    num_source_tokens: list[int],
    num_target_tokens: list[int],
    is_identity: bool = False,
) -> TokenAlignment:
    """Pack per-sequence alignments into a left-padded batch `TokenAlignment`."""
    batch = len(num_target_tokens)
    src_len, tgt_len = max(num_source_tokens), max(num_target_tokens)
    if is_identity:
        index = torch.arange(tgt_len).view(1, tgt_len, 1).expand(batch, tgt_len, 1).clone()
        weight = torch.zeros(batch, tgt_len, 1)
        for b, n in enumerate(num_target_tokens):
            weight[b, tgt_len - n :, 0] = 1.0
        return TokenAlignment(index, weight, src_len, is_identity=True)
    k = max(len(entries) for rows in source_rows for entries in rows)
    index = torch.zeros(batch, tgt_len, k, dtype=torch.long)
    weight = torch.zeros(batch, tgt_len, k)
    for b, rows in enumerate(source_rows):
        tgt_pad, src_pad = tgt_len - len(rows), src_len - num_source_tokens[b]
        for t, entries in enumerate(rows):
            for slot, (i, w) in enumerate(entries):
                index[b, tgt_pad + t, slot] = src_pad + i
                weight[b, tgt_pad + t, slot] = w
    return TokenAlignment(index, weight, src_len)
