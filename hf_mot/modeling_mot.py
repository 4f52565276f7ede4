"""MoTTranslator: a mixture of translator experts mapping a source model's KV cache into a target's."""

from __future__ import annotations

import copy
import importlib
import json
import os
import tempfile
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
from .kv import KVLayout, cast, layer_index, tokenizer_fingerprint

# The translator `hf-mot generate` uses when a (source, target) pair is given without `--translator`: each one ships
# inside the package.
DEFAULT_TRANSLATORS = {
    ("smollm2-135m", "gemma3-270m"): "hf-mot/smollm2-135m-to-gemma3-270m",
    ("gemma3-270m", "smollm2-135m"): "hf-mot/gemma3-270m-to-smollm2-135m",
}
# Repo ids of the shipped translators, and their folders under `hf_mot/pretrained/` (the repo's name).
SHIPPED_TRANSLATORS = {repo_id: repo_id.split("/", 1)[1] for repo_id in DEFAULT_TRANSLATORS.values()}


def shipped_translator_dir(repo_id: str) -> str | None:
    """The packaged folder of a shipped translator, or `None` if `repo_id` is not one (or is not installed)."""
    name = SHIPPED_TRANSLATORS.get(repo_id)
    if name is None:
        return None
    folder = Path(__file__).parent / "pretrained" / name
    return str(folder) if (folder / "model.safetensors").is_file() else None


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

    def __init__(self, count: int, source: KVLayout, target: KVLayout, start: int, produced: int):
        super().__init__()
        self.source_layers = [
            depth_matched_source_layers(source.num_layers, layer, target.num_layers, count)
            for layer in range(start, start + produced)
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


class LayerMLPs(nn.Module):
    """An MLP of its own for each of a few produced target layers, added to the layer's output.

    The mixture's experts run once per token and are shared by every layer; the shared representation and the
    linear paths then give each layer a linear read of it. Some layers need more: Gemma 3's full-attention
    layers carry 40% of the translated cache's KL while being 3 of its 18 layers (benchmarks/results/
    layer_attribution.json), and only they reach past its sliding window. Each MLP reads the layer-normed
    shared representation, next to the layer's depth-matched source features when the mixture has them. The
    output weights start at zero, so adding the MLPs to a trained translator starts from exactly that
    translator; the parameters sit on the module itself, as for [`TargetTokenReader`].
    """

    def __init__(self, layers: list[int], first_produced: int, input_size: int, size: int, output_size: int):
        super().__init__()
        self.slots = {layer - first_produced: slot for slot, layer in enumerate(layers)}  # produced index -> slot
        count = len(layers)
        self.weight_in = nn.Parameter(torch.empty(count, input_size, size))
        self.bias_in = nn.Parameter(torch.empty(count, size))
        self.weight_out = nn.Parameter(torch.empty(count, size, output_size))
        self.bias_out = nn.Parameter(torch.empty(count, output_size))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.normal_(self.weight_in, std=self.weight_in.shape[1] ** -0.5)
        for param in (self.bias_in, self.weight_out, self.bias_out):
            init.zeros_(param)

    def forward(self, hidden: torch.Tensor, matched: torch.Tensor | None, index: int) -> torch.Tensor:
        """The contribution to produced layer `index` (which must have an MLP): `hidden` `(batch, tokens,
        hidden_size)` and, if the mixture is depth-matched, `matched` `(batch, tokens, features)`."""
        slot = self.slots[index]
        inputs = hidden if matched is None else torch.cat((hidden, matched.to(hidden.dtype)), dim=-1)
        inputs = F.layer_norm(inputs, inputs.shape[-1:])
        inner = F.gelu(inputs @ self.weight_in[slot] + self.bias_in[slot])
        return inner @ self.weight_out[slot] + self.bias_out[slot]


class LocalTokenMixer(nn.Module):
    """Adds to each target token's representation a linear map of the `count` target tokens before it.

    Without it every target token is translated from its own aligned source features only. The alignment
    averages the source tokens that overlap a target token, so a word split differently by the two tokenizers
    comes out blurred, and the target's states at a token also depend on its neighbours. Reading the previous
    few tokens' representations gives the mixture that local context. It is causal (a token never reads later
    ones, as the target's own states never do) and padding is zeroed first, so a padded batch translates
    each row as it would alone. It starts at zero: adding it to a trained translator (`hf-mot train
    --init-from`) starts from exactly that translator. Its parameters sit on the module itself, as for
    [`TargetTokenReader`]. Added to the shipped SmolLM2 -> Gemma 3 translator it lowered held-out fidelity
    (examples/training/README.md); it is off by default.
    """

    def __init__(self, count: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(count, hidden_size, hidden_size))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init.zeros_(self.weight)

    def forward(self, hidden: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        """`hidden` `(batch, tokens, hidden_size)`, `real` `(batch, tokens)`: 1 for real tokens, 0 for padding."""
        context = hidden * real.unsqueeze(-1).to(hidden.dtype)
        out = hidden
        for back in range(1, min(self.weight.shape[0], hidden.shape[1] - 1) + 1):
            out = out + F.pad(context[:, :-back], (0, 0, back, 0)) @ self.weight[back - 1]
        return out


def _groups(last_tokens: list[int | None] | None, count: int) -> list[tuple[int | None, list[int]]]:
    """The produced layers `0 .. count - 1` grouped by how many last target tokens each needs (`None`: all),
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
    5. if the config has `layer_mlp_layers`, each of those layers also adds an MLP of its own ([`LayerMLPs`]).

    If the config has `local_context_tokens`, step 1 also adds a linear map of the previous that many target
    tokens' representations ([`LocalTokenMixer`]), before the router.

    The experts run once per token, not once per (token, layer): the cost grows with the context length only.
    With the identity init both projections are identities and every expert outputs zero, so the mixture
    reproduces its input exactly.
    """

    def __init__(self, config: MoTConfig, source: KVLayout, target: KVLayout):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_token
        start, count = config.produced_layer_range()
        self.produced = (start, count)
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
            self.depth_matched = DepthMatchedPath(config.depth_matched_layers, source, target, start, count)
        self.local_context = None
        if config.local_context_tokens:
            self.local_context = LocalTokenMixer(config.local_context_tokens, d)
        self.layer_mlps = None
        if config.layer_mlp_layers:
            matched = config.depth_matched_layers * source.feature_size
            self.layer_mlps = LayerMLPs(config.layer_mlp_layers, start, d + matched, config.layer_mlp_size,
                                        target.feature_size)

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
            # The produced layers are a contiguous block of the stacked features.
            start, count = self.produced
            width = self.out_proj.weight.shape[0]
            rows = torch.eye(self.out_proj.weight.shape[1])[start * width // count :][:width]
            init.copy_(self.out_proj.weight, rows)
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
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Translate `source` `(batch, source_tokens, source_layers, features)`; `target_embeddings`
        `(batch, target_tokens, target_embedding_size)` is needed when the mixture reads target tokens;
        `last_tokens`, one entry per produced layer, limits a layer to its last that many target tokens.

        Returns `(indices, block)` pairs, one per group of produced layers that need the same target tokens
        (all of them, or the last few), each block `(batch, tokens, len(indices), target_features)`; and the
        router's load-balancing loss. Each group is computed at once, for only the tokens it needs.
        """
        batch, tokens, layers, features = source.shape
        # Project before aligning (both are linear): the alignment then moves `hidden_size` features, not all.
        hidden = alignment.apply(self.in_proj(source.reshape(batch, tokens, layers * features)))
        if self.target_tokens is not None:
            hidden = hidden + self.target_tokens(cast(target_embeddings, hidden.dtype))
        if self.local_context is not None:
            # Padding rows of the alignment have no source token (all weights zero).
            hidden = self.local_context(hidden, alignment.weight.sum(dim=-1).to(hidden.device) > 0)

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
        for last, indices in _groups(last_tokens, self.produced[1]):
            read = hidden if last is None else hidden[:, -last:]
            block = self._out_proj(read, indices)
            matched = None
            if self.depth_matched is not None:
                matched = self.depth_matched.aligned_inputs(source, alignment, indices, last)
                block = block + self.depth_matched(matched, indices)
            if self.layer_mlps is not None and any(index in self.layer_mlps.slots for index in indices):
                per_layer = list(block.unbind(2))
                for j, index in enumerate(indices):
                    if index in self.layer_mlps.slots:
                        own = self.layer_mlps(read, None if matched is None else matched[:, :, j], index)
                        per_layer[j] = per_layer[j] + own
                block = torch.stack(per_layer, dim=2)
            blocks.append((indices, block))
        return blocks, self._load_balancing_loss(logits, chosen)

    def _out_proj(self, hidden: torch.Tensor, indices: list[int]) -> torch.Tensor:
        """The produced layers `indices` from the shared representation: `(batch, tokens, len(indices),
        target_features)`. `out_proj` holds every produced layer's rows, layer after layer."""
        count = self.produced[1]
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


@torch.no_grad()
def widen_mixture(narrow: KVMixture, wide: KVMixture, std: float) -> None:
    """Copy `narrow` into `wide` (a mixture with a larger `hidden_size` and/or `expert_hidden_size`) so that
    `wide` starts as `narrow` and its added units can learn.

    The added hidden dimensions start at zero (no projection writes them) but are read by a small random
    output projection, so their gradient is not zero; the added expert units read random weights but write
    zero. The layer norm then averages over zeros too, so its gain is rescaled: that is exact for inputs of
    zero mean and close otherwise (the tests bound the change).
    """
    d, h = narrow.expert_in.shape[1:]
    width, hidden = wide.expert_in.shape[1:]
    if narrow.layer_mlps is not None:
        # Their layer norm reads the shared representation: zero-padding it would change what they compute.
        raise ValueError("A mixture with layer MLPs cannot be widened: widen first, then add the layer MLPs.")
    if width < d or hidden < h or wide.num_experts != narrow.num_experts or wide.produced != narrow.produced:
        raise ValueError(
            f"Can only widen a mixture (hidden {d} -> {width}, experts {h} -> {hidden}, same number of experts "
            "and produced layers)."
        )
    for param in wide.parameters():
        param.zero_()
    wide.in_proj.weight[:d] = narrow.in_proj.weight
    wide.in_proj.bias[:d] = narrow.in_proj.bias
    wide.norm.weight[:d] = narrow.norm.weight * (d / width) ** 0.5
    wide.norm.weight[d:] = 1.0
    wide.norm.bias[:d] = narrow.norm.bias
    wide.router.weight[:, :d] = narrow.router.weight
    wide.expert_in[:, :d, :h] = narrow.expert_in
    wide.expert_in[:, :, h:].normal_(std=std)
    wide.expert_in_bias[:, :h] = narrow.expert_in_bias
    wide.expert_out[:, :h, :d] = narrow.expert_out
    wide.expert_out_bias[:, :d] = narrow.expert_out_bias
    wide.out_proj.weight[:, :d] = narrow.out_proj.weight
    wide.out_proj.weight[:, d:].normal_(std=0.1 * width**-0.5)
    wide.out_proj.bias.copy_(narrow.out_proj.bias)
    if narrow.target_tokens is not None:
        reader, wide_reader = narrow.target_tokens, wide.target_tokens
        wide_reader.norm_weight.copy_(reader.norm_weight)
        wide_reader.norm_bias.copy_(reader.norm_bias)
        wide_reader.proj_weight[:d] = reader.proj_weight
        wide_reader.proj_bias[:d] = reader.proj_bias
    if narrow.depth_matched is not None:
        wide.depth_matched.load_state_dict(narrow.depth_matched.state_dict())
    if narrow.local_context is not None:
        wide.local_context.weight[:, :d, :d] = narrow.local_context.weight


class PerLayerProjector(nn.Module):
    """Baseline in the style of Cache-to-Cache: for each target layer, one MLP over the concatenated keys and
    values of one source layer (picked by relative depth). No router, no mixture, no cross-layer reading.

    `expert_hidden_size` is the MLP width; pick it so the parameter count matches the mixture it is compared
    with (`benchmarks/results/ablations_pipeline.sh` does).
    """

    def __init__(self, config: MoTConfig, source: KVLayout, target: KVLayout):
        super().__init__()
        start, count = config.produced_layer_range()
        n_source, n_target = source.num_layers, target.num_layers
        self.source_layers = [
            depth_matched_source_layers(n_source, layer, n_target, 1)[0] for layer in range(start, start + count)
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


def _read_model_card(name_or_path, kwargs: dict) -> str | None:
    """The `README.md` next to the weights, or `None`."""
    from transformers.utils import cached_file

    options = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
    path = cached_file(
        str(name_or_path), "README.md", _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False, **options,
    )
    return Path(path).read_text(encoding="utf-8") if path else None


def _render_default_card(translator: MoTTranslator, repo_id: str) -> str | None:
    # Imported by name so that the self-contained modeling files (trust_remote_code) do not need model_card.py.
    try:
        model_card = importlib.import_module("hf_mot.model_card")
    except ImportError:
        return None
    parameters = sum(p.numel() for p in translator.parameters())
    return str(model_card.render_model_card(translator.config, repo_id, parameters=parameters))


def write_text_atomically(path: str, text: str) -> None:
    with tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path) or ".", delete=False, suffix=".tmp",
                                     encoding="utf-8") as tmp:
        tmp.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp.name, 0o666 & ~umask)  # temporary files are private; the card is not
    os.replace(tmp.name, path)


def write_json_atomically(path: str | os.PathLike, report: dict) -> None:
    """Write `report` as indented JSON through a temporary file, creating the folder; a killed run leaves the
    previous file whole."""
    os.makedirs(os.path.dirname(os.fspath(path)) or ".", exist_ok=True)
    write_text_atomically(os.fspath(path), json.dumps(report, indent=2, default=float))


# What `push_to_hub` takes besides the repo id, and what `save_pretrained(push_to_hub=True, ...)` hands on to it.
PUSH_OPTIONS = ("commit_message", "commit_description", "private", "token", "revision", "create_pr", "tags")


def _upload_folder(folder: str, repo_id: str, *, token=None, private=None, revision=None, commit_message=None,
                   commit_description=None, create_pr=False, tags=None):
    from huggingface_hub import HfApi, ModelCard

    card_path = os.path.join(folder, "README.md")
    if tags and os.path.exists(card_path):
        card = ModelCard.load(card_path)
        card.data.tags = sorted(set(card.data.tags or []) | set(tags))
        write_text_atomically(card_path, str(card))
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(
        repo_id=repo_id, folder_path=folder, revision=revision, commit_message=commit_message or "Upload translator",
        commit_description=commit_description, create_pr=create_pr,
    )


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
            self.key_mixture = KVMixture(config, source, target)
            self.value_mixture = KVMixture(config, source, target)
        start, count = config.produced_layer_range()
        self.produced_layers = list(range(start, start + count))
        self.model_card: str | None = None  # the card it was loaded with; `save_pretrained` writes it back
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
        model.model_card = _read_model_card(pretrained_model_name_or_path, kwargs)
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
        super().save_pretrained(save_directory, *args, **kwargs)
        if kwargs.get("is_main_process", True):
            card = model_card if model_card is not None else self.model_card
            if card is None:
                card = _render_default_card(self, repo_id or os.path.basename(os.path.normpath(save_directory)))
            if card is not None:
                write_text_atomically(os.path.join(save_directory, "README.md"), str(card))
        if push_to_hub:
            return _upload_folder(save_directory, repo_id or os.path.basename(os.path.normpath(save_directory)),
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
            return _upload_folder(folder, repo_id, token=token, private=private, revision=revision,
                                  commit_message=commit_message or "Upload MoT translator",
                                  commit_description=commit_description, create_pr=create_pr, tags=tags)

    def widened(
        self, hidden_size: int | None = None, expert_hidden_size: int | None = None, seed: int | None = None
    ) -> MoTTranslator:
        """A copy of this mixture translator with a larger `hidden_size` and/or `expert_hidden_size` that starts
        as this one (see [`widen_mixture`]): more capacity without starting training over. `seed` seeds the
        added units' random weights, so a training run's start can be rebuilt from its recorded seed."""
        if self.config.architecture != "mixture":
            raise ValueError("Only mixture translators can be widened, not the per-layer baseline.")
        if seed is not None:
            torch.manual_seed(seed)
        config = copy.deepcopy(self.config)
        config.hidden_size = hidden_size or config.hidden_size
        config.expert_hidden_size = expert_hidden_size or config.expert_hidden_size
        wide = MoTTranslator(config).to(self.dtype)
        for name in ("key_mixture", "value_mixture"):
            widen_mixture(getattr(self, name), getattr(wide, name), config.initializer_range)
        return wide

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, KVMixture):
            module.reset_parameters(identity=self.config.init == "identity", std=self.config.initializer_range)
        elif isinstance(module, (TargetTokenReader, DepthMatchedPath, LocalTokenMixer, LayerMLPs)):
            module.reset_parameters()
        elif isinstance(module, PerLayerProjector):
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
            last_tokens (`list[int | None]`, *optional*): per produced layer, produce only its last that many
                target tokens (`None`: all). In `full` mode a sliding-window layer of the target keeps only its
                last `sliding_window - 1` context tokens, so `build_translated_cache` asks for those only: on
                long contexts that skips most of the work.
        """
        if last_tokens is not None and len(last_tokens) != len(self.produced_layers):
            raise ValueError(
                f"`last_tokens` needs one entry per produced layer ({len(self.produced_layers)}), got "
                f"{len(last_tokens)}."
            )
        target = self.target_layout
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

        def features(states):
            # Token-major `(batch, tokens, layers, heads * dim)`: every layer of a token in a row.
            if isinstance(states, (list, tuple)):
                states = torch.stack([layer.transpose(1, 2) for layer in states], dim=2)
            return cast(states.flatten(-2), self.dtype)

        def heads(block):
            # (batch, tokens, layers, heads * dim) -> (layers, batch, heads, tokens, dim)
            return block.unflatten(-1, (target.num_kv_heads, target.head_dim)).permute(2, 0, 3, 1, 4)

        first = self.produced_layers[0]
        if self.config.architecture == "per_layer":
            keys, values = self.projector(features(source_keys), features(source_values), alignment)
            key_blocks, value_blocks, block_layers = [], [], []
            for last, indices in _groups(last_tokens, len(self.produced_layers)):
                pick = [keys[i] for i in indices], [values[i] for i in indices]
                key_block, value_block = (torch.stack(p, dim=2) for p in pick)
                if last is not None:
                    key_block, value_block = key_block[:, -last:], value_block[:, -last:]
                key_blocks.append(heads(key_block))
                value_blocks.append(heads(value_block))
                block_layers.append([first + i for i in indices])
            return MoTOutput(key_blocks=key_blocks, value_blocks=value_blocks, block_layers=block_layers,
                             aux_loss=key_blocks[0].new_zeros(()))
        keys, key_balance = self.key_mixture(features(source_keys), alignment, target_embeddings, last_tokens)
        values, value_balance = self.value_mixture(features(source_values), alignment, target_embeddings, last_tokens)
        return MoTOutput(
            key_blocks=[heads(block) for _, block in keys],
            value_blocks=[heads(block) for _, block in values],
            block_layers=[[first + i for i in indices] for indices, _ in keys],
            aux_loss=(key_balance + value_balance) / 2,
        )

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
