"""The dial's third way to spend its budget: the target recomputes chosen context tokens, each at its place in the
context (`strategy="deviation"`): half of them the last tokens, half those whose translation deviates most from
its own states.

The target's layer-0 keys and values depend on the token alone (no attention lies below them), so it reads them
for every token at the cost of that layer's projections (`read_bottom_layers(..., 0)`, under 1% of a prefill on
Gemma 3) and puts them in place of the translation there; how far the translation was from them scores the tokens
(`deviation`, `choose_tokens`). The rest of the budget recomputes the chosen tokens through every layer. A chosen
token attends to the translation of the tokens not chosen and to the recomputed states of the chosen tokens before
it, under the same causal and sliding-window masks as a prefill, so with a translation that is exact (the identity
oracle) the cache is exactly the target's own.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from .alignment import EncodedContext
from .bottom_layers import bottom_layer_share, read_bottom_layers
from .kv import KVLayout


def chosen_token_count(config, share: float, tokens: int) -> int:
    """How many tokens `share` of a prefill recomputes once the layer-0 read (every token) is paid for."""
    first = bottom_layer_share(config, 0, tokens)
    if share < first:
        raise ValueError(
            f"`recompute={share:g}` does not pay for the target's layer-0 keys and values on {tokens} tokens (they "
            f"cost {first:.4f} of a prefill), which `strategy='deviation'` reads to choose the tokens: raise it, or "
            "use `strategy='tail'`."
        )
    return int((share - first) * tokens)


def own_first_layer(target_model: PreTrainedModel, target: EncodedContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own layer-0 keys and values (RoPE applied), every context token: `(batch, heads, tokens, dim)`."""
    own = read_bottom_layers(target_model, target.input_ids, target.attention_mask, target.position_ids, 0,
                             keep_all=True)
    return own.layers[0].keys, own.layers[0].values


def deviation(translated: tuple[torch.Tensor, torch.Tensor], own: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per context token, `(batch, tokens)`: the squared distance of the translated layer-0 keys and values from the
    target's own, each relative to the own states' mean square (so keys and values weigh alike)."""
    score = 0
    for mine, theirs in zip(translated, own, strict=True):
        theirs = theirs.float()
        scale = theirs.pow(2).mean().clamp_min(1e-12)
        score = score + (mine.float() - theirs).pow(2).mean(dim=(1, 3)) / scale
    return score


def choose_tokens(score: torch.Tensor, attention_mask: torch.Tensor, count: int) -> list[torch.Tensor]:
    """Per row, the positions (ascending) of `count` real tokens: its last `count // 2`, and the highest-scoring
    of the others; never its first real token (the target's own states already; see
    `pipeline.first_token_states`) nor padding; fewer in a shorter row.

    Half goes to the tail because the two fix different things: the last tokens make the window a question reads
    first exact in every layer, the most deviating ones the words the translation got wrong wherever they stand.
    Either half alone kept less on held-out QA (docs/EXPERIMENTS.md)."""
    real = attention_mask.bool()
    chosen = []
    for row in range(score.shape[0]):
        positions = real[row].nonzero().flatten()[1:]
        k = min(count, len(positions))
        split = len(positions) - k // 2
        rest = positions[:split]
        top = rest[score[row, rest].topk(k - k // 2).indices]
        chosen.append(torch.cat([top, positions[split:]]).sort().values)
    return chosen


def _masks(target_model, key_positions, key_valid, query_positions, query_valid, dtype):
    """Additive attention masks `(batch, 1, queries, keys)` for the chosen tokens: causal by position over the
    valid keys, each query also sees its own new key (a padding query sees only that); sliding-window layers also
    drop keys `sliding_window` or more positions back. A dict by layer kind where the model has sliding layers."""
    queries = query_positions.shape[1]
    contexts = key_positions.shape[1] - queries
    allowed = key_valid[:, None, :] & (key_positions[:, None, :] <= query_positions[:, :, None])
    allowed &= query_valid[:, :, None]
    diagonal = torch.zeros_like(allowed)
    steps = torch.arange(queries, device=allowed.device)
    diagonal[:, steps, contexts + steps] = True
    allowed |= diagonal

    def additive(mask):
        additive_mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return additive_mask.masked_fill(~mask, torch.finfo(dtype).min)[:, None]

    layout = KVLayout.from_config(target_model.config)
    if layout.sliding_window is None or "sliding_attention" not in layout.layer_types:
        return additive(allowed)
    near = query_positions[:, :, None] - key_positions[:, None, :] < layout.sliding_window
    return {"full_attention": additive(allowed), "sliding_attention": additive((allowed & near) | diagonal)}


def recompute_tokens(
    target_model: PreTrainedModel,
    context_kv: dict[int, tuple[torch.Tensor, torch.Tensor]],
    target: EncodedContext,
    chosen: list[torch.Tensor],
) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """`context_kv` (per target layer, every context token's keys with RoPE and values) with the `chosen` tokens'
    states replaced by what the target computes for them at their positions (see the module docstring)."""
    from .pipeline import read_into_cache

    batch, tokens = target.input_ids.shape
    count = max(len(c) for c in chosen)
    if count == 0:
        return context_kv
    device = target.input_ids.device
    ids = torch.zeros(batch, count, dtype=torch.long, device=device)
    positions = torch.zeros_like(ids)
    valid = torch.zeros(batch, count, dtype=torch.bool, device=device)
    superseded = torch.zeros(batch, tokens, dtype=torch.bool, device=device)
    for row, where in enumerate(chosen):
        n = len(where)
        ids[row, :n] = target.input_ids[row, where]
        positions[row, :n] = target.position_ids[row, where]
        valid[row, :n] = True
        superseded[row, where] = True
    key_positions = torch.cat([target.position_ids, positions], dim=1)
    key_valid = torch.cat([target.attention_mask.bool() & ~superseded, valid], dim=1)
    work = DynamicCache()  # every layer keeps every token: a chosen token's window may reach far back
    for layer in range(len(context_kv)):
        work.update(*context_kv[layer], layer)
    masks = _masks(target_model, key_positions, key_valid, positions, valid, target_model.dtype)
    read_into_cache(target_model, work, ids, masks, positions)
    out = {}
    for layer in context_kv:
        # The work cache's context columns are its own copy of the translation: the recomputed states go there.
        # The copy of the source columns is needed: with one key/value head, writing a tensor's columns from a view
        # of the same tensor is refused as overlapping memory.
        states = work.layers[layer].keys, work.layers[layer].values
        for row, where in enumerate(chosen):
            for both in states:
                both[row, :, where] = both[row, :, tokens : tokens + len(where)].clone()
        out[layer] = tuple(both[:, :, :tokens] for both in states)
    return out
