"""Settings as command-line flags and environment variables, derived from dataclass fields.

``options_of(cls)`` walks a config dataclass (and the dataclass-typed fields it holds, its
sections) and gives one ``Option`` per plain field: its flag (the field's name with dashes, or
``doc(flag=...)``), its environment variable (``MINIRT_`` + the flag in capitals), its type
(``str``, ``int``, ``float``, ``bool``, a ``Literal`` of strings, or one of them ``| None``),
help and allowed values. Pure: no argparse, no ``os.environ``; ``minirt.cli`` and
``actors.runtime.config`` use it.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

ENV_PREFIX = "MINIRT_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")

Choices = Sequence[str] | Callable[[], Sequence[str]]


def doc(
    help: str,
    *,
    flag: str | None = None,
    choices: Choices | None = None,
    off_flag: str | None = None,
    off_help: str = "",
    many: bool = False,
) -> dict[str, Any]:
    """Field metadata. ``help``: the flag's help. ``flag``: its name when not the field's (the
    environment name follows the flag). ``choices``: allowed values, or a function returning them
    (called only when needed, so listing them imports nothing at start-up). ``off_flag``: for a
    bool, an extra flag that sets it false (with ``off_help``). ``many``: a string flag that
    takes one or more words (joined by spaces)."""
    return {
        "help": help,
        "flag": flag,
        "choices": choices,
        "off_flag": off_flag,
        "off_help": off_help,
        "many": many,
    }


@dataclass(frozen=True)
class Option:
    path: tuple[str, ...]  # ("kv", "num_blocks")
    flag: str  # "num-blocks", used as --num-blocks
    env: str  # "MINIRT_NUM_BLOCKS"
    type: type  # str, int, float or bool
    optional: bool  # None allowed
    default: Any
    help: str
    choices_of: Choices | None = None
    off_flag: str | None = None
    off_help: str = ""
    many: bool = False  # a str flag of one or more words

    @property
    def key(self) -> str:
        """Dotted path, as in error messages and TOML: ``kv.num_blocks``."""
        return ".".join(self.path)

    @property
    def dest(self) -> str:
        """Where argparse stores the flag's value."""
        return "cfg." + self.key

    @property
    def choices(self) -> tuple[str, ...] | None:
        c = self.choices_of
        if c is None:
            return None
        return tuple(c() if callable(c) else c)

    def problem(self, value: Any) -> str | None:
        """Why ``value`` cannot be this setting, or None."""
        if value is None:
            return None if self.optional else "must be set"
        t = self.type
        ok = (
            isinstance(value, bool)
            if t is bool
            else not isinstance(value, bool)
            and isinstance(value, (int, float) if t is float else t)
        )
        if not ok:
            return f"expected {t.__name__}, got {value!r}"
        choices = self.choices
        if choices is not None and value not in choices:
            return f"{value!r} is not one of: {', '.join(choices)}"
        return None

    def check(self, value: Any) -> None:
        """Raise ``ValueError`` naming the field when ``value`` is not valid for it."""
        why = self.problem(value)
        if why is not None:
            raise ValueError(f"config {self.key}: {why}")

    def parse(self, text: str, source: str) -> Any:
        """The value of ``text`` (from the environment variable or flag ``source``)."""
        t = self.type
        try:
            if t is bool:
                if text.lower() not in TRUE + FALSE:
                    raise ValueError(f"expected one of {'/'.join(TRUE + FALSE)}")
                value: Any = text.lower() in TRUE
            else:
                value = t(text)
        except ValueError as e:
            raise ValueError(
                f"{source} ({self.key}): {text!r} is not a valid {t.__name__}: {e}"
            ) from None
        why = self.problem(value)
        if why is not None:
            raise ValueError(f"{source} ({self.key}): {why}")
        return value

    def put(self, nested: dict[str, Any], value: Any) -> None:
        """Set ``value`` at this option's path in a nested dict (as a TOML file would)."""
        d = nested
        for part in self.path[:-1]:
            d = d.setdefault(part, {})
        d[self.path[-1]] = value


def _scalar(hint: Any, where: str) -> tuple[type, bool, tuple[str, ...] | None]:
    """(type, optional, Literal choices) of a field's type hint."""
    optional = False
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(hint) if a is not type(None)]
        optional = len(rest) < len(typing.get_args(hint))
        if len(rest) == 1:
            hint = rest[0]
    if typing.get_origin(hint) is Literal:
        values = typing.get_args(hint)
        if all(isinstance(v, str) for v in values):
            return str, optional, values
    elif hint in (str, int, float, bool):
        return hint, optional, None
    raise TypeError(
        f"config field {where}: type {hint!r} has no flag; use str, int, float, bool, a Literal "
        "of strings, or one of them | None"
    )


@functools.cache
def options_of(cls: type) -> list[Option]:
    """Every plain field of ``cls`` and of its sections; raises on two fields with one flag."""
    out: list[Option] = []
    _walk(cls, (), out)
    seen: dict[str, str] = {}
    for opt in out:
        for name in (opt.flag, opt.off_flag, opt.env):
            if name is None:
                continue
            if name in seen:
                raise ValueError(f"config fields {seen[name]} and {opt.key} both claim {name!r}")
            seen[name] = opt.key
    return out


def _walk(cls: type, prefix: tuple[str, ...], out: list[Option]) -> None:
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = (*prefix, f.name)
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            _walk(typing.cast(type, hint), path, out)
            continue
        meta = f.metadata
        t, optional, literal = _scalar(hint, ".".join(path))
        flag = (meta.get("flag") or f.name).replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append(
            Option(
                path=path,
                flag=flag,
                env=ENV_PREFIX + flag.upper().replace("-", "_"),
                type=t,
                optional=optional,
                default=default,
                help=meta.get("help", ""),
                choices_of=meta.get("choices") or literal,
                off_flag=meta.get("off_flag"),
                off_help=meta.get("off_help", ""),
                many=meta.get("many", False),
            )
        )
