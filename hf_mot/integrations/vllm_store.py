"""The store of translated caches that vLLM serves through `hf_mot.integrations.vllm.MoTConnector`.

One safetensors file per context, `STORE/<namespace>/<tokens>-<key>.safetensors`:

- `namespace` names the translator and the pair (`hf_mot-` + a hash of the translator's, the source's and the
  target's weight fingerprints). It is also the `cache_salt` of the requests that use the entry, so that vLLM's
  prefix cache never hands translated blocks to a request that asked for the target's own reading.
- `key` is the SHA-256 of the target's token ids of the context (special tokens included), `tokens` their count.
- The file holds `token_ids` `(T,)`, and `keys` / `values` `(layers, T, kv heads, head dim)`: what the target's
  attention layers cache for those tokens (after the key norm and RoPE, as vLLM caches them). Every layer holds
  every token, sliding-window layers too, because a recomputed tail looks back past the window from its start.
  The metadata names the translator, the pair and its fingerprints, and the translator's recommended `recompute`.

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

STORE_FORMAT = "hf_mot.vllm_store.v1"
# Sampled rows of the embedding matrix and the whole last MLP down-projection identify a checkpoint: fine-tunes
# and revisions change the last layer, and a model of another family differs in both.
_EMBEDDING_ROW_STRIDE = 997


class StoreEntryError(ValueError):
    """A store entry that must not be served: the message says why and how to mend it."""


def tokens_key(token_ids) -> str:
    """The SHA-256 of a context's target token ids (the store's key)."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()


def entry_name(token_ids) -> str:
    return f"{len(token_ids)}-{tokens_key(token_ids)}.safetensors"


def _tensor_digest(digest, tensor: torch.Tensor) -> None:
    # bfloat16 bytes: the same checkpoint loaded in float32 or bfloat16 gives the same fingerprint.
    data = tensor.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
    digest.update(str(tuple(tensor.shape)).encode())
    digest.update(data.numpy().tobytes())


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
    _tensor_digest(digest, embedding[::_EMBEDDING_ROW_STRIDE])
    _tensor_digest(digest, tensors[_find(names, f"layers.{num_layers - 1}.mlp.down_proj.weight")])
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
    """An entry's metadata and token ids, read and checked without reading its keys and values."""

    path: Path
    token_ids: tuple[int, ...]
    metadata: dict

    @property
    def recompute(self) -> float:
        return float(self.metadata["recompute"])


def read_header(path: str | os.PathLike, served: ServedModel) -> EntryHeader:
    """Read an entry's metadata and token ids and check them against the served model; a `StoreEntryError` says
    what is wrong (not an entry, corrupted, another target or revision, other cache shapes)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_file():
        raise StoreEntryError(f"No store entry at {path}: write it with `hf-mot translate --to-vllm-store`.")
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != STORE_FORMAT:
                raise StoreEntryError(f"{path} is not a translated-cache store entry ({STORE_FORMAT}).")
            names = set(f.keys())
            if names != {"token_ids", "keys", "values"}:
                raise StoreEntryError(f"{path} holds {sorted(names)}, not token_ids, keys and values.")
            token_ids = f.get_tensor("token_ids")
            shapes = {name: tuple(f.get_slice(name).get_shape()) for name in ("keys", "values")}
    except SafetensorError as error:
        raise StoreEntryError(f"{path} is not a readable safetensors file ({error}): write it again.") from error
    if metadata.get("target_fingerprint") != served.fingerprint:
        raise StoreEntryError(
            f"{path} was translated for target {metadata.get('target_id')!r} with weights fingerprint "
            f"{metadata.get('target_fingerprint')}, but the served model's weights have fingerprint "
            f"{served.fingerprint}: another model or revision. Translate the context again for the served model."
        )
    expected = (served.num_layers, token_ids.numel(), served.num_kv_heads, served.head_dim)
    if token_ids.dim() != 1 or token_ids.numel() == 0 or any(shape != expected for shape in shapes.values()):
        raise StoreEntryError(
            f"{path} holds keys {shapes['keys']} and values {shapes['values']} for {token_ids.numel()} tokens, but "
            f"the served model caches {expected} (layers, tokens, KV heads, head dim): it is corrupted or for "
            "another model; translate the context again."
        )
    ids = tuple(token_ids.tolist())
    if path.name != entry_name(ids):
        raise StoreEntryError(f"{path}'s token ids do not match its name ({entry_name(ids)}): it is corrupted.")
    return EntryHeader(path, ids, metadata)


def read_states(header: EntryHeader, device=None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """An entry's keys and values `(layers, tokens, kv heads, head dim)`; a `StoreEntryError` if they are not
    finite (a broken translation) or unreadable."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(header.path), framework="pt", device=str(device or "cpu")) as f:
            keys, values = f.get_tensor("keys"), f.get_tensor("values")
    except (SafetensorError, OSError) as error:
        raise StoreEntryError(f"{header.path} could not be read ({error}): write it again.") from error
    if not (torch.isfinite(keys).all() and torch.isfinite(values).all()):
        raise StoreEntryError(f"{header.path} holds NaN or Inf: the translation it was written from was broken.")
    if dtype is not None:
        keys, values = keys.to(dtype), values.to(dtype)
    return keys, values


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
) -> list[Path]:
    """Translate each context and write it to the store as an entry the vLLM connector serves; returns the paths.

    The translation is `translate_context`'s at `recompute=0` (every token translated); the connector serves it at
    the translator's recommended `recompute` or a requested one, letting vLLM read the tail itself. Entries are
    written whole (temporary file, then rename). `source_cache`, for a single context, is the source model's
    cache of it (as in `translate_context`): then the source does not read the context again.
    """
    from ..kv import KVLayout
    from ..pipeline import encode_pair, fill_translated_cache, read_source_and_align, run_translator

    contexts = [context] if isinstance(context, str) else context
    if source_cache is not None and len(contexts) != 1:
        raise ValueError(f"`source_cache` is the cache of one context, but {len(contexts)} contexts were given.")
    layout = KVLayout.from_config(target_model.config)
    target_fp = model_fingerprint(target_model.state_dict(), layout.num_layers)
    source_fp = model_fingerprint(source_model.state_dict(), KVLayout.from_config(source_model.config).num_layers)
    digest = hashlib.sha256()
    for name, tensor in sorted(translator.state_dict().items()):
        digest.update(name.encode())
        _tensor_digest(digest, tensor)
    translator_fp = digest.hexdigest()[:16]
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
        translated = run_translator(translator, source, alignment, target_model, target_enc.input_ids,
                                    target_enc.attention_mask)
        _, states = fill_translated_cache(translated, target_model, target_enc)
        keys = torch.stack([states[i][0][0].transpose(0, 1) for i in range(layout.num_layers)])
        values = torch.stack([states[i][1][0].transpose(0, 1) for i in range(layout.num_layers)])
        token_ids = target_enc.input_ids[0].cpu()
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
            "recompute": str(translator.config.recompute),
        }
        path = folder / entry_name(token_ids.tolist())
        tensors = {"token_ids": token_ids.contiguous(), "keys": keys.cpu().contiguous(),
                   "values": values.cpu().contiguous()}
        write_safetensors_atomically(path, tensors, metadata)
        paths.append(path)
    return paths
