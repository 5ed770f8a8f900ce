"""The BERT-family model builder: one graph op by op through the Builder, for any family.

`build_bert` reads top to bottom: inputs → the family's embeddings → its encoder layers, each
in its placement and pipeline stage, with recomputation checkpoints → the task head (MLM on the
masked positions only + NSP for pre-training, or a registered fine-tuning head) → losses and
accuracies. What differs between BERT, GroupBERT and ModernBERT is the family's
(`popbert.builders.families`); placement, stages, recomputation, heads and losses are shared
here. Packed rows and the two dialects: docs/design.md, section "popbert.builders.bert".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from popbert.builders import layers
from popbert.builders.bert_config import BertConfig
from popbert.builders.families import Inputs, family_of
from popbert.builders.placement import PlacementPlan
from popbert.graph.annotations import LOSS_MEAN_KEY, LossMean
from popbert.graph.builder import Builder, TensorInfo

BATCH = "batch_size"
# The symbolic sequence axis of `build_bert(..., dynamic_sequence=True)` graphs (inference
# exports, and training graphs whose batches are trimmed: `execution.trim_padding`).
SEQUENCE = "sequence_length"
# Their symbolic MLM prediction-slot axis (`masked_lm_positions`, `masked_lm_ids`).
PREDICTIONS = "predictions"
# Label of an unused NSP slot in a packed row (PyTorch's and HF's ignore index).
NSP_IGNORE = -100


@dataclass
class BertGraph:
    """A built graph: the builder plus the names of its inputs and outputs by role."""

    builder: Builder
    config: BertConfig
    task: str
    inputs: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, str] = field(default_factory=dict)
    batch_size: int | str = BATCH
    sequence_length: int | str | None = None  # set by build_bert: an int, or SEQUENCE
    # What the loss is the mean over, when a head knows (the model's metadata says it: a session
    # may then run a micro-batch in parts of similar length, `popbert.runtime.groups`).
    loss_mean: LossMean | None = None

    def add_input(self, name: str, shape: list, signed: bool = False) -> str:
        """An integer input; `signed` if it can hold negative values. Its type follows the
        dialect (`layers.input_dtype`: INT64, or UINT32/INT32 for PopART)."""
        dtype = layers.input_dtype(self.builder, signed)
        self.inputs[name] = self.builder.addInputTensor(TensorInfo(dtype, shape), name)
        return self.inputs[name]

    def add_float_input(self, name: str, shape: list) -> str:
        """A float32 input (a regression target)."""
        self.inputs[name] = self.builder.addInputTensor(TensorInfo("FLOAT", shape), name)
        return self.inputs[name]

    @property
    def loss(self) -> str | None:
        return self.outputs.get("loss")

    def model(self) -> onnx.ModelProto:
        model = self.builder.getModel()
        if self.loss_mean is not None and self.loss is not None:
            model.metadata_props.add(key=LOSS_MEAN_KEY, value=self.loss_mean.text())
        return model


@dataclass
class Encoded:
    """What every task head starts from: the encoder output, the pooled [CLS], the word table."""

    hidden: str
    pooled: str | None  # None: an MLM-only model has no pooler
    word_table: str
    input_mask: str | None = None  # [rows, S] 1 on real tokens (None for packed rows)


# A task head adds its own inputs (labels, positions), computes its outputs into
# `graph.outputs` and, with `with_loss`, a scalar "loss" output.
TaskHead = Callable[[Builder, BertConfig, layers.WeightInit, BertGraph, Encoded, bool], None]
TASK_HEADS: dict[str, TaskHead] = {}
# Heads that read nothing of the encoder but its pooled output: the last layer of a family that
# pools the first row ([CLS]) needs computing for that row alone (`build_bert`).
POOLED_ONLY_TASKS: set[str] = set()


def register_task(name: str, pooled_only: bool = False) -> Callable[[TaskHead], TaskHead]:
    """Register a head so `build_bert(config, task=name)` builds it (fine-tuning heads use it).
    `pooled_only`: the head reads `Encoded.pooled` and never `Encoded.hidden`."""
    def register(head: TaskHead) -> TaskHead:
        TASK_HEADS[name] = head
        if pooled_only:
            POOLED_ONLY_TASKS.add(name)
        return head
    return register


def build_bert(config: BertConfig, task: str = "pretraining", with_loss: bool = True,
               seed: int = 0, zeros: bool = False, batch_size: int | str = BATCH,
               dynamic_sequence: bool = False, all_rows: bool = False) -> BertGraph:
    """Emit the BERT graph for `task`.

    task="pretraining" with_loss=True is the training graph (labels in, losses and accuracies
    out); with_loss=False gives MLM/NSP logits for inference. task="encoder" outputs the last
    hidden state and the pooled [CLS] output like `transformers.BertModel`. Other tasks come
    from `register_task`. `zeros=True` skips random initialisation (fast structural builds).
    `batch_size` is the batch dimension of every input: symbolic by default, an int for a graph
    compiled for one micro batch (required by `model.dialect: popart`).

    `dynamic_sequence=True` gives every input a symbolic sequence axis (`SEQUENCE`) of any
    length up to `max_position_embeddings`, and the MLM slots a symbolic `PREDICTIONS` axis:
    reshapes go through 0/-1 or the inputs' `Shape`, positions are a `Slice` of the position
    table and the attention mask is expanded to the input's length. Inference exports use it,
    and so do training graphs fed batches cut to their longest row (`execution.trim_padding`).
    Static shapes are what IPUs compile, so the popart dialect and packing refuse the flag.

    A head that reads only the pooled output (`register_task(..., pooled_only=True)`:
    classification, regression, cross-encoders) of a family that pools the first row gets a
    last layer computed for that row alone: keys and values from every row, the rest for
    [CLS] (`Family.first_row_layer`). Its outputs equal the full layer's; `all_rows=True`
    computes every row anyway (to measure what that costs).
    """
    config.validate()
    if task not in TASK_HEADS:
        raise ValueError(f"unknown task {task!r}; expected one of {sorted(TASK_HEADS)}")
    b = Builder(dialect=config.dialect, graph_name=f"bert_{task}")
    layers.check_batch_size(b, batch_size)
    init = layers.WeightInit(config.initializer_range, seed=seed, zeros=zeros)
    plan = PlacementPlan(config)
    graph = BertGraph(b, config, task, batch_size=batch_size)
    if config.packed and task != "pretraining":
        raise ValueError(f"model.packed is for pre-training only; task {task!r} takes one "
                         f"sequence per row")
    if dynamic_sequence and (config.dialect != "onnx" or config.packed):
        raise ValueError("dynamic_sequence is for onnx-dialect graphs of unpacked rows; the "
                         "popart dialect and packed rows need model.sequence_length fixed")
    seq: int | str = SEQUENCE if dynamic_sequence else config.sequence_length
    graph.sequence_length = seq
    family = family_of(config)
    # A training row of several texts (an embedding pair: anchor, positive, negatives) has
    # inputs [batch, texts, sequence]; the encoder reads them as [batch x texts, sequence].
    texts = config.task.texts if with_loss and task == config.task.name else None
    shape = [batch_size, texts, seq] if texts else [batch_size, seq]

    def text_input(name: str) -> str:
        tensor = graph.add_input(name, shape)
        return b.aiOnnx.flatten([tensor], f"{name}/Texts", axis=2) if texts else tensor

    inputs = Inputs(text_input("input_ids"))
    if family.segments:
        inputs.segment_ids = text_input("segment_ids")
    if config.packed:
        # Packed rows: positions restart per sequence and attention stays within a sequence.
        inputs.position_ids = graph.add_input("position_ids", [batch_size, seq])
        inputs.sequence_index = graph.add_input("sequence_index", [batch_size, seq])
    else:
        inputs.input_mask = text_input("input_mask")

    with plan.scope(b, plan.embeddings):
        embedded = family.embed(b, config, init, inputs, seq, dynamic_sequence)
    hidden = embedded.hidden
    first_row_last = (not all_rows and task in POOLED_ONLY_TASKS and not config.packed
                      and family.first_row_layer is not None and family.pools_first_row(config))
    for index, where in enumerate(plan.layers):
        last = index == config.num_layers - 1
        layer = family.first_row_layer if first_row_last and last else family.layer
        with plan.scope(b, where):
            hidden = layer(b, config, init, hidden, embedded.context, index, seq)
            if family.final is not None and last:
                hidden = family.final(b, config, init, hidden)
            if config.recompute and plan.enabled and plan.checkpoint_layer(index):
                hidden = b.checkpointOutput([hidden])[0]

    with plan.scope(b, plan.heads):
        pooled = family.pool(b, config, init, graph, hidden, embedded.context, task)
        encoded = Encoded(hidden, pooled, embedded.word_table, inputs.input_mask)
        TASK_HEADS[task](b, config, init, graph, encoded, with_loss)
        # Outputs get plain names ("loss", "mlm_accuracy", ...) users can ask for.
        for role, tensor in graph.outputs.items():
            graph.outputs[role] = b.aiOnnx.identity([tensor], role)
            b.addOutputTensor(graph.outputs[role])
    return graph


@register_task("encoder")
def encoder_outputs(b: Builder, config: BertConfig, init: layers.WeightInit, graph: BertGraph,
                    encoded: Encoded, with_loss: bool) -> None:
    """`transformers.BertModel`'s outputs; no loss (it is for inference and feature export).
    An MLM-only model has no pooler, so no `pooler_output`."""
    graph.outputs["last_hidden_state"] = encoded.hidden
    if encoded.pooled is not None:
        graph.outputs["pooler_output"] = encoded.pooled


@register_task("pretraining")
def pretraining_head(b: Builder, config: BertConfig, init: layers.WeightInit, graph: BertGraph,
                     encoded: Encoded, with_loss: bool) -> None:
    """MLM on the masked positions + NSP; with labels, the summed loss and both accuracies.

    Packed: the MLM slots cover all sequences of a row, `nsp_logits` is [B, K, 2] (one per
    packed sequence) and `next_sentence_labels` [B, K] with `NSP_IGNORE` in unused slots.
    `model.next_sentence_prediction: false` (RoBERTa's MLM-only objective): no NSP head, no
    `next_sentence_labels` input, and the loss is the MLM loss alone.
    """
    preds: int | str = (PREDICTIONS if isinstance(graph.sequence_length, str)
                        else config.max_predictions_per_seq)
    positions = graph.add_input("masked_lm_positions", [graph.batch_size, preds])
    mlm_logits = mlm_head(b, config, init, encoded.hidden, positions, encoded.word_table)
    graph.outputs["mlm_logits"] = mlm_logits
    if not config.next_sentence_prediction:
        if with_loss:
            mlm_labels = graph.add_input("masked_lm_ids", [graph.batch_size, preds])
            graph.outputs.update(mlm_losses(b, config, mlm_logits, mlm_labels))
        return
    nsp_logits = nsp_head(b, config, init, encoded.pooled)
    graph.outputs["nsp_logits"] = nsp_logits
    if with_loss:
        mlm_labels = graph.add_input("masked_lm_ids", [graph.batch_size, preds])
        nsp_shape = ([graph.batch_size, config.max_sequences_per_pack] if config.packed
                     else [graph.batch_size])
        # Packed rows label unused NSP slots NSP_IGNORE (-100): a signed input.
        nsp_labels = graph.add_input("next_sentence_labels", nsp_shape, signed=config.packed)
        graph.outputs.update(losses(b, config, mlm_logits, nsp_logits, mlm_labels, nsp_labels))


def mlm_head(b: Builder, config: BertConfig, init: layers.WeightInit, hidden: str,
             positions: str, word_table: str) -> str:
    """Logits [B, P, V] at the masked positions only: dense, GELU, LayerNorm, then the
    projection tied to the word embedding (serialised over the vocabulary for PopART,
    `layers.tied_projection`) plus a bias; which of them carry biases is the family's."""
    h = config.hidden_size
    bias = family_of(config).head_bias(config)
    with b.nameScope("CLS"):
        masked = layers.gather_positions(b, hidden, positions, "Gather")  # [B, P, H]
        with b.nameScope("LMPrediction"):
            x = layers.gelu(b, layers.dense(b, masked, h, h, init, "Dense", bias=bias.dense))
            x = layers.layer_norm(b, x, h, config.layer_norm_eps, init, bias=bias.norm)
        logits = layers.tied_projection(b, x, word_table, "MLM/MatMul")
        if not bias.decoder:
            return b.aiOnnx.identity([logits], "mlm_logits")
        with b.nameScope("MLM"):
            decoder_bias = b.addInitializedInputTensor(init.constant([config.vocab_size], 0.0),
                                                       "Bias")
        return b.aiOnnx.add([logits, decoder_bias], "mlm_logits")


def nsp_head(b: Builder, config: BertConfig, init: layers.WeightInit, pooled: str) -> str:
    with b.nameScope("NSP"):
        return layers.dense(b, pooled, config.hidden_size, 2, init, "Cls")


def _flat_mlm(b: Builder, config: BertConfig, mlm_logits: str, mlm_labels: str
              ) -> tuple[str, str]:
    flat_logits = b.aiOnnx.reshape(
        [mlm_logits, b.addConstant(np.array([-1, config.vocab_size], np.int64), "shape")],
        "MLMLogitsFlat")
    flat_labels = b.aiOnnx.reshape(
        [mlm_labels, b.addConstant(np.array([-1], np.int64), "flat")], "MLMLabelsFlat")
    return flat_logits, flat_labels


def mlm_losses(b: Builder, config: BertConfig, mlm_logits: str, mlm_labels: str
               ) -> dict[str, str]:
    """MLM only: the loss (label 0 = padding, ignored; `loss` is `mlm_loss`) and accuracy."""
    with b.nameScope("Loss"):
        flat_logits, flat_labels = _flat_mlm(b, config, mlm_logits, mlm_labels)
        mlm_loss = layers.softmax_cross_entropy(b, flat_logits, flat_labels, 0, "mlm_loss")
        mlm_accuracy = layers.accuracy(b, flat_logits, flat_labels, 0, "mlm_accuracy")
    return {"loss": mlm_loss, "mlm_loss": mlm_loss, "mlm_accuracy": mlm_accuracy}


def losses(b: Builder, config: BertConfig, mlm_logits: str, nsp_logits: str, mlm_labels: str,
           nsp_labels: str) -> dict[str, str]:
    """MLM loss (label 0 = padding, ignored) + NSP loss, their sum, and both accuracies."""
    with b.nameScope("Loss"):
        flat_logits, flat_labels = _flat_mlm(b, config, mlm_logits, mlm_labels)
        mlm_loss = layers.softmax_cross_entropy(b, flat_logits, flat_labels, 0, "mlm_loss")
        nsp_ignore = None
        if config.packed:
            # One prediction per packed sequence; unused slots are labelled NSP_IGNORE, so
            # both means run over real sequences only, exactly as in the unpacked graph.
            nsp_logits = b.aiOnnx.reshape(
                [nsp_logits, b.addConstant(np.array([-1, 2], np.int64), "nsp_shape")],
                "NSPLogitsFlat")
            nsp_labels = b.aiOnnx.reshape(
                [nsp_labels, b.addConstant(np.array([-1], np.int64), "nsp_flat")],
                "NSPLabelsFlat")
            nsp_ignore = NSP_IGNORE
        nsp_loss = layers.softmax_cross_entropy(b, nsp_logits, nsp_labels, nsp_ignore,
                                                "nsp_loss")
        loss = b.aiOnnx.add([mlm_loss, nsp_loss], "loss")
        mlm_accuracy = layers.accuracy(b, flat_logits, flat_labels, 0, "mlm_accuracy")
        nsp_accuracy = layers.accuracy(b, nsp_logits, nsp_labels, nsp_ignore, "nsp_accuracy")
    return {"loss": loss, "mlm_loss": mlm_loss, "nsp_loss": nsp_loss,
            "mlm_accuracy": mlm_accuracy, "nsp_accuracy": nsp_accuracy}
