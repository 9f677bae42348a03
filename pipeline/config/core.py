"""Typed configs from plain dicts: strict keys, type checks, field docs, `key.sub=value` overrides.

A config is a tree of dataclasses. Each field carries its documentation as a string literal right
under it (read with `ast`, so `lockstep config --help`, the README option table and the tests use the
same words). Loading is strict: an unknown key, a wrong type or a missing section raises
`ConfigError` with the dotted path and a suggestion. Tagged unions are dataclass fields whose type is
a `Union` of dataclasses with a `type: Literal[...]` field; `type` picks the member.

This module imports nothing heavy (no torch), so config checks are instant.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import textwrap
import types
import typing
from typing import Any, Literal, Union, get_args, get_origin

import yaml

from pipeline.errors import ConfigError

_NONE_TYPE = type(None)


# --------------------------------------------------------------------------------------------------
# Field documentation


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Map field name -> the docstring written under it in the class body (empty if none)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
        for prev, node in zip(body, body[1:]):
            if (
                isinstance(prev, ast.AnnAssign)
                and isinstance(prev.target, ast.Name)
                and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


# --------------------------------------------------------------------------------------------------
# Type checking and conversion


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _union_members(tp: Any) -> tuple[Any, ...] | None:
    if get_origin(tp) in (Union, types.UnionType):
        return get_args(tp)
    return None


def _tag_of(cls: type) -> tuple[str, ...]:
    """The `type` literal values of a tagged-union member."""
    hint = _hints(cls).get("type")
    if hint is None or get_origin(hint) is not Literal:
        raise TypeError(f"{cls.__name__} is in a tagged union but has no `type: Literal[...]` field")
    return get_args(hint)


def describe_type(tp: Any) -> str:
    """A short human name for a type annotation, used in error messages and docs."""
    if tp is Any:
        return "any"
    members = _union_members(tp)
    if members is not None:
        return " | ".join(describe_type(m) for m in members)
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list[{describe_type(args[0])}]" if args else "list"
    if origin is dict:
        k, v = get_args(tp) or (Any, Any)
        return f"dict[{describe_type(k)}, {describe_type(v)}]"
    if tp is _NONE_TYPE:
        return "null"
    if _is_dataclass_type(tp):
        return "section"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against annotation `tp` and build dataclasses; raise ConfigError on mismatch."""
    if tp is Any:
        return value
    members = _union_members(tp)
    if members is not None:
        if value is None and _NONE_TYPE in members:
            return None
        non_none = [m for m in members if m is not _NONE_TYPE]
        if all(_is_dataclass_type(m) for m in non_none) and len(non_none) > 1:
            return _convert_tagged(value, non_none, path)
        errors = []
        for member in non_none:
            try:
                return _convert(value, member, path)
            except ConfigError as e:
                errors.append(e)
        sections = [e for m, e in zip(non_none, errors) if _is_dataclass_type(m)]
        if isinstance(value, dict) and len(sections) == 1:  # a mapping for `str | Section`: the section's own error
            raise sections[0]
        raise ConfigError(f"{path}: expected {describe_type(tp)}, got {value!r}")
    origin = get_origin(tp)
    if origin is Literal:
        allowed = get_args(tp)
        if value not in allowed:
            hint = difflib.get_close_matches(str(value), [str(a) for a in allowed], n=1)
            extra = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{path}: {value!r} is not one of {', '.join(map(repr, allowed))}{extra}")
        return value
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        (item_tp,) = get_args(tp)[:1] or (Any,)
        items = [_convert(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        _, v_tp = get_args(tp) or (Any, Any)
        return {str(k): _convert(v, v_tp, f"{path}.{k}") for k, v in value.items()}
    if _is_dataclass_type(tp):
        return from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-3` (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config annotation {tp!r} at {path}")


def _convert_tagged(value: Any, members: list[type], path: str) -> Any:
    if dataclasses.is_dataclass(value) and type(value) in members:
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a section with a `type` key, got {value!r}")
    by_tag = {tag: m for m in members for tag in _tag_of(m)}
    tag = value.get("type", _tag_of(members[0])[0])  # no `type`: the first member (the default)
    if tag not in by_tag:
        hint = difflib.get_close_matches(str(tag), list(by_tag), n=1)
        extra = f" (did you mean {hint[0]!r}?)" if hint else ""
        raise ConfigError(f"{path}.type: {tag!r} is not one of {', '.join(map(repr, by_tag))}{extra}")
    return from_dict(by_tag[tag], value, path)


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a mapping, strictly. Missing keys take the field defaults."""
    if dataclasses.is_dataclass(data) and isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1)
            extra = f" (did you mean {(path + '.' if path else '') + hint[0]!r}?)" if hint else ""
            raise ConfigError(f"unknown config key {sub!r}{extra}")
        kwargs[key] = _convert(value, hints[key], sub)
    for name, f in fields.items():
        if name in kwargs:
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{path + '.' if path else ''}{name}: required, no default")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if path and not str(e).startswith(path):
            raise ConfigError(f"{path}: {e}") from None
        raise


def to_dict(obj: Any) -> Any:
    """The inverse of `from_dict`: plain dicts/lists/scalars, ready for YAML."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# --------------------------------------------------------------------------------------------------
# Overrides


def parse_value(text: str) -> Any:
    """Parse an override's right-hand side as YAML (so `3`, `1e-3`, `true`, `[1,2]`, `null` work)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def leaf_paths(cls: type, prefix: str = "") -> dict[str, str]:
    """Map every leaf field name to its dotted path (used for the `rollout_batch_size=8` shortcut).

    Names that occur in more than one section map to "" (ambiguous: the dotted path is required).
    Tagged-union sections contribute the fields of all their members.
    """
    out: dict[str, str] = {}

    def visit(c: type, pre: str) -> None:
        for f in dataclasses.fields(c):
            tp = _hints(c)[f.name]
            dotted = f"{pre}{f.name}"
            members = _union_members(tp) or (tp,)
            sections = [m for m in members if _is_dataclass_type(m)]
            if sections:
                for m in sections:
                    visit(m, dotted + ".")
                continue
            out[f.name] = "" if f.name in out and out[f.name] != dotted else dotted

    visit(cls, prefix)
    return out


def _member_type(tp: Any, name: str) -> Any:
    """The annotation of `name` one level below annotation `tp`: a section's field or a mapping's value
    (Any when `tp` has no such member: the override's own checks name it later)."""
    for member in _union_members(tp) or (tp,):
        if _is_dataclass_type(member) and name in _hints(member):
            return _hints(member)[name]
        if get_origin(member) is dict:
            return (get_args(member) or (Any, Any))[1]
    return Any


def _shorthand_section(tp: Any) -> type | None:
    """The section of a `str | Section` annotation, whose bare string stands for the section's first
    field (eval.datasets: `test: x.jsonl` is `test: {path: x.jsonl}`); None for other annotations."""
    members = _union_members(tp) or (tp,)
    sections = [m for m in members if _is_dataclass_type(m)]
    return sections[0] if str in members and len(sections) == 1 else None


def apply_overrides(cls: type, data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` (or unique-leaf `c=value`) overrides to a raw config mapping."""
    data = dict(data)
    leaves = leaf_paths(cls)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (for example rollout.rollout_batch_size=8)")
        key, text = item.split("=", 1)
        key = key.strip().lstrip("-").replace("-", "_")
        top = {f.name for f in dataclasses.fields(cls)}
        if "." not in key and key not in top:
            if key not in leaves:
                names = [n for n in leaves if leaves[n]] + list(top)
                hint = difflib.get_close_matches(key, names, n=1)
                extra = f" (did you mean {leaves.get(hint[0]) or hint[0]!r}?)" if hint else ""
                raise ConfigError(f"unknown config key {key!r}{extra}")
            if leaves[key] == "":
                raise ConfigError(f"override {key!r} is ambiguous: name its section (section.{key}=...)")
            key = leaves[key]
        parts = key.split(".")
        node, tp = data, cls
        for part in parts[:-1]:
            tp = _member_type(tp, part)
            child = node.get(part)
            section = _shorthand_section(tp)
            if isinstance(child, str) and section is not None:  # `test: x.jsonl`, then test.rm_type=...
                child = {dataclasses.fields(section)[0].name: child}
            child = dict(child) if isinstance(child, dict) else {}
            node[part] = child
            node = child
        node[parts[-1]] = parse_value(text)
    return data


def load_yaml(path: str) -> dict:
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path!r} is a directory: give a YAML file, e.g. configs/tiny.yaml") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path!r} is not UTF-8 text (byte {e.start}): a binary file, or another"
                          " encoding?") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"config file {path!r}{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r}: top level must be a mapping")
    return data


def option_table(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, doc) for every field, sections expanded; for docs and --help."""
    rows = []
    defaults = cls()
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        dotted = f"{prefix}{f.name}"
        value = getattr(defaults, f.name)
        members = _union_members(tp) or (tp,)
        sections = [m for m in members if _is_dataclass_type(m)]
        if sections:
            if len(sections) == 1:
                rows.extend(option_table(sections[0], dotted + "."))
            else:
                tags = ", ".join(t for m in sections for t in _tag_of(m))
                rows.append((dotted + ".type", tags, repr(getattr(value, "type", None)), docs.get(f.name, "")))
                for m in sections:
                    for row in option_table(m, dotted + "."):
                        if not row[0].endswith(".type"):
                            tag = "/".join(_tag_of(m))
                            rows.append((row[0], row[1], row[2], f"[{tag}] {row[3]}"))
            continue
        rows.append((dotted, describe_type(tp), repr(value), docs.get(f.name, "")))
    return rows
