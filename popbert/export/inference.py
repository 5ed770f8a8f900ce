"""Inference export: the same BERT graph with trained weights, standard opset, checked in ORT.

The exported model is verified at export time: ONNX Runtime runs the written file and the torch
backend runs the FP32 graph on a sample batch, and they must agree, so a file that leaves here
is known to compute what training computed. Tasks, options and the metadata an export carries:
docs/design.md, section "popbert.export.inference".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from popbert.atomic import atomic_write_bytes, reported, staging_directory
from popbert.builders.bert import BATCH, SEQUENCE, build_bert
from popbert.builders.bert_config import BertConfig
from popbert.builders.families import family_of
from popbert.errors import CheckpointError, UsageError
from popbert.export.agreement import check_agreement
from popbert.export.fused import CPU_FUSIONS, fuse_for_ort
from popbert.export.quantize import DEFAULT_KEEP_FLOAT, QUANTIZE_MODES, quantize_int8
from popbert.graph.annotations import METADATA_PREFIX, strip_annotations, trainable_initializers
from popbert.tasks import TASKS as FINETUNE_TASKS
from popbert.tasks import task_metadata as finetune_metadata

log = logging.getLogger(__name__)

TASKS = ("pretraining", "encoder", *FINETUNE_TASKS)  # the table holds "embedding"
# The float formats an inference export may be written in (`popbert export --dtype`).
EXPORT_DTYPES = ("float32", "float16")
# The runtimes an export is written for (`popbert export --runtime`): ONNX, or an OpenVINO IR.
RUNTIMES = ("onnxruntime", "openvino")
# ORT's fused CPU kernels (Attention, LayerNorm, GELU) reorder FP32 sums; logits of O(10) agree
# to a few 1e-6 in practice; 1e-4 of the output's scale (at least 1e-4 absolute) leaves margin
# without hiding a wrong weight. Relative, because FP32 rounding is: a model with huge weights
# (a run trained with far too high a learning rate) has logits of 1e5 that agree to 1e-6 of that.
VERIFY_ATOL = 1e-4
# FP16 has 11 significant bits (relative step 9.8e-4); over a dozen layers rounding compounds to
# about 1e-2 of an output's scale, while a wrong or missing weight changes outputs by O(1).
FP16_TOLERANCE = 3e-2
# Dynamic INT8 moves each output by a share of its size, not by rounding noise: on random token
# ids the RMS difference of all-MiniLM-L6-v2's hidden states is 0.12-0.19 of their RMS with
# per-channel weights, 0.40 per-tensor. A wrong or missing weight moves it by about 1 or more.
INT8_TOLERANCE = 0.5
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
             "input_mask": mask}
    if family_of(config).segments:
        batch["segment_ids"] = np.zeros((batch_size, seq), np.int64)
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
    feeds = {i.name: batch[i.name] for i in session.get_inputs()}
    return {n: np.asarray(v, np.float32) for n, v in zip(names, session.run(None, feeds))}


def compare(reference: Mapping[str, np.ndarray], theirs: Mapping[str, np.ndarray],
            dtype: str = "float32", quantize: str | None = None) -> float:
    """`check_agreement` of ONNX Runtime's outputs at the tolerance for `dtype`/`quantize`."""
    if quantize:
        return check_agreement(reference, theirs, "ONNX Runtime", INT8_TOLERANCE,
                               relative_rms=True)
    return check_agreement(reference, theirs, "ONNX Runtime",
                           VERIFY_ATOL if dtype == "float32" else FP16_TOLERANCE)


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


def optimize_for_ort(model: onnx.ModelProto, config: BertConfig,
                     fusions: Collection[str] = CPU_FUSIONS) -> onnx.ModelProto:
    """`model` with ONNX Runtime's fused BERT contrib operators named in `fusions`
    (`popbert.export.fused`); the operators it now has (op type → count) are stored as
    `popbert.fusions` metadata."""
    out, fused = fuse_for_ort(model, config.num_heads, fusions)
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
            staging_directory(output) as tmp:
        staged = tmp / output.name
        onnx.save_model(model, str(staged), save_as_external_data=True,
                        all_tensors_to_one_file=True, location=data_name, size_threshold=1024)
        onnx.checker.check_model(str(staged), full_check=True)
        os.replace(tmp / data_name, output.parent / data_name)
        os.replace(staged, output)
    log.info("weights over %.1f GB: wrote them to %s next to the model",
             external_data_threshold / 1e9, data_name)
    return output


def export_weights(weights: Mapping[str, torch.Tensor | np.ndarray], config: BertConfig,
                   task: str, output: Path, *, dtype: str = "float32",
                   batch_size: int | None = None, sequence_length: int | None = None,
                   optimize: bool = False, fusions: Collection[str] | None = None,
                   quantize: str | None = None, keep_float: Collection[str] | None = None,
                   metadata: Mapping[str, str] | None = None,
                   external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> Path:
    """Build the `task` inference graph with `weights`, check, write and verify it.

    `batch_size=None` / `sequence_length=None` keep that axis symbolic (any batch; any length
    up to `max_position_embeddings`), an integer fixes it (the length at most
    `max_position_embeddings`). `optimize` rewrites the graph into ONNX Runtime's fused BERT
    operators named in `fusions` (default: those that pay on the CPU, `CPU_FUSIONS`);
    `quantize="int8"` (which implies `optimize`) then stores its weight matrices in INT8
    except the roles in `keep_float` (`popbert.export.quantize`). `metadata` is stored as ONNX
    metadata props. ONNX Runtime must agree with the torch backend at every `check_shapes`
    pair (within `compare`'s tolerance for the format); the file is removed again if not.
    """
    if task not in TASKS:
        raise UsageError(f"--task: expected one of {', '.join(TASKS)}, got {task!r}")
    if dtype not in EXPORT_DTYPES:
        raise UsageError(f"--dtype: expected one of {', '.join(EXPORT_DTYPES)}, got {dtype!r}")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if quantize is not None and quantize not in QUANTIZE_MODES:
        raise UsageError(f"--quantize: expected one of {', '.join(QUANTIZE_MODES)}, "
                         f"got {quantize!r}")
    if quantize and dtype != "float32":
        raise UsageError(f"--quantize {quantize} quantizes a float32 graph; drop --dtype "
                         f"{dtype}")
    if keep_float is not None and not quantize:
        raise UsageError("--keep-float applies to quantized exports; add --quantize int8")
    optimize = optimize or bool(quantize) or fusions is not None
    if optimize and dtype != "float32":
        raise UsageError("--optimize: ONNX Runtime's fused BERT operators are written for "
                         "float32 exports only; drop --optimize or use --dtype float32")
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
        model = optimize_for_ort(model, config, CPU_FUSIONS if fusions is None else fusions)
    if quantize:
        model, counts = quantize_int8(model, DEFAULT_KEEP_FLOAT if keep_float is None
                                      else keep_float)
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                            f"{METADATA_PREFIX}quantized": json.dumps(counts)})
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    source = _write(model, output, external_data_threshold)
    try:
        difference = max(compare(reference, ort_outputs(source, batch), dtype, quantize)
                         for reference, batch in zip(references, batches))
    except BaseException:
        output.unlink(missing_ok=True)
        output.with_name(output.name + ".data").unlink(missing_ok=True)
        raise
    checked = ", ".join(f"{len(b['input_ids'])}x{b['input_ids'].shape[1]}" for b in batches)
    log.info("exported %s (%s, %s%s%s, batch %s, sequence %s): ONNX Runtime matches the torch "
             "backend to %.2g%s at batch x length %s", output, task, dtype,
             ", fused" if optimize else "", f", {quantize}" if quantize else "",
             batch_size or BATCH,
             sequence_length or f"{SEQUENCE} (trained at {config.sequence_length})", difference,
             " (relative RMS)" if quantize else "", checked)
    return output


def task_metadata(config: BertConfig, vocab: Path | None, task: str | None = None
                  ) -> dict[str, str]:
    """What serving a `task` export (default: the checkpoint's task) needs besides its weights
    (read by `popbert.serve`)."""
    meta = {f"{METADATA_PREFIX}lowercase": json.dumps(config.task.lowercase)}
    meta.update({f"{METADATA_PREFIX}{key}": json.dumps(value)
                 for key, value in finetune_metadata(config, task).items()})
    if task == "embedding":  # what the vectors are, and the prompts a client puts first
        meta.update({f"{METADATA_PREFIX}{key}": json.dumps(value) for key, value in (
            ("pooling", config.task.pooling or "mean"),
            ("normalize", bool(config.task.normalize)),
            ("prompts", config.task.prompts or {}))})
    if vocab is not None:
        from popbert.data.tokenization import read_vocab_text

        meta[f"{METADATA_PREFIX}vocab"] = read_vocab_text(vocab)
    return meta


def export_checkpoint(checkpoint: Path, task: str, output: Path, *, dtype: str = "float32",
                      batch_size: int | None = None, sequence_length: int | None = None,
                      optimize: bool = False, fusions: Collection[str] | None = None,
                      quantize: str | None = None, keep_float: Collection[str] | None = None,
                      eval_data: Path | None = None, max_accuracy_drop: float | None = None,
                      runtime: str = "onnxruntime", precision: str = "auto",
                      calibration: Path | None = None,
                      external_data_threshold: int = EXTERNAL_DATA_THRESHOLD) -> Path:
    """`popbert export`: a checkpoint directory (or run directory) → inference ONNX file, or
    with `runtime="openvino"` an OpenVINO IR directory converted from the verified FP32 ONNX
    file and run at `precision` (`auto`, `f32`, `bf16`: `popbert.serve.openvino_ir`).

    With `eval_data` the export is scored against the plain FP32 export on that file
    (`popbert.export.accuracy`) before it is moved into place, and refused (AccuracyError,
    nothing written) if it loses more than `max_accuracy_drop` points.
    """
    from popbert.config import config_from_dict
    from popbert.hf.checkpoint import checkpoint_vocab
    from popbert.io.checkpoint import find_checkpoint, load_checkpoint
    from popbert.serve.openvino_ir import resolve_precision

    if runtime not in RUNTIMES:
        raise UsageError(f"--runtime: expected one of {', '.join(RUNTIMES)}, got {runtime!r}")
    if runtime == "openvino":
        ignored = [flag for flag, given in (("--optimize", optimize or fusions is not None),
                                            ("--keep-float", keep_float is not None),
                                            ("--dtype float16", dtype != "float32")) if given]
        if ignored:
            raise UsageError(f"{ignored[0]} writes ONNX Runtime's operators; the OpenVINO "
                             "export is converted from the plain FP32 graph and runs at "
                             "--precision (auto, f32, bf16), INT8 with --quantize int8")
        precision = resolve_precision(precision)
    elif Path(output).is_dir():
        raise UsageError(f"--output {output}: is a directory; expected the ONNX file to write "
                         "(a directory is what --runtime openvino writes)")
    elif calibration is not None:
        raise UsageError("--calibration applies to --runtime openvino --quantize int8 (ONNX "
                         "Runtime's INT8 export quantizes activations as it runs)")
    elif precision != "auto":
        raise UsageError("--precision applies to --runtime openvino; ONNX Runtime's precision "
                         "is the file's (--dtype, --quantize)")
    if max_accuracy_drop is not None and eval_data is None:
        raise UsageError("--max-accuracy-drop needs --eval FILE: the data to measure the drop on")
    if calibration is not None and not quantize:
        raise UsageError("--calibration is the data static INT8 calibrates on: it needs "
                         "--quantize int8 (with --runtime openvino)")
    if eval_data is not None:
        from popbert.export.accuracy import check_eval_task

        check_eval_task(task)
    # The data files as the task reads them, before anything is exported.
    check_task_data("--calibration", calibration, task)
    check_task_data("--eval", eval_data, task)
    restored = load_checkpoint(checkpoint, weights_only=True)
    cfg = config_from_dict(restored.config,
                           source=str(find_checkpoint(checkpoint, warn=False)))  # said once
    metadata = vocab = None
    if task in FINETUNE_TASKS:  # served from text: its vocabulary
        vocab = checkpoint_vocab(checkpoint, cfg.data.vocab_file)
        metadata = task_metadata(cfg.model, vocab, task)
    if eval_data is not None and vocab is None:
        raise UsageError(f"--eval: {checkpoint} has no vocabulary (its {cfg.data.vocab_file} is "
                         f"gone and the run directory has no vocab.txt) to encode {eval_data}")

    def export(target: Path, runtime: str = "onnxruntime", precision: str = "f32",
               **chosen: object) -> Path:
        if runtime == "openvino":
            rows = None
            if chosen.get("quantize"):
                rows = _calibration_file(calibration, cfg, task)
            return _export_openvino(export, cfg.model, task, target, precision, batch_size,
                                    sequence_length, rows)
        return export_weights(restored.weights, cfg.model, task, target,
                              batch_size=batch_size, sequence_length=sequence_length,
                              metadata=metadata,
                              external_data_threshold=external_data_threshold, **chosen)

    chosen = {"dtype": dtype, "optimize": optimize, "fusions": fusions, "quantize": quantize,
              "keep_float": keep_float, "runtime": runtime, "precision": precision}
    if eval_data is None:
        path = export(Path(output), **chosen)
    else:
        path = _export_scored(export, chosen, task, Path(output), Path(eval_data),
                              max_accuracy_drop)
    if metadata is not None and vocab is None:  # said once the export exists: it matters then
        log.warning("%s: its vocabulary %s is gone and there is no vocab.txt in the run "
                    "directory: %s cannot be served by `popbert predict` (it reads the "
                    "vocabulary from the model's metadata)", checkpoint, cfg.data.vocab_file,
                    path)
    return path


def check_task_data(flag: str, path: Path | None, task: str) -> None:
    """Refuse (one line) a data file `task` would not read: a classification export reads
    rows or a .txt file of texts, a SQuAD export SQuAD JSON (`popbert.io.paths`' kinds)."""
    if path is None:
        return
    from popbert.io import paths

    if task not in FINETUNE_TASKS:
        raise UsageError(f"{flag} {path}: the {task} export reads no task data; {flag} applies "
                         f"to {' and '.join(FINETUNE_TASKS)} exports")
    paths.check_path(f"{flag} (a {task} export)", path,
                     paths.PREDICT_INPUTS[FINETUNE_TASKS[task].files])


# Rows of the training file static INT8 calibrates on when no --calibration file is given.
CALIBRATION_ROWS = 300


def _calibration_file(given: Path | None, cfg: Any, task: str) -> Path:
    """--calibration, else the training file the checkpoint was fine-tuned on (said once)."""
    if given is not None:
        return Path(given)
    stored = cfg.finetune.train_file
    if task not in FINETUNE_TASKS or not stored or not Path(stored).is_file():
        where = (f"its training file {stored} is not here" if stored
                 else "the checkpoint names no training file")
        raise UsageError(f"--quantize int8 --runtime openvino calibrates on rows of the task's "
                         f"data: give --calibration FILE ({where})")
    log.info("calibrating INT8 on the first %d rows of %s, the checkpoint's training file "
             "(--calibration FILE to choose)", CALIBRATION_ROWS, stored)
    return Path(stored)


def _export_openvino(export: Callable[..., Path], config: BertConfig, task: str, output: Path,
                     precision: str, batch_size: int | None, sequence_length: int | None,
                     calibration: Path | None = None) -> Path:
    """The FP32 ONNX export (verified in ONNX Runtime), converted to an OpenVINO IR directory
    at `output` (INT8 by NNCF, calibrated on `calibration`'s rows, when given) and verified
    again, at `precision`, against the torch backend."""
    from popbert.export.openvino import write_ir

    output.parent.mkdir(parents=True, exist_ok=True)
    with staging_directory(output) as tmp:
        source = export(tmp / "model.onnx")
        model = onnx.load(str(source))
        shapes = check_shapes(inference_config(config, sequence_length), batch_size,
                              sequence_length)
        batches = [sample_batch(inference_config(config, sequence_length), task,
                                batch_size=rows, seed=index, sequence_length=length)
                   for index, (rows, length) in enumerate(shapes)]
        references = [torch_outputs(model, batch) for batch in batches]
        rows = None
        if calibration is not None:
            from popbert.export.accuracy import calibration_rows

            rows = calibration_rows(source, task, calibration, CALIBRATION_ROWS)
        worst = write_ir(source, output, precision, batches, references, rows,
                         f32_tolerance=VERIFY_ATOL, int8_tolerance=INT8_TOLERANCE)
    log.info("exported %s (OpenVINO IR, %s, precision %s%s): OpenVINO matches the torch backend "
             "to %.2g%s at batch x length %s", output, task, precision,
             f", INT8 calibrated on {len(rows)} rows" if rows else "", worst,
             " (relative RMS)" if rows else "",
             ", ".join(f"{rows_}x{length}" for rows_, length in shapes))
    return output


def _export_scored(export: Callable[..., Path], chosen: Mapping[str, object], task: str,
                   output: Path, eval_data: Path, max_drop: float | None) -> Path:
    """Export into a directory beside `output`, score it against the plain FP32 export on
    `eval_data`, and move it into place only if the drop is allowed."""
    from popbert.export.accuracy import accuracy_cost, check_drop

    output.parent.mkdir(parents=True, exist_ok=True)
    with reported(output), \
            staging_directory(output) as tmp:
        staged = export(tmp / output.name, **chosen)
        reference = export(tmp / "reference-fp32.onnx")
        cost = accuracy_cost(reference, staged, task, eval_data)
        log.info("accuracy cost %s", cost.line())
        check_drop(cost, max_drop, output)
        data = staged.with_name(staged.name + ".data")
        if data.exists():
            os.replace(data, output.with_name(output.name + ".data"))
        os.replace(staged, output)
    return output
