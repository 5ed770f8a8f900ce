"""Model hyperparameters: one dataclass shared by the builder, the config file and HF mapping.

`BertConfig` is the `model` section of a run config; its `task` (`model.task`, a `TaskConfig`)
records what a fine-tuned model is for, so a checkpoint's config alone is enough to rebuild,
export and serve it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from popbert.builders.groupbert_config import GroupBertOptions, check_groupbert
from popbert.builders.modernbert_config import ModernBertOptions, check_modernbert
from popbert.rules import (
    POSITIVE_INT,
    Invalid,
    Rule,
    above,
    at_least,
    check_fields,
    one_of,
    setting,
    within,
)

# The fine-tuning tasks a checkpoint can be for (`model.task.name`); None = none (pre-training).
TASK_NAMES = ("squad", "classification", "token-classification", "embedding")
# How an embedding model is trained (`model.task.loss`): in-batch negatives (InfoNCE /
# sentence-transformers' MultipleNegativesRankingLoss), or CoSENT on scored pairs.
EMBEDDING_LOSSES = ("mnrl", "cosent")
# How an embedding export pools token states into one vector (sentence-transformers' names).
POOLINGS = ("mean", "cls", "max", "mean_sqrt_len")
# The encoders the builder emits (`model.architecture`).
ARCHITECTURES = ("bert", "groupbert", "modernbert")
# The ONNX dialects the builder writes (`model.dialect`): standard ONNX, or PopART's.
DIALECTS = ("onnx", "popart")


@dataclass
class TaskConfig:
    """Settings of the fine-tuning task a model was trained for (the `model.task` mapping).

    Written by fine-tuning and `popbert import-hf`, read back by export, `export-hf` and
    serving: they must agree on one typed record, not on keys of a free-form dict. Fields that
    do not apply to the task stay None.
    """

    # One of TASK_NAMES, or None for a pre-training checkpoint.
    name: str | None = setting(None, one_of(TASK_NAMES).or_null())
    # The Hugging Face class the weights correspond to, e.g. "BertForQuestionAnswering".
    hf_architecture: str | None = None
    lowercase: bool = True  # whether the WordPiece tokenizer lowercases (an uncased vocabulary)
    # squad: tokens between the starts of a context's windows; question tokens kept.
    doc_stride: int | None = setting(None, at_least(1).or_null())
    max_query_length: int | None = setting(None, at_least(1).or_null())
    # classification: classes; 1: one score (regression, as transformers' num_labels=1)
    num_labels: int | None = setting(None, at_least(1).or_null())
    labels: list[str] | None = None  # classification: class names, in label-id order
    # classification with one output: what its score goes through when served, as a
    # sentence-transformers CrossEncoder folder records it ("sigmoid": CrossEncoder.predict's
    # default; "identity"); None: the raw score (a regression model popbert trained).
    activation: str | None = setting(None, one_of(("sigmoid", "identity")).or_null())
    # embedding (`export --task embedding`): how token states become one vector per text, as
    # sentence-transformers' Pooling module names them, and whether it is L2-normalised;
    # None: mean pooling, not normalised. `prompts`: the text put before a query's or a
    # document's ({"query": "search_query: ", ...}).
    pooling: str | None = setting(None, one_of(POOLINGS).or_null())
    normalize: bool | None = None
    prompts: dict[str, str] | None = None
    # embedding training (`popbert finetune embedding`): the texts of one training row (anchor,
    # positive, hard negatives; or a scored pair's two), so the training graph's inputs are
    # [batch, texts, sequence]; the loss, its similarity scale, whether in-batch negatives also
    # go from positives to anchors, and the leading dimensions each trained on (Matryoshka).
    texts: int | None = setting(None, at_least(2).or_null())
    loss: str | None = setting(None, one_of(EMBEDDING_LOSSES).or_null())
    scale: float | None = setting(None, above(0).or_null())
    symmetric: bool | None = None
    matryoshka_dims: list[int] | None = None

    def validate(self) -> None:
        """Raise :class:`~popbert.rules.Invalid` (a ConfigError) naming the offending key."""
        check_fields(self, "model.task")
        if self.matryoshka_dims is not None and (
                not self.matryoshka_dims or not all(isinstance(d, int) and not isinstance(d, bool)
                                                    and d >= 1 for d in self.matryoshka_dims)):
            raise Invalid(f"model.task.matryoshka_dims must be a list of integers >= 1, got "
                          f"{self.matryoshka_dims!r}", "model.task.matryoshka_dims")
        if self.name in ("classification", "token-classification") and self.num_labels is None:
            raise Invalid(f"model.task.num_labels must be set for model.task.name "
                          f"{self.name!r}", "model.task.num_labels", "model.task.name")
        if self.num_labels == 1 and self.labels is not None:
            raise Invalid("model.task.labels names classes, but model.task.num_labels 1 is one "
                          "score (regression): remove the labels", "model.task.labels",
                          "model.task.num_labels")
        if self.labels is not None and len(self.labels) != (self.num_labels or len(self.labels)):
            raise Invalid(f"model.task.labels names {len(self.labels)} classes but "
                          f"model.task.num_labels is {self.num_labels}",
                          "model.task.labels", "model.task.num_labels")


@dataclass
class BertConfig:
    """Shape and behaviour of a BERT graph (the `model` section of a popbert config).

    Defaults are BERT-Base. Names follow Google's `bert_config.json` where one exists.
    """

    vocab_size: int = setting(30522, POSITIVE_INT)
    hidden_size: int = setting(768, POSITIVE_INT)
    num_layers: int = setting(12, POSITIVE_INT)
    num_heads: int = setting(12, POSITIVE_INT)
    intermediate_size: int = setting(3072, POSITIVE_INT)
    max_position_embeddings: int = setting(512, POSITIVE_INT)
    type_vocab_size: int = setting(2, POSITIVE_INT)
    sequence_length: int = setting(128, POSITIVE_INT)
    max_predictions_per_seq: int = setting(20, POSITIVE_INT)
    hidden_dropout: float = setting(0.1, within("[0, 1)"))
    attention_dropout: float = setting(0.1, within("[0, 1)"))
    layer_norm_eps: float = setting(1e-12, above(0))
    initializer_range: float = setting(0.02, at_least(0))  # the weights' standard deviation
    # Placement: layers per device, e.g. [3, 7, 7, 7] for Large; None = no placement annotations.
    # A leading 0 ([0, 4, 4, 4]) puts the embeddings alone on device 0 (Graphcore's Base layout).
    layers_per_ipu: list[int] | None = setting(None, Rule(
        lambda v: bool(v) and all(n >= 0 for n in v), "a non-empty list of counts >= 0",
        nullable=True))
    # Checkpoint each layer output (except each device's last) for recomputation.
    recompute: bool = False
    # "onnx" (standard opset 23) or "popart" (ai.onnx 11 + ai.graphcore).
    dialect: str = setting("onnx", one_of(DIALECTS))
    # Packed sequences (Krell et al. 2021): each row holds up to `max_sequences_per_pack`
    # sequences; the pre-training graph then takes `position_ids`, `sequence_index` and
    # `cls_positions` inputs, and `max_predictions_per_seq` counts MLM slots per row (pack).
    packed: bool = False
    # Next-sentence prediction in pre-training (Google's BERT). false: MLM only (RoBERTa, Liu et
    # al. 2019): no NSP head or pooler, and text becomes full rows of contiguous sentences.
    next_sentence_prediction: bool = True
    max_sequences_per_pack: int = setting(3, at_least(1))
    # The encoder family (`builders/families.py`): "bert" (Google's post-norm BERT,
    # `builders/bert_encoder.py`), "groupbert" (Chelombiev et al. 2021: PreNorm layers of
    # convolution, FFN, attention, FFN; its own settings in `model.groupbert`,
    # `builders/groupbert.py`) or "modernbert" (Warner et al.
    # 2024: rotary positions, GeGLU, alternating sliding-window attention; its own settings in
    # `model.modernbert`, `builders/modernbert.py`).
    architecture: str = setting("bert", one_of(ARCHITECTURES))
    groupbert: GroupBertOptions = field(default_factory=GroupBertOptions)
    modernbert: ModernBertOptions = field(default_factory=ModernBertOptions)
    task: TaskConfig = field(default_factory=TaskConfig)

    def validate(self) -> None:
        """Raise :class:`~popbert.rules.Invalid` (a ConfigError) naming the offending keys when
        the shape is impossible."""
        check_fields(self, "model")
        if self.hidden_size % self.num_heads:
            raise Invalid(f"model.hidden_size ({self.hidden_size}) must be divisible by "
                          f"model.num_heads ({self.num_heads})",
                          "model.hidden_size", "model.num_heads")
        if self.sequence_length > self.max_position_embeddings:
            raise Invalid(f"model.sequence_length ({self.sequence_length}) exceeds "
                          f"model.max_position_embeddings ({self.max_position_embeddings})",
                          "model.sequence_length", "model.max_position_embeddings")
        if self.max_predictions_per_seq > self.sequence_length:
            raise Invalid(f"model.max_predictions_per_seq ({self.max_predictions_per_seq}) "
                          f"exceeds model.sequence_length ({self.sequence_length})",
                          "model.max_predictions_per_seq", "model.sequence_length")
        if self.packed and self.max_sequences_per_pack > self.sequence_length // 2:
            raise Invalid(f"model.max_sequences_per_pack ({self.max_sequences_per_pack}) "
                          f"exceeds what model.sequence_length ({self.sequence_length}) can "
                          "hold (2 tokens each)", "model.max_sequences_per_pack",
                          "model.sequence_length", "model.packed")
        if self.layers_per_ipu is not None and sum(self.layers_per_ipu) != self.num_layers:
            raise Invalid(f"model.layers_per_ipu {self.layers_per_ipu} places "
                          f"{sum(self.layers_per_ipu)} layers but model.num_layers is "
                          f"{self.num_layers}", "model.layers_per_ipu", "model.num_layers")
        FAMILY_CHECKS[self.architecture](self)
        self.task.validate()


def check_sentence_pair_packing(config: BertConfig) -> None:
    """BERT and GroupBERT pack sentence pairs for NSP: packing MLM-only rows is refused."""
    if config.packed and not config.next_sentence_prediction:
        raise Invalid("model.packed packs sentence pairs for next-sentence prediction; "
                      "with model.next_sentence_prediction false rows are full chunks of "
                      "text with no padding to pack away", "model.packed",
                      "model.next_sentence_prediction")


def check_groupbert_family(config: BertConfig) -> None:
    """GroupBERT packs sentence pairs as BERT does, and its own keys fit the sizes."""
    check_sentence_pair_packing(config)
    check_groupbert(config)


# Each family's own config checks, by `model.architecture` (its options live beside them:
# GroupBERT's in `model.groupbert`, `groupbert_config.py`; ModernBERT's in `model.modernbert`,
# `modernbert_config.py`).
FAMILY_CHECKS: dict[str, Callable[[BertConfig], None]] = {
    "bert": check_sentence_pair_packing,
    "groupbert": check_groupbert_family,
    "modernbert": check_modernbert,
}
