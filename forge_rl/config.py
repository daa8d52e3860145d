"""Configs: YAML files plus `key=value` overrides, merged into typed dataclasses.

Each app declares its config as a dataclass tree (required fields have no default). Then

    cfg = load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["trainer.lr=1e-4", "group_size=8"])

reads the file, applies the overrides (OmegaConf dotlist syntax), resolves interpolations such
as `${group_size}` and returns a `GRPOConfig` instance. Every mistake is a `ConfigError` naming
the key and where it came from: an unknown key (with the closest valid keys), a value of the
wrong type (with the expected type) or a missing required key.

Fields typed `dict[str, Any]` accept any keys: they pass options through to a library under its
own names (vLLM engine arguments, sampling parameters). A key a config class renamed (its `RENAMED`) is refused
naming the new key.
"""

import argparse
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import (
    ConfigKeyError,
    InterpolationKeyError,
    MissingMandatoryValue,
    OmegaConfBaseException,
    ValidationError,
)

from forge_rl.errors import ConfigError, did_you_mean, one_line

T = TypeVar("T")


def load_config(schema: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    """Build a `schema` instance from the YAML file at `path` and dotlist `overrides`."""
    merged = OmegaConf.structured(schema)
    layers: list[tuple[str, DictConfig]] = []
    if path is not None:
        layers.append((f"file {path}", _read_yaml(Path(path))))
    for item in overrides:
        layers.append((f"command-line override {item!r}", _parse_override(item)))
    for source, layer in layers:
        _check_keys(schema, layer, prefix="", source=source)
        try:
            merged = OmegaConf.merge(merged, layer)
        except ValidationError as e:
            raise ConfigError(_type_message(schema, e, source)) from None
        except TypeError:  # OmegaConf cannot merge a mapping into a list or a list into a mapping
            raise ConfigError(_container_message(merged, layer, source)) from None
        except OmegaConfBaseException as e:  # what the key checks above do not foresee
            raise ConfigError(f"{source}: {str(e).splitlines()[0]}") from None
        for key in _missing_keys(layer):  # merge keeps the default under "???"; the file means "required"
            OmegaConf.update(merged, key, "???", merge=False)
    try:  # before the dataclasses' own checks, which a NaN slips through (every comparison with it is false)
        _refuse_nan(OmegaConf.to_container(merged, resolve=True), "")
    except OmegaConfBaseException:
        pass  # an interpolation that does not resolve: to_object below names it
    try:
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        where = f" in {path}" if path else ""
        raise ConfigError(
            f"missing required config key '{e.full_key}': set it{where} or pass {e.full_key}=VALUE"
        ) from None
    except InterpolationKeyError as e:
        raise ConfigError(f"config key '{e.full_key}': {str(e).splitlines()[0]}") from None
    except ValidationError as e:  # an interpolation resolved to a value of the wrong type
        raise ConfigError(_type_message(schema, e, "an interpolation")) from None
    except ValueError as e:  # a config dataclass's own check (__post_init__), which names its key
        raise ConfigError(str(e)) from None


def command_line(schema: type, description: str | None = None) -> argparse.ArgumentParser:
    """The apps' parser: `--config FILE`, `key=value` overrides, `--debug`, and `--verbose` where the schema has
    the key. `overrides(args)` gives the overrides it read."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", type=Path, help="YAML config file")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.lr=1e-4")
    parser.add_argument(
        "--debug", action="store_true", help="on an error, show its traceback too (also: FORGE_RL_DEBUG=1)"
    )
    if "verbose" in _field_types(schema):
        parser.add_argument("--verbose", action="store_true", help="same as verbose=true")
    return parser


def overrides(args: argparse.Namespace) -> list[str]:
    return [*args.overrides, *(["verbose=true"] if getattr(args, "verbose", False) else [])]


def parse_args(schema: type[T], argv: Sequence[str] | None = None, description: str | None = None) -> T:
    """`prog --config FILE key=value ...` -> a `schema` instance; a config error exits with status 2 and its
    message on one line."""
    parser = command_line(schema, description)
    args = parser.parse_args(argv)
    try:
        return load_config(schema, args.config, overrides(args))
    except ConfigError as e:
        parser.exit(2, f"forge_rl: {one_line(e)}\n")


def to_yaml(cfg: Any) -> str:
    """The resolved config as YAML, to store next to a run's outputs."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def _read_yaml(path: Path) -> DictConfig:
    if not path.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        loaded = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {yaml_problem(e)}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read ({e.strerror or e})") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"config file {path} must hold a mapping of keys, found a {type(loaded).__name__}")
    return loaded


def _parse_override(item: str) -> DictConfig:
    if "=" not in item or item.startswith("="):
        raise ConfigError(f"command-line override {item!r} is not of the form key=value")
    try:
        return OmegaConf.from_dotlist([item])
    except yaml.YAMLError as e:  # the value is read as YAML: `key=[1, 2` or `key={a: b`
        raise ConfigError(
            f"command-line override {item!r}: its value is not valid YAML ({yaml_problem(e)}); quote it whole "
            "for the shell, e.g. 'key=[1, 2]'"
        ) from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"command-line override {item!r} cannot be parsed: {one_line(e)}") from None


def yaml_problem(error: yaml.YAMLError) -> str:
    """What the YAML parser found and where, on one line: "did not find expected ',' or ']' at line 2, column 1"."""
    problem = getattr(error, "problem", None) or getattr(error, "context", None)
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    if problem is None:
        return one_line(error)
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def _container_message(merged: DictConfig, layer: DictConfig, source: str, prefix: str = "") -> str:
    """Name the key where `layer` gives a mapping for a list or a list for a mapping."""
    for key, value in layer.items_ex(resolve=False):
        current = merged.get(key) if isinstance(merged, DictConfig) else None
        full_key = f"{prefix}{key}"
        if isinstance(value, DictConfig) and isinstance(current, ListConfig):
            return f"config key '{full_key}' in {source} expects a list, got a mapping"
        if isinstance(value, ListConfig) and isinstance(current, DictConfig):
            return f"config key '{full_key}' in {source} expects a mapping, got a list"
        if isinstance(value, DictConfig) and isinstance(current, DictConfig):
            inner = _container_message(current, value, source, f"{full_key}.")
            if not inner.startswith(f"{source}:"):
                return inner
    return f"{source}: a mapping where the config has a list, or a list where it has a mapping"


def _field_types(schema: type) -> dict[str, Any]:
    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _missing_keys(node: DictConfig, prefix: str = "") -> list[str]:
    """Dotted keys whose value is "???" (OmegaConf's marker for a required value)."""
    keys = []
    for key, value in node.items_ex(resolve=False):  # resolving here would fail on later interpolations
        full_key = f"{prefix}{key}"
        if OmegaConf.is_missing(node, key):
            keys.append(full_key)
        elif isinstance(value, DictConfig):
            keys += _missing_keys(value, f"{full_key}.")
    return keys


def _check_keys(schema: type, node: DictConfig, prefix: str, source: str) -> None:
    """Reject keys the schema does not have, naming the closest valid ones; a key the schema renamed (its class's
    `RENAMED`: old key -> new key) is refused naming the new one."""
    fields = _field_types(schema)
    renamed = getattr(schema, "RENAMED", {})
    for key in node.keys():
        full_key = f"{prefix}{key}"
        if key not in fields and key in renamed:
            raise ConfigError(f"config key '{full_key}' in {source} is now '{prefix}{renamed[key]}'")
        if key not in fields:
            name, colon, value = str(key).partition(":")
            if colon and name in fields:  # {name:x} in YAML flow style is one key, "name:x"
                raise ConfigError(
                    f"config key '{prefix}{name}' in {source} is written '{key}': YAML needs a space "
                    f"after the colon ('{name}: {value}'; quote a value that has colons of its own)"
                )
            hint = did_you_mean(str(key), fields, prefix) or (
                f"valid keys here: {', '.join(repr(prefix + f) for f in fields)}"
            )
            raise ConfigError(f"unknown config key '{full_key}' in {source}; {hint}")
        child_type = _unwrap_optional(fields[key])
        try:
            child = node[key]
        except (ConfigKeyError, OmegaConfBaseException):
            continue  # an interpolation: checked when resolved
        if dataclasses.is_dataclass(child_type) and isinstance(child, DictConfig):
            _check_keys(child_type, child, f"{full_key}.", source)
        item_type = (typing.get_args(child_type) or [None])[0]
        if (
            typing.get_origin(child_type) is list
            and dataclasses.is_dataclass(item_type)
            and isinstance(child, ListConfig)
        ):
            for i, item in enumerate(child):  # e.g. rewards: a list of RewardConfig
                if isinstance(item, DictConfig):
                    _check_keys(item_type, item, f"{full_key}[{i}].", source)


def _refuse_nan(node: Any, key: str) -> None:
    """A NaN in any float of the config (`lr=nan`) is refused: no setting means "not a number"."""
    if isinstance(node, float) and math.isnan(node):
        raise ConfigError(f"config key '{key}' is nan: give a number")
    if isinstance(node, dict):
        for k, v in node.items():
            _refuse_nan(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            _refuse_nan(v, f"{key}[{i}]")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _expected_type(schema: type, full_key: str) -> str:
    tp: Any = schema
    for part in full_key.split("."):
        tp = _unwrap_optional(tp)
        if not dataclasses.is_dataclass(tp):
            return "?"
        tp = _field_types(tp).get(part, "?")
    return getattr(tp, "__name__", str(tp))


def _type_message(schema: type, e: ValidationError, source: str) -> str:
    key = e.full_key or "?"
    return (
        f"config key '{key}' in {source} expects {_expected_type(schema, key)}, "
        f"got {e.value!r} ({type(e.value).__name__})"
    )
