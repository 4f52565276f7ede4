"""Gemma-3-270M, served by vLLM, answers from SmolLM2-135M's reading of a document.

hf_mot translates SmolLM2's cache of the document into a store entry; vLLM loads it through `MoTConnector` and
prefills only the question. The same request without the entry's `cache_salt` is an ordinary prefill, shown
next to it. Runs in vLLM's environment, which has hf_mot installed too (`bash scripts/setup_vllm.sh`):

    .venv-vllm/bin/python examples/vllm_serving/serve_translated_cache.py
"""

import os
import tempfile
import time
from pathlib import Path

DOCUMENT = Path(__file__).parents[1] / "cache_translation" / "document.txt"
QUESTION = " Question: Who built the tower? Answer:"


def main() -> None:
    # KV cache memory for vLLM's CPU backend, in GiB. Without it vLLM reserves 92% of the machine's memory and
    # refuses to start when less is free (here, with the two models of the translation loaded beside it).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hf_mot import MoTTranslator, load_model
    from hf_mot.integrations.vllm_store import write_store_entries
    from hf_mot.models import convert_embedded_model

    context = DOCUMENT.read_text(encoding="utf-8")
    source, source_tok = load_model("smollm2-135m")
    target, target_tok = load_model("gemma3-270m")
    translator = MoTTranslator.from_pretrained("hf-mot/smollm2-135m-to-gemma3-270m")
    store = tempfile.mkdtemp(prefix="hf_mot_store_")
    # SmolLM2 reads the document; its cache is translated into Gemma 3's cache space and written to the store.
    (entry,) = write_store_entries(store, context, translator=translator, source_model=source,
                                   source_tokenizer=source_tok, target_model=target, target_tokenizer=target_tok)
    del source, target

    llm = LLM(
        model=str(convert_embedded_model("gemma3-270m")), dtype="float32", max_model_len=2048,
        kv_transfer_config={
            "kv_connector": "MoTConnector", "kv_connector_module_path": "hf_mot.integrations.vllm",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"store": store},
        },
    )
    prompt_ids = target_tok(context).input_ids + target_tok(QUESTION, add_special_tokens=False).input_ids
    params = SamplingParams(max_tokens=16, temperature=0.0)
    for name, prompt in [
        ("vLLM prefills the document", TokensPrompt(prompt_token_ids=prompt_ids)),
        # The salt names the entry's namespace: it selects the translated cache and keeps its blocks apart from
        # the prefix cache that ordinary requests share.
        ("from SmolLM2's translated cache", TokensPrompt(prompt_token_ids=prompt_ids, cache_salt=entry.parent.name)),
    ]:
        llm.reset_prefix_cache()
        start = time.perf_counter()
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        print(f"{name}: {out.outputs[0].text.strip()!r} ({out.num_cached_tokens} of {len(prompt_ids)} prompt "
              f"tokens not computed, {seconds:.2f} s for 16 tokens)")


if __name__ == "__main__":  # vLLM's CPU platform spawns processes
    main()
