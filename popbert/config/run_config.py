"""Run configuration: one YAML file -> validated dataclasses, presets and `--set` overrides.

A run is described by one YAML file with the sections `model`, `data`, `optimizer`, `execution`,
`training` and `tracking`. Every key is checked here, before any model is built, so a typo or a
wrong type fails in a second with a one-line `ConfigError` naming the file and the key, instead of
an obscure error hours into a run. The resolved config is saved with every checkpoint.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from popbert.builders.bert_config import BertConfig
from popbert.errors import ConfigError
from popbert.io.atomic import atomic_write_text

logger = logging.getLogger(__name__)

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
DEFAULT_PRESET = "tiny"

OPTIMIZERS = ("lamb", "adamw")
DECAYS = ("linear", "polynomial", "none")
LOSS_SCALINGS = ("none", "static", "dynamic")
BACKENDS = ("torch", "popart")
DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "float16", "bfloat16")
TRACKERS = ("none", "wandb")


# ----------------------------------------------------------------------------------------------
# Sections
# ----------------------------------------------------------------------------------------------


@dataclass
class DataConfig:
    """Where the pre-training data comes from and how instances are generated from text."""

    # Globs of HDF5 shards or text files; empty = the corpus bundled with popbert.data.
    input_files: list[str] = field(default_factory=list)
    vocab_file: str | None = None  # None = the bundled WordPiece vocabulary
    seed: int = 12345
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    duplication_factor: int = 1
    whole_word_masking: bool = False
    shuffle: bool = True


@dataclass
class OptimizerConfig:
    """Optimizer, learning-rate schedule and loss scaling (Graphcore's LAMB settings by default)."""

    name: str = "lamb"
    lr: float = 0.001
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-6
    weight_decay: float = 0.01
    # Graphcore ships LAMB without bias correction (popart.AdamMode.LambNoBias).
    bias_correction: bool = False
    max_grad_norm: float | None = None
    warmup_steps: int = 0
    warmup_start_lr: float = 1e-7
    decay: str = "linear"
    end_lr: float = 1e-7
    power: float = 1.0
    # Graphcore's piecewise-constant schedule "step:lr,step:lr,..."; replaces warmup/decay.
    lr_schedule: str | None = None
    loss_scaling: str = "none"
    loss_scale: float = 1.0  # the static scale, or the initial scale when dynamic
    max_trust_ratio: float | None = None


@dataclass
class ExecutionConfig:
    """How and where the graph runs: backend, device, batch layout, precision."""

    backend: str = "torch"
    device: str = "auto"
    micro_batch_size: int = 32
    gradient_accumulation: int = 1
    replicas: int = 1
    device_iterations: int = 1
    weight_dtype: str = "float32"
    compute_dtype: str = "float32"
    stochastic_rounding: bool | None = None  # None = on exactly when weights are half precision
    compile: bool = False
    pipeline: bool = False
    replicated_tensor_sharding: bool = False
    pipeline_schedule: str = "1f1b"  # or "gpipe" (execution.pipeline)
    recompute: bool = False
    threads: int | None = None  # torch intra-op threads; None = torch's default

    @property
    def use_stochastic_rounding(self) -> bool:
        """Whether weight updates are stochastically rounded (resolves the None default)."""
        if self.stochastic_rounding is None:
            return self.weight_dtype != "float32"
        return self.stochastic_rounding


@dataclass
class TrainingConfig:
    """Length of the run, batch size check, checkpoint and log cadence."""

    steps: int = 1000
    # None = derived: micro_batch_size x replicas x gradient_accumulation.
    global_batch_size: int | None = None
    checkpoint_every: int = 0  # 0 = only at the end
    log_every: int = 10
    seed: int = 42


@dataclass
class TrackingConfig:
    """Where metrics go besides `metrics.jsonl`."""

    backend: str = "none"
    project: str = "popbert"
    run_name: str | None = None


SECTIONS: dict[str, type] = {
    "model": BertConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "execution": ExecutionConfig,
    "training": TrainingConfig,
    "tracking": TrackingConfig,
}


@dataclass
class RunConfig:
    """A whole run: one dataclass per YAML section."""

    model: BertConfig = field(default_factory=BertConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    @property
    def global_batch_size(self) -> int:
        """Sequences per optimizer step: micro batch x replicas x gradient accumulation."""
        e = self.execution
        return e.micro_batch_size * e.replicas * e.gradient_accumulation

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (YAML/JSON-ready) that `config_from_dict` turns back into an equal
        config."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    def validate(self, source: str = "<config>") -> None:
        """Check values and cross-section consistency; raise ConfigError naming the key."""
        _validate(self, source)


# ----------------------------------------------------------------------------------------------
# YAML loading (YAML 1.2 floats: PyYAML would read `1e-3` as the string '1e-3')
# ----------------------------------------------------------------------------------------------


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars: `1e-3` is a float, `100:5` and `yes` stay strings."""


_REPLACED = {"tag:yaml.org,2002:float", "tag:yaml.org,2002:int", "tag:yaml.org,2002:bool"}
_Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"""^(?:[-+]?0b[0-1_]+
                |[-+]?0o[0-7_]+
                |[-+]?(?:0|[1-9][0-9_]*)
                |[-+]?0x[0-9a-fA-F_]+)$""", re.X),
    list("-+0123456789"),
)
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def _parse_yaml(text: str, source: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None


# ----------------------------------------------------------------------------------------------
# Type checking
# ----------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        name = " or ".join(_type_name(a) for a in args)
        return f"{name} or null" if len(args) < len(typing.get_args(tp)) else name
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"list of {_type_name(item)}" if item is not Any else "list"
    if origin is dict or tp is dict:
        return "mapping"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


class _TypeMismatch(Exception):
    pass


def _coerce(value: Any, tp: Any) -> Any:
    """Return `value` converted to `tp` (int -> float only), or raise _TypeMismatch."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _TypeMismatch
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg)
            except _TypeMismatch:
                continue
        raise _TypeMismatch
    if origin is list or tp is list:
        if not isinstance(value, list | tuple):
            raise _TypeMismatch
        (item,) = typing.get_args(tp) or (Any,)
        return [_coerce(v, item) for v in value]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise _TypeMismatch
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise _TypeMismatch
    if tp is str:
        if isinstance(value, str):
            return value
        raise _TypeMismatch
    raise TypeError(f"unsupported config field type {tp!r}")


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _unknown_key(source: str, key: str, valid: list[str]) -> ConfigError:
    name = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(name, valid, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(f"{source}: unknown key {key}{hint}; valid keys: {', '.join(valid)}")


def _build_section(name: str, values: Any, sources: dict[str, str], default_source: str) -> Any:
    cls = SECTIONS[name]
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ConfigError(f"{default_source}: section {name} must be a mapping of keys, "
                          f"got {values!r}")
    types_ = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        full = f"{name}.{key}"
        src = sources.get(full, default_source)
        if not isinstance(key, str) or key not in types_:
            raise _unknown_key(src, full, sorted(types_))
        try:
            kwargs[key] = _coerce(value, types_[key])
        except _TypeMismatch:
            raise ConfigError(
                f"{src}: {full}: expected {_type_name(types_[key])}, got {value!r}") from None
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------


def parse_lr_schedule(spec: str) -> list[tuple[int, float]]:
    """Parse Graphcore's piecewise-constant schedule "step:lr,step:lr" (steps increasing).

    From each listed step on, the learning rate is the listed value until the next entry.
    Raises ValueError on malformed text.
    """
    entries: list[tuple[int, float]] = []
    for part in spec.split(","):
        part = part.strip()
        step_s, sep, lr_s = part.partition(":")
        if not sep:
            raise ValueError(f"entry {part!r} is not step:lr")
        try:
            step, lr = int(step_s), float(lr_s)
        except ValueError:
            raise ValueError(f"entry {part!r} is not step:lr") from None
        if step < 0 or lr < 0 or lr != lr:
            raise ValueError(f"entry {part!r} needs step >= 0 and lr >= 0")
        if entries and step <= entries[-1][0]:
            raise ValueError(f"steps must increase, got {step} after {entries[-1][0]}")
        entries.append((step, lr))
    return entries


class _Checker:
    """Raises ConfigError naming the key and where its value came from (file or --set)."""

    def __init__(self, source: str, key_sources: dict[str, str]) -> None:
        self.source = source
        self.key_sources = key_sources

    def where(self, key: str | None) -> str:
        return self.key_sources.get(key, self.source) if key else self.source

    def __call__(self, ok: bool, key: str | None, message: str) -> None:
        if not ok:
            raise ConfigError(f"{self.where(key)}: {message}")

    def enum(self, key: str, value: str, allowed: tuple[str, ...]) -> None:
        self(value in allowed, key, f"{key}: expected one of {', '.join(allowed)}, got {value!r}")


def _validate(cfg: RunConfig, source: str, key_sources: dict[str, str] | None = None) -> None:
    check = _Checker(source, key_sources or {})
    try:
        cfg.model.validate()
    except ValueError as exc:
        named = [k for k in re.findall(r"model\.\w+", str(exc)) if k in check.key_sources]
        raise ConfigError(f"{check.where(named[0] if named else None)}: {exc}") from None

    d = cfg.data
    check(0.0 < d.masked_lm_prob <= 1.0, "data.masked_lm_prob",
          f"data.masked_lm_prob must be in (0, 1], got {d.masked_lm_prob}")
    check(0.0 <= d.short_seq_prob <= 1.0, "data.short_seq_prob",
          f"data.short_seq_prob must be in [0, 1], got {d.short_seq_prob}")
    check(d.duplication_factor >= 1, "data.duplication_factor",
          f"data.duplication_factor must be >= 1, got {d.duplication_factor}")

    o = cfg.optimizer
    check.enum("optimizer.name", o.name, OPTIMIZERS)
    check.enum("optimizer.decay", o.decay, DECAYS)
    check.enum("optimizer.loss_scaling", o.loss_scaling, LOSS_SCALINGS)
    check(o.lr > 0, "optimizer.lr", f"optimizer.lr must be > 0, got {o.lr}")
    check(len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas), "optimizer.betas",
          f"optimizer.betas must be two values in [0, 1), got {o.betas}")
    check(o.eps > 0, "optimizer.eps", f"optimizer.eps must be > 0, got {o.eps}")
    check(o.weight_decay >= 0, "optimizer.weight_decay",
          f"optimizer.weight_decay must be >= 0, got {o.weight_decay}")
    check(o.max_grad_norm is None or o.max_grad_norm > 0, "optimizer.max_grad_norm",
          f"optimizer.max_grad_norm must be > 0 or null, got {o.max_grad_norm}")
    check(o.warmup_steps >= 0, "optimizer.warmup_steps",
          f"optimizer.warmup_steps must be >= 0, got {o.warmup_steps}")
    check(o.warmup_start_lr >= 0, "optimizer.warmup_start_lr",
          f"optimizer.warmup_start_lr must be >= 0, got {o.warmup_start_lr}")
    check(o.end_lr >= 0, "optimizer.end_lr", f"optimizer.end_lr must be >= 0, got {o.end_lr}")
    check(o.power > 0, "optimizer.power", f"optimizer.power must be > 0, got {o.power}")
    check(o.loss_scale > 0, "optimizer.loss_scale",
          f"optimizer.loss_scale must be > 0, got {o.loss_scale}")
    check(o.max_trust_ratio is None or o.max_trust_ratio > 0, "optimizer.max_trust_ratio",
          f"optimizer.max_trust_ratio must be > 0 or null, got {o.max_trust_ratio}")
    if o.lr_schedule is not None:
        try:
            parse_lr_schedule(o.lr_schedule)
        except ValueError as exc:
            check(False, "optimizer.lr_schedule", f"optimizer.lr_schedule {o.lr_schedule!r}: {exc}")

    e = cfg.execution
    check.enum("execution.backend", e.backend, BACKENDS)
    check.enum("execution.device", e.device, DEVICES)
    check.enum("execution.weight_dtype", e.weight_dtype, DTYPES)
    check.enum("execution.compute_dtype", e.compute_dtype, DTYPES)
    check.enum("execution.pipeline_schedule", e.pipeline_schedule, ("1f1b", "gpipe"))
    for key in ("micro_batch_size", "gradient_accumulation", "replicas", "device_iterations"):
        value = getattr(e, key)
        check(value >= 1, f"execution.{key}", f"execution.{key} must be >= 1, got {value}")
    check(e.threads is None or e.threads >= 1, "execution.threads",
          f"execution.threads must be >= 1 or null, got {e.threads}")
    check(not e.pipeline or cfg.model.layers_per_ipu is not None, "execution.pipeline",
          "execution.pipeline needs model.layers_per_ipu (the layers of each pipeline stage)")
    check(e.backend != "popart" or cfg.model.dialect == "popart", "execution.backend",
          f"execution.backend 'popart' needs model.dialect 'popart' "
          f"(PopART reads ai.onnx opset 11), got {cfg.model.dialect!r}")

    t = cfg.training
    check(t.steps >= 1, "training.steps", f"training.steps must be >= 1, got {t.steps}")
    check(t.checkpoint_every >= 0, "training.checkpoint_every",
          f"training.checkpoint_every must be >= 0 (0 = only at the end), "
          f"got {t.checkpoint_every}")
    check(t.log_every >= 1, "training.log_every",
          f"training.log_every must be >= 1, got {t.log_every}")
    if t.global_batch_size is not None:
        per_pass = e.micro_batch_size * e.replicas
        layout = (f"execution.micro_batch_size ({e.micro_batch_size}) x execution.replicas "
                  f"({e.replicas})")
        check(t.global_batch_size >= 1, "training.global_batch_size",
              f"training.global_batch_size must be >= 1 or null, got {t.global_batch_size}")
        check(t.global_batch_size % per_pass == 0, "training.global_batch_size",
              f"training.global_batch_size ({t.global_batch_size}) is not divisible by "
              f"{layout} = {per_pass}")
        check(t.global_batch_size == cfg.global_batch_size, "training.global_batch_size",
              f"training.global_batch_size ({t.global_batch_size}) != {layout} x "
              f"execution.gradient_accumulation ({e.gradient_accumulation}) = "
              f"{cfg.global_batch_size}; set execution.gradient_accumulation="
              f"{t.global_batch_size // per_pass} or training.global_batch_size=null")

    k = cfg.tracking
    check.enum("tracking.backend", k.backend, TRACKERS)
    check(bool(k.project), "tracking.project", "tracking.project must not be empty")

    if o.lr_schedule is None and o.warmup_steps > t.steps:
        logger.warning("optimizer.warmup_steps (%d) exceeds training.steps (%d): the run ends "
                       "before reaching the peak learning rate", o.warmup_steps, t.steps)
    if e.stochastic_rounding and e.weight_dtype == "float32":
        logger.warning("execution.stochastic_rounding has no effect with float32 weights")


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def list_presets() -> list[str]:
    """Names of the presets shipped in popbert/presets (usable wherever a config path is)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """Path of a shipped preset's YAML file; ConfigError listing the presets if unknown."""
    path = PRESETS_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(list_presets())}")
    return path


def _resolve(config: str | os.PathLike[str]) -> tuple[Path, str]:
    """Path and display name of a config given as a file path or a preset name."""
    path = Path(config)
    if path.is_file():
        return path, str(config)
    name = str(config)
    if (PRESETS_DIR / f"{name}.yaml").is_file() and os.sep not in name:
        return PRESETS_DIR / f"{name}.yaml", f"{name}.yaml (preset)"
    if path.exists():
        raise ConfigError(f"{config}: not a file")
    raise ConfigError(f"config file not found: {config} "
                      f"(presets: {', '.join(list_presets())})")


def config_from_dict(d: dict[str, Any], source: str = "<dict>",
                     key_sources: dict[str, str] | None = None) -> RunConfig:
    """Build and validate a RunConfig from nested section dicts (missing keys take defaults).

    `source` names where the values came from in error messages; `key_sources` may name a
    different origin for single keys ("section.key" -> e.g. "--set section.key=value").
    """
    if d is None:
        d = {}
    if not isinstance(d, dict):
        raise ConfigError(f"{source}: expected a mapping of sections "
                          f"({', '.join(SECTIONS)}), got {type(d).__name__}")
    sources = key_sources or {}
    for name in d:
        if name not in SECTIONS:
            raise _unknown_key(sources.get(str(name), source), str(name), list(SECTIONS))
    sections = {name: _build_section(name, d.get(name), sources, source) for name in SECTIONS}
    cfg = RunConfig(**sections)
    _validate(cfg, source, sources)
    return cfg


def parse_override(text: str) -> tuple[list[str], Any]:
    """Split `section.key=value` into its key path and YAML-parsed value."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    parts = key.split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise ConfigError(f"bad --set {text!r}: expected section.key=value, "
                          f"e.g. optimizer.lr=0.001")
    if not raw.strip():
        raise ConfigError(f"bad --set {text!r}: missing value (use null for none)")
    try:
        value = yaml.load(raw, Loader=_Loader)  # noqa: S506 - _Loader is a SafeLoader
    except yaml.YAMLError:
        raise ConfigError(f"bad --set {text!r}: {raw!r} is not a YAML value") from None
    return parts, value


def apply_overrides(d: dict[str, Any], overrides: typing.Iterable[str],
                    key_sources: dict[str, str] | None = None) -> dict[str, Any]:
    """Return a copy of raw config `d` with `section.key=value` overrides applied."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in d.items()}
    for text in overrides:
        parts, value = parse_override(text)
        src = f"--set {text}"
        section, key = parts[0], parts[1]
        if section not in SECTIONS:
            raise _unknown_key(src, section, list(SECTIONS))
        valid = sorted(_field_types(SECTIONS[section]))
        if key not in valid:
            raise _unknown_key(src, f"{section}.{key}", valid)
        sec = out.get(section)
        if not isinstance(sec, dict):
            sec = {}
        out[section] = sec
        if len(parts) == 2:
            sec[key] = value
        else:
            # Deeper keys only reach into mapping fields such as model.extra.
            if _type_name(_field_types(SECTIONS[section])[key]) != "mapping":
                raise ConfigError(f"{src}: {section}.{key} is not a mapping, so "
                                  f"{'.'.join(parts)} cannot be set")
            node = sec.get(key)
            node = dict(node) if isinstance(node, dict) else {}
            sec[key] = node
            for p in parts[2:-1]:
                child = node.get(p)
                node[p] = dict(child) if isinstance(child, dict) else {}
                node = node[p]
            node[parts[-1]] = value
        if key_sources is not None:
            key_sources[f"{section}.{key}"] = src
    return out


def load_config(config: str | os.PathLike[str] = DEFAULT_PRESET,
                overrides: typing.Iterable[str] = ()) -> RunConfig:
    """Load a YAML config file or preset name, apply `--set` overrides, validate.

    Raises ConfigError with a one-line message naming the file (or override) and the key.
    """
    path, source = _resolve(config)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from None
    raw = _parse_yaml(text, source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections "
                          f"({', '.join(SECTIONS)}), got {type(raw).__name__}")
    key_sources: dict[str, str] = {}
    # Unknown sections/keys in the file are reported against the file, before overrides.
    for name in raw:
        if name not in SECTIONS:
            raise _unknown_key(source, str(name), list(SECTIONS))
    raw = apply_overrides(raw, overrides, key_sources)
    return config_from_dict(raw, source=source, key_sources=key_sources)


class _Dumper(yaml.SafeDumper):
    """Block mappings, flow lists (`betas: [0.9, 0.999]`), as in the presets.

    A string is quoted when it would read as anything else under either YAML 1.1 (yaml.safe_load,
    e.g. 'yes', '100:5') or popbert's YAML 1.2 loader (e.g. '1e-3'), so both read the file back
    the same.
    """


_Dumper.yaml_implicit_resolvers = {
    ch: list(yaml.SafeDumper.yaml_implicit_resolvers.get(ch, []))
    + list(_Loader.yaml_implicit_resolvers.get(ch, []))
    for ch in set(yaml.SafeDumper.yaml_implicit_resolvers) | set(_Loader.yaml_implicit_resolvers)
}

_Dumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data,
                                                         flow_style=True))


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML text (sections in the canonical order)."""
    return yaml.dump(cfg.to_dict(), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def save_config(cfg: RunConfig, path: str | os.PathLike[str]) -> Path:
    """Write the resolved config as YAML, atomically; `load_config(path)` gives an equal config."""
    return atomic_write_text(path, dump_config(cfg))


__all__ = [
    "BertConfig", "ConfigError", "DataConfig", "ExecutionConfig", "OptimizerConfig", "RunConfig",
    "TrackingConfig", "TrainingConfig", "apply_overrides", "config_from_dict", "dump_config",
    "list_presets", "load_config", "parse_lr_schedule", "parse_override", "preset_path",
    "save_config",
]
