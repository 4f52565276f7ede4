"""Which target layers' translation costs the most: full-mode caches with some layers put back to native.

For each held-out pair, the target's continuation is scored from the translated cache (full mode), from the
same cache with one target layer's keys and values replaced by the target's own (native) ones, and with
groups replaced: all keys only, all values only, the full-attention layers, the sliding-window layers. A
layer whose restoration recovers much top-1 agreement and KL is where the translation error sits; restoring
every layer gives exactly the native scores (the check that the swap is clean).

Usage (pairs from the selection part, so the reported test pairs stay unseen):
    python benchmarks/layer_attribution.py --translator hf-mot/smollm2-135m-to-gemma3-270m \
        --lengths 128 256 512 --per-length 12
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_mot import MoTTranslator, load_model, translate_context
from hf_mot._compat import cache_kwarg
from hf_mot.evaluation.fidelity import HELDOUT_PARTS, _against_native, _continuation_logits, heldout_examples
from hf_mot.evaluation.report import machine_info
from hf_mot.files import write_json_atomically


def swaps(layer_types: list[str]) -> dict[str, tuple[list[int], bool, bool]]:
    """Condition name -> (layers put back to native, keys, values)."""
    every = list(range(len(layer_types)))
    out = {"translated": ([], True, True)}
    out.update({f"layer {i}": ([i], True, True) for i in every})
    out["all keys"] = (every, True, False)
    out["all values"] = (every, False, True)
    for kind in sorted(set(layer_types)):
        out[f"all {kind}"] = ([i for i in every if layer_types[i] == kind], True, True)
    out["all (native)"] = (every, True, True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", default="smollm2-135m")
    parser.add_argument("--target", default="gemma3-270m")
    parser.add_argument("--translator", default="hf-mot/smollm2-135m-to-gemma3-270m", help="a full-mode translator")
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512])
    parser.add_argument("--per-length", type=int, default=12)
    parser.add_argument("--part", choices=HELDOUT_PARTS, default="selection")
    parser.add_argument("--output", type=Path, default=Path("benchmarks/results/layer_attribution.json"))
    args = parser.parse_args()

    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    translator = MoTTranslator.from_pretrained(args.translator).eval()
    examples = heldout_examples(target_tok, tuple(args.lengths), args.per_length, part=args.part)
    every_layer = ["full_attention"] * target.config.num_hidden_layers
    layer_types = list(getattr(target.config, "layer_types", None) or every_layer)
    conditions = swaps(layer_types)
    totals = {name: [0, 0.0] for name in conditions}
    scored = 0
    with torch.no_grad():
        for example in tqdm(examples, desc="attribution"):
            continuation = torch.tensor([example.continuation_ids])
            context_ids = target_tok(example.context, return_tensors="pt").input_ids
            native_logits = _continuation_logits(target, torch.cat([context_ids, continuation], 1),
                                                 context_ids.shape[1])
            native = DynamicCache(config=target.config)
            target(input_ids=context_ids, use_cache=True, **{cache_kwarg(target): native})
            translated = translate_context(
                example.context, translator=translator, source_model=source, source_tokenizer=source_tok,
                target_model=target, target_tokenizer=target_tok, recompute=0.0,
            )
            for name, (layers, keys, values) in conditions.items():
                cache = copy.deepcopy(translated)
                for i in layers:
                    if keys:
                        cache.layers[i].keys = native.layers[i].keys.clone()
                    if values:
                        cache.layers[i].values = native.layers[i].values.clone()
                logits = _continuation_logits(target, continuation, cache.get_seq_length(), cache=cache,
                                              prefix_mask=cache.attention_mask)
                row = _against_native(logits, continuation[0, 1:], native_logits, native_logits.log_softmax(-1))
                totals[name][0] += row["top1_agree"]
                totals[name][1] += row["kl"]
            scored += native_logits.shape[0]
    results = {name: {"layers": conditions[name][0], "keys": conditions[name][1], "values": conditions[name][2],
                      "top1_agreement": agree / scored, "kl": kl / scored}
               for name, (agree, kl) in totals.items()}
    restored = results["all (native)"]
    if restored["top1_agreement"] != 1.0 or restored["kl"] > 1e-4:
        sys.exit(f"Putting every layer back did not give the native scores ({restored}): the swap is not clean.")
    base = results["translated"]
    lines = ["| put back to native | top-1 agreement | recovered top-1 (points) | KL | KL removed |",
             "|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {100 * r['top1_agreement']:.1f}% | "
                     f"{100 * (r['top1_agreement'] - base['top1_agreement']):+.1f} | {r['kl']:.3f} | "
                     f"{100 * (1 - r['kl'] / base['kl']):.0f}% |")
    table = "\n".join(lines)
    print(table)
    report = {
        "benchmark": "layer_attribution",
        "command": " ".join(["python benchmarks/layer_attribution.py", *sys.argv[1:]]),
        "machine": machine_info(), "translator": args.translator,
        "data": f"{args.part} part of the validation split of hf_mot.training.data, {args.per_length} pairs at "
                f"each of {args.lengths} target tokens, 32-token continuations ({scored} scored tokens)",
        "results": results, "table": table,
    }
    write_json_atomically(args.output, report)
    plot(results, layer_types, args.output.with_suffix(".png"))
    print(f"wrote {args.output} and {args.output.with_suffix('.png')}")


def plot(results: dict, layer_types: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = results["translated"]
    layers = range(len(layer_types))
    colors = ["tab:red" if kind == "full_attention" else "tab:blue" for kind in layer_types]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    axes[0].bar(layers, [100 * (results[f"layer {i}"]["top1_agreement"] - base["top1_agreement"]) for i in layers],
                color=colors)
    axes[0].set(xlabel="target layer put back to native (red: full attention)",
                ylabel="top-1 agreement recovered (points)")
    axes[1].bar(layers, [100 * (1 - results[f"layer {i}"]["kl"] / base["kl"]) for i in layers], color=colors)
    axes[1].set(xlabel="target layer put back to native (red: full attention)", ylabel="KL removed (%)")
    for ax in axes:
        ax.set_xticks(list(layers))
        ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
