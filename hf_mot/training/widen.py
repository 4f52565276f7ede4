"""Widening a trained translator: more capacity that starts exactly where the trained one is, so training
goes on from it instead of starting over (`hf-mot train --init-from X --hidden-size/--expert-hidden-size`)."""

from __future__ import annotations

import copy

import torch

from ..modeling_mot import KVMixture, MoTTranslator


def widen_translator(
    translator: MoTTranslator, hidden_size: int | None = None, expert_hidden_size: int | None = None,
    seed: int | None = None,
) -> MoTTranslator:
    """A copy of a mixture translator with a larger `hidden_size` and/or `expert_hidden_size` that computes what it
    computes (see [`widen_mixture`]). `seed` seeds the added units' random weights, so that a training run's start
    can be rebuilt from its recorded seed."""
    if translator.config.architecture != "mixture":
        raise ValueError("Only mixture translators can be widened, not the per-layer baseline.")
    if seed is not None:
        torch.manual_seed(seed)
    config = copy.deepcopy(translator.config)
    config.hidden_size = hidden_size or config.hidden_size
    config.expert_hidden_size = expert_hidden_size or config.expert_hidden_size
    wide = MoTTranslator(config).to(translator.dtype)
    for name in ("key_mixture", "value_mixture"):
        widen_mixture(getattr(translator, name), getattr(wide, name), config.initializer_range)
    return wide


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
    if width < d or hidden < h or wide.num_experts != narrow.num_experts or wide.num_layers != narrow.num_layers:
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
