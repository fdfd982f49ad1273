"""docs/deploy-across-sites.md, read as the Edge e2e test (flare_airflow_testing/edge_sites.py) uses it.

The guide's blocks -- the job's keys, the central side's ``airflow.cfg`` lines, a site worker's
environment, its policy (a process site's or a container site's) and the command that starts it --
are taken from the page and used as
written. Only the guide's placeholders are put in place: the central address
(``https://airflow.example.org``), the site's directories (``/srv/flare``, ``/etc/flare``), ``site-1``
for each site, and the values the page leaves open (``<...>``, ``...``). A placeholder the page no
longer has, or one left unfilled, is an error: editing the guide changes what the test runs.
"""

from __future__ import annotations

import configparser
import copy
import pathlib
import re
import shlex
from typing import Any

import yaml

from flare_airflow_testing.harness import REPO

GUIDE = REPO / "docs" / "deploy-across-sites.md"
CENTRAL_URL = "https://airflow.example.org"
EXAMPLE_SITE = "site-1"
_SECTION = re.compile(r"^## (.+)$", re.M)
_FENCE = re.compile(r"^ *```(\w*)\n(.*?)^ *```", re.S | re.M)
_OPEN = re.compile(r"<[^<>]*>|\.\.\.")


class GuideError(AssertionError):
    """docs/deploy-across-sites.md no longer has what the Edge e2e test follows."""


def _section(title: str) -> str:
    text = GUIDE.read_text()
    parts = _SECTION.split(text)
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name.strip() == title:
            return body
    raise GuideError(f"{GUIDE.name}: no section '## {title}'")


def block(title: str, lang: str) -> str:
    """The one ``lang`` code block of section ``title``, dedented."""
    found = [body for kind, body in _FENCE.findall(_section(title)) if kind == lang]
    if len(found) != 1:
        raise GuideError(f"{GUIDE.name}, section '{title}': expected one ```{lang} block, found {len(found)}")
    lines = found[0].splitlines()
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines) + "\n"


def _put(value: str, old: str, new: str, where: str) -> str:
    if old not in value:
        raise GuideError(f"{GUIDE.name}: {where} = {value!r} no longer has the placeholder {old!r}")
    return value.replace(old, new)


def _filled(values: dict[str, str], given: dict[str, str], where: str) -> dict[str, str]:
    """``values`` with each key of ``given`` replaced, which must be a placeholder in the guide."""
    out = dict(values)
    for key, value in given.items():
        if key not in out or not _OPEN.search(out[key]):
            raise GuideError(f"{GUIDE.name}: {where} has no placeholder value for {key}")
        out[key] = value
    left = {k: v for k, v in out.items() if _OPEN.search(v)}
    if left:
        raise GuideError(f"{GUIDE.name}: {where}: placeholders left unfilled: {left}")
    return out


def job_keys() -> dict[str, Any]:
    """'The job: one queue per site': the keys a job adds for sites at the sites."""
    keys = yaml.safe_load(block("The job: one queue per site", "yaml"))
    assert isinstance(keys, dict), keys
    return keys


def central_config(*, base: str, root: pathlib.Path) -> dict[str, str]:
    """'Central side': the ``airflow.cfg`` lines as ``AIRFLOW__SECTION__KEY`` variables, for the API
    at ``base`` and the central side's files under ``root`` (the guide's ``/srv/flare``)."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(block("Central side", "ini"))
    env = {
        f"AIRFLOW__{section.upper()}__{key.upper()}": value.replace("/srv/flare", str(root))
        for section in parser.sections()
        for key, value in parser[section].items()
    }
    url = "AIRFLOW__EDGE__API_URL"
    env[url] = _put(env.get(url, ""), CENTRAL_URL, base, "[edge] api_url")
    if "AIRFLOW__API_AUTH__JWT_SECRET" in env:
        raise GuideError(f"{GUIDE.name}: the central side's airflow.cfg sets a jwt_secret: no shared secret")
    return _filled(env, {}, "the central side's airflow.cfg")


def worker_env(*, base: str, root: pathlib.Path, store_connection: str) -> dict[str, str]:
    """'A site's worker': its environment, with this worker's directories and the central address."""
    env: dict[str, str] = {}
    for line in block("A site's worker", "bash").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if len(words) != 1 or "=" not in words[0]:
            raise GuideError(f"{GUIDE.name}: the worker's environment has a line that is not NAME=value: {line!r}")
        name, value = words[0].split("=", 1)
        value = value.replace(CENTRAL_URL, base).replace("/srv/flare", str(root)).replace("/etc/flare", str(root))
        env[name] = value
    secret = [name for name in env if "JWT" in name or name.endswith("__SECRET_KEY")]
    if secret:
        raise GuideError(f"{GUIDE.name}: the worker's environment holds {secret}: a site holds no shared secret")
    given: dict[str, str] = {}
    conns = [name for name in env if name.startswith("AIRFLOW_CONN_")]
    if len(conns) != 1:
        raise GuideError(f"{GUIDE.name}: the worker's environment should define one store connection, has {conns}")
    given[conns[0]] = store_connection
    return _filled(env, given, "the worker's environment")


def store_connection_name() -> str:
    """The connection id the worker's environment defines (``AIRFLOW_CONN_SITE_STORE`` -> ``site_store``)."""
    for line in block("A site's worker", "bash").splitlines():
        if line.startswith("AIRFLOW_CONN_"):
            return line.split("=", 1)[0].removeprefix("AIRFLOW_CONN_").lower()
    raise GuideError(f"{GUIDE.name}: the worker's environment defines no AIRFLOW_CONN_ store connection")


def site_policy(site: str, root: pathlib.Path) -> dict[str, Any]:
    """'A site's worker': the policy example, for ``site`` on a worker whose directory is ``root``."""
    text = block("A site's worker", "yaml")
    text = _put(text, EXAMPLE_SITE, site, "the site policy").replace("/srv/flare", str(root))
    policy = yaml.safe_load(text)
    assert isinstance(policy, dict), policy
    return copy.deepcopy(policy)


def container_site_policy(site: str, root: pathlib.Path, image: str) -> dict[str, Any]:
    """'Container sites at a site': the policy example, for ``site`` running ``image``."""
    text = block("Container sites at a site", "yaml")
    text = _put(text, EXAMPLE_SITE, site, "the container site policy").replace("/srv/flare", str(root))
    policy = yaml.safe_load(text)
    assert isinstance(policy, dict), policy
    container = policy["sites"][site]["launcher_spec"]["container"]
    container.update(_filled({"image": str(container.get("image"))}, {"image": image}, "the container site policy"))
    return copy.deepcopy(policy)


def worker_argv(site: str) -> list[str]:
    """'A site's worker': the command that starts it, for ``site``."""
    found = re.findall(r"`(flare-airflow site worker [^`]+)`", _section("A site's worker"))
    if len(found) != 1:
        raise GuideError(f"{GUIDE.name}: expected one `flare-airflow site worker SITE` command, found {found}")
    argv = shlex.split(found[0])
    if argv[3:] != [EXAMPLE_SITE]:
        raise GuideError(f"{GUIDE.name}: the worker command {found[0]!r} should name the example site only")
    return [*argv[:3], site]
