"""Train a translator for any pair of causal LMs (the `hf-mot train` command and examples/training).

Usage:
    hf-mot train --source smollm2-135m --target gemma3-270m --output-dir runs/smollm2-to-gemma3 --max-steps 2000
    accelerate launch --num_processes 2 examples/training/train_translator.py --source ... --target ... ...

Re-running with the same `--output-dir` resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import fields

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from ..configuration_mot import MoTConfig
from ..files import write_json_atomically
from ..modeling_mot import MoTTranslator
from ..models import load_model
from .data import ContextContinuationDataset, MoTDataCollator
from .losses import LossWeights
from .trainer import MoTTrainer, MoTTrainingArguments
from .widen import widen_translator


class TimeBudget(TrainerCallback):
    """Stop (saving a checkpoint) once a wall-clock budget is spent."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60
        self.start = time.monotonic()

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() - self.start > self.seconds:
            control.should_training_stop = True
            control.should_save = True


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-mot train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    models = parser.add_argument_group("models")
    models.add_argument("--source", required=True, help="source model: embedded name, path or repo id")
    models.add_argument("--target", required=True, help="target model: embedded name, path or repo id")
    translator = parser.add_argument_group("translator")
    translator.add_argument("--init-from", help="start from this translator (path or repo id) instead of scratch")
    translator.add_argument(
        "--hidden-size", type=int, default=None,
        help="width of each mixture's shared representation (default 256; with --init-from: a larger value "
        "widens the loaded translator, which starts as it was)",
    )
    translator.add_argument(
        "--expert-hidden-size", type=int, default=None,
        help="width of each expert MLP (default 512; with --init-from: a larger value widens, as above)",
    )
    translator.add_argument("--num-experts", type=int, default=4)
    translator.add_argument("--num-experts-per-token", type=int, default=2)
    translator.add_argument("--architecture", choices=["mixture", "per_layer"], default="mixture",
                            help="mixture of translators, or the per-layer (Cache-to-Cache-style) baseline")
    translator.add_argument(
        "--target-tokens", action=argparse.BooleanOptionalAction, default=True,
        help="let the mixtures read the target's embedding of each target token (with --init-from: added, "
        "starting at zero, to a translator that lacks it)",
    )
    translator.add_argument(
        "--depth-matched-layers", type=int, default=2,
        help="source layers at the same relative depth that each target layer also reads through a linear map of "
        "its own (0: off; with --init-from: added, starting at zero, to a translator that lacks it)",
    )
    translator.add_argument(
        "--fresh-learning-rate", type=float, default=None,
        help="with --init-from: learning rate of the paths this run adds at zero (target-token reader, "
        "depth-matched path), so they catch up while the loaded weights move at "
        "--learning-rate (default: --learning-rate for all)",
    )
    translator.add_argument(
        "--train-only", nargs="+", default=None, metavar="NAME",
        help="train only the translator parameters whose names contain one of these (e.g. depth_matched; the names "
        "of the keys in model.safetensors); the rest stays frozen",
    )
    data = parser.add_argument_group("data")
    data.add_argument("--context-words", type=int, nargs=2, default=[48, 256], metavar=("MIN", "MAX"))
    data.add_argument("--continuation-words", type=int, default=24)
    data.add_argument("--max-train-chunks", type=int, default=None)
    data.add_argument(
        "--recall-fraction", type=float, default=0.0,
        help="share of training pairs whose continuation repeats a span of their own context (trains the "
        "translated cache for copying and retrieval; 0: plain continuations only)",
    )
    data.add_argument(
        "--question-fraction", type=float, default=0.0,
        help="share of training pairs whose continuation asks for a span of their context by the words before it "
        "and answers with it, in the QA prompts' Question:/Answer: frame (with --recall-fraction: at most 1 in all)",
    )
    losses = parser.add_argument_group("loss weights (0 switches a term off)")
    losses.add_argument("--nll-weight", type=float, default=1.0)
    losses.add_argument("--kv-weight", type=float, default=1.0)
    losses.add_argument("--kl-weight", type=float, default=1.0)
    losses.add_argument(
        "--kl-first-weight", type=float, default=1.0,
        help="the KL at the first continuation position counts this many times, the excess halving at each later "
        "position: more weight where last-state shift bends the first generated tokens (1: uniform)",
    )
    losses.add_argument(
        "--question-nll-weight", type=float, default=1.0,
        help="the next-token loss on question pairs counts this much against the other pairs (0: they train "
        "through the KV and KL terms only, toward the native target's answer rather than the data's)",
    )
    losses.add_argument(
        "--kv-full-attention-weight", type=float, default=1.0,
        help="inside the KV term, the target's full-attention layers count this much against its sliding-window "
        "layers: only they reach past the window on long contexts (1: every layer alike)",
    )
    losses.add_argument("--balance-weight", type=float, default=0.01)
    losses.add_argument(
        "--hidden-weight", type=float, default=0.0,
        help="the target's per-layer hidden states at the continuation positions, RMS-normalised, against native: "
        "counts the cache's error where the continuation reads it (0: off)",
    )
    run = parser.add_argument_group("run")
    run.add_argument("--output-dir", required=True)
    run.add_argument("--max-steps", type=int, default=2000)
    run.add_argument("--batch-size", type=int, default=4, help="pairs per forward pass (per process)")
    run.add_argument("--gradient-accumulation-steps", type=int, default=1,
                     help="forward passes per optimizer step: the effective batch is batch size x this x processes, "
                          "at the memory of one batch")
    run.add_argument("--learning-rate", type=float, default=1e-3)
    run.add_argument("--warmup-steps", type=int, default=50)
    run.add_argument("--save-steps", type=int, default=100)
    run.add_argument("--keep-checkpoints", type=int, default=2,
                     help="newest checkpoints kept (0: keep every one, e.g. to pick one on a downstream task later)")
    run.add_argument("--logging-steps", type=int, default=10)
    run.add_argument("--time-budget-minutes", type=float, default=None, help="stop and save after this long")
    run.add_argument("--bf16", action="store_true", help="bf16 autocast: for GPUs and CPUs with fast bf16 matmuls "
                     "(check first: on AVX2-only CPUs it is much slower)")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-resume", action="store_true", help="start over even if checkpoints exist")
    return parser


# The config field of each path `--init-from` can add, and the KVMixture attribute that holds it.
ADDED_MODULES = {"target_embedding_size": "target_tokens", "depth_matched_layers": "depth_matched"}

RECORD = "train_command.json"
# Written by scripts/interpolate_translator.py instead of RECORD: the translator is a weighted mean of a run and
# its start, not trained itself.
INTERPOLATION_RECORD = "interpolation.json"


def record_command(args: argparse.Namespace, argv: list[str]) -> None:
    """Write the run's arguments to `RECORD` in its output dir (with those of the run it started from, if
    any), so that model cards can say how a translator was trained."""
    record = {"argv": argv, "args": vars(args)}
    if args.init_from and os.path.isfile(os.path.join(args.init_from, RECORD)):
        with open(os.path.join(args.init_from, RECORD), encoding="utf-8") as f:
            record["init_from_record"] = json.load(f)
    write_json_atomically(os.path.join(args.output_dir, RECORD), record)


def main(argv: list[str] | None = None) -> MoTTrainer:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.gradient_accumulation_steps < 1:
        parser.error(f"--gradient-accumulation-steps must be 1 or more, got {args.gradient_accumulation_steps}.")
    if args.keep_checkpoints < 0:
        parser.error(f"--keep-checkpoints must be 0 (keep every checkpoint) or more, got {args.keep_checkpoints}.")
    # Every loss weight has a `--X-weight` flag named after its `LossWeights` field.
    loss_weights = {f"{field.name}_weight": getattr(args, f"{field.name}_weight") for field in fields(LossWeights)}
    for name, value in loss_weights.items():
        if value < 0:
            parser.error(f"--{name.replace('_', '-')} must be 0 or more, got {value}.")
    if args.fresh_learning_rate is not None and not args.init_from:
        parser.error("--fresh-learning-rate is for the paths added to an --init-from translator; a translator "
                     "trained from scratch has none. Leave it out, or use --learning-rate.")
    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    fresh = []
    if args.init_from:
        translator = MoTTranslator.from_pretrained(args.init_from)
        config, added = translator.config, {}
        if config.architecture == "mixture":
            if args.target_tokens and config.target_embedding_size is None:
                added["target_embedding_size"] = target.config.get_text_config(decoder=True).hidden_size
            if args.depth_matched_layers and not config.depth_matched_layers:
                added["depth_matched_layers"] = args.depth_matched_layers
        if added:
            # The added paths start at zero: the new translator starts as the loaded one.
            translator = MoTTranslator.from_pretrained(args.init_from, **added)
            fresh = [name for name, _ in translator.named_parameters()
                     if any(f".{ADDED_MODULES[field]}." in name for field in added if field in ADDED_MODULES)]
        sizes = {"hidden_size": args.hidden_size, "expert_hidden_size": args.expert_hidden_size}
        for name, size in sizes.items():
            if size is not None and size < getattr(config, name):
                parser.error(f"--{name.replace('_', '-')} {size} is smaller than the {getattr(config, name)} of "
                             f"{args.init_from}: a loaded translator can be widened, not narrowed.")
        if any(size is not None and size > getattr(config, name) for name, size in sizes.items()):
            try:
                translator = widen_translator(translator, **sizes, seed=args.seed)
            except ValueError as error:  # widen_translator() says what cannot be widened; the CLI says how to go on
                parser.error(f"{args.init_from}: {error} Leave out --hidden-size/--expert-hidden-size.")
        # The loaded card states how the starting translator was trained and what it measured, not this run:
        # checkpoints get a card rendered from the config instead (ship_translator.py reads the start's own).
        translator.model_card = None
    else:
        config = MoTConfig.from_models(
            source.config, target.config, source_tokenizer=source_tok, target_tokenizer=target_tok,
            hidden_size=args.hidden_size or 256, expert_hidden_size=args.expert_hidden_size or 512,
            num_experts=args.num_experts,
            num_experts_per_token=args.num_experts_per_token,
            architecture=args.architecture, target_tokens=args.target_tokens,
            depth_matched_layers=args.depth_matched_layers if args.architecture == "mixture" else 0,
        )
        torch.manual_seed(args.seed)
        translator = MoTTranslator(config)
    if args.train_only:
        names = [name for name, _ in translator.named_parameters()]
        trained = [name for name in names if any(part in name for part in args.train_only)]
        if not trained:
            parser.error(f"--train-only {' '.join(args.train_only)} matches none of the translator's parameters "
                         f"({', '.join(names[:4])}, ...).")
        for name, param in translator.named_parameters():
            param.requires_grad_(name in trained)
    train_dataset = ContextContinuationDataset(
        "train", context_words=tuple(args.context_words), continuation_words=args.continuation_words,
        max_chunks=args.max_train_chunks, recall_fraction=args.recall_fraction,
        question_fraction=args.question_fraction, seed=args.seed,
    )
    training_args = MoTTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate, warmup_steps=args.warmup_steps, lr_scheduler_type="cosine",
        weight_decay=0.0, max_grad_norm=1.0, save_steps=args.save_steps,
        save_total_limit=args.keep_checkpoints or None,
        logging_steps=args.logging_steps, seed=args.seed, data_seed=args.seed, bf16=args.bf16,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        fresh_learning_rate=args.fresh_learning_rate, **loss_weights,
    )
    trainer = MoTTrainer(
        model=translator, args=training_args, source_model=source, target_model=target,
        train_dataset=train_dataset, data_collator=MoTDataCollator(source_tok, target_tok),
        fresh_parameters=fresh,
    )
    if args.time_budget_minutes is not None:
        trainer.add_callback(TimeBudget(args.time_budget_minutes))
    if trainer.is_world_process_zero():
        record_command(args, argv)
    resume = not args.no_resume and os.path.isdir(args.output_dir)
    checkpoint = get_last_checkpoint(args.output_dir) if resume else None
    trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model(args.output_dir)
    trainer.save_state()
    return trainer


if __name__ == "__main__":
    main()
