"""The hf-mot command: the main job end to end, info, and one-line errors with a non-zero exit."""

import subprocess
import sys

import pytest
from conftest import CONTEXTS, char_tokenizer, tiny_model

from hf_mot import MoTConfig, MoTTranslator


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    source, target = tiny_model("llama", seed=1), tiny_model("gemma3", seed=2)
    for name, model in (("src", source), ("tgt", target)):
        model.save_pretrained(root / name)
        char_tokenizer().save_pretrained(root / name)
    config = MoTConfig.from_models(source.config, target.config, source_tokenizer=char_tokenizer(),
                                   target_tokenizer=char_tokenizer(), hidden_size=16)
    MoTTranslator(config).save_pretrained(root / "translator")
    (root / "doc.txt").write_text(CONTEXTS[0])
    return root


def _hf_mot(*args):
    return subprocess.run([sys.executable, "-m", "hf_mot.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def test_generate_prints_answer_and_timings(dirs):
    result = _hf_mot("generate", "--source", dirs / "src", "--target", dirs / "tgt", "--translator",
                     dirs / "translator", "--context-file", dirs / "doc.txt", "--prompt", " Q: where? A:",
                     "--max-new-tokens", "4")
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("answer: ")
    assert "translation (full mode):" in lines[1] and "native prefill of the target:" in lines[1]


def test_info_names_the_pair(dirs):
    result = _hf_mot("info", dirs / "translator")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "source:" in result.stdout and "llama (2 layers" in result.stdout
    assert "target:" in result.stdout and "gemma3_text (3 layers" in result.stdout


def test_bad_input_gives_one_line_and_non_zero_exit(dirs):
    result = _hf_mot("generate", "--source", dirs / "src", "--target", dirs / "tgt", "--translator",
                     dirs / "translator", "--context", "   ")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("hf-mot generate: error: `context[0]` is empty")
