"""Shared fixtures: tiny models built from configs (fast), the real embedded models (session-scoped), and a
Hub-compatible server on loopback."""

import os
import string
import tempfile
import warnings

from hub_server import HubServer

# huggingface_hub reads its endpoint and cache folders when it is imported, so the test Hub starts and the
# environment points at it before anything imports transformers: every Hub call of the session goes to
# 127.0.0.1, and the Hub cache is a fresh temporary folder.
HUB = HubServer().__enter__()
os.environ["HF_ENDPOINT"] = HUB.url
os.environ["HF_HOME"] = tempfile.mkdtemp(prefix="hf_mot_tests_hf_home_")
os.environ["HF_TOKEN"] = "hf_mot_test_token"
os.environ.pop("HF_HUB_OFFLINE", None)

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)

from hf_mot import load_model

CHARS = string.ascii_letters + string.digits + string.punctuation + " \n"
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]
TINY_VOCAB = 320  # room for the byte-level BPE (256 bytes + merges)

CONTEXTS = [
    "The Eiffel Tower is in Paris. It was finished in 1889 for the World's Fair.",
    "Alice has three cats and one dog. The dog is called Rex and it likes to run.",
    "Water boils at 100 degrees Celsius at sea level, and freezes at zero degrees.",
    "Mount Everest is the highest mountain on Earth, on the border of Nepal and China.",
    "In 1969 Neil Armstrong became the first person to walk on the Moon during Apollo 11.",
]


@pytest.fixture(autouse=True)
def _deprecations_are_errors():
    # Like peft: transformers API churn (e.g. renamed cache keywords) should fail loudly in our tests.
    with warnings.catch_warnings():
        warnings.filterwarnings("error", category=FutureWarning, module=r"transformers(\.|$)")
        warnings.filterwarnings("error", category=DeprecationWarning, module=r"transformers(\.|$)")
        yield


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", tokenizer.token_to_id("<bos>"))]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character: a tokenizer for tiny models."""
    vocab = {token: i for i, token in enumerate(SPECIALS + list(CHARS))}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return _wrap(tokenizer)


def bpe_tokenizer() -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained on the test contexts: tokenizes differently from `char_tokenizer`."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(CONTEXTS * 4, trainer=trainer)
    return _wrap(tokenizer)


def tiny_config(family: str):
    common = dict(vocab_size=TINY_VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return LlamaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, **common,
        )
    if family == "qwen2":
        return Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=512, **common,
        )
    if family == "gemma3":
        # A sliding window (8) much shorter than the contexts, and one global layer, as in Gemma 3.
        return Gemma3TextConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            max_position_embeddings=512, **common,
        )
    if family == "gemma3-deep":
        # A full-attention layer above another one, for dedicated maps that read the residual stream below it.
        return Gemma3TextConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            max_position_embeddings=512, **common,
        )
    if family == "smollm3":
        # SmolLM3's NoPE layers: `no_rope_layers[i]` is 0 where layer i caches unrotated keys (here the first).
        return SmolLM3Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, no_rope_layers=[0, 1], max_position_embeddings=512, **common,
        )
    if family == "gpt2":
        return GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=512, **common)
    if family == "opt":
        return OPTConfig(
            hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512,
            word_embed_proj_dim=32, **common,
        )
    raise ValueError(family)


MODEL_CLASSES = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
    "gemma3-deep": Gemma3ForCausalLM,
    "smollm3": SmolLM3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "opt": OPTForCausalLM,
}


def tiny_model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODEL_CLASSES[family](tiny_config(family))
    model.config.name_or_path = f"tiny-{family}"
    return model.eval()


@pytest.fixture(scope="session")
def smollm2():
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def gemma3():
    return load_model("gemma3-270m")


def identity_translator(model, tokenizer, **options):
    from hf_mot import MoTConfig, MoTTranslator

    config = MoTConfig.from_models(
        model.config, model.config, source_tokenizer=tokenizer, target_tokenizer=tokenizer, init="identity", **options
    )
    return MoTTranslator(config)


def native_and_translated(
    model, tokenizer, translator, contexts, prompt, *, native_tail=0, recompute=None, strategy="tail", window=None,
    target=None, target_tokenizer=None, **generate_kwargs
):
    """Generate from native prefill of context + prompt, and from the translated cache + prompt (or, with
    `window=(start, count)`, from the window-injection diagnostic's cache).

    `model` is the source and, unless `target`/`target_tokenizer` are given, the target. Returns the two token
    tensors (new tokens only).
    """
    from hf_mot import translate_context
    from hf_mot._compat import cache_kwarg
    from hf_mot.alignment import encode_contexts
    from hf_mot.evaluation.injection import translate_with_window

    source, source_tokenizer = model, tokenizer
    model, tokenizer = target or model, target_tokenizer or tokenizer
    models = dict(translator=translator, source_model=source, source_tokenizer=source_tokenizer, target_model=model,
                  target_tokenizer=tokenizer)
    if window is None:
        cache = translate_context(contexts, **models, native_tail=native_tail, recompute=recompute, strategy=strategy)
    else:
        cache = translate_with_window(contexts, **models, window=window)
    batch = len(contexts) if isinstance(contexts, list) else 1
    prompt_ids = tokenizer([prompt] * batch, return_tensors="pt", add_special_tokens=False).input_ids.to(model.device)
    context = encode_contexts(tokenizer, contexts if isinstance(contexts, list) else [contexts], model.device)
    full_ids = torch.cat([context.input_ids, prompt_ids], dim=1)
    full_mask = torch.cat([context.attention_mask, torch.ones_like(prompt_ids)], dim=1)
    seed = generate_kwargs.pop("seed", None)
    if seed is not None:
        torch.manual_seed(seed)
    native = model.generate(input_ids=full_ids, attention_mask=full_mask, **generate_kwargs)
    if seed is not None:
        torch.manual_seed(seed)
    translated = model.generate(
        input_ids=prompt_ids, attention_mask=cache.generation_mask(prompt_ids.shape[1]),
        **{cache_kwarg(model): cache}, **generate_kwargs,
    )
    return native[:, full_ids.shape[1]:], translated[:, prompt_ids.shape[1]:]


@pytest.fixture
def hub():
    """The loopback Hub server of this test session (`hub.url`, `hub.state.repos`)."""
    return HUB


# The fixtures that convert or load the embedded models: a test that uses one is a `real_models` test whether or not
# it says so, so that `-m "not real_models"` runs without them.
REAL_MODEL_FIXTURES = {"smollm2", "gemma3", "real_tokenizers"}


def pytest_collection_modifyitems(items):
    for item in items:
        if REAL_MODEL_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.real_models)
