"""The translator's modules: a mixture of translator experts (with its router) for keys and one for values, and
the paths added to them. [`MoTTranslator`] in `modeling_mot` holds two of them."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers import initialization as init

from .alignment import TokenAlignment
from .configuration_mot import MoTConfig
from .kv import KVLayout, cast, layer_index


class TargetTokenReader(nn.Module):
    """The target's embedding of each target token, layer-normalised and projected to the mixture's width.

    It starts at zero, so adding it to a trained translator (`hf-mot train --init-from`) starts from exactly
    that translator. Its parameters sit on the module itself (no child modules): transformers only
    initialises a custom-code module whose own parameters are missing from the checkpoint.
    """

    def __init__(self, embedding_size: int, hidden_size: int):
        super().__init__()
        self.norm_weight = nn.Parameter(torch.empty(embedding_size))
        self.norm_bias = nn.Parameter(torch.empty(embedding_size))
        self.proj_weight = nn.Parameter(torch.empty(hidden_size, embedding_size))
        self.proj_bias = nn.Parameter(torch.empty(hidden_size))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.ones_(self.norm_weight)
        for param in (self.norm_bias, self.proj_weight, self.proj_bias):
            init.zeros_(param)

    def forward(self, embeddings: torch.Tensor) -> torch.Tensor:
        normed = F.layer_norm(embeddings, self.norm_weight.shape, self.norm_weight, self.norm_bias)
        return F.linear(normed, self.proj_weight, self.proj_bias)


def depth_matched_source_layers(source_layers: int, target_layer: int, target_layers: int, count: int) -> list[int]:
    """The `count` consecutive source layers around the relative depth of `target_layer`."""
    centre = round(target_layer * (source_layers - 1) / max(target_layers - 1, 1))
    first = min(max(centre - count // 2, 0), source_layers - count)
    return list(range(first, first + count))


class DepthMatchedPath(nn.Module):
    """Per produced target layer, a linear map from the source layers at the same relative depth (aligned to
    target tokens), added to the mixture's output.

    The mixture's shared `hidden_size` representation limits the rank of everything it produces: the values of
    Gemma-3-270M's 18 layers need far more than 256 dimensions (a rank-256 projection of them keeps a 0.40
    relative error per layer; their keys only 0.09). This path gives each target layer rank of its own. It
    starts at zero, so adding it to a trained translator starts from exactly that translator; its parameters
    sit on the module itself so that loading such a translator initialises them as missing.
    """

    def __init__(self, count: int, source: KVLayout, target: KVLayout):
        super().__init__()
        produced = target.num_layers
        self.source_layers = [
            depth_matched_source_layers(source.num_layers, layer, produced, count) for layer in range(produced)
        ]
        self.weight = nn.Parameter(torch.empty(produced, count * source.feature_size, target.feature_size))
        self.bias = nn.Parameter(torch.empty(produced, target.feature_size))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.zeros_(self.weight)
        init.zeros_(self.bias)

    def aligned_inputs(
        self, source: torch.Tensor, alignment: TokenAlignment, indices: list[int], last_tokens: int | None = None
    ) -> torch.Tensor:
        """The source layers read for each of the produced layers `indices`, aligned to target tokens:
        `(batch, source_tokens, source_layers, features)` -> `(batch, target_tokens, len(indices), count *
        features)`, or only the last `last_tokens` target tokens. Only the source layers these layers read are
        aligned, and only onto the target tokens asked for."""
        wanted = [self.source_layers[i] for i in indices]
        batch, tokens, layers, features = source.shape
        used = sorted({layer for reads in wanted for layer in reads})
        rows = alignment.num_target_tokens if last_tokens is None else min(last_tokens, alignment.num_target_tokens)
        # Picking the layers out first copies the whole source; it pays only when most target tokens are aligned.
        if (tokens + rows) * len(used) < rows * layers:
            source = source.index_select(2, layer_index(used, source.device))
        else:
            used = list(range(layers))
        aligned = alignment.apply(source.reshape(batch, tokens, -1), last_tokens)
        where = layer_index([used.index(layer) for reads in wanted for layer in reads], source.device)
        aligned = aligned.view(*aligned.shape[:2], len(used), features).index_select(2, where)
        return aligned.view(*aligned.shape[:2], len(indices), -1)

    def forward(self, aligned: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """The contribution to the produced layers `indices` from their `aligned_inputs`: `(batch, target_tokens,
        len(indices), target_features)`."""
        weight, bias = self.weight, self.bias
        if len(indices) < len(self.source_layers):
            which = layer_index(indices, weight.device)
            weight, bias = weight.index_select(0, which), bias.index_select(0, which)
        return torch.einsum("btlf,lfo->btlo", aligned, weight) + bias


class DedicatedLayerPath(nn.Module):
    """For a few chosen target layers, a linear map of their own from chosen source layers (aligned to target tokens)
    and the target's embedding of each token (or, with `reads_residual`, the target's own residual stream entering
    one of its layers, RMS-normalised: `MoTConfig.dedicated_bottom_layers`), added to the mixture's output for
    those layers.

    Retrieval over long contexts lives in a few layers (Gemma 3's full-attention layers), and the shared
    representation does not carry them well enough; a map per layer from many source layers can, and can be fitted
    in closed form (`hf_mot.training.layer_fit`). With `previous_tokens`, it also reads the target's embeddings of
    that many tokens before each token (`MoTConfig.dedicated_previous_tokens`). It starts at zero, so adding it to a
    trained translator starts from exactly that translator; its parameters sit on the module itself, for the same
    reason as [`DepthMatchedPath`].
    """

    def __init__(
        self, target_layers: list[int], source_layers: list[int], source: KVLayout, target: KVLayout,
        embedding_size: int | None, reads_residual: bool = False, previous_tokens: int = 0,
    ):
        super().__init__()
        self.reads_residual = reads_residual
        self.previous_tokens = previous_tokens
        self.target_layers = list(target_layers)
        self.source_layers = list(source_layers)
        self.in_features = len(source_layers) * source.feature_size + (embedding_size or 0) * (1 + previous_tokens)
        self.weight = nn.Parameter(torch.empty(len(target_layers), self.in_features, target.feature_size))
        self.bias = nn.Parameter(torch.empty(len(target_layers), target.feature_size))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.zeros_(self.weight)
        init.zeros_(self.bias)

    def inputs(
        self, source: torch.Tensor, alignment: TokenAlignment, embeddings: torch.Tensor | None,
        last_tokens: int | None = None,
    ) -> torch.Tensor:
        """What the maps read, per target token: `(batch, target_tokens, in_features)` (or the last `last_tokens`).
        `embeddings` are the target's token embeddings, or its residual stream with `reads_residual`."""
        picked = source.index_select(2, layer_index(self.source_layers, source.device)).flatten(2)
        aligned = alignment.apply(picked, last_tokens)
        if embeddings is None:
            return aligned
        tokens = aligned.shape[1]
        states = cast(embeddings[:, -tokens:], aligned.dtype)
        if self.reads_residual:
            # The residual stream's scale grows with depth and varies by token; the maps read its direction.
            states = states * torch.rsqrt(states.pow(2).mean(-1, keepdim=True) + 1e-6)
        if not self.previous_tokens:
            return torch.cat([aligned, states], dim=-1)
        # Zeros before a row's first token, padding included (padding rows of the alignment weigh nothing), so a
        # left-padded row reads what it would alone.
        real = (alignment.weight.sum(-1, keepdim=True) > 0).to(aligned.device, aligned.dtype)
        padded = F.pad(cast(embeddings, aligned.dtype) * real, (0, 0, self.previous_tokens, 0))
        total = padded.shape[1]
        before = [padded[:, total - tokens - shift:total - shift] for shift in range(1, self.previous_tokens + 1)]
        return torch.cat([aligned, states, *before], dim=-1)

    def forward(self, inputs: torch.Tensor, which: list[int]) -> torch.Tensor:
        """The contribution to `self.target_layers[i] for i in which`: `(batch, tokens, len(which), features)`."""
        weight, bias = self.weight, self.bias
        if len(which) < len(self.target_layers):
            index = layer_index(which, weight.device)
            weight, bias = weight.index_select(0, index), bias.index_select(0, index)
        return torch.einsum("btf,lfo->btlo", inputs, weight) + bias


def rms_normalize(block: torch.Tensor, head_dim: int, eps: float = 1e-6) -> torch.Tensor:
    """Each head's features scaled to unit RMS, as an RMS key norm does before its weight: `(..., heads * dim)`."""
    heads = block.unflatten(-1, (-1, head_dim))
    return (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)


def groups_by_last_tokens(last_tokens: list[int | None] | None, count: int) -> list[tuple[int | None, list[int]]]:
    """The target layers `0 .. count - 1` grouped by how many last target tokens each needs (`None`: all),
    so that each group is computed as one block."""
    if last_tokens is None:
        return [(None, list(range(count)))]
    groups: dict = {}
    for index, last in enumerate(last_tokens):
        groups.setdefault(last, []).append(index)
    return list(groups.items())


class KVMixture(nn.Module):
    """One mixture of translator experts: maps the source's keys (or values) to the target's.

    For each target token:

    1. the token's features from every source layer, stacked, are projected to `hidden_size` (one matrix:
       what a target layer needs may sit in any source layer), then moved onto target tokens by the alignment;
       If the config has `target_embedding_size`, the target's own embedding of each target token (normalised,
       projected to `hidden_size`) is added: it tells the mixture which target token it is producing;
    2. a router picks `num_experts_per_token` expert MLPs from the normalised representation, and their gated
       outputs are added to it (a residual mixture of translators);
    3. one projection produces the features of every produced target layer at once;
    4. if the config has `depth_matched_layers`, a per-layer linear path from the source layers at the same
       relative depth is added ([`DepthMatchedPath`]): it lifts the rank limit of the shared representation;
    5. if the config has `dedicated_layers`, those layers get a map of their own ([`DedicatedLayerPath`]), and
       with `dedicated_key_norm` the key mixture RMS-normalises their keys.

    The experts run once per token, not once per (token, layer): the cost grows with the context length only.
    With the identity init both projections are identities and every expert outputs zero, so the mixture
    reproduces its input exactly.
    """

    def __init__(self, config: MoTConfig, source: KVLayout, target: KVLayout, keys: bool = False):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        count = target.num_layers
        self.num_layers = count
        d, h = config.hidden_size, config.expert_hidden_size
        self.in_proj = nn.Linear(source.num_layers * source.feature_size, d)
        self.norm = nn.LayerNorm(d)
        self.router = nn.Linear(d, config.num_experts, bias=False)
        self.expert_in = nn.Parameter(torch.empty(config.num_experts, d, h))
        self.expert_in_bias = nn.Parameter(torch.empty(config.num_experts, h))
        self.expert_out = nn.Parameter(torch.empty(config.num_experts, h, d))
        self.expert_out_bias = nn.Parameter(torch.empty(config.num_experts, d))
        self.out_proj = nn.Linear(d, count * target.feature_size)
        self.target_tokens = None
        if config.target_embedding_size is not None:
            self.target_tokens = TargetTokenReader(config.target_embedding_size, d)
        self.depth_matched = None
        if config.depth_matched_layers:
            self.depth_matched = DepthMatchedPath(config.depth_matched_layers, source, target)
        self.dedicated = None
        if config.dedicated_layers:
            previous = config.dedicated_previous_tokens
            if config.dedicated_previous_tokens_keys_only and not keys:
                previous = 0
            self.dedicated = DedicatedLayerPath(config.dedicated_layers, config.dedicated_source_layers, source,
                                                target, config.target_embedding_size,
                                                reads_residual=config.dedicated_bottom_layers is not None,
                                                previous_tokens=previous)
        self.normalized_layers = set(config.dedicated_layers or ()) if keys and config.dedicated_key_norm else set()
        self.head_dim = target.head_dim

    @torch.no_grad()
    def reset_parameters(self, identity: bool, std: float) -> None:
        for param in (self.in_proj.bias, self.out_proj.bias, self.expert_in_bias, self.expert_out_bias):
            init.zeros_(param)
        init.normal_(self.router.weight, std=std)
        init.normal_(self.expert_in, std=std)
        init.ones_(self.norm.weight)
        init.zeros_(self.norm.bias)
        if identity:
            init.copy_(self.in_proj.weight, torch.eye(*self.in_proj.weight.shape))
            init.copy_(self.out_proj.weight, torch.eye(*self.out_proj.weight.shape))
            init.zeros_(self.expert_out)
        else:
            # The input projection roughly preserves scale; the output starts small, so the first steps do not
            # start from wild keys that swamp the target's attention.
            init.normal_(self.in_proj.weight, std=self.in_proj.weight.shape[1] ** -0.5)
            init.normal_(self.out_proj.weight, std=0.1 * self.out_proj.weight.shape[1] ** -0.5)
            init.normal_(self.expert_out, std=std)

    def forward(
        self,
        source: torch.Tensor,
        alignment: TokenAlignment,
        target_embeddings: torch.Tensor | None = None,
        last_tokens: list[int | None] | None = None,
        target_residual: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Translate `source` `(batch, source_tokens, source_layers, features)`; `target_embeddings`
        `(batch, target_tokens, target_embedding_size)` is needed when the mixture reads target tokens;
        `last_tokens`, one entry per target layer, limits a layer to its last that many target tokens;
        `target_residual` `(batch, target_tokens, target_embedding_size)` is what dedicated maps that read the
        target's residual stream read.

        Returns `(indices, block)` pairs, one per group of target layers that need the same target tokens
        (all of them, or the last few), each block `(batch, tokens, len(indices), target_features)`; and the
        router's load-balancing loss. Each group is computed at once, for only the tokens it needs.
        """
        batch, tokens, layers, features = source.shape
        # Project before aligning (both are linear): the alignment then moves `hidden_size` features, not all.
        hidden = alignment.apply(self.in_proj(source.reshape(batch, tokens, layers * features)))
        if self.target_tokens is not None:
            hidden = hidden + self.target_tokens(cast(target_embeddings, hidden.dtype))

        flat = hidden.reshape(-1, hidden.shape[-1])
        normed = self.norm(flat)
        logits = self.router(normed)
        gate_logits, chosen = logits.topk(self.top_k, dim=-1)
        gates = gate_logits.softmax(dim=-1)
        # Every expert runs on every token, the experts not chosen with gate 0: all experts side by side are one MLP
        # of `num_experts * expert_hidden_size` units, scaled by their expert's gate before the output product. With
        # a few experts two matrix products cost less than gathering each expert's tokens (a launch per expert, and
        # a wait for the GPU to say how many tokens each got), and the result is the same.
        dense_gates = cast(torch.zeros_like(logits).scatter(1, chosen, cast(gates, logits.dtype)), normed.dtype)
        experts, width = self.expert_in.shape[0], self.expert_in.shape[2]
        weight_in = self.expert_in.permute(1, 0, 2).reshape(normed.shape[-1], experts * width)
        inner = F.gelu(torch.addmm(self.expert_in_bias.flatten(), normed, weight_in)).view(-1, experts, width)
        mixed = torch.addmm(dense_gates @ self.expert_out_bias, (inner * dense_gates[..., None]).flatten(1),
                            self.expert_out.reshape(experts * width, -1))
        hidden = (flat + cast(mixed, flat.dtype)).view_as(hidden)

        blocks = []
        for last, indices in groups_by_last_tokens(last_tokens, self.num_layers):
            block = self._out_proj(hidden if last is None else hidden[:, -last:], indices)
            if self.depth_matched is not None:
                matched = self.depth_matched.aligned_inputs(source, alignment, indices, last)
                block = block + self.depth_matched(matched, indices)
            if self.dedicated is not None:
                states = target_residual if self.dedicated.reads_residual else target_embeddings
                block = self._add_dedicated(block, indices, source, alignment, states, last)
            blocks.append((indices, block))
        return blocks, self._load_balancing_loss(logits, chosen)

    def _add_dedicated(self, block, indices, source, alignment, embeddings, last) -> torch.Tensor:
        """`block` with the dedicated maps' contribution added to the dedicated layers among `indices` (and their keys
        normalised, for the key mixture with `dedicated_key_norm`)."""
        dedicated = self.dedicated.target_layers
        rows = [j for j, layer in enumerate(indices) if layer in dedicated]
        if not rows:
            return block
        inputs = self.dedicated.inputs(source, alignment, embeddings, last)
        where = layer_index(rows, block.device)
        added = block.index_select(2, where) + self.dedicated(inputs, [dedicated.index(indices[j]) for j in rows])
        if self.normalized_layers:
            added = rms_normalize(added, self.head_dim)
        return block.index_copy(2, where, cast(added, block.dtype))

    def _out_proj(self, hidden: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """The target layers `indices` from the shared representation: `(batch, tokens, len(indices),
        target_features)`. `out_proj` holds every target layer's rows, layer after layer."""
        count = self.num_layers
        if len(indices) == count:
            out = self.out_proj(hidden)
        else:
            which = layer_index(indices, hidden.device)
            weight = self.out_proj.weight.view(count, -1, self.out_proj.in_features).index_select(0, which)
            bias = self.out_proj.bias.view(count, -1).index_select(0, which)
            out = F.linear(hidden, weight.flatten(0, 1), bias.flatten())
        return out.view(*hidden.shape[:2], len(indices), -1)

    def _load_balancing_loss(self, logits: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        # Switch-Transformer style: num_experts * sum_e (share of routed slots) * (mean router probability).
        share = F.one_hot(chosen, self.num_experts).float().mean(dim=(0, 1))
        probability = logits.float().softmax(dim=-1).mean(dim=0)
        return self.num_experts * (share * probability).sum()
