"""Reading an NVFlare job folder's configuration files, with the line of every component.

NVFlare writes ``meta.json`` and ``app*/config/config_fed_{server,client}.json``; hand-written jobs
often use HOCON (``.conf``), which NVFlare reads with pyhocon, as this module does. A refusal must
name the file and line of the component it refuses: neither parser keeps lines, so a component's
line is found in the text by its class path (the n-th component with one path is its n-th
mention).

The folder is untrusted, and pyhocon acts on what it parses: ``include file(...)`` reads another
file, ``include url(...)`` fetches one, and ``${NAME}`` falls back to the importing user's
environment. So the HOCON text is scanned before pyhocon sees it, and any include or substitution
is refused with its line: an import reads its own folder only, fetches nothing and substitutes
no environment.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flare_airflow.nvflare.errors import NvflareJobError
from flare_airflow.nvflare.paths import inside

CONFIG_SUFFIXES = (".json", ".conf")
# Deeper than any NVFlare config (components hold args objects a few levels down); deeper input
# would only exhaust the recursion of the parsers and of whoever reads the job later.
MAX_DEPTH = 32
# In HOCON code with the strings' insides blanked: an include statement (quoted, file(), url(),
# package(), classpath(), required(...); pyhocon reads the keyword in any case) and a
# substitution ``${...}`` / ``${?...}``.
_INCLUDE = re.compile(r'(?<![\w.\$-])include\s*(?:required\s*\(\s*)?(?:[a-z]+\s*\(\s*)?"', re.IGNORECASE)
_SUBSTITUTION = re.compile(r"\$\{")


@dataclass(frozen=True)
class Where:
    file: Path
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Component:
    """One ``{"id", "path" or "name", "args"}`` entry of an NVFlare config."""

    id: str
    path: str
    args: dict[str, Any]
    where: Where

    @property
    def class_name(self) -> str:
        return self.path.rsplit(".", 1)[-1]


@dataclass
class ConfigFile:
    path: Path
    data: dict[str, Any]
    text: str
    _mentions: dict[str, int] = field(default_factory=dict)

    def line_of(self, needle: str) -> int:
        """The line of ``needle``'s next mention (1 when it is not in the text)."""
        nth = self._mentions.get(needle, 0)
        self._mentions[needle] = nth + 1
        offset = -1
        for _ in range(nth + 1):
            offset = self.text.find(needle, offset + 1)
            if offset < 0:
                return 1
        return self.text.count("\n", 0, offset) + 1

    def component(self, raw: Any, what: str) -> Component:
        if not isinstance(raw, Mapping):
            raise NvflareJobError(f"{self.path}: {what} is {type(raw).__name__}, not a component object")
        path = raw.get("path") or raw.get("name")
        if not isinstance(path, str) or not path:
            raise NvflareJobError(f"{self.path}:{self.line_of(str(raw.get('id', what)))}: {what} names no class (path)")
        args = raw.get("args") or {}
        if not isinstance(args, Mapping):
            raise NvflareJobError(f"{self.path}: the args of {path} are not an object")
        return Component(str(raw.get("id", "")), path, dict(args), Where(self.path, self.line_of(path)))

    def components(self, key: str) -> Iterator[Component]:
        items = self.data.get(key) or []
        if not isinstance(items, list):
            raise NvflareJobError(f"{self.path}: {key!r} must be a list")
        for index, raw in enumerate(items):
            yield self.component(raw, f"{key}[{index}]")


def find_config(folder: Path, stem: str, root: Path) -> Path | None:
    """``folder/stem.json`` or ``folder/stem.conf`` (NVFlare accepts either), refused when it (or a
    folder on its way) is a link leading outside the job folder ``root``."""
    for suffix in CONFIG_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_symlink() or candidate.exists():
            inside(root, candidate, f"{stem}{suffix}")
        if candidate.is_file():
            return candidate
    return None


def _code_only(text: str) -> str:
    """``text`` with the insides of HOCON's quoted strings and its comments blanked, lines kept."""
    out = list(text)
    i, n = 0, len(text)
    while i < n:
        if text.startswith('"""', i):
            end = text.find('"""', i + 3)
            end = n if end < 0 else end + 3
            out[i + 3 : max(i + 3, end - 3)] = [c if c == "\n" else " " for c in text[i + 3 : max(i + 3, end - 3)]]
            i = end
        elif text[i] == '"':
            j = i + 1
            while j < n and text[j] not in '"\n':
                j += 2 if text[j] == "\\" else 1
            out[i + 1 : min(j, n)] = " " * (min(j, n) - i - 1)
            i = j + 1
        elif text[i] == "#" or text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out[i:j] = " " * (j - i)
            i = j
        else:
            i += 1
    return "".join(out)


def _refuse_hocon_reach(path: Path, text: str) -> None:
    """Refuse what makes pyhocon read, fetch or substitute beyond this file's text."""
    code = _code_only(text)
    found = _INCLUDE.search(code)
    if found:
        line = code.count("\n", 0, found.start()) + 1
        raise NvflareJobError(
            f"{path}:{line}: HOCON include: an imported job reads only its own folder's files and fetches "
            'nothing (include "...", file(...), url(...) and package(...) are refused); write the included '
            "settings into this file"
        )
    found = _SUBSTITUTION.search(code)
    if found:
        line = code.count("\n", 0, found.start()) + 1
        raise NvflareJobError(
            f"{path}:{line}: HOCON substitution ${{...}}: refused, since pyhocon fills one it cannot resolve from "
            "the importing user's environment variables (which would end up in the written job); write the value "
            "itself"
        )


def _depth_problem(data: Any) -> bool:
    """Whether ``data`` nests deeper than :data:`MAX_DEPTH` (checked without recursion)."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return True
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
    return False


def read_config(path: Path) -> ConfigFile:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise NvflareJobError(f"cannot read {path}: {why or exc}") from None
    nested = f"{path}: nested deeper than {MAX_DEPTH} levels; an NVFlare config is a few levels deep"
    if path.suffix == ".conf":
        _refuse_hocon_reach(path, text)
        try:  # only HOCON jobs need it
            from pyhocon import ConfigFactory
            from pyhocon.exceptions import ConfigException
        except ImportError:
            raise NvflareJobError(
                f"{path}: reading NVFlare's HOCON (.conf) files needs pyhocon: "
                "pip install 'flare-airflow[nvflare]' (or pyhocon), then import again"
            ) from None

        try:
            tree = ConfigFactory.parse_string(text)
            data: Any = json.loads(json.dumps(tree.as_plain_ordered_dict()))
        except (ConfigException, ValueError) as exc:
            raise NvflareJobError(f"{path}: not valid HOCON: {exc}") from None
        except RecursionError:
            raise NvflareJobError(nested) from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise NvflareJobError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
        except RecursionError:
            raise NvflareJobError(nested) from None
    if _depth_problem(data):
        raise NvflareJobError(nested)
    if not isinstance(data, dict):
        raise NvflareJobError(f"{path}: the top level must be an object")
    return ConfigFile(path, data, text)
