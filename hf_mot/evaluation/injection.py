"""Window injection, a diagnostic of the MoT paper's first failure mode (propagated translation shift).

The target reads the context itself, but a window of its layers attends to translated keys and values instead
of its own; every layer above the window then computes on top of them. How far the error grows on the way up
shows how a translation error propagates. It contains a full prefill of the target, so it is never a way to
save time: the library's caches are translated in every layer (`translate_context`).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from ..alignment import EncodedContext, TokenAlignment, encode_contexts
from ..cache import TranslatedCache
from ..kv import SourceKV
from ..modeling_mot import MoTTranslator
from ..pipeline import fill_translated_cache, read_into_cache, read_source_and_align, run_translator


class InjectingCache(TranslatedCache):
    """A cache whose first `update()` of each layer in `injected` stores (and attends to) the given states instead
    of the ones the target computed. It records what every layer attended to over the context in `context_kv`
    (every context token, before a sliding-window layer drops old ones)."""

    def __init__(self, config, *, attention_mask: torch.Tensor, injected: dict, **kwargs):
        super().__init__(config, attention_mask=attention_mask, **kwargs)
        self.injected = dict(injected)
        self.context_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # Every attention layer of transformers 5.x hands its new states to `update()` and attends to what it
        # returns, so swapping them here works for any architecture.
        replacement = self.injected.pop(layer_idx, None)
        if replacement is not None:
            keys, values = replacement
            if keys.shape != key_states.shape:
                raise ValueError(
                    f"Injected keys for layer {layer_idx} have shape {tuple(keys.shape)} but the target computed "
                    f"{tuple(key_states.shape)}: the translator does not match this target model."
                )
            key_states, value_states = keys.to(key_states.dtype), values.to(value_states.dtype)
        self.context_kv.setdefault(layer_idx, (key_states, value_states))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)


@torch.no_grad()
def window_injected_cache(
    translator: MoTTranslator,
    source: SourceKV,
    alignment: TokenAlignment,
    target_model: PreTrainedModel,
    target: EncodedContext,
    window: tuple[int, int],
) -> tuple[InjectingCache, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The target's own pass over the context with translated layers `window = (start, count)` injected.

    Returns the cache and, per target layer, the keys and values it attended to over the context.
    """
    start, count = window
    layers = list(range(start, start + count))
    num_layers = target_model.config.get_text_config(decoder=True).num_hidden_layers
    if count < 1 or start < 0 or start + count > num_layers:
        raise ValueError(f"`window={window}` must name layers inside the target's {num_layers}: (start, count).")
    translated = run_translator(translator, source, alignment, target_model, target.input_ids, target.attention_mask)
    # Placed in a scratch cache only to get each layer's finished keys (key-norm scale and RoPE) for every token.
    scratch = TranslatedCache(target_model.config, attention_mask=target.attention_mask)
    _, finished = fill_translated_cache(translated, target_model, target, layers=layers, cache=scratch)
    cache = InjectingCache(target_model.config, attention_mask=target.attention_mask, injected=finished,
                           target_id=target_model.config.name_or_path)
    read_into_cache(target_model, cache, target.input_ids, target.attention_mask, target.position_ids)
    return cache, dict(sorted(cache.context_kv.items()))


def translate_with_window(
    context: str,
    *,
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    source_tokenizer,
    target_model: PreTrainedModel,
    target_tokenizer,
    window: tuple[int, int],
    source_cache=None,
) -> InjectingCache:
    """`translate_context`'s counterpart for window injection: text (and, optionally, the source's cache of it)
    in, the target's cache with the translated `window` injected out."""
    translator.check_pair(source_model, target_model, source_tokenizer, target_tokenizer)
    source_enc = encode_contexts(source_tokenizer, [context], source_model.device)
    target_enc = encode_contexts(target_tokenizer, [context], target_model.device)
    source, alignment = read_source_and_align(source_model, source_tokenizer, target_tokenizer, source_enc,
                                              target_enc, source_cache)
    cache, _ = window_injected_cache(translator, source, alignment, target_model, target_enc, window)
    return cache
