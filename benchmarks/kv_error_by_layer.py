"""Where each translator's keys and values are wrong: relative KV error per target layer, side by side.

For each held-out pair the target reads the context itself (its native cache) and the translator produces the
full-mode cache; per target layer the benchmark reports ||translated - native||^2 / ||native||^2 over the
context tokens both caches hold, for keys and for values, summed over the pairs before dividing. This is the
quantity the KV term of the Context Correction Loss trains, measured per layer; `layer_attribution.py` says how
much each layer's error costs the continuation.

Usage (pairs from the selection part, so the reported test pairs stay unseen):
    python benchmarks/kv_error_by_layer.py --translator lcq=hf-mot/smollm2-135m-to-gemma3-270m \
        --translator mine=runs/pair --lengths 128 256 512 --per-length 12
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_mot import MoTTranslator, load_model, translate_context
from hf_mot._compat import cache_kwarg
from hf_mot.evaluation.fidelity import HELDOUT_PARTS, heldout_examples
from hf_mot.evaluation.report import machine_info
from hf_mot.files import write_json_atomically


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--translator", action="append", required=True, metavar="NAME=PATH",
                        help="a full-mode translator to measure (repeat the flag to compare several)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--per-length", type=int, default=12)
    parser.add_argument("--part", choices=HELDOUT_PARTS, default="selection")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/kv_error_by_layer.json"))
    args = parser.parse_args()
    named = dict(entry.split("=", 1) if "=" in entry else (entry, entry) for entry in args.translator)

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    translators = {name: MoTTranslator.from_pretrained(path).eval() for name, path in named.items()}
    examples = heldout_examples(target_tok, tuple(args.lengths), args.per_length, part=args.part)
    layers = target.config.num_hidden_layers
    # Per translator and layer: squared error and squared native norm, keys and values.
    sums = {name: torch.zeros(layers, 2, 2, dtype=torch.float64) for name in translators}
    with torch.no_grad():
        for example in tqdm(examples, desc="kv error"):
            context_ids = target_tok(example.context, return_tensors="pt").input_ids
            native = DynamicCache(config=target.config)
            target(input_ids=context_ids, use_cache=True, **{cache_kwarg(target): native})
            for name, translator in translators.items():
                translated = translate_context(
                    example.context, translator=translator, source_model=source, source_tokenizer=source_tok,
                    target_model=target, target_tokenizer=target_tok, recompute=0.0,
                )
                for i in range(layers):
                    pairs = ((translated.layers[i].keys, native.layers[i].keys),
                             (translated.layers[i].values, native.layers[i].values))
                    for kind, (ours, theirs) in enumerate(pairs):
                        held = min(ours.shape[2], theirs.shape[2])  # a sliding layer keeps its window only
                        ours, theirs = ours[:, :, -held:].double(), theirs[:, :, -held:].double()
                        sums[name][i, kind, 0] += (ours - theirs).square().sum()
                        sums[name][i, kind, 1] += theirs.square().sum()
    errors = {name: (s[..., 0] / s[..., 1]).tolist() for name, s in sums.items()}
    layer_types = list(getattr(target.config, "layer_types", None) or ["full_attention"] * layers)
    names = list(translators)
    lines = ["| layer | type | " + " | ".join(f"{n}: keys / values" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for i in range(layers):
        cells = " | ".join(f"{errors[n][i][0]:.3f} / {errors[n][i][1]:.3f}" for n in names)
        lines.append(f"| {i} | {layer_types[i].replace('_attention', '')} | {cells} |")
    means = " | ".join(f"{sum(e[0] for e in errors[n]) / layers:.3f} / {sum(e[1] for e in errors[n]) / layers:.3f}"
                       for n in names)
    lines.append(f"| mean | | {means} |")
    table = "\n".join(lines)
    print(table)
    report = {
        "benchmark": "kv_error_by_layer",
        "command": " ".join(["python benchmarks/kv_error_by_layer.py", *sys.argv[1:]]),
        "machine": machine_info(), "translators": named, "layer_types": layer_types,
        "data": f"{args.part} part of the validation split of hf_mot.training.data, {args.per_length} pairs at "
                f"each of {args.lengths} target tokens",
        "relative_error": {name: {"keys": [e[0] for e in errs], "values": [e[1] for e in errs]}
                           for name, errs in errors.items()},
        "table": table,
    }
    write_json_atomically(args.output, report)
    plot(errors, layer_types, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


def plot(errors: dict, layer_types: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    layers = range(len(layer_types))
    width = 0.8 / len(errors)
    for kind, ax in enumerate(axes):
        for n, (name, errs) in enumerate(errors.items()):
            ax.bar([i + n * width for i in layers], [e[kind] for e in errs], width=width, label=name)
        for i, layer_type in enumerate(layer_types):
            if layer_type == "full_attention":
                ax.axvspan(i - 0.5 * width, i + 0.8 - 0.5 * width, color="tab:red", alpha=0.08)
        ax.set(xlabel="target layer (shaded: full attention)", title=("keys", "values")[kind])
        ax.set_xticks(list(layers))
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("relative KV error")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
