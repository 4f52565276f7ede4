"""Configuration of a Mixture-of-Translators KV-cache translator."""

from __future__ import annotations

from transformers import PretrainedConfig

from .kv import KVLayout

INJECTION_MODES = ("full", "window")
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
        injection_mode (`str`, *optional*, defaults to `"full"`): `"full"` translates every target layer and
            the target runs no pass over the context; `"window"` translates the layers
            `[injection_start, injection_start + injection_layers)` and the target replays the context through
            its own layers with that window injected.
        injection_start (`int`, *optional*, defaults to 0): first injected target layer in `"window"` mode.
        injection_layers (`int`, *optional*): number of injected target layers in `"window"` mode (defaults to
            a quarter of the target depth, at least one).
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
        local_context_tokens (`int`, *optional*, defaults to 0): when > 0, each target token's representation
            also reads the representations of this many target tokens before it (a causal linear mixer, before
            the router). Otherwise every target token is translated from its own aligned source features only.
        layer_mlp_layers (`list[int]`, *optional*, defaults to `[]`): target layers that each get an MLP of their
            own in each mixture, added to the layer's output. It reads the mixture's shared representation and,
            with `depth_matched_layers`, the depth-matched source features: nonlinear capacity for layers that
            need more than the shared representation gives them (Gemma 3's full-attention layers, the only ones
            that reach past its sliding window). Its output starts at zero.
        layer_mlp_size (`int`, *optional*, defaults to 512): inner width of each of those MLPs.
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
    injection_mode: str = "full"
    injection_start: int = 0
    injection_layers: int | None = None
    init: str = "random"
    architecture: str = "mixture"
    initializer_range: float = 0.02
    target_embedding_size: int | None = None
    depth_matched_layers: int = 0
    local_context_tokens: int = 0
    layer_mlp_layers: list[int] | None = None
    layer_mlp_size: int = 512
    recompute: float = 0.0

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        check_recompute(self.recompute, "`recompute`")
        for name, allowed in (
            ("injection_mode", INJECTION_MODES),
            ("init", INITS),
            ("architecture", ARCHITECTURES),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` must be one of {allowed}, got {getattr(self, name)!r}.")
        for name in ("depth_matched_layers", "local_context_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"`{name}` must be >= 0 (0: off), got {getattr(self, name)}.")
        self.layer_mlp_layers = sorted(self.layer_mlp_layers or [])
        for name in ("hidden_size", "expert_hidden_size", "num_experts", "num_experts_per_token", "layer_mlp_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"`{name}` must be >= 1, got {getattr(self, name)}.")
        if self.num_experts_per_token > self.num_experts:
            raise ValueError(
                f"`num_experts_per_token` ({self.num_experts_per_token}) must be <= `num_experts` "
                f"({self.num_experts})."
            )
        if self.source is None or self.target is None:
            return
        target = self.target_layout
        if self.injection_layers is None and self.injection_mode == "window":
            self.injection_layers = max(1, target.num_layers // 4)
        start, count = self.produced_layer_range()
        if start < 0 or count < 1 or start + count > target.num_layers:
            raise ValueError(
                f"The injection window [{start}, {start + count}) does not fit the target's {target.num_layers} "
                "layers: choose `injection_start` and `injection_layers` inside it."
            )
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
        if self.local_context_tokens and self.architecture != "mixture":
            raise ValueError(
                "`local_context_tokens` needs `architecture='mixture'`: the per-layer baseline reads each token on "
                "its own. Leave it at 0."
            )
        if self.layer_mlp_layers:
            if self.architecture != "mixture":
                raise ValueError("`layer_mlp_layers` needs `architecture='mixture'`. Leave it empty.")
            outside = [layer for layer in self.layer_mlp_layers if not start <= layer < start + count]
            if outside or len(set(self.layer_mlp_layers)) != len(self.layer_mlp_layers):
                raise ValueError(
                    f"`layer_mlp_layers` must name distinct target layers this translator produces "
                    f"([{start}, {start + count})), got {self.layer_mlp_layers}."
                )
        if self.target_embedding_size is not None and self.architecture != "mixture":
            raise ValueError(
                "`target_embedding_size` (reading the target's tokens) needs `architecture='mixture'`; the "
                "per-layer baseline reads source KV only. Build it with `target_tokens=False`."
            )
        if self.init == "identity":
            if self.architecture != "mixture":
                raise ValueError("`init='identity'` needs `architecture='mixture'`.")
            self._check_identity_possible()

    @property
    def source_layout(self) -> KVLayout:
        return KVLayout.from_dict(self.source)

    @property
    def target_layout(self) -> KVLayout:
        return KVLayout.from_dict(self.target)

    def produced_layer_range(self) -> tuple[int, int]:
        """`(first target layer, number of layers)` that this translator produces."""
        if self.injection_mode == "full":
            return 0, self.target["num_layers"]
        return self.injection_start, self.injection_layers

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
