"""MoTTranslator: a mixture of translator experts mapping a source model's KV cache into a target's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from .alignment import TokenAlignment
from .configuration_mot import MoTConfig
from .kv import KVLayout, tokenizer_fingerprint


# Repo ids of the translators shipped inside the package, and their folders under `hf_mot/pretrained/`.
SHIPPED_TRANSLATORS = {"hf-mot/smollm2-135m-to-gemma3-270m": "smollm2-135m-to-gemma3-270m"}


def shipped_translator_dir(repo_id: str) -> str | None:
    """The packaged folder of a shipped translator, or `None` if `repo_id` is not one (or is not installed)."""
    name = SHIPPED_TRANSLATORS.get(repo_id)
    if name is None:
        return None
    folder = Path(__file__).parent / "pretrained" / name
    return str(folder) if (folder / "model.safetensors").is_file() else None


class KVMixture(nn.Module):
    """One mixture of translator experts: maps per-layer source keys (or values) to target keys (or values).

    For each produced target layer and each target token:

    1. every source layer is projected to `hidden_size` (one projection per source layer, shared by the target
       layers that read it), then moved onto target tokens by the token alignment;
    2. the target layer mixes its window of source layers with learned weights;
    3. a router picks `num_experts_per_token` experts from the normalised representation plus a target-layer
       embedding, and their gated outputs are added to it (a residual mixture);
    4. a per-target-layer projection produces the target's KV heads.

    With the identity init every projection is the identity and every expert outputs zero, so the mixture
    reproduces its input exactly.
    """

    def __init__(self, config: MoTConfig, source: KVLayout, target: KVLayout):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        start, count = config.produced_layer_range()
        windows = [config.source_layers_for(layer) for layer in range(start, start + count)]
        # Only the source layers some window reads get a projection.
        self.used_source_layers = sorted({s for window in windows for s in window})
        position = {s: i for i, s in enumerate(self.used_source_layers)}
        # A plain list, not a buffer: from_pretrained materialises non-persistent buffers uninitialised.
        self.window_index = [[position[s] for s in w] for w in windows]
        d, h, n_used, n_out = config.hidden_size, config.expert_hidden_size, len(self.used_source_layers), count
        self.source_proj = nn.Parameter(torch.empty(n_used, source.feature_size, d))
        self.source_bias = nn.Parameter(torch.empty(n_used, d))
        self.window_mix = nn.Parameter(torch.empty(n_out, config.source_window))
        self.layer_embedding = nn.Parameter(torch.empty(n_out, d))
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, config.num_experts, bias=False)
        self.expert_in = nn.Parameter(torch.empty(config.num_experts, d, h))
        self.expert_in_bias = nn.Parameter(torch.empty(config.num_experts, h))
        self.expert_out = nn.Parameter(torch.empty(config.num_experts, h, d))
        self.expert_out_bias = nn.Parameter(torch.empty(config.num_experts, d))
        self.out_proj = nn.Parameter(torch.empty(n_out, d, target.feature_size))
        self.out_bias = nn.Parameter(torch.empty(n_out, target.feature_size))

    @torch.no_grad()
    def reset_parameters(self, identity: bool, std: float) -> None:
        for param in (self.source_bias, self.expert_in_bias, self.expert_out_bias, self.out_bias):
            init.zeros_(param)
        init.constant_(self.window_mix, 1.0 / self.window_mix.shape[1])
        init.normal_(self.router.weight, std=std)
        init.normal_(self.expert_in, std=std)
        init.ones_(self.norm.weight)
        init.zeros_(self.norm.bias)
        if identity:
            init.copy_(self.source_proj, torch.eye(*self.source_proj.shape[1:]).expand_as(self.source_proj))
            init.copy_(self.out_proj, torch.eye(*self.out_proj.shape[1:]).expand_as(self.out_proj))
            init.zeros_(self.expert_out)
            init.zeros_(self.layer_embedding)
        else:
            # Scaled so that the projections roughly preserve the scale of their input at init.
            init.normal_(self.source_proj, std=self.source_proj.shape[1] ** -0.5)
            init.normal_(self.out_proj, std=self.out_proj.shape[1] ** -0.5)
            init.normal_(self.expert_out, std=std)
            init.normal_(self.layer_embedding, std=std)

    def forward(self, source: torch.Tensor, alignment: TokenAlignment) -> tuple[torch.Tensor, torch.Tensor]:
        """Translate `source` `(source_layers, batch, source_tokens, features)`.

        Returns the target features `(produced_layers, batch, target_tokens, target_features)` and the router's
        load-balancing loss.
        """
        used = source[self.used_source_layers]
        projected = torch.einsum("lbsf,lfd->lbsd", used, self.source_proj) + self.source_bias[:, None, None]
        # Each target layer's window mix as one (out_layers, used_layers) matrix: a single matmul. Mixing
        # before aligning (both are linear) aligns only the out_layers, not every used source layer.
        index = torch.tensor(self.window_index, device=projected.device)
        mix = projected.new_zeros(index.shape[0], projected.shape[0]).scatter(1, index, self.window_mix.to(projected.dtype))
        hidden = torch.einsum("ol,lbsd->obsd", mix, projected)
        hidden = alignment.apply(hidden)

        routed = self.norm(hidden) + self.layer_embedding[:, None, None]
        flat = routed.reshape(-1, routed.shape[-1])
        logits = self.router(flat)
        gate_logits, chosen = logits.topk(self.top_k, dim=-1)
        gates = gate_logits.softmax(dim=-1)
        mixed = torch.zeros_like(flat)
        for expert in range(self.num_experts):
            rows, slot = (chosen == expert).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            x = flat.index_select(0, rows)
            y = F.gelu(x @ self.expert_in[expert] + self.expert_in_bias[expert])
            y = y @ self.expert_out[expert] + self.expert_out_bias[expert]
            mixed.index_add_(0, rows, y * gates[rows, slot].unsqueeze(-1))
        hidden = hidden + mixed.view_as(hidden)

        out = torch.einsum("obtd,odf->obtf", hidden, self.out_proj) + self.out_bias[:, None, None]
        return out, self._load_balancing_loss(logits, chosen)

    def _load_balancing_loss(self, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        # Switch-Transformer style: num_experts * sum_e (share of routed slots) * (mean router probability).
        share = F.one_hot(chosen, self.num_experts).float().mean(dim=(0, 1))
        probability = logits.float().softmax(dim=-1).mean(dim=0)
        return self.num_experts * (share * probability).sum()


@dataclass
class MoTOutput(ModelOutput):
    """Output of [`MoTTranslator`].

    Args:
        keys (`list[torch.FloatTensor]`): position-free, pre-norm target keys for each produced target layer,
            each `(batch, target_kv_heads, target_tokens, target_head_dim)`.
        values (`list[torch.FloatTensor]`): target values, same shapes.
        layers (`list[int]`): the target layer index of each entry.
        aux_loss (`torch.FloatTensor`): router load-balancing loss (mean of the key and value mixtures).
    """

    keys: list[torch.Tensor] | None = None
    values: list[torch.Tensor] | None = None
    layers: list[int] | None = None
    aux_loss: torch.Tensor | None = None


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
        self.key_mixture = KVMixture(config, source, target)
        self.value_mixture = KVMixture(config, source, target)
        start, count = config.produced_layer_range()
        self.produced_layers = list(range(start, start + count))
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        """Load a translator from a folder or a Hub repo id.

        The translators that ship with hf_mot (`SHIPPED_TRANSLATORS`) load from the installed package, offline,
        when asked for by repo id without a `revision`. Weights load from safetensors only.
        """
        shipped = shipped_translator_dir(str(pretrained_model_name_or_path))
        if shipped is not None and kwargs.get("revision") is None:
            pretrained_model_name_or_path = shipped
        kwargs.setdefault("use_safetensors", True)
        return super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, KVMixture):
            module.reset_parameters(identity=self.config.init == "identity", std=self.config.initializer_range)

    @property
    def source_layout(self) -> KVLayout:
        return self.config.source_layout

    @property
    def target_layout(self) -> KVLayout:
        return self.config.target_layout

    def forward(
        self,
        source_keys: list[torch.Tensor],
        source_values: list[torch.Tensor],
        alignment: TokenAlignment,
    ) -> MoTOutput:
        """Translate position-free source keys and values.

        Args:
            source_keys (`list[torch.FloatTensor]`): one `(batch, source_kv_heads, source_tokens, head_dim)`
                tensor per source layer, RoPE undone (see `hf_mot.kv.read_source_cache`).
            source_values (`list[torch.FloatTensor]`): the source values, same shapes.
            alignment ([`TokenAlignment`]): target tokens onto source tokens.
        """
        target = self.target_layout
        outputs, aux = [], []
        for tensors, mixture in ((source_keys, self.key_mixture), (source_values, self.value_mixture)):
            stacked = torch.stack(tensors).to(self.dtype)  # (layers, batch, heads, tokens, dim)
            layers, batch, heads, tokens, dim = stacked.shape
            features = stacked.permute(0, 1, 3, 2, 4).reshape(layers, batch, tokens, heads * dim)
            translated, balance = mixture(features, alignment)
            translated = translated.view(*translated.shape[:3], target.num_kv_heads, target.head_dim)
            outputs.append(list(translated.permute(0, 1, 3, 2, 4).unbind(0)))
            aux.append(balance)
        return MoTOutput(keys=outputs[0], values=outputs[1], layers=self.produced_layers, aux_loss=sum(aux) / 2)

    def check_pair(self, source_model=None, target_model=None, source_tokenizer=None, target_tokenizer=None) -> None:
        """Raise a `ValueError` if the given models or tokenizers are not the ones this translator was built for."""
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
