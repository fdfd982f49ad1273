"""Short messages: values cut to a readable length, pydantic errors turned into one line each.

Every line names the source (file or ``<python>``), the field path and the site, then says what
was wrong and what is allowed.
"""

from __future__ import annotations

import reprlib
import types
import typing
from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError


class KeyLinesLike(Protocol):
    def line(self, path: Sequence[Any]) -> int | None: ...


MAX_REPR = 80
MAX_ERROR_LINES = 20
# Values are clipped to MAX_REPR already; a line is capped so a hostile file cannot flood the log.
# 700: the longest messages (a site's watch and store together, what to do) plus a deep job path
# (a pytest-xdist worker's temp dir) stayed whole only above 600; at 400 their middle was cut.
MAX_ERROR_LINE = 700


def short_repr(value: Any, limit: int = MAX_REPR) -> str:
    """``repr(value)`` cut to ``limit`` characters: messages stay readable whatever the input."""
    try:
        text = reprlib_repr(value)
    except Exception:  # an object whose repr fails is still named by its type
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def clip(text: str, limit: int = MAX_REPR) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def reprlib_repr(value: Any) -> str:
    # reprlib bounds the work on huge or deeply nested values (an alias bomb expands to 10**9 items).
    r = reprlib.Repr()
    r.maxstring = r.maxother = MAX_REPR
    r.maxlist = r.maxdict = r.maxtuple = r.maxset = 6
    r.maxlevel = 3
    return r.repr(value)


def cap(line: str) -> str:
    """One message line of at most ``MAX_ERROR_LINE`` characters."""
    if len(line) <= MAX_ERROR_LINE:
        return line
    # keep the head (where and what) and the tail (what to do); cut the middle (a long value)
    return line[: MAX_ERROR_LINE - 150] + " ... " + line[-145:]


def _members(current: Any) -> list[type[BaseModel]] | None:
    """The models of a union (also one wrapped in ``Annotated``, as a discriminated union is)."""
    if typing.get_origin(current) is typing.Annotated:
        current = typing.get_args(current)[0]
    if typing.get_origin(current) in (typing.Union, types.UnionType):
        models = [a for a in typing.get_args(current) if isinstance(a, type) and issubclass(a, BaseModel)]
        return models or None
    return None


def _tag_of(model: type[BaseModel], part: Any) -> bool:
    """Whether ``part`` of an error's location is the tag pydantic put there for ``model`` (its
    class name, or the ``Literal`` value of its discriminator field)."""
    if part == model.__name__:
        return True
    for field in model.model_fields.values():
        if typing.get_origin(field.annotation) is typing.Literal and typing.get_args(field.annotation) == (part,):
            return True
    return False


def _walk(root: type[BaseModel], loc: tuple[Any, ...]) -> tuple[tuple[Any, ...], Any]:
    """``loc`` without the union tags pydantic inserts (``aggregator.krum.f`` -> ``aggregator.f``),
    and the type found at its end (``None`` where the walk loses the type)."""
    current: Any = root
    clean: list[Any] = []
    i = 0
    while i < len(loc):
        members = _members(current)
        if members is not None:
            chosen = next((m for m in members if _tag_of(m, loc[i])), None)
            if chosen is not None:
                current, i = chosen, i + 1
                continue
            current = members[0]
        clean.append(loc[i])
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(str(loc[i]))
            current = None if field is None else field.annotation
        elif typing.get_origin(current) is dict:
            current = typing.get_args(current)[1]
        elif typing.get_origin(current) is list:
            current = typing.get_args(current)[0]
        else:
            current = None
        i += 1
    return tuple(clean), current


def _allowed_keys(root: type[BaseModel], root_keys: Sequence[str], loc: tuple[Any, ...]) -> list[str] | None:
    """The keys allowed where an unknown key appeared (``loc``: the mapping that held it)."""
    _, current = _walk(root, loc)
    members = _members(current)
    if members is not None:
        current = members[0]
    if current is root:
        return list(root_keys)
    if isinstance(current, type) and issubclass(current, BaseModel):
        return list(current.model_fields)
    return None


_TYPE_MESSAGES = {
    "int_type": "must be an integer",
    "int_parsing": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "float_parsing": "must be a number",
    "finite_number": "must be a finite number (not .inf or .nan)",
    "bool_type": "must be true or false",
    "bool_parsing": "must be true or false",
    "string_type": "must be a string",
    "model_type": "must be a mapping of keys to values",
    "model_attributes_type": "must be a mapping of keys to values",
    "dict_type": "must be a mapping of keys to values",
    "list_type": "must be a list",
    "invalid_key": "keys must be strings",
}


def _message(err: Any, loc: tuple[Any, ...], root: type[BaseModel], root_keys: Sequence[str]) -> str:
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        allowed = _allowed_keys(root, root_keys, loc[:-1])
        return f"unknown key {short_repr(loc[-1])}" + (f"; allowed keys: {', '.join(allowed)}" if allowed else "")
    if kind == "missing":
        return "required field is missing"
    if kind == "union_tag_invalid":
        tags = str(err["ctx"]["expected_tags"]).rsplit(", ", 1)
        return f"must be {' or '.join(tags)}, got {short_repr(err['ctx']['tag'])}"
    if kind in _TYPE_MESSAGES:
        msg = _TYPE_MESSAGES[kind]
        if isinstance(value, bool) and kind.startswith(("int", "float")):
            return f"{msg}, got {str(value).lower()} (true/false is not a number)"
        if kind == "string_type" and isinstance(value, int | float):
            return f"{msg}, got the number {short_repr(value)} (quote it: '{value}')"
        return f"{msg}, got {type(value).__name__} {short_repr(value)}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if msg.startswith("Input should be "):
        # pydantic's range and choice messages ("Input should be greater than 0") plus what was given
        msg = "must be " + msg.removeprefix("Input should be ") + f", got {short_repr(value)}"
    return msg


def _candidates(loc: tuple[Any, ...]) -> list[tuple[Any, ...]]:
    """Where in the file a merged site field may have come from: the site, ``@default``, NVFlare's blocks."""
    paths = [loc]
    if len(loc) >= 2 and loc[0] == "sites":
        site, rest = loc[1], loc[2:]
        paths.append(("sites", "@default", *rest))
        if rest[:1] == ("resource_spec",):
            paths += [("resource_spec", site, *rest[1:]), ("resource_spec", "@default", *rest[1:])]
        if rest[:1] == ("launcher_spec",):
            paths += [("launcher_spec", site, *rest[1:]), ("launcher_spec", "default", *rest[1:])]
    return paths


def line_of(lines: KeyLinesLike | None, loc: tuple[Any, ...]) -> int | None:
    """The line of the field at ``loc`` (or of its nearest enclosing key the file has)."""
    if lines is None:
        return None
    for size in range(len(loc), 0, -1):
        for path in _candidates(loc[:size]):
            line = lines.line(path)
            if line is not None:
                return line
    return None


def field_in_message(msg: str) -> tuple[str, ...]:
    """The field a whole-job message starts with (``min_clients is 5 ...`` -> ``("min_clients",)``)."""
    head = msg.split(" ", 1)[0].rstrip(":")
    return tuple(head.split(".")) if head and all(part for part in head.split(".")) else ()


def located(source: str, lines: KeyLinesLike | None, loc: tuple[Any, ...]) -> str:
    """``source:line`` when the field's line is known, else ``source``."""
    line = line_of(lines, loc) if loc else None
    return f"{source}:{line}" if line else source


def describe(
    exc: ValidationError,
    source: str,
    root: type[BaseModel],
    root_keys: Sequence[str],
    lines: KeyLinesLike | None = None,
) -> str:
    """The errors of validating ``root`` (whose top level accepts ``root_keys``) from ``source``.

    With ``lines`` (a YAML file's :class:`~.yaml_loader.KeyLines`) every error names its line.
    """
    out = []
    errors = exc.errors()
    for err in errors[:MAX_ERROR_LINES]:
        msg = _message(err, tuple(err["loc"]), root, root_keys)
        loc, _ = _walk(root, tuple(err["loc"]))
        if err["type"] == "union_tag_invalid":
            loc += (str(err["ctx"]["discriminator"]).strip("'"),)
        if not loc:
            # a check across fields (or the merge of @default and NVFlare's blocks): its message
            # starts with the field it is about
            out.append(cap(f"{located(source, lines, field_in_message(msg))}: {msg}"))
            continue
        field = ".".join(str(p) for p in loc)
        where = f"{located(source, lines, loc)}: {short_repr(field, 200) if len(field) > 200 else field}"
        if len(loc) >= 2 and loc[0] == "sites":
            where += f" (site {short_repr(loc[1])})"
        out.append(cap(f"{where}: {msg}"))
    if len(errors) > MAX_ERROR_LINES:
        out.append(f"... and {len(errors) - MAX_ERROR_LINES} more errors")
    return "invalid job configuration:\n  " + "\n  ".join(out)
