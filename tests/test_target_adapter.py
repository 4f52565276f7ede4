"""The target adapter (`hf_mot.target_adapter`): a LoRA on the target's query projections in the dedicated layers,
trained with their maps, active only while the target reads a translated cache. Tiny models."""

import copy
import warnings

import pytest
import torch
from conftest import CONTEXTS, tiny_model
from test_layer_fit import FULL, _pair_translator

from hf_mot import MoTTranslator, translate_context
from hf_mot.fingerprint import weights_fingerprint
from hf_mot.training.layer_fit import fit_dedicated_layers, with_dedicated_layers


@pytest.fixture(scope="module")
def fitted():
    source, target, translator, char, bpe = _pair_translator()
    translator = with_dedicated_layers(translator, FULL, [0, 1], key_norm=True)
    ids = torch.tensor([[2, 5, 7, 11, 13, 3, 4]])
    with torch.no_grad():
        before = target(input_ids=ids).logits
    fingerprint = weights_fingerprint(target)
    report = fit_dedicated_layers(translator, source, char, target, bpe, pairs=12, validation_pairs=4,
                                  context_words=(20, 40), epochs=3, learning_rate=1e-3, target_lora_rank=4,
                                  adapter_learning_rate=1e-2, progress=False)
    return dict(source=source, target=target, translator=translator, char=char, bpe=bpe, ids=ids, before=before,
                fingerprint=fingerprint, report=report)


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_fit_trains_an_adapter_and_leaves_the_target_as_it_was(fitted):
    target, translator, report = fitted["target"], fitted["translator"], fitted["report"]
    assert report["target_lora_rank"] == 4
    loss = {stage: report[stage]["kl"][0] + report[stage]["output_error"][0] for stage in ("without", "distilled")}
    assert loss["distilled"] < 0.9 * loss["without"]
    adapter = translator.target_adapter
    assert adapter is not None and translator.config.target_adapter == "target_adapter"
    lora_b = [v for k, v in adapter.state_dict.items() if "lora_B" in k]
    assert lora_b and all(torch.count_nonzero(v) > 0 for v in lora_b)  # trained away from its zero start
    # Outside `adapt_target` the target computes exactly what it did before the fit, and has the same fingerprint.
    torch.testing.assert_close(_logits(target, fitted["ids"]), fitted["before"], rtol=0, atol=0)
    assert weights_fingerprint(target) == fitted["fingerprint"]
    with translator.adapt_target(target):
        adapted = _logits(target, fitted["ids"])
    assert not torch.allclose(adapted, fitted["before"])
    torch.testing.assert_close(_logits(target, fitted["ids"]), fitted["before"], rtol=0, atol=0)


def test_adapter_saves_as_a_standard_peft_adapter(fitted, tmp_path):
    from peft import PeftModel

    target, translator, ids = fitted["target"], fitted["translator"], fitted["ids"]
    translator.save_pretrained(tmp_path / "t")
    assert sorted(p.name for p in (tmp_path / "t" / "target_adapter").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"]
    loaded = MoTTranslator.from_pretrained(tmp_path / "t")
    assert loaded.target_adapter.name == translator.target_adapter.name
    with translator.adapt_target(target):
        expected = _logits(target, ids)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with loaded.adapt_target(target):
            torch.testing.assert_close(_logits(target, ids), expected)
    assert not [w for w in caught if "other weights" in str(w.message)]  # the same target, adapter or not
    # PEFT itself loads it onto a fresh copy of the target, with the same effect.
    bare = tiny_model("gemma3", seed=1)  # the target as `_pair_translator` makes it
    with warnings.catch_warnings():
        # PEFT 0.21 (the newest on this index) reads a property transformers 5.25 deprecates.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
        peft_model = PeftModel.from_pretrained(bare, str(tmp_path / "t" / "target_adapter"))
    torch.testing.assert_close(_logits(peft_model, ids), expected, atol=1e-5, rtol=1e-5)


def test_missing_or_corrupted_adapter_files_are_refused(fitted, tmp_path):
    fitted["translator"].save_pretrained(tmp_path / "t")
    weights = tmp_path / "t" / "target_adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match="corrupted or truncated"):
        MoTTranslator.from_pretrained(tmp_path / "t")
    weights.unlink()
    with pytest.raises(OSError, match="target_adapter/adapter_model.safetensors is missing"):
        MoTTranslator.from_pretrained(tmp_path / "t")


def test_recomputed_tail_reads_with_the_adapter(fitted):
    """The target's own reading of the tail attends to the translated tokens, so the adapter is on for it: the
    tail's states above the adapted layer change with it, and nothing else does."""
    models = dict(source_model=fitted["source"], source_tokenizer=fitted["char"], target_model=fitted["target"],
                  target_tokenizer=fitted["bpe"])
    translator = fitted["translator"]
    plain = copy.deepcopy(translator)
    plain.attach_target_adapter(None)
    with_adapter = translate_context(CONTEXTS[0], translator=translator, recompute=0.5, **models)
    without = translate_context(CONTEXTS[0], translator=plain, recompute=0.5, **models)
    assert with_adapter.target_adapter is translator.target_adapter and without.target_adapter is None
    tail = with_adapter.native_tokens
    assert tail > 0
    for index, (a, b) in enumerate(zip(with_adapter.layers, without.layers, strict=True)):
        torch.testing.assert_close(a.keys[..., :-tail, :], b.keys[..., :-tail, :])
        # Layer FULL[0] 's own keys come before its attention; the layers after it read its adapted output.
        assert torch.equal(a.values[..., -tail:, :], b.values[..., -tail:, :]) == (index <= FULL[0])


def test_vllm_store_refuses_a_translator_with_an_adapter(fitted, tmp_path):
    from hf_mot.integrations.vllm_store import write_store_entries

    with pytest.raises(ValueError, match="target adapter"):
        write_store_entries(tmp_path, CONTEXTS[0], translator=fitted["translator"], source_model=fitted["source"],
                            source_tokenizer=fitted["char"], target_model=fitted["target"],
                            target_tokenizer=fitted["bpe"])
    assert not any(tmp_path.iterdir())
