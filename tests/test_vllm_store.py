"""The store of translated caches that vLLM serves (`hf_mot.integrations.vllm_store`); no vLLM needed here.
The connector itself is tested end to end in `test_vllm_connector.py`."""

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from hf_mot import MoTTranslator, translate_context
from hf_mot.integrations.vllm_store import (
    ServedModel,
    StoreEntryError,
    checkpoint_fingerprint,
    entry_name,
    find_entry,
    model_fingerprint,
    read_header,
    read_states,
    write_store_entries,
)
from hf_mot.models import convert_embedded_model

REPO_ID = "hf-mot/smollm2-135m-to-gemma3-270m"
# Longer than Gemma 3's 512-token window, so the sliding-window layers are written past it.
CONTEXT = " ".join(
    f"In {1800 + i} the harbour of Aldmere shipped {i * 7} tonnes of salt to the river towns, and the ledger of that "
    f"year names {i % 5 + 2} new captains." for i in range(24)
)


@pytest.fixture(scope="module")
def written(tmp_path_factory, smollm2, gemma3):
    (source, source_tok), (target, target_tok) = smollm2, gemma3
    translator = MoTTranslator.from_pretrained(REPO_ID).eval()
    # Entries for pure translation: with a recommended recompute of 0, the sliding layers keep their window only.
    translator.config.recompute = 0.0
    store = tmp_path_factory.mktemp("store")
    models = dict(translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
                  target_tokenizer=target_tok)
    (path,) = write_store_entries(store, CONTEXT, **models)
    served = ServedModel(checkpoint_fingerprint(convert_embedded_model("gemma3-270m"), 18), 18, 1, 256)
    return path, served, translate_context(CONTEXT, **models, recompute=0)


def test_entry_holds_what_translate_context_caches(written):
    path, served, cache = written
    header = read_header(path, served)
    states = read_states(header, 18)
    tokens = len(header.token_ids)
    assert tokens == cache.get_seq_length() > 512
    assert path.parent.name == header.metadata["namespace"] and path.parent.name.startswith("hf_mot-")
    for index, (layer, (keys, values)) in enumerate(zip(cache.layers, states, strict=True)):
        # (batch, heads, kept tokens, dim) in the cache; (kept tokens, heads, dim) in the entry.
        kept = tokens if index in (5, 11, 17) else 511
        assert keys.shape == values.shape == (kept, 1, 256) and header.first_positions[index] == tokens - kept
        torch.testing.assert_close(keys, layer.keys[0].transpose(0, 1))
        torch.testing.assert_close(values, layer.values[0].transpose(0, 1))
    # Served at recompute 0 (the translator's recommended value here, the default bound) it serves; a recomputed
    # tail would attend to sliding-window states the entry does not hold.
    assert header.refusal(tokens) is None
    assert "larger max_recompute" in header.refusal(tokens - 1)


def test_an_entry_for_recomputing_holds_what_the_tail_attends_to(smollm2, gemma3, written, tmp_path):
    (source, source_tok), (target, target_tok) = smollm2, gemma3
    _, served, _ = written
    translator = MoTTranslator.from_pretrained(REPO_ID).eval()
    (path,) = write_store_entries(tmp_path, CONTEXT, translator=translator, source_model=source,
                                  source_tokenizer=source_tok, target_model=target, target_tokenizer=target_tok,
                                  max_recompute=0.25)
    header = read_header(path, served)
    tokens = len(header.token_ids)
    tail = int(0.25 * tokens)
    assert header.first_positions == tuple(0 if i in (5, 11, 17) else tokens - 511 - tail for i in range(18))
    assert header.refusal(tokens - tail) is None and header.refusal(tokens - tail - 1) is not None
    # The shipped translator recommends a tail: an entry that could not serve it is refused.
    assert translator.config.recompute > 0
    with pytest.raises(ValueError, match="below the translator's recommended recompute"):
        write_store_entries(tmp_path, CONTEXT, translator=translator, source_model=source,
                            source_tokenizer=source_tok, target_model=target, target_tokenizer=target_tok,
                            max_recompute=translator.config.recompute / 2)
    with pytest.raises(ValueError, match="must be in"):
        write_store_entries(tmp_path, CONTEXT, translator=translator, source_model=source,
                            source_tokenizer=source_tok, target_model=target, target_tokenizer=target_tok,
                            max_recompute=1.5)
    with pytest.raises(ValueError, match="the cache of one context, but 2 contexts"):
        write_store_entries(tmp_path, [CONTEXT, CONTEXT], translator=translator, source_model=source,
                            source_tokenizer=source_tok, target_model=target, target_tokenizer=target_tok,
                            source_cache=DynamicCache())


def test_served_model_fingerprint_matches_the_writer(written, gemma3, smollm2):
    _, served, _ = written
    assert model_fingerprint(gemma3[0].state_dict(), 18) == served.fingerprint
    assert model_fingerprint(smollm2[0].state_dict(), 30) != served.fingerprint
    # Weights in bfloat16 are the same checkpoint; a changed last layer is another revision.
    state = {name: tensor.to(torch.bfloat16) for name, tensor in gemma3[0].state_dict().items()}
    assert model_fingerprint(state, 18) == served.fingerprint
    state["model.layers.17.mlp.down_proj.weight"] = state["model.layers.17.mlp.down_proj.weight"] * 1.01
    assert model_fingerprint(state, 18) != served.fingerprint


def test_find_entry_takes_a_stored_context_that_the_prompt_continues(written):
    path, served, _ = written
    ids = list(read_header(path, served).token_ids)
    store, space = path.parent.parent, path.parent.name
    assert find_entry(store, space, ids + [1, 2]) == path
    assert find_entry(store, space, ids) is None  # the engine must read at least one prompt token itself
    assert find_entry(store, space, ids[:-1] + [ids[-1] + 1, 5]) is None
    assert find_entry(store, "hf_mot-0000000000000000", ids + [1]) is None


@pytest.mark.parametrize("damage", ["other_target", "truncated", "renamed", "other_shape", "not_finite"])
def test_a_bad_entry_is_refused_with_a_reason(written, tmp_path, damage):
    path, served, _ = written
    bad = tmp_path / path.parent.name / path.name
    bad.parent.mkdir()
    shutil.copy(path, bad)
    match = {"other_target": "another model or revision", "truncated": "not a readable safetensors",
             "renamed": "do not match its name", "other_shape": "served model caches",
             "not_finite": "NaN or Inf"}[damage]
    if damage == "other_target":
        served = ServedModel("0123456789abcdef", 18, 1, 256)
    elif damage == "truncated":
        bad.write_bytes(path.read_bytes()[:-1000])
    elif damage == "renamed":
        bad = bad.rename(bad.parent / entry_name([2, 3, 4]))
    elif damage == "other_shape":
        served = ServedModel(served.fingerprint, 18, 2, 128)
    else:
        with safe_open(str(path), framework="pt") as f:
            tensors, metadata = {name: f.get_tensor(name) for name in f.keys()}, f.metadata()
        tensors["layers.3.values"][7, 0, 0] = float("nan")
        save_file(tensors, str(bad), metadata=metadata)
        with pytest.raises(StoreEntryError, match=match):
            read_states(read_header(bad, served), 18)
        return
    with pytest.raises(StoreEntryError, match=match):
        read_header(bad, served)
