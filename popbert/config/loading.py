"""From YAML files, presets and `--set` overrides to a validated `RunConfig`, and back to YAML.

A config file is laid over a preset: the one its top-level `preset:` key names, `tiny` when it
names none, or none at all with `preset: null` (then the dataclass defaults fill the gaps). So
a file holding only `training: {steps: 10}` is a coherent tiny run, and the resolved config
records the preset it came from. `--set section.key=value` overrides apply on top, and every key
and type is checked on the way: each mistake is one `ConfigError` line naming the file (or the
override) and the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import types
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from popbert.builders.bert_config import ARCHITECTURES, BertConfig, TaskConfig
from popbert.config.sections import (
    SECTIONS,
    TOP_LEVEL_KEYS,
    Bytes,
    Origins,
    RunConfig,
    Seconds,
    non_finite,
    validate_run_config,
)
from popbert.config.yaml_io import DuplicateKeyError, dump_yaml, load_yaml, parse_yaml
from popbert.errors import ConfigError
from popbert.rules import INT_LIMIT
from popbert.textfile import read_text

logger = logging.getLogger(__name__)

PRESETS_DIR = Path(__file__).resolve().parent / "presets"
DEFAULT_PRESET = "tiny"

# Strings Python's float() reads as a non-finite number: in a numeric key they are a request
# for inf/nan (YAML 1.2 spells those .inf and .nan), not a typo to report as a wrong type.
_NON_FINITE_TEXT = {"inf", "+inf", "-inf", "infinity", "+infinity", "-infinity", "nan", "+nan",
                    "-nan"}


# ----------------------------------------------------------------------------------------------
# Presets
# ----------------------------------------------------------------------------------------------


def list_presets() -> list[str]:
    """Names of the presets shipped in popbert/config/presets (usable wherever a config path
    is, and as a file's `preset:`)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(name: str) -> Path:
    """Path of a shipped preset's YAML file; ConfigError listing the presets if unknown."""
    path = PRESETS_DIR / f"{name}.yaml"
    if os.sep in name or not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; presets: {', '.join(list_presets())}")
    return path


def _preset_name(path: Path) -> str | None:
    """The preset a file is, when it is one of the shipped preset files."""
    resolved = path.resolve()
    return resolved.stem if resolved.parent == PRESETS_DIR and resolved.suffix == ".yaml" else None


def _resolve(config: str | os.PathLike[str]) -> tuple[Path, str, str | None]:
    """Path, display name and preset name (None for a user's file) of a config given as a file
    path or a preset name."""
    path = Path(config)
    if path.is_file():
        return path, str(config), _preset_name(path)
    name = str(config)
    if os.sep not in name and (PRESETS_DIR / f"{name}.yaml").is_file():
        return PRESETS_DIR / f"{name}.yaml", f"{name}.yaml (preset)", name
    if path.exists():
        raise ConfigError(f"{config}: not a file")
    raise ConfigError(f"config file not found: {config} "
                      f"(presets: {', '.join(list_presets())})")


# ----------------------------------------------------------------------------------------------
# Raw (parsed, unchecked) configs
# ----------------------------------------------------------------------------------------------


def _check_top_level(raw: Any, source: str) -> dict[str, Any]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping of sections "
                          f"({', '.join(SECTIONS)}), got {type(raw).__name__}")
    for name in raw:
        if name not in TOP_LEVEL_KEYS:
            raise _unknown_key(source, str(name), list(TOP_LEVEL_KEYS))
    return raw


# Keys that moved into a family's own section: old dotted name -> new one. Files written
# before (checkpoints' config.yaml, users' YAML) and `--set` still read them.
MOVED_KEYS = {f"model.{key}": f"model.groupbert.{key}"
              for key in ("ffn_groups", "conv_kernel_size", "conv_group_size")}


def _move_keys(raw: dict[str, Any], sources: dict[str, str]) -> dict[str, Any]:
    """`raw` with each `MOVED_KEYS` key at its new place (a value `--set` gave the new key
    wins over one a file spelled the old way)."""
    model = raw.get("model")
    if not isinstance(model, dict) or not any(k.split(".")[1] in model for k in MOVED_KEYS):
        return raw
    model = dict(model)
    for old, new in MOVED_KEYS.items():
        key = old.split(".")[1]
        if key not in model:
            continue
        value = model.pop(key)
        section, name = new.split(".")[1:]
        target = dict(model.get(section) or {})
        if new not in sources:
            target[name] = value
        model[section] = target
        logger.debug("%s is read as %s", old, new)
    return {**raw, "model": model}


def _upgrade_legacy(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with the pre-`model.task` spelling of task settings mapped onto `model.task`.

    Checkpoints written before the task settings were typed hold them in a free-form
    `model.extra` mapping, with the task under the key `task` (now `model.task.name`). Keys
    `TaskConfig` has no field for were never read by popbert, so they are dropped.
    """
    model = raw.get("model")
    if not isinstance(model, dict) or "extra" not in model:
        return raw
    model = dict(model)
    extra = model.pop("extra")
    task: dict[str, Any] = {}
    if isinstance(extra, dict):
        fields = _field_types(TaskConfig)
        renamed = {("name" if k == "task" else k): v for k, v in extra.items()}
        task = {k: v for k, v in renamed.items() if k in fields}
        dropped = sorted(str(k) for k in renamed if k not in fields)
        if dropped:
            logger.debug("model.extra: dropped %s (not task settings)", ", ".join(dropped))
    given = model.get("task")
    model["task"] = _merge(task, given) if isinstance(given, dict) else (given or task)
    return {**raw, "model": model}


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    """`top` laid over `base`: mappings merge key by key; an empty (null) mapping in `top`
    keeps `base`'s (a file with a bare `tracking:` line changes nothing)."""
    out = dict(base)
    for key, value in top.items():
        below = out.get(key)
        if isinstance(below, dict) and isinstance(value, dict):
            out[key] = _merge(below, value)
        elif isinstance(below, dict) and value is None:
            continue
        else:
            out[key] = value
    return out


def _read(path: Path, source: str) -> dict[str, Any]:
    text = read_text(path, "a YAML config", error=ConfigError)
    return _upgrade_legacy(_check_top_level(parse_yaml(text, source), source))


def _over_preset(raw: dict[str, Any], source: str, own_name: str | None,
                 seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """`raw` laid over the preset it names, recursively, with `preset` set to that name.

    A shipped preset (`own_name`) stands on its own unless it names another; any other file
    without a `preset:` key is laid over DEFAULT_PRESET.
    """
    name = raw.get("preset", own_name if own_name is not None else DEFAULT_PRESET)
    if name is None or name == own_name:
        return {**raw, "preset": name}
    if not isinstance(name, str) or name not in list_presets():
        raise ConfigError(f"{source}: preset: unknown preset {name!r}; presets: "
                          f"{', '.join(list_presets())}")
    if name in seen:
        raise ConfigError(f"{source}: preset: {name!r} is laid over itself "
                          f"({' -> '.join((*seen, name))})")
    base_source = f"{name}.yaml (preset)"
    base = _over_preset(_read(preset_path(name), base_source), base_source, name, (*seen, name))
    return {**_merge(base, raw), "preset": name}


# ----------------------------------------------------------------------------------------------
# Types: raw values -> dataclass fields
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
    if origin is dict or tp is dict or _dataclass_type(tp) is not None:
        return "mapping"
    if tp is Any:
        return "any value"
    if tp is Seconds:
        return "seconds (a number, or e.g. 90s, 30m, 2h)"
    if tp is Bytes:
        return "a size (bytes, or e.g. 20GB, 512MiB)"
    return getattr(tp, "__name__", str(tp))


def _dataclass_type(tp: Any) -> type | None:
    """The dataclass a field holds (a nested mapping such as `model.task`), else None."""
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def _is_numeric(tp: Any) -> bool:
    if typing.get_origin(tp) in (typing.Union, types.UnionType, list):
        return any(_is_numeric(a) for a in typing.get_args(tp))
    return tp in (int, float)


class _TypeMismatch(Exception):
    pass


class _OutOfRange(Exception):
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
    if tp is Seconds:
        try:
            return Seconds.parse(value)
        except ValueError:
            raise _TypeMismatch from None
    if tp is Bytes:
        try:
            return Bytes.parse(value)
        except ValueError:
            raise _TypeMismatch from None
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _TypeMismatch
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if abs(value) > INT_LIMIT:
                raise _OutOfRange
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


def _source_of(key: str, sources: dict[str, str], default: str) -> str:
    """Where `key`'s value came from: the override that set it or a mapping above it."""
    return Origins(default, sources)(key)


def _convert(key: str, value: Any, tp: Any, src: str) -> Any:
    """One field's value, type-checked (non-finite numbers named as such)."""
    bad = non_finite(value, key)
    if bad is not None:
        raise ConfigError(f"{src}: {bad[0]} must be a finite number, got {bad[1]}")
    try:
        return _coerce(value, tp)
    except _OutOfRange:
        raise ConfigError(f"{src}: {key}: expected an integer from -{INT_LIMIT} to {INT_LIMIT} "
                          f"(2**31 - 1), got {value!r}") from None
    except _TypeMismatch:
        if (_is_numeric(tp) and isinstance(value, str)
                and value.strip().lower() in _NON_FINITE_TEXT):
            raise ConfigError(f"{src}: {key} must be a finite number, got {value!r}") from None
        raise ConfigError(f"{src}: {key}: expected {_type_name(tp)}, got {value!r}") from None


def _build(cls: type, path: str, values: Any, sources: dict[str, str], default_source: str
           ) -> Any:
    """A `cls` instance from a raw mapping at dotted `path` (a section, or a mapping inside one
    such as `model.task`); missing keys take the dataclass defaults."""
    if dataclasses.is_dataclass(values) and not isinstance(values, type):
        values = dataclasses.asdict(values)  # e.g. a TaskConfig inside `model.__dict__`
    if values is None:
        values = {}
    src = _source_of(path, sources, default_source)
    if not isinstance(values, dict):
        what = f"section {path}" if "." not in path else path
        raise ConfigError(f"{src}: {what} must be a mapping of keys, got {values!r}")
    types_ = _field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        full = f"{path}.{key}"
        key_src = _source_of(full, sources, default_source)
        if not isinstance(key, str) or key not in types_:
            raise _unknown_key(key_src, full, sorted(types_))
        nested = _dataclass_type(types_[key])
        if nested is not None:
            kwargs[key] = _build(nested, full, value, sources, default_source)
        else:
            kwargs[key] = _convert(full, value, types_[key], key_src)
    return cls(**kwargs)


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def config_from_dict(d: dict[str, Any] | None, source: str = "<dict>",
                     key_sources: dict[str, str] | None = None) -> RunConfig:
    """Build and validate a RunConfig from a dict of sections and `preset`.

    Missing keys take the dataclass defaults: the dict is *not* laid over its `preset`, which
    is only recorded (a saved config, a checkpoint's, is complete; `load_config` is what lays a
    file over its preset). A legacy `model.extra` mapping is read as `model.task`. `source`
    names where the values came from in error messages; `key_sources` may name a different
    origin for single keys ("section.key" -> e.g. "--set section.key=value").
    """
    sources = key_sources or {}
    d = _move_keys(_upgrade_legacy(_check_top_level(d, source)), sources)
    preset = _convert("preset", d.get("preset"), str | None,
                      _source_of("preset", sources, source))
    sections = {name: _build(cls, name, d.get(name), sources, source)
                for name, cls in SECTIONS.items()}
    cfg = RunConfig(preset=preset, **sections)
    validate_run_config(cfg, source, sources)
    check_family_sections(cfg, source, sources)
    return cfg


# The model families with a settings section of their own (`model.groupbert`,
# `model.modernbert`): a key there does something only when `model.architecture` names it.
FAMILY_SECTIONS = tuple(f.name for f in dataclasses.fields(BertConfig)
                        if f.name in ARCHITECTURES)


def check_family_sections(cfg: RunConfig, source: str = "<config>",
                          key_sources: dict[str, str] | None = None) -> None:
    """ConfigError (one line) for a family's own setting on another family's model: one an
    override names, or one a file sets away from its default. Either would do nothing."""
    sources = key_sources or {}
    architecture = cfg.model.architecture
    for family in FAMILY_SECTIONS:
        if family == architecture:
            continue
        prefix = f"model.{family}"
        named = sorted(k for k in sources if k == prefix or k.startswith(prefix + "."))
        options = getattr(cfg.model, family)
        default = type(options)()
        changed = [f"{prefix}.{f.name}" for f in dataclasses.fields(options)
                   if getattr(options, f.name) != getattr(default, f.name)]
        bad = named or changed
        if bad:
            raise ConfigError(f"{Origins(source, sources)(bad[0])}: {bad[0]} is a setting of "
                              f"model.architecture {family}, but the model is "
                              f"{architecture!r}: it would do nothing; remove it, or set "
                              f"model.architecture={family}")


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
        value = load_yaml(raw)
    except DuplicateKeyError as exc:
        raise ConfigError(f"bad --set {text!r}: duplicate key {exc.key}") from None
    except yaml.YAMLError:
        raise ConfigError(f"bad --set {text!r}: {raw!r} is not a YAML value") from None
    return parts, value


def apply_overrides(d: dict[str, Any], overrides: Iterable[str],
                    key_sources: dict[str, str] | None = None) -> dict[str, Any]:
    """Return a copy of raw config `d` with `section.key=value` overrides applied.

    Keys are checked against the dataclasses as they are set (`model.task.num_labels=3`
    reaches into the `model.task` mapping); `key_sources`, if given, records which override
    set each key.
    """
    out: dict[str, Any] = dict(d)
    for text in overrides:
        parts, value = parse_override(text)
        src = f"--set {text}"
        if ".".join(parts) in MOVED_KEYS:
            moved = MOVED_KEYS[".".join(parts)]
            logger.warning("%s: the key is now %s", src, moved)
            parts = moved.split(".")
        section = parts[0]
        if section not in SECTIONS:
            raise _unknown_key(src, section, list(SECTIONS))
        cls: type | None = SECTIONS[section]
        node = out[section] = dict(out[section]) if isinstance(out.get(section), dict) else {}
        for depth, key in enumerate(parts[1:], start=1):
            here = ".".join(parts[:depth])
            if cls is None:
                raise ConfigError(f"{src}: {here} is not a mapping, so {'.'.join(parts)} "
                                  f"cannot be set")
            types_ = _field_types(cls)
            if key not in types_:
                raise _unknown_key(src, f"{here}.{key}", sorted(types_))
            if depth == len(parts) - 1:
                node[key] = value
                break
            cls = _dataclass_type(types_[key])
            child = node.get(key)
            node[key] = dict(child) if isinstance(child, dict) else {}
            node = node[key]
        if key_sources is not None:
            key_sources[".".join(parts)] = src
    return out


def load_config(config: str | os.PathLike[str] = DEFAULT_PRESET,
                overrides: Iterable[str] = ()) -> RunConfig:
    """Load a YAML config file (laid over its preset) or a preset name, apply `--set`
    overrides, validate.

    Raises ConfigError with a one-line message naming the file (or override) and the key.
    """
    path, source, own_name = _resolve(config)
    raw = _over_preset(_read(path, source), source, own_name)
    key_sources: dict[str, str] = {}
    raw = apply_overrides(raw, overrides, key_sources)
    return config_from_dict(raw, source=source, key_sources=key_sources)


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML text (`preset`, then the sections in the canonical order);
    `load_config` reads it back as an equal config."""
    return dump_yaml(cfg.to_dict())


__all__ = [
    "DEFAULT_PRESET", "FAMILY_SECTIONS", "PRESETS_DIR", "apply_overrides",
    "check_family_sections", "config_from_dict", "dump_config",
    "list_presets", "load_config", "parse_override", "preset_path",
]
