"""Inference export: the same BERT graph with trained weights, standard opset, checked in ORT.

The exported model is verified at export time: ONNX Runtime and the torch backend run the same
graph on a sample batch and must agree, so a file that leaves here is known to compute what
training computed.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from popbert.atomic import atomic_write_bytes
from popbert.builder import strip_annotations
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig
from popbert.errors import UsageError

log = logging.getLogger(__name__)

TASKS = ("pretraining", "encoder")
# ORT's fused CPU kernels (Attention, LayerNorm, GELU) reorder FP32 sums; logits of O(10) agree
# to a few 1e-6 in practice; 1e-4 absolute leaves margin without hiding a wrong weight.
VERIFY_ATOL = 1e-4


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


def sample_batch(config: BertConfig, task: str, batch_size: int = 2,
                 seed: int = 0) -> dict[str, np.ndarray]:
    """A padded batch of valid ids for verification (second row half padding)."""
    rng = np.random.default_rng(seed)
    seq = config.sequence_length
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


def verify(model: onnx.ModelProto, config: BertConfig, task: str) -> float:
    """Run the export in ONNX Runtime and in the torch backend; return the max difference."""
    import onnxruntime as ort

    from popbert.session import InferenceSession

    batch = sample_batch(config, task)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    theirs = dict(zip(names, session.run(None, batch)))
    ours = InferenceSession(model).run(batch)
    worst = 0.0
    for name in names:
        difference = float(np.abs(ours[name].float().numpy() - theirs[name]).max())
        worst = max(worst, difference)
        if not difference <= VERIFY_ATOL:
            raise RuntimeError(f"export check failed: output {name!r} differs between ONNX "
                               f"Runtime and the torch backend by {difference:.3g} "
                               f"(> {VERIFY_ATOL})")
    return worst


def export_weights(weights: Mapping[str, torch.Tensor | np.ndarray], config: BertConfig,
                   task: str, output: Path) -> Path:
    """Build the `task` inference graph with `weights`, check, verify and write it atomically."""
    if task not in TASKS:
        raise UsageError(f"--task: expected one of {', '.join(TASKS)}, got {task!r}")
    inference_config = BertConfig(**{**config.__dict__, "layers_per_ipu": None,
                                     "recompute": False, "dialect": "onnx"})
    graph = build_bert(inference_config, task=task, with_loss=False, zeros=True)
    model = strip_annotations(with_weights(graph.model(), weights))
    model.graph.name = f"popbert_{task}"
    onnx.checker.check_model(model, full_check=True)
    difference = verify(model, inference_config, task)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(output, model.SerializeToString())
    log.info("exported %s (%s): ONNX Runtime matches the torch backend to %.2g", output, task,
             difference)
    return output


def export_checkpoint(checkpoint: Path, task: str, output: Path) -> Path:
    """`popbert export`: a checkpoint directory (or run directory) → inference ONNX file."""
    from popbert.checkpoint import load_checkpoint
    from popbert.pretrain import config_of_checkpoint

    cfg = config_of_checkpoint(checkpoint)
    restored = load_checkpoint(checkpoint, weights_only=True)
    return export_weights(restored.weights, cfg.model, task, output)
