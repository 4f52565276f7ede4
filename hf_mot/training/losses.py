"""Next-token loss and the Context Correction Loss.

The target continues from the translated cache; the same target after reading the context natively is the
teacher. The Context Correction Loss pulls the two trajectories together where the MoT method says they drift:

- per-layer KV from the injection point up (propagated translation shift: an early error grows upward);
- the next-token distributions at the continuation positions (last-state shift: the first tokens after the
  context are bent by errors at the last context position);
- optionally, the target's hidden states at the continuation positions, layer by layer: where the translated
  cache bends the trajectory of the tokens that read it, rather than how far the cache itself is off.

A router load-balancing term keeps all experts in use. The frozen models never receive gradients: the native
side runs under `torch.no_grad()`, and the translated side only lets gradients flow into the translator.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch
from torch.nn import functional as F
from transformers import DynamicCache, PreTrainedModel

from .._compat import cache_kwarg
from ..alignment import EncodedContext
from ..kv import KVLayout, positions_from_mask, read_source_cache
from ..modeling_mot import MoTTranslator
from ..pipeline import fill_translated_cache, read_into_cache, run_translator


@dataclass
class LossWeights:
    """The weight of each loss term; 0 switches a term off (for ablations). `MoTTrainingArguments` inherits these
    fields, so `hf-mot train` takes each as `--NAME` with the help below."""

    nll_weight: float = field(default=1.0, metadata={"help": "weight of the next-token loss on the continuation"})
    kv_weight: float = field(default=1.0, metadata={
        "help": "weight of the Context Correction Loss's per-layer relative KV error against the native cache"})
    kl_weight: float = field(default=1.0, metadata={
        "help": "weight of the KL from the native next-token distributions at the continuation positions"})
    balance_weight: float = field(default=0.01, metadata={"help": "weight of the router load-balancing term"})
    kl_first_weight: float = field(default=1.0, metadata={
        "help": "the KL at the first continuation position counts this many times, the excess halving at each "
        "later position: more weight where last-state shift bends the first generated tokens (1: uniform)"})
    question_nll_weight: float = field(default=1.0, metadata={
        "help": "the next-token loss on question pairs counts this much against the other pairs (0: they train "
        "through the KV and KL terms only, toward the native target's answer rather than the data's)"})
    kv_full_attention_weight: float = field(default=1.0, metadata={
        "help": "inside the KV term, the target's full-attention layers count this much against its "
        "sliding-window layers: only they reach past the window on long contexts (1: every layer alike)"})
    hidden_weight: float = field(default=0.0, metadata={
        "help": "the target's per-layer hidden states at the continuation positions, RMS-normalised, against "
        "native: counts the cache's error where the continuation reads it (0: off)"})

    def __post_init__(self):
        negative = {f.name: getattr(self, f.name) for f in fields(LossWeights) if getattr(self, f.name) < 0}
        if negative:
            raise ValueError(f"Loss weights must be 0 (off) or more, got {negative}.")


@dataclass
class LossParts:
    total: torch.Tensor
    nll: torch.Tensor
    kv: torch.Tensor
    kl: torch.Tensor
    balance: torch.Tensor
    hidden: torch.Tensor

    def detached(self) -> dict[str, float]:
        return {name: getattr(self, name).detach().float().item() for name in LOGGED_PARTS}


# The parts of `LossParts` the trainer logs.
LOGGED_PARTS = ("total", "nll", "kv", "kl", "balance", "hidden")


def _continue(model: PreTrainedModel, cache, context_mask: torch.Tensor, batch: dict, hidden_states: bool = False):
    """Run the continuation through `model` after the cached context; return its output (logits and, with
    `hidden_states`, every layer's hidden states)."""
    mask = torch.cat([context_mask, batch["continuation_mask"]], dim=1)
    positions = context_mask.sum(dim=1, keepdim=True) + torch.arange(
        batch["continuation_ids"].shape[1], device=mask.device
    )
    return model(
        input_ids=batch["continuation_ids"], attention_mask=mask, position_ids=positions, use_cache=True,
        output_hidden_states=hidden_states, **{cache_kwarg(model): cache},
    )


def _trajectory_error(translated: tuple, native: tuple, mask: torch.Tensor) -> torch.Tensor:
    """Mean over layers and real continuation tokens of ||t/rms(t) - n/rms(n)||^2 / width.

    The embeddings (index 0) are the same tokens on both sides and are left out. RMS normalisation is what each
    layer applies to its input first, and keeps the few very large channels of the residual stream from
    swamping the rest."""
    real = mask.bool()
    errors = []
    for t, n in zip(translated[1:], native[1:], strict=True):
        t, n = t[real].float(), n[real].float()
        t = t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)
        n = n * torch.rsqrt(n.pow(2).mean(-1, keepdim=True) + 1e-6)
        errors.append((t - n).pow(2).mean())
    return torch.stack(errors).mean()


def native_context_kv(target_model: PreTrainedModel, batch: dict) -> tuple[DynamicCache, list]:
    # A config-less DynamicCache keeps every token of sliding-window layers, for the per-layer comparison.
    cache = DynamicCache()
    mask = batch["target_attention_mask"]
    read_into_cache(target_model, cache, batch["target_input_ids"], mask, positions_from_mask(mask))
    return cache, [(layer.keys, layer.values) for layer in cache.layers]


def _relative_kv_error(
    translated: list, native: list, mask: torch.Tensor, layer_weights: list[float]
) -> torch.Tensor:
    """Weighted mean over layers of ||translated - native||^2 / ||native||^2 on real context tokens (keys and
    values alike)."""
    real = mask[:, None, :, None].to(native[0][0].dtype)
    errors = []
    for (tk, tv), (nk, nv) in zip(translated, native, strict=True):
        errors.append(sum(((t - n) ** 2 * real).sum() / ((n**2) * real).sum().clamp_min(1e-6)
                          for t, n in ((tk, nk), (tv, nv))) / 2)
    weights = torch.tensor(layer_weights, dtype=errors[0].dtype, device=errors[0].device)
    return (torch.stack(errors) * weights).sum() / weights.sum()


def context_correction_loss(
    translator: MoTTranslator,
    source_model: PreTrainedModel,
    target_model: PreTrainedModel,
    batch: dict,
    weights: LossWeights,
) -> LossParts:
    """All loss terms for one batch from `MoTDataCollator`.

    `translator` may be wrapped (DDP). The next-token loss covers
    continuation tokens 2..n: the first continuation token is predicted from the last context position, which
    the translated cache does not run (a prompt after it does, at generation time).
    """
    # Only the translator learns: the models are frozen here, whoever calls this.
    source_model.requires_grad_(False)
    target_model.requires_grad_(False)
    source_mask, target_mask = batch["source_attention_mask"], batch["target_attention_mask"]
    with torch.no_grad():
        source_cache = DynamicCache()
        read_into_cache(
            source_model, source_cache, batch["source_input_ids"], source_mask, positions_from_mask(source_mask)
        )
        source = read_source_cache(source_cache, source_model, source_mask, positions_from_mask(source_mask))
        native_cache, native_kv = native_context_kv(target_model, batch)
        native_out = (
            _continue(target_model, native_cache, target_mask, batch, hidden_states=bool(weights.hidden_weight))
            if weights.kl_weight or weights.hidden_weight else None
        )

    out = run_translator(
        translator, source, batch["alignment"], target_model, batch["target_input_ids"], target_mask
    )
    target = EncodedContext(batch["target_input_ids"], target_mask, spans=[], special=[])
    cache, translated_kv = fill_translated_cache(out, target_model, target)

    zero = out.aux_loss.new_zeros(())
    layers = sorted(translated_kv)
    # The layout reads the text config, where multimodal targets keep their layer types.
    layer_types = KVLayout.from_config(target_model.config).layer_types
    full = [not layer_types or layer_types[i] == "full_attention" for i in layers]
    # Only a mix of layer types has anything to weigh (and a weight of 0 must not zero the whole term).
    full_weight = weights.kv_full_attention_weight
    layer_weights = [full_weight if f else 1.0 for f in full] if not all(full) else [1.0] * len(full)
    kv = (
        _relative_kv_error([translated_kv[i] for i in layers], [native_kv[i] for i in layers], target_mask,
                           layer_weights)
        if weights.kv_weight
        else zero
    )
    continued = (
        _continue(target_model, cache, target_mask, batch, hidden_states=bool(weights.hidden_weight))
        if weights.nll_weight or weights.kl_weight or weights.hidden_weight else None
    )
    logits = continued.logits if continued is not None else None
    continuation_mask = batch["continuation_mask"][:, 1:].bool()
    nll = zero
    if weights.nll_weight:
        labels = batch["continuation_ids"][:, 1:][continuation_mask]
        per_token = F.cross_entropy(logits[:, :-1][continuation_mask].float(), labels, reduction="none")
        # A weighted mean: at `question_nll` 1 the plain mean; at 0 the mean over the other pairs only.
        question = batch.get("question", torch.zeros(len(continuation_mask), dtype=torch.bool))
        row_weight = torch.where(question.to(per_token.device), weights.question_nll_weight, 1.0)
        token_weight = row_weight[:, None].expand_as(continuation_mask)[continuation_mask]
        nll = (token_weight * per_token).sum() / token_weight.sum().clamp_min(1e-6)
    kl = weighted_kl = zero
    if weights.kl_weight:
        every = batch["continuation_mask"].bool()
        native_logp = native_out.logits[every].float().log_softmax(-1)
        per_token = F.kl_div(
            logits[every].float().log_softmax(-1), native_logp, log_target=True, reduction="none"
        ).sum(-1)
        position = torch.arange(every.shape[1], device=every.device).expand_as(every)[every]
        # The logged KL stays the plain mean over tokens, comparable across runs whatever `kl_first` is.
        kl = per_token.mean()
        weighted_kl = ((1 + (weights.kl_first_weight - 1) * 0.5 ** position.float()) * per_token).mean()
    hidden = (
        _trajectory_error(continued.hidden_states, native_out.hidden_states, batch["continuation_mask"])
        if weights.hidden_weight
        else zero
    )
    total = (weights.nll_weight * nll + weights.kv_weight * kv + weights.kl_weight * weighted_kl
             + weights.balance_weight * out.aux_loss + weights.hidden_weight * hidden)
    return LossParts(total=total, nll=nll, kv=kv, kl=kl, balance=out.aux_loss, hidden=hidden)
