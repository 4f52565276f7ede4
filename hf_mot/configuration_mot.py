"""Configuration of a Mixture-of-Translators KV-cache translator."""

from __future__ import annotations

from transformers import PretrainedConfig

from .kv import KVLayout

INITS = ("random", "identity")
ARCHITECTURES = ("mixture", "per_layer")


def check_recompute(recompute, name: str = "`recompute`") -> float:
    """`recompute` as a float in [0, 1], or a `TypeError`/`ValueError` that says what it must be."""
    if isinstance(recompute, bool) or not isinstance(recompute, (int, float)):
        raise TypeError(f"{name} must be a number in [0, 1], got {type(recompute).__name__} {recompute!r}.")
    if not 0.0 <= recompute <= 1.0:  # also refuses NaN
        raise ValueError(
            f"{name} must be in [0, 1] (0: pure translation, 1: the target reads the whole context itself), "
            f"got {recompute!r}."
        )
    return float(recompute)


# Options of earlier versions that changed what a translator computes. A config that uses them describes a
# translator this version would run differently, so it is refused rather than loaded with them ignored.
REMOVED_OPTIONS = {
    "injection_mode": ("full", "window mode (translated layers injected into the target's own pass over the "
                       "context) contains a full prefill and cannot be faster than one"),
    "local_context_tokens": (0, "the local token mixer never improved held-out fidelity"),
    "layer_mlp_layers": (None, "per-layer MLPs never shipped"),
}
# Their companions, which only meant something with a removed option turned on.
IGNORED_OPTIONS = ("injection_start", "injection_layers", "layer_mlp_size")


def _refuse_removed_options(kwargs: dict) -> None:
    for name, (harmless, why) in REMOVED_OPTIONS.items():
        value = kwargs.pop(name, harmless)
        if value != harmless and value != []:
            raise ValueError(
                f"`{name}={value!r}` is no longer supported: {why}. Retrain the translator without it "
                f"(`hf-mot train`), or load it with the hf_mot version that trained it."
            )
    for name in IGNORED_OPTIONS:
        kwargs.pop(name, None)


class MoTConfig(PretrainedConfig):
    r"""
    Configuration of a [`MoTTranslator`], which maps one model's KV cache (the source) into another's (the target).

    Args:
        source (`dict`): the source model's cache layout and identity, as recorded by [`KVLayout`]
            (model type, depth, KV heads, head dim, vocab size, tokenizer fingerprint, ...).
        target (`dict`): the same for the target model.
        hidden_size (`int`, *optional*, defaults to 256): width of the translator's token representation (the
            source's stacked per-layer features are projected to it, and the target's are projected from it).
        expert_hidden_size (`int`, *optional*, defaults to 512): inner width of each expert MLP.
        num_experts (`int`, *optional*, defaults to 4): translator experts per mixture (keys and values each
            have their own mixture).
        num_experts_per_token (`int`, *optional*, defaults to 2): experts the router picks for each token (top-k
            softmax gating).
        init (`str`, *optional*, defaults to `"random"`): `"identity"` builds the exact identity translator,
            which only makes sense with the same model on both sides (the oracle of the test suite).
        initializer_range (`float`, *optional*, defaults to 0.02): std of the random weight init.
        target_embedding_size (`int`, *optional*): the target's input-embedding width. When set, each mixture
            also reads the target's own embedding of every target token (computed by the target model at
            translation time, nothing stored). The target's lower layers depend mostly on the token itself,
            which the cross-tokenizer alignment blurs. `from_models` sets it unless `target_tokens=False`.
        depth_matched_layers (`int`, *optional*, defaults to 0): when > 0, each produced target layer also gets a
            linear map of its own from this many source layers at the same relative depth, added to the
            mixture's output. The shared `hidden_size` representation caps the rank of all produced layers
            together; this path lifts the cap (it matters for values, which are high-rank across layers).
        dedicated_layers (`list[int]`, *optional*): target layers that get a linear map of their own, from the
            `dedicated_source_layers` (aligned to target tokens) and, when the mixtures read target tokens, the
            target's embedding of each token; added to the mixture's output. Meant for the layers retrieval lives
            in, such as Gemma 3's full-attention layers: the shared representation does not carry them well
            enough (`hf-mot fit-layers` fits these maps).
        dedicated_source_layers (`list[int]`, *optional*): the source layers the dedicated maps read. Required
            with `dedicated_layers`.
        dedicated_key_norm (`bool`, *optional*, defaults to `False`): RMS-normalise the keys of the dedicated
            layers per head, as a target with a key norm (Gemma 3, Qwen 3) does to its own keys before scaling
            them. A least-squares fit of keys shrinks them toward their mean, which flattens the target's
            attention; normalising undoes the shrinkage.
        dedicated_bottom_layers (`int`, *optional*): the dedicated maps read the target's own residual stream
            entering this layer (RMS-normalised) in place of its token embedding. The target computes it by reading
            the context through its layers below (`translate_context(..., strategy="bottom")`, which then also
            caches its own keys and values there and in this layer), so every dedicated layer must lie above it.
            What the target's bottom layers gathered from the context is what its full-attention layers above
            retrieve with; the embedding of a token alone does not carry it.
        dedicated_previous_tokens (`int`, *optional*, defaults to 0): the dedicated maps also read the target's
            embeddings of this many tokens before each token. A key that a later copy of the text before it must
            find (the name before a fact, found again by the question's name) carries that earlier token, which
            the target's own bottom layers put there and a map of one token's source states reaches only through
            the other model's vocabulary. Needs `target_embedding_size`, and not `dedicated_bottom_layers`, whose
            residual stream carries the tokens before already.
        dedicated_previous_tokens_keys_only (`bool`, *optional*, defaults to `False`): only the key maps read the
            tokens before; the value maps read each token alone. Retrieval finds a fact through the keys, and it is
            the keys that carry the token before; the values cost as many inputs again for little.
        target_adapter (`str`, *optional*): the subfolder of the translator's folder or repo that holds a PEFT LoRA
            adapter for the target's query projections in the dedicated layers, trained with their maps
            (`hf-mot fit-layers --target-lora-rank`). It is active only while the target reads a translated cache
            (`MoTTranslator.adapt_target`).
        recompute (`float`, *optional*, defaults to 0.0): the share of a native prefill's compute that
            `translate_context(..., recompute=None)` lets the target spend reading part of the context itself (see
            `translate_context`): the translator's recommended point of its speed/quality curve. 0 is pure
            translation, until a curve measured for this translator says otherwise.
        architecture (`str`, *optional*, defaults to `"mixture"`): `"mixture"` is the Mixture of Translators;
            `"per_layer"` is the Cache-to-Cache-style baseline (one MLP per target layer over one source layer's
            keys and values, `expert_hidden_size` wide; no router).

    Example:

    ```python
    >>> from transformers import AutoConfig
    >>> from hf_mot import MoTConfig
    >>> config = MoTConfig.from_models(source_config, target_config, num_experts=4)
    >>> config.target["num_layers"]
    18
    ```
    """

    model_type = "mot"

    source: dict | None = None
    target: dict | None = None
    hidden_size: int = 256
    expert_hidden_size: int = 512
    num_experts: int = 4
    num_experts_per_token: int = 2
    init: str = "random"
    architecture: str = "mixture"
    initializer_range: float = 0.02
    target_embedding_size: int | None = None
    depth_matched_layers: int = 0
    dedicated_layers: list[int] | None = None
    dedicated_source_layers: list[int] | None = None
    dedicated_key_norm: bool = False
    dedicated_bottom_layers: int | None = None
    dedicated_previous_tokens: int = 0
    dedicated_previous_tokens_keys_only: bool = False
    target_adapter: str | None = None
    recompute: float = 0.0

    def __post_init__(self, **kwargs):
        _refuse_removed_options(kwargs)
        super().__post_init__(**kwargs)
        check_recompute(self.recompute, "`recompute`")
        for name, allowed in (
            ("init", INITS),
            ("architecture", ARCHITECTURES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)!r}.")
        if self.depth_matched_layers < 0:
            raise ValueError(f"`depth_matched_layers` must be >= 0 (0: off), got {self.depth_matched_layers}.")
        for name in ("hidden_size", "expert_hidden_size", "num_experts", "num_experts_per_token"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"`num_experts_per_token` ({self.num_experts_per_token}) must be <= `num_experts` "
                f"({self.num_experts})."
            )
        if self.source is None or self.target is None:
            return
        if self.depth_matched_layers > self.source["num_layers"]:
            raise ValueError(
                f"`depth_matched_layers` ({self.depth_matched_layers}) is more than the source's "
                f"{self.source['num_layers']} layers."
            )
        if self.depth_matched_layers and self.architecture != "mixture":
            raise ValueError(
                "`depth_matched_layers` needs `architecture='mixture'`: the per-layer baseline is depth-matched "
                "already."
            )
        self._check_dedicated_layers()
        if self.target_adapter is not None and not self.dedicated_layers:
            raise ValueError("`target_adapter` needs `dedicated_layers`: it is trained with their maps.")
        if self.target_embedding_size is not None and self.architecture != "mixture":
            raise ValueError(
                "`target_embedding_size` (reading the target's tokens) needs `architecture='mixture'`; the "
                "per-layer baseline reads source KV only. Build it with `target_tokens=False`."
            )
        if self.init == "identity":
            if self.architecture != "mixture":
                raise ValueError("`init='identity'` needs `architecture='mixture'`.")
            self._check_identity_possible()

    def _check_dedicated_layers(self) -> None:
        if not self.dedicated_layers:
            if (self.dedicated_source_layers or self.dedicated_key_norm or self.dedicated_bottom_layers is not None
                    or self.dedicated_previous_tokens or self.dedicated_previous_tokens_keys_only):
                raise ValueError("`dedicated_source_layers`, `dedicated_key_norm`, `dedicated_bottom_layers` and "
                                 "`dedicated_previous_tokens(_keys_only)` need `dedicated_layers`.")
            return
        if self.architecture != "mixture":
            raise ValueError("`dedicated_layers` needs `architecture='mixture'`.")
        if not self.dedicated_source_layers:
            raise ValueError("`dedicated_layers` needs `dedicated_source_layers`: the source layers their maps read.")
        for name, layers, side in (("dedicated_layers", self.dedicated_layers, self.target),
                                   ("dedicated_source_layers", self.dedicated_source_layers, self.source)):
            count = side["num_layers"]
            if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < count for i in layers):
                raise ValueError(f"`{name}` must be layer indices in [0, {count}), got {layers!r}.")
            if len(set(layers)) != len(layers) or list(layers) != sorted(layers):
                raise ValueError(f"`{name}` must be increasing, without repeats, got {layers!r}.")
        previous = self.dedicated_previous_tokens
        if isinstance(previous, bool) or not isinstance(previous, int) or previous < 0:
            raise ValueError(f"`dedicated_previous_tokens` must be a whole number >= 0, got {previous!r}.")
        if self.dedicated_previous_tokens_keys_only and not previous:
            raise ValueError("`dedicated_previous_tokens_keys_only` needs `dedicated_previous_tokens` >= 1.")
        if previous and (self.target_embedding_size is None or self.dedicated_bottom_layers is not None):
            raise ValueError(
                "`dedicated_previous_tokens` needs maps that read the target's token embeddings: "
                "`target_embedding_size` set and no `dedicated_bottom_layers` (whose residual stream carries the "
                "tokens before already)."
            )
        bottom = self.dedicated_bottom_layers
        if bottom is None:
            return
        highest = self.target["num_layers"] - 2
        if isinstance(bottom, bool) or not isinstance(bottom, int) or not 0 < bottom <= highest:
            raise ValueError(f"`dedicated_bottom_layers` must be a layer index in [1, {highest}], got {bottom!r}.")
        if self.target_embedding_size is None:
            raise ValueError("`dedicated_bottom_layers` needs `target_embedding_size`: the residual stream the maps "
                             "read has the width of the target's embeddings.")
        below = [i for i in self.dedicated_layers if i <= bottom]
        if below:
            raise ValueError(
                f"Dedicated layers {below} are not above `dedicated_bottom_layers={bottom}`: the target reads its "
                f"layers 0-{bottom} itself there. Dedicate only layers above it."
            )

    @property
    def source_layout(self) -> KVLayout:
        return KVLayout.from_dict(self.source)

    @property
    def target_layout(self) -> KVLayout:
        return KVLayout.from_dict(self.target)

    def _check_identity_possible(self) -> None:
        source, target = self.source_layout, self.target_layout
        if source.shape_signature() != target.shape_signature():
            raise ValueError(
                "`init='identity'` needs the same model on both sides, got source "
                f"{source.describe()} and target {target.describe()}. Use `init='random'` for a model pair."
            )
        if self.hidden_size != source.num_layers * source.feature_size:
            raise ValueError(
                "`init='identity'` needs `hidden_size` equal to the stacked KV width of all layers "
                f"({source.num_layers * source.feature_size}); got {self.hidden_size}. "
                "`MoTConfig.from_models(cfg, cfg, init='identity')` sets it."
            )

    @classmethod
    def from_models(
        cls,
        source_config: PretrainedConfig,
        target_config: PretrainedConfig,
        *,
        source_tokenizer=None,
        target_tokenizer=None,
        target_tokens: bool = True,
        **options,
    ) -> MoTConfig:
        """Derive a config from the two model configs (and, if given, the tokenizers' fingerprints).

        Args:
            source_config / target_config (`PretrainedConfig`): configs of the source and target models.
            source_tokenizer / target_tokenizer (*optional*): recorded as fingerprints so that the translator
                refuses a tokenizer it was not built for.
            target_tokens (`bool`, defaults to `True`): let the mixtures read the target's embedding of each
                target token (sets `target_embedding_size`). Ignored by the per-layer baseline.
            options: any other [`MoTConfig`] field. With `init="identity"`, `hidden_size` defaults to the
                value the identity needs.
        """
        from .kv import tokenizer_fingerprint

        source = KVLayout.from_config(
            source_config, tokenizer_fingerprint(source_tokenizer) if source_tokenizer is not None else None
        )
        target = KVLayout.from_config(
            target_config, tokenizer_fingerprint(target_tokenizer) if target_tokenizer is not None else None
        )
        if options.get("init") == "identity":
            options.setdefault("hidden_size", source.num_layers * source.feature_size)
        if target_tokens and options.get("architecture", "mixture") == "mixture":
            options.setdefault("target_embedding_size", target_config.get_text_config(decoder=True).hidden_size)
        return cls(source=source.to_dict(), target=target.to_dict(), **options)

    def record_weights(self, source_model, target_model) -> None:
        """Record the fingerprints of the weights the translator is trained with: `check_pair` warns when it is
        used with a model of the same shapes but other weights (see `hf_mot.fingerprint`)."""
        from .fingerprint import weights_fingerprint

        self.source = {**self.source, "weights_fingerprint": weights_fingerprint(source_model)}
        self.target = {**self.target, "weights_fingerprint": weights_fingerprint(target_model)}
