"""hf_mot: continue one LLM from another LLM's KV cache with a Mixture-of-Translators."""

from transformers import AutoConfig, AutoModel

from .alignment import TokenAlignment
from .cache import TranslatedCache
from .configuration_mot import MoTConfig
from .modeling_mot import MoTOutput, MoTTranslator
from .models import load_model
from .pair import MoTPair
from .pipeline import translate_context

__version__ = "0.2.0"

AutoConfig.register(MoTConfig.model_type, MoTConfig, exist_ok=True)
AutoModel.register(MoTConfig, MoTTranslator, exist_ok=True)
# `save_pretrained` then also writes the modeling files and an `auto_map`, so that users without hf_mot can
# load a translator with `AutoModel.from_pretrained(repo, trust_remote_code=True)`.
MoTConfig.register_for_auto_class()
MoTTranslator.register_for_auto_class("AutoModel")

__all__ = [
    "MoTConfig",
    "MoTOutput",
    "MoTPair",
    "MoTTranslator",
    "TokenAlignment",
    "TranslatedCache",
    "load_model",
    "translate_context",
]
