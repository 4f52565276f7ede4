"""MoTPair: a translator with the two models it translates between, given once."""

from __future__ import annotations

import torch
from transformers import Cache, PreTrainedModel, PreTrainedTokenizerBase

from ._compat import cache_kwarg
from .cache import TranslatedCache
from .modeling_mot import MoTTranslator
from .models import load_model
from .pipeline import translate_context


def _model_and_tokenizer(spec, side: str, dtype: torch.dtype):
    """`spec` is a name to load, a `(model, tokenizer)` pair, or `None` for the model the translator records."""
    if isinstance(spec, tuple):
        if len(spec) != 2 or not isinstance(spec[0], PreTrainedModel) or not isinstance(
            spec[1], PreTrainedTokenizerBase
        ):
            raise TypeError(f"`{side}` must be a name or path, or a (model, tokenizer) pair; got {spec!r:.80}.")
        return spec
    if spec is not None:
        return load_model(spec, dtype=dtype)
    return None


class MoTPair:
    r"""
    A translator and its source and target models, so that each call names them once.

    Args:
        translator ([`MoTTranslator`]): a translator built for this (source, target) pair.
        source_model / source_tokenizer: the model that reads the context.
        target_model / target_tokenizer: the model that continues from the translated cache.

    Example:

    ```python
    >>> from hf_mot import MoTPair
    >>> pair = MoTPair.from_pretrained("hf-mot/smollm2-135m-to-gemma3-270m")  # loads the models it records
    >>> pair.generate("The Eiffel Tower was built for the 1889 World's Fair in Paris.",
    ...               " Question: What was built for the fair? Answer:", max_new_tokens=8)
    ' The Eiffel Tower.'
    ```

    `translate_context(context, translator=..., source_model=..., ...)` is the functional form of
    `pair.translate(context)`.
    """

    def __init__(
        self,
        translator: MoTTranslator,
        source_model: PreTrainedModel,
        source_tokenizer: PreTrainedTokenizerBase,
        target_model: PreTrainedModel,
        target_tokenizer: PreTrainedTokenizerBase,
    ):
        translator.check_pair(source_model, target_model, source_tokenizer, target_tokenizer)
        self.translator = translator.eval()
        self.source_model, self.source_tokenizer = source_model, source_tokenizer
        self.target_model, self.target_tokenizer = target_model, target_tokenizer

    @classmethod
    def from_pretrained(
        cls, translator, *, source=None, target=None, dtype: torch.dtype = torch.float32, **kwargs
    ) -> MoTPair:
        """Load a translator (a folder, a Hub repo id or a [`MoTTranslator`]) and the models it translates between.

        `source` and `target` are each a name or path for `load_model`, a `(model, tokenizer)` pair already
        loaded, or `None` (the default): the model the translator's config records. `dtype` is the models'
        dtype; other keyword arguments go to `MoTTranslator.from_pretrained`.
        """
        name = str(translator) if not isinstance(translator, MoTTranslator) else translator.name_or_path
        if not isinstance(translator, MoTTranslator):
            translator = MoTTranslator.from_pretrained(translator, **kwargs)
        loaded = {}
        for side, spec in (("source", source), ("target", target)):
            given = _model_and_tokenizer(spec, side, dtype)
            if given is None:
                recorded = getattr(translator.config, f"{side}_layout").name_or_path
                if not recorded:
                    raise ValueError(f"{name} does not record its {side} model: pass `{side}=NAME_OR_PATH` "
                                     f"(`--{side}` on the command line).")
                try:
                    given = load_model(recorded, dtype=dtype)
                except Exception as error:
                    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                    raise ValueError(
                        f"{name} was built for {side} {recorded!r} (from its config), which does not load here "
                        f"({first_line}): pass `{side}=NAME_OR_PATH` (`--{side}` on the command line)."
                    ) from error
            loaded[side] = given
        return cls(translator, *loaded["source"], *loaded["target"])

    def translate(
        self,
        context: str | list[str],
        *,
        source_cache: Cache | None = None,
        recompute: float | None = None,
        native_tail: int = 0,
    ) -> TranslatedCache:
        """`translate_context` with this pair's translator and models (see there)."""
        return translate_context(
            context, translator=self.translator, source_model=self.source_model,
            source_tokenizer=self.source_tokenizer, target_model=self.target_model,
            target_tokenizer=self.target_tokenizer, source_cache=source_cache, recompute=recompute,
            native_tail=native_tail,
        )

    @torch.no_grad()
    def generate(
        self,
        context: str | list[str] | TranslatedCache,
        prompt: str | list[str],
        *,
        recompute: float | None = None,
        source_cache: Cache | None = None,
        **generate_kwargs,
    ) -> str | list[str]:
        """The target's answer to `prompt` after the context: translated from the source (or a `TranslatedCache`
        already made, which generation extends), decoded without special tokens.

        One context (or a cache of one) and one prompt give a string; a list of contexts, or a cache of several,
        gives a list, with `prompt` for each or one prompt per context. `generate_kwargs` go to
        `target_model.generate` (greedy unless they say otherwise; `max_new_tokens` defaults to 32).
        """
        cache = context if isinstance(context, TranslatedCache) else self.translate(
            context, recompute=recompute, source_cache=source_cache)
        batch = cache.attention_mask.shape[0]
        prompts = [prompt] * batch if isinstance(prompt, str) else list(prompt)
        if len(prompts) != batch:
            raise ValueError(f"`prompt` has {len(prompts)} entries for {batch} contexts: pass one, or one each.")
        tokenizer, model = self.target_tokenizer, self.target_model
        # Prompts are left-padded as the contexts are, so that every row's new tokens start at the same place.
        side, tokenizer.padding_side = tokenizer.padding_side, "left"
        try:
            encoded = tokenizer(prompts, return_tensors="pt", add_special_tokens=False, padding=batch > 1)
        finally:
            tokenizer.padding_side = side
        input_ids = encoded.input_ids.to(model.device)
        mask = torch.cat([cache.attention_mask, encoded.attention_mask.to(cache.attention_mask.device)], dim=1)
        generate_kwargs.setdefault("max_new_tokens", 32)
        generate_kwargs.setdefault("do_sample", False)
        with self.translator.adapt_target(model):
            out = model.generate(input_ids=input_ids, attention_mask=mask.to(model.device), **generate_kwargs,
                                 **{cache_kwarg(model): cache})
        answers = tokenizer.batch_decode(out[:, input_ids.shape[1]:], skip_special_tokens=True)
        return answers[0] if isinstance(prompt, str) and not isinstance(context, list) and batch == 1 else answers
