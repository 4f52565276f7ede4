"""The KV layout of a decoder, and reading its cache in a position-free form.

Every architecture the translator supports caches per layer a key and a value tensor of shape
`(batch, kv_heads, tokens, head_dim)`. What differs is what the keys hold:

- Llama / Qwen2 / Mistral cache keys rotated with RoPE;
- Gemma 3 caches `RoPE(k_norm(k))` (RMS-normalised keys, scaled by the norm's weight, then rotated);
- GPT-2 / OPT cache plain keys (their positions enter through embeddings).

Reading undoes the rotation and the key norm's per-channel scale, so the translator sees keys that depend on
content only (for Gemma 3: the unit-RMS normalised key). Writing does the reverse for the target: its key
norm's scale, then its RoPE at the target positions.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from dataclasses import asdict, dataclass

import torch
from transformers import Cache, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase


@dataclass(frozen=True)
class KVLayout:
    """What a translator must know about one side of a pair: the shapes of its cache and who it is."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_positions: int | None = None
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    name_or_path: str = ""
    tokenizer_fingerprint: str | None = None

    @classmethod
    def from_config(cls, config: PretrainedConfig, tokenizer_fingerprint: str | None = None) -> KVLayout:
        text = config.get_text_config(decoder=True)
        num_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        layer_types = tuple(getattr(text, "layer_types", None) or ())
        return cls(
            model_type=text.model_type,
            num_layers=text.num_hidden_layers,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=text.vocab_size,
            max_positions=getattr(text, "max_position_embeddings", None),
            layer_types=layer_types,
            sliding_window=getattr(text, "sliding_window", None) if "sliding_attention" in layer_types else None,
            name_or_path=getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", ""),
            tokenizer_fingerprint=tokenizer_fingerprint,
        )

    @classmethod
    def from_dict(cls, data: dict) -> KVLayout:
        data = dict(data)
        data["layer_types"] = tuple(data.get("layer_types") or ())
        return cls(**data)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["layer_types"] = list(self.layer_types)
        return data

    @property
    def feature_size(self) -> int:
        """Size of one token's keys (or values) in one layer, all KV heads side by side."""
        return self.num_kv_heads * self.head_dim

    def shape_signature(self) -> tuple:
        """The fields two models must share for one to stand in for the other."""
        return (self.model_type, self.num_layers, self.num_kv_heads, self.head_dim, self.vocab_size)

    def describe(self) -> str:
        return (
            f"{self.model_type} ({self.num_layers} layers, {self.num_kv_heads} KV heads x {self.head_dim}, "
            f"vocab {self.vocab_size})"
        )


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A short hash of a tokenizer's vocabulary and special tokens: equal fingerprints tokenize alike."""
    cached = getattr(tokenizer, "_hf_mot_fingerprint", None)
    if cached is not None:
        return cached
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    payload = json.dumps(
        {"vocab": vocab, "special": sorted(map(str, tokenizer.all_special_tokens))}, ensure_ascii=False
    )
    fingerprint = hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
    tokenizer._hf_mot_fingerprint = fingerprint
    return fingerprint


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    for name in ("layers", "h"):
        layers = getattr(decoder, name, None)
        if layers is not None:
            return layers
    raise TypeError(f"Cannot find the decoder layers of {type(model).__name__}: it is not a supported decoder.")


def _attention(model: PreTrainedModel, layer_idx: int) -> torch.nn.Module | None:
    layer = decoder_layers(model)[layer_idx]
    return getattr(layer, "self_attn", None) or getattr(layer, "attn", None)


def key_norm(model: PreTrainedModel, layer_idx: int) -> torch.nn.Module | None:
    """The module that normalises keys before RoPE in this layer (Gemma 3, Qwen 3), or `None`."""
    attention = _attention(model, layer_idx)
    return getattr(attention, "k_norm", None) if attention is not None else None


def key_norm_scale(model: PreTrainedModel, layer_idx: int) -> torch.Tensor | None:
    """Per-channel scale of the layer's key norm (Gemma's `1 + weight`, Qwen 3's `weight`), or `None`.

    An RMS norm maps a vector of ones to `scale / sqrt(1 + eps)`, whatever convention the architecture uses,
    so the scale is read off the module itself.
    """
    norm = key_norm(model, layer_idx)
    if norm is None:
        return None
    head_dim = KVLayout.from_config(model.config).head_dim
    eps = float(getattr(norm, "eps", getattr(norm, "variance_epsilon", 0.0)))
    weight = next(norm.parameters())
    with torch.no_grad():
        ones = torch.ones(head_dim, device=weight.device, dtype=torch.float32)
        return norm(ones).float() * (1.0 + eps) ** 0.5


def _unscale(keys: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Channels the norm switches off (scale 0, seen in Gemma 3) are always 0 in the cache: keep them at 0.
    scale = scale.to(keys.dtype)
    safe = torch.where(scale.abs() < 1e-6, torch.ones_like(scale), scale)
    return torch.where(scale.abs() < 1e-6, torch.zeros_like(keys), keys / safe)


def rotary_cos_sin(
    model: PreTrainedModel, layer_idx: int, position_ids: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's own RoPE tables for `layer_idx` at `position_ids`, shaped `(batch, tokens, rotary_dim)`.

    Uses the model's rotary module, so RoPE scaling variants and Gemma 3's per-layer-type bases come for free.
    Returns `None` for models without RoPE (GPT-2, OPT).
    """
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None:
        return None
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        layer_type = model.config.get_text_config(decoder=True).layer_types[layer_idx]
        cos, sin = rotary(like, position_ids, layer_type)
    else:
        cos, sin = rotary(like, position_ids)
    return cos, sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `(batch, heads, tokens, head_dim)` with the `rotate_half` convention of transformers."""
    dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    rotated, rest = x[..., :dim], x[..., dim:]
    rotated = rotated * cos + _rotate_half(rotated) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` (exact up to rounding, also with attention scaling folded into cos/sin)."""
    dim = cos.shape[-1]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    rotated, rest = x[..., :dim], x[..., dim:]
    rotated = (rotated * cos - _rotate_half(rotated) * sin) / (cos * cos + sin * sin)
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as `generate()` derives them: count of real tokens so far, padding at 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


@dataclass
class SourceKV:
    """Position-free keys and values of every source layer, each `(batch, kv_heads, tokens, head_dim)`."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    attention_mask: torch.Tensor


def _cache_tensors(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """(keys, values, tokens seen) per layer, for the cache classes of transformers 5.x."""
    out = []
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False) or layer.keys is None:
            raise ValueError(
                "`source_cache` has a layer that holds no keys: pass the cache returned by the source model's "
                "forward pass over the context (`model(input_ids, use_cache=True).past_key_values`)."
            )
        out.append((layer.keys, layer.values, layer.get_seq_length()))
    return out


def read_source_cache(
    cache: Cache,
    model: PreTrainedModel,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None = None,
) -> SourceKV:
    """Turn a source model's cache into position-free keys and values.

    Args:
        cache (`transformers.Cache`): what `model` returned as `past_key_values` after reading the context.
        model (`PreTrainedModel`): the source model that filled the cache.
        attention_mask (`torch.LongTensor` of shape `(batch, tokens)`): the mask the context was read with.
        position_ids (`torch.LongTensor`, *optional*): positions the context was read at; defaults to the ones
            `generate()` derives from `attention_mask`.
    """
    if not isinstance(cache, Cache):
        raise TypeError(
            f"`source_cache` must be a transformers `Cache` (e.g. `DynamicCache`), got {type(cache).__name__}."
        )
    layout = KVLayout.from_config(model.config)
    layers = _cache_tensors(cache)
    batch, tokens = attention_mask.shape
    if len(layers) != layout.num_layers:
        raise ValueError(
            f"`source_cache` has {len(layers)} layers but `source_model` ({layout.describe()}) has "
            f"{layout.num_layers}: pass the cache that `source_model` produced."
        )
    if position_ids is None:
        position_ids = positions_from_mask(attention_mask)
    keys, values, finite = [], [], []
    for layer_idx, (k, v, seen) in enumerate(layers):
        if k.shape[1] != layout.num_kv_heads or k.shape[-1] != layout.head_dim:
            raise ValueError(
                f"`source_cache` layer {layer_idx} holds {k.shape[1]} KV heads x {k.shape[-1]} but `source_model` "
                f"({layout.describe()}) caches {layout.num_kv_heads} x {layout.head_dim}: pass the cache that "
                "`source_model` produced."
            )
        if k.shape[0] != batch:
            raise ValueError(
                f"`source_cache` holds a batch of {k.shape[0]} but the context batch is {batch}: pass one context "
                "per cached sequence."
            )
        if k.shape[-2] < seen:
            raise ValueError(
                f"`source_cache` layer {layer_idx} is a sliding-window layer that kept only {k.shape[-2]} of the "
                f"{seen} context tokens, so the rest would be silently lost. Prefill the source with a cache that "
                "keeps every token: `source_model(..., past_key_values=DynamicCache())` (no `config=`)."
            )
        if k.shape[-2] != tokens:
            raise ValueError(
                f"`source_cache` holds {k.shape[-2]} tokens but the source context has {tokens}: the cache must "
                "come from exactly this context, with nothing generated after it."
            )
        if k.dtype != model.dtype:
            raise TypeError(
                f"`source_cache` holds {k.dtype} tensors but `source_model` runs in {model.dtype}: pass the cache "
                f"that `source_model` produced as it is now, or cast the model with `.to({k.dtype})`."
            )
        finite.append(torch.isfinite(k).all() & torch.isfinite(v).all())
        cos_sin = rotary_cos_sin(model, layer_idx, position_ids, k)
        if cos_sin is not None:
            k = undo_rope(k, *cos_sin)
        scale = key_norm_scale(model, layer_idx)
        if scale is not None:
            k = _unscale(k, scale)
        keys.append(k)
        values.append(v)
    # One check for all layers: a check per layer would make the CPU wait for the GPU at every layer.
    finite = torch.stack(finite)
    if not finite.all():
        layer_idx = int((~finite).nonzero()[0])
        raise ValueError(
            f"`source_cache` layer {layer_idx} contains NaN or Inf: the source forward pass overflowed. "
            "Run the source model in float32 or bfloat16 instead of float16."
        )
    return SourceKV(keys=keys, values=values, attention_mask=attention_mask)


def finish_target_keys(
    model: PreTrainedModel, layer_idx: int, keys: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Put translated, position-free keys where the target caches them: its key norm's scale, then its RoPE.

    For targets that normalise keys (Gemma 3), the translator predicts the normalised key direction and the
    target's own per-channel norm scale is applied, so channels the norm switches off stay off.
    """
    scale = key_norm_scale(model, layer_idx)
    if scale is not None:
        keys = keys * scale.to(keys.dtype)
    cos_sin = rotary_cos_sin(model, layer_idx, position_ids, keys)
    if cos_sin is not None:
        keys = apply_rope(keys, *cos_sin)
    return keys
