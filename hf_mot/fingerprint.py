"""Fingerprints of model weights: what tells a checkpoint from another with the same shapes (a base model from
its instruct tune, one revision from the next)."""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable

import torch

# Sampled rows of the embedding matrix and the whole last decoder layer identify a checkpoint: fine-tunes and
# revisions change the last layer, and a model of another family differs in both.
EMBEDDING_ROW_STRIDE = 997


def tensor_digest(digest, tensor: torch.Tensor) -> None:
    """Add a tensor's shape and values to `digest`, as bfloat16 bytes: the same checkpoint loaded in float32 or
    bfloat16 gives the same fingerprint."""
    data = tensor.detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16)
    digest.update(str(tuple(tensor.shape)).encode())
    digest.update(data.numpy().tobytes())


# Fingerprints of live modules, dropped when a parameter is replaced, changed in place or moved: hashing weights
# on every call would cost more than translating a short context.
_FINGERPRINTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def cached_fingerprint(module: torch.nn.Module, kind: str, compute: Callable[[], str]) -> str:
    """`compute()`, the fingerprint of `kind` for `module`, cached until one of its parameters changes."""
    state = tuple((id(p), p._version, p.device, p.dtype) for p in module.parameters())
    known = _FINGERPRINTS.get(module)
    if known is None or known[0] != state:
        known = (state, {})
        _FINGERPRINTS[module] = known
    if kind not in known[1]:
        known[1][kind] = compute()
    return known[1][kind]


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A short fingerprint of a decoder's weights (its input embedding, sampled, and its last decoder layer)."""
    from .kv import decoder_layers

    def compute() -> str:
        digest = hashlib.sha256()
        tensor_digest(digest, model.get_input_embeddings().weight[::EMBEDDING_ROW_STRIDE])
        for name, tensor in sorted(decoder_layers(model)[-1].state_dict().items()):
            # A PEFT adapter (hf_mot's target adapter) leaves the model's own weights as they were, under new names.
            if ".lora_" in name:
                continue
            digest.update(name.replace(".base_layer.", ".").encode())
            tensor_digest(digest, tensor)
        return digest.hexdigest()[:16]

    return cached_fingerprint(model, "weights", compute)
