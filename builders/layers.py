"""Layer helpers written once against the Builder API, choosing ops per dialect.

Model code calls these helpers and never branches on the dialect itself: `onnx` is standard
opset 23, `popart` ai.onnx opset 11 plus ai.graphcore ops with static shapes. The ops of each
dialect, and the two choices that make both compute the same function: docs/design.md, section
"popbert.builders.layers".
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from onnx import TensorProto

from popbert.graph.builder import Builder

# The tied MLM projection is serialised into this many vocabulary chunks, as Graphcore did
# (`setSerializeMatMul(..., "output_channels", 5)`), or the largest divisor of the vocabulary
# below it: PopART requires the output channels to be a multiple of the factor.
MLM_SERIALIZATION_STEPS = 5

# Large negative logit for masked-out keys: exp() underflows to exactly 0 in FP32 and FP16, and
# unlike finfo.min it cannot overflow when added to a score in half precision.
MASK_VALUE = -10000.0


class WeightInit:
    """Draws initial weights: BERT's N(0, 0.02) (or zeros, for fast structural builds)."""

    def __init__(self, std: float = 0.02, seed: int = 0, zeros: bool = False,
                 dtype: type = np.float32):
        self.std = std
        self.zeros = zeros
        self.dtype = dtype
        self.rng = np.random.default_rng(seed)

    def normal(self, shape: Sequence[int]) -> np.ndarray:
        if self.zeros:
            return np.zeros(shape, self.dtype)
        return (self.rng.standard_normal(shape) * self.std).astype(self.dtype)

    def truncated(self, shape: Sequence[int], std: float, cutoff: float) -> np.ndarray:
        """N(0, std) truncated to ±cutoff·std (draws outside are redrawn), as `torch.nn.init.
        trunc_normal_` initialises ModernBERT."""
        if self.zeros:
            return np.zeros(shape, self.dtype)
        z = self.rng.standard_normal(shape)
        outside = np.abs(z) > cutoff
        while outside.any():
            z[outside] = self.rng.standard_normal(int(outside.sum()))
            outside = np.abs(z) > cutoff
        return (z * std).astype(self.dtype)

    def constant(self, shape: Sequence[int], value: float) -> np.ndarray:
        return np.full(shape, value, self.dtype)


def scalar(b: Builder, value: float | int, dtype: type, name: str) -> str:
    return b.addConstant(np.array(value, dtype), name)


def input_dtype(b: Builder, signed: bool = False) -> str:
    """The declared type of an integer graph input (ids, positions, masks, labels).

    onnx: INT64, what ONNX Runtime, the exports and the loaders use. popart: 32-bit, because
    IPUs stream 32-bit integers: UINT32 as Graphcore's BERT fed its inputs
    (`popart.TensorInfo("UINT32", shape)`), INT32 for an input that can hold negative values
    (`signed`, e.g. packed NSP labels with their -100 ignore index). The one place the choice
    is made; model code passes only `signed`.
    """
    if b.dialect == "onnx":
        return "INT64"
    return "INT32" if signed else "UINT32"


def as_index(b: Builder, x: str, name: str) -> str:
    """Integer tensor `x` in a type every op reading it accepts: INT32/INT64 unchanged (the onnx
    dialect's inputs never change); anything else (the popart dialect's UINT32 inputs) Cast to
    INT32, because opset 11 takes only int32/int64 `Gather` indices and `Equal` operands."""
    if b.getTensorDtypeString(x) in ("int32", "int64"):
        return x
    return b.aiOnnx.cast([x], name, to=TensorProto.INT32)


def _int_dtype(b: Builder, x: str) -> np.dtype:
    """The numpy dtype of integer tensor `x`, for constants it meets in arithmetic/compares
    (opset 11 requires both operands of the same type)."""
    return np.dtype(b.getTensorDtypeString(x))


def sequence_entry(seq_len: int | str) -> int:
    """The sequence axis as a Reshape target entry: the length when static, -1 ("infer from
    the element count") when symbolic. At most one -1 per target, so callers keep the batch
    as 0 ("copy") and every other entry static."""
    return -1 if isinstance(seq_len, str) else seq_len


def leading_dims(b: Builder, x: str, count: int, name: str) -> str:
    """The first `count` dimensions of `x` as an int64 [count] tensor (`Shape` with `end`,
    opset 15+): for targets with more than one symbolic dimension (batch and sequence), which a
    single -1 cannot express. Symbolic shapes exist only in the onnx dialect."""
    return b.aiOnnx.shape([x], name, end=count)


def _add_bias(b: Builder, y: str, features: int, init: WeightInit) -> str:
    """y + B, the bias `B` (zeros) of the current name scope."""
    bias = b.addInitializedInputTensor(init.constant([features], 0.0), "B")
    return b.aiOnnx.add([y, bias], "Add")


def dense(b: Builder, x: str, in_features: int, out_features: int, init: WeightInit,
          name: str, bias: bool = True, initial: np.ndarray | None = None) -> str:
    """x @ W + B with W stored [in, out] (Google BERT's layout); `initial` overrides the
    default N(0, std) draw of W (families with their own initialisation)."""
    with b.nameScope(name):
        if initial is None:
            initial = init.normal([in_features, out_features])
        weight = b.addInitializedInputTensor(initial, "W")
        y = b.aiOnnx.matmul([x, weight], "MatMul")
        if bias:
            y = _add_bias(b, y, out_features, init)
    return y


def layer_norm(b: Builder, x: str, hidden: int, eps: float, init: WeightInit,
               name: str = "Norm", bias: bool = True) -> str:
    """LayerNorm over the last axis with `Gamma` (and, with `bias`, `Beta`) weights."""
    with b.nameScope(name):
        gamma = b.addInitializedInputTensor(init.constant([hidden], 1.0), "Gamma")
        beta = (b.addInitializedInputTensor(init.constant([hidden], 0.0), "Beta") if bias
                else None)
        if b.dialect == "onnx":
            operands = [x, gamma] if beta is None else [x, gamma, beta]
            return b.aiOnnx.layernormalization(operands, "LayerNorm", axis=-1,
                                               epsilon=float(eps))
        # PopART: GroupNormalization with one group on a [N, H] tensor, reshaped back; it
        # needs a beta, so a bias-free norm passes constant zeros.
        if beta is None:
            beta = b.addConstant(np.zeros([hidden], np.float32), "NoBeta")
        shape = b.getTensorShape(x)
        flat = b.aiOnnx.reshape([x, b.addConstant(np.array([-1, hidden], np.int64), "flat")])
        normed = b.aiGraphcore.groupnormalization([flat, gamma, beta], "GroupNorm", num_groups=1,
                                                  epsilon=float(eps))[0]
        return b.aiOnnx.reshape([normed, b.addConstant(np.array(_static(shape, x), np.int64),
                                                       "shape")])


def gelu(b: Builder, x: str) -> str:
    """Exact (erf) GELU: opset-20 `Gelu`, or `ai.graphcore::GeluErf` (see the module docstring
    for why not `ai.graphcore::Gelu`)."""
    if b.dialect == "onnx":
        return b.aiOnnx.gelu([x], "Gelu")
    return b.aiGraphcore.geluerf([x], "Gelu")


def dropout(b: Builder, x: str, probability: float, name: str = "Dropout") -> str:
    """Dropout that the sessions switch off for evaluation; p = 0 emits nothing."""
    if probability <= 0.0:
        return x
    if b.dialect == "onnx":
        ratio = scalar(b, probability, np.float32, f"{name}/ratio")
        return b.aiOnnx.dropout([x, ratio], name)
    return b.aiOnnx.dropout([x], name, ratio=float(probability))


def silu(b: Builder, x: str, name: str = "SiLU") -> str:
    """x · sigmoid(x) (Swish), from Sigmoid and Mul: both dialects, no opset-22 op needed."""
    return b.aiOnnx.mul([x, b.aiOnnx.sigmoid([x], f"{name}/Sigmoid")], name)


def glu(b: Builder, x: str, in_features: int, out_features: int, init: WeightInit,
        name: str = "GLU") -> str:
    """Gated linear unit: one dense in → 2·out, the first half (values) times the sigmoid of
    the second (gates), as `torch.nn.functional.glu` splits it. One [in, 2·out] weight rather
    than two so a single GEMM computes both halves."""
    both = dense(b, x, in_features, 2 * out_features, init, name)
    values, gates = split(b, both, 2, -1, f"{name}/Split")
    return b.aiOnnx.mul([values, b.aiOnnx.sigmoid([gates], f"{name}/Sigmoid")], f"{name}/Gate")


def grouped_matmul(b: Builder, x: str, in_features: int, out_features: int, groups: int,
                   seq_len: int | str, init: WeightInit, name: str, bias: bool = True) -> str:
    """Block-diagonal x @ W over [B, S, in] → [B, S, out]: group g's in/G inputs feed only its
    out/G outputs (1/G of a dense layer's weights and FLOPs).

    Written as one batched MatMul over the groups, the way PopART and ONNX Runtime run it
    without a Conv: x reshaped to [B·S, G, in/G] and transposed group-major [G, B·S, in/G],
    times the weight `W` [G, in/G, out/G] gives [G, B·S, out/G], transposed back and reshaped
    to [B, S, out]; then the bias `B` [out]. Group-major makes each group one large matmul; a
    [B, S, G, 1, in/G] operand broadcast against W runs B·S·G one-row matmuls and copies W
    B·S times (GroupBERT's training step was 5x slower on CPU at H128 that way).
    A symbolic `seq_len` (inference exports) takes the [B, S] of the merge from `x`'s shape.
    """
    if in_features % groups or out_features % groups:
        raise ValueError(f"grouped_matmul {name!r}: {groups} groups must divide {in_features} "
                         f"and {out_features}")
    with b.nameScope(name):
        weight = b.addInitializedInputTensor(
            init.normal([groups, in_features // groups, out_features // groups]), "W")
        grouped = b.aiOnnx.reshape(
            [x, b.addConstant(np.array([-1, groups, in_features // groups], np.int64),
                              "group_shape")], "Reshape")
        grouped = b.aiOnnx.transpose([grouped], "GroupMajor", perm=[1, 0, 2])
        y = b.aiOnnx.matmul([grouped, weight], "MatMul")
        y = b.aiOnnx.transpose([y], "TokenMajor", perm=[1, 0, 2])
        if isinstance(seq_len, str):
            merge = b.aiOnnx.concat(
                [leading_dims(b, x, 2, "TokenDims"),
                 b.addConstant(np.array([out_features], np.int64), "out_dim")],
                "merge_shape", axis=0)
        else:
            merge = b.addConstant(np.array([-1, seq_len, out_features], np.int64),
                                  "merge_shape")
        y = b.aiOnnx.reshape([y, merge], "Merge")
        if bias:
            y = _add_bias(b, y, out_features, init)
    return y


def grouped_conv1d(b: Builder, x: str, channels: int, group_size: int, kernel: int,
                   init: WeightInit, name: str = "Conv", offsets_keep: str | None = None) -> str:
    """Grouped 1-D convolution over the sequence of [B, S, C] → [B, S, C], "same" padding.

    ONNX `Conv` (opset 1+, so both dialects) on the [B, C, S] transpose with `group` =
    C / group_size: weight `W` [C, group_size, kernel], bias `B` [C], `pads` kernel//2 each
    side (kernel odd), then transposed back.

    Packed rows pass `offsets_keep` ([B, 1, kernel, S] 1/0 from `packed_conv_keep`): output
    token s then reads input token s + j - kernel//2 only where that entry j is 1 (same
    sequence, not padding). The k shifted copies of x are stacked by a depthwise one-hot `Conv`
    (exact: each output is one input times 1), masked, and the grouped convolution becomes a
    kernel-1 `Conv` on the stack with the same `W` reshaped [C, group_size·kernel, 1]: same
    weights and names as the unpacked graph, whose ops are unchanged.
    """
    if channels % group_size or kernel % 2 == 0:
        raise ValueError(f"grouped_conv1d {name!r}: group size {group_size} must divide "
                         f"{channels} channels and kernel {kernel} must be odd")
    with b.nameScope(name):
        weight = b.addInitializedInputTensor(init.normal([channels, group_size, kernel]), "W")
        bias = b.addInitializedInputTensor(init.constant([channels], 0.0), "B")
        channels_first = b.aiOnnx.transpose([x], "ToChannels", perm=[0, 2, 1])
        if offsets_keep is None:
            y = b.aiOnnx.conv([channels_first, weight, bias], "Conv",
                              group=channels // group_size, kernel_shape=[kernel],
                              pads=[kernel // 2, kernel // 2], strides=[1], dilations=[1])
        else:
            seq = _static(b.getTensorShape(x)[1:2], x)[0]
            y = _packed_conv(b, channels_first, weight, bias, channels, group_size, kernel,
                             offsets_keep, seq)
        return b.aiOnnx.transpose([y], "FromChannels", perm=[0, 2, 1])


def _shift_stack(b: Builder, x: str, channels: int, kernel: int, name: str) -> str:
    """[B, C, S] → [B, C·k, S] with channel c·k + j = x[c, s + j - k//2] (0 outside): a
    depthwise Conv whose kernels are one-hot, so every output is exactly one input."""
    one_hot = np.tile(np.eye(kernel, dtype=np.float32)[:, None, :], (channels, 1, 1))
    taps = b.addConstant(one_hot, f"{name}_taps")  # [C·k, 1, k]
    return b.aiOnnx.conv([x, taps], name, group=channels, kernel_shape=[kernel],
                         pads=[kernel // 2, kernel // 2], strides=[1], dilations=[1])


def _packed_conv(b: Builder, x: str, weight: str, bias: str, channels: int, group_size: int,
                 kernel: int, offsets_keep: str, seq: int) -> str:
    """The grouped conv of [B, C, S] `x` with each offset's neighbours masked by
    `offsets_keep` [B, 1, k, S]: shift-stack, mask, kernel-1 grouped Conv."""
    stacked = _shift_stack(b, x, channels, kernel, "Shift")  # [B, C·k, S]
    s = seq
    per_offset = b.aiOnnx.reshape(
        [stacked, b.addConstant(np.array([0, channels, kernel, s], np.int64), "offset_shape")],
        "Offsets")
    masked = b.aiOnnx.mul([per_offset, offsets_keep], "SameSequence")
    masked = b.aiOnnx.reshape(
        [masked, b.addConstant(np.array([0, channels * kernel, s], np.int64), "stack_shape")],
        "Stack")
    taps = b.aiOnnx.reshape(
        [weight, b.addConstant(np.array([channels, group_size * kernel, 1], np.int64),
                               "tap_shape")], "Taps")
    return b.aiOnnx.conv([masked, taps, bias], "Conv", group=channels // group_size,
                         kernel_shape=[1], pads=[0, 0], strides=[1], dilations=[1])


def packed_conv_keep(b: Builder, sequence_index: str, kernel: int) -> str:
    """[B, S] sequence index (0 = padding) → float [B, 1, k, S]: entry j of token s is 1 where
    token s + j - k//2 exists, is not padding and belongs to the same sequence as token s.

    The k shifted indices come from a one-hot Conv on the index as float (exact for these small
    integers; the zero padding of the Conv reads as padding)."""
    with b.nameScope("ConvKeep"):
        index = b.aiOnnx.cast([as_index(b, sequence_index, "Index")], "Float", to=1)
        index = unsqueeze(b, index, [1], "Channel", "channel_axis")  # [B, 1, S]
        shifted = _shift_stack(b, index, 1, kernel, "Shift")  # [B, k, S]
        same = b.aiOnnx.equal([shifted, index], "SameSequence")
        real = b.aiOnnx.greater([shifted, scalar(b, 0.0, np.float32, "zero")], "RealToken")
        keep = b.aiOnnx.cast([b.aiOnnx.And([same, real], "Allowed")], "Cast", to=1)
        return unsqueeze(b, keep, [1], "Unsqueeze", "group_axis")  # [B, 1, k, S]


def padding_keep(b: Builder, input_mask: str) -> str:
    """[B, S] 1/0 mask → float [B, S, 1] to multiply activations by, zeroing padded tokens."""
    with b.nameScope("PaddingKeep"):
        as_float = b.aiOnnx.cast([input_mask], "Cast", to=1)
        return unsqueeze(b, as_float, [2], "Unsqueeze")


def real_tokens(b: Builder, sequence_index: str) -> str:
    """[B, S] sequence index → bool [B, S], true on tokens of a sequence (index > 0): the
    `input_mask` of a packed row."""
    index = as_index(b, sequence_index, "RealTokens/Index")
    zero = b.addConstant(np.array(0, _int_dtype(b, index)), "zero")
    return b.aiOnnx.greater([index, zero], "RealTokens")


def check_batch_size(b: Builder, batch_size: int | str) -> None:
    """The popart dialect compiles for one micro batch, as IPUs do: a symbolic batch is refused
    before any input exists, with what to pass instead."""
    if b.dialect == "popart" and (not isinstance(batch_size, int) or batch_size < 1):
        raise ValueError(f"model.dialect 'popart' builds static shapes: pass the micro batch, "
                         f"build_bert(..., batch_size=execution.micro_batch_size), "
                         f"not batch_size={batch_size!r}")


def unsqueeze(b: Builder, x: str, axes: Sequence[int], name: str,
              axes_name: str = "axes") -> str:
    """Insert size-1 axes: `axes` is an input from opset 13, an attribute before."""
    if b.opset >= 13:
        return b.aiOnnx.unsqueeze([x, b.addConstant(np.array(axes, np.int64), axes_name)], name)
    return b.aiOnnx.unsqueeze([x], name, axes=list(axes))


def squeeze(b: Builder, x: str, axes: Sequence[int], name: str,
            axes_name: str = "axes") -> str:
    """Remove size-1 axes: `axes` is an input from opset 13, an attribute before."""
    if b.opset >= 13:
        return b.aiOnnx.squeeze([x, b.addConstant(np.array(axes, np.int64), axes_name)], name)
    return b.aiOnnx.squeeze([x], name, axes=list(axes))


def first_row(b: Builder, x: str, axis: int, name: str) -> str:
    """`x` cut to its first entry along `axis` (kept, of size 1)."""
    with b.nameScope(name):
        zero = b.addConstant(np.array([0], np.int64), "start")
        return b.aiOnnx.slice([x, zero, b.addConstant(np.array([1], np.int64), "end"),
                               b.addConstant(np.array([axis], np.int64), "axis")], "Slice")


def first_row_query(b: Builder, q: str, mask: str, x: str) -> tuple[str, str, str]:
    """A layer's query [B, S, H], attention mask [B, 1, S, S] and residual input [B, S, H] cut
    to row 0 ([CLS]): what a layer computed for that row alone attends and adds with (its keys
    and values stay whole)."""
    return (first_row(b, q, 1, "FirstQuery"), first_row(b, mask, 2, "FirstMaskRow"),
            first_row(b, x, 1, "FirstRow"))


def split(b: Builder, x: str, parts: int, axis: int, name: str) -> list[str]:
    """Split into `parts` equal pieces along `axis`: `num_outputs` from opset 18; before, the
    sizes as the `split` attribute (static, so the axis must be)."""
    if b.opset >= 18:
        return b.aiOnnx.split([x], name, axis=axis, num_outputs=parts)
    size = _static(b.getTensorShape(x), x)[axis]
    if size % parts:
        raise ValueError(f"split {x!r}: axis {axis} of size {size} is not {parts} equal parts")
    return b.aiOnnx.split([x], name, axis=axis, split=[size // parts] * parts)


def gather_positions(b: Builder, hidden: str, positions: str, name: str,
                     axis_name: str = "axis", index_name: str = "Index") -> str:
    """Rows of `hidden` [B, S, H] at `positions` [B, P] per batch row → [B, P, H].

    onnx: `GatherND` with `batch_dims=1` (opset 12+). popart (opset 11): `Gather` on the
    flattened [B·S, H] activations at `positions + row · S`; B and S are static there.
    """
    if b.opset >= 12:
        index = unsqueeze(b, positions, [2], index_name, axis_name)
        return b.aiOnnx.gathernd([hidden, index], name, batch_dims=1)
    batch, seq, width = _static(b.getTensorShape(hidden), hidden)
    flat = b.aiOnnx.reshape(
        [hidden, b.addConstant(np.array([batch * seq, width], np.int64), "flat_shape")],
        f"{name}/Flatten")
    positions = as_index(b, positions, f"{index_name}/Cast")
    offsets = b.addConstant((np.arange(batch, dtype=_int_dtype(b, positions)) * seq)[:, None],
                            "row_offsets")
    index = b.aiOnnx.add([positions, offsets], index_name)
    return b.aiOnnx.gather([flat, index], name, axis=0)


def tied_projection(b: Builder, x: str, table: str, name: str) -> str:
    """x @ tableᵀ: the MLM projection tied to the word embedding `table` [V, H].

    In the popart dialect the MatMul carries PopART's serialisation annotation (the vocabulary
    in `MLM_SERIALIZATION_STEPS` chunks of output channels, keeping precision): PopART needs it
    to fit the [B·P, V] logits and their gradient in tile memory. The torch lowering reads
    nothing from it. The onnx dialect leaves it off: it would only stop the lowering from
    fusing the projection with its bias (that fusion requires both nodes' annotations equal).
    """
    projection = b.aiOnnx.transpose([table], "TiedProjection", perm=[1, 0])
    logits = b.aiOnnx.matmul([x, projection], name)
    if b.dialect == "popart":
        vocab = _static(b.getTensorShape(table), table)[0]
        b.setSerializeMatMul({logits}, "output_channels", serialization_factor(vocab),
                             keep_precision=True)
    return logits


def serialization_factor(vocab_size: int, steps: int = MLM_SERIALIZATION_STEPS) -> int:
    """The largest factor <= `steps` that divides `vocab_size` (PopART's requirement):
    5 for a 30400-entry vocabulary, 4 for the bundled 8192, 3 for BERT's 30522."""
    return next(f for f in range(min(steps, vocab_size), 0, -1) if vocab_size % f == 0)


def attention_mask(b: Builder, input_mask: str, seq_len: int | str) -> str:
    """[B, S] 1/0 mask → additive [B, 1, S, S] float mask (0 keep, -10000 drop).

    Expanded over the query axis because ONNX Runtime's Attention kernel does not broadcast it;
    with a symbolic `seq_len` the expanded shape is read from the mask itself.
    """
    with b.nameScope("AttentionMask"):
        as_float = b.aiOnnx.cast([input_mask], "Cast", to=1)
        one = scalar(b, 1.0, np.float32, "one")
        inverted = b.aiOnnx.sub([one, as_float], "Invert")
        additive = b.aiOnnx.mul([inverted, scalar(b, MASK_VALUE, np.float32, "big")], "Scale")
        mask = unsqueeze(b, additive, [1, 2], "Unsqueeze")
        if isinstance(seq_len, str):
            length = b.aiOnnx.shape([input_mask], "Length", start=1, end=2)
            shape = b.aiOnnx.concat([b.addConstant(np.array([1, 1], np.int64), "ones"),
                                     length, length], "shape", axis=0)
        else:
            shape = b.addConstant(np.array([1, 1, seq_len, seq_len], np.int64), "shape")
        return b.aiOnnx.expand([mask, shape], "Expand")


def packed_attention_mask(b: Builder, sequence_index: str, seq_len: int) -> str:
    """[B, S] sequence index (0 = padding, 1..k = packed sequence) → additive [B, 1, S, S].

    Block-diagonal: query i may attend to key j only if both belong to the same sequence and
    j is not padding. A padding query sees only -10000 and attends uniformly; its output is
    never read.
    """
    with b.nameScope("AttentionMask"):
        sequence_index = as_index(b, sequence_index, "Index")
        queries = unsqueeze(b, sequence_index, [2], "Queries", "query_axis")
        keys = unsqueeze(b, sequence_index, [1], "Keys", "key_axis")
        same = b.aiOnnx.equal([queries, keys], "SameSequence")  # [B, S, S]
        real = b.aiOnnx.greater([keys, b.addConstant(np.array(0, _int_dtype(b, keys)), "zero")],
                                "RealKey")  # [B, 1, S]
        allowed = b.aiOnnx.cast([b.aiOnnx.And([same, real], "Allowed")], "Cast", to=1)
        one = scalar(b, 1.0, np.float32, "one")
        inverted = b.aiOnnx.sub([one, allowed], "Invert")
        additive = b.aiOnnx.mul([inverted, scalar(b, MASK_VALUE, np.float32, "big")], "Scale")
        return unsqueeze(b, additive, [1], "Unsqueeze", "head_axis")


def multi_head_attention(b: Builder, q: str, k: str, v: str, mask: str, hidden: int,
                         heads: int, seq_len: int | str, attention_dropout: float,
                         query_len: int | str | None = None) -> str:
    """Scaled dot-product attention over [B, S, H] tensors, returning [B, S, H].

    With no attention-probability dropout the `onnx` dialect emits the fused opset-23
    `Attention` op; otherwise (and in the `popart` dialect) the explicit
    MatMul/Softmax/Dropout/MatMul chain, since `Attention` has no dropout. A symbolic
    `seq_len` reshapes through -1 (`sequence_entry`). Queries of another length than the keys
    (`query_len`, e.g. 1 for [CLS] alone) give [B, query_len, H]; `mask` is then
    [B, 1, query_len, S].
    """
    if b.dialect == "onnx" and attention_dropout <= 0.0:
        return b.aiOnnx.attention([q, k, v, mask], "Attention", q_num_heads=heads,
                                  kv_num_heads=heads)
    head_dim = hidden // heads
    split_shape = b.addConstant(np.array([0, sequence_entry(seq_len), heads, head_dim],
                                           np.int64), "heads_shape")
    query_len = seq_len if query_len is None else query_len
    query_shape = split_shape if query_len == seq_len else b.addConstant(
        np.array([0, sequence_entry(query_len), heads, head_dim], np.int64), "query_shape")

    def heads_first(t: str, perm: list[int], name: str, shape: str = split_shape) -> str:
        return b.aiOnnx.transpose([b.aiOnnx.reshape([t, shape], f"{name}/Reshape")],
                                  f"{name}/Transpose", perm=perm)

    qh = heads_first(q, [0, 2, 1, 3], "Q", query_shape)
    kh = heads_first(k, [0, 2, 3, 1], "K")  # [B, heads, d, S]
    vh = heads_first(v, [0, 2, 1, 3], "V")
    scores = b.aiOnnx.matmul([qh, kh], "Scores")
    scores = b.aiOnnx.mul([scores, scalar(b, 1.0 / np.sqrt(head_dim), np.float32, "scale")],
                          "Scale")
    scores = b.aiOnnx.add([scores, mask], "Mask")
    probs = b.aiOnnx.softmax([scores], "Softmax", axis=-1)
    probs = dropout(b, probs, attention_dropout, "ProbsDropout")
    context = b.aiOnnx.matmul([probs, vh], "Context")
    context = b.aiOnnx.transpose([context], "Context/Transpose", perm=[0, 2, 1, 3])
    merge = b.addConstant(np.array([0, sequence_entry(query_len), hidden], np.int64),
                          "merge_shape")
    return b.aiOnnx.reshape([context, merge], "Context/Reshape")


def softmax_cross_entropy(b: Builder, logits: str, labels: str, ignore_index: int | None,
                          name: str) -> str:
    """Mean cross-entropy of [N, C] logits against [N] labels, skipping `ignore_index`.

    popart: Softmax + `ai.graphcore::Nll` (mean over the labels not ignored), as Graphcore's
    BERT wrote it; PopART fuses the pair's gradient (NlllWithSoftmaxGradDirect) and so does the
    torch lowering (`log_softmax` + NLL), so the loss is as stable as the fused onnx op.
    """
    if b.dialect == "onnx":
        return b.aiOnnx.softmaxcrossentropyloss([logits, labels], name, reduction="mean",
                                                ignore_index=ignore_index)
    probs = b.aiOnnx.softmax([logits], f"{name}/Softmax", axis=-1)
    return b.aiGraphcore.nllloss([probs, labels], name, reduction=1,  # popart.ReductionType.Mean
                                 ignoreIndex=ignore_index)


def accuracy(b: Builder, logits: str, labels: str, ignore_index: int | None, name: str) -> str:
    """Fraction of argmax predictions equal to the labels, over labels != ignore_index.

    popart: the logits are read through `ai.graphcore::Detach`, so PopART's autodiff never
    walks back through the ArgMax of a metric (it has no gradient).
    """
    with b.nameScope(name):
        if b.dialect == "popart":
            logits = b.aiGraphcore.detach([logits], "Detach")
        predictions = b.aiOnnx.argmax([logits], "ArgMax", axis=-1, keepdims=0)  # INT64
        labels = as_index(b, labels, "Labels")
        if b.getTensorDtypeString(labels) != "int64":  # 32-bit labels: compare in INT32
            predictions = b.aiOnnx.cast([predictions], "Predictions", to=TensorProto.INT32)
        correct = b.aiOnnx.cast([b.aiOnnx.equal([predictions, labels], "Equal")], "Correct",
                                to=1)
        if ignore_index is None:
            return b.aiOnnx.reducemean([correct], "Mean", keepdims=0)
        ignore = b.addConstant(np.array(ignore_index, _int_dtype(b, labels)), "ignore")
        ignored = b.aiOnnx.equal([labels, ignore], "Ignored")
        weight = b.aiOnnx.cast([b.aiOnnx.Not([ignored], "Valid")], "Weight", to=1)
        hits = b.aiOnnx.reducesum([b.aiOnnx.mul([correct, weight], "Hits")], "HitSum",
                                  keepdims=0)
        count = b.aiOnnx.reducesum([weight], "Count", keepdims=0)
        count = b.aiOnnx.max([count, scalar(b, 1.0, np.float32, "one")], "AtLeastOne")
        return b.aiOnnx.div([hits, count], "Accuracy")


def _static(shape: list, tensor: str) -> list[int]:
    if any(not isinstance(d, int) or d <= 0 for d in shape):
        raise ValueError(f"popart dialect needs static shapes; {tensor!r} has shape {shape}")
    return shape
