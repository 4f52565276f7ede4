"""Translators on the Hub, for real: push_to_hub / from_pretrained over HTTP against the loopback Hub server
that conftest starts (HF_ENDPOINT points at it, HF_HOME is a temporary folder)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import CONTEXTS, bpe_tokenizer, char_tokenizer, tiny_model
from huggingface_hub import HfApi
from transformers import AutoModel

from hf_mot import MoTConfig, MoTTranslator, translate_context

ROOT = Path(__file__).resolve().parents[1]


def _translator(seed: int = 0, **options) -> MoTTranslator:
    source, target = tiny_model("llama", seed=1), tiny_model("qwen2", seed=2)
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=char_tokenizer(),
                                   target_tokenizer=bpe_tokenizer(), hidden_size=16, expert_hidden_size=16, **options)
    torch.manual_seed(seed)
    return MoTTranslator(config).eval()


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_push_and_load_by_repo_id(hub, tmp_path):
    translator = _translator()
    commit = translator.push_to_hub("hf-mot-test/round-trip")
    files = hub.state.repos[("model", "hf-mot-test/round-trip")].resolve("main").files
    assert {"config.json", "model.safetensors", "README.md", "modeling_mot.py", "configuration_mot.py"} <= set(files)
    assert commit.oid == hub.state.repos[("model", "hf-mot-test/round-trip")].branches["main"]

    cache = tmp_path / "fresh-cache"
    loaded = MoTTranslator.from_pretrained("hf-mot-test/round-trip", cache_dir=cache)
    assert _same_weights(translator, loaded)
    assert loaded.config.to_dict()["source"] == translator.config.to_dict()["source"]
    assert any(cache.rglob("model.safetensors")), "the weights must have come through the fresh cache"
    assert any(r.startswith("GET /hf-mot-test/round-trip/resolve/") and r.endswith("/model.safetensors")
               for r in hub.state.requests)
    # The card travels with the weights and comes back with them.
    assert "library_name: hf_mot" in loaded.model_card and "tiny-llama" in loaded.model_card
    # AutoModel finds the class through the registration that importing hf_mot does.
    auto = AutoModel.from_pretrained("hf-mot-test/round-trip", cache_dir=cache)
    assert type(auto) is MoTTranslator and _same_weights(translator, auto)


def test_save_pretrained_can_push(hub, tmp_path):
    translator = _translator()
    translator.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="hf-mot-test/via-save")
    files = hub.state.repos[("model", "hf-mot-test/via-save")].resolve("main").files
    assert files["model.safetensors"] == (tmp_path / "local" / "model.safetensors").read_bytes()
    assert files["README.md"].decode() == (tmp_path / "local" / "README.md").read_text()


def test_push_options_reach_the_hub(hub, tmp_path):
    """`private`, `commit_message`, `revision` and `tags` are honoured by `push_to_hub` and by
    `save_pretrained(push_to_hub=True, ...)`, not dropped."""
    translator = _translator()
    translator.save_pretrained(tmp_path / "local", push_to_hub=True, repo_id="hf-mot-test/private-save",
                               private=True, commit_message="first weights", revision="exp", tags=["kv-cache"])
    repo = hub.state.repos[("model", "hf-mot-test/private-save")]
    assert repo.private and "exp" in repo.branches
    commit = repo.resolve("exp")
    assert commit.message == "first weights" and "- kv-cache" in commit.files["README.md"].decode()
    translator.push_to_hub("hf-mot-test/private-push", private=True, commit_message="via push",
                           commit_description="why", tags=["a", "b"])
    pushed = hub.state.repos[("model", "hf-mot-test/private-push")]
    assert pushed.private and pushed.resolve("main").message == "via push"
    assert "- a\n" in pushed.resolve("main").files["README.md"].decode()
    with pytest.raises(TypeError, match="push_to_hub=True"):
        translator.save_pretrained(tmp_path / "again", private=True)


def test_card_written_by_save_pretrained(tmp_path):
    translator = _translator()
    translator.save_pretrained(tmp_path / "out")
    card = (tmp_path / "out" / "README.md").read_text()
    front_matter = card.split("---")[1]
    assert "library_name: hf_mot" in front_matter and "mixture-of-translators" in front_matter
    assert "MoTTranslator.from_pretrained(\"out\")" in card
    # A card given explicitly wins, and is kept through a load / save round trip.
    translator.save_pretrained(tmp_path / "custom", model_card="---\nlicense: mit\n---\n# Mine\n")
    reloaded = MoTTranslator.from_pretrained(tmp_path / "custom")
    reloaded.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "README.md").read_text() == "---\nlicense: mit\n---\n# Mine\n"


def test_card_usage_snippet_asks_its_prompt_as_valid_python():
    """The snippet's prompt is written as a Python string literal, whatever it holds (ship_translator.py
    --usage-prompt gives the reverse translator's card a completion prompt)."""
    import ast

    from hf_mot.model_card import render_model_card

    prompt = ' He said "so" and it\'s \\ done'
    card = str(render_model_card(_translator().config, "org/name", usage_prompt=prompt))
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0]
    calls = [node for node in ast.walk(ast.parse(snippet))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "tgt_tok"]
    assert [ast.literal_eval(call.args[0]) for call in calls] == [prompt]


def test_revisions(hub, tmp_path):
    first, second, third = _translator(seed=0), _translator(seed=1), _translator(seed=2)
    old = first.push_to_hub("hf-mot-test/revisions").oid
    second.push_to_hub("hf-mot-test/revisions")
    third.push_to_hub("hf-mot-test/revisions", revision="experiment")
    cache = tmp_path / "cache"
    assert _same_weights(MoTTranslator.from_pretrained("hf-mot-test/revisions", cache_dir=cache), second)
    assert _same_weights(MoTTranslator.from_pretrained("hf-mot-test/revisions", revision=old, cache_dir=cache), first)
    pinned = MoTTranslator.from_pretrained("hf-mot-test/revisions", revision="experiment", cache_dir=cache)
    assert _same_weights(pinned, third)


def test_missing_repo_file_and_revision(hub, tmp_path):
    missing = r"(?s)Could not load a translator from .hf-mot-test/no-such-repo.*Check the repo"
    with pytest.raises(OSError, match=missing):
        MoTTranslator.from_pretrained("hf-mot-test/no-such-repo", cache_dir=tmp_path)
    api = HfApi()
    api.create_repo("hf-mot-test/config-only")
    api.upload_file(path_or_fileobj=json.dumps(_translator().config.to_dict()).encode(), path_in_repo="config.json",
                    repo_id="hf-mot-test/config-only")
    with pytest.raises(OSError, match=r"model\.safetensors"):
        MoTTranslator.from_pretrained("hf-mot-test/config-only", cache_dir=tmp_path)
    _translator().push_to_hub("hf-mot-test/has-main")
    with pytest.raises(OSError, match=r"no-such-branch"):
        MoTTranslator.from_pretrained("hf-mot-test/has-main", revision="no-such-branch", cache_dir=tmp_path)


def test_server_down(tmp_path):
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = "from hf_mot import MoTTranslator\nMoTTranslator.from_pretrained('hf-mot-test/anything')\n"
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "Could not load a translator from 'hf-mot-test/anything'" in result.stderr
    assert "connect" in result.stderr.lower()


def test_repo_for_another_pair_is_refused(hub, tmp_path):
    _translator().push_to_hub("hf-mot-test/llama-to-qwen2")
    translator = MoTTranslator.from_pretrained("hf-mot-test/llama-to-qwen2", cache_dir=tmp_path)
    other_source, other_target = tiny_model("gpt2"), tiny_model("gemma3")
    with pytest.raises(ValueError, match=r"This translator was built for source_model .*Load the translator made"):
        translate_context(CONTEXTS[0], translator=translator, source_model=other_source,
                          source_tokenizer=char_tokenizer(), target_model=other_target,
                          target_tokenizer=bpe_tokenizer())


def test_corrupted_and_pickle_weights_are_refused(tmp_path):
    translator = _translator()
    translator.save_pretrained(tmp_path / "ok")
    weights = (tmp_path / "ok" / "model.safetensors").read_bytes()
    for name, data in (("truncated", weights[: len(weights) // 2]), ("garbage", b"not a safetensors file" * 10)):
        folder = tmp_path / name
        translator.save_pretrained(folder)
        (folder / "model.safetensors").write_bytes(data)
        with pytest.raises(ValueError, match=r"model\.safetensors of .* is corrupted or truncated"):
            MoTTranslator.from_pretrained(folder)
    pickled = tmp_path / "pickled"
    translator.save_pretrained(pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(translator.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(OSError, match=r"model\.safetensors"):
        MoTTranslator.from_pretrained(pickled)
    with pytest.raises(ValueError, match=r"safetensors only"):
        MoTTranslator.from_pretrained(pickled, use_safetensors=False)


def test_trust_remote_code_without_hf_mot(hub, tmp_path):
    translator = _translator()
    translator.push_to_hub("hf-mot-test/remote-code")
    # A fresh interpreter in which `import hf_mot` fails: only the files uploaded with the weights can help.
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'hf_mot' or name.startswith('hf_mot.'):\n"
        "            raise ImportError('hf_mot is not installed here')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from transformers import AutoModel\n"
        "model = AutoModel.from_pretrained('hf-mot-test/remote-code', trust_remote_code=True)\n"
        "print(type(model).__module__, type(model).__name__)\n"
        "print(sum(float(p.double().sum()) for p in model.state_dict().values()))\n"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    module, name, checksum = result.stdout.split()[-3:]
    assert name == "MoTTranslator" and module.startswith("transformers_modules.")
    assert float(checksum) == pytest.approx(sum(float(p.double().sum()) for p in translator.state_dict().values()))
