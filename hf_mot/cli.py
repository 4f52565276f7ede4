"""The `hf-mot` command.

    hf-mot generate --context-file doc.txt --prompt " Question: ... Answer:"
    hf-mot train --source smollm2-135m --target gemma3-270m --output-dir runs/pair
    hf-mot info PATH_OR_REPO
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

UNTRAINED = "untrained"


def _generate(args: argparse.Namespace) -> None:
    import torch
    from transformers import DynamicCache

    from . import MoTConfig, MoTTranslator, load_model, translate_context
    from ._compat import cache_kwarg
    from .pipeline import encode_contexts, prefill_source

    if args.context_file is not None:
        context = Path(args.context_file).read_text(encoding="utf-8")
    else:
        context = args.context
    torch.manual_seed(args.seed)
    print(f"Loading source {args.source} and target {args.target} ...", file=sys.stderr)
    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    if args.translator == UNTRAINED:
        print(
            "warning: no translator given; using a randomly initialised one, so the answer shows the mechanics, "
            "not the quality. Pass --translator PATH_OR_REPO for a trained translator.",
            file=sys.stderr,
        )
        config = MoTConfig.from_models(
            source.config, target.config, source_tokenizer=source_tok, target_tokenizer=target_tok
        )
        translator = MoTTranslator(config)
    else:
        translator = MoTTranslator.from_pretrained(args.translator)
    translator.eval()

    # The source reads the document once (in a multi-agent system it already has); only translation is timed.
    source_enc = encode_contexts(source_tok, [context])
    source_cache = prefill_source(source, source_enc)

    def translate():
        return translate_context(
            context, translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
            target_tokenizer=target_tok, source_cache=source_cache, injection_mode=args.mode,
        )

    def native_prefill():
        with torch.no_grad():
            native = DynamicCache(config=target.config)
            target_ids = encode_contexts(target_tok, [context]).input_ids
            target.get_decoder()(input_ids=target_ids, use_cache=True, **{cache_kwarg(target): native})

    # Each is run once untimed first: first calls pay one-off costs (kernel selection, allocations).
    translate_s, cache = _timed(translate)
    native_s, _ = _timed(native_prefill)

    prompt = target_tok(args.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    out = target.generate(
        input_ids=prompt, attention_mask=cache.generation_mask(prompt.shape[1]), max_new_tokens=args.max_new_tokens,
        do_sample=False, **{cache_kwarg(target): cache},
    )
    answer = target_tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True)
    print(f"answer: {answer.strip()}")
    print(
        f"context: {cache.get_seq_length()} target tokens; translation ({cache.injection_mode} mode): "
        f"{translate_s:.3f} s; native prefill of the target: {native_s:.3f} s ({native_s / translate_s:.1f}x)"
    )


def _timed(fn):
    fn()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _info(args: argparse.Namespace) -> None:
    """Print which source and target models a translator was built for, and its shape."""
    from . import MoTConfig

    config = MoTConfig.from_pretrained(args.translator)
    source, target = config.source_layout, config.target_layout
    print(f"source: {source.name_or_path or '?'}  {source.describe()}")
    print(f"target: {target.name_or_path or '?'}  {target.describe()}")
    start, count = config.produced_layer_range()
    print(
        f"translator: {config.num_experts} experts (top-{config.num_experts_per_token}), hidden {config.hidden_size}, "
        f"expert width {config.expert_hidden_size}, {config.injection_mode} mode, "
        f"target layers {start}-{start + count - 1}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-mot", description="Continue one LLM from another LLM's KV cache.")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser(
        "generate",
        help="source reads a context, target answers a prompt from the translated cache",
        description="The source model reads a context; its cache is translated; the target answers the prompt "
        "from the translated cache. Prints the answer, the translation time and what the target's own prefill "
        "would have cost.",
    )
    text = generate.add_mutually_exclusive_group(required=True)
    text.add_argument("--context", help="context text")
    text.add_argument("--context-file", help="file holding the context text (UTF-8)")
    generate.add_argument("--prompt", default=" Question: What is this text about? Answer:", help="target prompt")
    generate.add_argument("--source", default="smollm2-135m", help="source model: embedded name, path or repo id")
    generate.add_argument("--target", default="gemma3-270m", help="target model: embedded name, path or repo id")
    generate.add_argument(
        "--translator", default=UNTRAINED, help=f"translator path or repo id (default: {UNTRAINED}, a random one)"
    )
    generate.add_argument("--mode", choices=["full", "window"], default=None, help="injection mode (default: config)")
    generate.add_argument("--max-new-tokens", type=int, default=24)
    generate.add_argument("--seed", type=int, default=0)
    generate.set_defaults(func=_generate)

    train = commands.add_parser(
        "train", help="train a translator for a model pair", add_help=False,
        description="Train a translator (all options: hf-mot train --help).",
    )
    train.set_defaults(func=None)

    info = commands.add_parser("info", help="what a translator was built for", description=_info.__doc__)
    info.add_argument("translator", help="translator path or repo id")
    info.set_defaults(func=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        # The training script owns its (long) argument list; hand it everything after `train`.
        from .training.train import main as train_main

        train_main(argv[1:])
        return 0
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except (ValueError, TypeError, FileNotFoundError, ModuleNotFoundError, OSError) as error:
        print(f"hf-mot {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
