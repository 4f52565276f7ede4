"""`MoTConnector` end to end in vLLM's CPU build: one vLLM engine serves every case below (the serving example
starts its own), in vLLM's own environment (`scripts/setup_vllm.sh`). Marked `vllm`: the default run skips it,
`.ci/run` runs it in a step of its own (`pytest -m vllm tests`)."""

import json
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from hf_mot import MoTConfig, MoTTranslator, translate_context
from hf_mot._compat import cache_kwarg
from hf_mot.integrations.vllm_runner import run_in_vllm, vllm_python
from hf_mot.integrations.vllm_store import write_store_entries
from hf_mot.models import convert_embedded_model

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_python() is None, reason="no vLLM environment: run `bash scripts/setup_vllm.sh`"),
]

REPO_ID = "hf-mot/smollm2-135m-to-gemma3-270m"
# Past Gemma 3's 512-token sliding window, so the sliding layers' blocks are written beyond it.
CONTEXT = " ".join(
    f"In {1800 + i} the harbour of Aldmere shipped {i * 7} tonnes of salt to the river towns, and the ledger of that "
    f"year names {i % 5 + 2} new captains." for i in range(24)
)
QUESTION = " Question: How many tonnes of salt did Aldmere ship in 1805? Answer:"
STEPS = 16
TAIL = 0.25


def _rewrite(path, folder, change):
    """A copy of entry `path` in namespace folder `folder` (same file name), its tensors and metadata changed."""
    folder.mkdir(parents=True)
    with safe_open(str(path), framework="pt") as f:
        tensors, metadata = {name: f.get_tensor(name) for name in f.keys()}, dict(f.metadata())
    change(tensors, metadata)
    save_file(tensors, str(folder / path.name), metadata=metadata)
    return folder.name


def _generate(model, cache, question_ids):
    ids = torch.tensor([question_ids])
    out = model.generate(input_ids=ids, attention_mask=cache.generation_mask(ids.shape[1]),
                         **{cache_kwarg(model): cache}, max_new_tokens=STEPS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory, smollm2, gemma3):
    (source, source_tok), (target, target_tok) = smollm2, gemma3
    store = tmp_path_factory.mktemp("store")
    shipped = MoTTranslator.from_pretrained(REPO_ID).eval()
    identity = MoTTranslator(MoTConfig.from_models(target.config, target.config, source_tokenizer=target_tok,
                                                   target_tokenizer=target_tok, init="identity"))
    (own,) = write_store_entries(store, CONTEXT, translator=identity, source_model=target, source_tokenizer=target_tok,
                                 target_model=target, target_tokenizer=target_tok)
    pair = dict(translator=shipped, source_model=source, source_tokenizer=source_tok, target_model=target,
                target_tokenizer=target_tok)
    (entry,) = write_store_entries(store, CONTEXT, **pair, max_recompute=TAIL)
    context_ids = target_tok(CONTEXT).input_ids
    question_ids = target_tok(QUESTION, add_special_tokens=False).input_ids
    prompt = context_ids + question_ids

    def scaled(tensors, metadata):
        for name in tensors:
            if name.endswith(".values"):
                tensors[name] *= -1.0

    def other_target(tensors, metadata):
        metadata["target_fingerprint"] = "0123456789abcdef"

    def not_finite(tensors, metadata):
        tensors["layers.5.keys"][40] = float("nan")

    salts = {
        "scaled": _rewrite(entry, store / "hf_mot-damaged-scaled", scaled),
        "other_target": _rewrite(entry, store / "hf_mot-damaged-target", other_target),
        "not_finite": _rewrite(entry, store / "hf_mot-damaged-nan", not_finite),
    }
    truncated = store / "hf_mot-damaged-cut" / entry.name
    truncated.parent.mkdir()
    truncated.write_bytes(entry.read_bytes()[:-4096])
    salts["truncated"] = truncated.parent.name
    cases = {
        "native": {"prompt_token_ids": prompt},
        "identity": {"prompt_token_ids": prompt, "cache_salt": own.parent.name},
        "shipped": {"prompt_token_ids": prompt, "cache_salt": entry.parent.name,
                    "kv_transfer_params": {"hf_mot_recompute": 0}},
        "shipped_tail": {"prompt_token_ids": prompt, "cache_salt": entry.parent.name,
                         "kv_transfer_params": {"hf_mot_recompute": TAIL}},
        "shipped_default": {"prompt_token_ids": prompt, "cache_salt": entry.parent.name},
        "beyond_max_recompute": {"prompt_token_ids": prompt, "cache_salt": entry.parent.name,
                                 "kv_transfer_params": {"hf_mot_recompute": 0.5}},
        "short_prompt": {"prompt_token_ids": context_ids[:200] + question_ids, "cache_salt": entry.parent.name,
                         "kv_transfer_params": {"hf_mot_entry": str(entry)}},
        "no_salt": {"prompt_token_ids": prompt, "kv_transfer_params": {"hf_mot_entry": str(entry)}},
        "no_entry": {"prompt_token_ids": context_ids[:200] + question_ids, "cache_salt": entry.parent.name},
        # Pure translation, so that every position vLLM reads comes from the damaged entry.
        **{name: {"prompt_token_ids": prompt, "cache_salt": salt, "kv_transfer_params": {"hf_mot_recompute": 0}}
           for name, salt in salts.items()},
    }
    result = run_in_vllm(convert_embedded_model("gemma3-270m"), str(store), list(cases.values()), max_tokens=STEPS)
    outputs = dict(zip(cases, result["outputs"], strict=True))
    expected = {
        "shipped": _generate(target, translate_context(CONTEXT, **pair, recompute=0), question_ids),
        "shipped_tail": _generate(target, translate_context(CONTEXT, **pair, recompute=TAIL), question_ids),
        "recommended": shipped.config.recompute,
    }
    return outputs, expected, len(context_ids), result["log"]


def test_identity_cache_gives_vllms_own_greedy_text(served):
    outputs, _, tokens, _ = served
    assert outputs["native"]["num_cached_tokens"] == [0]
    assert outputs["identity"]["num_cached_tokens"] == [tokens]  # loaded, not prefilled again
    assert outputs["identity"]["token_ids"] == outputs["native"]["token_ids"]


def test_translated_cache_gives_generates_text(served):
    outputs, expected, tokens, log = served
    assert outputs["shipped"]["num_cached_tokens"] == [tokens]
    assert outputs["shipped"]["token_ids"] == expected["shipped"]
    # The dial: vLLM prefills the last quarter of the context itself, attending to the translated head.
    assert outputs["shipped_tail"]["num_cached_tokens"] == [tokens - int(TAIL * tokens)]
    assert outputs["shipped_tail"]["token_ids"] == expected["shipped_tail"]
    # A request that names no recompute gets the translator's recommended tail, recorded in the entry.
    recommended = expected["recommended"]
    assert 0 < recommended <= TAIL
    assert outputs["shipped_default"]["num_cached_tokens"] == [tokens - int(recommended * tokens)]
    # Gemma 3's sliding-window layers run on vLLM's hybrid KV cache manager: only their window is written.
    kept = [int(line.split("(at least ")[1].split()[0]) for line in log if f"loaded {tokens} translated" in line]
    assert kept and all(511 <= k < tokens for k in kept), log


def test_what_is_loaded_decides_the_answer(served):
    outputs, _, tokens, _ = served
    assert outputs["scaled"]["num_cached_tokens"] == [tokens]
    assert outputs["scaled"]["token_ids"] != outputs["native"]["token_ids"]


@pytest.mark.parametrize("case, reason", [
    ("other_target", "another model or revision"),
    ("beyond_max_recompute", "larger max_recompute"),
    ("truncated", "not a readable safetensors file"),
    ("short_prompt", "does not start with"),
    ("no_salt", "cache_salt"),
    ("no_entry", "holds no context that its prompt starts with"),
])
def test_a_bad_entry_falls_back_to_a_normal_prefill(served, case, reason):
    outputs, _, _, log = served
    assert outputs[case]["num_cached_tokens"] == [0]
    if case not in ("short_prompt", "no_entry"):
        assert outputs[case]["token_ids"] == outputs["native"]["token_ids"]
    assert any("prefilled normally" in line and reason in line for line in log), log


def test_values_found_broken_while_loading_are_recomputed(served):
    outputs, _, _, log = served
    assert outputs["not_finite"]["token_ids"] == outputs["native"]["token_ids"]
    assert any("NaN or Inf" in line and "recomputes" in line for line in log), log


def test_the_serving_example_answers_from_the_translated_cache():
    """examples/vllm_serving runs as its docstring says and prints vLLM's own answer beside the translated one."""
    example = Path(__file__).parents[1] / "examples" / "vllm_serving" / "serve_translated_cache.py"
    done = subprocess.run([str(vllm_python()), str(example)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    own, translated = [line for line in done.stdout.splitlines() if "prompt tokens not computed" in line]
    assert own.startswith("vLLM prefills the document") and "(0 of " in own
    assert translated.startswith("from SmolLM2's translated cache") and "Eiffel" in translated
    reused, prompt = map(int, re.search(r"\((\d+) of (\d+) prompt tokens", translated).groups())
    assert 0 < reused < prompt  # the document came from the store, the question was prefilled


# Builds the connector from a vLLM config (no engine, no weights loaded) for each setting it must refuse.
_REFUSED_SETTINGS = """
import json, sys
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from hf_mot.integrations.vllm import MoTConnector

def build(extra={"store": "store"}, policy="recompute", tensor_parallel=1, cache_dtype="auto"):
    kv = KVTransferConfig(kv_connector="MoTConnector", kv_connector_module_path="hf_mot.integrations.vllm",
                          kv_role="kv_consumer", kv_load_failure_policy=policy, kv_connector_extra_config=extra)
    config = VllmConfig(model_config=ModelConfig(model=sys.argv[1], dtype="float32"), kv_transfer_config=kv,
                        cache_config=CacheConfig(cache_dtype=cache_dtype),
                        parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel))
    MoTConnector(config, KVConnectorRole.SCHEDULER, None)

cases = {"no_store": dict(extra={}), "failure_policy": dict(policy="fail"), "tensor_parallel": dict(tensor_parallel=2),
         "fp8_cache": dict(cache_dtype="fp8"), "recompute": dict(extra={"store": "store", "recompute": 2})}
messages = {}
for name, settings in cases.items():
    try:
        build(**settings)
        messages[name] = None
    except ValueError as error:
        messages[name] = str(error)
print("REFUSALS " + json.dumps(messages))
"""


def test_settings_the_connector_cannot_serve_are_refused_at_start():
    done = subprocess.run([str(vllm_python()), "-c", _REFUSED_SETTINGS, str(convert_embedded_model("gemma3-270m"))],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("REFUSALS ")]
    messages = json.loads(line.removeprefix("REFUSALS "))
    assert "kv_connector_extra_config={'store': DIR}" in messages["no_store"]
    assert "kv_load_failure_policy='recompute'" in messages["failure_policy"]
    assert "tensor and pipeline parallelism" in messages["tensor_parallel"]
    assert "kv_cache_dtype='fp8'" in messages["fp8_cache"]
    assert "must be in [0, 1]" in messages["recompute"]
