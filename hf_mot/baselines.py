"""Baselines the translator is measured against; benchmarks and `hf-mot train --architecture per_layer` use them."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from .alignment import TokenAlignment
from .configuration_mot import MoTConfig
from .kv import KVLayout
from .mixture import depth_matched_source_layers


class PerLayerProjector(nn.Module):
    """Baseline in the style of Cache-to-Cache: for each target layer, one MLP over the concatenated keys and
    values of one source layer (picked by relative depth). No router, no mixture, no cross-layer reading.

    `expert_hidden_size` is the MLP width; pick it so the parameter count matches the mixture it is compared
    with (`hf-mot train --architecture per_layer` takes `--expert-hidden-size`).
    """

    def __init__(self, config: MoTConfig, source: KVLayout, target: KVLayout):
        super().__init__()
        count = target.num_layers
        self.source_layers = [
            depth_matched_source_layers(source.num_layers, layer, count, 1)[0] for layer in range(count)
        ]
        self.target_features = target.feature_size
        inner, width_out = config.expert_hidden_size, 2 * target.feature_size
        self.w_in = nn.Parameter(torch.empty(count, 2 * source.feature_size, inner))
        self.b_in = nn.Parameter(torch.empty(count, inner))
        self.w_out = nn.Parameter(torch.empty(count, inner, width_out))
        self.b_out = nn.Parameter(torch.empty(count, width_out))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.normal_(self.w_in, std=self.w_in.shape[1] ** -0.5)
        init.normal_(self.w_out, std=0.1 * self.w_out.shape[1] ** -0.5)
        init.zeros_(self.b_in)
        init.zeros_(self.b_out)

    def forward(self, keys: torch.Tensor, values: torch.Tensor, alignment: TokenAlignment):
        """`(batch, source_tokens, source_layers, features)` keys and values -> the target's, per produced
        layer `(layers, batch, target_tokens, target_features)`."""
        x = alignment.apply(torch.cat([keys, values], dim=-1)[:, :, self.source_layers].permute(2, 0, 1, 3))
        hidden = F.gelu(torch.einsum("cbtf,cfh->cbth", x, self.w_in) + self.b_in[:, None, None])
        out = torch.einsum("cbth,chf->cbtf", hidden, self.w_out) + self.b_out[:, None, None]
        keys, values = out.split(self.target_features, dim=-1)
        return list(keys.unbind(0)), list(values.unbind(0))
