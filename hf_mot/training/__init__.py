"""Training translators: data, the Context Correction Loss, MoTTrainer."""

from .data import ContextContinuationDataset, MoTDataCollator
from .losses import LossWeights, context_correction_loss
from .trainer import MoTTrainer, MoTTrainingArguments

__all__ = [
    "ContextContinuationDataset",
    "LossWeights",
    "MoTDataCollator",
    "MoTTrainer",
    "MoTTrainingArguments",
    "context_correction_loss",
]
