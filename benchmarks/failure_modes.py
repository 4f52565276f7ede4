"""The MoT method's two failure modes, measured on held-out text for one or more translators side by side.

- Propagated translation shift: translated layers `[start, start + count)` are injected into the target's own
  pass over the context, which computes every layer above them on top (`hf_mot.evaluation.injection`). For each
  start layer this reports the relative KV error of every target layer from the injection point up (against the
  target's native cache of the same context), and the share of the continuation-NLL gap closed.
- Last-state shift: the KL between the native and translated next-token distributions at each position after
  the context, every layer translated (position 1 is the first prediction after the context).

Compare a translator trained with the Context Correction Loss against one trained without it.

Usage:
    python benchmarks/failure_modes.py --translator ccl=hf-mot/smollm2-135m-to-gemma3-270m \
        --translator no-ccl=runs/ablation-no-ccl --starts 0 3 6 9 12 15 --count 3 --examples 24
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from hf_mot import MoTTranslator, load_model
from hf_mot.alignment import encode_contexts
from hf_mot.evaluation.fidelity import evaluate_fidelity, heldout_examples, summarize
from hf_mot.evaluation.injection import window_injected_cache
from hf_mot.evaluation.report import machine_info
from hf_mot.files import write_json_atomically
from hf_mot.pipeline import fill_translated_cache, read_source_and_align, run_translator
from hf_mot.training.losses import native_context_kv


@torch.no_grad()
def layer_errors(translator, source, source_tok, target, target_tok, contexts, start, count, mode) -> list[float]:
    """Mean relative KV error (keys and values) per target layer, over `contexts`; NaN below the injection."""
    sums = torch.zeros(target.config.num_hidden_layers)
    for context in contexts:
        s, t = encode_contexts(source_tok, [context]), encode_contexts(target_tok, [context])
        source_kv, alignment = read_source_and_align(source, source_tok, target_tok, s, t)
        if mode == "window":
            _, context_kv = window_injected_cache(translator, source_kv, alignment, target, t, (start, count))
        else:
            out = run_translator(translator, source_kv, alignment, target, t.input_ids, t.attention_mask)
            _, context_kv = fill_translated_cache(out, target, t)
        batch = {"target_input_ids": t.input_ids, "target_attention_mask": t.attention_mask}
        _, native = native_context_kv(target, batch)
        for layer, (keys, values) in context_kv.items():
            nk, nv = native[layer]
            key_error = ((keys - nk) ** 2).sum() / (nk**2).sum()
            sums[layer] += 0.5 * (key_error + ((values - nv) ** 2).sum() / (nv**2).sum())
    errors = (sums / len(contexts)).tolist()
    first = start if mode == "window" else 0
    return [float("nan") if i < first else e for i, e in enumerate(errors)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--translator", action="append", required=True, metavar="NAME=PATH")
    parser.add_argument("--starts", type=int, nargs="+", default=[0, 3, 6, 9, 12, 15])
    parser.add_argument("--count", type=int, default=3, help="translated layers injected at each start")
    parser.add_argument("--length", type=int, default=256, help="context length in target tokens")
    parser.add_argument("--examples", type=int, default=24)
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/failure_modes.json"))
    args = parser.parse_args()

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    examples = heldout_examples(target_tok, (args.length,), args.examples)
    contexts = [e.context for e in examples]
    results = {}
    for spec in args.translator:
        name, _, path = spec.partition("=")
        translator = MoTTranslator.from_pretrained(path).eval()
        conditions = {"full": {}}
        conditions.update({f"window@{s}": {"window": (s, args.count)} for s in args.starts})
        rows = evaluate_fidelity(examples, translator=translator, source_model=source, source_tokenizer=source_tok,
                                 target_model=target, target_tokenizer=target_tok, conditions=conditions)
        summary = summarize(rows, list(conditions))
        results[name] = {
            "path": path,
            "full": {**summary["full"], "layer_errors": layer_errors(
                translator, source, source_tok, target, target_tok, contexts, 0, 0, "full")},
            "window": {
                s: {**summary[f"window@{s}"], "layer_errors": layer_errors(
                    translator, source, source_tok, target, target_tok, contexts, s, args.count, "window")}
                for s in args.starts
            },
        }

    lines = ["| translator | injected layers | gap closed | top-1 agreement | KV error at the window "
             "| KV error at the top layer | KL at the first position |", "|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        for label, m, first in [("all (full)", r["full"], 0),
                                *[(f"{s}-{s + args.count - 1}", r["window"][s], s) for s in args.starts]]:
            lines.append(f"| {name} | {label} | {100 * m['gap_closed']:.1f}% | {100 * m['top1_agreement']:.1f}% | "
                         f"{m['layer_errors'][first]:.3f} | {m['layer_errors'][-1]:.3f} | "
                         f"{m['kl_by_position'][0]:.3f} |")
    table = "\n".join(lines)
    print(table)
    report = {
        "benchmark": "failure_modes", "command": "python benchmarks/failure_modes.py " + " ".join(sys.argv[1:]),
        # Each context's first token comes from the target itself (`pipeline.first_token_states`) since hf_mot
        # 0.2; tables without this field were measured before, with it translated.
        "first_token": "target",
        "machine": machine_info(),
        "data": f"validation split of hf_mot.training.data, {args.examples} contexts of {args.length} target tokens",
        "results": results, "table": table,
    }
    write_json_atomically(args.output, report)
    plot(results, args, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for name, r in results.items():
        for s in args.starts:
            errors = r["window"][s]["layer_errors"]
            axes[0].plot(range(len(errors)), errors, marker=".", label=f"{name}, inject {s}-{s + args.count - 1}")
        axes[1].plot(args.starts, [100 * r["window"][s]["gap_closed"] for s in args.starts], marker="o", label=name)
        by_position = r["full"]["kl_by_position"]
        axes[2].plot(range(1, len(by_position) + 1), by_position, label=f"{name} (full)")
    axes[0].set(xlabel="target layer", ylabel="relative KV error vs native",
                title="propagated translation shift (window mode)")
    axes[1].set(xlabel="first injected layer", ylabel="NLL gap closed (%)", title="quality against start layer")
    axes[2].set(xlabel="prediction position after the context", ylabel="KL(native || translated)",
                title="last-state shift (full mode)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
