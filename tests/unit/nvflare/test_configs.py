"""Reading an NVFlare config (flare_airflow/nvflare/configs.py): HOCON that reaches beyond its file
is refused before pyhocon acts on it; what only looks like it (in a string, a comment) is not."""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow.nvflare.configs import read_config
from flare_airflow.nvflare.errors import NvflareJobError


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ('{\n  include "other.conf"\n}', 2),
        ('{\n  a = 1\n  include required(file("/etc/passwd"))\n}', 3),
        ('{\n  b { include classpath("x.conf") }\n}', 2),
        ('{\n  INCLUDE "other.conf"\n}', 2),  # pyhocon reads the keyword in any case
        ('{\n  include package("flare_airflow:x.conf")\n}', 2),
        ("{\n  key = ${HOME}\n}", 2),
        ("{\n  key = ${?HOME}\n}", 2),
        ('{\n  a = "x"\n  key = "prefix" ${HOME}\n}', 3),
    ],
)
def test_include_and_substitution_are_refused_with_their_line(tmp_path: pathlib.Path, text: str, line: int) -> None:
    path = tmp_path / "config_fed_server.conf"
    path.write_text(text)
    with pytest.raises(NvflareJobError, match=rf"config_fed_server\.conf:{line}: HOCON (include|substitution)"):
        read_config(path)


def test_lookalikes_in_strings_and_comments_are_plain_text(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "config_fed_client.conf"
    path.write_text(
        '{\n  # include "x.conf" and ${HOME} in a comment\n  // include url("http://x")\n'
        '  args = "include \\"y.conf\\" ${HOME}"\n  doc = """${USER} include "z" """\n  include_vars = 1\n}\n'
    )
    data = read_config(path).data
    assert data == {"args": 'include "y.conf" ${HOME}', "doc": '${USER} include "z" ', "include_vars": 1}
