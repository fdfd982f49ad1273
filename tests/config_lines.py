"""Config errors name the line: every field error about a YAML file reads ``FILE:LINE: field: ...``.

Tests that assert what an error says call :func:`without_lines`: it checks that each field error
(the lines under ``invalid job configuration:``) carries a line number -- so every one of those
tests also checks the line is there -- then drops the numbers so the tests can match
``FILE: field: ...`` whatever the layout of their YAML. A required top-level key that is missing
has no line to name.
"""

from __future__ import annotations

import re


def without_lines(path: object, message: str) -> str:
    name = re.escape(str(path))
    if "invalid job configuration:" in message:
        for line in message.split("invalid job configuration:", 1)[1].splitlines():
            if re.match(rf"\s*{name}[: ]", line) and "required field is missing" not in line:
                assert re.match(rf"\s*{name}:\d+: ", line), f"no line number in: {line!r}\n{message}"
    return re.sub(rf"({name}):\d+: ", r"\1: ", message)
