"""The dial's second way to spend its budget: the target reads the context through its bottom layers itself.

Gemma 3 retrieves through its full-attention layers; the first of them (layer 5) reads the residual stream of the
five sliding-window layers below it. Reading layers 0-4 natively and stopping once layer 5 has cached its keys and
values gives the target exact keys and values for its bottom six layers, at about a quarter of a prefill; the
translation fills the layers above. On the shipped translation that took QA retention from 59% to 74% of native
(docs/EXPERIMENTS.md). A translator whose dedicated maps read the residual stream entering layer 5
(`MoTConfig.dedicated_bottom_layers`) gets it from the same read.

`recompute=r` with `strategy="bottom"` buys the most bottom layers whose cost stays within `r` of a prefill's
(`bottom_layers_within`), counted in multiply-adds of the projections, MLPs and attention (sliding layers attend
over at most their window).
"""

from __future__ import annotations

from transformers import DynamicCache, PreTrainedModel

from .kv import decoder_layers


class _Stop(Exception):
    """Raised inside the target's forward once the wanted layers have cached their keys and values."""


def _layer_costs(config, tokens: int) -> list[tuple[float, float]]:
    """Per layer, multiply-adds per context token: (its query, key and value projections; the rest)."""
    text = config.get_text_config(decoder=True)
    hidden, heads = text.hidden_size, text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    inner = getattr(text, "intermediate_size", None) or 4 * hidden
    kinds = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
    window = getattr(text, "sliding_window", None) or tokens
    costs = []
    for kind in kinds:
        # A query attends over half the context on average, a sliding-window one over at most its window.
        span = min(window, tokens) if kind == "sliding_attention" else tokens / 2
        projections = hidden * head_dim * (heads + 2 * kv_heads)
        rest = 2 * span * heads * head_dim + heads * head_dim * hidden + 3 * hidden * inner
        costs.append((float(projections), float(rest)))
    return costs


def bottom_layer_share(config, layers: int, tokens: int) -> float:
    """The share of a prefill's multiply-adds that reading layers `0 .. layers - 1` whole, and layer `layers` up
    to its cached keys and values (its projections, not its attention), costs on `tokens` context tokens."""
    costs = _layer_costs(config, tokens)
    total = sum(b + a for b, a in costs)
    spent = sum(b + a for b, a in costs[:layers]) + (costs[layers][0] if layers < len(costs) else 0.0)
    return spent / total


def bottom_layers_within(config, budget: float, tokens: int) -> int | None:
    """The most bottom layers (`layers` as in `bottom_layer_share`) `budget` pays for, or `None` if not even the
    first layer's keys and values."""
    count = len(_layer_costs(config, tokens))
    best = None
    for layers in range(count - 1):
        if bottom_layer_share(config, layers, tokens) <= budget:
            best = layers
    return best


class _CacheUntil(DynamicCache):
    """A `DynamicCache` of the target's config that stops the forward once layer `last` has cached its states."""

    def __init__(self, config, last: int, keep_all: bool = False):
        # Built without the config, every layer is a plain one that keeps all tokens, sliding ones too.
        if keep_all:
            super().__init__()
        else:
            super().__init__(config=config)
        self.last = last

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if layer_idx == self.last:
            raise _Stop
        return out


def read_bottom_layers(target_model: PreTrainedModel, input_ids, attention_mask, position_ids, layers: int,
                       residual_at: int | None = None, keep_all: bool = False):
    """The target's own cache of the context in layers `0 .. layers` (a `DynamicCache`), reading layers `0 ..
    layers - 1` whole and stopping in layer `layers` once it has cached its keys and values (before its
    attention): nothing above is computed.

    With `residual_at` (at most `layers`), also the residual stream entering that layer, `(batch, tokens, hidden)`:
    returns `(cache, residual)` then. With `keep_all`, sliding-window layers keep every token, not only their
    window's.
    """
    if not 0 <= layers < len(decoder_layers(target_model)) - 1:
        raise ValueError(f"`layers` must be in [0, {len(decoder_layers(target_model)) - 2}], got {layers}.")
    if residual_at is not None and not 0 <= residual_at <= layers:
        raise ValueError(f"`residual_at` must be in [0, {layers}] (a layer the read reaches), got {residual_at}.")
    from .pipeline import read_into_cache

    captured = []

    def capture(module, args, kwargs):
        captured.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    cache = _CacheUntil(target_model.config, layers, keep_all)
    handle = None
    if residual_at is not None:
        handle = decoder_layers(target_model)[residual_at].register_forward_pre_hook(capture, with_kwargs=True)
    try:
        read_into_cache(target_model, cache, input_ids, attention_mask, position_ids)
    except _Stop:
        pass
    else:
        raise RuntimeError(f"Layer {layers} never cached its states: the bottom read did not stop there.")
    finally:
        if handle is not None:
            handle.remove()
    return cache if residual_at is None else (cache, captured[0])


def place_bottom_layers(cache, bottom: DynamicCache, layers: int) -> None:
    """Put `bottom`'s layers `0 .. layers` in place of `cache`'s (both built from the target's config)."""
    for index in range(layers + 1):
        mine, theirs = cache.layers[index], bottom.layers[index]
        if type(mine) is not type(theirs) or mine.keys.shape != theirs.keys.shape:
            raise RuntimeError(f"Layer {index} of the bottom read does not match the translated cache's.")
        cache.layers[index] = theirs


def check_strategy(strategy: str) -> str:
    if strategy not in ("tail", "bottom", "deviation"):
        raise ValueError(
            f"`strategy` must be 'tail' (the target reads the last context tokens), 'bottom' (it reads its bottom "
            f"layers) or 'deviation' (it recomputes the tokens whose translation deviates most), got {strategy!r}."
        )
    return strategy

