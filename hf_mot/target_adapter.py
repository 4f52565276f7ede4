"""A target-side adapter: a LoRA on the target's query projections in the layers retrieval lives in, trained with
the translator's dedicated maps (`hf-mot fit-layers --target-lora-rank`) so that the target's queries meet the
translated keys halfway. It is active only while the target reads a translated cache
(`MoTTranslator.adapt_target`); the target's own reading never sees it.

It is kept in the translator's folder or repo as a standard PEFT adapter (`adapter_config.json` and
`adapter_model.safetensors` in `target_adapter/`), so `PeftModel.from_pretrained(target, "<repo>/target_adapter")`
or `target.load_adapter(...)` load it as well.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import warnings
from pathlib import Path

import torch

from .files import write_safetensors_atomically, write_text_atomically
from .kv import decoder_layers

# The translator folder's subfolder that holds the adapter (`MoTConfig.target_adapter` names it).
ADAPTER_FOLDER = "target_adapter"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
# PEFT's files name the weights as a `PeftModel` wrapping the target would.
_PEFT_PREFIX = "base_model.model."
# The adapter's name in the target while `hf-mot fit-layers` trains it.
_TRAINING = "hf_mot-training"


def query_projection_names(model: torch.nn.Module, layers: list[int]) -> list[str]:
    """The qualified names of the query projections of `layers` in `model`."""
    wanted = {id(decoder_layers(model)[i].self_attn.q_proj): i for i in layers}
    names = {wanted[id(m)]: name for name, m in model.named_modules() if id(m) in wanted}
    if len(names) != len(layers):
        raise ValueError(f"Could not find the query projections (`self_attn.q_proj`) of target layers {layers}.")
    return [names[i] for i in layers]


class TargetAdapter:
    """A LoRA for the target: its PEFT config (a dict, as in `adapter_config.json`) and its weights, named as in
    PEFT's files. `name` is the adapter name it gets in a target model: `hf_mot-` and a hash of its weights."""

    def __init__(self, peft_config: dict, state_dict: dict[str, torch.Tensor]):
        if not state_dict:
            raise ValueError("A target adapter needs weights: the state dict is empty.")
        # As `adapter_config.json` holds it (sets as sorted lists, enums as their values): the name, a hash of
        # config and weights, stays the same through saving and loading.
        self.peft_config = json.loads(json.dumps(dict(peft_config), default=_jsonable))
        self.state_dict = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state_dict.items()}
        digest = hashlib.sha256(json.dumps(self.peft_config, sort_keys=True).encode())
        for key in sorted(self.state_dict):
            digest.update(key.encode())
            digest.update(self.state_dict[key].numpy().tobytes())
        self.name = "hf_mot-" + digest.hexdigest()[:12]

    @classmethod
    def new(cls, target_model, layers: list[int], rank: int, alpha: float | None = None) -> tuple:
        """Put a fresh LoRA of `rank` on the query projections of `layers` of `target_model` (its output starts at
        zero), make it the only active adapter, and return its `LoraConfig` and trainable parameters; `take` turns
        it into a `TargetAdapter` when it is trained."""
        from peft import LoraConfig, inject_adapter_in_model

        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"The target adapter's rank must be a whole number >= 1, got {rank!r}.")
        config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else rank, lora_dropout=0.0,
                            target_modules=query_projection_names(target_model, layers), bias="none")
        inject_adapter_in_model(config, target_model, adapter_name=_TRAINING)
        _activate(target_model, _TRAINING)
        params = [p for n, p in target_model.named_parameters() if f".{_TRAINING}." in n]
        for p in params:
            p.requires_grad_(True)
        return config, params

    @classmethod
    def take(cls, target_model, peft_config) -> TargetAdapter:
        """The adapter `new` put into `target_model` (with `peft_config`), trained, as a `TargetAdapter`; it is
        removed from the model."""
        state = {_PEFT_PREFIX + n.replace(f".{_TRAINING}.", "."): p for n, p in target_model.named_parameters()
                 if f".{_TRAINING}." in n}
        adapter = cls(peft_config.to_dict(), state)
        for layer in _tuner_layers(target_model):
            layer.delete_adapter(_TRAINING)
            layer._disable_adapters = True
        return adapter

    def save(self, folder: str | os.PathLike) -> None:
        """Write the adapter as PEFT does (`adapter_config.json`, `adapter_model.safetensors`) into `folder`."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        write_text_atomically(folder / "adapter_config.json", json.dumps(self.peft_config, indent=2) + "\n")
        write_safetensors_atomically(folder / "adapter_model.safetensors", self.state_dict, {"format": "pt"})

    @classmethod
    def load(cls, name_or_path, folder: str = ADAPTER_FOLDER, options: dict | None = None) -> TargetAdapter:
        """Read the adapter in the `folder` subfolder of a translator folder or Hub repo (`options`: those of
        `from_pretrained`)."""
        from safetensors.torch import load_file
        from transformers.utils import cached_file

        options = {k: v for k, v in (options or {}).items()
                   if k in ("revision", "cache_dir", "token", "local_files_only", "force_download")}
        paths = {}
        for filename in ADAPTER_FILES:
            path = cached_file(str(name_or_path), f"{folder}/{filename}",
                               _raise_exceptions_for_missing_entries=False, **options)
            if path is None:
                raise OSError(
                    f"The translator {str(name_or_path)!r} names a target adapter, but {folder}/{filename} "
                    "is missing: download the whole repo again, or save the translator again with `save_pretrained`."
                )
            paths[filename] = path
        try:
            state = load_file(paths["adapter_model.safetensors"])
        except Exception as error:
            raise ValueError(
                f"The target adapter's weights ({folder}/adapter_model.safetensors of {str(name_or_path)!r}) "
                f"are corrupted or truncated ({error}). Download them again (`force_download=True`)."
            ) from error
        config = json.loads(Path(paths["adapter_config.json"]).read_text(encoding="utf-8"))
        return cls(config, state)

    def inject(self, target_model) -> None:
        """Put the adapter into `target_model` (disabled) under its `name`, unless it is there already."""
        from peft import LoraConfig, inject_adapter_in_model

        if any(self.name in layer.lora_A for layer in _tuner_layers(target_model)):
            return
        config = LoraConfig(**{k: v for k, v in self.peft_config.items() if k in LoraConfig.__dataclass_fields__})
        with warnings.catch_warnings():
            # PEFT warns that the model may end up with several adapters: each hf_mot adapter is kept under its name.
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            inject_adapter_in_model(config, target_model, adapter_name=self.name)
        params = dict(target_model.named_parameters())
        loaded = set()
        with torch.no_grad():
            for key, value in self.state_dict.items():
                module, _, leaf = key[len(_PEFT_PREFIX):].rpartition(".")
                module, _, kind = module.rpartition(".")
                name = f"{module}.{kind}.{self.name}.{leaf}"
                if name not in params or params[name].shape != value.shape:
                    raise ValueError(
                        f"The target adapter's weight {key} does not fit this target model (no parameter {name} of "
                        f"shape {tuple(value.shape)}): it was trained for another target."
                    )
                params[name].copy_(value)
                loaded.add(name)
        missing = [n for n in params if f".{self.name}." in n and n not in loaded]
        if missing:
            raise ValueError(f"The target adapter's weights leave {missing} unset: its files are incomplete.")
        for layer in _tuner_layers(target_model):
            layer.enable_adapters(False)

    @contextlib.contextmanager
    def active(self, target_model):
        """Make the adapter the only active one in `target_model` (putting it there first) until the block ends."""
        self.inject(target_model)
        saved = [(layer, list(layer.active_adapters), layer.disable_adapters) for layer in _tuner_layers(target_model)]
        _activate(target_model, self.name)
        try:
            yield target_model
        finally:
            for layer, adapters, disabled in saved:
                layer.set_adapter(adapters, inference_mode=True)
                layer._disable_adapters = disabled


def reading_translated(cache, target_model):
    """A context manager for code that has the cache but not the translator: the target adapter of the translator
    that made `cache` (`TranslatedCache.target_adapter`) is active inside it; with none, it does nothing."""
    adapter = getattr(cache, "target_adapter", None)
    return contextlib.nullcontext(target_model) if adapter is None else adapter.active(target_model)


def _jsonable(value):
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return getattr(value, "value", str(value))  # enums (PEFT's task and adapter types) by their values


def _tuner_layers(model) -> list:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in model.modules() if isinstance(m, BaseTunerLayer)]


def _activate(model, name: str) -> None:
    """Make `name` the only active adapter of every adapted layer of `model` (frozen), and enable it."""
    for layer in _tuner_layers(model):
        if name in layer.lora_A:
            layer.set_adapter([name], inference_mode=True)
            layer._disable_adapters = False
        else:
            layer.enable_adapters(False)
