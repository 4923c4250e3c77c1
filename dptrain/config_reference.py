"""The key reference of ``dptrain train``'s config (docs/config.md), generated from the config
dataclasses themselves: every key with its type, default and the docstring under its field.

    python -m dptrain.config_reference > docs/config.md

tests/test_configs.py checks that docs/config.md is what this prints, so the page cannot drift
from the code. (Field docstrings are not kept by Python at run time: they are read from each
class's source with ``ast``.)
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
import typing
from typing import Any

from dptrain.config import _type_name, _yaml_scalar, to_dict

_INTRO = """\
# Configuration keys

Every key of `dptrain train --config FILE [key.sub=value ...]`, with its type, default and
meaning. Generated from the config dataclasses by `python -m dptrain.config_reference`
(tests/test_configs.py checks that this page matches the code). Unknown keys, values of the
wrong type or out of range, and a setting that the run would ignore exit with status 2 and one
line naming the key: a field of another `model.name`, `data.name` or `optim.filter.name`
(the "gpt2:", "timm:", "DiSK:" ... at the start of its description), `data.tokenizer_path`
without the gpt2 tokenizer, `optim.min_lr_ratio` with the constant schedule. Settings of a
feature switched off by a number (`data.augment_pad` with `data.augmult: 0`,
`optim.ema_start_step` with `optim.ema_decay: 0`, the inner-momentum gammas with K = 0) are
accepted: a sweep includes the switched-off point.

Fractions are accepted for numbers (`privacy.delta=1/84122`); lists and mappings are written
in YAML flow style on the command line (`model.channels=[16,32]`).
"""


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass ``cls`` (and its bases)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(inspect.cleandoc(nxt.value.value).split())
    return docs


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def sections(cls: type, prefix: str = "") -> list[tuple[str, list[tuple[str, str, str, str]]]]:
    """[(section, [(key, type, default cell, doc), ...]), ...]: ``cls``'s own fields first, then
    one section per nested config (lists of configs as ``key[]``)."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows, nested = [], []
    for f in dataclasses.fields(cls):
        tp, key = hints[f.name], f"{prefix}{f.name}"
        default = _default(f)
        if dataclasses.is_dataclass(tp):
            nested.append((tp, f"{key}."))
            continue
        args, type_name = typing.get_args(tp), _type_name(tp)
        if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
            nested.append((args[0], f"{key}[]."))
            type_name = f"list of mappings (`{key}[]`)"
        shown = ("required" if default is dataclasses.MISSING
                 else f"`{_cell(_yaml_scalar(to_dict(default)))}`")
        rows.append((key, type_name, shown, docs.get(f.name, "")))
    out = [(prefix.rstrip(".") or "top level", rows)]
    for sub, sub_prefix in nested:
        out.extend(sections(sub, sub_prefix))
    return out


def reference_markdown() -> str:
    from dptrain.trainer import RunConfig

    parts = [_INTRO]
    for name, rows in sections(RunConfig):
        if not rows:
            continue
        parts.append(f"\n## `{name}`\n" if name != "top level" else "\n## Top level\n")
        parts.append("\n| key | type | default | what it does |\n|---|---|---|---|\n")
        for key, tp, default, doc in rows:
            parts.append(f"| `{key}` | {_cell(tp)} | {default} | {_cell(doc)} |\n")
    return "".join(parts)


if __name__ == "__main__":
    print(reference_markdown(), end="")
