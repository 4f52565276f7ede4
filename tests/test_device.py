"""bfloat16 and GPUs: the identity oracle holds bit for bit in bfloat16 (on the CPU and, where CUDA is present, on
the GPU), and a translation on the GPU equals the CPU's. The CUDA cases are skipped, saying why, without a GPU."""

import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer, identity_translator, tiny_model
from transformers import DynamicCache

from hf_mot import MoTConfig, MoTTranslator, translate_context
from hf_mot._compat import cache_kwarg
from hf_mot.alignment import encode_contexts
from hf_mot.pipeline import read_into_cache

CUDA = pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none here")
)


def _native_cache(model, tokenizer, contexts):
    encoded = encode_contexts(tokenizer, contexts, model.device)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        read_into_cache(model, cache, encoded.input_ids, encoded.attention_mask, encoded.position_ids)
    return cache, encoded.attention_mask


def _continue(model, tokenizer, cache, mask):
    prompt = tokenizer([" Question: what? Answer:"] * mask.shape[0], return_tensors="pt", add_special_tokens=False)
    ids = prompt.input_ids.to(model.device)
    full_mask = torch.cat([mask, torch.ones_like(ids)], dim=1)
    out = model.generate(input_ids=ids, attention_mask=full_mask, max_new_tokens=16, do_sample=False,
                         **{cache_kwarg(model): cache})
    return out[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bfloat16_identity_oracle_is_exact(family, device):
    """Models in bfloat16, the identity translator in float32: the translated cache is the native one (RoPE and
    the key norm are undone and redone in float32, so at most a rare element where rotation cancels lands one
    bfloat16 step away), and generate() continues from it alike."""
    model, tokenizer = tiny_model(family).to(device=device, dtype=torch.bfloat16), char_tokenizer()
    translator = identity_translator(model, tokenizer).to(device)
    contexts = CONTEXTS[:3]
    translated = translate_context(contexts, translator=translator, source_model=model, source_tokenizer=tokenizer,
                                   target_model=model, target_tokenizer=tokenizer)
    native, mask = _native_cache(model, tokenizer, contexts)
    for ours, theirs in zip(translated.layers, native.layers, strict=True):
        assert ours.keys.dtype == torch.bfloat16 and ours.get_seq_length() == theirs.get_seq_length()
        assert torch.equal(ours.values, theirs.values)
        differ = ours.keys != theirs.keys
        assert differ.float().mean() < 1e-3
        # Within a bfloat16 step (8 significant bits) of the largest channel of its head: RoPE mixes channels.
        step = theirs.keys.float().abs().amax(dim=-1, keepdim=True) * 2**-8
        assert ((ours.keys.float() - theirs.keys.float()).abs() <= step)[differ].all()
    assert _continue(model, tokenizer, translated, translated.attention_mask) == _continue(model, tokenizer, native,
                                                                                           mask)


def _random_pair(device, dtype):
    source, target = tiny_model("llama", seed=3), tiny_model("gemma3", seed=4)
    config = MoTConfig.from_models(source.config, target.config, hidden_size=16, depth_matched_layers=1,
                                   target_embedding_size=target.config.hidden_size)
    torch.manual_seed(5)
    translator = MoTTranslator(config).eval()
    with torch.no_grad():  # trained-looking: every path writes something
        for param in translator.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return [m.to(device=device, dtype=dtype) for m in (source, target, translator)]


def _translated(device, dtype, contexts):
    source, target, translator = _random_pair(device, dtype)
    return translate_context(contexts, translator=translator, source_model=source, source_tokenizer=bpe_tokenizer(),
                             target_model=target, target_tokenizer=char_tokenizer())


@pytest.mark.parametrize("device", [CUDA])
def test_translation_on_the_gpu_matches_the_cpu(device):
    """A padded batch across Gemma 3's sliding window, every optional path of the mixture on: float32 on the GPU
    within float32 rounding of the CPU, bfloat16 within bfloat16's."""
    contexts = [CONTEXTS[0] + " " + CONTEXTS[1], CONTEXTS[2]]
    reference = _translated("cpu", torch.float32, contexts)
    for dtype, tolerance in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        ours = _translated(device, dtype, contexts)
        for a, b in zip(ours.layers, reference.layers, strict=True):
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert x.dtype == dtype and x.device.type == device
                assert (x.float().cpu() - y).norm() <= tolerance * y.norm()
