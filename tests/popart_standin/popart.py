"""A STAND-IN for Graphcore's ``popart`` module, for popbert's contract test only.

It implements the part of PopART's Python API that ``popbert.backends.popart`` calls, with the
names, argument names and defaults of the PopART Python API (SDK 3.x: the ``popart_core`` pybind
bindings in ``python/popart/popart_core/popart.cpp`` and ``python/popart/python_files/
session.py`` of graphcore/popart), and records every call and every option set in :data:`LOG`.
It checks what PopART checks of its arguments where that is cheap and certain: option names
(a pybind class takes no other attributes), option value types, optimizer keys and
``(value, isConst)`` pairs, anchor return types, the element count and dtype of fed arrays, that
``updateOptimizerFromHost`` gets a valid replacement, and contiguous arrays in ``PyWeightsIO``.

It computes NOTHING: no graph is compiled, no IPU or IPU Model is used. ``run`` fills the anchors
with a pattern (``step + 0.1·micro-batch + 0.01·replica``) and moves every float weight by
``−learning rate`` per step, only so a test can see which optimizer and which weights the
"device" holds. Passing against it shows that popbert calls this API as intended; it shows
nothing about PopART's numbers, compilation or memory.

Put this directory on ``sys.path`` (the test does) to make ``import popart`` find it.
"""

from __future__ import annotations

import enum
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

__standin__ = True
LOG: list[tuple[Any, ...]] = []
AVAILABLE_IPUS = 64  # the stand-in's "machine"


def _log(*entry: Any) -> None:
    LOG.append(entry)


class popart_exception(Exception):
    """PopART's exception type."""


# -- enums (values as in the bindings) ------------------------------------------------------------

class VirtualGraphMode(enum.Enum):
    Off = 0
    Manual = 1
    Auto = 2
    ExecutionPhases = 3


class RecomputationType(enum.Enum):
    NoRecompute = 0
    Standard = 1
    NormOnly = 2
    Pipeline = 3
    RecomputeAll = 4


class ReductionType(enum.Enum):
    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.Enum):
    Running = 0
    Post = 1


class TensorStorage(enum.Enum):
    OnChip = 0
    OffChip = 1


class ReplicatedTensorSharding(enum.Enum):
    Off = 0
    On = 1


class AdamMode(enum.Enum):
    Adam = 0
    AdamNoBias = 1
    AdaMax = 2
    Lamb = 3
    LambNoBias = 4


class WeightDecayMode(enum.Enum):
    Decay = 0
    L2Regularization = 1


class DataType(enum.Enum):
    UNDEFINED = 0
    FLOAT = 1
    FLOAT16 = 2
    INT32 = 3
    UINT32 = 4


class SyncPattern(enum.Enum):
    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class DeviceConnectionType(enum.Enum):
    Always = 0
    OnDemand = 1
    Never = 2


class DeviceSelectionCriterion(enum.Enum):
    First = 0
    Random = 1


class AnchorReturnTypeId(enum.Enum):
    Final = 0
    EveryN = 1
    All = 2
    Sum = 3


# -- session options ------------------------------------------------------------------------------

class TensorLocation:
    def __init__(self, storage: TensorStorage = TensorStorage.OnChip,
                 replicatedTensorSharding: ReplicatedTensorSharding =
                 ReplicatedTensorSharding.Off, shardingDomain: Any = None) -> None:
        if not isinstance(storage, TensorStorage):
            raise TypeError(f"TensorLocation: storage must be a TensorStorage, got {storage!r}")
        if not isinstance(replicatedTensorSharding, ReplicatedTensorSharding):
            raise TypeError("TensorLocation: replicatedTensorSharding must be a "
                            f"ReplicatedTensorSharding, got {replicatedTensorSharding!r}")
        self.storage = storage
        self.replicatedTensorSharding = replicatedTensorSharding
        self.shardingDomain = shardingDomain

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, TensorLocation)
                and (self.storage, self.replicatedTensorSharding)
                == (other.storage, other.replicatedTensorSharding))

    def __repr__(self) -> str:
        return f"TensorLocation({self.storage}, {self.replicatedTensorSharding})"


class TensorLocationSettings:
    def __init__(self, location: TensorLocation | TensorStorage | None = None,
                 minElementsForOffChip: int = 2,
                 minElementsForReplicatedTensorSharding: int = 8192) -> None:
        if isinstance(location, TensorStorage):  # the (storage, ...) overload
            location = TensorLocation(location)
        self.location = location if location is not None else TensorLocation()
        self.minElementsForOffChip = int(minElementsForOffChip)
        self.minElementsForReplicatedTensorSharding = int(minElementsForReplicatedTensorSharding)

    def __repr__(self) -> str:
        return (f"TensorLocationSettings({self.location!r}, minElementsForOffChip="
                f"{self.minElementsForOffChip}, minElementsForReplicatedTensorSharding="
                f"{self.minElementsForReplicatedTensorSharding})")


# PopART's defaults (willow/include/popart/sessionoptions.hpp); only these names can be set.
_SESSION_OPTION_DEFAULTS: dict[str, Any] = {
    "logDir": "",
    "virtualGraphMode": VirtualGraphMode.Off,
    "enablePipelining": False,
    "autoRecomputation": RecomputationType.NoRecompute,
    "enableReplicatedGraphs": False,
    "replicatedGraphCount": 1,
    "enableDistributedReplicatedGraphs": False,
    "enableGradientAccumulation": False,
    "accumulationFactor": 1,
    "accumulationAndReplicationReductionType": ReductionType.Sum,
    "meanAccumulationAndReplicationReductionStrategy": MeanReductionStrategy.Post,
    "enableStochasticRounding": False,
    "optimizerStateTensorLocationSettings": None,  # set per instance
    "weightTensorLocationSettings": None,
    "accumulatorTensorLocationSettings": None,
    "enableEngineCaching": False,
    "cachePath": "session_cache",
    "enableOutlining": True,
    "outlineThreshold": 1.0,
    "enableFloatingPointChecks": False,
    "partialsTypeMatMuls": "",
    "engineOptions": {},
}


class SessionOptions:
    """``popart.SessionOptions``: a fixed set of attributes; each assignment is recorded."""

    def __init__(self) -> None:
        values = dict(_SESSION_OPTION_DEFAULTS)
        for key in ("optimizerStateTensorLocationSettings", "weightTensorLocationSettings",
                    "accumulatorTensorLocationSettings"):
            values[key] = TensorLocationSettings()
        object.__setattr__(self, "_values", values)
        object.__setattr__(self, "assigned", {})

    def __getattr__(self, name: str) -> Any:
        values = object.__getattribute__(self, "_values")
        if name in values:
            return values[name]
        raise AttributeError(f"'popart.SessionOptions' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise AttributeError(f"'popart.SessionOptions' object has no attribute {name!r}")
        default = _SESSION_OPTION_DEFAULTS[name]
        expected = type(values[name]) if default is None else type(default)
        if isinstance(default, bool) and not isinstance(value, bool):
            raise TypeError(f"SessionOptions.{name}: incompatible type {type(value).__name__}")
        if expected is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise TypeError(f"SessionOptions.{name}: expected {expected.__name__}, got "
                            f"{type(value).__name__}")
        values[name] = value
        self.assigned[name] = value
        _log("SessionOptions", name, value)


# -- data flow ------------------------------------------------------------------------------------

class AnchorReturnType:
    def __init__(self, anchorReturnTypeString: str, returnPeriod: int | None = None,
                 tileSet: Any = None, exchangeStrategy: Any = None) -> None:
        ids = {"final": AnchorReturnTypeId.Final, "everyn": AnchorReturnTypeId.EveryN,
               "all": AnchorReturnTypeId.All, "sum": AnchorReturnTypeId.Sum}
        key = anchorReturnTypeString.lower()
        if key not in ids:
            raise popart_exception("Invalid anchor return type ID supplied: "
                                   + anchorReturnTypeString)
        self._id = ids[key]
        self._rp = returnPeriod or 0

    def id(self) -> AnchorReturnTypeId:
        return self._id

    def rp(self) -> int:
        return self._rp


class DataFlow:
    def __init__(self, batchesPerStep: int, anchorTensors: dict[str, AnchorReturnType]
                 ) -> None:
        if not isinstance(batchesPerStep, int) or batchesPerStep < 1:
            raise TypeError(f"DataFlow: batchesPerStep must be a positive int, got "
                            f"{batchesPerStep!r}")
        for name, art in anchorTensors.items():
            if not isinstance(name, str) or not isinstance(art, AnchorReturnType):
                raise TypeError("DataFlow: anchorTensors maps tensor ids to AnchorReturnType")
        self._bps = batchesPerStep
        self._anchors = dict(anchorTensors)
        _log("DataFlow", batchesPerStep, {k: v.id() for k, v in anchorTensors.items()})

    def batchesPerStep(self) -> int:
        return self._bps

    def anchors(self) -> list[str]:
        return list(self._anchors)

    def art(self, anchor: str) -> AnchorReturnType:
        return self._anchors[anchor]

    def nAnchors(self) -> int:
        return len(self._anchors)

    def isAnchored(self, anchor: str) -> bool:
        return anchor in self._anchors


# -- optimizer ------------------------------------------------------------------------------------

_ADAM_KEYS = ("defaultLearningRate", "defaultWeightDecay", "defaultBeta1", "defaultBeta2",
              "defaultEps", "lossScaling", "defaultMaxWeightNorm", "maxWeightNorm")
_ADAM_UNSET = {"defaultLearningRate": (0.1, True), "defaultWeightDecay": (0.0, True),
               "defaultBeta1": (0.9, True), "defaultBeta2": (0.999, True),
               "defaultEps": (1e-6, True), "lossScaling": (1.0, True),
               "defaultMaxWeightNorm": (10.0, True)}
_SPECIFIC_KEYS = ("learningRate", "weightDecay", "beta1", "beta2", "eps", "maxWeightNorm")


def _optimizer_values(values: Any, allowed: tuple[str, ...], where: str
                      ) -> dict[str, tuple[float, bool]]:
    if not isinstance(values, dict):
        raise TypeError(f"{where}: expected a dict")
    checked = {}
    for key, value in values.items():
        if not isinstance(key, str):
            raise popart_exception("A key in the optimizer map input must be a py::str")
        if key not in allowed:
            raise popart_exception(f"Invalid key {key} in {where}. Permitted keys are "
                                   f"( {' '.join(allowed)} )")
        if (not isinstance(value, tuple) or len(value) != 2
                or not isinstance(value[0], float | int) or isinstance(value[0], bool)
                or not isinstance(value[1], bool)):
            raise popart_exception(f"A value in the optimizer map must be a (float, bool) "
                                   f"tuple; {key}: {value!r}")
        checked[key] = (float(value[0]), value[1])
    return checked


class ClipNormSettings:
    def __init__(self, weightIds: list[str], maxNorm: float) -> None:
        self.weightIds = list(weightIds)
        self.maxNorm = float(maxNorm)

    @staticmethod
    def clipWeights(weightIds: list[str], maxNorm: float) -> ClipNormSettings:
        return ClipNormSettings(weightIds, maxNorm)

    @staticmethod
    def clipAllWeights(maxNorm: float) -> ClipNormSettings:
        settings = ClipNormSettings([], maxNorm)
        settings.all_weights = True
        return settings


class Adam:
    """``popart.Adam(values, mode, weight_decay_mode, accum_type, accl1_type, accl2_type,
    clip_norm_settings, scaled_optimizer_state, debugContext)``."""

    def __init__(self, values: dict[str, tuple[float, bool]], mode: AdamMode = AdamMode.Adam,
                 weight_decay_mode: WeightDecayMode = WeightDecayMode.Decay,
                 accum_type: DataType = DataType.UNDEFINED,
                 accl1_type: DataType = DataType.FLOAT, accl2_type: DataType = DataType.FLOAT,
                 clip_norm_settings: list[ClipNormSettings] | None = None,
                 scaled_optimizer_state: bool = False, debugContext: str = "adam") -> None:
        given = _optimizer_values(values, _ADAM_KEYS, "the Adam constructor")
        if "maxWeightNorm" in given:  # deprecated spelling, as PopART maps it
            given["defaultMaxWeightNorm"] = given.pop("maxWeightNorm")
        for name, value, kind in (("mode", mode, AdamMode),
                                  ("weight_decay_mode", weight_decay_mode, WeightDecayMode),
                                  ("accum_type", accum_type, DataType),
                                  ("accl1_type", accl1_type, DataType),
                                  ("accl2_type", accl2_type, DataType)):
            if not isinstance(value, kind):
                raise TypeError(f"Adam: {name} must be a {kind.__name__}, got {value!r}")
        self.values = {**_ADAM_UNSET, **given}
        self.given = given
        self.mode = mode
        self.weight_decay_mode = weight_decay_mode
        self.accum_type = accum_type
        self.accl1_type = accl1_type
        self.accl2_type = accl2_type
        self.clip_norm_settings = list(clip_norm_settings or [])
        self.scaled_optimizer_state = scaled_optimizer_state
        self.specific: dict[str, dict[str, tuple[float, bool]]] = {}
        _log("Adam", given, {"mode": mode, "weight_decay_mode": weight_decay_mode,
                             "accum_type": accum_type, "accl1_type": accl1_type,
                             "accl2_type": accl2_type,
                             "clip_norm_settings": [c.maxNorm for c in self.clip_norm_settings]})

    def insertSpecific(self, id: str, values: dict[str, tuple[float, bool]]) -> None:
        given = _optimizer_values(values, _SPECIFIC_KEYS, "Adam::insertSpecific")
        # Like PopART, the keys not given take the optimizer's current defaults.
        complete = {key: self.values["default" + key[0].upper() + key[1:]]
                    for key in _SPECIFIC_KEYS}
        complete.update(given)
        self.specific[id] = complete
        _log("Adam.insertSpecific", id, given)

    def learning_rate_of(self, weight: str) -> float:
        """(Stand-in only.) The learning rate this optimizer applies to ``weight``."""
        if weight in self.specific:
            return self.specific[weight]["learningRate"][0]
        return self.values["defaultLearningRate"][0]

    def _const_fingerprint(self) -> tuple:
        def consts(values: dict[str, tuple[float, bool]]) -> tuple:
            return tuple(sorted((k, v[1], v[0] if v[1] else None) for k, v in values.items()))
        return (self.mode, self.weight_decay_mode, self.accl1_type, self.accl2_type,
                consts(self.values),
                tuple(sorted((w, consts(v)) for w, v in self.specific.items())))


# -- devices --------------------------------------------------------------------------------------

class DeviceInfo:
    def __init__(self, numIpus: int, type: str, tilesPerIPU: int = 1472) -> None:
        self.numIpus = numIpus
        self.type = type
        self.tilesPerIPU = tilesPerIPU
        self.id = 0
        self.attached = True

    def attach(self) -> bool:
        self.attached = True
        return True

    def detach(self) -> None:
        self.attached = False
        _log("DeviceInfo.detach", self.numIpus)


class DeviceManager:
    def acquireAvailableDevice(self, numIpus: int = 1, tilesPerIpu: int = 0,
                               pattern: SyncPattern = SyncPattern.Full,
                               connectionType: DeviceConnectionType =
                               DeviceConnectionType.Always,
                               selectionCriterion: DeviceSelectionCriterion =
                               DeviceSelectionCriterion.First) -> DeviceInfo:
        _log("DeviceManager.acquireAvailableDevice", numIpus)
        if numIpus & (numIpus - 1) or numIpus < 1:
            raise popart_exception(f"No partition of {numIpus} IPUs: IPU partitions come in "
                                   "powers of two")
        if numIpus > AVAILABLE_IPUS:
            raise popart_exception(f"Failed to acquire device with {numIpus} IPUs")
        return DeviceInfo(numIpus, "Ipu")

    def createIpuModelDevice(self, e: dict[str, Any]) -> DeviceInfo:
        options = {str(k): str(v) for k, v in e.items()}  # the binding stringifies the dict
        _log("DeviceManager.createIpuModelDevice", options)
        return DeviceInfo(int(options.get("numIPUs", 1)), "IpuModel",
                          int(options.get("tilesPerIPU", 1472)))

    def createOfflineIPUDevice(self, opts: dict[str, Any]) -> DeviceInfo:
        return DeviceInfo(int(opts.get("numIPUs", 1)), "OfflineIpu")


# -- step and weight IO ---------------------------------------------------------------------------

class PyStepIO:
    def __init__(self, inputs: dict[str, np.ndarray], outputs: dict[str, np.ndarray]) -> None:
        self.inputs = inputs
        self.outputs = outputs


class PyWeightsIO:
    def __init__(self, weights: dict[str, np.ndarray]) -> None:
        for name, array in weights.items():
            if not array.flags["C_CONTIGUOUS"]:
                raise popart_exception(f"PyWeightsIO is unable to use the provided numpy output "
                                       f"array for tensor '{name}' as it is not c-contiguous")
        self.weights = weights


class TensorInfo:
    def __init__(self, dtype: np.dtype, shape: list[int]) -> None:
        self._dtype = np.dtype(dtype)
        self._shape = list(shape)

    def shape(self) -> list[int]:
        return list(self._shape)

    def data_type_lcase(self) -> str:
        return self._dtype.name


class InputShapeInfo:
    pass


class Patterns:
    pass


# -- the training session -------------------------------------------------------------------------

_STATE_PREFIXES = ("Accl1___", "Accl2___", "Step___")


class TrainingSession:
    """``popart.TrainingSession``: holds a "device" copy and a host copy of every initializer
    (PopART makes each a Variable) and of Adam's state, and records what is asked of it."""

    def __init__(self, fnModel: bytes, dataFlow: DataFlow, loss: str, optimizer: Adam,
                 deviceInfo: DeviceInfo, inputShapeInfo: InputShapeInfo | None = None,
                 patterns: Patterns | None = None, userOptions: SessionOptions | None = None,
                 name: str = "training") -> None:
        if not isinstance(fnModel, bytes):
            raise TypeError("TrainingSession: fnModel must be the serialised ModelProto (bytes)")
        for arg, kind in ((dataFlow, DataFlow), (optimizer, Adam), (deviceInfo, DeviceInfo)):
            if not isinstance(arg, kind):
                raise TypeError(f"TrainingSession: expected a popart.{kind.__name__}, got "
                                f"{type(arg).__name__}")
        self.model = onnx.load_from_string(fnModel)
        graph = self.model.graph
        tensors = ({i.name for i in graph.input} | {o.name for o in graph.output}
                   | {t.name for t in graph.initializer}
                   | {v for n in graph.node for v in n.output})
        if loss not in tensors:
            raise popart_exception(f"loss tensor {loss} is not in the model")
        for anchor in dataFlow.anchors():
            if anchor not in tensors:
                raise popart_exception(f"anchor {anchor} is not in the model")
        self.options = userOptions if userOptions is not None else SessionOptions()
        self.dataFlow = dataFlow
        self.loss = loss
        self.optimizer = optimizer
        self.deviceInfo = deviceInfo
        self.optimizers = [optimizer]
        self.prepared = False
        self.seed: int | None = None
        self.rng_state = [0, 0, 0, 0]
        self.runs = 0
        self.host: dict[str, np.ndarray] = {
            t.name: numpy_helper.to_array(t).copy() for t in graph.initializer}
        floats = [n for n, a in self.host.items() if a.dtype.kind == "f"]
        for weight in floats:
            self.host["Accl1___" + weight] = np.zeros(self.host[weight].shape, np.float32)
            self.host["Accl2___" + weight] = np.zeros(self.host[weight].shape, np.float32)
            self.host["Step___" + weight] = np.zeros((), np.float32)
        self.device = {n: a.copy() for n, a in self.host.items()}
        self.inputs = {i.name: i for i in graph.input if i.name not in self.host}
        ipus = [a.i for n in graph.node for a in n.attribute if a.name == "__ipu_number"]
        vgraphs = max(ipus, default=0) + 1
        replicas = self.options.replicatedGraphCount if self.options.enableReplicatedGraphs else 1
        if deviceInfo.numIpus < replicas * vgraphs:
            raise popart_exception(f"the device has {deviceInfo.numIpus} IPUs but the session "
                                   f"needs {replicas} replica(s) x {vgraphs} IPU(s)")
        _log("TrainingSession", {"loss": loss, "numIpus": deviceInfo.numIpus, "name": name,
                                 "patterns": patterns})

    # properties of popart/session.py
    @property
    def replicationFactor(self) -> int:
        o = self.options
        return o.replicatedGraphCount if o.enableReplicatedGraphs else 1

    @property
    def accumulationFactor(self) -> int:
        o = self.options
        return o.accumulationFactor if o.enableGradientAccumulation else 1

    def prepareDevice(self, loadEngine: bool = True) -> None:
        self.prepared = True
        _log(f"{type(self).__name__}.prepareDevice")

    def _need_device(self, what: str) -> None:
        if not self.prepared:
            raise popart_exception(f"Must call prepareDevice before {what}")

    def setRandomSeed(self, seedValue: int) -> None:
        self._need_device("setRandomSeed")
        self.seed = int(seedValue)
        _log(f"{type(self).__name__}.setRandomSeed", int(seedValue))

    def getRNGState(self) -> list[int]:
        return list(self.rng_state)

    def setRNGState(self, rngValue: list[int]) -> None:
        self.rng_state = [int(v) for v in rngValue]
        _log(f"{type(self).__name__}.setRNGState", list(self.rng_state))

    def weightsFromHost(self) -> None:
        self._need_device("weightsFromHost")
        self.device = {n: a.copy() for n, a in self.host.items()}
        _log(f"{type(self).__name__}.weightsFromHost")

    def weightsToHost(self) -> None:
        self._need_device("weightsToHost")
        self.host = {n: a.copy() for n, a in self.device.items()}
        _log(f"{type(self).__name__}.weightsToHost")

    def readWeights(self, weightsIo: PyWeightsIO) -> None:
        for name, array in weightsIo.weights.items():
            if name not in self.host:
                raise popart_exception(f"No weight {name} in the session")
            source = self.host[name]
            if array.shape != source.shape or array.dtype != source.dtype:
                raise popart_exception(f"readWeights: {name} is {source.dtype}{list(source.shape)}"
                                       f", the array {array.dtype}{list(array.shape)}")
            array[...] = source
        _log(f"{type(self).__name__}.readWeights", sorted(weightsIo.weights))

    def writeWeights(self, weightsIo: PyWeightsIO) -> None:
        for name, array in weightsIo.weights.items():
            if name not in self.host:
                raise popart_exception(f"No weight {name} in the session")
            target = self.host[name]
            if array.shape != target.shape or array.dtype != target.dtype:
                raise popart_exception(f"writeWeights: {name} is {target.dtype}"
                                       f"{list(target.shape)}, the array {array.dtype}"
                                       f"{list(array.shape)}")
            self.host[name] = array.copy()
        _log(f"{type(self).__name__}.writeWeights", sorted(weightsIo.weights))

    def updateOptimizerFromHost(self, optimizer: Adam) -> None:
        if not isinstance(optimizer, Adam):
            raise TypeError("updateOptimizerFromHost takes a popart.Optimizer")
        if optimizer._const_fingerprint() != self.optimizer._const_fingerprint():
            raise popart_exception("This Optimizer of type Adam is not a valid replacement: "
                                   "its type, modes or const values differ")
        self.optimizer = optimizer
        self.optimizers.append(optimizer)
        _log("TrainingSession.updateOptimizerFromHost", optimizer.values["defaultLearningRate"])

    def getTensorIds(self) -> set[str]:
        graph = self.model.graph
        return (set(self.host) | {i.name for i in graph.input}
                | {v for n in graph.node for v in n.output})

    def getInfo(self, id: str) -> TensorInfo:
        if id in self.host:
            return TensorInfo(self.host[id].dtype, list(self.host[id].shape))
        for value in [*self.model.graph.input, *self.model.graph.output]:
            if value.name == id:
                tensor = value.type.tensor_type
                dims = [d.dim_value for d in tensor.shape.dim]
                return TensorInfo(helper.tensor_dtype_to_np_dtype(tensor.elem_type), dims)
        raise popart_exception(f"No tensor {id}")

    def initAnchorArrays(self) -> dict[str, np.ndarray]:
        arrays = {}
        bps = self.dataFlow.batchesPerStep()
        for anchor in self.dataFlow.anchors():
            info = self.getInfo(anchor)
            shape = [self.replicationFactor]
            if self.dataFlow.art(anchor).id() == AnchorReturnTypeId.All:
                shape = [bps, self.accumulationFactor, *shape]
            shape = [d for d in shape if d != 1] + info.shape()
            arrays[anchor] = np.empty(shape, dtype=info.data_type_lcase())
        return arrays

    def run(self, stepio: PyStepIO, debugName: str = "") -> None:
        self._need_device("run")
        bps, accl, repl = (self.dataFlow.batchesPerStep(), self.accumulationFactor,
                           self.replicationFactor)
        samples = bps * accl * repl
        for name, info in self.inputs.items():
            if name not in stepio.inputs:
                raise popart_exception(f"No input provided for {name}")
            array = stepio.inputs[name]
            want = helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type)
            if array.dtype != want:
                raise popart_exception(f"input {name}: dtype {array.dtype}, the graph's {want}")
            dims = [d.dim_value if d.HasField("dim_value") else None
                    for d in info.type.tensor_type.shape.dim]
            if None not in dims and array.size != samples * int(np.prod(dims, dtype=np.int64)):
                raise popart_exception(
                    f"Unexpected number of input elements for Tensor {name}. Expected "
                    f"{samples * int(np.prod(dims, dtype=np.int64))}, but received {array.size}")
        expected = self.initAnchorArrays()
        for anchor, array in expected.items():
            given = stepio.outputs.get(anchor)
            if given is None or given.shape != array.shape:
                raise popart_exception(f"anchor {anchor}: expected an array of shape "
                                       f"{array.shape}")
            pattern = (np.arange(bps)[:, None, None] + 0.1 * np.arange(accl)[None, :, None]
                       + 0.01 * np.arange(repl)[None, None, :] + self.runs * bps)
            given[...] = pattern.reshape(given.shape)
        for _ in range(bps):
            for name in self.host:
                if name.startswith(_STATE_PREFIXES):
                    if name.startswith("Step___"):
                        self.device[name] = self.device[name] + 1
                    continue
                array = self.device[name]
                if array.dtype.kind == "f" and "Accl1___" + name in self.device:
                    lr = self.optimizer.learning_rate_of(name)
                    self.device[name] = (array - lr).astype(array.dtype)
                    self.device["Accl1___" + name] = self.device["Accl1___" + name] + 1
        self.runs += 1
        self.rng_state = [v + 1 for v in self.rng_state]
        _log(f"{type(self).__name__}.run", {n: a.shape for n, a in stepio.inputs.items()})

    def modelToHost(self, fn: str) -> None:
        _log(f"{type(self).__name__}.modelToHost", fn)


class InferenceSession(TrainingSession):
    """``popart.InferenceSession``: the graph's forward pass (PopART applies no dropout in an
    inference session) with a "device" and a host copy of every initializer, no optimizer and
    no optimizer state. ``run`` fills every anchor with the sum of the float weights the
    "device" holds (float64), so a test can see which weights an evaluation used; weights
    never change."""

    def __init__(self, fnModel: bytes, dataFlow: DataFlow, deviceInfo: DeviceInfo,
                 inputShapeInfo: InputShapeInfo | None = None,
                 patterns: Patterns | None = None, userOptions: SessionOptions | None = None,
                 name: str = "inference") -> None:
        if not isinstance(fnModel, bytes):
            raise TypeError("InferenceSession: fnModel must be the serialised ModelProto (bytes)")
        for arg, kind in ((dataFlow, DataFlow), (deviceInfo, DeviceInfo)):
            if not isinstance(arg, kind):
                raise TypeError(f"InferenceSession: expected a popart.{kind.__name__}, got "
                                f"{type(arg).__name__}")
        self.model = onnx.load_from_string(fnModel)
        graph = self.model.graph
        tensors = ({i.name for i in graph.input} | {o.name for o in graph.output}
                   | {t.name for t in graph.initializer}
                   | {v for n in graph.node for v in n.output})
        for anchor in dataFlow.anchors():
            if anchor not in tensors:
                raise popart_exception(f"anchor {anchor} is not in the model")
        self.options = userOptions if userOptions is not None else SessionOptions()
        self.dataFlow = dataFlow
        self.deviceInfo = deviceInfo
        self.prepared = False
        self.seed = None
        self.rng_state = [0, 0, 0, 0]
        self.runs = 0
        self.host = {t.name: numpy_helper.to_array(t).copy() for t in graph.initializer}
        self.device = {n: a.copy() for n, a in self.host.items()}
        self.inputs = {i.name: i for i in graph.input if i.name not in self.host}
        ipus = [a.i for n in graph.node for a in n.attribute if a.name == "__ipu_number"]
        replicas = self.options.replicatedGraphCount if self.options.enableReplicatedGraphs else 1
        if deviceInfo.numIpus < replicas * (max(ipus, default=0) + 1):
            raise popart_exception(f"the device has {deviceInfo.numIpus} IPUs but the session "
                                   f"needs {replicas} replica(s) x {max(ipus, default=0) + 1} "
                                   "IPU(s)")
        _log("InferenceSession", {"numIpus": deviceInfo.numIpus, "name": name,
                                  "patterns": patterns})

    def updateOptimizerFromHost(self, optimizer: Adam) -> None:
        raise popart_exception("an InferenceSession has no optimizer")

    def run(self, stepio: PyStepIO, debugName: str = "") -> None:
        weights = [a for n, a in self.device.items() if a.dtype.kind == "f"]
        checksum = float(sum(a.astype(np.float64).sum() for a in weights))
        super().run(stepio, debugName)  # its checks; no optimizer state, so no weight moves
        for array in stepio.outputs.values():
            array[...] = checksum
