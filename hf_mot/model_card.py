"""Model cards for translators: card data plus the template shipped in `hf_mot/templates/`."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .configuration_mot import MoTConfig
from .models import EMBEDDED_MODELS

TEMPLATE = Path(__file__).parent / "templates" / "model_card_template.md"
# What the usage snippet asks the target about its one-sentence document on the Eiffel Tower.
DEFAULT_USAGE_PROMPT = " Question: Who built the tower? Answer:"


def _hub_id(name: str) -> str:
    embedded = EMBEDDED_MODELS.get(name)
    return embedded.hub_id if embedded is not None else name


def render_model_card(
    config: MoTConfig,
    repo_id: str,
    *,
    source_load_name: str | None = None,
    target_load_name: str | None = None,
    training_description: str = "Not recorded for this translator.",
    usage_prompt: str = DEFAULT_USAGE_PROMPT,
    evaluation_description: str = "Not evaluated yet: `hf-mot evaluate --translator PATH` measures it.",
    fidelity: dict | None = None,
    qa: dict | None = None,
    parameters: int | None = None,
    datasets: list[str] | None = None,
    license: str = "apache-2.0",
) -> ModelCard:
    """Render the card of a translator. `usage_prompt` is what the usage snippet asks the target about its
    one-sentence document (a question, or text for the target to complete). `fidelity`
    (from `hf_mot.evaluation.summarize`, keyed by mode) and `qa` (task -> summary from `hf-mot evaluate`'s
    `evaluation.json`) become the card's `model-index`."""
    source, target = config.source_layout, config.target_layout
    paths = (
        f", a depth-matched path from {config.depth_matched_layers} source layers per target layer"
        if config.depth_matched_layers else ""
    )
    if config.dedicated_layers:
        paths += (
            f", maps of their own for target layers {config.dedicated_layers} reading source layers "
            f"{config.dedicated_source_layers}" + (" (keys RMS-normalised)" if config.dedicated_key_norm else "")
        )
        if config.dedicated_previous_tokens:
            paths += f" and the target's embeddings of the {config.dedicated_previous_tokens} tokens before each token"
            if config.dedicated_previous_tokens_keys_only:
                paths += " (the key maps only)"
    if config.target_adapter:
        paths += (
            f", and a LoRA on the target's query projections of those layers ({config.target_adapter}/, a PEFT "
            "adapter that `translator.adapt_target(target)` turns on while the target reads a translated cache)"
        )
    eval_results = []
    for mode, summary in (fidelity or {}).items():
        for metric, key in (("gap_closed", "gap_closed"), ("top1_agreement", "top1_agreement")):
            eval_results.append(
                EvalResult(
                    task_type="kv-cache-translation", task_name=f"LM fidelity ({mode} mode)",
                    dataset_type="hf_mot/validation", dataset_name="hf_mot held-out documents",
                    dataset_config=f"{mode} mode",  # the Hub groups results by task and dataset config
                    dataset_split="validation", metric_type=metric, metric_value=round(summary[key], 4),
                )
            )
    for task, summary in (qa or {}).items():
        metric = "accuracy" if task == "boolq" else "f1"
        for mode in ("full", "window"):
            if mode in summary:
                eval_results.append(
                    EvalResult(
                        task_type="question-answering", task_name=f"{task} from a translated cache ({mode} mode)",
                        dataset_type=f"hf_mot/{task}", dataset_name=task, dataset_config=f"{mode} mode",
                        dataset_split="evaluation",
                        metric_type=metric, metric_value=round(summary[mode]["score"], 4),
                    )
                )
    card_data = ModelCardData(
        library_name="hf_mot",
        base_model=[_hub_id(name) for name in (source.name_or_path, target.name_or_path) if name],
        tags=["kv-cache", "cache-translation", "mixture-of-translators", source.model_type, target.model_type],
        license=license,
        datasets=datasets,
        model_name=repo_id,
        eval_results=eval_results or None,
    )
    size = f"{parameters / 1e6:.1f}M parameters, " if parameters else ""
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        model_name=repo_id,
        repo_id=repo_id,
        source_name=source.name_or_path or source.model_type,
        target_name=target.name_or_path or target.model_type,
        source_description=source.describe(),
        target_description=target.describe(),
        translator_description=(
            f"{size}{config.num_experts} experts per mixture (top-{config.num_experts_per_token}), hidden size "
            f"{config.hidden_size}, expert width {config.expert_hidden_size}, reading all source layers"
            f"{' and the target token embeddings' if config.target_embedding_size else ''}{paths}, "
            f"every target layer translated; recommended `recompute` "
            f"{config.recompute:g} (what `translate_context(..., recompute=None)` uses)"
        ),
        source_load_name=source_load_name or source.name_or_path or "SOURCE_MODEL",
        target_load_name=target_load_name or target.name_or_path or "TARGET_MODEL",
        training_description=training_description,
        evaluation_description=evaluation_description,
        usage_prompt=usage_prompt,
    )
