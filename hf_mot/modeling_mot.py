"""MoTTranslator: a mixture of translator experts mapping a source model's KV cache into a target's."""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from .alignment import TokenAlignment
from .baselines import PerLayerProjector
from .configuration_mot import MoTConfig
from .files import write_text_atomically
from .fingerprint import weights_fingerprint
from .hub import PUSH_OPTIONS, read_model_card, render_default_card, shipped_translator_dir, upload_folder
from .kv import KVLayout, cast, tokenizer_fingerprint
from .mixture import DedicatedLayerPath, DepthMatchedPath, KVMixture, TargetTokenReader, groups_by_last_tokens
from .target_adapter import ADAPTER_FOLDER, TargetAdapter


@dataclass
class MoTOutput(ModelOutput):
    """Output of [`MoTTranslator`].

    The produced target layers come in blocks: the layers that need the same target tokens (all of them, or
    a sliding-window layer's last few) are stacked in one tensor, so that later steps treat them at once.

    Args:
        key_blocks (`list[torch.FloatTensor]`): position-free, pre-norm target keys, one `(len(layers), batch,
            target_kv_heads, tokens, target_head_dim)` tensor per block.
        value_blocks (`list[torch.FloatTensor]`): target values, same shapes.
        block_layers (`list[list[int]]`): the target layer index of each entry of each block.
        aux_loss (`torch.FloatTensor`): router load-balancing loss (mean of the key and value mixtures).
    """

    key_blocks: list[torch.Tensor] | None = None
    value_blocks: list[torch.Tensor] | None = None
    block_layers: list[list[int]] | None = None
    aux_loss: torch.Tensor | None = None

    @property
    def layers(self) -> list[int]:
        """Every produced target layer, in order."""
        return sorted(layer for layers in self.block_layers for layer in layers)


class MoTTranslator(PreTrainedModel):
    r"""
    Mixture-of-Translators KV-cache translator: keys and values of a source model's cache go through two
    separate mixtures of experts ([`KVMixture`]) and come out in the target model's KV head layout.

    The translator works on position-free tensors (see `hf_mot.kv`); `translate_context` and
    `build_translated_cache` take care of undoing the source's RoPE and applying the target's key norm and RoPE.

    Example:

    ```python
    >>> from hf_mot import MoTConfig, MoTTranslator
    >>> config = MoTConfig.from_models(model.config, model.config, init="identity")
    >>> translator = MoTTranslator(config)  # exact identity: the test oracle
    ```
    """

    config_class = MoTConfig
    base_model_prefix = "translator"
    main_input_name = "source_keys"
    _supports_sdpa = False

    def __init__(self, config: MoTConfig):
        super().__init__(config)
        if config.source is None or config.target is None:
            raise ValueError(
                "`MoTConfig` has no `source`/`target` layout: build it with "
                "`MoTConfig.from_models(source_model.config, target_model.config)`."
            )
        source, target = config.source_layout, config.target_layout
        if config.architecture == "per_layer":
            self.projector = PerLayerProjector(config, source, target)
        else:
            self.key_mixture = KVMixture(config, source, target, keys=True)
            self.value_mixture = KVMixture(config, source, target)
        self.model_card: str | None = None  # the card it was loaded with; `save_pretrained` writes it back
        # The target-side LoRA trained with the dedicated maps (`config.target_adapter`), if any.
        self.target_adapter: TargetAdapter | None = None
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a translator from a folder or a Hub repo id (`revision=` pins a branch or commit).

        The translators that ship with hf_mot (`SHIPPED_TRANSLATORS`) load from the installed package, offline,
        when asked for by repo id without a `revision`. They load in float32 unless `dtype=` says otherwise.
        Weights load from safetensors only, never pickle. The repo's `README.md` model card, if any, is kept in
        `model_card` and written again by `save_pretrained`.
        """
        name = str(pretrained_model_name_or_path)
        shipped = shipped_translator_dir(name)
        if shipped is not None and kwargs.get("revision") is None:
            pretrained_model_name_or_path = name = shipped
        if kwargs.get("use_safetensors") is False:
            raise ValueError("`use_safetensors=False`: hf_mot translators load from safetensors only (no pickle).")
        kwargs["use_safetensors"] = True
        # Weights may be stored in float16 to stay small (the shipped ones are); translators compute in float32
        # unless the caller asks otherwise (`dtype=`), as the models they sit between usually do on CPU.
        kwargs.setdefault("dtype", torch.float32)
        try:
            model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except OSError as error:
            raise OSError(
                f"Could not load a translator from {name!r}: {error}\nCheck the repo id or folder (and `revision`); "
                "a translator repo holds config.json and model.safetensors, as `save_pretrained` writes them."
            ) from error
        except Exception as error:
            if "safetensor" not in f"{type(error).__name__} {error}".lower():
                raise
            raise ValueError(
                f"The weights file model.safetensors of {name!r} is corrupted or truncated ({error}). Download "
                "it again (`force_download=True`) or save the translator again with `save_pretrained`."
            ) from error
        model.model_card = read_model_card(pretrained_model_name_or_path, kwargs)
        if model.config.target_adapter is not None:
            model.target_adapter = TargetAdapter.load(pretrained_model_name_or_path, model.config.target_adapter,
                                                      kwargs)
        return model

    def save_pretrained(self, save_directory, *args, model_card=None, push_to_hub: bool = False, **kwargs):
        """`PreTrainedModel.save_pretrained`, plus a `README.md` model card.

        The card is `model_card` (a `huggingface_hub.ModelCard` or its text) if given, else the card this
        translator was loaded with, else one rendered from the config by `hf_mot.model_card`.
        """
        repo_id = kwargs.pop("repo_id", None)
        push = {name: kwargs.pop(name) for name in PUSH_OPTIONS if name in kwargs and name != "token"}
        if push and not push_to_hub:
            raise TypeError(f"{sorted(push)} only mean something with `push_to_hub=True`.")
        token = kwargs.get("token")
        if (self.target_adapter is None) != (self.config.target_adapter is None):
            raise ValueError(
                "`config.target_adapter` and the translator's `target_adapter` must be set together: use "
                "`attach_target_adapter` (or `attach_target_adapter(None)` to drop it)."
            )
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            if self.target_adapter is not None:
                self.target_adapter.save(os.path.join(save_directory, self.config.target_adapter))
            card = model_card if model_card is not None else self.model_card
            if card is None:
                card = render_default_card(self, repo_id or os.path.basename(os.path.normpath(save_directory)))
            if card is not None:
                write_text_atomically(os.path.join(save_directory, "README.md"), str(card))
        if push_to_hub:
            return upload_folder(save_directory, repo_id or os.path.basename(os.path.normpath(save_directory)),
                                  token=token, **push)

    def push_to_hub(
        self,
        repo_id: str,
        *,
        commit_message: str | None = None,
        private: bool | None = None,
        token: str | None = None,
        revision: str | None = None,
        model_card=None,
        commit_description: str | None = None,
        create_pr: bool = False,
        tags: list[str] | None = None,
        **kwargs,
    ):
        """Upload `config.json`, `model.safetensors`, the modeling files (for `trust_remote_code=True`) and the
        model card to `repo_id` (created if needed, private if `private`). `revision` names a branch, created from
        `main` if needed; `create_pr` opens a pull request instead of committing to it; `tags` are added to the
        model card's metadata.

        Returns the `huggingface_hub.CommitInfo` of the upload.
        """
        if kwargs:
            raise TypeError(f"MoTTranslator.push_to_hub got unexpected arguments: {sorted(kwargs)}.")
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, model_card=model_card, repo_id=repo_id)
            return upload_folder(folder, repo_id, token=token, private=private, revision=revision,
                                  commit_message=commit_message or "Upload MoT translator",
                                  commit_description=commit_description, create_pr=create_pr, tags=tags)

    def attach_target_adapter(self, adapter: TargetAdapter | None) -> None:
        """Keep `adapter` with the translator (saved in `target_adapter/`, named in the config), or drop it."""
        if adapter is not None and not self.config.dedicated_layers:
            raise ValueError("A target adapter is trained with the dedicated layers' maps: this translator has none.")
        self.target_adapter = adapter
        self.config.target_adapter = None if adapter is None else ADAPTER_FOLDER

    def adapt_target(self, target_model: PreTrainedModel):
        """A context manager: inside it, `target_model` runs with this translator's target adapter (a LoRA on the
        query projections of the dedicated layers) active; outside it, as it was. Wrap the `generate()` (or forward)
        calls that continue from a translated cache. Translators without an adapter make it do nothing.

        ```python
        >>> with translator.adapt_target(tgt):
        ...     out = tgt.generate(input_ids=prompt, attention_mask=mask, past_key_values=cache, max_new_tokens=16)
        ```
        """
        if self.target_adapter is None:
            return contextlib.nullcontext(target_model)
        self.check_pair(target_model=target_model)
        return self.target_adapter.active(target_model)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, KVMixture):
            module.reset_parameters(identity=self.config.init == "identity", std=self.config.initializer_range)
        elif isinstance(module, (TargetTokenReader, DepthMatchedPath, DedicatedLayerPath, PerLayerProjector)):
            module.reset_parameters()

    @property
    def source_layout(self) -> KVLayout:
        return self.config.source_layout

    @property
    def target_layout(self) -> KVLayout:
        return self.config.target_layout

    def forward(
        self,
        source_keys: torch.Tensor | list[torch.Tensor],
        source_values: torch.Tensor | list[torch.Tensor],
        alignment: TokenAlignment,
        target_embeddings: torch.Tensor | None = None,
        last_tokens: list[int | None] | None = None,
        target_residual: torch.Tensor | None = None,
    ) -> MoTOutput:
        """Translate position-free source keys and values.

        Args:
            source_keys (`torch.FloatTensor` or `list[torch.FloatTensor]`): the source keys token-major `(batch,
                source_tokens, source_layers, source_kv_heads, head_dim)`, as `hf_mot.kv.read_source_cache` returns
                them, or a list of one `(batch, source_kv_heads, source_tokens, head_dim)` tensor per layer; RoPE
                undone.
            source_values: the source values, same shapes.
            alignment ([`TokenAlignment`]): target tokens onto source tokens.
            target_embeddings (`torch.FloatTensor` of shape `(batch, target_tokens, target_embedding_size)`,
                *optional*): the target model's input embeddings of the target tokens,
                `target_model.get_input_embeddings()(target_input_ids)`. Required when the config has
                `target_embedding_size`; `hf_mot.pipeline.run_translator` passes them.
            last_tokens (`list[int | None]`, *optional*): per target layer, produce only its last that many
                target tokens (`None`: all). A sliding-window layer of the target keeps only its last
                `sliding_window - 1` context tokens, so `build_translated_cache` asks for those only: on long
                contexts that skips most of the work.
            target_residual (`torch.FloatTensor` of shape `(batch, target_tokens, target_embedding_size)`,
                *optional*): the target's residual stream entering layer `config.dedicated_bottom_layers` (the
                input of that decoder layer) at the target tokens. Required with that option;
                `translate_context(..., strategy="bottom")` reads it.
        """
        target = self.target_layout
        if last_tokens is not None and len(last_tokens) != target.num_layers:
            raise ValueError(
                f"`last_tokens` needs one entry per target layer ({target.num_layers}), got {len(last_tokens)}."
            )
        expected = self.config.target_embedding_size
        if expected is not None and target_embeddings is None:
            raise ValueError(
                "This translator reads the target's token embeddings: pass `target_embeddings="
                "target_model.get_input_embeddings()(target_input_ids)` (or use `translate_context`)."
            )
        if expected is not None and (
            target_embeddings.dim() != 3
            or target_embeddings.shape[-1] != expected
            or target_embeddings.shape[1] != alignment.num_target_tokens
        ):
            raise ValueError(
                f"`target_embeddings` must be (batch, {alignment.num_target_tokens} target tokens, {expected}), got "
                f"{tuple(target_embeddings.shape)}: embed the same target tokens the alignment was built for."
            )

        bottom = self.config.dedicated_bottom_layers
        if bottom is not None and target_residual is None:
            raise ValueError(
                f"This translator's dedicated maps read the target's residual stream entering layer {bottom}: use "
                f"`translate_context(..., strategy='bottom')` with a `recompute` that pays for layers 0-{bottom - 1}, "
                f"or pass `target_residual`."
            )
        if bottom is not None and target_residual.shape != (*target_embeddings.shape[:2], expected):
            raise ValueError(
                f"`target_residual` must be (batch, {alignment.num_target_tokens} target tokens, {expected}), got "
                f"{tuple(target_residual.shape)}: the input of the target's layer {bottom} at the aligned tokens."
            )

        def features(states):
            # Token-major `(batch, tokens, layers, heads * dim)`: every layer of a token in a row.
            if isinstance(states, (list, tuple)):
                states = torch.stack([layer.transpose(1, 2) for layer in states], dim=2)
            return cast(states.flatten(-2), self.dtype)

        def heads(block):
            # (batch, tokens, layers, heads * dim) -> (layers, batch, heads, tokens, dim)
            return block.unflatten(-1, (target.num_kv_heads, target.head_dim)).permute(2, 0, 3, 1, 4)

        if self.config.architecture == "per_layer":
            keys, values = self.projector(features(source_keys), features(source_values), alignment)
            key_blocks, value_blocks, block_layers = [], [], []
            for last, indices in groups_by_last_tokens(last_tokens, target.num_layers):
                pick = [keys[i] for i in indices], [values[i] for i in indices]
                key_block, value_block = (torch.stack(p, dim=2) for p in pick)
                if last is not None:
                    key_block, value_block = key_block[:, -last:], value_block[:, -last:]
                key_blocks.append(heads(key_block))
                value_blocks.append(heads(value_block))
                block_layers.append(indices)
            return MoTOutput(key_blocks=key_blocks, value_blocks=value_blocks, block_layers=block_layers,
                             aux_loss=key_blocks[0].new_zeros(()))
        keys, key_balance = self.key_mixture(features(source_keys), alignment, target_embeddings, last_tokens,
                                             target_residual)
        values, value_balance = self.value_mixture(features(source_values), alignment, target_embeddings,
                                                   last_tokens, target_residual)
        return MoTOutput(
            key_blocks=[heads(block) for _, block in keys],
            value_blocks=[heads(block) for _, block in values],
            block_layers=[indices for indices, _ in keys],
            aux_loss=(key_balance + value_balance) / 2,
        )

    def check_pair(self, source_model=None, target_model=None, source_tokenizer=None, target_tokenizer=None) -> None:
        """Raise a `ValueError` if the given models or tokenizers are not the ones this translator was built for;
        warn if a model has their shapes but other weights than it was trained with (a base model for its
        instruct tune, another revision): the translation may then be worse than its card says."""
        checks = (
            ("source_model", source_model, self.source_layout),
            ("target_model", target_model, self.target_layout),
        )
        for name, model, layout in checks:
            if model is None:
                continue
            got = KVLayout.from_config(model.config)
            if got.shape_signature() != layout.shape_signature():
                raise ValueError(
                    f"This translator was built for {name} {layout.describe()} but got {got.describe()}. "
                    f"Load the translator made for this model pair, or train one with `hf-mot train`."
                )
            fingerprint = weights_fingerprint(model) if layout.weights_fingerprint is not None else None
            if fingerprint is not None and fingerprint != layout.weights_fingerprint:
                warnings.warn(
                    f"`{name}` ({got.name_or_path or got.model_type}) has other weights (fingerprint "
                    f"{fingerprint}) than the translator was trained with ({layout.name_or_path}, "
                    f"{layout.weights_fingerprint}): the translation may be worse than its card says. Load "
                    f"{layout.name_or_path}, or measure it on this model (benchmarks/lm_fidelity.py).",
                    stacklevel=2,
                )
        for name, tokenizer, layout in (
            ("source_tokenizer", source_tokenizer, self.source_layout),
            ("target_tokenizer", target_tokenizer, self.target_layout),
        ):
            if tokenizer is None or layout.tokenizer_fingerprint is None:
                continue
            if tokenizer_fingerprint(tokenizer) != layout.tokenizer_fingerprint:
                raise ValueError(
                    f"`{name}` is not the tokenizer this translator was built for (fingerprint "
                    f"{tokenizer_fingerprint(tokenizer)} != {layout.tokenizer_fingerprint}): pass the tokenizer "
                    f"of {layout.name_or_path or layout.model_type}."
                )
