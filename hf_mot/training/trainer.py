"""MoTTrainer and MoTTrainingArguments: thin subclasses of transformers' Trainer and TrainingArguments."""

from __future__ import annotations

import os
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from ..evaluation.qa import answer, native_cache
from ..evaluation.tasks import QAExample
from ..pipeline import translate_context
from ..plotting import pyplot
from .losses import LossWeights, context_correction_loss


@dataclass
class MoTTrainingArguments(LossWeights, TrainingArguments):
    r"""
    [`~transformers.TrainingArguments`] plus the weights of the loss terms ([`LossWeights`]: `nll_weight`,
    `kv_weight`, `kl_weight`, `balance_weight`, `kl_first_weight`, `question_nll_weight`,
    `kv_full_attention_weight`, `hidden_weight`; 0 switches a term off) and:

    Args:
        fresh_learning_rate (`float`, *optional*): learning rate of the trainer's `fresh_parameters` (paths
            added at zero to a trained translator); the others keep `learning_rate`.
        time_budget_minutes (`float`, *optional*): stop, saving a checkpoint, once training has run this long.
    """

    fresh_learning_rate: float | None = field(
        default=None, metadata={"help": "learning rate of the paths added at zero to an --init-from translator "
                                        "(default: --learning-rate)"}
    )
    time_budget_minutes: float | None = field(
        default=None, metadata={"help": "stop and save a checkpoint once training has run this long"}
    )
    per_device_train_batch_size: int = field(
        default=8, metadata={"help": "pairs per forward pass (per process)", "aliases": ["--batch-size"]}
    )
    save_total_limit: int | None = field(
        default=None, metadata={"help": "newest checkpoints kept (0 or unset: every one, e.g. to pick one on a "
                                        "downstream task later)", "aliases": ["--keep-checkpoints"]}
    )
    # The batches carry an alignment object and columns the translator's forward does not name.
    remove_unused_columns: bool = field(default=False)
    # Experts the router did not pick in a step get no gradient; DDP must know that.
    ddp_find_unused_parameters: bool | None = field(default=True)
    report_to: None | str | list[str] = field(default="none")

    def __post_init__(self):
        # Both bases check their own fields (the loss weights come after `TrainingArguments`' in the field order,
        # so `MoTTrainingArguments("out_dir")` still means `output_dir`).
        TrainingArguments.__post_init__(self)
        LossWeights.__post_init__(self)
        if self.gradient_accumulation_steps < 1:
            raise ValueError(
                f"`gradient_accumulation_steps` must be 1 or more, got {self.gradient_accumulation_steps}."
            )
        if self.time_budget_minutes is not None and self.time_budget_minutes <= 0:
            raise ValueError(f"`time_budget_minutes` must be more than 0, got {self.time_budget_minutes}.")


class TimeBudget(TrainerCallback):
    """Stop (saving a checkpoint) once a wall-clock budget is spent."""

    def __init__(self, minutes: float):
        self.seconds = minutes * 60
        self.start = time.monotonic()

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.monotonic()  # the budget is for training, not for loading models and data

    def on_step_end(self, args, state, control, **kwargs):
        if time.monotonic() - self.start > self.seconds:
            control.should_training_stop = True
            control.should_save = True
            # The last checkpoint is a candidate for the best one too.
            control.should_evaluate = args.eval_strategy != "no"


class LossCurveCallback(TrainerCallback):
    """Writes `loss_curve.png` next to the checkpoints whenever one is saved, and at the end."""

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            write_loss_curve(state.log_history, args.output_dir)

    on_train_end = on_save


def write_loss_curve(log_history: list[dict], output_dir: str) -> str | None:
    """`loss_curve.png` in `output_dir`, or `None` when there is nothing to plot or no matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    rows = [row for row in log_history if "loss" in row and "step" in row]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [row["step"] for row in rows]
    for name in ("loss", "nll", "kv", "kl", "hidden"):
        if all(name in row for row in rows):
            ax.plot(steps, [row[name] for row in rows], label="total" if name == "loss" else name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
    evaluations = [row for row in log_history if "eval_qa_f1" in row and "step" in row]
    if evaluations:
        qa = ax.twinx()
        qa.plot([row["step"] for row in evaluations], [row["eval_qa_f1"] for row in evaluations], "o-",
                color="black", label="held-out QA F1, translated")
        qa.set_ylabel("QA F1 (recompute=0)")
        qa.legend(loc="upper right")
    fig.tight_layout()
    path = os.path.join(output_dir, "loss_curve.png")
    os.makedirs(output_dir, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=output_dir, suffix=".png", delete=False) as tmp:
        fig.savefig(tmp.name, dpi=110)
    os.replace(tmp.name, path)
    plt.close(fig)
    return path


# `torch.backends.cpu.get_cpu_capability()` values where bf16 matmuls have no hardware path. Every AVX-512 CPU
# reports "AVX512", with or without AVX-512 BF16 / AMX, so those are not warned about.
SLOW_BF16_CPUS = ("DEFAULT", "AVX2")


class MoTTrainer(Trainer):
    r"""
    [`~transformers.Trainer`] for a [`MoTTranslator`]: `compute_loss` runs the frozen source and target
    models and returns the next-token loss plus the Context Correction Loss. Checkpointing, logging, resuming
    and multi-process training (accelerate) are the Trainer's own.

    Args:
        model ([`MoTTranslator`]): the translator to train (the only trainable module).
        source_model / target_model (`PreTrainedModel`): frozen here; they are not saved with checkpoints.
        fresh_parameters (`list[str]`, *optional*): names of the translator's parameters that were added at zero
            to a trained translator; they learn at `args.fresh_learning_rate` when it is set.
        args ([`MoTTrainingArguments`]), and any other `Trainer` argument.

    Evaluation is QA, not a loss: `eval_dataset` is a list of extractive [`QAExample`]s (e.g.
    `needle_check_examples`), and `evaluate()` answers each from the translated cache at pure translation
    (recompute=0) and from the target's own reading (once, kept). It logs `eval_qa_f1`, `eval_native_f1` and
    `eval_qa_retention` (their ratio), so `metric_for_best_model="qa_f1"` with `load_best_model_at_end` keeps the
    checkpoint that answers best: the losses can stay level while retrieval is lost.

    Example:

    ```python
    >>> trainer = MoTTrainer(model=translator, args=MoTTrainingArguments("out", max_steps=100),
    ...                      source_model=src, target_model=tgt, train_dataset=dataset,
    ...                      data_collator=MoTDataCollator(src_tok, tgt_tok))
    >>> trainer.train()
    ```
    """

    def __init__(
        self, *args, source_model: PreTrainedModel, target_model: PreTrainedModel,
        source_tokenizer=None, target_tokenizer=None, fresh_parameters: list[str] | None = None, **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if not isinstance(self.args, MoTTrainingArguments):
            raise TypeError(f"`args` must be `MoTTrainingArguments`, got {type(self.args).__name__}.")
        if self.eval_dataset is not None:
            self._check_qa_examples(self.eval_dataset)
            if source_tokenizer is None or target_tokenizer is None:
                raise ValueError("QA evaluation (`eval_dataset`) answers with the models' tokenizers: pass "
                                 "`source_tokenizer` and `target_tokenizer` too.")
        self.source_tokenizer, self.target_tokenizer = source_tokenizer, target_tokenizer
        self._native_scores: dict[tuple[str, str], float] = {}
        self.model.check_pair(source_model, target_model)
        capability = torch.backends.cpu.get_cpu_capability()
        if self.args.bf16 and self.args.device.type == "cpu" and capability in SLOW_BF16_CPUS:
            # Measured on a 2-core AVX2 box: not one step of batch 4 x 4 in 9 min, against 83 s a step in fp32.
            warnings.warn(f"bf16 on this CPU ({capability}, no AVX-512) runs emulated matmuls, several times slower "
                          "than fp32: leave out --bf16 / `bf16=True`.", stacklevel=2)
        self.source_model = source_model.requires_grad_(False).eval().to(self.args.device)
        self.target_model = target_model.requires_grad_(False).eval().to(self.args.device)
        self.add_callback(LossCurveCallback())
        if self.args.time_budget_minutes is not None:
            self.add_callback(TimeBudget(self.args.time_budget_minutes))
        self._loss_parts: list[dict[str, float]] = []
        # Context tokens read since the last log, kept on the device between logs: counting them must not wait for
        # the GPU every step.
        self._context_tokens: torch.Tensor | int = 0
        self._since: float | None = None  # set by the first step: loading models and data is not reading
        names = dict(self.model.named_parameters())
        unknown = sorted(set(fresh_parameters or ()) - set(names))
        if unknown:
            raise ValueError(f"`fresh_parameters` names parameters the translator does not have: {unknown[:3]}.")
        self.fresh_parameters = [names[name] for name in fresh_parameters or ()]

    def create_optimizer(self, model=None):
        """The Trainer's optimizer, with the fresh parameters moved to a group of their own at
        `args.fresh_learning_rate` (the scheduler then scales both groups alike)."""
        created = self.optimizer is None  # the Trainer asks again later and gets the one it made
        optimizer = super().create_optimizer(model)
        if not created or self.args.fresh_learning_rate is None or not self.fresh_parameters:
            return optimizer
        fresh = {id(param) for param in self.fresh_parameters}
        for group in list(optimizer.param_groups):
            moved = [param for param in group["params"] if id(param) in fresh]
            if moved:
                group["params"] = [param for param in group["params"] if id(param) not in fresh]
                settings = {key: value for key, value in group.items() if key != "params"}
                optimizer.add_param_group({**settings, "params": moved, "lr": self.args.fresh_learning_rate})
        return optimizer

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # `bf16` autocasts the translator's forward only (accelerate wraps it); the frozen models run here, and
        # they are most of the cost.
        with torch.autocast(self.args.device.type, dtype=torch.bfloat16, enabled=self.args.bf16):
            parts = context_correction_loss(
                model, self.source_model, self.target_model, inputs, self.args
            )
        self._loss_parts.append(parts.detached())
        self._context_tokens = self._context_tokens + inputs["target_attention_mask"].sum()
        if self._since is None:
            self._since = time.monotonic()
        return (parts.total, {"loss": parts.total}) if return_outputs else parts.total

    @staticmethod
    def _check_qa_examples(examples) -> None:
        if isinstance(examples, dict) or not len(examples) or not all(
                isinstance(e, QAExample) and e.choices is None for e in examples):
            raise TypeError("`eval_dataset` must be a non-empty list of extractive `QAExample`s (e.g. "
                            "`hf_mot.evaluation.tasks.needle_check_examples(48)`): MoTTrainer evaluates by QA.")

    @torch.no_grad()
    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval") -> dict[str, float]:
        """QA F1 from the translated cache at recompute=0 and from the target's own reading, and their ratio; and
        the share of each's replies that contain an answer (`qa_found`, `native_found`: F1 also counts phrasing)."""
        examples = self.eval_dataset if eval_dataset is None else eval_dataset
        if examples is None:
            raise ValueError("No `eval_dataset`: pass QA examples to evaluate on (`needle_check_examples`).")
        self._check_qa_examples(examples)
        models = dict(source_model=self.source_model, source_tokenizer=self.source_tokenizer,
                      target_model=self.target_model, target_tokenizer=self.target_tokenizer)
        was_training = self.model.training
        self.model.eval()
        translated, native = [], []  # (F1, found) per question
        try:
            for example in tqdm(examples, desc="QA check", leave=False,
                                disable=self.args.disable_tqdm or not self.is_world_process_zero()):
                key = (example.context, example.question)
                if key not in self._native_scores:  # the target and its answers do not change while training
                    cache, mask = native_cache(self.target_model, self.target_tokenizer, example.context)
                    reply = answer(example, self.target_model, self.target_tokenizer, cache, mask)
                    self._native_scores[key] = (reply["score"], reply["found"])
                native.append(self._native_scores[key])
                cache = translate_context(example.context, translator=self.model, recompute=0.0, **models)
                reply = answer(example, self.target_model, self.target_tokenizer, cache, cache.attention_mask)
                translated.append((reply["score"], reply["found"]))
        finally:
            self.model.train(was_training)
        f1, found = (statistics.fmean(column) for column in zip(*translated, strict=True))
        native_f1, native_found = (statistics.fmean(column) for column in zip(*native, strict=True))
        metrics = {f"{metric_key_prefix}_qa_f1": f1, f"{metric_key_prefix}_native_f1": native_f1,
                   f"{metric_key_prefix}_qa_found": found, f"{metric_key_prefix}_native_found": native_found}
        # Undefined when the target answers none of them itself (a tiny or random target): then left out.
        if native_f1:
            metrics[f"{metric_key_prefix}_qa_retention"] = f1 / native_f1
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        if self._loss_parts and "loss" in logs:
            # The trajectory term is off by default; a column of zeros would only crowd the log.
            names = ("nll", "kv", "kl", "balance") + (("hidden",) if self.args.hidden_weight else ())
            for name in names:
                logs[name] = round(sum(p[name] for p in self._loss_parts) / len(self._loss_parts), 5)
            self._loss_parts.clear()
            # Every process reads its own batches; the main one logs, so the rate is its own times their number.
            if self._since is not None:
                elapsed = time.monotonic() - self._since
                logs["context_tokens_per_second"] = round(int(self._context_tokens) * self.args.world_size / elapsed)
            self._context_tokens, self._since = 0, time.monotonic()
        super().log(logs, *args, **kwargs)
