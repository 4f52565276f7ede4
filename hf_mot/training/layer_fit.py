"""Fitting a translator's dedicated layers (`MoTConfig.dedicated_layers`) to what the target's attention does there.

Retrieval over a long context happens in a few target layers (Gemma 3's three full-attention layers): given its
own keys and values there, and translated ones everywhere else, the target answers as well as after reading the
context itself. The fit has two steps, both layer-local, so neither runs the models while it optimises:

1. **A ridge start.** Per dedicated layer, a closed-form least-squares map from what the dedicated path reads (the
   chosen source layers, aligned to target tokens, and the target's token embedding) to what the rest of the
   translator gets wrong: the target's own position-free keys and values less the translator's.
2. **Attention distillation.** The target's own queries at the positions after a context (questions, answers and
   continuations) attend over the translated context keys and values, next to the target's own keys and values of
   those positions. The loss is the KL from the target's own attention distribution plus the relative error of the
   attention output, per layer. A least-squares fit alone shrinks keys toward their mean and flattens attention,
   which is where retrieval dies; this step trains on what retrieval uses.

Only the dedicated maps change; the rest of the translator stays as it was.
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from ..alignment import encode_contexts
from ..bottom_layers import bottom_layer_share
from ..kv import _attention, apply_rope, cast, decoder_layers, finish_target_keys, read_source_cache
from ..mixture import rms_normalize
from ..modeling_mot import MoTTranslator
from ..pipeline import read_into_cache, read_source_and_align, run_translator
from ..target_adapter import TargetAdapter

# What `hf-mot fit-layers` writes next to the translator: the fit's command, settings and attention errors.
LAYER_FIT_RECORD = "layer_fit.json"


@dataclass
class LayerFitRecord:
    """One (context, suffix) pair, as the fit needs it. `L` dedicated layers, `T` context tokens, `S` suffix tokens.

    The context-long tensors are stored in float16: long contexts make many of them. Attributes:
        key_inputs / value_inputs: what the key and value paths read, `(T, in_features)`.
        base_keys / base_values: the translator's position-free output without the dedicated maps (and before any
            key normalisation), `(L, T, features)`.
        native_keys: the target's own position-free keys of the context, `(L, T, features)`.
        native_values: the target's own values of context and suffix, `(L, T + S, features)`.
        finished_keys: the target's own cached keys (key norm and RoPE applied) of context and suffix, `(L, kv_heads,
            T + S, head_dim)`.
        queries: the target's queries at the suffix positions, RoPE applied, `(L, heads, S, head_dim)`.
        query_inputs / query_cos / query_sin: what those queries are made from (`layer_queries`), for a target
            adapter trained with the maps: the layers' hidden states `(L, S, hidden)` and RoPE `(L, S, rope_dim)`.
    """

    key_inputs: torch.Tensor
    value_inputs: torch.Tensor
    base_keys: torch.Tensor
    base_values: torch.Tensor
    native_keys: torch.Tensor
    native_values: torch.Tensor
    finished_keys: torch.Tensor
    queries: torch.Tensor
    query_inputs: torch.Tensor
    query_cos: torch.Tensor
    query_sin: torch.Tensor

    @property
    def context_tokens(self) -> int:
        return self.base_keys.shape[1]


def check_fit_layers(translator: MoTTranslator) -> list[int]:
    """The translator's dedicated layers, or a `ValueError` saying why it cannot be fitted."""
    config = translator.config
    if not config.dedicated_layers:
        raise ValueError(
            "The translator has no `dedicated_layers` to fit: `hf-mot fit-layers` adds them (`--layers`)."
        )
    kinds = config.target_layout.layer_types
    sliding = [i for i in config.dedicated_layers if kinds and kinds[i] != "full_attention"]
    if sliding:
        raise ValueError(
            f"Dedicated layers {sliding} are {kinds[sliding[0]]} layers: the fit models full causal attention over "
            "the whole context. Dedicate the target's full-attention layers."
        )
    return list(config.dedicated_layers)


@contextlib.contextmanager
def dedicated_maps_off(translator: MoTTranslator):
    """Run the translator as if it had no dedicated maps: they add zero, and no key is normalised."""
    mixtures = [translator.key_mixture, translator.value_mixture]
    saved = [(m.dedicated.weight.detach().clone(), m.dedicated.bias.detach().clone(), m.normalized_layers)
             for m in mixtures]
    with torch.no_grad():
        for m in mixtures:
            m.dedicated.weight.zero_()
            m.dedicated.bias.zero_()
            m.normalized_layers = set()
    try:
        yield
    finally:
        with torch.no_grad():
            for m, (weight, bias, normalized) in zip(mixtures, saved, strict=True):
                m.dedicated.weight.copy_(weight)
                m.dedicated.bias.copy_(bias)
                m.normalized_layers = normalized


def layer_queries(attention: torch.nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """A layer's queries as its attention uses them: projection (with a target adapter's, when one is active), query
    norm if any, RoPE. A NoPE layer (SmolLM3, Llama 4: `use_rope` false) attends with unrotated queries."""
    queries = attention.q_proj(hidden).unflatten(-1, (-1, attention.head_dim)).transpose(1, 2)
    norm = getattr(attention, "q_norm", None)
    queries = norm(queries) if norm is not None else queries
    return apply_rope(queries, cos, sin) if getattr(attention, "use_rope", True) else queries


@contextlib.contextmanager
def _capture_query_inputs(model: PreTrainedModel, layers: list[int]):
    """Record what each layer's queries are made from: its hidden states and RoPE cos/sin, `(hidden, cos, sin)`."""
    captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    handles = []
    for index in layers:

        def hook(module, args, kwargs, index=index):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            captured[index] = (hidden, cos, sin)

        handles.append(_attention(model, index).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _capture_residual(model: PreTrainedModel, layer: int | None):
    """Record the residual stream entering decoder layer `layer` (nothing when `None`): a list, filled by the read."""
    captured: list[torch.Tensor] = []
    if layer is None:
        yield captured
        return

    def hook(module, args, kwargs):
        captured.append(kwargs["hidden_states"] if "hidden_states" in kwargs else args[0])

    handle = decoder_layers(model)[layer].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield captured
    finally:
        handle.remove()


def _layer_features(out, layers: list[int], values: bool) -> torch.Tensor:
    """The translator's output for `layers` of one context, `(L, tokens, features)`."""
    found = {}
    for block_layers, block in zip(out.block_layers, out.value_blocks if values else out.key_blocks, strict=True):
        for j, layer in enumerate(block_layers):
            if layer in layers:
                found[layer] = block[j, 0].transpose(0, 1).flatten(1)  # (heads, tokens, dim) -> (tokens, features)
    return torch.stack([found[layer] for layer in layers])


@torch.no_grad()
def record_pair(
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    source_tokenizer: PreTrainedTokenizerBase,
    target_model: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
    context: str,
    suffix: str,
) -> LayerFitRecord:
    """What the fit needs of one context and the text after it (a question and its answer, or a continuation)."""
    layers = check_fit_layers(translator)
    source_enc = encode_contexts(source_tokenizer, [context], source_model.device)
    target_enc = encode_contexts(target_tokenizer, [context], target_model.device)
    source, alignment = read_source_and_align(source_model, source_tokenizer, target_tokenizer, source_enc,
                                              target_enc)
    suffix_ids = target_tokenizer(suffix, add_special_tokens=False, return_tensors="pt").input_ids
    if suffix_ids.shape[1] == 0:
        raise ValueError(f"The suffix {suffix!r} has no tokens: the fit needs query positions after the context.")
    ids = torch.cat([target_enc.input_ids, suffix_ids.to(target_enc.input_ids.device)], dim=1)
    tokens = target_enc.input_ids.shape[1]
    cache = DynamicCache()  # no config: every layer keeps every token
    bottom = translator.config.dedicated_bottom_layers
    with _capture_query_inputs(target_model, layers) as captured, _capture_residual(target_model, bottom) as residual:
        read_into_cache(target_model, cache, ids, torch.ones_like(ids))
    # Causal: the context's residual stream is the same with or without the suffix after it.
    residual = residual[0][:, :tokens] if bottom is not None else None
    with dedicated_maps_off(translator):
        out = run_translator(translator, source, alignment, target_model, target_enc.input_ids,
                             target_enc.attention_mask, target_residual=residual)
    states = residual
    if bottom is None and translator.config.target_embedding_size is not None:
        states = target_model.get_input_embeddings()(target_enc.input_ids)
    inputs = [
        mixture.dedicated.inputs(cast(kv.flatten(-2), translator.dtype), alignment, states)[0]
        for mixture, kv in ((translator.key_mixture, source.keys), (translator.value_mixture, source.values))
    ]
    suffix_inputs = [tuple(t[0, tokens:] for t in captured[i]) for i in layers]  # (hidden, cos, sin), (S, features)
    native = read_source_cache(cache, target_model, torch.ones_like(ids))
    every = torch.tensor(layers, device=ids.device)
    return LayerFitRecord(
        key_inputs=inputs[0].half(),
        value_inputs=inputs[1].half(),
        base_keys=_layer_features(out, layers, values=False).half(),
        base_values=_layer_features(out, layers, values=True).half(),
        native_keys=native.keys[0, :tokens].index_select(1, every).flatten(2).transpose(0, 1).half(),
        native_values=native.values[0].index_select(1, every).flatten(2).transpose(0, 1).half(),
        finished_keys=torch.stack([cache.layers[i].keys[0] for i in layers]).half(),
        queries=torch.stack([layer_queries(_attention(target_model, i), *(t[None] for t in inputs))[0]
                             for i, inputs in zip(layers, suffix_inputs, strict=True)]).float(),
        query_inputs=torch.stack([inputs[0] for inputs in suffix_inputs]).float(),
        query_cos=torch.stack([inputs[1] for inputs in suffix_inputs]).float(),
        query_sin=torch.stack([inputs[2] for inputs in suffix_inputs]).float(),
    )


@torch.no_grad()
def ridge_start(translator: MoTTranslator, records: list[LayerFitRecord], ridge: float = 1e-3) -> None:
    """Set the dedicated maps to the least-squares fit of the translator's residual error on `records`.

    `ridge` is the penalty relative to the mean diagonal of the inputs' Gram matrix. The first context token is left
    out: the target's own states replace its translation (`pipeline.first_token_states`).
    """
    for path, inputs, base, native in (
        (translator.key_mixture.dedicated, "key_inputs", "base_keys", "native_keys"),
        (translator.value_mixture.dedicated, "value_inputs", "base_values", "native_values"),
    ):
        size = path.in_features + 1  # a column of ones fits the bias
        gram = torch.zeros(size, size, dtype=torch.float64)
        cross = torch.zeros(size, path.weight.shape[0] * path.weight.shape[2], dtype=torch.float64)
        for record in records:
            tokens = record.context_tokens
            x = getattr(record, inputs)[1:].double()
            x = torch.cat([x, x.new_ones(len(x), 1)], dim=1)
            residual = getattr(record, native)[:, 1:tokens].float() - getattr(record, base)[:, 1:].float()
            y = residual.transpose(0, 1).flatten(1).double()  # (tokens, L * features)
            gram += x.T @ x
            cross += x.T @ y
        penalty = ridge * gram.diagonal()[:-1].mean()
        gram.diagonal()[:-1].add_(penalty)
        solution = torch.linalg.solve(gram, cross).float().unflatten(1, (path.weight.shape[0], -1))
        path.weight.copy_(solution[:-1].transpose(0, 1))
        path.bias.copy_(solution[-1])


def attention_error(translator: MoTTranslator, target_model: PreTrainedModel, record: LayerFitRecord,
                    adapted: bool = False):
    """Per dedicated layer, the KL from the target's own attention distribution at the suffix positions to the one
    over the translated context, and the relative error of the attention output: two `(L,)` tensors.

    With `adapted`, the queries that attend over the translated context are made again by the target's layers, so
    that an adapter active on their query projections takes part; the target's own attention keeps its own queries.
    """
    config = translator.config
    layers = config.dedicated_layers
    layout = config.target_layout
    tokens = record.context_tokens
    first = torch.zeros(1, tokens, 1, device=record.base_keys.device)
    first[0, 0] = 1.0  # the target's own states replace the first token's translation
    translated = []
    native_values = record.native_values.float()
    for mixture, inputs, base, native in (
        (translator.key_mixture, record.key_inputs, record.base_keys, record.native_keys.float()),
        (translator.value_mixture, record.value_inputs, record.base_values, native_values[:, :tokens]),
    ):
        added = mixture.dedicated(cast(inputs, translator.dtype)[None], list(range(len(layers))))[0]
        states = base.float() + added.transpose(0, 1).float()  # (L, T, features)
        if mixture.normalized_layers:
            states = rms_normalize(states, layout.head_dim)
        translated.append(first * native + (1 - first) * states)
    keys, values = (s.unflatten(-1, (layout.num_kv_heads, layout.head_dim)).transpose(1, 2) for s in translated)
    positions = torch.arange(tokens, device=keys.device)[None]
    keys = finish_target_keys(target_model, list(layers), keys[:, None], positions)[:, 0].float()
    native_keys = record.finished_keys.float()
    keys = torch.cat([keys, native_keys[:, :, tokens:]], dim=2)
    native_values = native_values.unflatten(-1, (layout.num_kv_heads, -1)).transpose(1, 2)
    values = torch.cat([values, native_values[:, :, tokens:]], dim=2)
    with torch.no_grad():
        native_log_probs, native_out = suffix_attention(target_model, layers[0], record.queries, native_keys,
                                                        native_values)
    queries = record.queries
    if adapted:
        parts = (record.query_inputs, record.query_cos, record.query_sin)
        queries = torch.stack([layer_queries(_attention(target_model, layer), *(t[j][None] for t in parts))[0]
                               for j, layer in enumerate(layers)])
    log_probs, out = suffix_attention(target_model, layers[0], queries, keys, values)
    # Keys a query cannot see have -inf on both sides: no -inf - -inf there.
    gap = (native_log_probs - log_probs).masked_fill(native_log_probs.isinf(), 0.0)
    kl = (native_log_probs.exp() * gap).sum(-1).mean((1, 2))
    error = (out - native_out).pow(2).sum((1, 2, 3)) / native_out.pow(2).sum((1, 2, 3)).clamp_min(1e-12)
    return kl, error


def suffix_attention(
    target_model: PreTrainedModel, layer: int, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention of `layer` (the scale and logit cap of its own module) from suffix `queries` `(L, heads, S,
    dim)` over `keys`/`values` `(L, kv_heads, T + S, dim)`, causal over the suffix: the log-probabilities `(L,
    heads, S, T + S)` and the output `(L, heads, S, dim)`."""
    attention = _attention(target_model, layer)
    softcap = getattr(target_model.config.get_text_config(decoder=True), "attn_logit_softcapping", None)
    suffix, total = queries.shape[2], keys.shape[2]
    visible = torch.ones(suffix, total, dtype=torch.bool, device=keys.device).tril(total - suffix)
    groups = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
    logits = queries @ keys.transpose(-1, -2) * attention.scaling
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    log_probs = logits.masked_fill(~visible, float("-inf")).log_softmax(-1)
    return log_probs, log_probs.exp() @ values


def mean_attention_error(translator, target_model, records: list[LayerFitRecord], adapted: bool = False
                         ) -> dict[str, list[float]]:
    """`attention_error` averaged over `records`, per dedicated layer."""
    with torch.no_grad():
        parts = [attention_error(translator, target_model, record, adapted) for record in records]
    return {"kl": torch.stack([p[0] for p in parts]).mean(0).tolist(),
            "output_error": torch.stack([p[1] for p in parts]).mean(0).tolist()}


def distill_attention(
    translator: MoTTranslator,
    target_model: PreTrainedModel,
    train: list[LayerFitRecord],
    validation: list[LayerFitRecord],
    *,
    epochs: int = 4,
    learning_rate: float = 1e-4,
    adapter: list[torch.nn.Parameter] | None = None,
    adapter_learning_rate: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> list[dict]:
    """Train the dedicated maps on `attention_error` (KL plus output error, every layer alike), one record per
    step, with a cosine learning rate. Keeps the epoch with the lowest validation loss.

    `adapter`: the parameters of a target adapter on the dedicated layers' query projections, active on
    `target_model`, trained jointly (at `adapter_learning_rate`) on the queries it makes (`attention_error`'s
    `adapted`).

    Returns one dict per epoch: its validation KL and output error per layer, and their mean (`loss`).
    """
    paths = [translator.key_mixture.dedicated, translator.value_mixture.dedicated]
    params = [p for path in paths for p in path.parameters()]
    adapter = list(adapter or [])
    adapted = bool(adapter)
    frozen = [p for p in translator.parameters() if all(p is not q for q in params)]
    for p in frozen:
        p.requires_grad_(False)
    groups = [{"params": params, "lr": learning_rate, "base_lr": learning_rate}]
    if adapted:
        groups.append({"params": adapter, "lr": adapter_learning_rate, "base_lr": adapter_learning_rate})
    optimizer = torch.optim.Adam(groups)
    steps, step = epochs * len(train), 0
    rng = random.Random(seed)
    history, best, best_loss = [], None, math.inf
    try:
        for epoch in range(epochs):
            order = list(range(len(train)))
            rng.shuffle(order)
            for index in tqdm(order, desc=f"distill epoch {epoch + 1}/{epochs}", disable=not progress):
                for group in optimizer.param_groups:
                    group["lr"] = group["base_lr"] * 0.5 * (1 + math.cos(math.pi * step / steps))
                kl, error = attention_error(translator, target_model, train[index], adapted)
                loss = kl.mean() + error.mean()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                step += 1
            scores = mean_attention_error(translator, target_model, validation, adapted)
            scores["loss"] = sum(scores["kl"]) / len(scores["kl"]) + sum(scores["output_error"]) / len(
                scores["output_error"])
            history.append({"epoch": epoch + 1, **scores})
            if scores["loss"] < best_loss:
                best_loss = scores["loss"]
                best = ([copy.deepcopy(path.state_dict()) for path in paths], [p.detach().clone() for p in adapter])
    finally:
        for p in frozen:
            p.requires_grad_(True)
    for path, state in zip(paths, best[0], strict=True):
        path.load_state_dict(state)
    with torch.no_grad():
        for p, kept in zip(adapter, best[1], strict=True):
            p.copy_(kept)
    return history


def default_source_layers(num_layers: int, count: int = 10) -> list[int]:
    """`count` source layers evenly spaced, counting down from the last."""
    step = max(num_layers // count, 1)
    return sorted(range(num_layers - 1, -1, -step))[-count:]


def with_dedicated_layers(
    translator: MoTTranslator, layers: list[int], source_layers: list[int], key_norm: bool,
    bottom_layers: int | None = None, target_config=None, previous_tokens: int = 0,
    previous_tokens_keys_only: bool = False,
) -> MoTTranslator:
    """A copy of `translator` with (zero) dedicated maps for `layers`, reading `source_layers`: it translates exactly
    as `translator` does until they are fitted (apart from key normalisation, with `key_norm`).

    With `bottom_layers`, the maps read the target's residual stream entering that layer in place of its token
    embeddings (`MoTConfig.dedicated_bottom_layers`), and the copy's recommended `recompute` becomes what reading the
    layers below costs (`target_config`, the target model's config, prices it). With `previous_tokens`, the maps also
    read the target's embeddings of that many tokens before each token (`MoTConfig.dedicated_previous_tokens`); with
    `previous_tokens_keys_only`, only the key maps do."""
    if translator.config.architecture != "mixture":
        raise ValueError("Dedicated layers need a mixture translator (`architecture='mixture'`).")
    if translator.config.dedicated_layers:
        raise ValueError(
            f"The translator already has dedicated layers {translator.config.dedicated_layers}: start from the "
            "translator they were fitted on (its model card names it), which has none."
        )
    config = copy.deepcopy(translator.config)
    config.dedicated_layers, config.dedicated_source_layers = list(layers), list(source_layers)
    config.dedicated_key_norm = key_norm
    config.dedicated_bottom_layers = bottom_layers
    config.dedicated_previous_tokens = previous_tokens
    config.dedicated_previous_tokens_keys_only = previous_tokens_keys_only
    config._check_dedicated_layers()
    if bottom_layers is not None:
        if target_config is None:
            raise ValueError("`bottom_layers` needs `target_config` to price reading the layers below it.")
        # The share falls with context length (the full-attention layers above grow): short contexts bound it.
        share = max(bottom_layer_share(target_config, bottom_layers, tokens) for tokens in (1, 512))
        config.recompute = min(math.ceil(100 * share) / 100, 0.99)
    widened = MoTTranslator(config).to(device=translator.device, dtype=translator.dtype)
    missing, unexpected = widened.load_state_dict(translator.state_dict(), strict=False)
    if unexpected or any(".dedicated." not in name for name in missing):
        raise RuntimeError(f"Adding dedicated layers changed other weights: {missing}, {unexpected}.")
    return widened.eval()


def fit_dedicated_layers(
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    source_tokenizer: PreTrainedTokenizerBase,
    target_model: PreTrainedModel,
    target_tokenizer: PreTrainedTokenizerBase,
    *,
    pairs: int = 240,
    validation_pairs: int = 24,
    context_words: tuple[int, int] = (200, 1100),
    ridge: float = 1e-3,
    epochs: int = 4,
    learning_rate: float = 1e-4,
    target_lora_rank: int | None = None,
    adapter_learning_rate: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> dict:
    """Fit `translator`'s dedicated maps in place: a ridge start, then attention distillation (module docstring).

    With `target_lora_rank`, a LoRA of that rank on the target's query projections of the dedicated layers is
    distilled jointly with the maps and attached to the translator (`MoTTranslator.attach_target_adapter`); the
    target model is left as it was.

    Training and validation pairs come from disjoint documents of the corpus's training split
    (`hf_mot.training.data.retrieval_pairs`): the validation split, where reported fidelity comes from, stays
    unseen. Returns a report: the validation attention error per dedicated layer without the maps, after the ridge
    start and after distillation, and the distillation's epochs.
    """
    from .data import retrieval_pairs

    layers = check_fit_layers(translator)
    for name, value in (("pairs", pairs), ("validation_pairs", validation_pairs), ("epochs", epochs)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"`{name}` must be a whole number >= 1, got {value!r}.")

    def records(part, count, seed):
        chosen = retrieval_pairs(count, context_words=context_words, seed=seed, part=part)
        return [record_pair(translator, source_model, source_tokenizer, target_model, target_tokenizer,
                            p["context"], p["suffix"])
                for p in tqdm(chosen, desc=f"reading {part} pairs", disable=not progress)]

    train, validation = records("fit", pairs, seed), records("check", validation_pairs, seed + 1)
    report = {"layers": layers, "pairs": pairs, "validation_pairs": validation_pairs,
              "context_tokens": sum(r.context_tokens for r in train)}
    with dedicated_maps_off(translator):
        report["without"] = mean_attention_error(translator, target_model, validation)
    ridge_start(translator, train, ridge)
    report["ridge"] = mean_attention_error(translator, target_model, validation)
    adapter_config, adapter = None, None
    if target_lora_rank is not None:
        adapter_config, adapter = TargetAdapter.new(target_model, layers, target_lora_rank)
        report["target_lora_rank"] = target_lora_rank
    try:
        report["epochs"] = distill_attention(translator, target_model, train, validation, epochs=epochs,
                                             learning_rate=learning_rate, adapter=adapter,
                                             adapter_learning_rate=adapter_learning_rate, seed=seed,
                                             progress=progress)
        report["distilled"] = mean_attention_error(translator, target_model, validation, adapted=adapter is not None)
    finally:
        if adapter_config is not None:
            trained = TargetAdapter.take(target_model, adapter_config)
    if adapter_config is not None:
        translator.attach_target_adapter(trained)
    translator.config.record_weights(source_model, target_model)
    return report
