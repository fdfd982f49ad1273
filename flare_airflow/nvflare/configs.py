"""Reading an NVFlare job folder's configuration files, with the line of every component.

NVFlare writes ``meta.json`` and ``app*/config/config_fed_{server,client}.json``; hand-written jobs
often use HOCON (``.conf``), which NVFlare reads with pyhocon, as this module does. A refusal must
name the file and line of the component it refuses: neither parser keeps lines, so a component's
line is found in the text by its class path (the n-th component with one path is its n-th
mention).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flare_airflow.core.errors import ConfigError

CONFIG_SUFFIXES = (".json", ".conf")


class NvflareJobError(ConfigError):
    """An NVFlare job folder cannot be imported (every problem is named with its file and line)."""


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


def find_config(folder: Path, stem: str) -> Path | None:
    """``folder/stem.json`` or ``folder/stem.conf`` (NVFlare accepts either)."""
    for suffix in CONFIG_SUFFIXES:
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def read_config(path: Path) -> ConfigFile:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise NvflareJobError(f"cannot read {path}: {exc.strerror or exc}") from None
    if path.suffix == ".conf":
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
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise NvflareJobError(f"{path}:{exc.lineno}: not valid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise NvflareJobError(f"{path}: the top level must be an object")
    return ConfigFile(path, data, text)
