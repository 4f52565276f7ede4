"""Train a translator for any pair of causal LMs (the `hf-mot train` command and examples/training).

Usage:
    hf-mot train --source smollm2-135m --target gemma3-270m --output-dir runs/smollm2-to-gemma3 --max-steps 2000
    torchrun --standalone --nproc_per_node 2 examples/training/train_translator.py --source ... --target ... ...

Re-running with the same `--output-dir` resumes from its last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass, field, fields
from typing import Literal

import torch
from transformers import HfArgumentParser
from transformers.trainer_utils import get_last_checkpoint

from ..configuration_mot import MoTConfig
from ..evaluation.tasks import needle_check_examples
from ..files import write_json_atomically
from ..modeling_mot import MoTTranslator
from ..models import load_model
from .data import ContextContinuationDataset, MoTDataCollator
from .losses import LossWeights
from .trainer import MoTTrainer, MoTTrainingArguments
from .widen import widen_translator


@dataclass
class TranslatorArguments:
    """The model pair, the translator to train and where it starts."""

    source: str = field(metadata={"help": "source model: embedded name, path or repo id"})
    target: str = field(metadata={"help": "target model: embedded name, path or repo id"})
    init_from: str | None = field(
        default=None, metadata={"help": "start from this translator (path or repo id) instead of scratch"}
    )
    hidden_size: int | None = field(default=None, metadata={
        "help": "width of each mixture's shared representation (default 256; with --init-from: a larger value "
        "widens the loaded translator, which starts as it was)"})
    expert_hidden_size: int | None = field(default=None, metadata={
        "help": "width of each expert MLP (default 512; with --init-from: a larger value widens, as above)"})
    num_experts: int = field(default=4, metadata={"help": "translator experts per mixture"})
    num_experts_per_token: int = field(default=2, metadata={"help": "experts the router picks for each token"})
    architecture: Literal["mixture", "per_layer"] = field(default="mixture", metadata={
        "help": "mixture of translators, or the per-layer (Cache-to-Cache-style) baseline"})
    target_tokens: bool = field(default=True, metadata={
        "help": "let the mixtures read the target's embedding of each target token (with --init-from: added, "
        "starting at zero, to a translator that lacks it)"})
    depth_matched_layers: int = field(default=2, metadata={
        "help": "source layers at the same relative depth that each target layer also reads through a linear map "
        "of its own (0: off; with --init-from: added, starting at zero, to a translator that lacks it)"})
    train_only: list[str] = field(default_factory=list, metadata={
        "help": "train only the translator parameters whose names contain one of these (e.g. depth_matched; the "
        "names of the keys in model.safetensors); the rest stays frozen"})
    resume: bool = field(default=True, metadata={
        "help": "go on from the last checkpoint in --output-dir if there is one (--no-resume: start over)"})


@dataclass
class DataArguments:
    """How the (context, continuation) training pairs are cut from the offline corpus."""

    context_words: list[int] = field(default_factory=lambda: [48, 256], metadata={
        "help": "MIN MAX words of context per pair"})
    continuation_words: int = field(default=24, metadata={"help": "words of continuation per pair"})
    max_train_chunks: int | None = field(default=None, metadata={"help": "use at most this many training pairs"})
    recall_fraction: float = field(default=0.0, metadata={
        "help": "share of training pairs whose continuation repeats a span of their own context (trains the "
        "translated cache for copying and retrieval; 0: plain continuations only)"})
    question_fraction: float = field(default=0.0, metadata={
        "help": "share of training pairs whose continuation asks for a span of their context by the words before "
        "it and answers with it, in the QA prompts' Question:/Answer: frame (with --recall-fraction: at most 1 in "
        "all)"})
    retrieval_fraction: float = field(default=0.0, metadata={
        "help": "share of training pairs replaced by retrieval pairs: contexts of --retrieval-context-words that run "
        "on across documents, half with a made-up fact at a random depth and a question about it, the rest asking "
        "for or repeating a span (the pairs `hf-mot fit-layers` fits on); 0: none"})
    retrieval_context_words: list[int] = field(default_factory=lambda: [200, 2400], metadata={
        "help": "MIN MAX words of context per retrieval pair (MIN at least 20)"})
    qa_eval_examples: int = field(default=0, metadata={
        "help": "evaluate on this many held-out needle questions (made-up facts in the corpus's validation split, "
        "answered at recompute=0) at each --eval-strategy step: logs eval_qa_f1 and eval_qa_retention; with "
        "--load-best-model-at-end --metric-for-best-model qa_f1 the run ends on its best checkpoint (0: no "
        "evaluation)"})
    qa_eval_context_words: list[int] = field(default_factory=lambda: [200, 2000], metadata={
        "help": "MIN MAX words of context per evaluation question (MIN at least 20)"})


# `hf-mot train`'s defaults where they differ from `TrainingArguments`' (a translator trains from scratch in a few
# thousand small steps; the loaded weights of `--init-from` runs keep these unless told otherwise).
TRAIN_DEFAULTS = dict(max_steps=2000, per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=50,
                      save_steps=100, save_total_limit=2, logging_steps=10, lr_scheduler_type="cosine",
                      weight_decay=0.0, max_grad_norm=1.0, seed=0,
                      # Without a GPU, `torchrun --nproc_per_node N` gives N processes on the CPU (gloo) only when
                      # the arguments say CPU; otherwise each process trains alone on the whole data.
                      use_cpu=not torch.cuda.is_available(),
                      # On a GPU, worker processes tokenise and align the next batches while the card trains on this
                      # one; on a CPU they would take cores from the models' forward passes.
                      dataloader_num_workers=4 if torch.cuda.is_available() else 0)
# What the run record keeps of the training arguments (the rest are `TrainingArguments` defaults).
RECORDED_TRAINING = ("output_dir", "max_steps", "gradient_accumulation_steps", "learning_rate", "warmup_steps",
                     "seed", "bf16", "fresh_learning_rate", "time_budget_minutes",
                     *(f.name for f in fields(LossWeights)))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the help, and the usage examples of the description kept as written."""


def build_parser() -> HfArgumentParser:
    parser = HfArgumentParser((TranslatorArguments, DataArguments, MoTTrainingArguments), prog="hf-mot train",
                              description=__doc__, formatter_class=_HelpFormatter)
    parser.set_defaults(**TRAIN_DEFAULTS)
    return parser


# The config field of each path `--init-from` can add, and the KVMixture attribute that holds it.
ADDED_MODULES = {"target_embedding_size": "target_tokens", "depth_matched_layers": "depth_matched"}

RECORD = "train_command.json"
# Written by scripts/interpolate_translator.py instead of RECORD: the translator is a weighted mean of a run and
# its start, not trained itself.
INTERPOLATION_RECORD = "interpolation.json"


def record_command(model_args: TranslatorArguments, data_args: DataArguments, training_args: MoTTrainingArguments,
                   argv: list[str]) -> None:
    """Write the run's arguments to `RECORD` in its output dir (with those of the run it started from, if
    any), so that model cards can say how a translator was trained."""
    args = {**asdict(model_args), **asdict(data_args), "batch_size": training_args.per_device_train_batch_size,
            **{name: getattr(training_args, name) for name in RECORDED_TRAINING}}
    record = {"argv": argv, "args": args}
    if model_args.init_from and os.path.isfile(os.path.join(model_args.init_from, RECORD)):
        with open(os.path.join(model_args.init_from, RECORD), encoding="utf-8") as f:
            record["init_from_record"] = json.load(f)
    write_json_atomically(os.path.join(training_args.output_dir, RECORD), record)


def parse(parser: HfArgumentParser, argv: list[str]):
    """The three argument dataclasses; what `TrainingArguments` or the checks here refuse is a usage error."""
    if not any(arg.split("=")[0] in ("--output_dir", "--output-dir") for arg in argv) and argv[:1] != ["-h"] \
            and "--help" not in argv:
        parser.error("--output-dir is required: checkpoints, the model and its run record are written there.")
    try:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(argv)
    except ValueError as error:
        parser.error(str(error))
    for option, words, least in (("--context-words", data_args.context_words, 1),
                                 ("--retrieval-context-words", data_args.retrieval_context_words, 20),
                                 ("--qa-eval-context-words", data_args.qa_eval_context_words, 20)):
        if len(words) != 2 or not least <= words[0] <= words[1]:
            parser.error(f"{option} takes MIN MAX ({least} <= MIN <= MAX), got {words}.")
    if data_args.qa_eval_examples < 0:
        parser.error(f"--qa-eval-examples is a number of questions (0: none), got {data_args.qa_eval_examples}.")
    if data_args.qa_eval_examples and training_args.eval_strategy == "no":
        parser.error("--qa-eval-examples needs --eval-strategy steps --eval-steps N: when to evaluate (with "
                     "--save-steps a multiple of N, --load-best-model-at-end --metric-for-best-model qa_f1 keeps "
                     "the best checkpoint).")
    if training_args.eval_strategy != "no" and not data_args.qa_eval_examples:
        parser.error(f"--eval-strategy {training_args.eval_strategy.value} evaluates on held-out QA: add "
                     "--qa-eval-examples N (48 take about a minute per check on 2 CPU cores).")
    if not 0 <= data_args.retrieval_fraction <= 1:
        parser.error(f"--retrieval-fraction is a share of the pairs, in [0, 1]; got {data_args.retrieval_fraction}.")
    if training_args.fresh_learning_rate is not None and not model_args.init_from:
        parser.error("--fresh-learning-rate is for the paths added to an --init-from translator; a translator "
                     "trained from scratch has none. Leave it out, or use --learning-rate.")
    return model_args, data_args, training_args


def main(argv: list[str] | None = None) -> MoTTrainer:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args, data_args, training_args = parse(parser, argv)
    source, source_tok = load_model(args.source)
    target, target_tok = load_model(args.target)
    fresh = []
    if args.init_from:
        translator = MoTTranslator.from_pretrained(args.init_from)
        config, added = translator.config, {}
        if config.dedicated_bottom_layers is not None:
            parser.error(f"{args.init_from}'s dedicated maps read the target's residual stream, which this trainer "
                         "does not compute: continue from the translator they were fitted on (its model card names "
                         "it), then `hf-mot fit-layers --bottom-layers` again.")
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
                translator = widen_translator(translator, **sizes, seed=training_args.seed)
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
        torch.manual_seed(training_args.seed)
        translator = MoTTranslator(config)
    translator.config.record_weights(source, target)  # what it is trained with: check_pair warns on others
    if args.train_only:
        names = [name for name, _ in translator.named_parameters()]
        trained = [name for name in names if any(part in name for part in args.train_only)]
        if not trained:
            parser.error(f"--train-only {' '.join(args.train_only)} matches none of the translator's parameters "
                         f"({', '.join(names[:4])}, ...).")
        for name, param in translator.named_parameters():
            param.requires_grad_(name in trained)
    train_dataset = ContextContinuationDataset(
        "train", context_words=tuple(data_args.context_words), continuation_words=data_args.continuation_words,
        max_chunks=data_args.max_train_chunks, recall_fraction=data_args.recall_fraction,
        question_fraction=data_args.question_fraction, retrieval_fraction=data_args.retrieval_fraction,
        retrieval_context_words=tuple(data_args.retrieval_context_words), seed=training_args.seed,
    )
    if training_args.dataloader_num_workers:
        # The tokenizers' own threads cannot survive the fork into the workers; the workers are the parallelism.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # One fixed draw, whatever the run's seed: runs are compared on the same questions.
    eval_dataset = needle_check_examples(
        data_args.qa_eval_examples, context_words=tuple(data_args.qa_eval_context_words)
    ) if data_args.qa_eval_examples else None
    trainer = MoTTrainer(
        model=translator, args=training_args, source_model=source, target_model=target,
        train_dataset=train_dataset, data_collator=MoTDataCollator(source_tok, target_tok),
        eval_dataset=eval_dataset, source_tokenizer=source_tok, target_tokenizer=target_tok,
        fresh_parameters=fresh,
    )
    if trainer.is_world_process_zero():
        record_command(args, data_args, training_args, argv)
    output_dir = training_args.output_dir
    checkpoint = get_last_checkpoint(output_dir) if args.resume and os.path.isdir(output_dir) else None
    trainer.train(resume_from_checkpoint=checkpoint)
    trainer.save_model(output_dir)
    trainer.save_state()
    return trainer


if __name__ == "__main__":
    main()
