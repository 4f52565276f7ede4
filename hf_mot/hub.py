"""Where translators live: the ones shipped inside the package, model cards next to the weights, and uploads."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from .files import write_text_atomically

# The translator `hf-mot generate` uses when a (source, target) pair is given without `--translator`: each one ships
# inside the package.
DEFAULT_TRANSLATORS = {
    ("smollm2-135m", "gemma3-270m"): "hf-mot/smollm2-135m-to-gemma3-270m",
    ("gemma3-270m", "smollm2-135m"): "hf-mot/gemma3-270m-to-smollm2-135m",
}
# Repo ids of the shipped translators, and their folders under `hf_mot/pretrained/` (the repo's name).
SHIPPED_TRANSLATORS = {repo_id: repo_id.split("/", 1)[1] for repo_id in DEFAULT_TRANSLATORS.values()}

# What `push_to_hub` takes besides the repo id, and what `save_pretrained(push_to_hub=True, ...)` hands on to it.
PUSH_OPTIONS = ("commit_message", "commit_description", "private", "token", "revision", "create_pr", "tags")


def shipped_translator_dir(repo_id: str) -> str | None:
    """The packaged folder of a shipped translator, or `None` if `repo_id` is not one (or is not installed)."""
    name = SHIPPED_TRANSLATORS.get(repo_id)
    if name is None:
        return None
    folder = Path(__file__).parent / "pretrained" / name
    return str(folder) if (folder / "model.safetensors").is_file() else None


def read_model_card(name_or_path, kwargs: dict) -> str | None:
    """The `README.md` next to the weights (a folder or a Hub repo, with `from_pretrained`'s options), or `None`."""
    from transformers.utils import cached_file

    options = {k: kwargs[k] for k in ("revision", "cache_dir", "token", "local_files_only") if k in kwargs}
    path = cached_file(
        str(name_or_path), "README.md", _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False, **options,
    )
    return Path(path).read_text(encoding="utf-8") if path else None


def render_default_card(translator, repo_id: str) -> str | None:
    """A card rendered from the translator's config, or `None` where `hf_mot.model_card` is not installed."""
    # Imported by name: the modeling files uploaded for `trust_remote_code` do not carry model_card.py.
    try:
        model_card = importlib.import_module("hf_mot.model_card")
    except ImportError:
        return None
    parameters = sum(p.numel() for p in translator.parameters())
    return str(model_card.render_model_card(translator.config, repo_id, parameters=parameters))


def upload_folder(folder: str, repo_id: str, *, token=None, private=None, revision=None, commit_message=None,
                  commit_description=None, create_pr=False, tags=None):
    """Create `repo_id` (and the branch `revision`) if needed and upload `folder`, adding `tags` to its card."""
    from huggingface_hub import HfApi, ModelCard

    card_path = os.path.join(folder, "README.md")
    if tags and os.path.exists(card_path):
        card = ModelCard.load(card_path)
        card.data.tags = sorted(set(card.data.tags or []) | set(tags))
        write_text_atomically(card_path, str(card))
    api = HfApi(token=token)
    repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
    if revision is not None:
        api.create_branch(repo_id, branch=revision, exist_ok=True)
    return api.upload_folder(
        repo_id=repo_id, folder_path=folder, revision=revision, commit_message=commit_message or "Upload translator",
        commit_description=commit_description, create_pr=create_pr,
    )
