"""Cross-tokenizer token alignment from character offsets.

Each target token is mapped to the source tokens whose character spans overlap its own, weighted by the
length of the overlap. The result is a sparse row-stochastic matrix `(target tokens) x (source tokens)`
stored as a few (index, weight) pairs per target token, because a dense matrix of two long contexts would
cost more than the translation itself.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

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
    _sparse_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def num_target_tokens(self) -> int:
        return self.index.shape[1]

    def to_dense(self) -> torch.Tensor:
        """The alignment as a dense `(batch, target_tokens, source_tokens)` weight matrix."""
        batch, tokens, _ = self.index.shape
        dense = torch.zeros(batch, tokens, self.num_source_tokens, dtype=self.weight.dtype)
        return dense.scatter_add_(2, self.index, self.weight)

    def sparse_matrices(self, device=None, dtype=torch.float32) -> list[torch.Tensor]:
        """One sparse COO `(target_tokens, source_tokens)` matrix per batch row."""
        key = (str(device), dtype)
        cached = self._sparse_cache.get(key)
        if cached is None:
            cached = []
            rows = torch.arange(self.num_target_tokens).unsqueeze(-1).expand_as(self.index[0])
            for index, weight in zip(self.index, self.weight, strict=True):
                used = weight != 0
                matrix = torch.sparse_coo_tensor(
                    torch.stack([rows[used], index[used]]), weight[used],
                    (self.num_target_tokens, self.num_source_tokens), check_invariants=True,
                ).coalesce()
                cached.append(matrix.to(device=device, dtype=dtype))
            self._sparse_cache[key] = cached
        return cached

    def apply(self, features: torch.Tensor) -> torch.Tensor:
        """Map per-source-token features `(layers, batch, source_tokens, dim)` to target tokens."""
        if self.is_identity:
            return features
        layers, batch, tokens, dim = features.shape
        # A sparse product does work only for the few overlaps of each target token (20x faster than a
        # gather over the padded overlap slots at 1k tokens); CPU sparse kernels want float32.
        compute = torch.float32 if features.dtype == torch.bfloat16 else features.dtype
        out = []
        # Outside autocast: under it the dense side would be cast back to bf16, and the backward of the sparse
        # product fails on the mixed dtypes.
        with torch.autocast(features.device.type, enabled=False):
            for row, matrix in enumerate(self.sparse_matrices(features.device, compute)):
                flat = features[:, row].permute(1, 0, 2).reshape(tokens, layers * dim).to(compute)
                out.append(torch.sparse.mm(matrix, flat).view(self.num_target_tokens, layers, dim).permute(1, 0, 2))
        return torch.stack(out, dim=1).to(features.dtype)


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
    # Where token ends never go back (every tokenizer we know), the tokens ending at or before a target token's
    # start are a prefix that `bisect` skips; otherwise the scan back stops only at `longest`.
    ends = [source_spans[i][1] for i in text_tokens]
    ends_sorted = all(x <= y for x, y in zip(ends, ends[1:], strict=False))
    first_special = next((i for i, special in enumerate(source_special) if special), None)

    rows = []
    for (a, b), special in zip(target_spans, target_special, strict=True):
        if special or not text_tokens:
            # A special token (BOS) has no text: it stands for "start of sequence" on either side.
            rows.append([(first_special if first_special is not None else 0, 1.0)])
            continue
        if b <= a:
            b = a + 1
        hi = bisect.bisect_left(starts, b)
        overlaps = []
        lo = bisect.bisect_right(ends, a) if ends_sorted else 0
        j = hi - 1
        while j >= lo and starts[j] + longest > a:
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
        if not rows:
            continue
        tgt_pad, src_pad = tgt_len - len(rows), src_len - num_source_tokens[b]
        # Built as lists and converted once: writing tensor elements one by one cost more than the translation
        # itself at 4k tokens. Unused slots keep index 0 and weight 0.
        index[b, tgt_pad:] = torch.tensor([[src_pad + i for i, _ in e] + [0] * (k - len(e)) for e in rows])
        weight[b, tgt_pad:] = torch.tensor([[w for _, w in e] + [0.0] * (k - len(e)) for e in rows])
    return TokenAlignment(index, weight, src_len)
