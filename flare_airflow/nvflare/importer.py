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
The server app is read in :mod:`.server_app`, the client app in :mod:`.client_app`, its filters in
:mod:`.filters`; this module reads ``meta.json``, puts the job together and writes it.

The clients' result filters that have an equivalent (``ExcludeVars``, ``PercentilePrivacy``) are
site policy here: they go to ``OUT/<job>.site-policy.yaml`` for the sites' admins, not into the job.
Components whose work flare-airflow does another way (NVFlare's pipes and launchers, model
selectors, tracking receivers) are carried over as notes, never silently.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flare_airflow.core.config import load_job
from flare_airflow.core.config.policy import SitePolicy
from flare_airflow.core.errors import ConfigError
from flare_airflow.core.nvflare.state_check import check_file
from flare_airflow.nvflare.client_app import Trainer, read_client
from flare_airflow.nvflare.configs import ConfigFile, find_config, read_config
from flare_airflow.nvflare.errors import NvflareJobError
from flare_airflow.nvflare.model import check_initial_model
from flare_airflow.nvflare.output import check_targets, move_into_place, staging_folder
from flare_airflow.nvflare.paths import copy_custom, inside, plain_name
from flare_airflow.nvflare.reading import Reading, whole
from flare_airflow.nvflare.server_app import read_server

__all__ = ["ImportResult", "NvflareJobError", "import_job"]

SERVER = "server"
ALL_SITES = "@ALL"
_JOB_NAME = re.compile(r"[^a-z0-9_-]+")


@dataclass
class ImportResult:
    job_file: Path
    dag_file: Path
    job_dir: Path
    job: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    site_policy: Path | None = None  # the NVFlare filters as each site's privacy filters (site policy)


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
    reading = Reading()
    if server_app is None:
        raise NvflareJobError(f"{meta.path}: the deploy_map deploys no app to 'server'")
    if not client_apps:
        raise NvflareJobError(f"{meta.path}: the deploy_map deploys no app to a site")
    if initial_model is not None:
        check_initial_model(initial_model)
    server = read_server(
        _app_config(job_dir, server_app, "config_fed_server"), reading, have_initial_model=initial_model is not None
    )
    trainers: dict[str, Trainer | None] = {}
    site_filters: dict[str, list[dict[str, Any]]] = {}
    for app in client_apps:
        trainers[app], filters = read_client(_app_config(job_dir, app, "config_fed_client"), reading)
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
    if meta_min is not None and not (whole(meta_min) and meta_min >= 0):
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


def _script_file(job_dir: Path, app: str, trainer: Trainer, reading: Reading) -> Path | None:
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
