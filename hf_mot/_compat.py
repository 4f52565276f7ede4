"""Differences between transformers 5.x releases, kept in one place.

During 5.x the cache keyword of model forwards and `generate()` moved from `past_key_values` to `cache`
(the old name still works, with a FutureWarning). Everything in hf_mot passes caches through `cache_kwarg`.
"""

from __future__ import annotations

import inspect
from functools import cache

from transformers import PreTrainedModel


@cache
def _cache_kwarg_for(forward_owner: type) -> str:
    parameters = inspect.signature(forward_owner.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwarg(model: PreTrainedModel) -> str:
    """Name of the keyword that `model.forward` and `model.generate` take a cache by."""
    return _cache_kwarg_for(type(model))


def returned_cache(outputs):
    """The cache a forward pass returned, under whichever attribute this transformers version uses."""
    cache = getattr(outputs, "cache", None)
    return cache if cache is not None else outputs.past_key_values
