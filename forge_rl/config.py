"""Configs: YAML files plus `key=value` overrides, merged into typed dataclasses.

Each app declares its config as a dataclass tree (required fields have no default). Then

    cfg = load_config(GRPOConfig, "configs/grpo/tiny.yaml", ["trainer.lr=1e-4", "group_size=8"])

reads the file, applies the overrides (OmegaConf dotlist syntax), resolves interpolations such
as `${group_size}` and returns a `GRPOConfig` instance. Every mistake is a `ConfigError` naming
the key and where it came from: an unknown key (with the closest valid keys), a value of the
wrong type (with the expected type) or a missing required key. A key inside a list's entry is named with its
index, `rewards[0].weight`, and an override sets it so: `rewards[0].weight=0.5` (to add an entry, give the list).

Fields typed `dict[str, Any]` accept any keys: they pass options through to a library under its
own names (vLLM engine arguments, sampling parameters). A key a config class renamed (its `RENAMED`) is refused
naming the new key.
"""

import argparse
import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar
from collections.abc import Sequence

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf, ValueNode
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
        merged = _merge_layer(schema, merged, layer, source)
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
        raise ConfigError(_refusal(schema, e, "an interpolation")) from None
    except ValueError as e:  # a config dataclass's own check (__post_init__), which names its key
        raise ConfigError(str(e)) from None


def _merge_layer(schema: type, merged: DictConfig, layer: DictConfig, source: str) -> DictConfig:
    """`merged` with `layer` merged in; a value of the wrong type is refused naming its key and the type expected."""
    updates = _list_entry_updates(merged, layer, source)
    try:
        merged = OmegaConf.merge(merged, layer)
    except ValidationError as e:
        raise ConfigError(_refusal(schema, e, source, layer)) from None
    except TypeError as e:  # OmegaConf cannot merge a mapping into a list or a list into a mapping
        misfit = _misfit(schema, layer, "")
        if misfit is None:
            raise ConfigError(_container_message(merged, layer, source)) from None
        raise ConfigError(_type_message(schema, *misfit, source, e)) from None
    except OmegaConfBaseException as e:  # what the key checks above do not foresee
        raise ConfigError(f"{source}: {str(e).splitlines()[0]}") from None
    for key, value in updates:
        try:
            OmegaConf.update(merged, key, value, merge=True)
        except OmegaConfBaseException as e:  # ValidationError, or ConfigTypeError: a list for a mapping or back
            raise ConfigError(_refusal(schema, e, source, value, key)) from None
        for missing in _missing_keys(value) if isinstance(value, DictConfig) else []:
            OmegaConf.update(merged, f"{key}.{missing}", "???", merge=False)
    for key in _missing_keys(layer):  # merge keeps the default under "???"; the file means "required"
        OmegaConf.update(merged, key, "???", merge=False)
    return merged


def _list_entry_updates(merged: DictConfig, layer: DictConfig, source: str, prefix: str = "") -> list[tuple[str, Any]]:
    """The keys of `layer` that set a field of one entry of a list, `rewards[0].weight=0.5` (OmegaConf reads the key
    as a mapping, {"0": {"weight": 0.5}}, which a merge would refuse against the list): taken out of `layer`, as
    (key, value) pairs to set in place, each key with its index (`rewards[0]`)."""
    updates = []
    for key, value in list(layer.items_ex(resolve=False)):
        if not isinstance(value, DictConfig) or not value:
            continue
        try:
            current = merged.get(key)
        except OmegaConfBaseException:  # "???" or an interpolation that does not resolve
            continue
        full_key = f"{prefix}{key}"
        if isinstance(current, DictConfig):
            updates += _list_entry_updates(current, value, source, f"{full_key}.")
        elif isinstance(current, ListConfig) and all(str(index).isdigit() for index in value.keys()):
            for index, entry in value.items_ex(resolve=False):
                _check_index(current, full_key, int(index), source)
                updates.append((f"{full_key}[{index}]", entry))
            del layer[key]
    return updates


def _check_index(entries: ListConfig, key: str, index: int, source: str) -> None:
    if index >= len(entries):
        has = f"has {len(entries)}, {key}[0] to {key}[{len(entries) - 1}]" if entries else "is empty"
        raise ConfigError(
            f"config key '{key}[{index}]' in {source}: no such entry ({key} {has}); to add one, give the whole "
            f"list: {key}=[...]"
        )


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
        try:
            child = node[key]
        except (ConfigKeyError, OmegaConfBaseException):
            continue  # an interpolation: checked when resolved
        _check_child_keys(_unwrap_optional(fields[key]), child, full_key, source)


def _check_child_keys(child_type: Any, child: Any, full_key: str, source: str) -> None:
    """The keys under `full_key`: of its section, or of each entry of its list of sections (`rewards`), given whole
    (`rewards=[{...}]`) or one at a time (`rewards[0].weight=0.5`, read as {"0": {"weight": 0.5}})."""
    if dataclasses.is_dataclass(child_type) and isinstance(child, DictConfig):
        _check_keys(child_type, child, f"{full_key}.", source)
    item_type = (typing.get_args(child_type) or [None])[0]
    if typing.get_origin(child_type) is not list or not dataclasses.is_dataclass(item_type):
        return
    if isinstance(child, ListConfig):  # e.g. rewards: a list of RewardConfig
        entries = list(enumerate(child))
    elif isinstance(child, DictConfig):
        entries = [(index, entry) for index, entry in child.items_ex(resolve=False) if str(index).isdigit()]
    else:
        return
    for index, entry in entries:
        if isinstance(entry, DictConfig):
            _check_keys(item_type, entry, f"{full_key}[{index}].", source)


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


def _key_type(schema: type, full_key: str) -> Any:
    """The schema's type at `full_key` ("rewards[0].weight" -> float), or None where the schema does not say."""
    tp: Any = schema
    for index, name in re.findall(r"\[(\d+)\]|([^.\[\]]+)", full_key):
        tp = _unwrap_optional(tp)
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if index and origin is list:
            tp = args[0] if args else Any
        elif name and dataclasses.is_dataclass(tp):
            tp = _field_types(tp).get(name)
        elif name and origin is dict:
            tp = args[1] if len(args) == 2 else Any
        else:
            return None
        if tp is None:
            return None
    return tp


def _type_name(tp: Any) -> str:
    """A schema type as a message names it: int, float, str, bool, a mapping, a list of int, bool or str."""
    tp = _unwrap_optional(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp) or tp is dict or origin is dict:
        return "a mapping"
    if tp is list or origin is list:
        item = _type_name(args[0]) if args and args[0] is not Any else None
        return "a list" if item is None else "a list of mappings" if item == "a mapping" else f"a list of {item}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def _misfit(tp: Any, value: Any, key: str) -> tuple[str, Any] | None:
    """The first key at or under `key` whose `value` (as a layer gives it) does not fit the schema's type `tp`: a
    scalar for a section or a list, a list for a mapping or back, or a field of a list's entry of the wrong type. It
    names what OmegaConf's errors leave unnamed: a merge names an entry's field without the list's path (`weight`
    for `rewards[0].weight`), and a scalar given for a section with no key at all."""
    tp = _unwrap_optional(tp)
    origin = typing.get_origin(tp)
    if value is None or (isinstance(value, str) and (value == "???" or "${" in value)) or tp in (None, Any):
        return None  # null for a required section: OmegaConf names it; interpolations: checked when resolved
    if dataclasses.is_dataclass(tp) or tp is dict or origin is dict:
        if not isinstance(value, DictConfig):
            return key, value
        fields = _field_types(tp) if dataclasses.is_dataclass(tp) else {}
        for k, v in value.items_ex(resolve=False):
            found = _misfit(fields.get(k, Any), v, f"{key}.{k}" if key else str(k))
            if found is not None:
                return found
        return None
    if tp is list or origin is list:
        return _list_misfit((typing.get_args(tp) or [Any])[0], value, key)
    if isinstance(value, (DictConfig, ListConfig)):
        return key, value  # a mapping or a list for a number, a string, a flag
    return None


def _list_misfit(item_type: Any, value: Any, key: str) -> tuple[str, Any] | None:
    """_misfit for a list of `item_type`; an entry that is a section is also merged alone into its schema, which
    finds its fields of the wrong type (`rewards[0].weight=abc`)."""
    if not isinstance(value, ListConfig):
        return key, value
    for i, entry in enumerate(value._iter_ex(resolve=False)):
        found = _misfit(item_type, entry, f"{key}[{i}]")
        if found is None and dataclasses.is_dataclass(item_type) and isinstance(entry, DictConfig):
            try:
                OmegaConf.merge(OmegaConf.structured(item_type), entry)
            except ValidationError as e:
                found = (f"{key}[{i}].{e.full_key}", e.value) if e.full_key else None
        if found is not None:
            return found
    return None


def _refusal(schema: type, e: OmegaConfBaseException, source: str, value: Any = None, key: str = "") -> str:
    """The line for OmegaConf's refusal `e` of `value` (a layer, or what `key` was set to) in `schema`."""
    misfit = None
    if value is not None:
        misfit = _misfit(_key_type(schema, key) if key else schema, value, key)
    if misfit is None and isinstance(e, ValidationError) and e.full_key:
        misfit = e.full_key, e.value
    if misfit is None:
        return f"{source}: {str(e).splitlines()[0]}"
    return _type_message(schema, *misfit, source, e)


def _type_message(schema: type, key: str, value: Any, source: str, e: BaseException) -> str:
    """ "config key 'rewards[0].weight' in SOURCE expects float, got 'abc' (str)"."""
    if isinstance(value, ValueNode):
        value = value._value()
    got = "null" if value is None else _described(value)
    tp = _key_type(schema, key)
    if tp is None:  # a key the schema does not type (inside a mapping of options): OmegaConf's own words
        return f"config key '{key}' in {source}: {str(e).splitlines()[0]}"
    return f"config key '{key}' in {source} expects {_type_name(tp)}, got {got}{_moved_hint(schema, key)}"


def _moved_hint(schema: type, full_key: str) -> str:
    """What a key that changed its meaning used to be (its class's `MEANING_CHANGED`: key -> hint), for a value
    of the old kind: `trainer.loss: sft` once chose the objective and is now the loss's section."""
    parent, _, leaf = full_key.rpartition(".")
    owner = _unwrap_optional(_key_type(schema, parent) if parent else schema)
    hint = getattr(owner, "MEANING_CHANGED", {}).get(leaf) if dataclasses.is_dataclass(owner) else None
    return f" ({hint})" if hint else ""


def _described(value: Any) -> str:
    if isinstance(value, DictConfig):
        return "a mapping"
    return "a list" if isinstance(value, ListConfig) else f"{value!r} ({type(value).__name__})"
