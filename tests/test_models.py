"""load_model: the embedded defaults offline, the conversion cache, and pass-through to from_pretrained."""

import os
import subprocess
import sys

import pytest
from conftest import tiny_model


@pytest.mark.real_models
def test_embedded_conversion_honours_cache_env_and_needs_no_network(tmp_path):
    code = (
        "from hf_mot import load_model\n"
        "model, tokenizer = load_model('smollm2-135m')\n"
        "print(type(model).__name__, model.config.num_hidden_layers, len(tokenizer))\n"
    )
    env = {**os.environ, "HF_MOT_CACHE": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-2000:]
    assert first.stdout.split() == ["LlamaForCausalLM", "30", "49152"]
    converted = tmp_path / "models" / "smollm2-135m"
    assert (converted / "model.safetensors").is_file() and (converted / "tokenizer.json").is_file()
    assert "Converting smollm2-135m" in first.stderr
    # The second load reads the cached safetensors: no conversion this time.
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert second.returncode == 0 and "Converting" not in second.stderr
    assert not [p for p in (tmp_path / "models").iterdir() if p.name.startswith(".")], "temporary folder left"


def test_other_names_go_to_from_pretrained(tmp_path):
    from conftest import char_tokenizer

    from hf_mot import load_model

    tiny_model("llama").save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert model.config.model_type == "llama" and not model.training
    assert tokenizer("ab").input_ids[-2:] == char_tokenizer()("ab").input_ids[-2:]


def test_bad_name_type():
    from hf_mot import load_model

    with pytest.raises(TypeError, match="`name_or_path` must be a string or path"):
        load_model(42)
