"""Sweep files: W&B's sweep format plus popbert's keys, parsed and checked before anything runs.

A sweep file is the W&B format (`method`, `metric`, `parameters`, `run_cap`, `early_terminate`)
over one popbert job (`job`, `config`, `set`, `args`, `init_from`, `backend`, ...). Every mistake
is a `ConfigError` naming the file and key and what was expected. The format, key by key, with
examples: docs/sweeps.md.
"""

from __future__ import annotations

import json
import math
import os
import typing
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from popbert.config.yaml_io import parse_yaml
from popbert.errors import ConfigError
from popbert.rules import SEED
from popbert.tasks import TASKS
from popbert.textfile import read_text

METHODS = ("grid", "random", "bayes")
BACKENDS = ("optuna", "wandb")  # who runs the search: the Optuna store, or a W&B server
GOALS = ("minimize", "maximize")
# pre-training, and `finetune <command>` of each fine-tuning task (`popbert.tasks`)
JOBS = ("pretrain", *(f"finetune {task.command}" for task in TASKS.values()))
BAYES_SAMPLERS = ("tpe", "gp")
TOP_LEVEL = ("name", "description", "program", "command", "job", "config", "set", "args",
             "method", "metric", "parameters", "run_cap", "early_terminate", "init_from",
             "sampler", "seed", "heartbeat", "backend", "project", "entity")
# W&B distributions popbert maps onto Optuna's (`log_uniform` takes exponents, as in W&B).
DISTRIBUTIONS = ("constant", "categorical", "int_uniform", "uniform", "q_uniform",
                 "log_uniform", "log_uniform_values", "q_log_uniform_values")
DISCRETE = ("constant", "categorical", "int_uniform", "q_uniform")

# The sweep's names of the fine-tuning jobs (their commands), and the task each runs.
FINETUNE_TASKS = {f"finetune {task.command}": name for name, task in TASKS.items()}
# Config keys a fine-tuning run takes from its checkpoint or derives from its data.
NOT_SWEPT = ("model.", "data.", "training.steps", "optimizer.warmup_steps")


def finetune_args(job: str) -> dict[str, Any]:
    """The `args` a fine-tuning job takes (its command's own flags, which set `finetune.*` keys
    or an `execution.*` one), each with its kind: "path", bool, int, float or str (labels:
    comma-separated, as on the command line)."""
    from popbert.config.sections import SECTIONS
    from popbert.train.finetune import FLAG_KEYS, PATH_FLAGS, task_flags

    kinds: dict[str, Any] = {}
    for flag in task_flags(FINETUNE_TASKS[job]):
        section, key = FLAG_KEYS[flag].split(".", 1)
        field_type = typing.get_type_hints(SECTIONS[section])[key]
        kinds[flag] = "path" if flag in PATH_FLAGS else next(
            (t for t in (bool, int, float) if t in typing.get_args(field_type)
             or t is field_type), str)
    return kinds


@dataclass
class Parameter:
    """One swept key: a list of values (categorical, or a grid axis) or a distribution."""

    name: str
    distribution: str
    values: list[Any] = field(default_factory=list)
    min: float | None = None
    max: float | None = None
    q: float | None = None

    @property
    def continuous(self) -> bool:
        return self.distribution not in DISCRETE

    def grid_values(self) -> list[Any]:
        """The values a grid visits (int_uniform and q_uniform are discretised, as W&B does)."""
        if self.distribution in ("constant", "categorical"):
            return list(self.values)
        if self.distribution == "int_uniform":
            return list(range(int(self.min), int(self.max) + 1))
        if self.distribution == "q_uniform":
            count = int(math.floor((self.max - self.min) / self.q + 1e-9)) + 1
            return [_clean(self.min + i * self.q) for i in range(count)]
        raise ValueError(f"{self.name}: {self.distribution} has no grid")

    def edge_values(self) -> list[Any]:
        """Values that stand for the whole parameter when checking the config accepts it."""
        if self.distribution in ("constant", "categorical"):
            return list(self.values)
        if self.distribution == "log_uniform":
            return [math.exp(self.min), math.exp(self.max)]
        if self.distribution == "int_uniform":
            return [int(self.min), int(self.max)]
        return [self.min, self.max]


@dataclass
class InitFrom:
    """Start every trial from another sweep's trial (phase 1 → phase 2)."""

    sweep: str
    trial: str | int = "best"
    storage: str | None = None


@dataclass
class SweepSpec:
    """A parsed, checked sweep file."""

    job: str
    method: str
    metric: str
    goal: str
    parameters: dict[str, Parameter]
    config: str | None = None
    set: dict[str, Any] = field(default_factory=dict)
    args: dict[str, Any] = field(default_factory=dict)
    run_cap: int | None = None
    early_terminate: dict[str, Any] | None = None
    init_from: InitFrom | None = None
    sampler: str = "tpe"
    seed: int | None = None
    heartbeat: float = 30.0
    name: str | None = None
    backend: str = "optuna"
    project: str | None = None  # backend wandb: the W&B project and entity of the sweep
    entity: str | None = None
    source: str = "<sweep>"

    def overrides(self, params: Mapping[str, Any] | None = None) -> list[str]:
        """`--set` overrides of a trial: the fixed `set`, then the trial's config parameters."""
        values = {**self.set, **{k: v for k, v in (params or {}).items()
                                 if not k.startswith("args.")}}
        return [override_text(k, v) for k, v in values.items()]

    def job_args(self, params: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The job's own options: `args`, then the trial's `args.*` parameters."""
        out = dict(self.args)
        out.update({k[len("args."):]: v for k, v in (params or {}).items()
                    if k.startswith("args.")})
        return out

    def max_evaluations(self) -> int | None:
        """How many values of the metric a full pre-training trial reports (Hyperband's
        largest budget), or None where the run decides (fine-tuning: its data's size)."""
        if self.job != "pretrain" or any(k in self.parameters for k in
                                         ("training.steps", "training.eval_every",
                                          "training.log_every")):
            return None
        cfg = base_config(self)
        t = cfg.training
        validating = bool(t.eval_every and (cfg.data.validation_fraction
                                            or cfg.data.validation_files))
        if self.metric.startswith("val_"):
            return max(t.steps // t.eval_every, 1) if validating else None
        # The loop logs every log_every steps, at the last step, and at every evaluation.
        logged = {s for s in range(1, t.steps + 1) if s % t.log_every == 0 or s == t.steps
                  or (validating and s % t.eval_every == 0)}
        return max(len(logged), 1)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (JSON/YAML) that `parse_spec` reads back as an equal spec."""
        out: dict[str, Any] = {"job": self.job, "method": self.method,
                               "metric": {"name": self.metric, "goal": self.goal},
                               "parameters": {}}
        for name, p in self.parameters.items():
            if p.distribution == "constant":
                out["parameters"][name] = {"value": p.values[0]}
            elif p.distribution == "categorical":
                out["parameters"][name] = {"values": list(p.values)}
            else:
                entry = {"distribution": p.distribution, "min": p.min, "max": p.max}
                if p.q is not None:
                    entry["q"] = p.q
                out["parameters"][name] = entry
        for key in ("config", "run_cap", "early_terminate", "seed", "name", "project",
                    "entity"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.set:
            out["set"] = dict(self.set)
        if self.args:
            out["args"] = dict(self.args)
        if self.init_from is not None:
            out["init_from"] = {k: v for k, v in asdict(self.init_from).items() if v is not None}
        out["sampler"] = self.sampler
        out["heartbeat"] = self.heartbeat
        if self.backend != "optuna":
            out["backend"] = self.backend
        return out


def override_text(key: str, value: Any) -> str:
    """`key=value` as `--set` reads it (JSON is YAML, and keeps 1e-05 a number)."""
    return f"{key}={json.dumps(value)}"


def _clean(x: float) -> float:
    return float(f"{x:.12g}")


def load_spec(path: str | os.PathLike[str], check: bool = True) -> SweepSpec:
    """Read and check a sweep file; relative paths in it (config, args) are taken from the
    current directory and made absolute, so agents elsewhere find the same files."""
    path = Path(path)
    text = read_text(path, "a sweep YAML file", error=ConfigError)
    raw = parse_yaml(text, str(path))
    spec = parse_spec(raw, str(path))
    absolutize(spec)
    if check:
        check_spec(spec)
    return spec


def absolutize(spec: SweepSpec) -> None:
    """Make the config file and the job's input paths absolute (a preset name stays a name)."""
    if spec.config is not None and Path(spec.config).is_file():
        spec.config = str(Path(spec.config).resolve())
    kinds = finetune_args(spec.job) if spec.job in FINETUNE_TASKS else {}
    for key, value in list(spec.args.items()):
        if kinds.get(key) == "path" and isinstance(value, str):
            spec.args[key] = str(Path(value).resolve())


def _need(cond: bool, source: str, key: str, expected: str, got: Any = None) -> None:
    if not cond:
        tail = f", got {got!r}" if got is not None else ""
        raise ConfigError(f"{source}: {key}: expected {expected}{tail}")


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value)


def _flatten(parameters: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """W&B's nested form (`optimizer: {parameters: {lr: ...}}`) as dotted keys."""
    out: dict[str, Any] = {}
    for key, value in parameters.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and set(value) == {"parameters"} \
                and isinstance(value["parameters"], dict):
            out.update(_flatten(value["parameters"], f"{name}."))
        else:
            out[name] = value
    return out


def parse_parameter(name: str, raw: Any, source: str) -> Parameter:
    """One `parameters` entry: `value`, `values`, or `distribution` with `min`/`max` (`q`)."""
    key = f"parameters.{name}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {key}: expected a mapping with value, values or "
                          f"min/max, got {raw!r}")
    unknown = sorted(set(raw) - {"value", "values", "distribution", "min", "max", "q"})
    if unknown:
        raise ConfigError(f"{source}: {key}.{unknown[0]}: unknown key; expected value, values, "
                          "distribution, min, max, q")
    dist = raw.get("distribution")
    if dist is not None and dist not in DISTRIBUTIONS:
        raise ConfigError(f"{source}: {key}.distribution: unknown distribution {dist!r}; "
                          f"expected one of {', '.join(DISTRIBUTIONS)}")
    if "value" in raw:
        _need(dist in (None, "constant"), source, f"{key}.distribution",
              "constant (or none) with value", dist)
        return Parameter(name, "constant", [raw["value"]])
    if "values" in raw:
        values = raw["values"]
        _need(isinstance(values, list) and len(values) > 0, source, f"{key}.values",
              "a non-empty list", values)
        _need(dist in (None, "categorical"), source, f"{key}.distribution",
              "categorical (or none) with values", dist)
        for v in values:
            _need(v is None or isinstance(v, str | bool | int | float), source, f"{key}.values",
                  "numbers, strings, booleans or null", v)
        if len({json.dumps(v) for v in values}) != len(values):
            raise ConfigError(f"{source}: {key}.values: expected distinct values, got {values!r}")
        return Parameter(name, "categorical", list(values))
    if "min" not in raw or "max" not in raw:
        raise ConfigError(f"{source}: {key}: expected value, values, or min and max")
    lo, hi = raw["min"], raw["max"]
    _need(_number(lo), source, f"{key}.min", "a finite number", lo)
    _need(_number(hi), source, f"{key}.max", "a finite number", hi)
    if lo > hi:
        raise ConfigError(f"{source}: {key}: min ({lo}) is greater than max ({hi})")
    if dist is None:  # W&B's inference: integers → int_uniform, else uniform
        dist = "int_uniform" if isinstance(lo, int) and isinstance(hi, int) else "uniform"
    if dist == "int_uniform":
        _need(isinstance(lo, int) and isinstance(hi, int), source, f"{key}.min/max",
              "integers for int_uniform", [lo, hi])
    if dist in ("log_uniform_values", "q_log_uniform_values"):
        _need(lo > 0, source, f"{key}.min", f"a positive number for {dist}", lo)
    q = raw.get("q")
    if dist.startswith("q_"):
        q = 1.0 if q is None else q
        _need(_number(q) and q > 0, source, f"{key}.q", "a positive number", q)
    elif q is not None:
        raise ConfigError(f"{source}: {key}.q: only q_uniform and q_log_uniform_values take q")
    return Parameter(name, dist, [], float(lo) if dist != "int_uniform" else lo,
                     float(hi) if dist != "int_uniform" else hi, q)


def parse_spec(raw: Any, source: str = "<sweep>") -> SweepSpec:
    """A `SweepSpec` from a sweep file's mapping: the format checks (keys, method, goal,
    distributions, grid, run_cap), not yet those that need the config (`check_spec`)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping (method, metric, parameters, job, "
                          f"...), got {type(raw).__name__}")
    for key in raw:
        if key not in TOP_LEVEL:
            raise ConfigError(f"{source}: {key}: unknown key; expected one of "
                              f"{', '.join(TOP_LEVEL)}")
    for key in ("program", "command"):
        if key in raw:
            raise ConfigError(f"{source}: {key}: popbert runs its own job; name it with "
                              f"job: ({', '.join(JOBS)}) instead")
    job = raw.get("job", "pretrain")
    _need(job in JOBS, source, "job", " or ".join(JOBS), job)
    method = raw.get("method")
    if method not in METHODS:
        raise ConfigError(f"{source}: method: expected grid, random or bayes, got {method!r}")
    metric = raw.get("metric")
    _need(isinstance(metric, dict) and isinstance(metric.get("name"), str), source, "metric",
          "a mapping with name and goal", metric)
    extra = sorted(set(metric) - {"name", "goal"})
    if extra:
        raise ConfigError(f"{source}: metric.{extra[0]}: unknown key; expected name, goal")
    goal = metric.get("goal", "minimize")
    if goal not in GOALS:
        raise ConfigError(f"{source}: metric.goal: expected minimize or maximize, got {goal!r}")
    params_raw = raw.get("parameters")
    _need(isinstance(params_raw, dict) and params_raw, source, "parameters",
          "a non-empty mapping of config keys", params_raw)
    parameters = {name: parse_parameter(name, value, source)
                  for name, value in _flatten(params_raw).items()}
    if method == "grid":
        for p in parameters.values():
            if p.continuous:
                raise ConfigError(
                    f"{source}: parameters.{p.name}: method grid needs discrete values "
                    f"(values, value, int_uniform or q_uniform), got the continuous "
                    f"distribution {p.distribution}")
    run_cap = raw.get("run_cap")
    _need(run_cap is None or (isinstance(run_cap, int) and not isinstance(run_cap, bool)
                              and run_cap >= 1), source, "run_cap", "a positive integer",
          run_cap)
    early = raw.get("early_terminate")
    if early is not None:
        _need(isinstance(early, dict), source, "early_terminate", "a mapping", early)
        if early.get("type") != "hyperband":
            raise ConfigError(f"{source}: early_terminate.type: expected hyperband, got "
                              f"{early.get('type')!r}")
        for key, value in early.items():
            if key == "type":
                continue
            if key not in ("min_iter", "max_iter", "eta", "s", "strict"):
                raise ConfigError(f"{source}: early_terminate.{key}: unknown key; expected "
                                  "type, min_iter, max_iter, eta")
            if key in ("min_iter", "max_iter", "eta"):
                _need(isinstance(value, int) and not isinstance(value, bool) and value >= 1
                      and (key != "eta" or value >= 2), source, f"early_terminate.{key}",
                      "an integer >= 2" if key == "eta" else "a positive integer", value)
        if early.get("min_iter", 1) > early.get("max_iter", early.get("min_iter", 1)):
            raise ConfigError(f"{source}: early_terminate: min_iter ({early['min_iter']}) is "
                              f"greater than max_iter ({early['max_iter']})")
    fixed = raw.get("set", {}) or {}
    if isinstance(fixed, list):  # ["key=value", ...] as on the command line
        from popbert.config import parse_override

        fixed = {".".join(parse_override(text)[0]): parse_override(text)[1] for text in fixed}
    _need(isinstance(fixed, dict), source, "set", "a mapping of config keys to values", fixed)
    fixed = _flatten_set(fixed)
    args = raw.get("args", {}) or {}
    _need(isinstance(args, dict), source, "args", "a mapping of the job's options", args)
    init = raw.get("init_from")
    init_from = None
    if init is not None:
        _need(isinstance(init, dict) and isinstance(init.get("sweep"), str), source,
              "init_from", "a mapping with sweep (a sweep directory or id) and trial", init)
        extra = sorted(set(init) - {"sweep", "trial", "storage"})
        if extra:
            raise ConfigError(f"{source}: init_from.{extra[0]}: unknown key; expected sweep, "
                              "trial, storage")
        trial = init.get("trial", "best")
        _need(trial == "best" or (isinstance(trial, int) and not isinstance(trial, bool)
                                  and trial >= 0), source, "init_from.trial",
              "best or a trial number", trial)
        init_from = InitFrom(init["sweep"], trial, init.get("storage"))
    sampler = raw.get("sampler", "tpe")
    _need(sampler in BAYES_SAMPLERS, source, "sampler", "tpe or gp (for method bayes)", sampler)
    seed = raw.get("seed")
    _need(seed is None or (isinstance(seed, int) and not isinstance(seed, bool)
                           and SEED.allows(seed)), source, "seed", f"an integer {SEED.expected}",
          seed)
    heartbeat = raw.get("heartbeat", 30.0)
    _need(_number(heartbeat) and heartbeat >= 1, source, "heartbeat",
          "seconds between an agent's heartbeats (>= 1)", heartbeat)
    config = raw.get("config")
    _need(config is None or isinstance(config, str), source, "config",
          "a preset name or a config file", config)
    name = raw.get("name")
    _need(name is None or isinstance(name, str), source, "name", "a string", name)
    backend = raw.get("backend", "optuna")
    _need(backend in BACKENDS, source, "backend", " or ".join(BACKENDS), backend)
    for key in ("project", "entity"):
        _need(raw.get(key) is None or isinstance(raw[key], str), source, key,
              f"a W&B {key} name", raw.get(key))
    return SweepSpec(job=job, method=method, metric=metric["name"], goal=goal,
                     parameters=parameters, config=config, set=fixed, args=dict(args),
                     run_cap=run_cap, early_terminate=dict(early) if early else None,
                     init_from=init_from, sampler=sampler, seed=seed, heartbeat=float(heartbeat),
                     name=name, backend=backend, project=raw.get("project"),
                     entity=raw.get("entity"), source=source)


def _flatten_set(fixed: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`set` as dotted keys: `{optimizer: {lr: 1}}` and `{optimizer.lr: 1}` mean the same."""
    out: dict[str, Any] = {}
    for key, value in fixed.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and "." not in name:
            out.update(_flatten_set(value, f"{name}."))
        else:
            out[name] = value
    return out


def base_config(spec: SweepSpec, params: Mapping[str, Any] | None = None):
    """The pre-training config of a trial: `config` under `set` and the trial's parameters."""
    from popbert.config import DEFAULT_PRESET, load_config

    return load_config(spec.config or DEFAULT_PRESET, spec.overrides(params))


def job_metrics(spec: SweepSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(metrics the job logs per step into metrics.jsonl, metrics it reports once at the end)."""
    if spec.job == "pretrain":
        from popbert.train.pretrain import METRIC_KEYS

        return tuple(METRIC_KEYS), ()
    task = TASKS[FINETUNE_TASKS[spec.job]]
    return task.metric_keys, task.final_metrics


def check_spec(spec: SweepSpec) -> None:
    """The checks that need popbert's config: every parameter and `set` key is a config key the
    job takes, with values of the right type, and the metric is one the job writes."""
    src = spec.source
    if spec.job == "pretrain":
        if spec.args:
            raise ConfigError(f"{src}: args: pretrain takes its settings as config keys (set, "
                              f"parameters), not args")
        for p in spec.parameters.values():
            if p.name.startswith("args."):
                raise ConfigError(f"{src}: parameters.{p.name}: pretrain has no args; expected "
                                  "a config key such as optimizer.lr")
        _check_config_keys(spec)
    else:
        _check_finetune(spec)
    logged, final = job_metrics(spec)
    if spec.metric not in logged + final:
        raise ConfigError(f"{src}: metric.name: {spec.job} does not write {spec.metric!r}; "
                          f"expected one of {', '.join(dict.fromkeys(final + logged))}")
    if spec.job == "pretrain" and spec.metric.startswith("val_"):
        cfg = base_config(spec)
        if not (cfg.training.eval_every and (cfg.data.validation_fraction
                                             or cfg.data.validation_files)):
            raise ConfigError(f"{src}: metric.name: {spec.metric} is a validation metric: set "
                              "training.eval_every and data.validation_fraction (or "
                              "data.validation_files) under set")
    if spec.job == "finetune squad" and spec.metric in final and "predict" not in spec.args:
        raise ConfigError(f"{src}: metric.name: {spec.metric} is scored on args.predict "
                          "(a SQuAD file with answers); set it")
    if spec.method == "bayes" and spec.sampler == "gp":
        try:
            import scipy  # noqa: F401  (Optuna's GPSampler needs it)
        except ImportError:
            raise ConfigError(f"{src}: sampler: gp needs scipy (pip install scipy)") from None


def _check_config_keys(spec: SweepSpec) -> None:
    """Load the config with `set` and each parameter's edge values: unknown keys and bad types
    fail here as they would on the command line, named as sweep-file keys."""
    from popbert.config import DEFAULT_PRESET, load_config

    config = spec.config or DEFAULT_PRESET
    base = spec.overrides()
    try:
        load_config(config, base)
    except ConfigError as error:
        raise ConfigError(f"{spec.source}: set: {_sweep_words(error, base)}") from None
    for p in spec.parameters.values():
        for value in p.edge_values():
            text = override_text(p.name, value)
            try:
                load_config(config, [*base, text])
            except ConfigError as error:
                raise ConfigError(f"{spec.source}: parameters.{p.name}: "
                                  f"{_sweep_words(error, [*base, text])}") from None


def _sweep_words(error: ConfigError, overrides: list[str]) -> str:
    """The config's message without the `--set KEY=VALUE: ` it starts with on the command
    line: a sweep file has no --set; the line names the sweep file's key instead."""
    message = str(error)
    for text in overrides:
        if message.startswith(f"--set {text}: "):
            return message[len(f"--set {text}: "):]
    return message


def _check_finetune(spec: SweepSpec) -> None:
    src = spec.source
    kinds = finetune_args(spec.job)
    for key, value in spec.args.items():
        if key not in kinds:
            raise ConfigError(f"{src}: args.{key}: {spec.job} has no such option; expected one "
                              f"of {', '.join(kinds)}")
        _check_arg(src, f"args.{key}", kinds[key], value)
    for key in ("train",):
        if key not in spec.args:
            raise ConfigError(f"{src}: args.{key}: {spec.job} needs it")
    if "checkpoint" not in spec.args and spec.init_from is None:
        raise ConfigError(f"{src}: args.checkpoint: {spec.job} needs a checkpoint (or "
                          "init_from another sweep's trial)")
    keys = list(spec.set) + list(spec.parameters)
    for key in keys:
        where = "set" if key in spec.set else f"parameters.{key}"
        if key.startswith("args."):
            name = key[len("args."):]
            if name not in kinds or kinds[name] == "path":
                options = ", ".join(f"args.{k}" for k, t in kinds.items() if t != "path")
                raise ConfigError(f"{src}: {where}: {key} is not an option {spec.job} sweeps; "
                                  f"expected one of {options}")
            for value in spec.parameters[key].edge_values() if key in spec.parameters else []:
                _check_arg(src, where, kinds[name], value)
            continue
        _check_config_key(src, where, key)
        if key.startswith(NOT_SWEPT) or key.startswith("finetune."):
            raise ConfigError(f"{src}: {where}: {key} is a config key fine-tuning does not "
                              "take (model.* and data.* come from the checkpoint, "
                              "training.steps and optimizer.warmup_steps from the data; "
                              "finetune.* keys are args.<option>)")
        values = spec.parameters[key].edge_values() if key in spec.parameters \
            else [spec.set[key]]
        for value in values:  # the field's type, checked as --set checks it
            from popbert.config import DEFAULT_PRESET, load_config

            try:
                load_config(DEFAULT_PRESET, [override_text(key, value)])
            except ConfigError as error:
                raise ConfigError(f"{src}: {where}: "
                                  f"{_sweep_words(error, [override_text(key, value)])}"
                                  ) from None


def _check_config_key(src: str, where: str, key: str) -> None:
    """That `key` names a config field (the override machinery's own check and message)."""
    from popbert.config import apply_overrides

    try:
        apply_overrides({}, [f"{key}=null"])
    except ConfigError as error:
        raise ConfigError(f"{src}: {where}: {_sweep_words(error, [f'{key}=null'])}") from None


def _check_arg(src: str, key: str, kind: Any, value: Any) -> None:
    if kind == "path":
        _need(isinstance(value, str) and Path(value).exists(), src, key, "an existing path",
              value)
    elif kind is bool:
        _need(isinstance(value, bool), src, key, "true or false", value)
    elif kind is int:
        _need(isinstance(value, int) and not isinstance(value, bool), src, key, "an integer",
              value)
    elif kind is float:
        _need(_number(value), src, key, "a number", value)
    else:
        _need(isinstance(value, str), src, key, "a string", value)


__all__ = ["BACKENDS", "BAYES_SAMPLERS", "DISTRIBUTIONS", "FINETUNE_TASKS", "GOALS", "JOBS",
           "METHODS", "InitFrom", "Parameter", "SweepSpec", "base_config", "check_spec",
           "finetune_args", "job_metrics", "load_spec", "override_text", "parse_parameter",
           "parse_spec"]
