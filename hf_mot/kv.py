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

import functools
import hashlib
import inspect
import json
import weakref
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
    # `fingerprint.weights_fingerprint` of the weights the translator was trained with (None: not recorded).
    weights_fingerprint: str | None = None

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


def _decoder(model: PreTrainedModel) -> torch.nn.Module:
    return model.get_decoder() if hasattr(model, "get_decoder") else model.base_model


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    decoder = _decoder(model)
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


# Per model: the key-norm scales of all its layers stacked, and the tensors they were read from. A scale is read
# by running the norm (a few operators per layer), so it is read once and again only when a norm's weight is
# replaced, changed in place (its `_version` moves) or moved to another device or dtype.
_KEY_NORM_SCALES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def key_norm_scales(model: PreTrainedModel, layers: list[int]) -> torch.Tensor | None:
    """`key_norm_scale` of each of `layers`, stacked `(len(layers), head_dim)`, or `None` if the model has no
    key norm."""
    count = len(decoder_layers(model))
    norms = [key_norm(model, i) for i in range(count)]
    if norms[0] is None:
        return None
    weights = [next(n.parameters()) for n in norms]
    stamp = tuple((id(w), w._version, w.device, w.dtype) for w in weights)
    entry = _KEY_NORM_SCALES.get(model)
    if entry is None or entry[0] != stamp:
        entry = (stamp, torch.stack([key_norm_scale(model, i) for i in range(count)]))
        _KEY_NORM_SCALES[model] = entry
    scales = entry[1]
    if list(layers) == list(range(count)):
        return scales
    return scales.index_select(0, layer_index(layers, scales.device))


@functools.cache
def _index_tensor(indices: tuple[int, ...], device: str) -> torch.Tensor:
    return torch.tensor(indices, dtype=torch.long, device=device)


def layer_index(indices: list[int], device: torch.device) -> torch.Tensor:
    """`indices` as an index tensor on `device`, made once: building one from a list costs a few operators (and
    a host-to-device copy on a GPU) every time."""
    return _index_tensor(tuple(indices), str(device))


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in `dtype`, without a call when it already is: the hot path counts its operators, and on a GPU each
    is paid for in launch overhead."""
    return x if x.dtype == dtype else x.to(dtype)


def _unscale(keys: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # Channels the norm switches off (scale 0, seen in Gemma 3) are always 0 in the cache: keep them at 0.
    scale = cast(scale, keys.dtype)
    off = scale.abs() < 1e-6
    return (keys / torch.where(off, torch.ones_like(scale), scale)).masked_fill_(off, 0.0)


def layers_cos_sin(
    model: PreTrainedModel, layers: list[int], position_ids: torch.Tensor, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The model's own RoPE tables for `layers` at `position_ids`, `(len(layers), batch, tokens, rotary_dim)` each,
    or `None` for models without RoPE. The model's rotary module makes them, so RoPE scaling variants and Gemma 3's
    per-layer-type bases come for free; it runs once per distinct layer type among `layers`, not once per layer.
    A NoPE layer gets the identity rotation."""
    rotary = getattr(_decoder(model), "rotary_emb", None)
    if rotary is None:
        return None  # no RoPE (GPT-2, OPT)
    if "layer_type" in inspect.signature(rotary.forward).parameters:
        layer_types = model.config.get_text_config(decoder=True).layer_types
        kinds = sorted({layer_types[i] for i in layers})
        tables = [rotary(like, position_ids, kind) for kind in kinds]
    else:
        tables = [rotary(like, position_ids)]
    if len(tables) == 1:
        cos, sin = tables[0]
        cos, sin = cos.unsqueeze(0).expand(len(layers), *cos.shape), sin.unsqueeze(0).expand(len(layers), *sin.shape)
    else:
        which = layer_index([kinds.index(layer_types[i]) for i in layers], position_ids.device)
        cos = torch.stack([c for c, _ in tables]).index_select(0, which)
        sin = torch.stack([s for _, s in tables]).index_select(0, which)
    # NoPE layers (SmolLM3, Llama 4: `no_rope_layers[i]` is 0) cache unrotated keys: the identity rotation there.
    uses_rope = getattr(model.config.get_text_config(decoder=True), "no_rope_layers", None)
    if uses_rope is not None and not all(uses_rope[i] for i in layers):
        rotated = torch.tensor([bool(uses_rope[i]) for i in layers], device=cos.device)[:, None, None, None]
        cos, sin = torch.where(rotated, cos, 1.0), torch.where(rotated, sin, 0.0)
    return cos, sin


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float, inplace: bool = False):
    """Rotate each channel pair `(i, i + rotary_dim / 2)` of `x` by the angle in `cos`/`sin` (broadcastable to
    `x`'s channels), forward (`sign` 1) or back (-1). Every RoPE of transformers builds its tables as
    `cat(freqs, freqs)`, so half of each table is all there is; working on halves with fused multiply-adds (in
    place, where `x` is a copy no one else holds) touches the large keys fewer times than
    `x * cos + rotate_half(x) * sin`."""
    dim = cos.shape[-1]
    half = dim // 2
    cos, sin = cast(cos[..., :half], x.dtype), cast(sin[..., :half], x.dtype)
    first, second, rest = x[..., :half], x[..., half:dim], x[..., dim:]
    if inplace:
        original_first = first.clone()
        first.mul_(cos).addcmul_(second, sin, value=-sign)
        second.mul_(cos).addcmul_(original_first, sin, value=sign)
        return x
    first_out = torch.addcmul(first * cos, second, sin, value=-sign)
    second_out = torch.addcmul(second * cos, first, sin, value=sign)
    return torch.cat((first_out, second_out, rest) if rest.shape[-1] else (first_out, second_out), dim=-1)


def _unit_tables(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Undoing a rotation scaled by `cos^2 + sin^2` (attention scaling folded into the tables) divides by it: on the
    # tables, which have no heads axis, rather than on the keys.
    norm = cos * cos + sin * sin
    return cos / norm, sin / norm


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `(..., batch, heads, tokens, head_dim)` by `cos`/`sin` `(..., batch, tokens, rotary_dim)`, with
    the `rotate_half` convention of transformers."""
    return _rotate(x, cos.unsqueeze(-3), sin.unsqueeze(-3), 1.0)


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` (exact up to rounding, also with attention scaling folded into cos/sin)."""
    cos, sin = _unit_tables(cos, sin)
    return _rotate(x, cos.unsqueeze(-3), sin.unsqueeze(-3), -1.0)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids as `generate()` derives them: count of real tokens so far, padding at 0."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


@dataclass
class SourceKV:
    """Position-free keys and values of every source layer, token-major `(batch, tokens, layers, kv_heads,
    head_dim)`: every layer of a token side by side, as the translator reads them. The keys are float32
    whatever the model's dtype; the values keep the model's."""

    keys: torch.Tensor
    values: torch.Tensor
    attention_mask: torch.Tensor

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s keys and values in the cache's layout, `(batch, kv_heads, tokens, head_dim)` (views)."""
        return self.keys[:, :, index].transpose(1, 2), self.values[:, :, index].transpose(1, 2)


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
    """Turn a source model's cache into position-free keys and values, all layers at once.

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
    for layer_idx, (k, _, seen) in enumerate(layers):
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
        if not k.dtype.is_floating_point:
            raise TypeError(f"`source_cache` holds {k.dtype} tensors; a floating point cache is needed: pass the "
                            "cache that `source_model` produced.")
        if k.dtype != model.dtype:
            raise TypeError(
                f"`source_cache` holds {k.dtype} tensors but `source_model` runs in {model.dtype}: pass the cache "
                f"that `source_model` produced as it is now, or cast the model with `.to({k.dtype})`."
            )
    # Token-major in one copy each: the translator reads every layer of a token side by side.
    keys = torch.stack([k.transpose(1, 2) for k, _, _ in layers], dim=2)
    values = torch.stack([v.transpose(1, 2) for _, v, _ in layers], dim=2)
    # One check for all layers: a check per layer would make the CPU wait for the GPU at every layer. A NaN or Inf
    # anywhere in a layer makes its sum NaN or Inf (finite keys never sum to float32's 3e38): one pass over the
    # cache instead of the several `isfinite` makes.
    dims = (0, 1, 3, 4)
    finite = torch.isfinite(keys.sum(dims, dtype=torch.float32) + values.sum(dims, dtype=torch.float32))
    if not finite.all():
        layer_idx = int((~finite).nonzero()[0])
        raise ValueError(
            f"`source_cache` layer {layer_idx} contains NaN or Inf: the source forward pass overflowed. "
            "Run the source model in float32 or bfloat16 instead of float16."
        )
    every = list(range(layout.num_layers))
    # In float32, as `finish_target_keys` redoes it: a half-precision round trip through RoPE would not give back
    # the cached keys, and the identity translator would not reproduce the model. `keys` is this function's own
    # copy, so it is rotated in place.
    keys = cast(keys, torch.float32)
    cos_sin = layers_cos_sin(model, every, position_ids, keys)
    if cos_sin is not None:
        cos, sin = _unit_tables(*cos_sin)  # (layers, batch, tokens, dim) -> (batch, tokens, layers, 1, dim)
        keys = _rotate(keys, cos.permute(1, 2, 0, 3).unsqueeze(3), sin.permute(1, 2, 0, 3).unsqueeze(3), -1.0,
                       inplace=True)
    scales = key_norm_scales(model, every)
    if scales is not None:
        keys = _unscale(keys, scales[:, None])
    return SourceKV(keys=keys, values=values, attention_mask=attention_mask)


def finish_target_keys(
    model: PreTrainedModel, layers: int | list[int], keys: torch.Tensor, position_ids: torch.Tensor
) -> torch.Tensor:
    """Put translated, position-free keys where the target caches them: its key norm's scale, then its RoPE.

    `keys` is `(batch, kv_heads, tokens, head_dim)` for one layer index, or stacked `(len(layers), batch,
    kv_heads, tokens, head_dim)` for a list of layers (all finished at once); they are finished in float32 and
    returned in their own dtype. For targets that normalise keys
    (Gemma 3), the translator predicts the normalised key direction and the target's own per-channel norm scale
    is applied, so channels the norm switches off stay off.
    """
    if isinstance(layers, int):
        return finish_target_keys(model, [layers], keys[None], position_ids)[0]
    dtype = keys.dtype
    keys = cast(keys, torch.float32)  # see `read_source_cache`
    scales = key_norm_scales(model, layers)
    if scales is not None:
        keys = keys * scales[:, None, None, None]
    cos_sin = layers_cos_sin(model, layers, position_ids, keys)
    if cos_sin is not None:
        keys = apply_rope(keys, *cos_sin)
    return cast(keys, dtype)
