"""Typed configuration: dataclasses composed from YAML, with ``key.sub=value`` overrides.

Each component owns a ``@dataclass`` config (``PrivacyConfig`` in ``dptrain.privacy.config``,
``OptimConfig`` in ``dptrain.optim.config``, ...). ``RunConfig`` composes them. This module only
knows how to turn nested dicts into those dataclasses and back, strictly:

- an unknown key is an error naming its full dotted path (``privacy.epslion``);
- a value of the wrong type is an error naming the field and the expected type;
- range checks live in each config's ``validate()`` and raise :class:`ConfigError` too.

``ConfigError`` is what the command line turns into one line on stderr and exit status 2.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import yaml


class ConfigError(ValueError):
    """A user-facing configuration mistake; ``field`` is the dotted path of the culprit."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        #: raised alike on every rank of a run (a verdict the ranks share): ``dptrain`` prints
        #: it on rank 0 only, not once per rank (:func:`said_by_rank_0`)
        self.every_rank = False
        super().__init__(f"{field}: {message}" if field else message)


def said_by_rank_0(error: ConfigError) -> ConfigError:
    """``error``, marked as raised alike on every rank: the CLI prints it on rank 0 alone."""
    error.every_rank = True
    return error


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, tuple):
        args = get_args(tp)
        return f"list of {_type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def shown(value: Any) -> str:
    """``value`` as a config file would write it, for messages: null, true, false (Python's
    None, True and False mean nothing to a user of YAML); a string in YAML's single quotes,
    its backslashes as written (repr doubles those of a regex; a string with a control
    character: repr); anything else as repr."""
    if value is None or isinstance(value, bool):
        return {None: "null", True: "true", False: "false"}[value]
    if isinstance(value, str):  # (a control character: JSON's escapes, YAML's double quotes)
        return ("'" + value.replace("'", "''") + "'" if value.isprintable()
                else json.dumps(value))
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(shown(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {shown(v)}" for k, v in value.items()) + "}"
    return repr(value)


def parse_number(text: str) -> float | None:
    """``text`` as a float, ``1/84122`` included (delta is often written this way); None if it
    is neither."""
    number = _parse_fraction(text)
    if number is None:
        try:
            number = float(text)
        except ValueError:
            pass
    return number


def _parse_fraction(value: str) -> float | None:
    """Accept ``1/84122`` as a float (delta is often written this way)."""
    if isinstance(value, str) and value.count("/") == 1:
        num, den = value.split("/")
        try:
            return float(num) / float(den)
        except (ValueError, ZeroDivisionError):
            return None
    return None


def _convert(value: Any, tp: Any, path: str) -> Any:
    """Convert ``value`` (parsed YAML) to type ``tp`` or raise ConfigError naming ``path``."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(path, f"must not be null (expected {_type_name(tp)})")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as e:
                errors.append(e)
        if len(errors) == 1:  # X | None: X's own message (a range, not just "expected X")
            raise errors[0]
        raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigError(path, f"must be one of {_type_name(tp)}, got {value!r}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping for {tp.__name__}, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        (elem,) = get_args(tp)[:1] or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(path, f"expected a list, got {value!r}")
        return [_convert(v, elem, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(path, f"expected a mapping, got {value!r}")
        kt, vt = get_args(tp) or (Any, Any)
        return {_convert(k, kt, path): _convert(v, vt, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(path, f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ConfigError(path, f"expected an integer, got {value!r}")
        # every integer meets int64 (torch sizes, numpy, the C long of set_num_threads)
        if not -2**63 <= value < 2**63:
            raise ConfigError(path, f"{value!r} is beyond int64's range (9.2e18)")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(path, f"expected a number, got {value!r}")
        number = None
        if isinstance(value, (int, float)):
            try:
                number = float(value)
            except OverflowError:  # an integer of more than 308 digits
                raise ConfigError(path, f"{value!r} is beyond float32's range (3.4e38)") from None
        elif isinstance(value, str):
            number = parse_number(value)
        if number is None:
            raise ConfigError(path, f"expected a number, got {value!r}")
        # every number meets float32 tensors (lr 1e300 was a RuntimeError in the first step);
        # inf and nan are left to each field's own check and message
        if math.isfinite(number) and abs(number) > FLOAT32_MAX:
            raise ConfigError(path, f"{value!r} is beyond float32's range (3.4e38)")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(path, f"expected a string, got {value!r}")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(path, f"expected {_type_name(tp)}, got {value!r}")


FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
"""float32's largest number and smallest normal one: every config number meets float32 tensors."""


def from_dict(cls: type, data: dict, path: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``; unknown keys and bad types are ConfigErrors."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        sub = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise ConfigError(sub, f"unknown key (known keys of {path or 'the config'}: "
                                   f"{', '.join(sorted(fields))})")
        try:
            kwargs[key] = _convert(value, hints[key], sub)
        except ConfigError as e:
            raise _with_hint(e, cls, key, value) from None
    for name, f in fields.items():  # a field without a default must be given
        if (name not in kwargs and f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING):
            raise ConfigError(f"{path}.{name}" if path else name, "required, but not given")
    obj = cls(**kwargs)
    return obj


def _with_hint(error: ConfigError, cls: type, key: str, value: Any) -> ConfigError:
    """``error`` with what ``cls.value_hint(key, value)`` says the user may have meant (a
    config class may define it for names users bring from papers and other tools)."""
    hint = getattr(cls, "value_hint", None)
    said = hint(key, value) if hint is not None and error.field.split(".")[-1] == key else None
    if not said:
        return error
    return ConfigError(error.field, f"{error.message}; {said}")


def to_dict(obj: Any) -> Any:
    """Plain-data form of a config (for YAML/JSON output and checkpoints)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


NAME_MAX, PATH_MAX = 255, 4095
"""The longest file name and path (bytes) the checks accept: Linux's and macOS' limits."""


def check_path_name(field: str, value: str | None) -> None:
    """A path the operating system would refuse by its length is a ConfigError naming
    ``field`` (``Path.is_file`` and its kin raise ``OSError`` "File name too long" for it,
    where a missing file gives False)."""
    if not value:
        return
    if "{" in value:  # a shard pattern (webdataset): the names it stands for are the paths
        import itertools

        from braceexpand import braceexpand

        try:
            names = list(itertools.islice(braceexpand(value), 1000))
        except Exception:  # noqa: BLE001 -- not a pattern after all: the text is the path
            names = [value]
    else:
        names = [value]
    for name in names:
        encoded = os.fsencode(name)
        part = max(encoded.split(b"/"), key=len)
        if len(part) > NAME_MAX or len(encoded) > PATH_MAX:
            what = (f"a name of {len(part)} bytes (at most {NAME_MAX})"
                    if len(part) > NAME_MAX else f"{len(encoded)} bytes (at most {PATH_MAX})")
            raise ConfigError(field, f"is not a usable path: {what}; it starts {name[:60]!r}")


def _is_path_field(name: str) -> bool:
    return name == "path" or name.endswith(("_path", "_file", "_dir"))


def _scalar_fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` already has the scalar type ``hint`` names (bool, int, float, str,
    optionally | None); True for every other kind of hint (lists, mappings, dataclasses)."""
    args = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    if value is None:
        return type(None) in args or not any(a in (bool, int, float, str) for a in args)
    kinds = [a for a in args if a is not type(None)]
    if not kinds or any(a not in (bool, int, float, str) for a in kinds):
        return True  # (not a plain scalar hint: from_dict's conversion and validate() check it)
    for a in kinds:
        if a is bool and isinstance(value, bool):
            return True
        if a is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if a is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
        if a is str and isinstance(value, str):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def validate_tree(obj: Any, path: str = "") -> None:
    """Call ``validate()`` on every nested config, children first, prefixing field paths;
    path fields (``path``, ``*_path``, ``*_file``, ``*_dir``) are first checked by
    :func:`check_path_name`."""
    if not dataclasses.is_dataclass(obj):
        return
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        sub = f"{path}.{f.name}" if path else f.name
        hint = hints.get(f.name)
        # a config built in Python skips from_dict's conversion: a name outside its Literal
        # (OptimConfig(name="foo"): a KeyError later; filter convention "foo": read as
        # im_paper) is refused here too
        if get_origin(hint) is Literal and value not in get_args(hint):
            raise _with_hint(ConfigError(sub, f"must be one of {_type_name(hint)}, got "
                                              f"{value!r}"), type(obj), f.name, value)
        if not _scalar_fits(value, hint):  # (PrivacyConfig(steps=2.5) passed validate())
            raise ConfigError(sub, f"expected {_type_name(hint)}, got {value!r}")
        if _is_path_field(f.name) and isinstance(value, str):
            check_path_name(sub, value)
        if dataclasses.is_dataclass(value):
            validate_tree(value, sub)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                validate_tree(v, f"{sub}[{i}]")
    validate = getattr(obj, "validate", None)
    if validate is not None:
        try:
            validate()
        except ConfigError as e:
            if path and not e.field.startswith(path + "."):
                raise ConfigError(f"{path}.{e.field}" if e.field else path, e.message) from None
            raise


def _defaults(obj: Any) -> dict[str, Any]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(obj)}


def unused_fields(obj: Any) -> dict[str, tuple[str, Any, tuple]]:
    """The fields of ``obj`` that its kind does not read, each with (label, kind, the kinds that
    read it). ``obj.applicability()`` lists ``(label, kind, {field: kinds that read it})``:
    ``label`` names what ``kind`` is in messages (``model.name``), e.g. the gpt2-only fields of
    a ModelConfig."""
    out: dict[str, tuple[str, Any, tuple]] = {}
    for label, kind, applies in obj.applicability():  # the first, most basic, row that applies
        for name, kinds in applies.items():
            if kind not in kinds:
                out.setdefault(name, (label, kind, kinds))
    return out


def refuse_unused(obj: Any) -> None:
    """Refuse a field of ``obj`` that is set away from its default while its kind does not read
    it (:func:`unused_fields`): the run would silently ignore it, e.g. a DiSK gain without the
    DiSK filter or an n_layer for a timm model."""
    defaults = _defaults(obj)
    for name, (label, kind, kinds) in unused_fields(obj).items():
        if getattr(obj, name) != defaults[name]:
            raise ConfigError(name, f"applies only with {label} {' or '.join(map(str, kinds))} "
                                    f"({label} is {kind}), so it would be ignored; remove it or "
                                    f"set it back to its default, {_yaml_scalar(defaults[name])}")


def reset_unused(obj: Any) -> None:
    """Set the fields that the kinds of ``obj`` and of every config nested in it do not read
    back to their defaults: for a config written before such settings were refused (a
    checkpoint's), whose run ignored them."""
    for f in dataclasses.fields(obj):
        if dataclasses.is_dataclass(getattr(obj, f.name)):
            reset_unused(getattr(obj, f.name))
    if hasattr(obj, "applicability"):
        defaults = _defaults(obj)
        for name in unused_fields(obj):
            setattr(obj, name, defaults[name])


def _yaml_scalar(value: Any) -> str:
    """A default as it would be written in an override: ``null``, ``true``, ``[16, 32]``."""
    return yaml.safe_dump(value, default_flow_style=True).removesuffix("\n...\n").strip()


_INT_TAG = "tag:yaml.org,2002:int"
_FLOAT_TAG = "tag:yaml.org,2002:float"
_MERGE_TAG = "tag:yaml.org,2002:merge"
# YAML 1.1 reads these as base-8 and base-60 numbers: ``010`` is 8 and ``1:30`` is 90
_OCTAL = re.compile(r"[-+]?0[0-9_]+$")
_SEXAGESIMAL = re.compile(r"[-+]?[0-9][0-9_]*(:[0-5]?[0-9])+(\.[0-9_]*)?$")


def _yaml_error_line(e: yaml.YAMLError) -> str:
    """PyYAML's multi-line message as one line: the problem and where it is."""
    problem = getattr(e, "problem", None) or getattr(e, "context", None) or str(e)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    text = " ".join(str(problem).split())
    if mark is not None:
        text += f" (line {mark.line + 1}, column {mark.column + 1})"
    return text


def _check_nodes(loader: yaml.SafeLoader, node: yaml.Node, path: str, seen: set,
                 where: bool) -> None:
    """Refuse what YAML accepts silently: a key given twice in one mapping (the last would
    win) and integers written with a leading zero or colons (read as base 8 or base 60)."""
    if id(node) in seen:
        return
    seen.add(id(node))
    at = f" (line {node.start_mark.line + 1})" if where else ""
    if isinstance(node, yaml.ScalarNode):
        if node.tag in (_INT_TAG, _FLOAT_TAG) and node.style is None and (
                _OCTAL.match(node.value) or _SEXAGESIMAL.match(node.value)):
            raise ConfigError(path or "config",
                              f"ambiguous number {node.value!r}{at}: YAML reads a "
                              f"leading 0 as octal and colons as base 60; write it without "
                              f"the leading zeros, or quote it for a string")
        return
    if isinstance(node, yaml.SequenceNode):
        for i, child in enumerate(node.value):
            _check_nodes(loader, child, f"{path}[{i}]", seen, where)
        return
    if isinstance(node, yaml.MappingNode):
        first_line: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                _check_nodes(loader, value_node, path, seen, where)
                continue
            key = loader.construct_object(key_node, deep=True)
            sub = f"{path}.{key}" if path else str(key)
            try:
                if key in first_line:
                    lines = (f" (lines {first_line[key]} and {key_node.start_mark.line + 1})"
                             if where else "")
                    raise ConfigError(sub, f"duplicate key{lines}: YAML would silently keep "
                                           f"the last one; remove one of them")
                first_line[key] = key_node.start_mark.line + 1
            except TypeError:  # an unhashable key: the constructor reports it
                pass
            _check_nodes(loader, value_node, sub, seen, where)


def safe_load(text: str, path: str = "") -> Any:
    """``yaml.safe_load`` that refuses duplicate keys and octal/base-60 looking numbers with a
    ConfigError naming the dotted path (prefixed by ``path``: an override's key, whose value
    is one line, so no line numbers are given then)."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(loader, node, path, set(), where=not path)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def parse_override(text: str) -> tuple[list[str], Any]:
    """``privacy.epsilon=3`` -> (["privacy", "epsilon"], 3); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(text, "an override must look like key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(key or text, "an override must look like key.sub=value")
    if not raw.strip():  # `key=` meant null, silently: for some keys the opposite of intended
        raise ConfigError(key, "has no value (write key=null for null, key='' for an empty "
                               "string)")
    try:
        value = safe_load(raw, key)
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def apply_override(data: dict, keys: list[str], value: Any) -> None:
    node = data
    for k in keys[:-1]:
        nxt = node.get(k)
        if nxt is None:
            nxt = node[k] = {}
        if not isinstance(nxt, dict):
            raise ConfigError(".".join(keys), f"'{k}' is not a section")
        node = nxt
    node[keys[-1]] = value


def require_file(field: str, path: str | Path) -> None:
    """ConfigError naming ``field`` unless ``path`` is a file: "file not found", or, for a
    directory, that it is one (a directory given for a file was reported as not found)."""
    if not str(path).strip():  # (Path("") is the current directory)
        raise ConfigError(field, "is empty: give a file")
    path = Path(path)
    if path.is_dir():
        raise ConfigError(field, f"{path} is a directory, not a file")
    if not path.is_file():
        raise ConfigError(field, f"file not found: {path}")


def load_yaml(path: str | Path) -> dict:
    check_path_name("config", str(path))
    require_file("config", path)
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError("config", f"{path} is not UTF-8 text (byte {e.start}: "
                                    f"{e.reason})") from None
    except OSError as e:
        raise ConfigError("config", f"cannot read {path}: {e.strerror or e}") from None
    try:
        data = safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("config", f"{path} is not valid YAML: {_yaml_error_line(e)}") from None
    if data is None:  # an empty (or truncated, or mistyped) file would be the whole default run
        raise ConfigError("config", f"{path} holds no settings (for the defaults' GPT-2 "
                                    "small on E2E with DP-Muon, write {optim: {preset: gpt2}})")
    if not isinstance(data, dict):
        raise ConfigError("config", f"{path} must hold a mapping at the top level")
    return data


def _section_type(cls: type, keys: list[str]) -> type | None:
    """The config class (dataclass) at ``keys`` under ``cls``; None for a plain field (a
    number, a list, a free mapping such as ``model.timm_kwargs``) or an unknown key."""
    tp: Any = cls
    for k in keys:
        if not dataclasses.is_dataclass(tp):
            return None
        hint = typing.get_type_hints(tp).get(k)
        if hint is None:
            return None
        if get_origin(hint) in (Union, types.UnionType):  # Section | None
            sections = [a for a in get_args(hint) if dataclasses.is_dataclass(a)]
            hint = sections[0] if len(sections) == 1 else None
        tp = hint
    return tp if dataclasses.is_dataclass(tp) else None


def _apply(cls: type, data: dict, keys: list[str], value: Any) -> None:
    """One override; a mapping given to a config section sets the keys it names and keeps the
    section's others (``privacy={epsilon: 3}`` is ``privacy.epsilon=3``: it used to replace the
    whole section, dropping the file's steps and sample rate)."""
    if isinstance(value, dict) and _section_type(cls, keys) is not None:  # ({}: no change)
        for k, v in value.items():
            _apply(cls, data, [*keys, str(k)], v)
    else:
        apply_override(data, keys, value)


def apply_overrides(cls: type, data: dict, overrides) -> None:
    """``key.sub=value`` overrides into ``data`` (the raw settings of ``cls``), in order: a key
    given twice takes its last value, so that a script can add settings after a user's."""
    for text in overrides:
        keys, value = parse_override(text)
        _apply(cls, data, keys, value)


def load(cls: type, path: str | Path | None = None, overrides: list[str] = ()) -> Any:
    """Read YAML (optional), apply ``key.sub=value`` overrides, build and validate ``cls``."""
    data = load_yaml(path) if path is not None else {}
    apply_overrides(cls, data, overrides)
    obj = from_dict(cls, data)
    validate_tree(obj)
    return obj
