"""Named run configs and dotted command-line overrides (the parser of the config schema).

    cfg = configs.load_config("tiny")                           # configs/tiny.py
    cfg = apply_overrides(cfg, ["steps.margin=0.1", "rollout.temperature=1.0"])

:mod:`lopd_jax.settings.config` defines the schema (the :class:`~lopd_jax.settings.config.TrainConfig`
dataclass tree and its checks); this module parses ``dotted.key=value`` overrides to each field's type, and converts configs
to and from JSON dicts (``<workdir>/config.json``, :mod:`lopd_jax.settings.run_config`). Every
problem raises :class:`~lopd_jax.settings.errors.ConfigError` naming the key and the fix.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import json
import re
import types
import typing
from typing import Any, Literal, Sequence

from lopd_jax.settings.config import _DEFER_CROSS_CHECKS, TrainConfig, _matches, _type_name
from lopd_jax.settings.errors import ConfigError
from lopd_jax.settings.keys import is_inline, key_paths


# ----------------------------------------------------------------------------- overrides

_NONE = ("none", "null")
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _freeze(v: Any) -> Any:
    """JSON / literal lists -> tuples, recursively (for tuple-typed fields)."""
    return tuple(_freeze(x) for x in v) if isinstance(v, (list, tuple)) else v


def parse_value(text: str, tp: Any, key: str) -> Any:
    """``text`` parsed to type hint ``tp``; :class:`ConfigError` naming ``key`` if it does not fit."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    s = text.strip()
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and s.lower() in _NONE:
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return parse_value(s, a, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={text!r}: expected {' or '.join(_type_name(a) for a in args)}.")
    if origin is Literal:
        for choice in args:
            if s == str(choice) or (isinstance(choice, bool) and s.lower() == str(choice).lower()):
                return choice
        raise ConfigError(f"{key}={text!r}: choose one of {list(args)}.")
    if tp is bool:
        if s.lower() in _TRUE:
            return True
        if s.lower() in _FALSE:
            return False
        raise ConfigError(f"{key}={text!r}: expected a bool (true/false).")
    if tp is int:
        try:
            f = float(s)  # also accepts 1e3-style spellings of whole numbers
            if f.is_integer() and abs(f) < 2 ** 53:
                return int(f)
        except ValueError:
            pass
        raise ConfigError(f"{key}={text!r}: expected an int.")
    if tp is float:
        try:
            return float(s)
        except ValueError:
            raise ConfigError(f"{key}={text!r}: expected a float.") from None
    if tp is str:
        return text
    if origin is tuple or tp is tuple:
        if s.startswith(("(", "[")):
            items = _loose(s)
            if not isinstance(items, (list, tuple)):
                raise ConfigError(f"{key}={text!r}: expected a tuple.")
        else:
            items = [p.strip() for p in s.split(",") if p.strip()]
        if len(args) == 2 and args[1] is ... and args[0] in (int, float, bool, str):
            return tuple(_coerce(x, args[0], f"{key}[{i}]") for i, x in enumerate(items))
        return _freeze(items)
    if origin is dict or tp is dict:
        v = _loose(s)
        if not isinstance(v, dict):
            raise ConfigError(f"{key}={text!r}: expected a JSON object.")
        return v
    return _loose(s)


def _coerce(x: Any, tp: type, key: str) -> Any:
    """One tuple element (a string to parse, or an already-parsed literal) as ``tp``."""
    if isinstance(x, str) and tp is not str:
        return parse_value(x, tp, key)
    if not _matches(x, tp):
        raise ConfigError(f"{key}={x!r}: expected {_type_name(tp)}.")
    return float(x) if tp is float else x


def _loose(s: str) -> Any:
    """A literal if ``s`` reads as one (numbers, bools, lists, None), else the string."""
    if s.lower() in _TRUE[:1] + _FALSE[:1]:
        return s.lower() == "true"
    if s.lower() in _NONE:
        return None
    try:
        return json.loads(s)
    except json.JSONDecodeError:
        try:
            return ast.literal_eval(s)
        except (ValueError, SyntaxError):
            return s


def _dotted_fields(obj: Any, prefix: str = "") -> list[str]:
    """Every dotted field name under dataclass ``obj`` (sections and their fields)."""
    out = []
    for f in dataclasses.fields(obj):
        out.append(prefix + f.name)
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            out += _dotted_fields(v, f"{prefix}{f.name}.")
    return out


def _suggest(obj: Any, head: str) -> list[str]:
    """Dotted keys of ``obj`` the user may have meant by ``head``: fields of any section
    named ``head`` (``lopd_steps`` -> ``stages.lopd_steps``), then those with close names."""
    dotted = _dotted_fields(obj)
    exact = [d for d in dotted if d.rsplit(".", 1)[-1] == head]
    by_last = {}
    for d in dotted:
        by_last.setdefault(d.rsplit(".", 1)[-1], d)
    close = [by_last[n] for n in difflib.get_close_matches(head, list(by_last), n=3)]
    return list(dict.fromkeys(exact + close))[:3]


def _set(obj: Any, parts: list[str], text: str, key: str) -> Any:
    """A copy of dataclass ``obj`` with the dotted field ``parts`` set from ``text``."""
    paths = key_paths(type(obj))
    names = list(paths)
    head = parts[0]
    if head not in names:
        where = key[: len(key) - len(".".join(parts))].rstrip(".")
        # inside a section: its own close names; at the top: the full dotted key of any depth
        close = difflib.get_close_matches(head, names, n=3) if where else _suggest(obj, head)
        where = where or "the config"
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(f"unknown key {key!r}: {where} has no field {head!r}{hint} (fields: {names})")
    if len(paths[head]) > 1:  # a key of an inline settings object
        owner = paths[head][0]
        new = _set(getattr(obj, owner), parts, text, key)
        return dataclasses.replace(obj, **{owner: new})
    cur, tp = getattr(obj, head), typing.get_type_hints(type(obj))[head]
    if len(parts) == 1:
        if dataclasses.is_dataclass(cur):
            sub = list(key_paths(type(cur)))
            raise ConfigError(f"{key} is a section; set one of its fields, e.g. {key}.{sub[0]}=... (fields: {sub})")
        new = parse_value(text, tp, key)
    elif dataclasses.is_dataclass(cur):
        new = _set(cur, parts[1:], text, key)
    elif isinstance(cur, dict) and len(parts) == 2:
        new = {**cur, parts[1]: _loose(text.strip())}
    else:
        raise ConfigError(f"unknown key {key!r}: {head!r} is a {_type_name(tp)}, not a section.")
    try:
        return dataclasses.replace(obj, **{head: new})
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{key}={text!r}: {e}") from None


def apply_overrides(cfg: TrainConfig, overrides: Sequence[str]) -> TrainConfig:
    """``cfg`` with each ``"dotted.key=value"`` applied in order (a leading ``--`` is allowed).

    Values are parsed to the field's type: int, float, bool (true/false), str, None
    (``none``/``null`` for optional fields), tuples (``a,b,c`` or a Python/JSON literal),
    JSON objects for dict fields (``env.kwargs={"n": 4}``; or ``env.kwargs.n=4``), and
    Literal choices are checked.
    """
    token = _DEFER_CROSS_CHECKS.set(True)
    try:
        for item in overrides:
            body = item[2:] if item.startswith("--") else item
            if "=" not in body:
                raise ConfigError(f"override {item!r} must look like dotted.key=value (e.g. steps.margin=0.1).")
            key, text = body.split("=", 1)
            key = key.strip()
            if not key or any(not p for p in key.split(".")):
                raise ConfigError(f"override {item!r} has an empty key part.")
            cfg = _set(cfg, key.split("."), text, key)
    finally:
        _DEFER_CROSS_CHECKS.reset(token)
    return from_dict(to_dict(cfg))  # rebuilt with every check, cross-field ones included


# ----------------------------------------------------------------------------- (de)serialization


def _plain(obj: Any) -> Any:
    """A dataclass tree as nested dicts keyed by its sections' keys (inline objects merged)."""
    if not dataclasses.is_dataclass(obj):
        return obj
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        v = _plain(getattr(obj, f.name))
        if is_inline(f):
            out.update(v)
        else:
            out[f.name] = v
    return out


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-serializable nested dict of a dataclass tree (tuples become lists)."""
    return json.loads(json.dumps(_plain(cfg)))


def _build(cls: type, data: Any, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected an object, got {type(data).__name__}.")
    hints, paths = typing.get_type_hints(cls), key_paths(cls)
    unknown = sorted(set(data) - set(paths))
    if unknown:
        raise ConfigError(f"unknown keys {[prefix + k for k in unknown]} in saved config (fields: {sorted(paths)}).")
    inline_data: dict[str, dict[str, Any]] = {}
    for name in [k for k in data if len(paths[k]) > 1]:  # keys of inline objects, built below
        inline_data.setdefault(paths[name][0], {})[name] = data[name]
    data = {k: v for k, v in data.items() if len(paths[k]) == 1}
    kwargs = {owner: _build(hints[owner], sub, prefix) for owner, sub in inline_data.items()}
    for name, value in data.items():
        tp = hints[name]
        sub = [a for a in (typing.get_args(tp) or (tp,)) if dataclasses.is_dataclass(a)]
        if sub and isinstance(value, dict):
            kwargs[name] = _build(sub[0], value, f"{prefix}{name}.")
        elif isinstance(value, list):
            kwargs[name] = _freeze(value)
        else:
            kwargs[name] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(f"{prefix or 'config'}: {e}") from None


def from_dict(data: dict[str, Any]) -> TrainConfig:
    """Inverse of :func:`to_dict` (missing keys take defaults; unknown keys are errors)."""
    return _build(TrainConfig, data, "")


__all__ = ["parse_value", "apply_overrides", "to_dict", "from_dict"]
