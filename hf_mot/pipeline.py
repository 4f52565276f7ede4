"""From text to a TranslatedCache: tokenize for both models, align, read the source cache, translate."""

from __future__ import annotations

import weakref

import torch
from transformers import Cache, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ._compat import cache_kwarg, returned_cache
from .alignment import EncodedContext, TokenAlignment, align_contexts, check_contexts, encode_contexts
from .bottom_layers import (
    bottom_layer_share,
    bottom_layers_within,
    check_strategy,
    place_bottom_layers,
    read_bottom_layers,
)
from .cache import TranslatedCache
from .chosen_tokens import choose_tokens, chosen_token_count, deviation, own_first_layer, recompute_tokens
from .configuration_mot import check_recompute
from .kv import (
    KVLayout,
    SourceKV,
    cast,
    decoder_layers,
    finish_target_keys,
    layer_index,
    read_source_cache,
    tokenizer_fingerprint,
)
from .modeling_mot import MoTOutput, MoTTranslator
from .target_adapter import reading_translated


def read_into_cache(model: PreTrainedModel, cache: Cache, input_ids, attention_mask=None, position_ids=None):
    """Let `model`'s decoder read `input_ids` into `cache` (no LM head: only the cache is wanted)."""
    decoder = model.get_decoder()
    return decoder(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=True,
        **{cache_kwarg(decoder): cache},
    )


@torch.no_grad()
def prefill_source(model: PreTrainedModel, encoded: EncodedContext) -> Cache:
    """Read the contexts with the source model and return its cache.

    The cache is a plain `DynamicCache()` (not built from the config), so sliding-window layers keep every
    context token: the translator needs all of them.
    """
    outputs = read_into_cache(model, DynamicCache(), encoded.input_ids, encoded.attention_mask, encoded.position_ids)
    return returned_cache(outputs)


def read_source_and_align(
    source_model: PreTrainedModel,
    source_tokenizer: PreTrainedTokenizerBase,
    target_tokenizer: PreTrainedTokenizerBase,
    source_enc: EncodedContext,
    target_enc: EncodedContext,
    source_cache: Cache | None = None,
) -> tuple[SourceKV, TokenAlignment]:
    """The source's position-free KV of the encoded contexts (read from `source_cache`, or from a prefill made
    here when it is `None`) and the alignment of the target tokens onto the source tokens."""
    same_tokenizer = tokenizer_fingerprint(source_tokenizer) == tokenizer_fingerprint(target_tokenizer)
    alignment = align_contexts(source_enc, target_enc, same_tokenizer=same_tokenizer)
    given = source_cache is not None
    if not given:
        source_cache = prefill_source(source_model, source_enc)
    source = read_source_cache(source_cache, source_model, source_enc.attention_mask, source_enc.position_ids)
    if given and len(set(source_enc.lengths)) > 1:  # only a padded batch can have been padded on the wrong side
        _check_first_tokens(source, source_model, source_enc)
    return source, alignment


def _check_first_tokens(source: SourceKV, model: PreTrainedModel, encoded: EncodedContext) -> None:
    """Refuse a user's source cache that does not hold the contexts as they are encoded here (left-padded): each
    row's first real token sees only itself, so its cached values equal those of the token read alone (cached per
    token, see `first_token_states`). A right-padded batch differs."""
    own, _ = first_token_states(model, encoded.input_ids, encoded.attention_mask)
    first = encoded.attention_mask.long().argmax(dim=1)
    cached = source.values[torch.arange(first.shape[0], device=first.device), first].float().flatten(1)
    expected = own.values[:, 0].to(cached.device, torch.float32).flatten(1)
    # Relative distance: rounding (bf16, another attention kernel) stays far below it, another token far above.
    distance = (cached - expected).norm(dim=1) / expected.norm(dim=1).clamp_min(1e-6)
    if bool((distance > 0.1).any()):
        row = int((distance > 0.1).nonzero()[0])
        raise ValueError(
            f"`source_cache` row {row} does not hold this context as `source_model` reads it: its first token's "
            f"cached values are {float(distance[row]):.2f} (relative) away from the model's own. A right-padded "
            "batch does this: read the contexts left-padded (`source_tokenizer.padding_side = 'left'`, as "
            "`translate_context` tokenizes them), or leave `source_cache` out."
        )


def _check_devices(translator: MoTTranslator, source: SourceKV, target_model: PreTrainedModel) -> None:
    key = source.keys
    for name, device in (("translator", translator.device), ("target_model", target_model.device)):
        if device != key.device:
            raise ValueError(
                f"`{name}` is on {device} but the source cache is on {key.device}: move both models and the "
                f"translator to one device (`.to('{key.device}')`)."
            )


def run_translator(
    translator: MoTTranslator,
    source: SourceKV,
    alignment: TokenAlignment,
    target_model: PreTrainedModel,
    target_input_ids: torch.Tensor,
    target_attention_mask: torch.Tensor,
    last_tokens: list[int | None] | None = None,
    target_residual: torch.Tensor | None = None,
) -> MoTOutput:
    """Call `translator` on position-free source KV (with the target's token embeddings if it reads them, and
    `target_residual` for dedicated maps that read the target's residual stream); the first context token of each
    row gets the target's own states (see `first_token_states`).

    `translator` may be wrapped (DDP in training): its config is read from `.module` then. `last_tokens` (per
    produced layer) limits a layer to its last that many tokens (see `MoTTranslator.forward`).
    """
    config = getattr(translator, "module", translator).config
    embeddings = None
    if config.target_embedding_size is not None:
        with torch.no_grad():  # the target is frozen; only the translator learns
            embeddings = target_model.get_input_embeddings()(target_input_ids)
    # Looked up before the translator runs: reading the first tokens makes the CPU wait for the device, which
    # costs least while nothing is queued.
    first = first_token_states(target_model, target_input_ids, target_attention_mask)
    out = translator(source.keys, source.values, alignment, target_embeddings=embeddings, last_tokens=last_tokens,
                     target_residual=target_residual)
    return place_first_token(out, *first)


# What the target caches for a first token depends only on its weights and the token, so it is computed once
# per (model, token): a one-token pass costs ~60 ms here, as much as translating a short context. Entries are
# dropped when any parameter of the model is replaced, changed in place (its tensor `_version` moves) or moved
# to another device or dtype.
_FIRST_TOKEN_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _first_token_states(target_model: PreTrainedModel, tokens: list[int]) -> SourceKV:
    """The target's position-free keys and values of each token read alone at position 0, token-major
    `(len(tokens), 1, layers, heads, head_dim)`."""
    weights = tuple((id(p), p._version, p.device, p.dtype) for p in target_model.parameters())
    store = _FIRST_TOKEN_STATES.setdefault(target_model, {})
    if store.get("weights") != weights:
        store.clear()
        store.update(weights=weights, tokens=[], keys=None, values=None)
    missing = sorted(set(tokens) - set(store["tokens"]))
    if missing:
        ids = torch.tensor(missing, device=target_model.device)[:, None]
        zeros, ones = torch.zeros_like(ids), torch.ones_like(ids)
        cache = DynamicCache()
        with torch.no_grad():
            read_into_cache(target_model, cache, ids, position_ids=zeros)
            states = read_source_cache(cache, target_model, ones, zeros)
        known = store["keys"] is not None
        store["keys"] = torch.cat([store["keys"], states.keys]) if known else states.keys
        store["values"] = torch.cat([store["values"], states.values]) if known else states.values
        store["tokens"] = store["tokens"] + missing
    rows = torch.tensor([store["tokens"].index(token) for token in tokens], device=store["keys"].device)
    return SourceKV(keys=store["keys"].index_select(0, rows), values=store["values"].index_select(0, rows),
                    attention_mask=torch.ones(len(tokens), 1, dtype=torch.long))


def first_token_states(
    target_model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> tuple[SourceKV, torch.Tensor]:
    """The target's own states of each row's first context token, and where that token is: a `(1, batch, 1,
    tokens, 1)` mask that broadcasts over a block of translator output; `place_first_token` puts them in.

    Under causal attention the first token sees only itself, at position 0: its states are the same whatever
    follows, so the target computes them exactly by reading that one token. It is usually BOS, which most heads
    use as an attention sink, so an error there moves every later token's attention; and it has no source
    token to be translated from.
    """
    real = attention_mask.bool()
    first = real.long().argmax(dim=1)  # left padding: the first real column of each row
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    own = _first_token_states(target_model, input_ids[rows, first].tolist())
    at_first = torch.zeros_like(real).index_put_((rows, first), torch.tensor(True, device=real.device))
    return own, at_first[None, :, None, :, None]


def place_first_token(translated: MoTOutput, own: SourceKV, at_first: torch.Tensor) -> MoTOutput:
    """`translated` with the first token's states replaced by `own` (see `first_token_states`)."""

    def place(blocks, own_states):
        # A block may hold only its last tokens (`last_tokens`); the first token may then not be among them.
        out = []
        for layers, states in zip(translated.block_layers, blocks, strict=True):
            ours = own_states if len(layers) == len(own_states) else own_states.index_select(
                0, layer_index(layers, own_states.device))
            out.append(torch.where(at_first[..., -states.shape[3] :, :], cast(ours, states.dtype), states))
        return out

    # Token-major (batch, 1, layers, heads, dim) -> the blocks' (layers, batch, heads, 1, dim).
    own_keys, own_values = (states.permute(2, 0, 3, 1, 4) for states in (own.keys, own.values))
    return MoTOutput(key_blocks=place(translated.key_blocks, own_keys),
                     value_blocks=place(translated.value_blocks, own_values),
                     block_layers=translated.block_layers, aux_loss=translated.aux_loss)


def build_translated_cache(
    translator: MoTTranslator,
    source: SourceKV,
    alignment: TokenAlignment,
    target_model: PreTrainedModel,
    target: EncodedContext,
    *,
    native_tail: int = 0,
    source_id: str = "",
    target_residual: torch.Tensor | None = None,
) -> TranslatedCache:
    """Translate position-free source KV and place it in a `TranslatedCache` of the target, every target layer.

    `native_tail=k` keeps the translation of all but the last `k` context tokens and lets the target read
    those `k` itself on top of it (see `translate_context`). `target_residual`: see `MoTTranslator.forward`.
    """
    _check_native_tail(native_tail, target.input_ids.shape[1])
    _check_devices(translator, source, target_model)
    target_layout = KVLayout.from_config(target_model.config)
    last_tokens = tokens_kept(target_layout, target.input_ids.shape[1], native_tail)
    translated = run_translator(
        translator, source, alignment, target_model, target.input_ids, target.attention_mask, last_tokens,
        target_residual,
    )
    if not native_tail:
        cache, _ = fill_translated_cache(translated, target_model, target, source_id=source_id)
        cache.target_adapter = translator.target_adapter
        return cache
    # The translator reads the whole context (the source tokens of the tail inform the tokens before it, as
    # they would without a tail); only the tail's own translated states are dropped.
    head = EncodedContext(
        target.input_ids[:, :-native_tail], target.attention_mask[:, :-native_tail], target.spans, target.special
    )
    translated = MoTOutput(
        key_blocks=[k[:, :, :, :-native_tail] for k in translated.key_blocks],
        value_blocks=[v[:, :, :, :-native_tail] for v in translated.value_blocks],
        block_layers=translated.block_layers,
        aux_loss=translated.aux_loss,
    )
    cache, _ = fill_translated_cache(translated, target_model, head, source_id=source_id)
    cache.attention_mask, cache.num_context_tokens = target.attention_mask, target.input_ids.shape[1]
    cache.native_tokens = native_tail
    cache.target_adapter = translator.target_adapter
    # The tail's queries read the translated tokens before it: the target adapter is on for them.
    with reading_translated(cache, target_model):
        read_into_cache(target_model, cache, target.input_ids[:, -native_tail:], target.attention_mask,
                        target.position_ids[:, -native_tail:])
    return cache


def tokens_kept(layout: KVLayout, context_tokens: int, native_tail: int) -> list | None:
    """Per target layer, how many of the last context tokens its cache layer keeps (`None`: all).

    A sliding-window layer keeps the last `sliding_window - 1` tokens (transformers' `DynamicSlidingWindowLayer`),
    plus, with a native tail, those the tail's tokens still look back at. The translator need not produce the
    rest: on long contexts that is most of its work and memory (Gemma 3: 15 of 18 layers slide over 512 tokens).
    """
    if layout.sliding_window is None:
        return None
    kept = layout.sliding_window - 1 + native_tail
    if kept >= context_tokens:
        return None
    return [kept if kind == "sliding_attention" else None for kind in layout.layer_types]


def _check_native_tail(native_tail, context_tokens: int) -> None:
    if isinstance(native_tail, bool) or not isinstance(native_tail, int) or native_tail < 0:
        raise ValueError(f"`native_tail` must be a whole number of tokens >= 0, got {native_tail!r}.")
    if native_tail >= context_tokens:
        raise ValueError(
            f"`native_tail={native_tail}` leaves nothing to translate: the context is {context_tokens} target "
            f"tokens (with special tokens). Use a tail shorter than the context, or read it natively."
        )


def fill_translated_cache(
    translated: MoTOutput,
    target_model: PreTrainedModel,
    target: EncodedContext,
    layers: list[int] | None = None,
    source_id: str = "",
    cache: TranslatedCache | None = None,
) -> tuple[TranslatedCache, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Place translator output in a `TranslatedCache`: the target's key-norm scale and RoPE on the keys, then
    each layer into the cache.

    `layers` limits it to some target layers, and `cache` (empty) is the cache to fill: the window-injection
    diagnostic (`hf_mot.evaluation.injection`) uses both. Also returns, per target layer, the keys and values
    placed, for training to compare with the target's native cache.
    """
    layers = translated.layers if layers is None else layers
    positions = target.position_ids
    dtype = target_model.dtype
    if cache is None:
        cache = TranslatedCache(target_model.config, attention_mask=target.attention_mask, source_id=source_id,
                                target_id=target_model.config.name_or_path)
    context_kv = {}
    context_tokens = positions.shape[1]
    for block_layers, keys, values in zip(translated.block_layers, translated.key_blocks, translated.value_blocks,
                                          strict=True):
        wanted = [j for j, layer in enumerate(block_layers) if layer in layers]
        if not wanted:
            continue
        if len(wanted) < len(block_layers):
            which = layer_index(wanted, keys.device)
            keys, values = keys.index_select(0, which), values.index_select(0, which)
            block_layers = [block_layers[j] for j in wanted]
        kept = keys.shape[3]  # a sliding-window block may come with only the tokens its layers keep
        keys = cast(finish_target_keys(target_model, block_layers, keys, positions[:, context_tokens - kept :]), dtype)
        values = cast(values, dtype)
        for layer_idx, layer_keys, layer_values in zip(block_layers, keys.unbind(0), values.unbind(0), strict=True):
            context_kv[layer_idx] = (layer_keys, layer_values)
            cache.place(layer_idx, layer_keys, layer_values, context_tokens)
    return cache, dict(sorted(context_kv.items()))


def encode_pair(
    context: str | list[str],
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    source_tokenizer: PreTrainedTokenizerBase,
    target_model: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
) -> tuple[EncodedContext, EncodedContext]:
    """Check the contexts and the pair, and tokenize the contexts for both models (left-padded batches); a context
    longer than either model holds is an error, never truncated."""
    contexts = check_contexts(context)
    translator.check_pair(source_model, target_model, source_tokenizer, target_tokenizer)
    for model in (source_model, target_model):
        decoder_layers(model)  # a model that is not a supported decoder is named here, before any work
    source_enc = encode_contexts(source_tokenizer, contexts, source_model.device)
    target_enc = encode_contexts(target_tokenizer, contexts, target_model.device)
    for side, model, encoded in (("target", target_model, target_enc), ("source", source_model, source_enc)):
        limit = KVLayout.from_config(model.config).max_positions
        if limit is not None and encoded.input_ids.shape[1] > limit:
            raise ValueError(
                f"`context` is {encoded.input_ids.shape[1]} {side} tokens long but the {side} model holds at most "
                f"{limit}: shorten the context or split it; nothing is truncated silently."
            )
    return source_enc, target_enc


def _recompute_share(recompute, native_tail: int, translator: MoTTranslator) -> float:
    """The share of a prefill the target spends reading the context (see `translate_context`)."""
    if recompute is None:
        return 0.0 if native_tail else translator.config.recompute
    share = check_recompute(recompute)
    if native_tail:
        raise ValueError(
            f"`recompute={recompute!r}` and `native_tail={native_tail!r}` both set how much of the context the "
            "target reads itself: pass one of them."
        )
    return share


def read_context(target_model: PreTrainedModel, target: EncodedContext, source_id: str = "") -> TranslatedCache:
    """The target's own prefill of the contexts, as a `TranslatedCache` (the dial's exact end, `recompute=1`)."""
    cache = TranslatedCache(target_model.config, attention_mask=target.attention_mask, source_id=source_id,
                            target_id=target_model.config.name_or_path)
    read_into_cache(target_model, cache, target.input_ids, target.attention_mask, target.position_ids)
    cache.native_tokens = target.input_ids.shape[1]
    return cache


@torch.no_grad()
def translate_context(
    context: str | list[str],
    *,
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    source_tokenizer: PreTrainedTokenizerBase,
    target_model: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
    source_cache: Cache | None = None,
    native_tail: int = 0,
    recompute: float | None = None,
    strategy: str | None = None,
) -> TranslatedCache:
    """Translate what the source model read into a cache the target model can continue from.

    Args:
        context (`str` or `list[str]`): the context text; a list makes a left-padded batch.
        translator ([`MoTTranslator`]): a translator built for this (source, target) pair.
        source_model / source_tokenizer: the model that reads the context (or already has).
        target_model / target_tokenizer: the model that continues from the translated cache.
        source_cache (`transformers.Cache`, *optional*): the source model's cache of exactly this context
            (tokenized by `source_tokenizer` with special tokens, left-padded). Given, the source does not read
            the context again.
        native_tail (`int`, *optional*, defaults to 0): the target reads the last this many context tokens itself,
            on top of the translation of the rest. `recompute` sets it from a share instead.
        recompute (`float`, *optional*): the speed/quality dial, the share of a native prefill's compute the
            target may spend reading part of the context itself: 0 is pure translation (fastest), 1 the target's
            own prefill (exact; neither the source cache nor the translator is read). In between, the target
            reads the last `floor(recompute * context tokens)` tokens itself on top of the translation of the
            rest, which costs about that share of a prefill (a little more in attention, which grows with the
            context). `None` takes the translator's recommended value (`translator.config.recompute`), or none
            when `native_tail` is given. How the budget is spent may improve between versions; the budget is the
            promise.
        strategy (`str`, *optional*): how `recompute` is spent. `"tail"` (the default): the last tokens, as
            above. `"bottom"`: the target reads the whole context through as many of its bottom layers as the
            budget pays for, which gives it its own keys and values there (and in the layer above them); the
            translation fills the layers above (`hf_mot.bottom_layers`). A translator whose dedicated maps read
            the target's residual stream (`config.dedicated_bottom_layers`) works with `"bottom"` only, its default
            for it, and needs a `recompute` that pays for the layers below that stream. `"deviation"`: the target
            reads its layer-0 keys and values for every token (they depend on the token alone; under 1% of a
            prefill), and recomputes tokens through every layer, each at its place in the context: half the last
            ones, half those whose translation there deviates most from them (`hf_mot.chosen_tokens`).

    Returns:
        [`TranslatedCache`]: pass it to `target_model.generate()` with only the new tokens as `input_ids`.

    Example:

    ```python
    >>> cache = translate_context(document, translator=translator, source_model=src, source_tokenizer=src_tok,
    ...                           target_model=tgt, target_tokenizer=tgt_tok)
    >>> cache.get_seq_length()
    212
    ```
    """
    source_enc, target_enc = encode_pair(context, translator, source_model, source_tokenizer, target_model,
                                         target_tokenizer)
    share = _recompute_share(recompute, native_tail, translator)
    conditioned = translator.config.dedicated_bottom_layers is not None
    strategy = check_strategy(strategy if strategy is not None else "bottom" if conditioned else "tail")
    if conditioned and strategy != "bottom" and share != 1.0:
        raise ValueError(
            "This translator's dedicated maps read the target's residual stream entering layer "
            f"{translator.config.dedicated_bottom_layers}: it works with `strategy='bottom'` only."
        )
    if strategy in ("bottom", "deviation") and native_tail:
        raise ValueError(f"`strategy='{strategy}'` spends `recompute` its own way, not on the last tokens: pass "
                         "`recompute`, not `native_tail`.")
    if share == 1.0:
        return read_context(target_model, target_enc, source_id=source_model.config.name_or_path)
    if strategy == "bottom" and (share or conditioned):
        return _translate_above_bottom(translator, source_model, source_tokenizer, target_model, target_tokenizer,
                                       source_enc, target_enc, source_cache, share)
    if strategy == "deviation" and share:
        return _translate_recomputing_deviating(translator, source_model, source_tokenizer, target_model,
                                                target_tokenizer, source_enc, target_enc, source_cache, share)
    if share:
        native_tail = int(share * target_enc.input_ids.shape[1])
    _check_native_tail(native_tail, target_enc.input_ids.shape[1])
    source, alignment = read_source_and_align(source_model, source_tokenizer, target_tokenizer, source_enc,
                                              target_enc, source_cache)
    return build_translated_cache(
        translator,
        source,
        alignment,
        target_model,
        target_enc,
        native_tail=native_tail,
        source_id=source_model.config.name_or_path,
    )


def _translate_above_bottom(translator, source_model, source_tokenizer, target_model, target_tokenizer, source_enc,
                            target_enc, source_cache, share: float) -> TranslatedCache:
    """`translate_context`'s `strategy="bottom"`: the target's own bottom layers, the translation above them."""
    tokens = target_enc.input_ids.shape[1]
    layers = bottom_layers_within(target_model.config, share, tokens)
    needed = translator.config.dedicated_bottom_layers
    if needed is not None and (layers is None or layers < needed):
        raise ValueError(
            f"This translator's dedicated maps read the target's residual stream entering layer {needed}: reading "
            f"layers 0-{needed - 1} costs {bottom_layer_share(target_model.config, needed, tokens):.3f} of a "
            f"prefill on {tokens} tokens, more than `recompute={share:g}`. Raise `recompute` (`None` takes the "
            "translator's recommended value)."
        )
    if layers is None:
        raise ValueError(
            f"`recompute={share:g}` does not pay for the target's first layer on {tokens} tokens (it costs "
            f"{bottom_layer_share(target_model.config, 0, tokens):.3f} of a prefill): raise it, or use "
            "`strategy='tail'`."
        )
    # The target's read comes first: a translator that reads its residual stream needs it.
    bottom = read_bottom_layers(target_model, target_enc.input_ids, target_enc.attention_mask,
                                target_enc.position_ids, layers, residual_at=needed)
    bottom, residual = bottom if needed is not None else (bottom, None)
    source, alignment = read_source_and_align(source_model, source_tokenizer, target_tokenizer, source_enc,
                                              target_enc, source_cache)
    cache = build_translated_cache(translator, source, alignment, target_model, target_enc,
                                   source_id=source_model.config.name_or_path, target_residual=residual)
    place_bottom_layers(cache, bottom, layers)
    cache.native_layers = layers + 1
    return cache


def _translate_recomputing_deviating(translator, source_model, source_tokenizer, target_model, target_tokenizer,
                                     source_enc, target_enc, source_cache, share: float) -> TranslatedCache:
    """`translate_context`'s `strategy="deviation"` (see `hf_mot.chosen_tokens`)."""
    count = chosen_token_count(target_model.config, share, target_enc.input_ids.shape[1])
    own = own_first_layer(target_model, target_enc)
    source, alignment = read_source_and_align(source_model, source_tokenizer, target_tokenizer, source_enc,
                                              target_enc, source_cache)
    _check_devices(translator, source, target_model)
    # Every token of every layer: a chosen token early in the context attends to the translation within its window.
    translated = run_translator(translator, source, alignment, target_model, target_enc.input_ids,
                                target_enc.attention_mask)
    _, context_kv = fill_translated_cache(translated, target_model, target_enc)
    chosen = choose_tokens(deviation(context_kv[0], own), target_enc.attention_mask, count)
    context_kv[0] = own
    cache = TranslatedCache(target_model.config, attention_mask=target_enc.attention_mask,
                            source_id=source_model.config.name_or_path, target_id=target_model.config.name_or_path)
    cache.target_adapter = translator.target_adapter
    with reading_translated(cache, target_model):  # the chosen tokens' queries read the translation
        context_kv = recompute_tokens(target_model, context_kv, target_enc, chosen)
    for layer, (keys, values) in context_kv.items():
        cache.place(layer, keys, values, target_enc.input_ids.shape[1])
    cache.native_layers = 1
    return cache
