"""The YAML dialect of popbert configs: how config files and `--set` values are read and written.

PyYAML speaks YAML 1.1, where `1e-3` is the string '1e-3' and `yes` is True; a config full of
learning rates wants YAML 1.2 scalars instead. A mapping that names a key twice is an error here
(PyYAML silently keeps the last value, so a forgotten line would win unnoticed). The dumper
writes what both this loader and a plain `yaml.safe_load` read back as the same values.
"""

from __future__ import annotations

import re
from typing import Any

import yaml
from yaml.constructor import ConstructorError

from popbert.errors import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"


class DuplicateKeyError(ConstructorError):
    """A mapping names the same key twice; `key` is its dotted path, `first`/`second` are the
    1-based lines of the two occurrences."""

    def __init__(self, key: str, first: int, second: int, mark: yaml.Mark) -> None:
        super().__init__(problem=f"duplicate key {key}", problem_mark=mark)
        self.key, self.first, self.second = key, first, second


class Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars (`1e-3` is a float, `100:5` and `yes` stay strings) that
    rejects duplicate keys in a mapping."""

    def construct_document(self, node: yaml.Node) -> Any:
        # Dotted paths of the mappings, so a duplicate key is named as `optimizer.lr`, not `lr`.
        self._paths: dict[int, str] = {}
        self._name_mappings(node, "")
        return super().construct_document(node)

    def _name_mappings(self, node: yaml.Node, path: str) -> None:
        if isinstance(node, yaml.MappingNode):
            self._paths[id(node)] = path
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                self._name_mappings(value, f"{path}.{name}" if path else str(name))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._name_mappings(item, f"{path}[{i}]")

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        # Only the keys written in this mapping: keys brought in by a `<<` merge may be
        # overridden, as YAML intends.
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key; SafeConstructor reports it
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                parent = getattr(self, "_paths", {}).get(id(node), "")
                raise DuplicateKeyError(f"{parent}.{key}" if parent else str(key), first, line,
                                        key_node.start_mark)
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


_REPLACED = {"tag:yaml.org,2002:float", "tag:yaml.org,2002:int", "tag:yaml.org,2002:bool"}
Loader.yaml_implicit_resolvers = {
    ch: [(tag, rx) for tag, rx in resolvers if tag not in _REPLACED]
    for ch, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:int",
    re.compile(r"""^(?:[-+]?0b[0-1_]+
                |[-+]?0o[0-7_]+
                |[-+]?(?:0|[1-9][0-9_]*)
                |[-+]?0x[0-9a-fA-F_]+)$""", re.X),
    list("-+0123456789"),
)
Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
                |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
                |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
                |[-+]?\.(?:inf|Inf|INF)
                |\.(?:nan|NaN|NAN))$""", re.X),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    """Parse YAML text in popbert's dialect; raises yaml.YAMLError (DuplicateKeyError for a
    repeated key)."""
    return yaml.load(text, Loader=Loader)  # noqa: S506 - Loader is a SafeLoader


def parse_yaml(text: str, source: str) -> Any:
    """Parse a config file's text; any problem is one ConfigError line naming `source`."""
    try:
        return load_yaml(text)
    except DuplicateKeyError as exc:
        raise ConfigError(f"{source}: duplicate key {exc.key} at lines {exc.first} and "
                          f"{exc.second}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{source}: invalid YAML{where}: {problem}") from None


class Dumper(yaml.SafeDumper):
    """Block mappings, flow lists (`betas: [0.9, 0.999]`), as in the presets.

    A string is quoted when it would read as anything else under either YAML 1.1 (yaml.safe_load,
    e.g. 'yes', '100:5') or popbert's YAML 1.2 loader (e.g. '1e-3'), so both read the file back
    the same.
    """


Dumper.yaml_implicit_resolvers = {
    ch: list(yaml.SafeDumper.yaml_implicit_resolvers.get(ch, []))
    + list(Loader.yaml_implicit_resolvers.get(ch, []))
    for ch in set(yaml.SafeDumper.yaml_implicit_resolvers) | set(Loader.yaml_implicit_resolvers)
}

Dumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data,
                                                         flow_style=True))


def dump_yaml(data: Any) -> str:
    """`data` as YAML text in key order that `load_yaml` and `yaml.safe_load` read back equal."""
    return yaml.dump(data, Dumper=Dumper, sort_keys=False, default_flow_style=False)


__all__ = ["DuplicateKeyError", "Dumper", "Loader", "dump_yaml", "load_yaml", "parse_yaml"]
