"""The `hf-mot` command.

    hf-mot generate --context-file doc.txt --prompt " Question: ... Answer:"
    hf-mot translate --context-file doc.txt --output doc.cache.safetensors
    hf-mot train --source smollm2-135m --target gemma3-270m --output-dir runs/pair
    hf-mot fit-layers --translator PATH_OR_REPO --output-dir runs/fitted
    hf-mot evaluate --translator PATH_OR_REPO --output-dir results/
    hf-mot push PATH ORG/NAME
    hf-mot info PATH_OR_REPO
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

UNTRAINED = "untrained"


def _read_context(args: argparse.Namespace) -> str:
    if args.context_file is not None:
        return Path(args.context_file).read_text(encoding="utf-8")
    return args.context


DEFAULT_SOURCE, DEFAULT_TARGET = "smollm2-135m", "gemma3-270m"


def _load_pair(args: argparse.Namespace):
    """The source, target and translator named on the command line (the shipped default if none is named), and
    the translator's name. A translator named without --source/--target brings the models it was built for."""
    from . import MoTConfig, MoTPair, MoTTranslator, load_model
    from .hub import DEFAULT_TRANSLATORS

    name = args.translator
    if name in (None, UNTRAINED):
        args.source, args.target = args.source or DEFAULT_SOURCE, args.target or DEFAULT_TARGET
    if name is None:
        name = DEFAULT_TRANSLATORS.get((args.source, args.target))
        if name is None:
            raise ValueError(
                f"No translator ships for {args.source} -> {args.target}: pass --translator PATH_OR_REPO (train one "
                f"with `hf-mot train`), or --translator {UNTRAINED} to see the mechanics with a random one."
            )
    if name == UNTRAINED:
        print(f"Loading source {args.source} and target {args.target} ...", file=sys.stderr)
        (source, source_tok), (target, target_tok) = load_model(args.source), load_model(args.target)
        print("warning: a randomly initialised translator shows the mechanics, not the quality.", file=sys.stderr)
        config = MoTConfig.from_models(
            source.config, target.config, source_tokenizer=source_tok, target_tokenizer=target_tok
        )
        return source, source_tok, target, target_tok, MoTTranslator(config).eval(), name
    translator = MoTTranslator.from_pretrained(name)
    recorded = translator.config.source_layout.name_or_path, translator.config.target_layout.name_or_path
    print(f"Loading source {args.source or recorded[0]}, target {args.target or recorded[1]} and translator {name} "
          "...", file=sys.stderr)
    pair = MoTPair.from_pretrained(translator, source=args.source, target=args.target)
    return (pair.source_model, pair.source_tokenizer, pair.target_model, pair.target_tokenizer, pair.translator,
            name)


def _generate(args: argparse.Namespace) -> None:
    import contextlib

    import torch
    from transformers import DynamicCache

    from . import translate_context
    from ._compat import cache_kwarg
    from .alignment import encode_contexts
    from .pipeline import prefill_source, read_into_cache

    context = _read_context(args)
    torch.manual_seed(args.seed)
    source, source_tok, target, target_tok, translator, _ = _load_pair(args)

    # The source reads the document once (in a multi-agent system it already has); only translation is timed.
    source_enc = encode_contexts(source_tok, [context])
    source_cache = prefill_source(source, source_enc)

    def translate():
        return translate_context(
            context, translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
            target_tokenizer=target_tok, source_cache=source_cache, native_tail=args.native_tail,
            recompute=args.recompute, strategy=args.strategy,
        )

    target_ids = encode_contexts(target_tok, [context]).input_ids

    def native_prefill():
        with torch.no_grad():
            native = DynamicCache(config=target.config)
            read_into_cache(target, native, target_ids)
        return native

    # Each is run once untimed first: first calls pay one-off costs (kernel selection, allocations).
    translate_s, cache = _timed(translate)
    native_s, native_cache = _timed(native_prefill)

    prompt = target_tok(args.prompt, return_tensors="pt", add_special_tokens=False).input_ids

    def answer(context_cache, mask):
        # The translator's target adapter, if it has one, is on only while the target reads the translated cache.
        with translator.adapt_target(target) if context_cache is cache else contextlib.nullcontext():
            out = target.generate(input_ids=prompt, attention_mask=mask, max_new_tokens=args.max_new_tokens,
                                  do_sample=False, **{cache_kwarg(target): context_cache})
        # On one line: the two answers are read side by side.
        return " ".join(target_tok.decode(out[0, prompt.shape[1] :], skip_special_tokens=True).split())

    print(f"answer: {answer(cache, cache.generation_mask(prompt.shape[1]))}")
    own_mask = torch.ones(1, target_ids.shape[1] + prompt.shape[1], dtype=torch.long)
    print(f"target's own answer (it reads the context itself): {answer(native_cache, own_mask)}")
    tokens, read = cache.num_context_tokens, cache.native_tokens  # the cache has grown by the answer
    if read == tokens:
        how = " (all read natively)"
    elif cache.native_layers and args.strategy == "deviation":
        how = " (layer 0, the last tokens and the most deviating read natively)"
    elif cache.native_layers:
        how = f" (layers 0-{cache.native_layers - 1} read natively)"
    else:
        how = f" (last {read} read natively)" if read else ""
    print(
        f"context: {tokens} target tokens; translation{how}: "
        f"{translate_s:.3f} s; native prefill of the target: {native_s:.3f} s ({native_s / translate_s:.1f}x)"
    )


def _translate(args: argparse.Namespace) -> None:
    """The source reads the context; the translated cache is saved to a safetensors file, or to a store that
    vLLM serves it from (hf_mot.integrations.vllm)."""
    from . import translate_context

    if args.output is not None and not str(args.output).endswith(".safetensors"):
        raise ValueError(f"--output must end in .safetensors, got {args.output}.")
    if args.to_vllm_store is not None and (args.native_tail or args.recompute is not None or args.strategy):
        raise ValueError(
            "--to-vllm-store writes the whole translation; the connector applies the dial when it serves the entry "
            "(its `recompute` setting, or the request's). Drop --native-tail/--recompute/--strategy."
        )
    context = _read_context(args)
    source, source_tok, target, target_tok, translator, _ = _load_pair(args)
    if args.to_vllm_store is not None:
        from .integrations.vllm_store import write_store_entries

        start = time.perf_counter()
        (path,) = write_store_entries(
            args.to_vllm_store, context, translator=translator, source_model=source, source_tokenizer=source_tok,
            target_model=target, target_tokenizer=target_tok,
        )
        seconds = time.perf_counter() - start
        print(
            f"wrote {path} ({seconds:.3f} s). Serve it with vLLM: kv_transfer_config={{'kv_connector': "
            f"'MoTConnector', 'kv_connector_module_path': 'hf_mot.integrations.vllm', 'kv_role': 'kv_consumer', "
            f"'kv_connector_extra_config': {{'store': '{args.to_vllm_store}'}}}} and the request's "
            f"cache_salt='{path.parent.name}'."
        )
        return
    start = time.perf_counter()
    cache = translate_context(
        context, translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
        target_tokenizer=target_tok, native_tail=args.native_tail, recompute=args.recompute, strategy=args.strategy,
    )
    seconds = time.perf_counter() - start
    cache.save(args.output)
    print(
        f"wrote {args.output}: {cache.get_seq_length()} target tokens, {len(cache.layers)} layers, "
        f"{cache.native_tokens} read natively; source prefill + translation took {seconds:.3f} s. Load it with "
        "`TranslatedCache.load(path, target_model.config)`."
    )


def _push(args: argparse.Namespace) -> None:
    """Upload a saved translator (config, weights, modeling files, model card) to a Hub repo."""
    from . import MoTTranslator

    translator = MoTTranslator.from_pretrained(args.path)
    commit = translator.push_to_hub(
        args.repo_id, revision=args.revision, private=args.private or None, commit_message=args.commit_message
    )
    print(f"pushed {args.path} to {args.repo_id} ({args.revision or 'main'}): {commit.commit_url}")


def _evaluate(args: argparse.Namespace) -> None:
    """Every evaluation task for one (source, target, translator) triple, side by side: the target with no
    context, reading the context natively, and from the translated cache (pure translation, and each --recompute
    point). Writes
    evaluation.json, evaluation.md and evaluation.png to --output-dir."""
    from .evaluation.report import run_evaluation, write_report

    source, source_tok, target, target_tok, translator, translator_name = _load_pair(args)
    report = run_evaluation(
        translator=translator, source_model=source, source_tokenizer=source_tok, target_model=target,
        target_tokenizer=target_tok, tasks=tuple(args.tasks), limit=args.limit, lengths=tuple(args.lengths),
        recompute=tuple(args.recompute), native_tail=args.native_tail, seed=args.seed,
    )
    models = {"source": args.source, "target": args.target, "translator": translator_name}
    paths = write_report(report, args.output_dir, "hf-mot " + " ".join(sys.argv[1:]), models)
    print(Path(paths["markdown"]).read_text(encoding="utf-8"))
    print("wrote " + ", ".join(str(p) for p in paths.values()))


def _fit_layers(args: argparse.Namespace) -> None:
    """Give a translator dedicated maps for the target layers retrieval lives in (by default the target's
    full-attention layers) and fit them: a closed-form ridge start, then a distillation of the target's own attention
    at question, answer and continuation positions (hf_mot.training.layer_fit). The rest of the translator is kept.
    Writes the translator and layer_fit.json (the attention error per layer before and after) to --output-dir."""
    import json
    import tempfile

    from .files import write_text_atomically
    from .kv import key_norm
    from .training.layer_fit import (
        LAYER_FIT_RECORD,
        default_source_layers,
        fit_dedicated_layers,
        with_dedicated_layers,
    )

    output = Path(args.output_dir)
    if output.exists() and any(output.iterdir()):
        raise ValueError(f"--output-dir {output} is not empty: name a new folder.")
    source, source_tok, target, target_tok, translator, translator_name = _load_pair(args)
    layout = translator.config.target_layout
    layers = args.layers
    if layers is None:
        layers = [i for i, kind in enumerate(layout.layer_types) if kind == "full_attention"]
        if not layers:
            raise ValueError("The target has no layer types to find its full-attention layers by: pass --layers.")
        if args.bottom_layers is not None:  # the target reads the layers up to that one itself
            layers = [i for i in layers if i > args.bottom_layers]
    source_layers = args.source_layers or default_source_layers(translator.config.source_layout.num_layers)
    # Keys are normalised where the target normalises its own (Gemma 3, Qwen 3), never elsewhere.
    normalize = key_norm(target, layers[0]) is not None
    translator = with_dedicated_layers(translator, layers, source_layers, key_norm=normalize,
                                       bottom_layers=args.bottom_layers, target_config=target.config,
                                       previous_tokens=args.previous_tokens,
                                       previous_tokens_keys_only=args.previous_tokens_keys_only)
    report = fit_dedicated_layers(
        translator, source, source_tok, target, target_tok, pairs=args.pairs, validation_pairs=args.validation_pairs,
        context_words=tuple(args.context_words), ridge=args.ridge, epochs=args.epochs,
        learning_rate=args.learning_rate, target_lora_rank=args.target_lora_rank,
        adapter_learning_rate=args.adapter_learning_rate, seed=args.seed,
    )
    report["command"] = "hf-mot " + " ".join(sys.argv[1:])
    report["started_from"] = translator_name
    output.parent.mkdir(parents=True, exist_ok=True)
    # Written whole into a folder beside the output, then renamed into place: a killed run leaves no half folder.
    with tempfile.TemporaryDirectory(prefix=f".{output.name}-", dir=output.parent) as staging:
        staged = Path(staging) / output.name
        translator.save_pretrained(staged)
        write_text_atomically(staged / LAYER_FIT_RECORD, json.dumps(report, indent=2) + "\n")
        if output.exists():
            output.rmdir()
        staged.rename(output)
    for stage in ("without", "ridge", "distilled"):
        kl = ", ".join(f"{k:.3f}" for k in report[stage]["kl"])
        error = ", ".join(f"{e:.3f}" for e in report[stage]["output_error"])
        print(f"{stage:>10}: attention KL per layer {kl}; output error {error}")
    print(f"wrote {output}")


def _timed(fn):
    fn()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _info(args: argparse.Namespace) -> None:
    """Print which source and target models a translator was built for, its shape, and the figures its model
    card reports."""
    from huggingface_hub import ModelCard

    from . import MoTConfig
    from .hub import read_model_card, shipped_translator_dir

    location = shipped_translator_dir(args.translator) or args.translator
    config = MoTConfig.from_pretrained(location)
    source, target = config.source_layout, config.target_layout
    print(f"source: {source.name_or_path or '?'}  {source.describe()}")
    print(f"target: {target.name_or_path or '?'}  {target.describe()}")
    print(
        f"translator: {config.num_experts} experts (top-{config.num_experts_per_token}), hidden {config.hidden_size}, "
        f"expert width {config.expert_hidden_size}, all {target.num_layers} target layers, recommended recompute "
        f"{config.recompute:g}"
        + (", reads the target's token embeddings" if config.target_embedding_size else "")
    )
    card = read_model_card(location, {})
    results = ModelCard(card).data.eval_results if card else None
    if not results:
        print("measured: nothing reported in its model card (`hf-mot evaluate` measures it)")
    for result in results or []:
        print(f"measured: {result.task_name}, {result.dataset_name} ({result.dataset_split}): "
              f"{result.metric_type} = {result.metric_value}")


def _add_pair_arguments(parser: argparse.ArgumentParser, *, context: bool) -> None:
    if context:
        text = parser.add_mutually_exclusive_group(required=True)
        text.add_argument("--context", help="context text")
        text.add_argument("--context-file", help="file holding the context text (UTF-8)")
    parser.add_argument(
        "--source", default=None,
        help=f"source model: embedded name, path or repo id (default: the translator's own, else {DEFAULT_SOURCE})",
    )
    parser.add_argument(
        "--target", default=None,
        help=f"target model: embedded name, path or repo id (default: the translator's own, else {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--translator", default=None,
        help=f"translator path or repo id (default: the one shipped for the pair; '{UNTRAINED}': a random one)",
    )
    if context:
        parser.add_argument(
            "--native-tail", type=int, default=0, metavar="K",
            help="the target reads the last K context tokens itself, on top of the translation of the "
                 "rest (fixes last-state shift for K tokens of prefill; default 0)",
        )
        parser.add_argument(
            "--recompute", type=float, default=None, metavar="R",
            help="the speed/quality dial: the share of a native prefill the target may spend reading the context "
                 "itself, from 0 (pure translation) to 1 (its own prefill); default: the translator's recommended "
                 "value",
        )
        parser.add_argument(
            "--strategy", choices=("tail", "bottom", "deviation"), default=None,
            help="how --recompute is spent: 'tail' reads the last tokens, 'bottom' the bottom layers, 'deviation' "
                 "recomputes the last tokens and those whose translation deviates most (default: 'tail', or "
                 "'bottom' for a translator whose maps read the target's residual stream)",
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
    _add_pair_arguments(generate, context=True)
    generate.add_argument("--prompt", default=" Question: What is this text about? Answer:", help="target prompt")
    generate.add_argument("--max-new-tokens", type=int, default=24)
    generate.add_argument("--seed", type=int, default=0)
    generate.set_defaults(func=_generate)

    translate = commands.add_parser(
        "translate", help="save a translated cache to safetensors", description=_translate.__doc__
    )
    _add_pair_arguments(translate, context=True)
    where = translate.add_mutually_exclusive_group(required=True)
    where.add_argument("--output", help="where to write the cache (.safetensors)")
    where.add_argument(
        "--to-vllm-store", metavar="DIR",
        help="write the cache into a store that vLLM serves it from (hf_mot.integrations.vllm.MoTConnector)",
    )
    translate.set_defaults(func=_translate)

    evaluate = commands.add_parser("evaluate", help="QA, long-context, reuse and LM-fidelity evaluation",
                                   description=_evaluate.__doc__)
    _add_pair_arguments(evaluate, context=False)
    from .evaluation.report import TASKS

    evaluate.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS), help="tasks to run")
    evaluate.add_argument("--limit", type=int, default=50, help="examples per task (documents for reuse)")
    evaluate.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096],
                          help="long-context lengths in target tokens")
    evaluate.add_argument(
        "--recompute", type=float, nargs="+", default=[], metavar="R",
        help="add a condition per dial setting R in (0, 1]: the target spends that share of a prefill reading the "
             "context itself (pure translation, R=0, is always run)",
    )
    evaluate.add_argument(
        "--native-tail", type=int, default=0, metavar="K",
        help="add a condition in which the target reads the last K context tokens itself (default 0: none)",
    )
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--output-dir", default="results/evaluation", help="where the report goes")
    evaluate.set_defaults(func=_evaluate)

    push = commands.add_parser("push", help="upload a translator to the Hub", description=_push.__doc__)
    push.add_argument("path", help="folder written by save_pretrained (or a training output dir)")
    push.add_argument("repo_id", help="ORG/NAME on the Hub (created if missing)")
    push.add_argument("--revision", help="branch to push to (created from main if missing)")
    push.add_argument("--private", action="store_true", help="create the repo private")
    push.add_argument("--commit-message", default=None)
    push.set_defaults(func=_push)

    train = commands.add_parser(
        "train", help="train a translator for a model pair", add_help=False,
        description="Train a translator (all options: hf-mot train --help).",
    )
    train.set_defaults(func=None)

    fit = commands.add_parser("fit-layers", help="fit dedicated maps for the layers retrieval lives in",
                              description=_fit_layers.__doc__)
    _add_pair_arguments(fit, context=False)
    fit.add_argument("--output-dir", required=True, help="new folder for the fitted translator")
    fit.add_argument("--layers", type=int, nargs="+", default=None,
                     help="target layers to dedicate maps to (default: its full-attention layers)")
    fit.add_argument("--source-layers", type=int, nargs="+", default=None,
                     help="source layers the maps read (default: 10 evenly spaced, ending with the last)")
    fit.add_argument("--pairs", type=int, default=240, help="training pairs (default 240)")
    fit.add_argument("--validation-pairs", type=int, default=24, help="validation pairs (default 24)")
    fit.add_argument("--context-words", type=int, nargs=2, default=[200, 1100], metavar=("MIN", "MAX"),
                     help="context length range in words (default 200 1100)")
    fit.add_argument("--ridge", type=float, default=1e-3,
                     help="ridge penalty, relative to the inputs' mean square (default 1e-3)")
    fit.add_argument("--epochs", type=int, default=4, help="distillation epochs (default 4)")
    fit.add_argument("--learning-rate", type=float, default=1e-4, help="distillation learning rate (default 1e-4)")
    fit.add_argument("--target-lora-rank", type=int, default=None,
                     help="also train a LoRA of this rank on the target's query projections of those layers, jointly "
                          "with the maps; saved next to the translator as a PEFT adapter and active only while the "
                          "target reads a translated cache (default: none)")
    fit.add_argument("--adapter-learning-rate", type=float, default=1e-3,
                     help="the target LoRA's learning rate (default 1e-3)")
    fit.add_argument("--bottom-layers", type=int, default=None, metavar="K",
                     help="the maps read the target's own residual stream entering layer K in place of its token "
                          "embeddings; the translator then works with translate_context(..., strategy='bottom'), "
                          "the target reading its layers 0..K-1 itself, and recommends the recompute that costs "
                          "(default: none; for Gemma 3, 5: its first full-attention layer)")
    fit.add_argument("--previous-tokens", type=int, default=0, metavar="N",
                     help="the maps also read the target's embeddings of the N tokens before each token, which "
                          "keys that a repeat of the text before them finds carry (default 0; not with "
                          "--bottom-layers)")
    fit.add_argument("--previous-tokens-keys-only", action="store_true",
                     help="only the key maps read the tokens before (--previous-tokens); retrieval finds facts "
                          "through the keys, and the value maps stay as small as without them")
    fit.add_argument("--seed", type=int, default=0)
    fit.set_defaults(func=_fit_layers)

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
    # What bad input or a missing file or package raises, as one line. Not TypeError: past argparse, one is a bug,
    # and its traceback is what a report needs.
    except (ValueError, FileNotFoundError, ModuleNotFoundError, OSError) as error:
        print(f"hf-mot {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
