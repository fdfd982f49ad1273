"""The strict base model and the checks several specs share: names, argv, environment, secrets."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from flare_airflow.core.config.describe import short_repr

# Upper bounds: beyond them a value is a typo, and some would overflow (timedelta, pool slots).
MAX_SECONDS = 366 * 24 * 3600.0
MAX_WEIGHT = 1e6
MIN_WEIGHT = 1e-6
# Integers the trigger form (JSON in a browser) carries exactly.
MAX_FORM_INT = 2**53
Scalar = int | float | str | bool
# Names of the Client API's variables (and of what the launcher adds) belong to flare-airflow.
RESERVED_ENV_PREFIX = "FLARE_"

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?\Z")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\Z")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?\Z")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*\Z")
# What every executor's queues accept (Celery, Edge: `airflow edge worker --queues a,b` splits on ',').
_QUEUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
# Airflow's own rule for connection ids (airflow.utils.helpers.validate_key).
_CONN_ID = re.compile(r"^[A-Za-z0-9_.-]{1,250}\Z")
# An executor as a task names it: its class name, an alias from [core] executor, or a module path.
_EXECUTOR = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z")


# The validation context key set when a block comes from the site policy (the site admin's), not a
# job file: rules that only an admin may relax (confinement, container devices and mounts) read it.
SITE_POLICY_CONTEXT = "site_policy"


class Strict(BaseModel):
    # strict: no silent coercion (`rounds: true` is not 1, `evaluate: "no"` is not True);
    # allow_inf_nan=False: `.inf` / `.nan` are no timeout, weight or CPU count.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)


def queue_name(value: str, what: str) -> str:
    if not _QUEUE.match(value):
        raise ValueError(
            f"{what} {short_repr(value)} is not a queue name: use letters, digits, '.', '_' and '-', starting "
            "with a letter or digit, at most 128 characters (the site's worker runs `airflow edge worker "
            "--queues <name>`)"
        )
    return value


def conn_id_name(value: str, what: str) -> str:
    # Not echoed: a value that is not a name may be a URI with credentials in it.
    if not _CONN_ID.match(value):
        raise ValueError(
            f"{what} must be an Airflow connection id: letters, digits, '.', '_' and '-', at most 250 characters "
            "(the connection's name only -- never a URI or credentials: each side defines the connection itself)"
        )
    return value


def airflow_executor(value: str, what: str) -> str:
    if not _EXECUTOR.match(value) or len(value) > 200:
        raise ValueError(
            f"{what} {short_repr(value)} is not an Airflow executor name: give its class name or alias as in "
            "[core] executor (e.g. EdgeExecutor) or its module path "
            "(airflow.providers.edge3.executors.EdgeExecutor)"
        )
    return value


def dns_label(value: str, what: str) -> str:
    if not DNS_LABEL.match(value) or len(value) > 63:
        raise ValueError(
            f"{what} {value!r} is not an RFC 1123 label: use lowercase letters, digits and '-', "
            "start and end with a letter or digit, at most 63 characters"
        )
    return value


def dns_subdomain(value: str, what: str) -> str:
    if not _DNS_SUBDOMAIN.match(value) or len(value) > 253:
        raise ValueError(
            f"{what} {value!r} is not a Kubernetes object name: use lowercase letters, digits, '-' and '.', "
            "start and end with a letter or digit, at most 253 characters"
        )
    return value


def qualified_name(value: str, what: str) -> str:
    """A label or annotation key: ``[prefix/]name`` (prefix a DNS subdomain, name <= 63 characters)."""
    prefix, _, name = value.rpartition("/")
    ok = bool(name) and len(name) <= 63 and bool(_LABEL_VALUE.match(name))
    if prefix:
        ok = ok and len(prefix) <= 253 and bool(_DNS_SUBDOMAIN.match(prefix))
    if not ok:
        raise ValueError(
            f"{what} {value!r} is not a valid key: an optional DNS prefix and '/', then at most 63 letters, "
            "digits, '-', '_' or '.', starting and ending with a letter or digit (e.g. 'team' or 'example.org/team')"
        )
    return value


def label_value(value: str, what: str) -> str:
    """``value`` if Kubernetes accepts it as a label value, else a ValueError naming ``what``."""
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise ValueError(
            f"{what} {value!r} is not a valid label value: at most 63 letters, digits, '-', '_' or '.', "
            "starting and ending with a letter or digit"
        )
    return value


def no_nul(value: str, what: str) -> str:
    # execve and the file system cut a string at NUL: what ran would differ from what was written.
    if "\0" in value:
        raise ValueError(f"{what} contains a NUL character (\\0), which no argument, path or variable may hold")
    return value


def not_blank(value: str, what: str, blank: str) -> str:
    """``value``, which must hold more than white space (``blank`` says what to write) and no NUL."""
    if not value.strip():
        raise ValueError(blank)
    return no_nul(value, what)


def argv(value: Any) -> Any:
    """An exact argv: a list of strings (numbers are turned into strings), never one shell string."""
    if isinstance(value, str):
        raise ValueError("must be a list of arguments, not a string (arguments are never run through a shell)")
    if isinstance(value, list | tuple):
        out = []
        for item in value:
            if isinstance(item, bool) or not isinstance(item, str | int | float):
                raise ValueError(f"argument {short_repr(item)} must be a string or a number")
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"argument {item!r} is not a finite number; quote it if you mean the text")
            out.append(no_nul(str(item), f"argument {short_repr(item)}"))
        return out
    return value


def env_name(name: str, what: str, reserved: tuple[str, ...] = (RESERVED_ENV_PREFIX,)) -> str:
    if not _ENV_NAME.match(name):
        raise ValueError(
            f"{what}: {short_repr(name)} is not a valid environment variable name "
            "(letters, digits, '_', '-', '.'; not starting with a digit; no '=')"
        )
    if name.startswith(reserved):
        airflow = ", AIRFLOW* ones are Airflow's own" if len(reserved) > 1 else ""
        raise ValueError(
            f"{what}: {name!r} is reserved ({', '.join(p + '*' for p in reserved)}): FLARE_* variables are set by "
            f"flare-airflow for the Client API{airflow}; choose another name"
        )
    return name


def exactly_one(what: str, **sources: Any) -> None:
    given = [name for name, value in sources.items() if value not in (None, False)]
    if len(given) != 1:
        found = f"got {', '.join(given)}" if given else "got none"
        raise ValueError(f"{what} needs exactly one of {', '.join(sources)} ({found})")


# A launcher block's ``env`` (plain values) and ``secret_env`` (references resolved at the site):
# the process and Kubernetes blocks check them alike, with their own reserved names and references.


def env_values(value: dict[str, str], reserved: tuple[str, ...]) -> dict[str, str]:
    """A block's ``env``: valid, unreserved names; values without NUL."""
    for name, item in value.items():
        env_name(name, "env", reserved=reserved)
        no_nul(item, f"env.{name}")
    return value


def secret_references(value: Any, reference: type[BaseModel], shape: str, home: str) -> Any:
    """Before validation: every ``secret_env`` entry is a reference of ``shape``, never a value."""
    if isinstance(value, Mapping):
        for name, ref in value.items():
            if not isinstance(ref, Mapping | reference):
                raise ValueError(
                    f"secret_env.{name} must be a reference {shape}, never the value itself (values stay in {home})"
                )
    return value


def secret_env_names(value: dict[str, Any], reserved: tuple[str, ...]) -> dict[str, Any]:
    for name in value:
        env_name(name, "secret_env", reserved=reserved)
    return value


def env_or_secret(env: Mapping[str, Any], secret_env: Mapping[str, Any]) -> None:
    both = sorted(set(env) & set(secret_env))
    if both:
        raise ValueError(f"{', '.join(both)} set in both env and secret_env; keep one")


# A decimal number as people write it (``0.001``, ``1e-3``, ``-2.5E+4``): the text a float
# hyper-parameter takes from the trigger form, which :func:`hparam_value` parses. No
# ``inf``/``nan``/``1_000``, which Python's float() would take, and no leading zero followed by
# digits (``001``): nobody means that, it is what a form that re-read ``0.001`` at each keystroke
# sent (issue 37), and float() would read it as 1.
FLOAT_PATTERN = r"^\s*[+-]?((0|[1-9][0-9]*)([.][0-9]*)?|[.][0-9]+)([eE][+-]?[0-9]+)?\s*$"
_LEADING_ZERO = re.compile(r"^\s*[+-]?0[0-9]")


class Bounds(Protocol):
    """A numeric range (``job.HparamRange``): why a value is outside it, or None."""

    def refusal(self, value: float) -> str | None: ...


def hparam_value(name: str, default: Any, value: Any, bounds: Bounds | None = None) -> Any:
    """A run's value for a hyper-parameter: the type of the job's ``default``, finite, bounded.

    A float hyper-parameter also takes its number as text (``"1e-3"``): the trigger form keeps it
    as typed (a number field would read ``1e-3`` as 13). ``bounds``: the job's
    ``HparamRange`` for it, if any.

    Shared by the trigger form's check (``hp_<name>`` in a run's conf) and ``try-trainer --hparam``.
    """
    if (
        isinstance(default, float)
        and isinstance(value, str)
        and len(value) <= 64
        and re.fullmatch(FLOAT_PATTERN, value)
    ):
        value = float(value.strip())
    elif isinstance(default, float) and isinstance(value, str) and _LEADING_ZERO.match(value):
        raise ValueError(
            f"{name} must be a number as written, like the job's default {default!r}; got {short_repr(value)}, "
            "a leading zero followed by digits: write 0.001 (or 1e-3) in full"
        )
    if isinstance(default, bool):
        ok = isinstance(value, bool)
        kind = "true or false"
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) <= MAX_FORM_INT
        kind = "an integer"
    elif isinstance(default, float):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        kind = "a finite number"
        value = float(value) if ok else value
    else:
        ok = isinstance(value, str) and "\0" not in value
        kind = "a string"
    if not ok:
        raise ValueError(f"{name} must be {kind} like the job's default {default!r}, got {short_repr(value)}")
    if bounds is not None and not isinstance(value, bool) and (why := bounds.refusal(value)):
        raise ValueError(f"{name}={short_repr(value)} {why} (trainer.hparam_ranges)")
    return value


def positive_seconds(value: Any, name: str) -> Any:
    """A ``mode="before"`` check of a timeout or interval: a number of seconds in (0, MAX_SECONDS]."""
    if isinstance(value, bool) or (isinstance(value, int | float) and not 0 < value <= MAX_SECONDS):
        raise ValueError(f"{name} must be a number of seconds > 0 and <= {int(MAX_SECONDS)} (366 days), got {value!r}")
    return value


def is_real_number(value: Any) -> bool:
    """A real number: YAML's ``true`` is an int to Python, and a z of ``true`` is a typo, not 1."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def positive_number(value: float, what: str, example: str) -> float:
    """A ``mode="before"`` check of a finite number > 0; the error names ``what`` and gives ``example``."""
    if not (is_real_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{what} must be a number > 0 ({example}), got {value!r}")
    return float(value)
