"""Dynamic INT8 quantization of an inference export (`popbert export --quantize int8`).

ONNX Runtime's own `quantize_dynamic` does the work: weights become INT8 (per output channel by
default, which halves the error of per-tensor scales on BERT's FFN), activations are quantized
to UINT8 at run time (the U8S8 form AVX-512 VNNI and AMX multiply fastest), and the graph's
`MatMul`s and fused `Attention`s become `DynamicQuantizeMatMul`/`QAttention` when ORT loads it.
What popbert adds is which weights stay in FP32: the matrices are grouped by their role in the
layer (`ROLES`), the word embeddings are never quantized (they are lookups, and the MLM head's
tied projection reads them), and the groups left in FP32 by default were chosen by measurement
(docs/export.md, "Quantized exports").
"""

from __future__ import annotations

import logging
import re
import tempfile
from collections import Counter
from collections.abc import Collection
from pathlib import Path

import onnx

log = logging.getLogger(__name__)

QUANTIZE_MODES = ("int8",)
# A weight's role, from the name the builder gives it (BERT, GroupBERT and ModernBERT layers:
# ModernBERT's GeGLU MLP is `MLP/Wi`, `MLP/Wo`); a MatMul whose weight matches none is part of
# a task head (tests/io check every encoder weight of every family has a role).
ROLES = {
    "qkv": re.compile(r"/Attention/QKV/W$"),
    "attention-out": re.compile(r"/Attention/Out/W$"),
    "ffn-in": re.compile(r"/((FF|FFN\d+)/(1|Grouped)|MLP/Wi)/W$"),
    "ffn-out": re.compile(r"/(FF/2|FFN\d+/Out|MLP/Wo)/W$"),
    "conv": re.compile(r"/Conv/(GLU|Out)/W$"),
}
HEAD = "head"
ALL_ROLES = (*ROLES, HEAD)
# Left in FP32 unless the user says otherwise: the task heads (pooler, classifier, SQuAD and
# MLM transforms), which read one token or a few and cost nothing measurable either way. With
# per-channel scales no other role needed FP32 on the fine-tuned topic classifier (every choice
# within 0.25 points), and each kept role cost 10-70% of the time (benchmarks/
# RESULTS_inference.md, "What stays FP32"); per-tensor scales lost 1.4 points.
DEFAULT_KEEP_FLOAT = (HEAD,)


def weight_role(weight: str) -> str:
    """The role (`ROLES` key, or "head") of the weight initializer named `weight`."""
    return next((role for role, pattern in ROLES.items() if pattern.search(weight)), HEAD)


def quantize_int8(model: onnx.ModelProto, keep_float: Collection[str] = DEFAULT_KEEP_FLOAT,
                  per_channel: bool = True) -> tuple[onnx.ModelProto, dict[str, int]]:
    """`model` (FP32, fused or not) with its weight matrices in INT8 except the roles in
    `keep_float`, and how many matrices of each role were quantized."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    unknown = set(keep_float) - set(ALL_ROLES)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}; known: {', '.join(ALL_ROLES)}")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    # ORT's per-channel INT8 MatMul takes [K, N] weights only: GroupBERT's grouped FFN
    # ([groups, K/g, N/g], a batched MatMul) stays FP32.
    constants = {t.name for t in out.graph.initializer if len(t.dims) == 2}
    names: Counter[str] = Counter()
    quantized: Counter[str] = Counter()
    excluded = []
    for index, node in enumerate(out.graph.node):
        if not node.name or names[node.name]:  # quantize_dynamic excludes nodes by name
            node.name = f"{node.name or node.op_type}/{index}"
        names[node.name] += 1
        if node.op_type == "Attention" and node.domain != "com.microsoft":
            excluded.append(node.name)  # the standard op: ORT's quantizer takes it for its own
            continue
        if node.op_type not in ("MatMul", "Attention") or len(node.input) < 2 \
                or node.input[1] not in constants:
            if node.op_type == "MatMul":
                excluded.append(node.name)  # e.g. the MLM head's tied projection
            continue
        role = weight_role(node.input[1])
        if role in keep_float:
            excluded.append(node.name)
        else:
            quantized[role] += 1
    with tempfile.TemporaryDirectory(prefix="popbert-quantize-") as tmp:
        source, target = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        onnx.save_model(out, str(source))
        logging.getLogger().disabled = True  # its advice to pre-process: not for BERT
        try:
            quantize_dynamic(str(source), str(target), per_channel=per_channel,
                             weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul",
                                                                                "Attention"],
                             nodes_to_exclude=excluded,
                             extra_options={"MatMulConstBOnly": True,
                                            # ORT's shape inference cannot type contrib outputs
                                            "DefaultTensorType": onnx.TensorProto.FLOAT})
        finally:
            logging.getLogger().disabled = False
        result = onnx.load_model(str(target))
    del result.metadata_props[:]
    result.metadata_props.extend(model.metadata_props)
    counts = dict(sorted(quantized.items()))
    log.info("INT8 (%s): %s; FP32: %s", "per channel" if per_channel else "per tensor",
             ", ".join(f"{n} {role}" for role, n in counts.items()) or "nothing",
             ", ".join(sorted(keep_float)) or "nothing but the embeddings")
    return result, counts


__all__ = ["ALL_ROLES", "DEFAULT_KEEP_FLOAT", "HEAD", "QUANTIZE_MODES", "ROLES", "quantize_int8",
           "weight_role"]
