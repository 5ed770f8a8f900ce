"""Model hyperparameters: one dataclass shared by the builder, the config file and HF mapping.

`BertConfig` is the `model` section of a run config; its `task` (`model.task`, a `TaskConfig`)
records what a fine-tuned model is for, so a checkpoint's config alone is enough to rebuild,
export and serve it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# The fine-tuning tasks a checkpoint can be for (`model.task.name`); None = none (pre-training).
TASK_NAMES = ("squad", "classification")
# The encoders the builder emits (`model.architecture`).
ARCHITECTURES = ("bert", "groupbert")


@dataclass
class TaskConfig:
    """Settings of the fine-tuning task a model was trained for (the `model.task` mapping).

    Written by fine-tuning and `popbert import-hf`, read back by export, `export-hf` and
    serving: they must agree on one typed record, not on keys of a free-form dict. Fields that
    do not apply to the task stay None.
    """

    name: str | None = None  # one of TASK_NAMES, or None for a pre-training checkpoint
    # The Hugging Face class the weights correspond to, e.g. "BertForQuestionAnswering".
    hf_architecture: str | None = None
    lowercase: bool = True  # whether the WordPiece tokenizer lowercases (an uncased vocabulary)
    doc_stride: int | None = None  # squad: tokens between the starts of a context's windows
    max_query_length: int | None = None  # squad: question tokens kept
    num_labels: int | None = None  # classification: classes of the head
    labels: list[str] | None = None  # classification: class names, in label-id order

    def validate(self) -> None:
        """Raise ValueError naming the offending `model.task` key."""
        if self.name is not None and self.name not in TASK_NAMES:
            raise ValueError(f"model.task.name must be one of {', '.join(TASK_NAMES)} or null, "
                             f"got {self.name!r}")
        for key in ("doc_stride", "max_query_length"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"model.task.{key} must be >= 1 or null, got {value}")
        if self.num_labels is not None and self.num_labels < 2:
            raise ValueError(f"model.task.num_labels must be >= 2 or null, got {self.num_labels}")
        if self.name == "classification" and self.num_labels is None:
            raise ValueError("model.task.num_labels must be set for model.task.name "
                             "'classification'")
        if self.labels is not None and len(self.labels) != (self.num_labels or len(self.labels)):
            raise ValueError(f"model.task.labels names {len(self.labels)} classes but "
                             f"model.task.num_labels is {self.num_labels}")


@dataclass
class BertConfig:
    """Shape and behaviour of a BERT graph (the `model` section of a popbert config).

    Defaults are BERT-Base. Names follow Google's `bert_config.json` where one exists.
    """

    vocab_size: int = 30522
    hidden_size: int = 768
    num_layers: int = 12
    num_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    sequence_length: int = 128
    max_predictions_per_seq: int = 20
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layer_norm_eps: float = 1e-12
    initializer_range: float = 0.02
    # Placement: layers per device, e.g. [3, 7, 7, 7] for Large; None = no placement annotations.
    # A leading 0 ([0, 4, 4, 4]) puts the embeddings alone on device 0 (Graphcore's Base layout).
    layers_per_ipu: list[int] | None = None
    # Checkpoint each layer output (except each device's last) for recomputation.
    recompute: bool = False
    # "onnx" (standard opset 23) or "popart" (ai.onnx 11 + ai.graphcore).
    dialect: str = "onnx"
    # Packed sequences (Krell et al. 2021): each row holds up to `max_sequences_per_pack`
    # sequences; the pre-training graph then takes `position_ids`, `sequence_index` and
    # `cls_positions` inputs, and `max_predictions_per_seq` counts MLM slots per row (pack).
    packed: bool = False
    max_sequences_per_pack: int = 3
    # "bert" (Google's post-norm BERT, `builders/bert.py`) or "groupbert" (Chelombiev et al.
    # 2021: PreNorm layers of convolution, FFN, attention, FFN; `builders/groupbert.py`).
    architecture: str = "bert"
    # GroupBERT only: groups of the grouped (block-diagonal) FFN down-projection, which must
    # divide intermediate_size and hidden_size; the convolution module's kernel (odd, so "same"
    # padding is symmetric) and channels per group of its grouped 1-D convolution.
    ffn_groups: int = 4
    conv_kernel_size: int = 7
    conv_group_size: int = 16
    task: TaskConfig = field(default_factory=TaskConfig)

    def validate(self) -> None:
        """Raise ValueError naming the offending key when the shape is impossible."""
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size",
                    "max_position_embeddings", "type_vocab_size", "sequence_length",
                    "max_predictions_per_seq")
        for key in positive:
            if int(getattr(self, key)) <= 0:
                raise ValueError(
                    f"model.{key} must be a positive integer, got {getattr(self, key)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_heads ({self.num_heads})")
        if self.sequence_length > self.max_position_embeddings:
            raise ValueError(
                f"model.sequence_length ({self.sequence_length}) exceeds "
                f"model.max_position_embeddings ({self.max_position_embeddings})")
        if self.max_predictions_per_seq > self.sequence_length:
            raise ValueError(
                f"model.max_predictions_per_seq ({self.max_predictions_per_seq}) exceeds "
                f"model.sequence_length ({self.sequence_length})")
        for key in ("hidden_dropout", "attention_dropout"):
            p = float(getattr(self, key))
            if not 0.0 <= p < 1.0:
                raise ValueError(f"model.{key} must be in [0, 1), got {p}")
        if int(self.max_sequences_per_pack) < 1:
            raise ValueError(f"model.max_sequences_per_pack must be >= 1, "
                             f"got {self.max_sequences_per_pack}")
        if self.packed and self.max_sequences_per_pack > self.sequence_length // 2:
            raise ValueError(
                f"model.max_sequences_per_pack ({self.max_sequences_per_pack}) exceeds what "
                f"model.sequence_length ({self.sequence_length}) can hold (2 tokens each)")
        if self.dialect not in ("onnx", "popart"):
            raise ValueError(f"model.dialect must be 'onnx' or 'popart', got {self.dialect!r}")
        if self.layers_per_ipu is not None:
            if any(int(n) < 0 for n in self.layers_per_ipu) or not self.layers_per_ipu:
                raise ValueError(
                    f"model.layers_per_ipu must be a non-empty list of counts >= 0, "
                    f"got {self.layers_per_ipu}")
            if sum(self.layers_per_ipu) != self.num_layers:
                raise ValueError(
                    f"model.layers_per_ipu {self.layers_per_ipu} places "
                    f"{sum(self.layers_per_ipu)} layers but model.num_layers is {self.num_layers}")
        self._validate_architecture()
        self.task.validate()

    def _validate_architecture(self) -> None:
        """The GroupBERT keys: positive, and dividing the sizes they group."""
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"model.architecture must be one of {', '.join(ARCHITECTURES)}, "
                             f"got {self.architecture!r}")
        for key in ("ffn_groups", "conv_kernel_size", "conv_group_size"):
            if int(getattr(self, key)) <= 0:
                raise ValueError(
                    f"model.{key} must be a positive integer, got {getattr(self, key)}")
        if self.architecture != "groupbert":
            return
        for size in ("intermediate_size", "hidden_size"):
            if getattr(self, size) % self.ffn_groups:
                raise ValueError(f"model.ffn_groups ({self.ffn_groups}) must divide "
                                 f"model.{size} ({getattr(self, size)})")
        if self.hidden_size % self.conv_group_size:
            raise ValueError(f"model.conv_group_size ({self.conv_group_size}) must divide "
                             f"model.hidden_size ({self.hidden_size})")
        if self.conv_kernel_size % 2 == 0:
            raise ValueError(f"model.conv_kernel_size must be odd (\"same\" padding of k//2 "
                             f"each side), got {self.conv_kernel_size}")
