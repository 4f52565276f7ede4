"""The hf-mot command: the main job end to end, info, and one-line errors with a non-zero exit."""

import subprocess
import sys

import pytest
from conftest import CONTEXTS, char_tokenizer, tiny_model
from transformers import AutoConfig

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
    # Built from the saved models' configs, this one records where its models are.
    saved = [AutoConfig.from_pretrained(root / name) for name in ("src", "tgt")]
    MoTTranslator(MoTConfig.from_models(*saved, hidden_size=16)).save_pretrained(root / "translator_with_models")
    (root / "doc.txt").write_text(CONTEXTS[0])
    return root


def _hf_mot(*args):
    return subprocess.run([sys.executable, "-m", "hf_mot.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _generate_on_the_document(dirs, *options):
    """`hf-mot generate` on the tiny pair and document; must succeed. Returns its output lines."""
    result = _hf_mot("generate", "--source", dirs / "src", "--target", dirs / "tgt", "--translator",
                     dirs / "translator", "--context-file", dirs / "doc.txt", *options)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()


def test_generate_prints_answer_and_timings(dirs):
    lines = _generate_on_the_document(dirs, "--prompt", " Q: where? A:", "--max-new-tokens", "4")
    assert lines[0].startswith("answer: ") and lines[1].startswith("target's own answer")
    assert "translation: " in lines[2] and "native prefill of the target:" in lines[2]


def test_generate_at_recompute_one_answers_as_the_target_itself(dirs):
    lines = _generate_on_the_document(dirs, "--recompute", "1", "--max-new-tokens", "6")
    assert lines[0].split(": ", 1)[1] == lines[1].split(": ", 1)[1]
    assert "all read natively" in lines[2]
    result = _hf_mot("generate", "--source", dirs / "src", "--target", dirs / "tgt", "--translator",
                     dirs / "translator", "--context-file", dirs / "doc.txt", "--recompute", "1.5")
    assert result.returncode == 1 and "must be in [0, 1]" in result.stderr.strip().splitlines()[-1]


def test_generate_with_a_native_tail(dirs):
    lines = _generate_on_the_document(dirs, "--native-tail", "8", "--max-new-tokens", "4")
    assert "translation (last 8 read natively):" in lines[2]
    result = _hf_mot("generate", "--source", dirs / "src", "--target", dirs / "tgt", "--translator",
                     dirs / "translator", "--context", "Hi.", "--native-tail", "8")
    assert result.returncode == 1
    assert "`native_tail=8` leaves nothing to translate" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("strategy, recompute, read", [("bottom", "0.5", " (layers 0-"),
                                                      ("deviation", "0.5", " (layer 0, the last tokens"),
                                                      ("deviation", "0", ": ")])  # r = 0: pure translation
def test_generate_spends_the_budget_by_strategy(dirs, strategy, recompute, read):
    lines = _generate_on_the_document(dirs, "--recompute", recompute, "--strategy", strategy, "--max-new-tokens", "4")
    assert f"translation{read}" in lines[2]


def test_a_translator_brings_the_models_it_was_built_for(dirs):
    """Without --source/--target, the models come from the translator's config; a recorded model that does not
    load here (this one was built from in-memory models named tiny-llama and tiny-gemma3) says which flag to
    pass."""
    result = _hf_mot("generate", "--translator", dirs / "translator_with_models", "--context-file",
                     dirs / "doc.txt", "--max-new-tokens", "2")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"Loading source {dirs / 'src'}, target {dirs / 'tgt'}" in result.stderr
    result = _hf_mot("generate", "--translator", dirs / "translator", "--context-file", dirs / "doc.txt")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert "built for source 'tiny-llama' (from its config), which does not load here" in last
    assert last.endswith("pass `source=NAME_OR_PATH` (`--source` on the command line).")


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


def test_generate_needs_a_translator_for_a_pair_without_default(dirs):
    result = _hf_mot("generate", "--source", dirs / "src", "--target", dirs / "tgt", "--context", "Some text.")
    assert result.returncode == 1
    assert "No translator ships for" in result.stderr.strip().splitlines()[-1]


def test_translate_writes_a_cache_that_generates_like_the_live_one(dirs):
    import torch

    from hf_mot import TranslatedCache, translate_context
    from hf_mot._compat import cache_kwarg

    # The tiny Gemma target has sliding-window layers (window 8) shorter than the context.
    out = dirs / "doc.cache.safetensors"
    result = _hf_mot("translate", "--source", dirs / "src", "--target", dirs / "tgt", "--translator",
                     dirs / "translator", "--context-file", dirs / "doc.txt", "--output", out)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "wrote" in result.stdout and out.exists() and not list(dirs.glob("*.tmp"))

    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(dirs / "tgt").eval()
    source = AutoModelForCausalLM.from_pretrained(dirs / "src").eval()
    translator = MoTTranslator.from_pretrained(dirs / "translator").eval()
    live = translate_context(CONTEXTS[0], translator=translator, source_model=source,
                             source_tokenizer=char_tokenizer(), target_model=target, target_tokenizer=char_tokenizer())
    loaded = TranslatedCache.load(out, target.config)
    assert loaded.get_seq_length() == live.get_seq_length()
    prompt = char_tokenizer()(" Q: where? A:", return_tensors="pt", add_special_tokens=False).input_ids
    runs = []
    for cache in (live, loaded):
        runs.append(target.generate(input_ids=prompt, attention_mask=cache.generation_mask(prompt.shape[1]),
                                    max_new_tokens=8, do_sample=False, **{cache_kwarg(target): cache}))
    assert torch.equal(runs[0], runs[1])

    with pytest.raises(ValueError, match=r"holds 3 layers but the target config has 2"):
        TranslatedCache.load(out, tiny_model("llama").config)
    assert _hf_mot("translate", "--source", dirs / "src", "--target", dirs / "tgt", "--translator",
                   dirs / "translator", "--context", "x", "--output", dirs / "x.pt").returncode == 1


def test_translate_to_a_vllm_store_writes_an_entry_the_connector_reads(dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    from hf_mot.integrations.vllm_store import ServedModel, model_fingerprint, read_header, read_states

    pair = ["--source", dirs / "src", "--target", dirs / "tgt", "--translator", dirs / "translator",
            "--context-file", dirs / "doc.txt"]
    result = _hf_mot("translate", *pair, "--to-vllm-store", tmp_path / "store")
    assert result.returncode == 0, result.stderr[-2000:]
    (entry,) = (tmp_path / "store").glob("hf_mot-*/*.safetensors")
    assert f"cache_salt='{entry.parent.name}'" in result.stdout
    target = AutoModelForCausalLM.from_pretrained(dirs / "tgt")
    served = ServedModel(model_fingerprint(target.state_dict(), 3), 3, target.config.num_key_value_heads,
                         target.config.head_dim)
    header = read_header(entry, served)
    assert list(header.token_ids) == char_tokenizer()(CONTEXTS[0]).input_ids
    states = read_states(header, 3)
    assert len(states) == 3 and all(keys.abs().sum() > 0 for keys, _ in states)
    assert max(keys.shape[0] for keys, _ in states) == len(header.token_ids)
    result = _hf_mot("translate", *pair, "--to-vllm-store", tmp_path / "store", "--recompute", "0.5")
    assert result.returncode == 1 and "connector applies the dial" in result.stderr.strip().splitlines()[-1]


def test_push_uploads_to_the_hub(dirs, hub):
    result = _hf_mot("push", dirs / "translator", "hf-mot-test/cli-push", "--revision", "v1")
    assert result.returncode == 0, result.stderr[-2000:]
    repo = hub.state.repos[("model", "hf-mot-test/cli-push")]
    assert {"config.json", "model.safetensors", "README.md"} <= set(repo.resolve("v1").files)


def test_fit_layers_writes_a_fitted_translator(dirs, tmp_path):
    import json

    output = tmp_path / "fitted"
    pair = ("--source", dirs / "src", "--target", dirs / "tgt", "--translator", dirs / "translator")
    result = _hf_mot("fit-layers", *pair, "--output-dir", output, "--pairs", 4, "--validation-pairs", 2,
                     "--context-words", 20, 30, "--epochs", 1, "--previous-tokens", 1,
                     "--previous-tokens-keys-only")
    assert result.returncode == 0, result.stderr[-2000:]
    fitted = MoTTranslator.from_pretrained(output)
    # The tiny Gemma 3's one full-attention layer, and its key norm.
    assert fitted.config.dedicated_layers == [1] and fitted.config.dedicated_key_norm
    assert fitted.config.dedicated_previous_tokens == 1 and fitted.config.dedicated_previous_tokens_keys_only
    assert fitted.key_mixture.dedicated.weight.abs().sum() > 0
    report = json.loads((output / "layer_fit.json").read_text())
    assert report["command"].startswith("hf-mot fit-layers") and len(report["distilled"]["kl"]) == 1
    assert "distilled: attention KL per layer" in result.stdout

    again = _hf_mot("fit-layers", *pair, "--output-dir", output)
    assert again.returncode == 1 and "is not empty" in again.stderr.strip().splitlines()[-1]
    assert (output / "layer_fit.json").read_text() == json.dumps(report, indent=2) + "\n"


def test_every_subcommand_has_help():
    for command in ("generate", "translate", "train", "evaluate", "push", "info", "fit-layers"):
        result = _hf_mot(command, "--help")
        assert result.returncode == 0 and "usage:" in result.stdout, (command, result.stderr[-500:])
