"""Tokenizing a context for both models, and the cross-tokenizer token alignment from character offsets.

Each target token is mapped to the source tokens whose character spans overlap its own, weighted by the
length of the overlap. The result is a sparse row-stochastic matrix `(target tokens) x (source tokens)`
stored as a few (index, weight) pairs per target token, because a dense matrix of two long contexts would
cost more than the translation itself; applying it is one `embedding_bag` (a fused gather and weighted sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch.nn import functional as F

from .kv import cast, positions_from_mask

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

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
    _bags_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_target_tokens(self) -> int:
        return self.index.shape[1]

    def to_dense(self) -> torch.Tensor:
        """The alignment as a dense `(batch, target_tokens, source_tokens)` weight matrix."""
        batch, tokens, _ = self.index.shape
        dense = torch.zeros(batch, tokens, self.num_source_tokens, dtype=self.weight.dtype)
        return dense.scatter_add_(2, self.index, self.weight)

    def bags(self, last: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The alignment of the whole batch as `embedding_bag` inputs over `(batch * source_tokens)` rows:
        `(batch * rows, k)` source rows and their weights, where `rows` are the last `last` target tokens (all if
        `None`). Made once per alignment and device."""
        key = (last, str(device))
        cached = self._bags_cache.get(key)
        if cached is None:
            index, weight = self.index, self.weight
            if last is not None:
                index, weight = index[:, -last:], weight[:, -last:]
            batch, rows, k = index.shape
            index = index + (torch.arange(batch) * self.num_source_tokens).view(batch, 1, 1)
            cached = index.view(batch * rows, k).to(device), weight.reshape(batch * rows, k).to(device)
            self._bags_cache[key] = cached
        return cached

    def apply(self, features: torch.Tensor, last: int | None = None) -> torch.Tensor:
        """Map per-source-token features `(..., batch, source_tokens, dim)` to target tokens `(..., batch,
        target_tokens, dim)`, or to the last `last` target tokens only."""
        if self.is_identity:
            return features if last is None else features[..., -last:, :]
        *lead, batch, tokens, dim = features.shape
        rows = self.num_target_tokens if last is None else min(last, self.num_target_tokens)
        # Leading dims ride along as features: one weighted sum for all of them, with every row of the batch in it.
        if lead:
            flat = features.movedim(-1, 0).reshape(-1, batch * tokens).t().contiguous()
        else:
            flat = features.reshape(batch * tokens, dim)
        index, weight = self.bags(rows, features.device)
        # One fused gather-and-sum over each target token's few overlapping source tokens. Half precision is
        # summed in float32 on the CPU, where its kernels are slow or missing; outside autocast, which would
        # otherwise pick the dtype itself.
        half = flat.dtype in (torch.bfloat16, torch.float16)
        compute = torch.float32 if flat.device.type == "cpu" and half else flat.dtype
        with torch.autocast(features.device.type, enabled=False):
            out = F.embedding_bag(index, cast(flat, compute), per_sample_weights=cast(weight, compute), mode="sum")
        out = cast(out, features.dtype)
        if not lead:
            return out.view(batch, rows, dim)
        return out.t().reshape(dim, *lead, batch, rows).movedim(0, -1)


def span_overlaps(
    source_spans: list[Span],
    target_spans: list[Span],
    source_special: list[bool],
    target_special: list[bool],
) -> tuple[np.ndarray, np.ndarray]:
    """Align one target sequence onto one source sequence, every target token at once.

    Args:
        source_spans / target_spans: `(start, end)` character offsets of each token in the shared text.
        source_special / target_special: which tokens are special (BOS and the like) and cover no text.

    Returns:
        `index` and `weight`, both `(target_tokens, k)`: the source tokens each target token overlaps, in
        order, weighted by the length of the overlap; each row's weights sum to 1, unused slots have weight 0.
    """
    if not source_spans:
        raise ValueError("Cannot align onto an empty source sequence: the context tokenized to no source tokens.")
    source_special = np.asarray(source_special, dtype=bool)
    text_tokens = np.flatnonzero(~source_special)
    spans = np.asarray(source_spans, dtype=np.int64).reshape(-1, 2)[text_tokens]
    starts, ends = spans[:, 0], spans[:, 1]
    target = np.asarray(target_spans, dtype=np.int64).reshape(-1, 2)
    a, b = target[:, 0], np.maximum(target[:, 1], target[:, 0] + 1)
    specials = np.flatnonzero(source_special)
    start_of_sequence = int(specials[0]) if len(specials) else 0
    # A special token (BOS) has no text: it stands for "start of sequence" on either side.
    text_rows = ~np.asarray(target_special, dtype=bool) & bool(len(text_tokens))
    index = np.full((len(target), 1), start_of_sequence, dtype=np.int64)
    weight = np.ones((len(target), 1))
    if not text_rows.any():
        return index, weight

    # The source tokens a target token [a, b) can overlap start before b and, tokens being at most `longest`
    # long, after a - longest; where token ends never go back (every tokenizer we know), also end after a.
    hi = np.searchsorted(starts, b, side="left")
    longest = int((ends - starts).max())
    lo = np.searchsorted(starts, a - longest, side="right")
    if np.all(ends[1:] >= ends[:-1]):
        lo = np.maximum(lo, np.searchsorted(ends, a, side="right"))
    lo = np.minimum(lo, hi)
    width = max(int((hi - lo)[text_rows].max()), 1)
    candidates = lo[:, None] + np.arange(width)
    inside = candidates < hi[:, None]
    candidates = np.minimum(candidates, len(starts) - 1)
    overlap = np.minimum(b[:, None], ends[candidates]) - np.maximum(a[:, None], starts[candidates])
    overlap = np.where(inside & (overlap > 0), overlap, 0).astype(np.float64)
    # Text the source tokenizer did not cover (e.g. whitespace it folds into a neighbour): take the closest
    # source token before it, or the first one after it.
    uncovered = overlap.sum(axis=1) == 0
    candidates[uncovered, 0] = np.maximum(hi[uncovered] - 1, 0)
    overlap[uncovered, 0] = 1.0
    weight = overlap / overlap.sum(axis=1, keepdims=True)
    index = np.where(weight > 0, text_tokens[candidates], 0)
    rows = text_rows[:, None]
    index = np.where(rows, index, start_of_sequence)
    weight = np.where(rows, weight, np.arange(width) == 0)
    return index, weight.astype(np.float64)


def build_alignment(
    source_rows: list[tuple[np.ndarray, np.ndarray]] | None,
    num_source_tokens: list[int],
    num_target_tokens: list[int],
    is_identity: bool = False,
) -> TokenAlignment:
    """Pack per-sequence alignments (the `index`, `weight` pairs of [`span_overlaps`]) into a left-padded batch
    `TokenAlignment`."""
    batch = len(num_target_tokens)
    src_len, tgt_len = max(num_source_tokens), max(num_target_tokens)
    if is_identity:
        index = torch.arange(tgt_len).view(1, tgt_len, 1).expand(batch, tgt_len, 1).clone()
        weight = torch.zeros(batch, tgt_len, 1)
        for b, n in enumerate(num_target_tokens):
            weight[b, tgt_len - n :, 0] = 1.0
        return TokenAlignment(index, weight, src_len, is_identity=True)
    k = max(row_index.shape[1] for row_index, _ in source_rows)
    index = np.zeros((batch, tgt_len, k), dtype=np.int64)
    weight = np.zeros((batch, tgt_len, k), dtype=np.float32)
    for b, (row_index, row_weight) in enumerate(source_rows):
        tokens, width = row_index.shape
        tgt_pad, src_pad = tgt_len - tokens, src_len - num_source_tokens[b]
        # Unused slots keep index 0 and weight 0.
        index[b, tgt_pad:, :width] = np.where(row_weight > 0, row_index + src_pad, 0)
        weight[b, tgt_pad:, :width] = row_weight
    return TokenAlignment(torch.from_numpy(index), torch.from_numpy(weight), src_len)


@dataclass
class EncodedContext:
    """A left-padded batch of contexts tokenized by one tokenizer, with character offsets."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    spans: list[list[tuple[int, int]]]
    special: list[list[bool]]

    @property
    def lengths(self) -> list[int]:
        return [len(s) for s in self.spans]

    @property
    def position_ids(self) -> torch.Tensor:
        return positions_from_mask(self.attention_mask)


def check_contexts(context: str | list[str]) -> list[str]:
    contexts = [context] if isinstance(context, str) else context
    if not isinstance(contexts, (list, tuple)) or not all(isinstance(c, str) for c in contexts):
        raise TypeError(f"`context` must be a string or a list of strings, got {type(context).__name__}.")
    if not contexts:
        raise ValueError("`context` is an empty list: pass at least one context string.")
    for i, text in enumerate(contexts):
        if not text.strip():
            raise ValueError(f"`context[{i}]` is empty or whitespace only: there is nothing to translate.")
    return list(contexts)


def encode_contexts(tokenizer: PreTrainedTokenizerBase, contexts: list[str], device=None) -> EncodedContext:
    """Tokenize each context (with the tokenizer's special tokens, e.g. BOS) and left-pad the batch."""
    spans, special, ids = [], [], []
    for text in contexts:
        encoded = tokenizer(
            text, add_special_tokens=True, return_offsets_mapping=True, return_special_tokens_mask=True
        )
        ids.append(encoded["input_ids"])
        spans.append([tuple(span) for span in encoded["offset_mapping"]])
        special.append([bool(flag) for flag in encoded["special_tokens_mask"]])
    longest = max(len(i) for i in ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(ids), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(ids), longest), dtype=torch.long)
    for row, token_ids in enumerate(ids):
        input_ids[row, longest - len(token_ids) :] = torch.tensor(token_ids, dtype=torch.long)
        attention_mask[row, longest - len(token_ids) :] = 1
    return EncodedContext(input_ids.to(device), attention_mask.to(device), spans, special)


def align_contexts(
    source: EncodedContext, target: EncodedContext, *, same_tokenizer: bool = False
) -> TokenAlignment:
    """Align a batch of target-tokenized contexts onto the same contexts tokenized for the source."""
    identical = same_tokenizer and torch.equal(source.input_ids, target.input_ids)
    rows = None
    if not identical:
        pairs = zip(source.spans, target.spans, source.special, target.special, strict=True)
        rows = [span_overlaps(*pair) for pair in pairs]
    return build_alignment(rows, source.lengths, target.lengths, is_identity=identical)
