"""The default translator that ships inside the package."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_mot
from hf_mot.modeling_mot import shipped_translator_dir

REPO_ID = "hf-mot/smollm2-135m-to-gemma3-270m"


def test_ships_small_with_a_card():
    folder = Path(shipped_translator_dir(REPO_ID))
    assert folder.parent == Path(hf_mot.__file__).parent / "pretrained"
    assert (folder / "model.safetensors").stat().st_size <= 32 * 2**20
    card = (folder / "README.md").read_text()
    assert "library_name: hf_mot" in card and "google/gemma-3-270m" in card and "model-index" in card


def test_loads_by_repo_id_offline(tmp_path):
    code = (
        "from hf_mot import MoTTranslator\n"
        f"t = MoTTranslator.from_pretrained('{REPO_ID}')\n"
        "print(t.config.source['num_layers'], t.config.target['num_layers'], t.config.target['model_type'])\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["30", "18", "gemma3_text"]
    assert not any(tmp_path.iterdir()), "nothing should have been downloaded into the Hub cache"


@pytest.mark.real_models
def test_beats_no_context_on_held_out_text(smollm2, gemma3):
    from hf_mot import MoTTranslator
    from hf_mot.evaluation import evaluate_fidelity, heldout_examples, summarize

    (source, source_tok), (target, target_tok) = smollm2, gemma3
    translator = MoTTranslator.from_pretrained(REPO_ID).eval()
    examples = heldout_examples(target_tok, lengths=(64,), per_length=6)
    rows = evaluate_fidelity(
        examples, translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
        target_tokenizer=target_tok, conditions={"full": {"injection_mode": "full"}}, progress=False,
    )
    summary = summarize(rows, ["full"])
    assert summary["full"]["nll"] < summary["nll_no_context"]
    assert summary["full"]["top1_agreement"] > 0.3
