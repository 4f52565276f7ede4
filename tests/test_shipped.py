"""The default translator that ships inside the package."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_mot
from hf_mot.hub import shipped_translator_dir

REPO_ID = "hf-mot/smollm2-135m-to-gemma3-270m"
REVERSE_ID = "hf-mot/gemma3-270m-to-smollm2-135m"
# Each shipped translator: repo id, (source, target) fixture names, the target's Hub id and its layer counts.
SHIPPED = [
    pytest.param(REPO_ID, ("smollm2", "gemma3"), "google/gemma-3-270m", ["30", "18", "gemma3_text"], id="forward"),
    pytest.param(REVERSE_ID, ("gemma3", "smollm2"), "HuggingFaceTB/SmolLM2-135M-Instruct", ["18", "30", "llama"],
                 id="reverse"),
]


@pytest.mark.parametrize("repo_id, pair, target_hub_id, layers", SHIPPED)
def test_ships_small_with_a_card(repo_id, pair, target_hub_id, layers):
    folder = Path(shipped_translator_dir(repo_id))
    assert folder.parent == Path(hf_mot.__file__).parent / "pretrained"
    assert (folder / "model.safetensors").stat().st_size <= 32 * 2**20
    card = (folder / "README.md").read_text()
    assert "library_name: hf_mot" in card and target_hub_id in card and "model-index" in card


@pytest.mark.parametrize("repo_id, pair, target_hub_id, layers", SHIPPED)
def test_loads_by_repo_id_offline(tmp_path, repo_id, pair, target_hub_id, layers):
    code = (
        "from hf_mot import MoTTranslator\n"
        f"t = MoTTranslator.from_pretrained('{repo_id}')\n"
        "print(t.config.source['num_layers'], t.config.target['num_layers'], t.config.target['model_type'], t.dtype)\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    # Stored in float16 to stay small; loaded as float32 unless the caller asks for another dtype.
    assert result.stdout.split() == [*layers, "torch.float32"]
    assert not any(tmp_path.iterdir()), "nothing should have been downloaded into the Hub cache"


# The published held-out fidelity of each shipped translator on the 50 test pairs of 64 target tokens (gap closed,
# top-1 agreement): benchmarks/results/lm_fidelity.json (`shipped`) and benchmarks/results/reverse/lm_fidelity.json.
PUBLISHED_AT_64 = {REPO_ID: (0.9234, 0.7994), REVERSE_ID: (0.9864, 0.7742)}


@pytest.mark.real_models
@pytest.mark.parametrize("repo_id, pair, target_hub_id, layers", SHIPPED)
def test_reproduces_its_published_fidelity(request, repo_id, pair, target_hub_id, layers):
    """On the same 50 held-out pairs, the packaged translator lands within a point and a half of the figures it was
    published with: a broken alignment, RoPE, embedding path or cache fill costs far more than that."""
    from hf_mot import MoTTranslator
    from hf_mot.evaluation import evaluate_fidelity, heldout_examples, summarize

    (source, source_tok), (target, target_tok) = (request.getfixturevalue(name) for name in pair)
    translator = MoTTranslator.from_pretrained(repo_id).eval()
    examples = heldout_examples(target_tok, lengths=(64,), per_length=50)
    rows = evaluate_fidelity(
        examples, translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
        target_tokenizer=target_tok, conditions={"full": {"recompute": 0.0}}, progress=False,
    )
    summary = summarize(rows, ["full"])["full"]
    gap, top1 = PUBLISHED_AT_64[repo_id]
    assert abs(summary["gap_closed"] - gap) < 0.015, summary
    assert abs(summary["top1_agreement"] - top1) < 0.015, summary


@pytest.mark.parametrize("strategy", ["tail", "bottom", "deviation"])
def test_every_strategy_runs_on_the_shipped_pair(smollm2, gemma3, strategy):
    """The real pair at the dial's strategies: Gemma-3-270M has one key/value head, 18 layers with sliding windows
    of 512, and contexts here are longer than the window, which the tiny test models do not all reproduce."""
    import torch

    from hf_mot import MoTTranslator, translate_context
    from hf_mot.alignment import encode_contexts
    from hf_mot.pipeline import read_context

    (source, source_tok), (target, target_tok) = smollm2, gemma3
    translator = MoTTranslator.from_pretrained(REPO_ID).eval()
    document = (Path(__file__).parents[1] / "examples" / "cache_translation" / "document.txt").read_text()
    context = " ".join([document] * 5)
    encoded = encode_contexts(target_tok, [context])
    tokens = encoded.input_ids.shape[1]
    assert tokens > target.config.sliding_window
    cache = translate_context(context, translator=translator, source_model=source, source_tokenizer=source_tok,
                              target_model=target, target_tokenizer=target_tok, recompute=0.1, strategy=strategy)
    assert cache.get_seq_length() == tokens
    if strategy != "tail":  # both read the target's own layer 0 for every token
        own = read_context(target, encoded)
        assert torch.allclose(cache.layers[0].keys, own.layers[0].keys, atol=1e-4)
    prompt = target_tok(" Question: Who built the tower? Answer:", add_special_tokens=False, return_tensors="pt")
    out = target.generate(input_ids=prompt.input_ids, attention_mask=cache.generation_mask(prompt.input_ids.shape[1]),
                          past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape[1] == prompt.input_ids.shape[1] + 4


def test_info_reports_the_measured_figures_offline(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, "-m", "hf_mot.cli", "info", REPO_ID], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "target: gemma3-270m" in result.stdout
    assert "measured: LM fidelity (full mode)" in result.stdout and "gap_closed = 0." in result.stdout


@pytest.mark.real_models
@pytest.mark.parametrize("repo_id, pair, target_hub_id, layers", SHIPPED)
def test_the_card_usage_snippet_runs(tmp_path, repo_id, pair, target_hub_id, layers):
    card = (Path(shipped_translator_dir(repo_id)) / "README.md").read_text()
    snippet = card.split("```python\n", 1)[1].split("```", 1)[0]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run([sys.executable, "-c", snippet], env=env, capture_output=True, text=True, timeout=600,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    # The prompt asks about "the tower"; the name comes only through the translated cache. (The translator shipped
    # before answered "Gustave Eiffel"; the one shipped now answers "The Eiffel Tower.", as Gemma 3 itself begins
    # "The Eiffel Tower was built by Gustave Eiffel's company.")
    assert "Eiffel" in result.stdout, result.stdout


def _ship_script():
    path = Path(__file__).parents[1] / "scripts" / "ship_translator.py"
    spec = importlib.util.spec_from_file_location("ship_translator", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_started_from_the_shipped_package(tmp_path):
    """A recorded run (as `hf-mot train` leaves it) that started from a package holding the shipped card."""
    package, run = tmp_path / "package", tmp_path / "run"
    package.mkdir(), run.mkdir()
    card = (Path(shipped_translator_dir(REPO_ID)) / "README.md").read_text()
    (package / "README.md").write_text(card)
    argv = ["--source", "s", "--target", "t", "--init-from", str(package), "--output-dir", str(run)]
    args = {"init_from": str(package), "output_dir": str(run), "batch_size": 4, "context_words": [160, 640],
            "continuation_words": 16, "nll_weight": 1.0, "kv_weight": 1.0, "kl_weight": 2.0, "balance_weight": 0.01,
            "question_nll_weight": 0.0}
    (run / "train_command.json").write_text(json.dumps({"argv": argv, "args": args}))
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 7, "log_history": [{"train_runtime": 120}]}))
    return package, run, card, argv


def test_card_phases_carry_over_from_the_package_a_run_started_from(tmp_path):
    ship = _ship_script()
    package, run, card, argv = _run_started_from_the_shipped_package(tmp_path)
    shipped_phases = [line for line in card.splitlines() if line.startswith(ship.PHASE_PREFIXES)]
    assert shipped_phases  # the shipped card lists how it was trained

    phases = ship.describe_phases(run)
    assert phases[:-1] == shipped_phases
    assert phases[-1].startswith(f"- `hf-mot train {' '.join(argv)}`: 7 steps, 2 min;")
    assert "NLL on question pairs x0.0" in phases[-1]
    # Packaged into the same folder it started from, the card lists the run's phase; packaging again (as with
    # --evaluation) must not list it twice.
    (package / "README.md").write_text(card.replace(shipped_phases[-1], "\n".join([shipped_phases[-1], phases[-1]])))
    assert ship.describe_phases(run) == phases


def test_card_phases_of_an_interpolated_translator(tmp_path):
    ship = _ship_script()
    package, run, card, _ = _run_started_from_the_shipped_package(tmp_path)
    run_phases = ship.describe_phases(run)
    mean = tmp_path / "mean"
    mean.mkdir()
    argv = ["--start", str(package), "--run", str(run), "--alpha", "0.5", "--output-dir", str(mean)]
    (mean / "interpolation.json").write_text(json.dumps({"argv": argv, "start": str(package), "run": str(run),
                                                          "alpha": 0.5}))
    phases = ship.describe_phases(mean)
    assert phases[:-1] == run_phases
    assert phases[-1].startswith(f"- `python scripts/interpolate_translator.py {' '.join(argv)}`: no training;")
    assert "0.5 x the last phase's + 0.5 x those it started from" in phases[-1]
    # Shipped into the package the run started from, then packaged again: each phase is listed once.
    (package / "README.md").write_text(card + "\n" + "\n".join(phases[len(run_phases) - 1:]) + "\n")
    assert ship.describe_phases(mean) == phases


def test_card_phase_of_averaged_checkpoints(tmp_path):
    ship = _ship_script()
    package, run, _, _ = _run_started_from_the_shipped_package(tmp_path)
    mean = tmp_path / "mean"
    mean.mkdir()
    runs = [str(run / "checkpoint-1"), str(run / "checkpoint-2")]
    argv = ["--start", str(package), "--run", *runs, "--alpha", "0.6667", "--output-dir", str(mean)]
    (mean / "interpolation.json").write_text(json.dumps({"argv": argv, "start": str(package), "run": str(run),
                                                          "runs": runs, "alpha": 0.6667}))
    phases = ship.describe_phases(mean)
    assert phases[:-1] == ship.describe_phases(run)
    assert "0.6667 x the mean of 2 of the last phase's checkpoints + 0.3333 x those it started from" in phases[-1]


def test_card_phase_of_a_layer_fit(tmp_path):
    ship = _ship_script()
    package, _, card, _ = _run_started_from_the_shipped_package(tmp_path)
    fitted = tmp_path / "fitted"
    fitted.mkdir()
    command = f"hf-mot fit-layers --translator {package} --output-dir {fitted}"
    stage = {"kl": [1.0, 0.5, 0.25], "output_error": [0.7, 0.5, 0.2]}
    (fitted / "layer_fit.json").write_text(json.dumps({
        "command": command, "started_from": str(package), "layers": [5, 11, 17], "pairs": 240,
        "context_tokens": 1234, "without": stage, "epochs": [{}, {}],
        "distilled": {"kl": [0.3, 0.2, 0.1], "output_error": [0.2, 0.1, 0.05]}}))
    (fitted / "config.json").write_text(json.dumps({"dedicated_source_layers": [2, 5], "dedicated_key_norm": True}))
    shipped_phases = [line for line in card.splitlines() if line.startswith(ship.PHASE_PREFIXES)]
    phases = ship.describe_phases(fitted)
    assert phases[:-1] == shipped_phases
    assert phases[-1].startswith(f"- `{command}`: dedicated maps for target layers [5, 11, 17], reading source layers "
                                 "[2, 5]")
    assert "2 epochs" in phases[-1] and "1.000/0.500/0.250 -> 0.300/0.200/0.100" in phases[-1]
    # Shipped into the package it started from, then packaged again: the fit is listed once.
    (package / "README.md").write_text(card + "\n" + phases[-1] + "\n")
    assert ship.describe_phases(fitted) == phases

    # The output layers trained end to end after the fit (`hf-mot train --init-from` the fit's folder, whose card
    # lists no phases): the fit's phases, then the run's.
    run = tmp_path / "after-fit"
    run.mkdir()
    argv = ["--source", "s", "--target", "t", "--init-from", str(fitted), "--output-dir", str(run)]
    args = {"init_from": str(fitted), "output_dir": str(run), "batch_size": 4, "context_words": [160, 640],
            "continuation_words": 16, "nll_weight": 1.0, "kv_weight": 0.0, "kl_weight": 2.0, "balance_weight": 0.01}
    (run / "train_command.json").write_text(json.dumps({"argv": argv, "args": args}))
    (run / "trainer_state.json").write_text(json.dumps({"global_step": 45, "log_history": [{"train_runtime": 780}]}))
    after = ship.describe_phases(run)
    assert after[:-1] == phases
    assert after[-1].startswith(f"- `hf-mot train {' '.join(argv)}`: 45 steps, 13 min;")
    # Shipped into the package the fit started from, then packaged again: each phase is listed once.
    (package / "README.md").write_text(card + "\n" + "\n".join(after[-2:]) + "\n")
    assert ship.describe_phases(run) == after


def test_recommended_point_reads_the_dial_run():
    ship = _ship_script()
    dial = json.loads((Path(__file__).parents[1] / "benchmarks" / "results" / "quality_dial.json").read_text())
    summary = dial["summary"]["all"]
    text = ship.recommended_point(dial, 0.2)
    chosen, control = summary["recompute=0.2"], summary["control 0.2"]
    assert f"`recompute=0.2` keeps {100 * chosen['retention']:.0f}% [" in text
    assert f"{chosen['speedup']:.1f}x" in text and f"keeps {100 * control['retention']:.0f}% [" in text
    with pytest.raises(ValueError, match="--budgets 0 0.4"):
        ship.recommended_point(dial, 0.4)  # not measured: no point to recommend
