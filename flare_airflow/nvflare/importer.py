"""``flare-airflow import-nvflare JOB_DIR``: an NVFlare job folder as a flare-airflow job.

Reads what NVFlare's Job API, its recipes and hand-written jobs put in a job folder:

* ``meta.json`` / ``meta.conf``: ``name``, ``deploy_map`` (``@ALL`` needs ``--sites``),
  ``min_clients``, ``resource_spec`` (per site, ``@default``), ``launcher_spec`` (``default`` and
  per-site blocks);
* the server app's ``config_fed_server``: one FedAvg workflow (2.9's ``FedAvg``, or the 2.5-2.8
  ``ScatterAndGather``) with ``num_rounds`` and ``min_clients``, its persistor (the initial model),
  its aggregator (``aggregation_weights`` become site weights);
* the client app's ``config_fed_client``: one Client API executor, in-process (2.9's
  ``ScriptRunner``: ``task_script_path`` / ``task_script_args``) or launcher-based (2.5-2.8:
  ``ClientAPILauncherExecutor`` with a ``SubprocessLauncher`` whose ``script`` is a command line),
  its ``params_exchange_format`` (numpy / pytorch) and ``params_transfer_type`` (FULL / DIFF).

It writes ``OUT/<job>.yaml``, ``OUT/<job>_dag.py`` and ``OUT/<job>/`` (the client app's
``custom/`` folder with the script, and ``initial_model.safetensors``). What it cannot carry over
(another workflow such as Scaffold or Cyclic, a custom executor, a filter without an equivalent,
an unknown component) is refused, every one named with its file and line and what to do; nothing
is written then.

The job folder is untrusted input: nothing outside it is read (:mod:`.paths`), nothing fetched and
no environment substituted (:mod:`.configs`), the models are checked (:mod:`.model`), and the
output is written all or nothing, never over an earlier file without ``--force`` (:mod:`.output`).

The clients' result filters that have an equivalent (``ExcludeVars``, ``PercentilePrivacy``) are
site policy here: they go to ``OUT/<job>.site-policy.yaml`` for the sites' admins, not into the job.
Components whose work flare-airflow does another way (NVFlare's pipes and launchers, model
selectors, tracking receivers) are carried over as notes, never silently.
"""

from __future__ import annotations

import math
import numbers
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np
import yaml
from pydantic import ValidationError

from flare_airflow.core.config import load_job
from flare_airflow.core.config.policy import SitePolicy
from flare_airflow.core.config.privacy import Percentile
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.nvflare.state_check import check_file
from flare_airflow.nvflare.configs import Component, ConfigFile, Where, find_config, read_config
from flare_airflow.nvflare.errors import NvflareJobError
from flare_airflow.nvflare.model import NVFLARE_DEFAULT_MODEL, check_initial_model, inline_model
from flare_airflow.nvflare.output import check_targets, move_into_place, staging_folder
from flare_airflow.nvflare.paths import copy_custom, inside, plain_name, relative_inside

__all__ = ["ImportResult", "NvflareJobError", "import_job"]

SERVER = "server"
ALL_SITES = "@ALL"

FEDAVG_WORKFLOWS = {"FedAvg", "BaseFedAvg", "PTFedAvg", "ScatterAndGather"}
REFUSED_WORKFLOW_HINT = {
    "Scaffold": "SCAFFOLD's control variates are not implemented in flare-airflow",
    "ScatterAndGatherScaffold": "SCAFFOLD's control variates are not implemented in flare-airflow",
    "CyclicController": "cyclic weight transfer (one site after another) is not a FedAvg round",
    "Cyclic": "cyclic weight transfer (one site after another) is not a FedAvg round",
    "CrossSiteModelEval": "cross-site evaluation is not carried over; evaluate the published model with the trainer",
    "CrossSiteEval": "cross-site evaluation is not carried over; evaluate the published model with the trainer",
    "FedAvgEarlyStopping": "early stopping is not carried over",
    "PTFedAvgEarlyStopping": "early stopping is not carried over",
}
CLIENT_API_EXECUTOR = "ClientAPIExecutor"  # 2.9: execution_mode in_process | external_process
IN_PROCESS_EXECUTORS = {"InProcessClientAPIExecutor", "PTInProcessClientAPIExecutor"}  # 2.5-2.8
LAUNCHER_EXECUTORS = {"ClientAPILauncherExecutor", "PTClientAPILauncherExecutor"}  # 2.5-2.8
LAUNCHERS = {"SubprocessLauncher"}
AGGREGATORS = {"InTimeAccumulateWeightedAggregator"}
SHAREABLE_GENERATORS = {"FullModelShareableGenerator"}
NP_PERSISTORS = {"NPModelPersistor"}
MODEL_PERSISTORS = {"PTFileModelPersistor", "TFModelPersistor", "NPModelPersistor"}
# FedAvg / ScatterAndGather arguments whose behaviour flare-airflow has (or that only tune NVFlare itself).
WORKFLOW_ARGS_CARRIED = {
    "num_rounds": "rounds",
    "num_clients": "min_clients",
    "min_clients": "min_clients",
    "aggregation_weights": "the sites' weight",
    "persistor_id": "initial_model",
    "aggregator_id": "FedAvg",
    "shareable_generator_id": "FULL model to every site",
    "start_round": "must be 0",
    "task_name": "the train task",
    "train_task_name": "the train task",
    "wait_time_after_min_received": "a round ends when every site task ended",
    "train_timeout": "trainer.timeout",
    "save_filename": "the published global model",
    "memory_gc_rounds": "NVFlare's memory tuning",
    "enable_tensor_disk_offload": "NVFlare's memory tuning; flare-airflow streams updates from the store",
    "ignore_result_error": "a failed site does not count; min_clients decides",
    "allow_empty_global_weights": "the initial model is required",
}
WORKFLOW_ARGS_REFUSED = {
    "stop_cond": ("early stopping is not carried over", "remove stop_cond and patience"),
    "patience": ("early stopping is not carried over", "remove stop_cond and patience"),
    "exclude_vars": ("every tensor of the model is averaged in flare-airflow", "remove exclude_vars"),
    "fedprox_mu": ("FedProx's proximal term is not carried over", "add the proximal term to the client's loss"),
    "aggregator": ("a custom aggregator object is not carried over", "use the default weighted FedAvg"),
    "model": (
        "an initial model given inline to the workflow is not read",
        "save it as safetensors and pass --initial-model FILE",
    ),
}
# Components whose job flare-airflow does another way: carried over as a note each.
NOTED = {
    "IntimeModelSelector": "flare-airflow publishes the last round's global model, not the best one by a metric",
    "MetricsArtifactWriter": "the rounds' metrics are written to the run's metrics.json",
    "TBAnalyticsReceiver": "tracking scalars land in the round's metrics (metrics.json), not TensorBoard",
    "MLflowReceiver": "tracking scalars land in the round's metrics (metrics.json); publish them with MLflow there",
    "WandBReceiver": "tracking scalars land in the round's metrics (metrics.json)",
    "ValidationJsonGenerator": "cross-site validation results are not produced",
    "PTFileModelLocator": "cross-site evaluation's model locator is not needed",
    "NPModelLocator": "cross-site evaluation's model locator is not needed",
    "NPFormatter": "cross-site evaluation's formatter is not needed",
    "CellPipe": "NVFlare's pipe between its client and the script: the Client API reads the FLARE_* variables instead",
    "FilePipe": "NVFlare's pipe between its client and the script: the Client API reads the FLARE_* variables instead",
    "MetricRelayer": "tracking scalars travel with the update (its metrics)",
    "ExternalConfigurator": "the Client API's configuration comes from the site job's environment",
    "ConvertToFedEvent": "tracking events are not relayed to the server; scalars land in the round's metrics",
}
SUPPORTED_TRANSFER = ("FULL", "DIFF")
EXCHANGE_FORMATS = {"numpy": "numpy", "pytorch": "pytorch"}
_JOB_NAME = re.compile(r"[^a-z0-9_-]+")


@dataclass
class ImportResult:
    job_file: Path
    dag_file: Path
    job_dir: Path
    job: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    site_policy: Path | None = None  # the NVFlare filters as each site's privacy filters (site policy)


@dataclass
class _Reading:
    """What the importer found, and what it refuses, before anything is written."""

    refused: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def refuse(self, where: Where | Path, what: str, why: str, todo: str) -> None:
        self.refused.append(f"{where}: {what}: {why}; {todo}")

    def note(self, where: Where | Path, what: str, how: str) -> None:
        self.notes.append(f"{where}: {what}: {how}")


def _job_name(raw: str) -> str:
    name = _JOB_NAME.sub("-", raw.lower()).strip("-_")
    return name or "nvflare-job"


def _app_config(job_dir: Path, app: str, stem: str) -> ConfigFile:
    folder = job_dir / app / "config"
    path = find_config(folder, stem, job_dir)
    if path is None:
        raise NvflareJobError(
            f"{folder}: no {stem}.json or {stem}.conf; the deploy_map names app {app!r}, which NVFlare reads from there"
        )
    return read_config(path)


def _sites_of(job_dir: Path, meta: ConfigFile, sites: Sequence[str] | None) -> tuple[str | None, dict[str, list[str]]]:
    """The server app, and each client app's sites."""
    deploy_map = meta.data.get("deploy_map")
    if not isinstance(deploy_map, Mapping) or not deploy_map:
        raise NvflareJobError(f"{meta.path}:{meta.line_of('deploy_map')}: deploy_map is missing or empty")
    server_app: str | None = None
    clients: dict[str, list[str]] = {}
    for app, targets in deploy_map.items():
        if not plain_name(str(app)):
            raise NvflareJobError(
                f"{meta.path}:{meta.line_of(str(app))}: deploy_map app {str(app)[:80]!r} is not a folder name of the "
                "job (an app is a folder beside meta.json: no '/', '..' or absolute path); fix the name"
            )
        inside(job_dir, job_dir / str(app), f"app folder {app!r}")
        if not isinstance(targets, list):
            raise NvflareJobError(
                f"{meta.path}:{meta.line_of(str(app))}: deploy_map[{app!r}] must be a list of targets"
            )
        for target in targets:
            if target == SERVER:
                server_app = str(app)
            elif target == ALL_SITES:
                # NVFlare's @ALL is the server and every client; the server part is the app's server config.
                if find_config(job_dir / str(app) / "config", "config_fed_server", job_dir) is not None:
                    server_app = str(app)
                if not sites:
                    raise NvflareJobError(
                        f"{meta.path}:{meta.line_of(ALL_SITES)}: deploy_map[{app!r}] deploys to {ALL_SITES}; "
                        "a flare-airflow job names its sites: pass them, e.g. --sites site-1,site-2"
                    )
                clients.setdefault(str(app), []).extend(sites)
            else:
                clients.setdefault(str(app), []).append(str(target))
    named = [s for group in clients.values() for s in group]
    if sites and sorted(set(sites)) != sorted(set(named)):
        raise NvflareJobError(
            f"{meta.path}: --sites {','.join(sites)} differ from the deploy_map's sites "
            f"{','.join(sorted(set(named)))}; "
            "--sites is for @ALL deploy maps: leave it out, or edit the deploy_map"
        )
    return server_app, clients


def _split(line: str) -> list[str] | None:
    """A command line's words as a POSIX shell splits them; None when it cannot (an unclosed quote)."""
    try:
        return shlex.split(line)
    except ValueError:
        return None


def _script_of_command(command: str | list[str]) -> tuple[str, list[str]] | None:
    """``python3 -u custom/train.py --epochs 2`` -> (``custom/train.py``, ``["--epochs", "2"]``)."""
    tokens = (_split(command) or []) if isinstance(command, str) else [str(t) for t in command]
    for index, token in enumerate(tokens):
        if token.endswith(".py"):
            return token, tokens[index + 1 :]
    return None


@dataclass
class _Trainer:
    script: str  # relative to the client app's custom/ folder
    args: list[str]
    exchange: str
    transfer: str
    where: Where


def _custom_relative(script: str) -> str | None:
    """Where NVFlare finds the script in the app: ``custom/x.py``, or the exporting machine's
    absolute path of a file the Job API copied into ``custom/`` (its name); None when the path
    climbs out of ``custom/`` (``../..``)."""
    relative = Path(script).name if script.startswith("/") else script.removeprefix("custom/")
    return relative if relative_inside(relative) and plain_name(Path(relative).name) else None


def _executor_trainer(
    executor: Component, components: dict[str, Component], used: set[str], reading: _Reading
) -> _Trainer | None:
    """The trainer of a Client API executor (2.9's ClientAPIExecutor, 2.5-2.8's in-process or launcher one)."""
    args = executor.args
    name = executor.class_name
    exchange = str(args.get("params_exchange_format", "numpy")).lower()
    if exchange not in EXCHANGE_FORMATS:
        reading.refuse(
            executor.where,
            f"params_exchange_format {exchange!r}",
            "flare-airflow exchanges tensors (numpy arrays or torch tensors) through safetensors",
            "use params_exchange_format numpy or pytorch",
        )
        return None
    transfer = str(args.get("params_transfer_type", "FULL")).upper()
    if transfer not in SUPPORTED_TRANSFER:
        reading.refuse(executor.where, f"params_transfer_type {transfer!r}", "unknown", "use FULL or DIFF")
        return None
    launch_once = bool(args.get("launch_once", True))
    where = executor.where
    if (name == CLIENT_API_EXECUTOR and args.get("execution_mode") == "external_process") or name in LAUNCHER_EXECUTORS:
        if name == CLIENT_API_EXECUTOR:
            command: Any = args.get("command")
        else:
            launcher_id = str(args.get("launcher_id", "launcher"))
            launcher = components.get(launcher_id)
            used.add(launcher_id)
            if launcher is None or launcher.class_name not in LAUNCHERS:
                reading.refuse(
                    launcher.where if launcher else executor.where,
                    f"launcher {launcher.path if launcher else launcher_id!r}",
                    "only NVFlare's SubprocessLauncher (a script command line) is carried over",
                    "launch the client script with SubprocessLauncher, or use ScriptRunner",
                )
                return None
            command, where = launcher.args.get("script"), launcher.where
            launch_once = bool(launcher.args.get("launch_once", launch_once))
        parsed = _script_of_command(command) if isinstance(command, str | list) else None
        if parsed is None:
            reading.refuse(
                where,
                f"command {command!r}",
                "no Python script in the command line",
                "the client must run `python custom/<script>.py ARGS`",
            )
            return None
        script, script_args = parsed
    elif name == CLIENT_API_EXECUTOR and args.get("execution_mode", "in_process") != "in_process":
        reading.refuse(
            executor.where,
            f"execution_mode {args.get('execution_mode')!r}",
            "unknown",
            "use in_process or external_process",
        )
        return None
    else:
        path = args.get("task_script_path")
        if not isinstance(path, str) or not path:
            reading.refuse(executor.where, executor.path, "no task_script_path", "name the client script")
            return None
        script = path
        split_args = _split(str(args.get("task_script_args") or ""))
        if split_args is None:
            reading.refuse(executor.where, "task_script_args", "an unclosed quote", "close the quote")
            return None
        script_args = split_args
    if launch_once:
        reading.note(
            where,
            "launch_once",
            "NVFlare runs the client script once for all rounds; flare-airflow runs it once per round "
            "(state kept in memory across rounds starts afresh each round)",
        )
    relative = _custom_relative(script)
    if relative is None:
        reading.refuse(
            where,
            f"client script {script[:120]!r}",
            "it lies outside the client app's custom/ folder",
            "put the script in custom/ and name it custom/<script>.py",
        )
        return None
    return _Trainer(relative, script_args, EXCHANGE_FORMATS[exchange], transfer, where)


def _read_client(cfg: ConfigFile, reading: _Reading) -> tuple[_Trainer | None, list[dict[str, Any]]]:
    components = {c.id: c for c in cfg.components("components")}
    used: set[str] = set()
    trainer: _Trainer | None = None
    executors = cfg.data.get("executors") or []
    if not isinstance(executors, list) or not executors:
        reading.refuse(cfg.path, "executors", "the client config has no executor", "add a Client API executor")
        return None, []
    for index, entry in enumerate(executors):
        raw = entry.get("executor") if isinstance(entry, Mapping) else None
        executor = cfg.component(raw, f"executors[{index}].executor")
        tasks = entry.get("tasks", ["*"]) if isinstance(entry, Mapping) else []
        if executor.class_name not in {CLIENT_API_EXECUTOR} | IN_PROCESS_EXECUTORS | LAUNCHER_EXECUTORS:
            reading.refuse(
                executor.where,
                f"executor {executor.path} (tasks {tasks})",
                "only NVFlare's Client API executors (ScriptRunner's) are carried over",
                "rewrite the executor's work as a Client API script (flare.receive()/flare.send()) "
                "and use ScriptRunner",
            )
            continue
        if trainer is not None:
            reading.refuse(
                executor.where,
                f"executor {executor.path} (tasks {tasks})",
                "a second Client API executor: flare-airflow runs one trainer script per job",
                "keep one executor for the train task",
            )
            continue
        trainer = _executor_trainer(executor, components, used, reading)
    filters = _filters(cfg, reading, client=True)
    for cid, component in components.items():
        if cid not in used:  # the launcher was carried over (or refused) with its executor
            _known_or_refused(component, reading)
    return trainer, filters


def _exclude_vars(f: Component, reading: _Reading) -> dict[str, Any] | None:
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


def _percentile(f: Component, reading: _Reading) -> dict[str, Any] | None:
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


def _filters(cfg: ConfigFile, reading: _Reading, *, client: bool) -> list[dict[str, Any]]:
    """The client's result filters as privacy filters of its sites; anything else refused by name.

    A client's ``task_result_filters`` change what leaves the site: flare-airflow's site filters
    do the same, chosen by the site's policy and applied in the site task (a trainer cannot skip
    them). Filters on what a site receives, and the server's filters, have no equivalent.
    """
    mapped: list[dict[str, Any]] = []
    for key in ("task_data_filters", "task_result_filters"):
        for index, group in enumerate(cfg.data.get(key) or []):
            raws = group.get("filters", []) if isinstance(group, Mapping) else []
            tasks = group.get("tasks", ["*"]) if isinstance(group, Mapping) else ["*"]
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


def _known_or_refused(component: Component, reading: _Reading) -> None:
    hint = NOTED.get(component.class_name)
    if hint:
        reading.note(component.where, component.path, hint)
    else:
        reading.refuse(
            component.where,
            f"component {component.id!r} ({component.path})",
            "flare-airflow has no equivalent",
            "remove it from the job, or do its work in the client script",
        )


@dataclass
class _Server:
    rounds: int | None = None
    min_clients: int | None = None
    initial: dict[str, np.ndarray] | None = None
    weights: dict[str, float] = field(default_factory=dict)


def _read_server(cfg: ConfigFile, reading: _Reading, *, have_initial_model: bool) -> _Server:
    server = _Server()
    components = {c.id: c for c in cfg.components("components")}
    workflows = list(cfg.components("workflows"))
    if not workflows:
        reading.refuse(cfg.path, "workflows", "the server config has no workflow", "add a FedAvg workflow")
    used: set[str] = set()
    fedavg: Component | None = None
    for wf in workflows:
        if wf.class_name not in FEDAVG_WORKFLOWS or fedavg is not None:
            why = REFUSED_WORKFLOW_HINT.get(
                wf.class_name,
                "a second workflow" if fedavg is not None else "flare-airflow runs FedAvg rounds only",
            )
            reading.refuse(
                wf.where,
                f"workflow {wf.path}",
                why,
                "keep one FedAvg (or ScatterAndGather) workflow; other controllers run in NVFlare itself",
            )
            continue
        fedavg = wf
    if fedavg is None:
        return server
    args = fedavg.args
    rounds = args.get("num_rounds")
    server.rounds = rounds if _whole(rounds) and rounds > 0 else None
    if server.rounds is None:
        reading.refuse(fedavg.where, f"{fedavg.path} num_rounds", f"is {rounds!r}", "set a whole number >= 1")
    for key in ("min_clients", "num_clients"):
        value = args.get(key)
        if value is not None and not (_whole(value) and value >= 0):
            reading.refuse(fedavg.where, f"{fedavg.path} {key}", f"is {value!r}", "set a whole number >= 1")
        elif server.min_clients is None and _whole(value) and value > 0:
            server.min_clients = value
    for key, value in args.items():
        if key in WORKFLOW_ARGS_REFUSED and value not in (None, "", {}, []):
            why, todo = WORKFLOW_ARGS_REFUSED[key]
            reading.refuse(fedavg.where, f"{fedavg.class_name} {key}", why, todo)
        elif key not in WORKFLOW_ARGS_CARRIED and key not in WORKFLOW_ARGS_REFUSED:
            reading.note(fedavg.where, f"{fedavg.class_name} {key}={value!r}", "not carried over (no equivalent)")
    if args.get("start_round") not in (None, 0) or isinstance(args.get("start_round"), bool):
        reading.refuse(
            fedavg.where,
            f"{fedavg.path} start_round {args['start_round']!r}",
            "an imported job starts at round 0",
            "remove start_round (resume a flare-airflow run instead)",
        )
    _weights(fedavg, server, reading)
    # FedAvg (2.9) finds its persistor under the id "persistor" unless told otherwise.
    if fedavg.class_name != "ScatterAndGather":
        args = {"persistor_id": "persistor", **args}
    for key, kinds in (
        ("persistor_id", MODEL_PERSISTORS),
        ("aggregator_id", AGGREGATORS),
        ("shareable_generator_id", SHAREABLE_GENERATORS),
    ):
        cid = args.get(key)
        if not cid:
            continue
        used.add(str(cid))
        component = components.get(str(cid))
        if component is None and key == "persistor_id" and "persistor_id" not in fedavg.args:
            continue  # FedAvg without a persistor: the initial model must come from --initial-model
        if component is None:
            reading.refuse(fedavg.where, f"{key} {cid!r}", "no component has this id", "fix the id")
            continue
        if component.class_name not in kinds:
            reading.refuse(
                component.where,
                f"{key.removesuffix('_id')} {component.path}",
                "not one flare-airflow can carry over",
                f"use one of {', '.join(sorted(kinds))}",
            )
            continue
        if key == "persistor_id":
            server.initial = _initial_model(component, reading, have_initial_model=have_initial_model)
        elif key == "aggregator_id":
            _aggregator(component, server, reading)
    _filters(cfg, reading, client=False)
    for cid, component in components.items():
        if cid not in used:
            _known_or_refused(component, reading)
    return server


def _initial_model(
    component: Component, reading: _Reading, *, have_initial_model: bool
) -> dict[str, np.ndarray] | None:
    if have_initial_model:
        return None
    if component.class_name in NP_PERSISTORS:
        if component.args.get("source_ckpt_file_full_name"):
            reading.refuse(
                component.where,
                f"persistor {component.path} source_ckpt_file_full_name",
                "the checkpoint is a path on NVFlare's server",
                "pass that checkpoint as a safetensors file: --initial-model FILE",
            )
            return None
        initial = component.args.get("model")
        if initial is None:
            initial = NVFLARE_DEFAULT_MODEL
            reading.note(component.where, component.path, "no model given: NVFlare's default 3 x 3 array, as NVFlare")
        # NVFlare's NPModelPersistor holds the model as float32 (np.array(model, dtype=np.float32)).
        model, why = inline_model(initial)
        if why is not None:
            reading.refuse(
                component.where,
                f"persistor {component.path} model",
                f"it {why}",
                "give nested lists of numbers of one shape, or pass --initial-model FILE (safetensors)",
            )
        return model
    reading.refuse(
        component.where,
        f"persistor {component.path}",
        "it builds the initial model from framework code (e.g. a torch.nn.Module class) on the server",
        "save that model's state_dict as safetensors "
        "(safetensors.torch.save_file(Net().state_dict(), 'init.safetensors')) "
        "and pass --initial-model init.safetensors",
    )
    return None


def _whole(value: Any) -> TypeGuard[int]:
    """An integer, and not a bool (``true`` is no round count, though Python's bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _weights(component: Component, server: _Server, reading: _Reading) -> None:
    """``aggregation_weights``: each site's finite, non-negative weight."""
    weights = component.args.get("aggregation_weights")
    if weights is None:
        return
    if not isinstance(weights, Mapping):
        reading.refuse(
            component.where,
            f"{component.path} aggregation_weights",
            f"is {type(weights).__name__}, not an object of site: weight",
            "write {site-1: 1.0, site-2: 2.0}",
        )
        return
    for site, weight in weights.items():
        number = float(weight) if isinstance(weight, numbers.Real) and not isinstance(weight, bool) else math.nan
        if not (math.isfinite(number) and number >= 0):
            reading.refuse(
                component.where,
                f"{component.path} aggregation_weights[{str(site)[:60]!r}]",
                f"is {str(weight)[:40]!r}, not a finite number >= 0",
                "give each site a number",
            )
            continue
        server.weights[str(site)] = number


def _aggregator(component: Component, server: _Server, reading: _Reading) -> None:
    args = component.args
    if args.get("exclude_vars"):
        reading.refuse(
            component.where,
            f"{component.path} exclude_vars",
            "every tensor of the model is averaged in flare-airflow",
            "remove exclude_vars",
        )
    _weights(component, server, reading)
    kind = args.get("expected_data_kind", "WEIGHTS")
    if kind not in ("WEIGHTS", "WEIGHT_DIFF"):
        reading.refuse(
            component.where,
            f"{component.path} expected_data_kind {kind!r}",
            "flare-airflow aggregates weights (FULL) or weight differences (DIFF)",
            "use WEIGHTS or WEIGHT_DIFF",
        )


def _site_blocks(meta: ConfigFile, sites: list[str]) -> dict[str, dict[str, Any]]:
    """``resource_spec`` and ``launcher_spec`` of meta.json as the job's ``sites`` entries."""
    blocks: dict[str, dict[str, Any]] = {site: {} for site in sites}
    for field_name, defaults in (
        ("resource_spec", ("@default", "default", ALL_SITES)),
        ("launcher_spec", ("default", "@default")),
    ):
        specs = meta.data.get(field_name)
        if specs is None:
            continue
        if not isinstance(specs, Mapping):
            raise NvflareJobError(
                f"{meta.path}:{meta.line_of(field_name)}: {field_name} is {type(specs).__name__}, not an object of "
                f"site: {{...}}; fix it"
            )
        for key, spec in specs.items():
            if not isinstance(spec, Mapping):
                raise NvflareJobError(
                    f"{meta.path}:{meta.line_of(str(key))}: {field_name}[{str(key)[:60]!r}] is {type(spec).__name__} "
                    f"{str(spec)[:40]!r}, not an object (e.g. {{num_of_gpus: 1}}); fix it"
                )
            target = "@default" if key in defaults else str(key)
            blocks.setdefault(target, {})[field_name] = dict(spec)
    unknown = sorted(set(blocks) - set(sites) - {"@default"})
    if unknown:
        raise NvflareJobError(
            f"{meta.path}:{meta.line_of(unknown[0])}: resource_spec/launcher_spec name sites {unknown} "
            "that the deploy_map does not deploy to; fix the names"
        )
    return blocks


def import_job(
    job_dir: Path,
    out_dir: Path,
    *,
    sites: Sequence[str] | None = None,
    initial_model: Path | None = None,
    name: str | None = None,
    force: bool = False,
) -> ImportResult:
    """Read ``job_dir`` and write the flare-airflow job into ``out_dir``; raise :class:`NvflareJobError` if refused."""
    job_dir = job_dir.resolve()
    meta_path = find_config(job_dir, "meta", job_dir)
    if meta_path is None:
        raise NvflareJobError(f"{job_dir}: no meta.json or meta.conf: this is not an NVFlare job folder")
    meta = read_config(meta_path)
    server_app, client_apps = _sites_of(job_dir, meta, sites)
    reading = _Reading()
    if server_app is None:
        raise NvflareJobError(f"{meta.path}: the deploy_map deploys no app to 'server'")
    if not client_apps:
        raise NvflareJobError(f"{meta.path}: the deploy_map deploys no app to a site")
    if initial_model is not None:
        check_initial_model(initial_model)
    server = _read_server(
        _app_config(job_dir, server_app, "config_fed_server"), reading, have_initial_model=initial_model is not None
    )
    trainers: dict[str, _Trainer | None] = {}
    site_filters: dict[str, list[dict[str, Any]]] = {}
    for app in client_apps:
        trainers[app], filters = _read_client(_app_config(job_dir, app, "config_fed_client"), reading)
        for site in client_apps[app]:
            if filters:
                site_filters[site] = filters
    found = {app: t for app, t in trainers.items() if t is not None}
    scripts = {app: _script_file(job_dir, app, t, reading) for app, t in found.items()}
    first_app = next(iter(found), None)
    if first_app is not None:
        first = found[first_app]
        for app, other in found.items():
            same = (other.script, other.args, other.exchange, other.transfer) == (
                first.script,
                first.args,
                first.exchange,
                first.transfer,
            )
            if same and scripts[app] is not None and scripts[first_app] is not None:
                same = scripts[app].read_bytes() == scripts[first_app].read_bytes()  # type: ignore[union-attr]
            if not same:
                reading.refuse(
                    other.where,
                    f"client app {app!r}",
                    f"its client script or settings differ from app {first_app!r}'s",
                    "flare-airflow runs one trainer per job: give every site the same script "
                    "(site-specific behaviour from flare.get_site_name())",
                )
    if reading.refused:
        raise NvflareJobError(
            f"NVFlare job {job_dir} cannot be imported; {len(reading.refused)} thing(s) to change:\n  "
            + "\n  ".join(reading.refused)
        )
    assert first_app is not None and server.rounds is not None
    script_file = scripts[first_app]
    assert script_file is not None
    trainer = found[first_app]
    site_names = [s for app in client_apps for s in client_apps[app]]
    job_name = _job_name(name or str(meta.data.get("name") or job_dir.name))
    meta_min = meta.data.get("min_clients")
    if meta_min is not None and not (_whole(meta_min) and meta_min >= 0):
        raise NvflareJobError(
            f"{meta.path}:{meta.line_of('min_clients')}: min_clients is {meta_min!r}; set a whole number"
        )
    min_clients = server.min_clients or meta_min or len(site_names)

    out_dir = out_dir.resolve()
    job_file = out_dir / f"{job_name}.yaml"
    dag_file = out_dir / f"{job_name}_dag.py"
    files_dir = out_dir / job_name
    policy_file = out_dir / f"{job_name}.site-policy.yaml" if site_filters else None
    names = [files_dir.name, job_file.name, dag_file.name] + ([policy_file.name] if policy_file else [])
    check_targets(out_dir, names, force=force)
    sites_block = _site_blocks(meta, site_names)
    for site, weight in server.weights.items():
        if site in sites_block:
            sites_block[site]["weight"] = weight

    for note in (f.describe(str(script_file)) for f in check_file(script_file)):
        reading.notes.append(note)
    job: dict[str, Any] = {
        "job": job_name,
        "rounds": server.rounds,
        "min_clients": min_clients,
        "initial_model": f"{job_name}/initial_model.safetensors",
        "trainer": {
            "script": f"{job_name}/custom/{trainer.script}",
            "args": trainer.args,
            "nvflare": {"params_exchange": trainer.exchange, "transfer": trainer.transfer},
        },
        "evaluate": False,
        "sites": sites_block,
    }
    if policy_file is not None:
        reading.notes.append(
            f"{policy_file}: NVFlare's client filters are site policy in flare-airflow (each site's admin "
            "chooses them; the site task applies them, so a trainer cannot skip them): the job carries none -- "
            "give each site's admin its privacy block to merge into the site's policy (FLARE_SITE_CONFIG)"
        )
    with staging_folder(out_dir, job_name) as staging:
        files = staging / job_name
        files.mkdir()
        copy_custom(job_dir / first_app / "custom", files / "custom", job_dir)
        if initial_model is not None:
            (files / "initial_model.safetensors").write_bytes(initial_model.read_bytes())
        else:
            from safetensors.numpy import save_file

            assert server.initial is not None
            save_file(server.initial, str(files / "initial_model.safetensors"))
        header = [f"# Imported from the NVFlare job {job_dir} by `flare-airflow import-nvflare`."]
        header += [f"# note: {n}" for n in reading.notes]
        staged_job = staging / job_file.name
        staged_job.write_text("\n".join(header) + "\n" + yaml.safe_dump(job, sort_keys=False))
        try:  # as flare-airflow will load it: paths resolve against the job file's folder
            load_job(staged_job)
        except ConfigError as exc:
            raise NvflareJobError(
                f"the job imported from {job_dir} is not a valid flare-airflow job: {exc}\n"
                f"(from {meta.path}: check its resource_spec / launcher_spec)"
            ) from None
        if policy_file is not None:
            _write_site_policy(staging / policy_file.name, job_dir, site_filters)
        (staging / dag_file.name).write_text(
            f'"""The NVFlare job {job_name!r} imported by flare-airflow import-nvflare, as an Airflow DAG."""\n\n'
            "from pathlib import Path\n\n"
            "from flare_airflow.builder import build_dag\n\n"
            f"dag = build_dag(Path(__file__).with_name({job_file.name!r}))\n"
        )
        move_into_place(staging, out_dir, names)
    return ImportResult(job_file, dag_file, files_dir, job, reading.notes, policy_file)


def _script_file(job_dir: Path, app: str, trainer: _Trainer, reading: _Reading) -> Path | None:
    """The client script of ``app``, refused unless it is a file inside the app's ``custom/``."""
    custom = job_dir / app / "custom"
    path = custom / trainer.script
    if not (path.is_symlink() or path.exists()):
        reading.refuse(trainer.where, f"client script {trainer.script}", "not found", f"put it in {path.parent}")
        return None
    real = inside(job_dir, path, f"client script {trainer.script}")
    if not real.is_relative_to(inside(job_dir, custom, "custom/")) or not real.is_file():
        reading.refuse(
            trainer.where,
            f"client script {trainer.script}",
            "not a file inside the client app's custom/ folder",
            f"put it in {custom}",
        )
        return None
    return real


def _write_site_policy(path: Path, job_dir: Path, site_filters: Mapping[str, list[dict[str, Any]]]) -> None:
    """The sites' privacy filters as a site-policy snippet, validated as a site policy file."""
    policy = {"sites": {site: {"privacy": {"filters": filters}} for site, filters in site_filters.items()}}
    SitePolicy.model_validate(policy)
    header = (
        f"# The task result filters of the NVFlare job {job_dir}, as flare-airflow site policy\n"
        "# (written by `flare-airflow import-nvflare`). Filters are each site's admin's choice in\n"
        "# flare-airflow: merge a site's privacy block into that site's policy file (FLARE_SITE_CONFIG,\n"
        "# docs/privacy.md), where public_metrics also lists the metrics allowed to leave.\n"
    )
    path.write_text(header + yaml.safe_dump(policy, sort_keys=False))


def describe(result: ImportResult) -> str:
    lines = [
        f"wrote {result.job_file}",
        f"wrote {result.dag_file}",
        f"wrote {result.job_dir}/ (the client app's custom/ folder and initial_model.safetensors)",
        f"run it with: flare-airflow run flare_{result.job['job'].replace('-', '_')}",
    ]
    if result.site_policy is not None:
        lines.insert(3, f"wrote {result.site_policy} (the job's NVFlare filters as the sites' privacy policy)")
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)
