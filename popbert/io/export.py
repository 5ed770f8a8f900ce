"""Inference export: the same BERT graph with trained weights, standard opset, checked in ORT.

The exported model is verified at export time: ONNX Runtime runs the written file and the torch
backend runs the FP32 graph on a sample batch, and they must agree, so a file that leaves here
is known to compute what training computed. Tasks, options and the metadata an export carries:
docs/design.md, section "popbert.io.export".
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

import popbert.builders.tasks  # noqa: F401  (registers the squad and classification heads)
from popbert.atomic import atomic_write_bytes, reported
from popbert.builders.bert import BATCH, SEQUENCE, build_bert
from popbert.builders.bert_config import TASK_NAMES, BertConfig
from popbert.errors import CheckpointError, UsageError
from popbert.graph.annotations import METADATA_PREFIX, strip_annotations, trainable_initializers

log = logging.getLogger(__name__)

TASKS = ("pretraining", "encoder", "squad", "classification")
# The float formats an inference export may be written in (`popbert export --dtype`).
EXPORT_DTYPES = ("float32", "float16")
# ORT's fused CPU kernels (Attention, LayerNorm, GELU) reorder FP32 sums; logits of O(10) agree
# to a few 1e-6 in practice; 1e-4 of the output's scale (at least 1e-4 absolute) leaves margin
# without hiding a wrong weight. Relative, because FP32 rounding is: a model with huge weights
# (a run trained with far too high a learning rate) has logits of 1e5 that agree to 1e-6 of that.
VERIFY_ATOL = 1e-4
# FP16 has 11 significant bits (relative step 9.8e-4); over a dozen layers rounding compounds to
# about 1e-2 of an output's scale, while a wrong or missing weight changes outputs by O(1).
FP16_TOLERANCE = 3e-2
# Protobuf cannot serialize 2 GiB; above this many bytes of weights, use external data.
EXTERNAL_DATA_THRESHOLD = 2**31 - 2**27


def with_weights(model: onnx.ModelProto, weights: Mapping[str, torch.Tensor | np.ndarray]
                 ) -> onnx.ModelProto:
    """Replace the graph's initializers by `weights` (FP32), by ONNX name."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = {t.name for t in out.graph.initializer}
    for index, tensor in enumerate(out.graph.initializer):
        if tensor.name in weights:
            value = weights[tensor.name]
            array = (value.detach().float().cpu().numpy() if isinstance(value, torch.Tensor)
                     else np.asarray(value, np.float32))
            expected = tuple(tensor.dims)
            if array.shape != expected:
                raise UsageError(f"weight {tensor.name!r} has shape {array.shape}, the graph "
                                 f"expects {expected}")
            out.graph.initializer[index].CopyFrom(numpy_helper.from_array(array, tensor.name))
    missing = [n for n in weights if n not in names]
    if missing:
        log.debug("weights not used by this task's graph: %s", missing[:5])
    return out


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy computing in FP16: float initializers, Casts to float and float outputs → FP16.

    popbert's inference graphs take integer inputs only, so this is the whole conversion; the
    checker's full type inference then proves the graph consistent.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for index, tensor in enumerate(out.graph.initializer):
        if tensor.data_type == TensorProto.FLOAT:
            half = numpy_helper.to_array(tensor).astype(np.float16)
            out.graph.initializer[index].CopyFrom(numpy_helper.from_array(half, tensor.name))
    for node in out.graph.node:
        for attribute in node.attribute:
            if node.op_type == "Cast" and attribute.name == "to" and \
                    attribute.i == TensorProto.FLOAT:
                attribute.i = TensorProto.FLOAT16
    for output in out.graph.output:
        if output.type.tensor_type.elem_type == TensorProto.FLOAT:
            output.type.tensor_type.elem_type = TensorProto.FLOAT16
    del out.graph.value_info[:]  # stale FP32 shapes; inference recomputes them
    return out


def sample_batch(config: BertConfig, task: str, batch_size: int = 2,
                 seed: int = 0, sequence_length: int | None = None) -> dict[str, np.ndarray]:
    """A padded batch of valid ids for verification (second row half padding), of
    `sequence_length` tokens (the config's by default; at least 4)."""
    rng = np.random.default_rng(seed)
    seq = sequence_length or config.sequence_length
    mask = np.ones((batch_size, seq), np.int64)
    mask[1:, seq // 2:] = 0
    batch = {"input_ids": rng.integers(1, config.vocab_size, (batch_size, seq)) * mask,
             "segment_ids": np.zeros((batch_size, seq), np.int64),
             "input_mask": mask}
    batch["segment_ids"][:, seq // 4:] = 1
    batch["segment_ids"] *= mask
    if task == "pretraining":
        batch["masked_lm_positions"] = np.sort(
            rng.integers(1, seq // 2, (batch_size, config.max_predictions_per_seq)), axis=1)
    return batch


def torch_outputs(model: onnx.ModelProto, batch: Mapping[str, np.ndarray]
                  ) -> dict[str, np.ndarray]:
    """The torch backend's outputs for `batch` (FP32 reference of the export check)."""
    from popbert.runtime.session import InferenceSession

    return {k: v.float().numpy() for k, v in InferenceSession(model).run(batch).items()}


def ort_outputs(source: bytes | Path, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """ONNX Runtime's outputs (CPU) for a serialized model or a model file."""
    import onnxruntime as ort

    session = ort.InferenceSession(source if isinstance(source, bytes) else str(source),
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return {n: np.asarray(v, np.float32) for n, v in zip(names, session.run(None, dict(batch)))}


def compare(reference: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray],
            dtype: str = "float32") -> float:
    """Largest difference over outputs; RuntimeError above the tolerance for `dtype`."""
    worst = 0.0
    for name, value in theirs.items():
        expected = reference[name]
        difference = float(np.abs(expected - value).max())
        scale = max(1.0, float(np.abs(expected).max()))
        allowed = (VERIFY_ATOL if dtype == "float32" else FP16_TOLERANCE) * scale
        worst = max(worst, difference)
        if not difference <= allowed:
            raise RuntimeError(f"export check failed: output {name!r} differs between ONNX "
                               f"Runtime and the torch backend by {difference:.3g} "
                               f"(> {allowed:.3g})")
    return worst


def check_shapes(config: BertConfig, batch_size: int | None,
                 sequence_length: int | None) -> list[tuple[int, int]]:
    """The (batch, length) pairs an export is checked at: a symbolic axis at two values (2 and
    3 rows; the config's length and a shorter odd one), a fixed axis at its value."""
    batches = (2, 3) if batch_size is None else (batch_size, batch_size)
    if sequence_length is not None:
        lengths = (sequence_length, sequence_length)
    else:
        lengths = (config.sequence_length, max(4, config.sequence_length // 2 + 1))
    return sorted(set(zip(batches, lengths)))


def optimize_for_ort(model: onnx.ModelProto, config: BertConfig) -> onnx.ModelProto:
    """`model` through ONNX Runtime's transformer optimizer (model_type "bert"): its Python
    fusions only (`opt_level=0`), so the file stays portable across execution providers; ORT
    applies its own graph optimisations when it loads the file anyway. The operators the
    fusions added (op type → count) are logged and stored as `popbert.fusions` metadata."""
    import json
    from collections import Counter

    from onnxruntime.transformers.optimizer import optimize_model

    before = Counter(node.op_type for node in model.graph.node)
    # The optimizer warns about every producer but PyTorch/Keras/TF; ours is known.
    logging.getLogger("onnxruntime.transformers.optimizer").setLevel(logging.ERROR)
    out = optimize_model(model, model_type="bert", num_heads=config.num_heads,
                         hidden_size=config.hidden_size, opt_level=0).model
    domains = {node.domain for node in out.graph.node} - {"", "ai.onnx"}
    imported = {opset.domain for opset in out.opset_import}
    for domain in sorted(domains - imported):  # the fused contrib ops' domain (com.microsoft)
        out.opset_import.append(onnx.helper.make_opsetid(domain, 1))
    after = Counter(node.op_type for node in out.graph.node)
    fused = {op: count - before[op] for op, count in sorted(after.items())
             if count > before[op]}
    log.info("ONNX Runtime transformer optimizer added %s", fused or "no fused operators")
    onnx.helper.set_model_props(out, {**{p.key: p.value for p in model.metadata_props},
                                      f"{METADATA_PREFIX}fusions": json.dumps(fused)})
    return out


def inference_config(config: BertConfig, sequence_length: int | None = None) -> BertConfig:
    """The training config as an inference graph: no placement, no recompute, no dropout
    (dropout is the identity at inference, and without it the fused Attention op is used), no
    packing."""
    values = {**config.__dict__, "layers_per_ipu": None, "recompute": False, "dialect": "onnx",
              "hidden_dropout": 0.0, "attention_dropout": 0.0,
              "task": dataclasses.replace(config.task),
              # Packing is a training-time layout; the same weights serve one sequence per row.
              "packed": False}
    if sequence_length is not None:
        values["sequence_length"] = sequence_length
        values["max_predictions_per_seq"] = min(config.max_predictions_per_seq,
                                                sequence_length)
    result = BertConfig(**values)
    try:
        result.validate()
    except ValueError as error:
        raise UsageError(f"--sequence-length: {error}") from None
    return result


def _weights_bytes(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims, dtype=np.int64)) * (2 if t.data_type == TensorProto.FLOAT16
                                                        else 4)
               for t in model.graph.initializer)


def _write(model: onnx.ModelProto, output: Path, external_data_threshold: int) -> Path | bytes:
    """Check and write `model` atomically; returns what ORT should load (bytes or the path)."""
    if _weights_bytes(model) < external_data_threshold:
        onnx.checker.check_model(model, full_check=True)
        data = model.SerializeToString()
        atomic_write_bytes(output, data)
        stale = output.with_name(output.name + ".data")
        if stale.exists():
            stale.unlink()
        return data
    # Over the protobuf limit: weights in `<name>.onnx.data`; both files written in a temporary
    # directory next to the output, checked there, then renamed into place (data file first).
    data_name = output.name + ".data"
    with reported(output), \
            tempfile.TemporaryDirectory(dir=output.parent, prefix=f".tmp-{output.name}-") as tmp:
        staged = Path(tmp) / output.name
        onnx.save_model(model, str(staged), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        onnx.checker.check_model(str(staged), full_check=True)
        os.replace(Path(tmp) / data_name, output.parent / data_name)
        os.replace(staged, output)
    log.info("weights over %.1f GB: wrote them to %s next to the model",
             external_data_threshold / 1e9, data_name)
    return output


def export_weights(weights: Mapping[str, torch.Tensor | np.ndarray], config: BertConfig,
                   task: str, output: Path, *, dtype: str = "float32",
                   batch_size: int | None = None, sequence_length: int | None = None,
                   optimize: bool = False, metadata: Mapping[str, str] | None = None,
                   external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> Path:
    """Build the `task` inference graph with `weights`, check, write and verify it.

    `batch_size=None` / `sequence_length=None` keep that axis symbolic (any batch; any length
    up to `max_position_embeddings`), an integer fixes it (the length at most
    `max_position_embeddings`). `optimize` applies ONNX Runtime's transformer optimizer
    (`optimize_for_ort`). `metadata` is stored as ONNX metadata props. ONNX Runtime must agree
    with the torch backend at every `check_shapes` pair; the file is removed again if not.
    """
    if task not in TASKS:
        raise UsageError(f"--task: expected one of {', '.join(TASKS)}, got {task!r}")
    if dtype not in EXPORT_DTYPES:
        raise UsageError(f"--dtype: expected one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if optimize and dtype != "float32":
        raise UsageError("--optimize: ONNX Runtime's transformer fusions are applied to float32 "
                         "exports only; drop --optimize or use --dtype float32")
    config = inference_config(config, sequence_length)
    try:
        graph = build_bert(config, task=task, with_loss=False, zeros=True,
                           batch_size=BATCH if batch_size is None else batch_size,
                           dynamic_sequence=sequence_length is None)
    except ValueError as error:  # e.g. classification without model.task.num_labels
        raise UsageError(f"cannot build the {task} graph: {error}") from None
    built = graph.model()
    absent = [n for n in trainable_initializers(built) if n not in weights]
    if absent:
        raise CheckpointError(f"the checkpoint has no weights for the {task} graph's "
                              f"{', '.join(absent[:3])}{' ...' if len(absent) > 3 else ''}; "
                              f"fine-tune a {task} model first")
    model = strip_annotations(with_weights(built, weights))
    model.graph.name = f"popbert_{task}"
    batches = [sample_batch(config, task, batch_size=rows, seed=index, sequence_length=length)
               for index, (rows, length) in enumerate(
                   check_shapes(config, batch_size, sequence_length))]
    references = [torch_outputs(model, batch) for batch in batches]
    if dtype == "float16":
        model = to_float16(model)
    onnx.helper.set_model_props(model, {**(metadata or {}),
                                        f"{METADATA_PREFIX}task": task,
                                        f"{METADATA_PREFIX}dtype": dtype,
                                        f"{METADATA_PREFIX}sequence_length":
                                            str(config.sequence_length)})
    if optimize:
        model = optimize_for_ort(model, config)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    source = _write(model, output, external_data_threshold)
    try:
        difference = max(compare(reference, ort_outputs(source, batch), dtype)
                         for reference, batch in zip(references, batches))
    except BaseException:
        output.unlink(missing_ok=True)
        output.with_name(output.name + ".data").unlink(missing_ok=True)
        raise
    checked = ", ".join(f"{len(b['input_ids'])}x{b['input_ids'].shape[1]}" for b in batches)
    log.info("exported %s (%s, %s%s, batch %s, sequence %s): ONNX Runtime matches the torch "
             "backend to %.2g at batch x length %s", output, task, dtype,
             ", optimized" if optimize else "", batch_size or BATCH,
             sequence_length or f"{SEQUENCE} (trained at {config.sequence_length})", difference,
             checked)
    return output


def task_metadata(config: BertConfig, vocab: Path | None) -> dict[str, str]:
    """What serving a fine-tuned model needs besides its weights (read by `popbert.serve`)."""
    import json

    task = config.task
    meta = {f"{METADATA_PREFIX}lowercase": json.dumps(task.lowercase)}
    for key in ("doc_stride", "max_query_length", "labels"):
        value = getattr(task, key)
        if value is not None:
            meta[f"{METADATA_PREFIX}{key}"] = json.dumps(value)
    if vocab is not None:
        from popbert.data.tokenization import read_vocab_text

        meta[f"{METADATA_PREFIX}vocab"] = read_vocab_text(vocab)
    return meta


def export_checkpoint(checkpoint: Path, task: str, output: Path, *, dtype: str = "float32",
                      batch_size: int | None = None, sequence_length: int | None = None,
                      optimize: bool = False,
                      external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> Path:
    """`popbert export`: a checkpoint directory (or run directory) → inference ONNX file."""
    from popbert.config import config_from_dict
    from popbert.io.checkpoint import find_checkpoint, load_checkpoint
    from popbert.io.hf_checkpoint import checkpoint_vocab

    restored = load_checkpoint(checkpoint, weights_only=True)
    cfg = config_from_dict(restored.config,
                           source=str(find_checkpoint(checkpoint, warn=False)))  # said once
    metadata = vocab = None
    if task in TASK_NAMES:
        vocab = checkpoint_vocab(checkpoint, cfg.data.vocab_file)
        metadata = task_metadata(cfg.model, vocab)
    path = export_weights(restored.weights, cfg.model, task, output, dtype=dtype,
                          batch_size=batch_size, sequence_length=sequence_length,
                          optimize=optimize, metadata=metadata,
                          external_data_threshold=external_data_threshold)
    if metadata is not None and vocab is None:  # said once the export exists: it matters then
        log.warning("%s: its vocabulary %s is gone and there is no vocab.txt in the run "
                    "directory: %s cannot be served by `popbert predict` (it reads the "
                    "vocabulary from the model's metadata)", checkpoint, cfg.data.vocab_file,
                    path)
    return path

