"""The store of translated caches that vLLM serves through `hf_mot.integrations.vllm.MoTConnector`.

One safetensors file per context, `STORE/<namespace>/<tokens>-<key>.safetensors`:

- `namespace` names the translator and the pair (`hf_mot-` + a hash of the translator's, the source's and the
  target's weight fingerprints). It is also the `cache_salt` of the requests that use the entry, so that vLLM's
  prefix cache never hands translated blocks to a request that asked for the target's own reading.
- `key` is the SHA-256 of the target's token ids of the context (special tokens included), `tokens` their count.
- The file holds `token_ids` `(T,)`, and per target layer `layers.{i}.keys` / `layers.{i}.values`
  `(tokens, kv heads, head dim)`: what the layer caches for the context's last tokens (after the key norm and
  RoPE, as vLLM caches them). A full-attention layer holds every token; a sliding-window layer the last
  `window - 1 + floor(max_recompute * T)`, which is all that a request served at `recompute <= max_recompute`
  attends to (a recomputed tail looks back a window from its start).
  The metadata names the translator, the pair and its fingerprints, the window, `max_recompute`, and the
  translator's recommended `recompute`.

The layout does not depend on vLLM's block size or on its paged layout (which differs between CPU instruction
sets): the connector writes the tensors through vLLM's own cache-write operation.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..files import write_safetensors_atomically
from ..fingerprint import EMBEDDING_ROW_STRIDE, cached_fingerprint, tensor_digest

STORE_FORMAT = "hf_mot.vllm_store.v1"


class StoreEntryError(ValueError):
    """A store entry that must not be served: the message says why and how to mend it."""


def tokens_key(token_ids) -> str:
    """The SHA-256 of a context's target token ids (the store's key)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()


def entry_name(token_ids) -> str:
    return f"{len(token_ids)}-{tokens_key(token_ids)}.safetensors"


def _find(names, suffix: str) -> str:
    found = sorted((n for n in names if n == suffix or n.endswith("." + suffix)), key=len)
    if not found:
        raise StoreEntryError(f"The model has no tensor named like '{suffix}' to fingerprint its weights by.")
    return found[0]


def model_fingerprint(tensors, num_layers: int) -> str:
    """A short fingerprint of a decoder's weights: `tensors` maps parameter names to tensors (a `state_dict()`, or
    a lazy mapping over a checkpoint's files). Names may carry any prefix (`model.`, `language_model.model.`)."""
    digest = hashlib.sha256()
    names = list(tensors.keys())
    embedding = tensors[_find(names, "embed_tokens.weight")]
    tensor_digest(digest, embedding[::EMBEDDING_ROW_STRIDE])
    tensor_digest(digest, tensors[_find(names, f"layers.{num_layers - 1}.mlp.down_proj.weight")])
    return digest.hexdigest()[:16]


def _translator_fingerprint(translator: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(translator.state_dict().items()):
        digest.update(name.encode())
        tensor_digest(digest, tensor)
    return digest.hexdigest()[:16]


class _CheckpointTensors:
    """A read-only mapping over the tensors of a folder's safetensors files, each read only when asked for."""

    def __init__(self, folder: str | os.PathLike):
        from safetensors import safe_open

        self._files = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    self._files[name] = path
        if not self._files:
            raise StoreEntryError(f"{folder} holds no safetensors weights to fingerprint the served model by.")

    def keys(self):
        return self._files.keys()

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as f:
            return f.get_tensor(name)


def checkpoint_fingerprint(folder: str | os.PathLike, num_layers: int) -> str:
    """`model_fingerprint` of the model saved in `folder` (safetensors files, as vLLM loads them)."""
    return model_fingerprint(_CheckpointTensors(folder), num_layers)


def namespace(translator_fingerprint: str, source_fingerprint: str, target_fingerprint: str) -> str:
    text = f"{translator_fingerprint}:{source_fingerprint}:{target_fingerprint}"
    return "hf_mot-" + hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ServedModel:
    """What the connector checks an entry against: the served target's fingerprint and cache shape."""

    fingerprint: str
    num_layers: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class EntryHeader:
    """An entry's metadata, token ids and the first position each layer holds, read and checked without reading
    its keys and values."""

    path: Path
    token_ids: tuple[int, ...]
    metadata: dict
    first_positions: tuple[int, ...] = ()

    @property
    def recompute(self) -> float:
        return float(self.metadata["recompute"])

    def refusal(self, end: int) -> str | None:
        """Why this entry cannot serve a request that loads its first `end` tokens and computes the rest (a
        sliding-window layer lacking states the tail attends to), or `None`."""
        window = json.loads(self.metadata.get("sliding_window", "null"))
        needed = 0 if window is None else max(end - (window - 1), 0)
        if any(first > needed for first in self.first_positions):
            return (
                f"{self.path} holds sliding-window states for recompute up to {self.metadata['max_recompute']}, "
                f"but this request recomputes {len(self.token_ids) - end} of its {len(self.token_ids)} tokens: write "
                "it with a larger max_recompute"
            )
        return None


def _layer_names(index: int) -> tuple[str, str]:
    return f"layers.{index}.keys", f"layers.{index}.values"


def read_header(path: str | os.PathLike, served: ServedModel) -> EntryHeader:
    """Read an entry's metadata and token ids and check them against the served model; a `StoreEntryError` says
    what is wrong (not an entry, corrupted, another target or revision, other cache shapes)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise StoreEntryError(f"No store entry at {path}: write it with `hf-mot translate --to-vllm-store`.")
    expected_names = {"token_ids"} | {name for i in range(served.num_layers) for name in _layer_names(i)}
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != STORE_FORMAT:
                raise StoreEntryError(f"{path} is not a translated-cache store entry ({STORE_FORMAT}).")
            if metadata.get("target_fingerprint") != served.fingerprint:
                raise StoreEntryError(
                    f"{path} was translated for target {metadata.get('target_id')!r} with weights fingerprint "
                    f"{metadata.get('target_fingerprint')}, but the served model's weights have fingerprint "
                    f"{served.fingerprint}: another model or revision. Translate the context again for the served "
                    "model."
                )
            names = set(f.keys())
            if names != expected_names:
                raise StoreEntryError(
                    f"{path} holds {len(names)} tensors, not the token ids and keys and values of the served "
                    f"model's {served.num_layers} layers: it is corrupted or for another model."
                )
            token_ids = f.get_tensor("token_ids")
            shapes = [tuple(f.get_slice(name).get_shape()) for i in range(served.num_layers)
                      for name in _layer_names(i)]
    except SafetensorError as error:
        raise StoreEntryError(f"{path} is not a readable safetensors file ({error}): write it again.") from error
    tokens = token_ids.numel()
    sliding = json.loads(metadata.get("layer_types", "[]"))
    firsts = []
    for index in range(served.num_layers):
        keys, values = shapes[2 * index], shapes[2 * index + 1]
        kept = keys[0] if keys else -1
        full = index >= len(sliding) or sliding[index] != "sliding_attention"
        if (keys != values or keys[1:] != (served.num_kv_heads, served.head_dim) or not 0 < kept <= tokens
                or (full and kept != tokens)):
            raise StoreEntryError(
                f"{path} layer {index} holds keys {keys} and values {values} for {tokens} context tokens, but the "
                f"served model caches (tokens, {served.num_kv_heads}, {served.head_dim}) per layer, every token in "
                "a full-attention layer: it is corrupted or for another model; translate the context again."
            )
        firsts.append(tokens - kept)
    ids = tuple(token_ids.tolist())
    if token_ids.dim() != 1 or path.name != entry_name(ids):
        raise StoreEntryError(f"{path}'s token ids do not match its name: it is corrupted.")
    return EntryHeader(path, ids, metadata, tuple(firsts))


def read_states(header: EntryHeader, num_layers: int, device=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An entry's keys and values per layer, each `(tokens, kv heads, head dim)` for the layer's last tokens; a
    `StoreEntryError` if they are not finite (a broken translation) or unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(header.path), framework="pt", device=str(device or "cpu")) as f:
            states = [tuple(f.get_tensor(name) for name in _layer_names(i)) for i in range(num_layers)]
    except (SafetensorError, OSError) as error:
        raise StoreEntryError(f"{header.path} could not be read ({error}): write it again.") from error
    if not all(torch.isfinite(t).all() for layer in states for t in layer):
        raise StoreEntryError(f"{header.path} holds NaN or Inf: the translation it was written from was broken.")
    return states


def find_entry(store: str | os.PathLike, space: str, prompt_token_ids) -> Path | None:
    """The longest stored context of namespace `space` that is a proper prefix of the prompt (at least one prompt
    token is left for the engine to read), or `None`."""
    folder = Path(store) / space
    if not folder.is_dir():
        return None
    lengths = sorted({int(p.name.split("-", 1)[0]) for p in folder.glob("*-*.safetensors")
                      if p.name.split("-", 1)[0].isdigit()}, reverse=True)
    prompt = list(prompt_token_ids)
    for length in lengths:
        if length < len(prompt):
            path = folder / entry_name(prompt[:length])
            if path.is_file():
                return path
    return None


@torch.no_grad()
def write_store_entries(
    store: str | os.PathLike,
    context: str | list[str],
    *,
    translator,
    source_model,
    source_tokenizer,
    target_model,
    target_tokenizer,
    source_cache=None,
    max_recompute: float | None = None,
) -> list[Path]:
    """Translate each context and write it to the store as an entry the vLLM connector serves; returns the paths.

    The translation is `translate_context`'s at `recompute=0`; the connector serves it at the translator's
    recommended `recompute` or a requested one up to `max_recompute` (default: the recommended value), letting
    vLLM read the tail itself. Sliding-window layers keep only what such a tail attends to, which on long contexts
    is most of the translation's work saved. Entries are written whole (temporary file, then rename).
    `source_cache`, for a single context, is the source model's cache of it (as in `translate_context`): then the
    source does not read the context again.
    """
    from ..configuration_mot import check_recompute
    from ..kv import KVLayout
    from ..pipeline import (
        encode_pair,
        fill_translated_cache,
        read_source_and_align,
        run_translator,
        tokens_kept,
    )

    if translator.target_adapter is not None:
        raise ValueError(
            "This translator has a target adapter (a LoRA the target must run with while it reads the translation: "
            f"{translator.config.target_adapter}/), which the vLLM connector does not apply yet. Serve it with "
            "transformers (`translator.adapt_target`), or use a translator without one."
        )
    if translator.config.dedicated_bottom_layers is not None:
        raise ValueError(
            "This translator's dedicated maps read the target's residual stream, which the target computes by "
            "reading its bottom layers (`strategy='bottom'`); the vLLM connector does not do that yet. Serve it "
            "with transformers (`translate_context`), or use a translator without `dedicated_bottom_layers`."
        )
    contexts = [context] if isinstance(context, str) else context
    if source_cache is not None and len(contexts) != 1:
        raise ValueError(f"`source_cache` is the cache of one context, but {len(contexts)} contexts were given.")
    recommended = translator.config.recompute
    max_recompute = recommended if max_recompute is None else check_recompute(max_recompute, "`max_recompute`")
    if max_recompute < recommended:
        raise ValueError(
            f"`max_recompute={max_recompute}` is below the translator's recommended recompute {recommended}, at "
            "which the connector serves entries by default: pass at least that."
        )
    layout = KVLayout.from_config(target_model.config)
    target_fp = cached_fingerprint(
        target_model, "checkpoint", lambda: model_fingerprint(target_model.state_dict(), layout.num_layers))
    source_layers = KVLayout.from_config(source_model.config).num_layers
    source_fp = cached_fingerprint(
        source_model, "checkpoint", lambda: model_fingerprint(source_model.state_dict(), source_layers))
    translator_fp = cached_fingerprint(translator, "translator", lambda: _translator_fingerprint(translator))
    space = namespace(translator_fp, source_fp, target_fp)
    folder = Path(store) / space
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for text in contexts:
        # One context at a time: each entry is unpadded, as vLLM reads it.
        source_enc, target_enc = encode_pair(text, translator, source_model, source_tokenizer, target_model,
                                             target_tokenizer)
        source, alignment = read_source_and_align(source_model, source_tokenizer, target_tokenizer, source_enc,
                                                  target_enc, source_cache)
        tokens = target_enc.input_ids.shape[1]
        kept = tokens_kept(layout, tokens, int(max_recompute * tokens))
        translated = run_translator(translator, source, alignment, target_model, target_enc.input_ids,
                                    target_enc.attention_mask, kept)
        _, states = fill_translated_cache(translated, target_model, target_enc)
        token_ids = target_enc.input_ids[0].cpu()
        tensors = {"token_ids": token_ids.contiguous()}
        for index in range(layout.num_layers):
            keys, values = states[index]
            names = _layer_names(index)
            # (batch 1, heads, tokens, dim) in the cache; (tokens, heads, dim) as vLLM writes its cache.
            tensors[names[0]] = keys[0].transpose(0, 1).cpu().contiguous()
            tensors[names[1]] = values[0].transpose(0, 1).cpu().contiguous()
        metadata = {
            "format": STORE_FORMAT,
            "namespace": space,
            "translator_id": translator.config.name_or_path or "",
            "translator_fingerprint": translator_fp,
            "source_id": source_model.config.name_or_path or "",
            "source_fingerprint": source_fp,
            "target_id": target_model.config.name_or_path or "",
            "target_fingerprint": target_fp,
            "layer_types": json.dumps(list(layout.layer_types)),
            "sliding_window": json.dumps(layout.sliding_window),
            "recompute": str(recommended),
            "max_recompute": str(max_recompute),
        }
        path = folder / entry_name(token_ids.tolist())
        write_safetensors_atomically(path, tensors, metadata)
        paths.append(path)
    return paths
