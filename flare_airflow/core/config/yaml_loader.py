"""Reading a job file: bounded in size, safe YAML only, no duplicate keys, aliases that cannot explode.

Errors name the file and, for malformed YAML, the line and column; :class:`KeyLines` gives the line
of any field so that validation errors name it too.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from flare_airflow.core.config.describe import cap, short_repr
from flare_airflow.core.errors import ConfigError

# libyaml's parser when PyYAML was built with it (the wheels are): ~5x faster on a 1024-site job,
# whose YAML every task process parses again.
try:
    from yaml import CSafeLoader as _SafeLoader
except ImportError:  # PyYAML without libyaml
    from yaml import SafeLoader as _SafeLoader  # type: ignore[assignment]

# A job file is small (a 1024-site job is ~60 KiB); YAML aliases may not expand it without bound.
MAX_JOB_FILE_BYTES = 4 * 1024 * 1024
MAX_EXPANDED_NODES = 200_000
MAX_NESTING = 64


class _UniqueKeyLoader(_SafeLoader):
    """A safe loader that refuses duplicate keys, alias bombs and self-referencing documents.

    Aliases are fine (``&defaults`` ... ``*defaults``), but what they expand to is bounded: the
    composed node graph is measured before anything is constructed, so a 1 KiB file that would
    expand to 10**9 values is refused in microseconds.
    """

    def construct_document(self, node: yaml.Node) -> Any:
        _expanded_size(node, {}, set(), 0)
        return super().construct_document(node)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    "merge keys ('<<') are not supported: write the keys out "
                    "(settings every site shares go in sites.@default)",
                    key_node.start_mark,
                )
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
                seen.add(key)
            except TypeError:
                raise yaml.constructor.ConstructorError(
                    None, None, "a key is a list or mapping; keys must be plain names", key_node.start_mark
                ) from None
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {short_repr(key)} (each key may appear once)", key_node.start_mark
                )
        return super().construct_mapping(node, deep=deep)


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_nodes: set[int], depth: int) -> int:
    """Values ``node`` expands to with every alias followed (memoised: linear in the file)."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_nodes:
        raise yaml.constructor.ConstructorError(
            None, None, "an alias refers to a value that contains it (a self-referencing document)", node.start_mark
        )
    if depth > MAX_NESTING:
        raise yaml.constructor.ConstructorError(
            None, None, f"values are nested more than {MAX_NESTING} levels deep", node.start_mark
        )
    size = 1
    if isinstance(node, yaml.SequenceNode | yaml.MappingNode):
        open_nodes.add(key)
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        for child in children:
            size += _expanded_size(child, sizes, open_nodes, depth + 1)
            if size > MAX_EXPANDED_NODES:
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the document expands to more than {MAX_EXPANDED_NODES} values through its aliases "
                    "(an alias bomb?); write the values out or use fewer nested aliases",
                    node.start_mark,
                )
        open_nodes.discard(key)
    sizes[key] = size
    return size


def _read_job_text(path: pathlib.Path) -> str:
    try:
        if path.is_dir():
            raise ConfigError(f"{path}: is a directory; give the job's YAML file (e.g. {path}/job.yaml)")
        with path.open("rb") as fh:
            raw = fh.read(MAX_JOB_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the job file ({exc.strerror or exc})") from None
    except ValueError as exc:  # a NUL in the path
        raise ConfigError(f"{short_repr(str(path))}: not a usable file name ({exc})") from None
    if len(raw) > MAX_JOB_FILE_BYTES:
        raise ConfigError(
            f"{path}: larger than {MAX_JOB_FILE_BYTES // 2**20} MiB; a job file holds settings, not data "
            "(is this the right file?)"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a text file (byte {exc.start} is not UTF-8); a job file is YAML text: is this the right file?"
        ) from None


class KeyLines:
    """The line of each key in a job file, looked up by a field path such as ``("sites", "s1", "retries")``.

    Built from the composed YAML nodes and walked only when an error is reported, so a valid job
    pays nothing for it.
    """

    def __init__(self, root: yaml.Node | None) -> None:
        self._root = root

    def line(self, path: Sequence[Any]) -> int | None:
        """The 1-based line of the key at ``path``, or ``None`` when the file has no such key."""
        node = self._root
        line = None
        for part in path:
            if isinstance(node, yaml.MappingNode):
                for key_node, value_node in node.value:
                    if isinstance(key_node, yaml.ScalarNode) and key_node.value == str(part):
                        line, node = key_node.start_mark.line + 1, value_node
                        break
                else:
                    return None
            elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
                node = node.value[part]
                line = node.start_mark.line + 1
            else:
                return None
        return line


def read_job_yaml(path: pathlib.Path) -> Mapping[str, Any]:
    """The job file at ``path`` as a mapping, or a ``ConfigError`` naming the file (and line)."""
    return read_job_yaml_with_lines(path)[0]


def read_job_yaml_with_lines(path: pathlib.Path) -> tuple[Mapping[str, Any], KeyLines]:
    """The job file at ``path`` as a mapping and the lines of its keys (see :func:`read_job_yaml`)."""
    return parse_job_yaml_text(_read_job_text(path), path)


def parse_job_yaml_text(text: str, path: pathlib.Path | str) -> tuple[Mapping[str, Any], KeyLines]:
    """YAML ``text`` (a job file's, or a site policy's from elsewhere, named ``path`` in errors) as a
    mapping and the lines of its keys, with the same limits and checks as a job file."""
    if len(text) > MAX_JOB_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_JOB_FILE_BYTES // 2**20} MiB; it holds settings, not data")
    loader = _UniqueKeyLoader(text)
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(cap(f"{where}: malformed YAML: {problem}")) from None
    except RecursionError:
        raise ConfigError(f"{path}: malformed YAML: values are nested too deeply") from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError(f"{path}: the job file is empty; see docs/dag-authors.md for the keys a job needs")
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{path}: the job file must be a YAML mapping (job: ..., rounds: ..., sites: ...), "
            f"got a {type(data).__name__} {short_repr(data)}"
        )
    return data, KeyLines(root)
