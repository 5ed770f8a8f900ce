"""The PopART backend: a popbert graph trained by Graphcore's PopART on IPUs.

``make_session(model, loss, optimizer, SessionOptions(backend="popart"))`` (or
``execution.backend: popart``) returns a :class:`PopartTrainingSession`: the same graph, optimizer
factory, options and loss scaler as the torch backend, translated into PopART's objects, behind
the same ``popbert.runtime.protocol.Session``. Nothing here has run on an IPU (this repository's
machines have no Poplar SDK); ``tests/backends/test_popart_backend.py`` checks the translation
against a stand-in. What is translated and how (optimizer, half weights, weights and state, runs,
validation): docs/design.md, section "popbert.backends.popart"; using it: docs/popart.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from popbert.backends import import_popart
from popbert.backends.popart_options import (
    PopartOptions,
    acquire_device,
    data_flow,
    device_ipus,
    session_options,
)
from popbert.distributed import Replicas
from popbert.dtypes import rounds_stochastically
from popbert.errors import CheckpointError, ConfigError, InputError, UsageError
from popbert.graph.annotations import (
    IPU_NUMBER,
    PIPELINE_STAGE,
    constant_initializers,
    node_annotation,
    trainable_initializers,
)
from popbert.optimizers import AdamW, Lamb, LossScaler

if TYPE_CHECKING:
    from popbert.config import RunConfig
    from popbert.runtime.options import SessionOptions

log = logging.getLogger(__name__)

__all__ = ["AdamPlan", "GraphLayout", "OPTIMIZER_STATE_PREFIXES", "PopartOptions",
           "PopartTrainingSession", "adam_plan", "check_run_config", "graph_layout",
           "store_weights_as", "unsupported"]

NamedParameters = list[tuple[str, torch.nn.Parameter]]
OptimizerFactory = Callable[[NamedParameters], torch.optim.Optimizer]
Batch = Mapping[str, torch.Tensor | np.ndarray]
OptimizerValue = tuple[float, bool]  # PopART's OptimizerValue: (value, isConst)

POPART_MAX_OPSET = 11  # PopART reads ai.onnx up to opset 11
NO_WEIGHT_NORM_CLAMP = float(np.finfo(np.float16).max)  # Graphcore's BERT's defaultMaxWeightNorm
# PopART's optimizer state is kept in Variables named by these prefixes and the weight's name.
OPTIMIZER_STATE_PREFIXES = ("Accl1___", "Accl2___", "Step___")
CAST_SUFFIX = "::float32:"  # the FP32 view of a half weight: "<weight>::float32:<use>"
_STORAGE = {"float16": TensorProto.FLOAT16, "float32": TensorProto.FLOAT}
_FLOATS = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE)


# -- what popbert asks that PopART cannot do ------------------------------------------------------

def unsupported(*, weight_dtype: str, compute_dtype: str, graph_dtype: str | None,
                dynamic_loss_scaling: bool, max_trust_ratio: float | None) -> str | None:
    """The first thing asked of the PopART backend that has no PopART translation, as one line
    naming the config key and the ``SessionOptions`` field; None when everything translates.
    ``graph_dtype``: the graph's weight dtype before any half storage (None: not known yet)."""
    if weight_dtype not in _STORAGE:
        return (f"execution.weight_dtype (SessionOptions.weight_dtype) is {weight_dtype!r}: "
                "IPUs store weights in float16 or float32")
    if graph_dtype is not None and compute_dtype != graph_dtype:
        return (f"execution.compute_dtype (SessionOptions.compute_dtype) is {compute_dtype!r} "
                f"but PopART computes in the graph's own dtype, {graph_dtype} here (the torch "
                f"backend's autocast has no PopART counterpart): set it to {graph_dtype}")
    if dynamic_loss_scaling:
        return ("optimizer.loss_scaling is 'dynamic': the PopART backend scales the loss "
                "statically (optimizer.loss_scaling: static with optimizer.loss_scale; "
                "Graphcore's BERT used 512 for Base, 64 for Large)")
    if max_trust_ratio is not None:
        return (f"optimizer.max_trust_ratio is {max_trust_ratio}: PopART's LAMB has no "
                "trust-ratio clamp (it bounds the weight norm with maxWeightNorm instead); set "
                "it to null")
    return None


def check_run_config(cfg: RunConfig) -> None:
    """What a run config asks of the PopART backend that cannot be translated, as a one-line
    ConfigError, before a graph is built (the graph's dtype is checked by the session)."""
    e, o = cfg.execution, cfg.optimizer
    problem = unsupported(weight_dtype=e.weight_dtype, compute_dtype=e.compute_dtype,
                          graph_dtype=None, dynamic_loss_scaling=o.loss_scaling == "dynamic",
                          max_trust_ratio=o.max_trust_ratio)
    if problem:
        raise ConfigError(problem)


# -- the graph as PopART sees it ------------------------------------------------------------------

@dataclass(frozen=True)
class GraphLayout:
    """What the session reads off a graph once: its fed inputs (and their dtypes), its scalar
    outputs (the anchors), its trainable weights (shape, dtype), the float constants PopART would
    otherwise train, and the IPUs one replica spans."""

    inputs: tuple[str, ...]
    input_dtypes: dict[str, np.dtype]
    outputs: tuple[str, ...]
    scalar_outputs: tuple[str, ...]
    weights: dict[str, tuple[tuple[int, ...], np.dtype]]
    float_constants: tuple[str, ...]
    ipus: int
    placed: bool
    opset: int

    @property
    def weight_dtype(self) -> str | None:
        """The weights' dtype name ("float32", "float16"), or None for a graph without weights
        or with several."""
        names = {np.dtype(dtype).name for _, dtype in self.weights.values()}
        return names.pop() if len(names) == 1 else None


def _np_dtype(elem_type: int) -> np.dtype:
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def graph_layout(proto: onnx.ModelProto) -> GraphLayout:
    """The :class:`GraphLayout` of ``proto``."""
    graph = proto.graph
    initializers = {t.name: t for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in initializers]
    weights = {name: (tuple(int(d) for d in initializers[name].dims),
                      _np_dtype(initializers[name].data_type))
               for name in trainable_initializers(proto)}
    constants = constant_initializers(proto)
    float_constants = tuple(t.name for t in graph.initializer
                            if t.name in constants and t.data_type in _FLOATS)
    scalar = tuple(o.name for o in graph.output
                   if o.type.tensor_type.HasField("shape") and not o.type.tensor_type.shape.dim)
    ipu_numbers = [v for v in (node_annotation(n, IPU_NUMBER) for n in graph.node)
                   if v is not None]
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 0)
    return GraphLayout(
        inputs=tuple(i.name for i in inputs),
        input_dtypes={i.name: _np_dtype(i.type.tensor_type.elem_type) for i in inputs},
        outputs=tuple(o.name for o in graph.output), scalar_outputs=scalar, weights=weights,
        float_constants=float_constants, ipus=max(ipu_numbers, default=0) + 1,
        placed=bool(ipu_numbers), opset=int(opset))


def store_weights_as(proto: onnx.ModelProto, dtype: str) -> onnx.ModelProto:
    """A copy of ``proto`` whose trainable FLOAT initializers are stored in ``dtype`` ("float16")
    and read through a ``Cast`` to FLOAT before each use.

    PopART keeps a weight in its initializer's dtype, so this is how "weights stored in half,
    computed from FP32 views" (the torch backend's ``weight_dtype``) is said to PopART: the
    gradient flows back through the Cast into the half weight. Each Cast carries its consumer's
    ``__ipu_number`` and ``__pipeline_stage`` (a tied weight used in two stages gets one Cast in
    each), so a placed or pipelined graph stays placed. Other initializers are left alone.
    """
    target = _STORAGE[dtype]
    model = onnx.ModelProto()
    model.CopyFrom(proto)
    graph = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for n in graph.node for a in n.attribute):
        raise ValueError("store_weights_as: graphs with subgraphs (If, Loop, Scan) are not "
                         "supported")
    floats = {t.name for t in graph.initializer if t.data_type == TensorProto.FLOAT}
    halves = [name for name in trainable_initializers(model) if name in floats]
    if target == TensorProto.FLOAT or not halves:
        return model
    stored = set(halves)
    for tensor in graph.initializer:
        if tensor.name in stored:
            array = numpy_helper.to_array(tensor).astype(helper.tensor_dtype_to_np_dtype(target))
            tensor.CopyFrom(numpy_helper.from_array(array, tensor.name))
    for info in [*graph.input, *graph.value_info]:
        if info.name in stored:
            info.type.tensor_type.elem_type = target
    uses: dict[str, int] = {}
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        for position, name in enumerate(node.input):
            if name not in stored:
                continue
            view = f"{name}{CAST_SUFFIX}{uses.get(name, 0)}"
            uses[name] = uses.get(name, 0) + 1
            cast = helper.make_node("Cast", [name], [view], name=view, to=TensorProto.FLOAT)
            cast.attribute.extend(a for a in node.attribute
                                  if a.name in (IPU_NUMBER, PIPELINE_STAGE))
            nodes.append(cast)
            node.input[position] = view
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return model


# -- the optimizer --------------------------------------------------------------------------------

@dataclass(frozen=True)
class AdamPlan:
    """A ``popart.Adam`` as data: its mode, its values (``"defaultLearningRate"``, ...,
    ``"lossScaling"``), the per-weight values for ``insertSpecific`` and the clipping norm.

    Plain data so that a session can tell whether the optimizer changed between runs (and only
    in what PopART may change: non-const values) before it calls ``updateOptimizerFromHost``.
    """

    mode: str
    values: dict[str, OptimizerValue]
    specific: dict[str, dict[str, OptimizerValue]] = field(default_factory=dict)
    max_grad_norm: float | None = None

    def build(self, popart: ModuleType) -> Any:
        """The ``popart.Adam`` of this plan."""
        clip = ([popart.ClipNormSettings.clipAllWeights(self.max_grad_norm)]
                if self.max_grad_norm is not None else [])
        adam = popart.Adam(dict(self.values), mode=getattr(popart.AdamMode, self.mode),
                           weight_decay_mode=popart.WeightDecayMode.Decay,
                           accl1_type=popart.DataType.FLOAT, accl2_type=popart.DataType.FLOAT,
                           clip_norm_settings=clip)
        for weight, values in self.specific.items():
            adam.insertSpecific(weight, dict(values))
        return adam

    def changes_only_variables(self, other: AdamPlan) -> bool:
        """Whether ``other`` differs from this plan only in non-const values (what
        ``updateOptimizerFromHost`` accepts)."""
        if (self.mode, self.max_grad_norm) != (other.mode, other.max_grad_norm):
            return False
        if set(self.specific) != set(other.specific):
            return False
        pairs = [(self.values, other.values)]
        pairs += [(self.specific[w], other.specific[w]) for w in self.specific]
        for mine, theirs in pairs:
            if set(mine) != set(theirs):
                return False
            for key, (value, const) in mine.items():
                if theirs[key][1] != const or (const and theirs[key][0] != value):
                    return False
        return True


def adam_plan(optimizer: torch.optim.Optimizer, names: Mapping[int, str],
              frozen: Iterable[str] = (), loss_scale: float | None = None) -> AdamPlan:
    """The :class:`AdamPlan` of a popbert ``Lamb`` / ``AdamW`` (the table: docs/design.md, section
    "popbert.backends.popart").

    ``names``: ``id(parameter)`` → weight name for the optimizer's parameters; ``frozen``:
    weights PopART must not change (constants, weights the optimizer was not given).
    """
    if isinstance(optimizer, Lamb):
        lamb = True
    elif isinstance(optimizer, AdamW):
        lamb = False
    else:
        raise UsageError(f"the PopART backend translates popbert.optimizers.Lamb and AdamW "
                         f"(popart.Adam); got {type(optimizer).__module__}."
                         f"{type(optimizer).__qualname__}")
    groups = optimizer.param_groups
    corrections = {bool(g["bias_correction"]) for g in groups}
    if len(corrections) > 1:
        raise UsageError("the param groups disagree on bias_correction; PopART's AdamMode is "
                         "one per optimizer")
    bias = corrections.pop() if corrections else bool(optimizer.defaults["bias_correction"])
    mode = ("Lamb" if bias else "LambNoBias") if lamb else ("Adam" if bias else "AdamNoBias")
    clamps = sorted({g["max_trust_ratio"] for g in groups if g.get("max_trust_ratio")})
    if clamps and lamb:
        raise UsageError(unsupported(weight_dtype="float32", compute_dtype="float32",
                                     graph_dtype=None, dynamic_loss_scaling=False,
                                     max_trust_ratio=clamps[0]))
    d = optimizer.defaults

    def per_tensor(group: Mapping[str, Any]) -> dict[str, OptimizerValue]:
        values = {"learningRate": (float(group["lr"]), False),
                  "weightDecay": (float(group["weight_decay"]), True),
                  "beta1": (float(group["betas"][0]), True),
                  "beta2": (float(group["betas"][1]), True),
                  "eps": (float(group["eps"]), True)}
        if lamb:
            norm = 0.0 if not group["trust_ratio"] else group.get("max_weight_norm")
            values["maxWeightNorm"] = (float(NO_WEIGHT_NORM_CLAMP if norm is None else norm),
                                       True)
        return values

    default = per_tensor({**d, "lr": groups[0]["lr"] if groups else d["lr"],
                          "trust_ratio": True})
    values = {"default" + key[0].upper() + key[1:]: value for key, value in default.items()}
    if loss_scale is not None:
        values["lossScaling"] = (float(loss_scale), True)
    specific: dict[str, dict[str, OptimizerValue]] = {}
    for group in groups:
        differs = {k: v for k, v in per_tensor(group).items() if default[k] != v}
        if differs:
            for param in group["params"]:
                specific[names[id(param)]] = differs
    for name in frozen:
        specific[name] = {"learningRate": (0.0, True), "weightDecay": (0.0, True)}
    clip = getattr(optimizer, "max_grad_norm", None)
    return AdamPlan(mode, values, specific, float(clip) if clip is not None else None)


def _stochastic_rounding(optimizer: torch.optim.Optimizer, weights: str) -> bool:
    """Whether the optimizer asks for stochastically rounded updates of ``weights``-format
    weights (its groups' ``stochastic_rounding``, by `popbert.dtypes.rounds_stochastically`)."""
    flags = {g.get("stochastic_rounding") for g in optimizer.param_groups}
    return any(rounds_stochastically(flag, weights) for flag in flags)


# -- the session ----------------------------------------------------------------------------------

class PopartTrainingSession:
    """Train a graph with PopART: the PopART face of :class:`popbert.TrainingSession`.

    Made by :func:`popbert.backends.make_session` with the torch session's arguments, plus
    ``popart_options`` (:class:`~popbert.backends.popart_options.PopartOptions`). ``replicas``:
    None or a single process — PopART runs ``options.replication_factor`` replicas itself.
    ``input_checker`` builds the batch checker from ``(proto, input names)``
    (``popbert.runtime.inputs.InputChecker``, handed over by ``make_session``). ``popart``: the
    module to use (default: :func:`popbert.backends.import_popart`).
    """

    def __init__(self, model: onnx.ModelProto, loss: str, optimizer: OptimizerFactory,
                 options: SessionOptions, step_hook: Callable[[int], None] | None = None,
                 loss_scaler: LossScaler | None = None, replicas: Replicas | None = None, *,
                 input_checker: Callable[[onnx.ModelProto, list[str]], Any],
                 popart_options: PopartOptions | None = None,
                 popart: ModuleType | None = None):
        self._popart = popart if popart is not None else import_popart()
        self.options = options
        self.popart_options = popart_options or PopartOptions()
        if replicas is not None and replicas.size > 1:
            raise ValueError("the PopART backend runs its replicas inside one process "
                             "(replicatedGraphCount = SessionOptions.replication_factor): start "
                             "one process, not one per replica")
        self.replicas = Replicas.single()
        given = graph_layout(model)
        problem = unsupported(
            weight_dtype=options.weight_dtype, compute_dtype=options.compute_dtype,
            graph_dtype=given.weight_dtype,
            dynamic_loss_scaling=loss_scaler is not None and loss_scaler.dynamic,
            max_trust_ratio=None)
        if problem:
            raise ConfigError(problem)
        if given.weight_dtype == "float16" and options.weight_dtype == "float32":
            raise ConfigError("the graph stores float16 weights but SessionOptions.weight_dtype "
                              "(execution.weight_dtype) is float32")
        if given.opset > POPART_MAX_OPSET:
            log.warning("the graph uses ai.onnx opset %d; PopART reads up to opset %d (build it "
                        "with model.dialect: popart)", given.opset, POPART_MAX_OPSET)
        if options.pipeline and options.pipeline_schedule != "1f1b":
            log.warning("PopART schedules its pipeline itself (fill, 1F1B, flush); "
                        "pipeline_schedule %r is the torch backend's", options.pipeline_schedule)
        self.proto = store_weights_as(model, options.weight_dtype)
        self.layout = graph_layout(self.proto)
        if loss not in self.layout.outputs:
            raise ValueError(f"loss {loss!r} is not a graph output; outputs are "
                             f"{list(self.layout.outputs)}")
        self.loss_name = loss
        self.input_names = list(self.layout.inputs)
        self.output_names = list(self.layout.outputs)
        self.anchors = list(dict.fromkeys([loss, *self.layout.scalar_outputs]))
        self.inputs = input_checker(self.proto, self.input_names)
        self.step = 0
        self.step_hook = step_hook
        self.loss_scaler = loss_scaler
        self.device = torch.device("cpu")  # the host side; the IPUs are PopART's

        # The optimizer as the torch backend would make it, over shape-only placeholders: the
        # description popart.Adam is built from (and what set_lr changes between runs).
        self.named_parameters: NamedParameters = [
            (name, torch.nn.Parameter(torch.empty(shape, dtype=_torch_dtype(dtype),
                                                  device="meta")))
            for name, (shape, dtype) in self.layout.weights.items()]
        self.optimizer = optimizer(self.named_parameters)
        self._names = {id(p): n for n, p in self.named_parameters}
        optimized = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        self._frozen = [*self.layout.float_constants,
                        *(n for n, p in self.named_parameters if id(p) not in optimized)]
        self._plan = self._adam_plan()

        popart_ = self._popart
        user_options = session_options(
            popart_, options, self.popart_options, manual_placement=self.layout.placed,
            stochastic_rounding=_stochastic_rounding(self.optimizer, options.weight_dtype))
        self.device_info = acquire_device(popart_, self.popart_options,
                                          device_ipus(options.replication_factor,
                                                      self.layout.ipus))
        self._session = popart_.TrainingSession(
            fnModel=self.proto.SerializeToString(),
            dataFlow=data_flow(popart_, options.device_iterations, self.anchors),
            loss=loss, optimizer=self._plan.build(popart_), deviceInfo=self.device_info,
            userOptions=user_options)
        self._session.prepareDevice()
        self._session.weightsFromHost()
        self.seed = int(options.seed if options.seed is not None else torch.initial_seed())
        self._session.setRandomSeed(self.seed)
        self._host_weights: dict[str, torch.Tensor] | None = None
        # Validation (``evaluate``): its inference session, made at the first call, and whether
        # it holds the training session's current weights.
        self._validation: Any = None
        self._validation_device: Any = None
        self._validation_current = False

    # -- what the training loop uses --------------------------------------------------------------
    @property
    def sharded(self) -> bool:
        """Whether the optimizer state is sharded over the replicas (RTS)."""
        return self.options.replicated_tensor_sharding

    def micro_batches_per_run(self) -> int:
        """Micro-batches one `run()` takes:
        ``device_iterations × gradient_accumulation × replication_factor``."""
        o = self.options
        return o.device_iterations * o.gradient_accumulation * o.replication_factor

    def run(self, batch: Batch, micro_batches: int | None = None) -> dict[str, torch.Tensor]:
        """Train on ``batch`` (checked first: an InputError names what is wrong): one
        ``session.run`` of ``device_iterations`` optimizer steps; returns each scalar output's
        mean per step, shape [iterations]. ``micro_batches`` other than
        ``gradient_accumulation`` is refused: the steps are compiled for that many."""
        o = self.options
        if micro_batches is not None and micro_batches != o.gradient_accumulation:
            raise InputError(f"the PopART session's steps take gradient_accumulation "
                             f"({o.gradient_accumulation}) micro-batches each, not "
                             f"{micro_batches} (batch-size warmup needs the torch backend)")
        iterations = o.device_iterations
        per_run = (f" (device_iterations {iterations} × gradient_accumulation "
                   f"{o.gradient_accumulation} × replicas {o.replication_factor})")
        tensors = self.inputs.check(batch, self.micro_batches_per_run(), per_run)
        total = next(iter(tensors.values())).shape[0]
        if total % self.micro_batches_per_run():
            raise InputError(f"batch of {total} samples does not divide into "
                             f"{self.micro_batches_per_run()} micro-batches{per_run}")
        if self.step_hook is not None:
            self.step_hook(self.step)
        self._update_optimizer()
        feeds = {name: self._feed(name, tensors[name]) for name in self.input_names}
        anchors = self._session.initAnchorArrays()
        self._session.run(self._popart.PyStepIO(feeds, anchors))
        self._host_weights = None
        self._validation_current = False
        self.step += iterations
        outputs = {name: torch.from_numpy(
            np.asarray(anchors[name], dtype=np.float64).reshape(iterations, -1).mean(axis=1)
            .astype(np.float32)) for name in self.anchors}
        if self.loss_scaler is not None:
            outputs["loss_scale"] = torch.full((iterations,), self.loss_scaler.scale_value)
        return outputs

    def _feed(self, name: str, tensor: torch.Tensor) -> np.ndarray:
        """One input as PopART takes it: [iterations, accumulation, replicas, micro, ...] with the
        factors of 1 left out, in the graph input's declared dtype (numpy uint32/int32 for the
        popart dialect): PopART's step IO takes no other, and the batch was range-checked
        against that type first (``run``), so the cast from the loaders' int64 cannot wrap."""
        o = self.options
        factors = [f for f in (o.device_iterations, o.gradient_accumulation,
                               o.replication_factor) if f > 1]
        array = tensor.detach().cpu().numpy().astype(self.layout.input_dtypes[name], copy=False)
        micro = array.shape[0] // self.micro_batches_per_run()
        return np.ascontiguousarray(array.reshape(*factors, micro, *array.shape[1:]))

    def _adam_plan(self) -> AdamPlan:
        scale = self.loss_scaler.scale_value if self.loss_scaler is not None else None
        return adam_plan(self.optimizer, self._names, self._frozen, scale)

    def _update_optimizer(self) -> None:
        """Send the optimizer to the device when the host-side one changed (a new lr)."""
        plan = self._adam_plan()
        if plan == self._plan:
            return
        if not self._plan.changes_only_variables(plan):
            raise UsageError("between runs PopART can change the learning rate only; the "
                             "optimizer's other settings changed")
        self._session.updateOptimizerFromHost(plan.build(self._popart))
        self._plan = plan

    # -- weights ------------------------------------------------------------------------------
    def weights(self) -> dict[str, torch.Tensor]:
        """The trainable weights under their ONNX names, in their stored dtype: a host snapshot
        (``weightsToHost`` + ``readWeights``), fetched again after each run."""
        if self._host_weights is None:
            arrays = {n: np.empty(shape, dtype) for n, (shape, dtype)
                      in self.layout.weights.items()}
            self._read(arrays)
            self._host_weights = {n: torch.from_numpy(a) for n, a in arrays.items()}
        return dict(self._host_weights)

    def load_weights(self, weights: Mapping[str, torch.Tensor | np.ndarray],
                     strict: bool = True) -> None:
        """Copy ``weights`` (ONNX names) to the device; ``strict``: unknown names are an error.
        Shapes must match; dtypes are cast to the stored weight dtype."""
        ours = self.layout.weights
        unknown = sorted(set(weights) - set(ours))
        if unknown and strict:
            raise KeyError(f"weights not in the graph: {unknown[:5]}")
        arrays = {}
        for name, value in weights.items():
            if name not in ours:
                continue
            shape, dtype = ours[name]
            array = _numpy(value)
            if tuple(array.shape) != shape:
                raise ValueError(f"weight {name!r}: shape {tuple(array.shape)} does not match "
                                 f"the graph's {shape}")
            arrays[name] = _c_array(array, dtype)
        self._write(arrays)

    def _read(self, arrays: dict[str, np.ndarray]) -> None:
        self._session.weightsToHost()
        self._session.readWeights(self._popart.PyWeightsIO(arrays))

    def _write(self, arrays: dict[str, np.ndarray]) -> None:
        # weightsFromHost sends every weight's host copy: refresh them first, so the weights
        # not written here keep the values the device trained them to.
        self._session.weightsToHost()
        self._session.writeWeights(self._popart.PyWeightsIO(arrays))
        self._session.weightsFromHost()
        self._host_weights = None
        self._validation_current = False

    # -- validation -----------------------------------------------------------------------------
    def evaluate(self, batch: Batch) -> dict[str, torch.Tensor]:
        """The loss and the scalar outputs for one micro-batch with dropout off and no update
        (validation), as the torch session's ``evaluate``: a ``popart.InferenceSession`` of the
        same graph (PopART applies no dropout in an inference session), made at the first call
        on IPUs of its own (the graph's, one replica, no accumulation or pipelining), and given
        the training session's current weights whenever training changed them. Training is left
        as it was: its step, weights, optimizer state and device RNG are not touched. Each
        output comes back in its per-micro-batch shape (scalars 0-d)."""
        tensors = self.inputs.check(batch)
        if self._validation is None:
            self._validation = self._inference_session()
        if not self._validation_current:
            arrays = {n: _c_array(w.numpy(), self.layout.weights[n][1])
                      for n, w in self.weights().items()}
            self._validation.writeWeights(self._popart.PyWeightsIO(arrays))
            self._validation.weightsFromHost()
            self._validation_current = True
        feeds = {name: np.ascontiguousarray(tensors[name].detach().cpu().numpy().astype(
            self.layout.input_dtypes[name], copy=False)) for name in self.input_names}
        anchors = self._validation.initAnchorArrays()
        self._validation.run(self._popart.PyStepIO(feeds, anchors))
        return {name: torch.from_numpy(np.array(anchors[name], copy=True))
                for name in self.anchors}

    def _inference_session(self) -> Any:
        """PopART's inference session for ``evaluate``: one micro-batch per run."""
        popart_ = self._popart
        single = dataclasses.replace(self.options, gradient_accumulation=1, device_iterations=1,
                                     replication_factor=1, replicated_tensor_sharding=False,
                                     pipeline=False, recompute=False)
        user_options = session_options(popart_, single, self.popart_options,
                                       manual_placement=self.layout.placed,
                                       stochastic_rounding=False)
        self._validation_device = acquire_device(popart_, self.popart_options,
                                                 device_ipus(1, self.layout.ipus))
        session = popart_.InferenceSession(
            fnModel=self.proto.SerializeToString(), dataFlow=data_flow(popart_, 1, self.anchors),
            deviceInfo=self._validation_device, userOptions=user_options)
        session.prepareDevice()
        log.info("validation: a PopART inference session on %d IPU(s)",
                 self._validation_device.numIpus)
        return session

    # -- state ----------------------------------------------------------------------------------
    def _optimizer_state_ids(self) -> list[str]:
        return sorted(t for t in self._session.getTensorIds()
                      if t.startswith(OPTIMIZER_STATE_PREFIXES))

    def _state_array(self, tensor_id: str) -> np.ndarray:
        info = self._session.getInfo(tensor_id)
        return np.empty(list(info.shape()), dtype=np.dtype(info.data_type_lcase()))

    def state_dict(self) -> dict[str, Any]:
        """What PopART gives back for a resumed run: ``step``, ``weights``, ``optimizer``
        (``{"popart": {tensor id: array}}``: the moments and step counters PopART keeps as
        weights), ``loss_scaler`` and ``rng`` (the seed and the device's RNG state)."""
        state = {t: self._state_array(t) for t in self._optimizer_state_ids()}
        weights = {n: np.empty(shape, dtype) for n, (shape, dtype) in self.layout.weights.items()}
        self._read({**weights, **state})
        return {"step": self.step,
                "weights": {n: torch.from_numpy(a) for n, a in weights.items()},
                "optimizer": {"popart": {t: torch.from_numpy(a) for t, a in state.items()}},
                "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler else {},
                "rng": {"popart": {"seed": self.seed, "state": self._rng_state()}}}

    def _rng_state(self) -> list[int]:
        """The device RNG state (``getRNGState``; [] where this SDK has none)."""
        get = getattr(self._session, "getRNGState", None)
        return [int(v) for v in get()] if get is not None else []

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s ``state``; a state that does not fit (another
        model, or the torch backend's optimizer state) is a one-line CheckpointError."""
        missing = [k for k in ("step", "weights", "optimizer") if k not in state]
        if missing:
            raise CheckpointError(f"session state lacks {', '.join(missing)}")
        weights = dict(state["weights"])
        absent = sorted(set(self.layout.weights) - set(weights))
        extra = sorted(set(weights) - set(self.layout.weights))
        if absent or extra:
            raise CheckpointError(f"the weights do not fit this model: {len(absent)} missing "
                                  f"({', '.join(absent[:3])}), {len(extra)} unknown "
                                  f"({', '.join(extra[:3])})")
        optimizer = state["optimizer"] or {}
        if "popart" not in optimizer:
            raise CheckpointError("the optimizer state is not PopART's (a torch-backend "
                                  "checkpoint?): resume it with the torch backend, or start "
                                  "from its weights (--init-from / load_weights)")
        ids = set(self._optimizer_state_ids())
        arrays = {}
        for tensor_id, value in optimizer["popart"].items():
            if tensor_id not in ids:
                raise CheckpointError(f"the optimizer state holds {tensor_id!r}, which this "
                                      "session does not have")
            target = self._state_array(tensor_id)
            array = _numpy(value)
            if array.shape != target.shape:
                raise CheckpointError(f"optimizer state {tensor_id!r} has shape {array.shape}, "
                                      f"this session {target.shape}")
            arrays[tensor_id] = _c_array(array, target.dtype)
        for name, (shape, dtype) in self.layout.weights.items():
            array = _numpy(weights[name])
            if tuple(array.shape) != shape:
                raise CheckpointError(f"the weights do not fit this model: {name!r} has shape "
                                      f"{tuple(array.shape)}, this model {shape}")
            arrays[name] = _c_array(array, dtype)
        self._write(arrays)
        scaler = state.get("loss_scaler") or {}
        if self.loss_scaler is not None and scaler:
            self.loss_scaler.load_state_dict(scaler)
        rng = (state.get("rng") or {}).get("popart")
        if rng and rng.get("state") and hasattr(self._session, "setRNGState"):
            self._session.setRNGState(list(rng["state"]))
        self.step = int(state["step"])

    def close(self) -> None:
        """Give the IPUs back (``DeviceInfo.detach``), validation's too."""
        self.device_info.detach()
        if self._validation_device is not None:
            self._validation_device.detach()


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype


def _c_array(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A C-contiguous copy in ``dtype`` (``np.ascontiguousarray`` would make a scalar 1-d)."""
    return np.array(array, dtype=dtype, order="C", copy=True)


def _numpy(value: Any) -> np.ndarray:
    """A CPU numpy array of a tensor or array (bfloat16 through float32)."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype == torch.bfloat16:
            value = value.float()
        return value.numpy()
    return np.asarray(value)
