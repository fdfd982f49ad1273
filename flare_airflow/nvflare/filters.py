"""NVFlare's task filters: the clients' result filters with an equivalent become site policy.

A client's ``task_result_filters`` change what leaves the site: flare-airflow's site filters do
the same, chosen by the site's policy and applied in the site task (a trainer cannot skip them).
Filters on what a site receives, and the server's filters, have no equivalent and are refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from flare_airflow.core.config.filters import Percentile
from flare_airflow.nvflare.configs import Component, ConfigFile
from flare_airflow.nvflare.errors import NvflareJobError
from flare_airflow.nvflare.reading import Reading


def _exclude_vars(f: Component, reading: Reading) -> dict[str, Any] | None:
    value = f.args.get("exclude_vars")
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return {"type": "exclude_vars", "names": list(value)}
    if isinstance(value, str) and value:
        try:
            re.compile(value)
        except (re.error, RecursionError, OverflowError) as exc:
            reading.refuse(
                f.where, f"filter {f.path} exclude_vars={value[:80]!r}", f"not a regular expression ({exc})", "fix it"
            )
            return None
        # NVFlare searches the regex anywhere in a name (re.search); ours must match the whole name.
        return {"type": "exclude_vars", "regex": f".*(?:{value}).*"}
    reading.refuse(
        f.where,
        f"filter {f.path} exclude_vars={value!r}",
        "NVFlare leaves the update unchanged without names or a regex",
        "give a list of tensor names or a regex, or remove the filter",
    )
    return None


def _percentile(f: Component, reading: Reading) -> dict[str, Any] | None:
    spec = {"type": "percentile", "percentile": f.args.get("percentile", 10), "gamma": f.args.get("gamma", 0.01)}
    try:
        Percentile.model_validate(spec)
    except ValidationError as exc:
        problems = "; ".join(str(e["msg"]).removeprefix("Value error, ") for e in exc.errors())
        reading.refuse(
            f.where,
            f"filter {f.path}",
            f"its arguments are out of range ({problems})",
            "fix them, then the importer puts it in the site's policy",
        )
        return None
    return spec


# NVFlare filters that become the site's privacy filters (site policy in flare-airflow).
MAPPED_FILTERS = {"ExcludeVars": _exclude_vars, "PercentilePrivacy": _percentile}
REFUSED_FILTERS = {
    "SVTPrivacy": "the sparse vector technique is not implemented (and its noise is not accounted)",
    "StatisticsPrivacyFilter": "federated statistics jobs are not carried over",
    "ConvertWeights": "updates travel as safetensors tensors; there is no format to convert",
    "DXOBlocker": "flare-airflow has no per-data-kind blocking",
}
SITE_FILTER_TODO = (
    "remove it from the job and configure the equivalent filter in the site's policy "
    "(docs/privacy.md: exclude_vars, clip, gaussian, percentile)"
)


def read_filters(cfg: ConfigFile, reading: Reading, *, client: bool) -> list[dict[str, Any]]:
    """The client's result filters as privacy filters of its sites; anything else refused by name.

    A client's ``task_result_filters`` change what leaves the site: flare-airflow's site filters
    do the same, chosen by the site's policy and applied in the site task (a trainer cannot skip
    them). Filters on what a site receives, and the server's filters, have no equivalent.
    """
    mapped: list[dict[str, Any]] = []
    for key in ("task_data_filters", "task_result_filters"):
        groups = cfg.data.get(key) or []
        if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
            raise NvflareJobError(
                f"{cfg.path}:{cfg.line_of(key)}: {key} must be a list of {{tasks: [...], filters: [...]}} objects"
            )
        for index, group in enumerate(groups):
            raws, tasks = group.get("filters", []), group.get("tasks", ["*"])
            if not isinstance(raws, list) or not (isinstance(tasks, list) and all(isinstance(t, str) for t in tasks)):
                raise NvflareJobError(
                    f"{cfg.path}:{cfg.line_of(key)}: {key}[{index}]: tasks must be a list of task names and "
                    "filters a list of components"
                )
            for raw in raws:
                f = cfg.component(raw, f"{key}[{index}].filters")
                convert = MAPPED_FILTERS.get(f.class_name)
                if not client or key != "task_result_filters":
                    side = "the server's" if not client else "a filter on what the site receives"
                    reading.refuse(
                        f.where,
                        f"filter {f.path} ({key})",
                        f"{side} filters have no equivalent: flare-airflow filters each update as it leaves its site",
                        SITE_FILTER_TODO,
                    )
                elif convert is None:
                    why = REFUSED_FILTERS.get(f.class_name, "flare-airflow has no such filter")
                    reading.refuse(f.where, f"filter {f.path} ({key})", why, SITE_FILTER_TODO)
                else:
                    spec = convert(f, reading)
                    if spec is not None:
                        if not set(tasks) & {"*", "train"}:
                            reading.note(f.where, f.path, f"NVFlare applies it to tasks {tasks}; ours to every update")
                        mapped.append(spec)
    return mapped
