"""TranslatedCache: the target-space KV cache that `generate()` continues from."""

from __future__ import annotations

import json
import os

import torch
from transformers import DynamicCache, PretrainedConfig
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from .files import write_safetensors_atomically
from .kv import KVLayout


class TranslatedCache(DynamicCache):
    r"""
    A [`~transformers.DynamicCache`] of the target model, filled with translated keys and values.

    It is built from the target's config, so Gemma 3's sliding-window layers get the target's own
    sliding-window cache layers. Pass it to `generate()` as the cache with only the new tokens as `input_ids`.

    Args:
        config (`PretrainedConfig`): the target model's config.
        attention_mask (`torch.LongTensor` of shape `(batch, context_tokens)`): mask of the (left-padded)
            contexts; the `generate()` mask is this mask with ones appended for the new tokens.
        source_id (`str`) / target_id (`str`): which models the cache was translated from and for.

    Example:

    ```python
    >>> cache = translate_context(document, translator=translator, source_model=src, source_tokenizer=src_tok,
    ...                           target_model=tgt, target_tokenizer=tgt_tok)
    >>> prompt = tgt_tok(" Answer:", return_tensors="pt", add_special_tokens=False).input_ids
    >>> mask = cache.generation_mask(prompt.shape[1])
    >>> out = tgt.generate(input_ids=prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=16)
    ```
    """

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        attention_mask: torch.Tensor,
        source_id: str = "",
        target_id: str = "",
    ):
        super().__init__(config=config)
        self.attention_mask = attention_mask
        self.source_id = source_id
        self.target_id = target_id
        self.num_context_tokens = attention_mask.shape[1]
        # How many of the last context tokens the target read itself rather than taking their translation.
        self.native_tokens = 0
        # How many of the bottom layers hold the target's own keys and values (`strategy="bottom"`).
        self.native_layers = 0
        # The translator's target adapter (`MoTTranslator.adapt_target`), for `hf_mot`'s own readers of the cache.
        self.target_adapter = None

    def place(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, seen_tokens: int) -> None:
        """Store an empty layer's context states as `update()` would after the layer read `seen_tokens` tokens,
        without copying them: a sliding-window layer keeps (a view of) its last `sliding_window - 1` tokens and
        counts all `seen_tokens`, so `keys` may hold only those last tokens.
        """
        layer = self.layers[layer_idx]
        given = keys.shape[-2]
        sliding = type(layer) is DynamicSlidingWindowLayer
        if sliding:
            needed = min(seen_tokens, layer.sliding_window - 1)
            if given < needed:
                raise ValueError(
                    f"Layer {layer_idx} keeps its last {needed} tokens but was given {given}: translate them all."
                )
            if given > needed:
                keys, values = keys[..., given - needed :, :], values[..., given - needed :, :]
        elif given != seen_tokens:
            raise ValueError(
                f"Target layer {layer_idx} ({type(layer).__name__}) keeps every token, but was given {given} of the "
                f"{seen_tokens} context tokens: translate them all."
            )
        if layer.is_initialized or type(layer) not in (DynamicLayer, DynamicSlidingWindowLayer):
            # A layer class this does not know, or one that already holds tokens: the cache API's own way.
            if layer.is_initialized or given != seen_tokens:
                raise ValueError(f"Cannot place context states in cache layer {layer_idx} ({type(layer).__name__}).")
            DynamicCache.update(self, keys, values, layer_idx)
            return
        # What `lazy_initialization` + `update` leave behind, without the copy `update`'s concatenation makes.
        layer.device, layer.keys, layer.values, layer.is_initialized = keys.device, keys, values, True
        if sliding:
            layer.cumulative_length = seen_tokens
            if layer._sliding_window_tensor.device != keys.device:
                layer._sliding_window_tensor = layer._sliding_window_tensor.to(keys.device)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        self._expand_to_batch(key_states.shape[0], layer_idx)
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def _expand_to_batch(self, batch: int, layer_idx: int) -> None:
        # Beam search and `num_return_sequences` expand the prompt to batch * n rows but leave a user-given
        # cache alone; repeat each context row n times, in the order `generate()` expands its inputs.
        layer = self.layers[layer_idx] if layer_idx < len(self.layers) else None
        if layer is None or not layer.is_initialized or layer.keys is None or layer.keys.numel() == 0:
            return
        cached = layer.keys.shape[0]
        if batch == cached:
            return
        if batch % cached:
            raise ValueError(
                f"The cache holds {cached} contexts but `input_ids` has {batch} rows: pass one prompt per context "
                "(generate() expands them for beams and `num_return_sequences` itself)."
            )
        repeats = batch // cached
        self.batch_repeat_interleave(repeats)
        self.attention_mask = self.attention_mask.repeat_interleave(repeats, dim=0)

    def generation_mask(self, num_new_tokens: int) -> torch.Tensor:
        """The `attention_mask` for `generate()`: the context mask with ones for `num_new_tokens` new tokens."""
        ones = torch.ones(self.attention_mask.shape[0], num_new_tokens, dtype=self.attention_mask.dtype)
        return torch.cat([self.attention_mask, ones.to(self.attention_mask.device)], dim=1)

    def save(self, path: str | os.PathLike) -> None:
        """Write the cache to a safetensors file (written to a temporary file, then renamed)."""
        tensors = {"attention_mask": self.attention_mask.contiguous()}
        lengths = []
        for index, layer in enumerate(self.layers):
            tensors[f"layers.{index}.keys"] = layer.keys.contiguous()
            tensors[f"layers.{index}.values"] = layer.values.contiguous()
            # Sliding-window layers keep only their window but count every token they have seen.
            lengths.append(getattr(layer, "cumulative_length", layer.keys.shape[-2]))
        metadata = {
            "format": "hf_mot.TranslatedCache", "source_id": self.source_id, "target_id": self.target_id,
            "native_tokens": str(self.native_tokens), "seen_tokens": json.dumps(lengths),
        }
        write_safetensors_atomically(path, tensors, metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, config: PretrainedConfig, device=None) -> TranslatedCache:
        """Read a cache written by `save` for a target model with config `config`, onto `device` (default: the
        CPU). Every tensor's shape is checked against `config`; a file that is not such a cache, is truncated or
        was written for another target is a `ValueError` that says so."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), framework="pt", device=str(device or "cpu")) as f:
                metadata = f.metadata() or {}
                if metadata.get("format") != "hf_mot.TranslatedCache":
                    raise ValueError(f"{path} is not a translated cache written by `TranslatedCache.save`.")
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except SafetensorError as error:
            raise ValueError(
                f"{path} is not a readable safetensors file ({error}): it may be truncated or corrupted; write it "
                "again with `TranslatedCache.save`."
            ) from error
        mask = tensors.get("attention_mask")
        if mask is None or mask.dim() != 2:
            raise ValueError(f"{path} lacks the (batch, context tokens) attention mask that `save` writes.")
        cache = cls(config, attention_mask=mask, source_id=metadata.get("source_id", ""),
                    target_id=metadata.get("target_id", ""))
        try:
            native_tokens = int(metadata.get("native_tokens", 0))
            seen = json.loads(metadata.get("seen_tokens", "[]"))
            valid = isinstance(seen, list) and all(isinstance(n, int) and n > 0 for n in seen)
        except ValueError:
            valid = False
        if not valid or not 0 <= native_tokens <= mask.shape[1]:
            raise ValueError(
                f"{path} has corrupted metadata (the token counts `save` writes do not parse): write it again with "
                "`TranslatedCache.save`."
            )
        cache.native_tokens = native_tokens
        target = metadata.get("target_id") or "see its metadata"
        if len(seen) != len(cache.layers):
            raise ValueError(
                f"{path} holds {len(seen)} layers but the target config has {len(cache.layers)}: load it with the "
                f"config of the target it was translated for ({target})."
            )
        layout = KVLayout.from_config(config)
        for index, layer in enumerate(cache.layers):
            keys, values = tensors.get(f"layers.{index}.keys"), tensors.get(f"layers.{index}.values")
            if keys is None or values is None:
                raise ValueError(f"{path} lacks the keys or values of layer {index}: write it again with `save`.")
            kept = min(seen[index], getattr(layer, "sliding_window", seen[index] + 1) - 1)
            expected = (mask.shape[0], layout.num_kv_heads, kept, layout.head_dim)
            if tuple(keys.shape) != expected or tuple(values.shape) != expected:
                raise ValueError(
                    f"{path} layer {index} holds keys {tuple(keys.shape)} and values {tuple(values.shape)}, but this "
                    f"target caches {expected} (batch, KV heads, tokens, head dim) for {seen[index]} context tokens: "
                    f"load it with the config of the target it was translated for ({target})."
                )
            if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
                raise ValueError(f"{path} layer {index} contains NaN or Inf: the cache it was saved from was broken.")
            cache.place(index, keys, values, seen[index])
        return cache
