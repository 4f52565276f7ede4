"""Bad input gets a clear error that names the argument and the fix."""

import warnings

import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer, identity_translator, tiny_model
from transformers import DynamicCache

from hf_mot import MoTConfig, MoTTranslator, translate_context
from hf_mot.alignment import encode_contexts
from hf_mot.kv import positions_from_mask
from hf_mot.pipeline import prefill_source, read_into_cache


@pytest.fixture
def pair():
    model, tokenizer = tiny_model("llama"), char_tokenizer()
    return model, tokenizer, identity_translator(model, tokenizer)


def _translate(pair, context=CONTEXTS[0], **overrides):
    model, tokenizer, translator = pair
    kwargs = dict(
        translator=translator, source_model=model, source_tokenizer=tokenizer, target_model=model,
        target_tokenizer=tokenizer,
    )
    kwargs.update(overrides)
    return translate_context(context, **kwargs)


def test_translator_for_another_model_pair(pair):
    other = tiny_model("qwen2")
    with pytest.raises(ValueError, match=r"built for target_model llama .* got qwen2.*Load the translator"):
        _translate(pair, target_model=other)


def test_tokenizer_the_translator_was_not_built_for(pair):
    with pytest.raises(ValueError, match=r"`source_tokenizer` is not the tokenizer this translator was built for"):
        _translate(pair, source_tokenizer=bpe_tokenizer())


def test_cache_from_another_model(pair):
    other = tiny_model("qwen2")  # 3 layers instead of 2
    encoded = encode_contexts(char_tokenizer(), [CONTEXTS[0]])
    with pytest.raises(ValueError, match=r"`source_cache` has 3 layers .* pass the cache that `source_model`"):
        _translate(pair, source_cache=prefill_source(other, encoded))


def test_cache_with_another_batch_size(pair):
    model, tokenizer, _ = pair
    encoded = encode_contexts(tokenizer, [CONTEXTS[0]])
    with pytest.raises(ValueError, match=r"`source_cache` holds a batch of 1 but the context batch is 2"):
        _translate(pair, context=[CONTEXTS[0], CONTEXTS[1]], source_cache=prefill_source(model, encoded))


def test_cache_of_another_context(pair):
    model, tokenizer, _ = pair
    encoded = encode_contexts(tokenizer, [CONTEXTS[1]])
    with pytest.raises(ValueError, match=r"`source_cache` holds \d+ tokens but the source context has \d+"):
        _translate(pair, source_cache=prefill_source(model, encoded))


def test_cache_in_another_dtype(pair):
    model, tokenizer, _ = pair
    cache = prefill_source(model, encode_contexts(tokenizer, [CONTEXTS[0]]))
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.bfloat16(), layer.values.bfloat16()
    with pytest.raises(TypeError, match=r"`source_cache` holds torch.bfloat16 .* `source_model` runs in torch.float"):
        _translate(pair, source_cache=cache)


def test_translator_on_another_device(pair):
    model, tokenizer, translator = pair
    translator = translator.to("meta")
    with pytest.raises(ValueError, match=r"`translator` is on meta but the source cache is on cpu"):
        _translate(pair, translator=translator)


@pytest.mark.parametrize("context", ["", "   \n", []])
def test_empty_context(pair, context):
    with pytest.raises(ValueError, match=r"`context"):
        _translate(pair, context=context)


def test_context_of_wrong_type(pair):
    with pytest.raises(TypeError, match=r"`context` must be a string or a list of strings"):
        _translate(pair, context=42)


def test_context_longer_than_the_target_holds(pair):
    with pytest.raises(ValueError, match=r"`context` is \d+ target tokens long but the target model holds at most"):
        _translate(pair, context="word " * 200)


def test_context_longer_than_the_source_holds():
    """GPT-2 has learned positions (512 here): a context the target holds but the source does not is refused by
    name, where the source's prefill would fail inside its position embedding."""
    source, target = tiny_model("gpt2", seed=1), tiny_model("llama", seed=2)
    source.config.n_positions = 100  # the char tokenizer gives one token per character on both sides
    target.config.max_position_embeddings = 4096
    tokenizer = char_tokenizer()
    translator = MoTTranslator(MoTConfig.from_models(source.config, target.config, hidden_size=16))
    message = r"`context` is 151 source tokens long but the source model holds at most 100: shorten"
    with pytest.raises(ValueError, match=message):
        translate_context("x" * 150, translator=translator, source_model=source, source_tokenizer=tokenizer,
                          target_model=target, target_tokenizer=tokenizer)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_or_inf_in_cache(pair, bad):
    model, tokenizer, _ = pair
    cache = prefill_source(model, encode_contexts(tokenizer, [CONTEXTS[0]]))
    cache.layers[1].values[0, 0, 3, 0] = bad
    with pytest.raises(ValueError, match=r"`source_cache` layer 1 contains NaN or Inf"):
        _translate(pair, source_cache=cache)


def test_sliding_window_cache_that_lost_tokens(pair):
    model, tokenizer = tiny_model("gemma3"), char_tokenizer()
    translator = identity_translator(model, tokenizer)
    encoded = encode_contexts(tokenizer, [CONTEXTS[0]])
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)  # sliding layers keep only the last 7 tokens
    with torch.no_grad():
        model(input_ids=encoded.input_ids, cache=cache, use_cache=True)
    with pytest.raises(ValueError, match=r"sliding-window layer that kept only 7 of the \d+ context tokens"):
        _translate((model, tokenizer, translator), source_cache=cache)


@pytest.mark.parametrize(
    "tail, message",
    [
        (-1, r"`native_tail` must be a whole number of tokens >= 0, got -1"),
        (2.5, r"`native_tail` must be a whole number"),
        (True, r"`native_tail` must be a whole number"),
        (10_000, r"`native_tail=10000` leaves nothing to translate: the context is \d+ target tokens"),
    ],
)
def test_bad_native_tail(pair, tail, message):
    with pytest.raises(ValueError, match=message):
        _translate(pair, native_tail=tail)


def test_identity_init_needs_one_model():
    with pytest.raises(ValueError, match=r"`init='identity'` needs the same model on both sides"):
        MoTConfig.from_models(tiny_model("llama").config, tiny_model("qwen2").config, init="identity")


@pytest.mark.parametrize(
    "option", [dict(injection_mode="window", injection_layers=1), dict(local_context_tokens=2),
               dict(layer_mlp_layers=[1])],
)
def test_configs_of_removed_options_are_refused(pair, option):
    """A config saved with an option this version no longer runs (window mode, the local mixer, layer MLPs) is
    refused by name rather than loaded with it ignored; the harmless values old configs carry still load."""
    model, _, _ = pair
    with pytest.raises(ValueError, match=rf"`{next(iter(option))}=.*` is no longer supported"):
        MoTConfig.from_models(model.config, model.config, **option)
    old = dict(injection_mode="full", injection_start=0, injection_layers=None, local_context_tokens=0,
               layer_mlp_layers=[], layer_mlp_size=512)
    config = MoTConfig.from_models(model.config, model.config, **old)
    assert not any(hasattr(config, name) for name in old)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(num_experts=2, num_experts_per_token=3), r"`num_experts_per_token` \(3\) must be <= `num_experts`"),
        (dict(init="identity", hidden_size=8), r"`init='identity'` needs `hidden_size` equal to"),
    ],
)
def test_config_validation(options, message):
    config = tiny_model("llama").config
    with pytest.raises(ValueError, match=message):
        MoTConfig.from_models(config, config, **options)


def test_config_without_layouts():
    with pytest.raises(ValueError, match=r"MoTConfig.from_models"):
        MoTTranslator(MoTConfig())


def _saved_cache(tmp_path):
    model, tokenizer = tiny_model("gemma3"), char_tokenizer()  # sliding window 8, shorter than the context
    cache = translate_context(CONTEXTS[:2], translator=identity_translator(model, tokenizer), source_model=model,
                              source_tokenizer=tokenizer, target_model=model, target_tokenizer=tokenizer)
    path = tmp_path / "c.safetensors"
    cache.save(path)
    return model, cache, path


def test_translated_cache_load_checks_the_file(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from hf_mot import TranslatedCache

    model, cache, path = _saved_cache(tmp_path)
    loaded = TranslatedCache.load(path, model.config, device="cpu")
    for a, b in zip(loaded.layers, cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and a.get_seq_length() == b.get_seq_length()
    whole = path.read_bytes()
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    broken = tmp_path / "broken.safetensors"
    cases = {
        "truncated": None,
        "shape": {**tensors, "layers.1.keys": tensors["layers.1.keys"][..., :4].contiguous()},
        "missing": {k: v for k, v in tensors.items() if k != "layers.0.values"},
        "nan": {**tensors, "layers.2.values": tensors["layers.2.values"] * float("nan")},
    }
    messages = {"truncated": "truncated or corrupted", "shape": "layer 1 holds keys", "missing": "lacks the keys",
                "nan": "layer 2 contains NaN"}
    for case, content in cases.items():
        if content is None:
            broken.write_bytes(whole[: len(whole) // 2])
        else:
            save_file(content, broken, metadata=metadata)
        with pytest.raises(ValueError, match=messages[case]):
            TranslatedCache.load(broken, model.config)


def test_first_token_states_follow_a_dtype_change():
    """The target's own first-token states are cached per model; moving the model to another dtype in place
    keeps its parameters' ids and versions, and must not keep states computed in the old dtype."""
    from hf_mot.pipeline import _first_token_states

    model = tiny_model("llama")
    before = _first_token_states(model, [5]).keys
    model.to(torch.bfloat16)
    after = _first_token_states(model, [5]).keys
    fresh = _first_token_states(tiny_model("llama").to(torch.bfloat16), [5]).keys
    assert torch.equal(after, fresh) and not torch.equal(before, after)


def test_plots_are_optional(tmp_path, monkeypatch):
    """Without matplotlib (an extra), training checkpoints and evaluation reports are still written, with a
    warning that names the extra, instead of a crash after the work is done."""
    import sys

    from hf_mot.evaluation.report import plot_report
    from hf_mot.training.trainer import write_loss_curve

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.warns(UserWarning, match=r"hf-mot\[bench\]"):
        assert write_loss_curve([{"loss": 1.0, "step": 1}], str(tmp_path)) is None
    with pytest.warns(UserWarning, match=r"hf-mot\[bench\]"):
        assert plot_report({"results": {"long_context": {}}}, tmp_path / "x.png") is None
    assert not list(tmp_path.iterdir())


def test_cli_shows_a_traceback_for_a_type_error(monkeypatch):
    """Past argparse, a TypeError is a bug: `hf-mot` lets it through with its traceback, not as one line."""
    from hf_mot import cli

    def broken(args):
        raise TypeError("a bug")

    monkeypatch.setattr(cli, "_generate", broken)
    with pytest.raises(TypeError, match="a bug"):
        cli.main(["generate", "--context", "x"])
    monkeypatch.setattr(cli, "_generate", lambda args: (_ for _ in ()).throw(ValueError("bad input")))
    assert cli.main(["generate", "--context", "x"]) == 1


def test_right_padded_cache(pair):
    model, tokenizer, _ = pair
    contexts = [CONTEXTS[0], CONTEXTS[1][:30]]
    encoded = encode_contexts(tokenizer, contexts)
    # The same batch padded on the right, as a tokenizer with padding_side="right" gives it.
    order = torch.argsort(1 - encoded.attention_mask, dim=1, stable=True)  # real tokens first, padding last
    ids, mask = encoded.input_ids.gather(1, order), encoded.attention_mask.gather(1, order)
    assert mask[1, -1] == 0
    right = DynamicCache()
    read_into_cache(model, right, ids, mask, positions_from_mask(mask))
    _translate(pair, context=contexts, source_cache=prefill_source(model, encoded))  # left-padded: accepted
    with pytest.raises(ValueError, match=r"`source_cache` row 1 .* right-padded batch"):
        _translate(pair, context=contexts, source_cache=right)


def test_a_model_with_other_weights_is_warned_about(tmp_path):
    """Same shapes, other weights (a base model for its instruct tune): `check_pair` warns, naming the side."""
    model, other, tokenizer = tiny_model("llama"), tiny_model("llama", seed=1), char_tokenizer()
    translator = MoTTranslator(MoTConfig.from_models(model.config, model.config, source_tokenizer=tokenizer,
                                                     target_tokenizer=tokenizer))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        translator.check_pair(model, other)  # nothing recorded: nothing to compare
    translator.config.record_weights(model, model)
    translator.save_pretrained(tmp_path)
    loaded = MoTTranslator.from_pretrained(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded.check_pair(model.to(torch.bfloat16), model)  # the same weights in another dtype
    with pytest.warns(UserWarning, match=r"`target_model` \(tiny-llama\) has other weights .* than the translator"):
        loaded.check_pair(model, other)
