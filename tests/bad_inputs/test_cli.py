"""Bad command lines and bad files given to ``flare-airflow``: an error line, a non-zero exit, no traceback.

The commands run in this process (``flare_airflow.cli.main``), as the console script runs them.
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flare_airflow.cli import main
from flare_airflow.core.trust.keys import public_jwk
from flare_airflow_testing.harness import AirflowHome
from tests.bad_inputs.cases import Case, assert_clear

REPO = pathlib.Path(__file__).resolve().parents[2]
INITIAL_MODEL = REPO / "examples" / "digits" / "initial_model.safetensors"
JOB = """\
job: demo
rounds: 3
min_clients: 1
initial_model: init.safetensors
trainer: {script: train.py}
sites: {site-1: {}, site-2: {}}
"""
ROW = {"round": 1, "sites_valid": 2, "sites_total": 2}


@dataclass(frozen=True)
class Bad:
    argv: list[str]  # "{dir}" stands for the test's directory
    files: dict[str, bytes | str | None]  # name -> content; None: a directory; "->x": a symlink to x
    code: int = 2
    # The DAG file lies outside Airflow's DAGs folder (another, empty one), in an Airflow home that
    # loads the example DAGs (Airflow's default without AIRFLOW__CORE__LOAD_EXAMPLES=False).
    outside_with_examples: bool = False


CASES: list[Case] = []
INPUTS: dict[str, Bad] = {}


def case(
    id: str,
    bad_input: str,
    error: str,
    argv: list[str],
    files: dict[str, Any] | None = None,
    code: int = 2,
    outside_with_examples: bool = False,
) -> None:
    CASES.append(Case(id, "cli", bad_input, error))
    INPUTS[id] = Bad(argv, files or {}, code, outside_with_examples)


case(
    "validate-missing-file",
    "flare-airflow validate on a file that does not exist",
    "cannot read the job file (No such file or directory)",
    ["validate", "{dir}/nope.yaml"],
)
case(
    "validate-directory",
    "flare-airflow validate on a directory",
    "is a directory; give the job's YAML file",
    ["validate", "{dir}/jobs"],
    {"jobs": None},
)
case(
    "validate-binary-file",
    "flare-airflow validate on a binary file",
    "not a text file (byte 1 is not UTF-8)",
    ["validate", "{dir}/job.yaml"],
    {"job.yaml": b"\x00\xff\xfe"},
)
case(
    "validate-config-error",
    "flare-airflow validate; rounds: true",
    "rounds: must be an integer, got true",
    ["validate", "{dir}/job.yaml"],
    {"job.yaml": JOB.replace("rounds: 3", "rounds: true")},
)
case(
    "validate-initial-model-pickle",
    "flare-airflow validate; the initial model is a pickle",
    "this is a pickle/torch.save payload",
    ["validate", "{dir}/job.yaml"],
    {"job.yaml": JOB, "init.safetensors": b"\x80\x04K\x01."},
)
case(
    "validate-initial-model-nan",
    "flare-airflow validate; the initial model holds NaN",
    "has NaN or infinite values",
    ["validate", "{dir}/job.yaml"],
    {"job.yaml": JOB, "init.safetensors": "nan-model"},
)
case(
    "validate-bad-schedule",
    "flare-airflow validate; schedule: 'daily'",
    "schedule 'daily' is not a cron expression",
    ["validate", "{dir}/job.yaml"],
    {"job.yaml": JOB + "schedule: daily\n"},
)
case(
    "validate-no-argument",
    "flare-airflow validate with no job file",
    "the following arguments are required: job",
    ["validate"],
)
case("unknown-command", "flare-airflow valdate (typo)", "invalid choice: 'valdate'", ["valdate", "job.yaml"])
case(
    "report-missing-file",
    "flare-airflow report on a file that does not exist",
    "cannot read it (No such file or directory); give the metrics.json of a run",
    ["report", "{dir}/metrics.json"],
)
case(
    "report-directory",
    "flare-airflow report on a directory",
    "cannot read it (Is a directory)",
    ["report", "{dir}/final"],
    {"final": None},
)
case(
    "report-empty-file",
    "flare-airflow report on an empty file",
    "the file is empty",
    ["report", "{dir}/metrics.json"],
    {"metrics.json": ""},
)
case(
    "report-not-json",
    "flare-airflow report on a YAML file",
    "not JSON (Expecting value",
    ["report", "{dir}/metrics.json"],
    {"metrics.json": "rounds: []\n"},
)
case(
    "report-binary",
    "flare-airflow report on a binary file",
    "not JSON (",
    ["report", "{dir}/metrics.json"],
    {"metrics.json": b"\x89PNG\xff"},
)
case(
    "report-json-list",
    "flare-airflow report on a JSON list",
    "not a metrics.json of flare-airflow (expected an object with a 'rounds' list; got list)",
    ["report", "{dir}/metrics.json"],
    {"metrics.json": "[1, 2]"},
)
case(
    "report-wrong-object",
    "flare-airflow report on another JSON object (latest.json)",
    "expected an object with a 'rounds' list; got keys run_id, model_uri",
    ["report", "{dir}/metrics.json"],
    {"metrics.json": json.dumps({"run_id": "r", "model_uri": "m"})},
)
case(
    "report-row-missing-keys",
    "flare-airflow report; a round lacks sites_valid",
    "rounds[0] lacks sites_valid, sites_total",
    ["report", "{dir}/metrics.json"],
    {"metrics.json": json.dumps({"rounds": [{"round": 1}]})},
)
case(
    "report-row-not-object",
    "flare-airflow report; a round is a number",
    "rounds[1] must be an object, got int",
    ["report", "{dir}/metrics.json"],
    {"metrics.json": json.dumps({"rounds": [ROW, 7]})},
)
case(
    "report-evaluation-not-object",
    "flare-airflow report; a round's evaluation is a list",
    "rounds[0].evaluation must be an object, got list",
    ["report", "{dir}/metrics.json"],
    {"metrics.json": json.dumps({"rounds": [{**ROW, "evaluation": [0.9]}]})},
)
case(
    "run-log-symlink",
    "flare-airflow run --log at a symlink planted by another user",
    "is a symbolic link; refusing to write through it",
    ["run", "flare_demo", "--log", "{dir}/run.log"],
    {"victim": "precious\n", "run.log": "->victim"},
)
case(
    "run-log-missing-directory",
    "flare-airflow run --log in a directory that does not exist",
    "cannot create the log file (No such file or directory)",
    ["run", "flare_demo", "--log", "{dir}/no/run.log"],
)
case(
    "run-log-directory",
    "flare-airflow run --log naming a directory",
    "cannot create the log file (Is a directory)",
    ["run", "flare_demo", "--log", "{dir}/logs"],
    {"logs": None},
)
case(
    "pools-sync-bad-job",
    "flare-airflow pools sync on an invalid job",
    "sites: a job needs at least one site",
    ["pools", "sync", "{dir}/job.yaml"],
    {"job.yaml": JOB.replace("sites: {site-1: {}, site-2: {}}", "sites: []")},
)
case(
    "run-dag-with-config-error",
    "flare-airflow run of a DAG whose job file is invalid (was: 'Dag could not be found')",
    "ConfigError: invalid job configuration:",
    ["run", "flare_broken", "--dagfile", "{dir}/broken_dag.py", "--log", "{dir}/run.log"],
    {
        "job.yaml": JOB.replace("min_clients: 1", "min_clients: false"),
        "broken_dag.py": "from flare_airflow.builder import build_dag\n\n"
        "dag = build_dag(__file__.rsplit('/', 1)[0] + '/job.yaml', dag_id='flare_broken')\n",
    },
    code=1,
)
case(
    "run-dag-outside-with-examples-config-error",
    "flare-airflow run --dagfile outside the DAGs folder, load_examples on, trainer.scirpt in the job "
    "(was: Airflow's ValueError '... is not in the subpath of .../example_dags')",
    "trainer.scirpt: unknown key 'scirpt'",
    ["run", "flare_scirpt", "--dagfile", "{dir}/my-job/dag.py", "--log", "{dir}/run.log"],
    {
        "my-job": None,
        "my-job/job.yaml": JOB.replace("trainer: {script: train.py}", "trainer: {scirpt: ../train.py}"),
        "my-job/dag.py": "from flare_airflow.builder import build_dag\n\n"
        "dag = build_dag(__file__.rsplit('/', 1)[0] + '/job.yaml', dag_id='flare_scirpt')\n",
    },
    code=1,
    outside_with_examples=True,
)

case(
    "run-conf-out-of-range",
    "flare-airflow run --conf '{\"rounds\": 99}' for a 3-round job (was: a JSON schema dump)",
    "--conf refused before a run was created: Invalid input for param rounds: 99 is greater than the maximum of 3",
    ["run", "flare_demo", "--dagfile", "{dir}/demo_dag.py", "--conf", '{"rounds": 99}', "--log", "{dir}/run.log"],
    {
        "job.yaml": JOB,
        "demo_dag.py": "from flare_airflow.builder import build_dag\n\n"
        "dag = build_dag(__file__.rsplit('/', 1)[0] + '/job.yaml', dag_id='flare_demo')\n",
    },
)

NV_META = '{"name": "nv", "deploy_map": {"app": ["@ALL"]}}'
NV_SERVER = (
    '{"workflows": [{"id": "controller", "path": "nvflare.app_common.workflows.fedavg.FedAvg",\n'
    '  "args": {"num_clients": 2, "num_rounds": 2}}], "components": []}'
)
NV_CLIENT = (
    '{"executors": [{"tasks": ["*"], "executor": {"path": '
    '"nvflare.app_common.executors.client_api_executor.ClientAPIExecutor",\n'
    '  "args": {"execution_mode": "in_process", "task_script_path": "client.py"}}}]}'
)
NV_JOB = {
    "nv/meta.json": NV_META,
    "nv/app/config/config_fed_server.json": NV_SERVER,
    "nv/app/config/config_fed_client.json": NV_CLIENT,
    "nv/app/custom/client.py": "import nvflare.client as flare\n",
}
case(
    "import-nvflare-not-a-job",
    "flare-airflow import-nvflare on a folder without meta.json",
    "no meta.json or meta.conf: this is not an NVFlare job folder",
    ["import-nvflare", "{dir}/jobs", "--out", "{dir}/out"],
    {"jobs": None},
)
case(
    "import-nvflare-all-without-sites",
    "flare-airflow import-nvflare; the deploy_map deploys to @ALL and no --sites",
    "a flare-airflow job names its sites: pass them, e.g. --sites site-1,site-2",
    ["import-nvflare", "{dir}/nv", "--out", "{dir}/out"],
    NV_JOB,
)
case(
    "import-nvflare-bad-json",
    "flare-airflow import-nvflare; config_fed_server.json is not JSON",
    "config_fed_server.json:1: not valid JSON",
    ["import-nvflare", "{dir}/nv", "--out", "{dir}/out", "--sites", "site-1,site-2"],
    {**NV_JOB, "nv/app/config/config_fed_server.json": "{workflows: [}"},
)
case(
    "import-nvflare-scaffold",
    "flare-airflow import-nvflare; the server runs NVFlare's Scaffold workflow",
    "config_fed_server.json:1: workflow nvflare.app_common.workflows.scaffold.Scaffold: SCAFFOLD's control",
    ["import-nvflare", "{dir}/nv", "--out", "{dir}/out", "--sites", "site-1,site-2"],
    {**NV_JOB, "nv/app/config/config_fed_server.json": NV_SERVER.replace("fedavg.FedAvg", "scaffold.Scaffold")},
)
case(
    "import-nvflare-svt-filter",
    "flare-airflow import-nvflare; a site's result filter is NVFlare's SVTPrivacy",
    "config_fed_client.json:4: filter nvflare.app_common.filters.svt_privacy.SVTPrivacy (task_result_filters): "
    "the sparse vector technique is not implemented",
    ["import-nvflare", "{dir}/nv", "--out", "{dir}/out", "--sites", "site-1,site-2"],
    {
        **NV_JOB,
        "nv/app/config/config_fed_client.json": NV_CLIENT.removesuffix("}")
        + ',\n "task_result_filters": [{"tasks": ["train"], "filters": [\n'
        '  {"path": "nvflare.app_common.filters.svt_privacy.SVTPrivacy", "args": {"epsilon": 0.1}}]}]}',
    },
)

# A genuine public JWKS of site-1 (a fixed key: the table stays the same from run to run).
_SITE_1 = public_jwk("site-1", Ed25519PrivateKey.from_private_bytes(bytes(range(32))).public_key())
_JWKS = json.dumps({"keys": [_SITE_1]})
case(
    "data-ready-other-site",
    "flare-airflow site data-ready for a site whose signing key is not on this worker (announcing for another site)",
    "a site announces only for itself, signed with its own key",
    ["site", "data-ready", "not-this-worker-site"],
)
case(
    "data-ready-bad-version",
    "flare-airflow site data-ready with a version holding a space and a slash",
    "data version 'v 1/2' is not allowed",
    ["site", "data-ready", "site-1", "--version", "v 1/2"],
)
case(
    "site-keygen-path-name",
    "flare-airflow site keygen with a site name that is a path",
    "'../central' cannot name a party: use the site's name as in the job",
    ["site", "keygen", "../central", "--out", "{dir}/keys"],
)
case(
    "site-keygen-key-exists",
    "flare-airflow site keygen where the site already has a signing key",
    "already holds a signing key; keep it, or make a new one with --rotate",
    ["site", "keygen", "site-1", "--out", "{dir}/keys"],
    {"keys/sites/site-1/sign.pem": "a key"},
)
case(
    "registry-add-registry-not-json",
    "flare-airflow registry add; the registry file is not JSON",
    "registry.json is not JSON",
    ["registry", "add", "{dir}/registry.json", "{dir}/site-1.jwks.json"],
    {"registry.json": "{", "site-1.jwks.json": _JWKS},
)
case(
    "registry-add-private-key",
    "flare-airflow registry add; the JWKS handed in holds a private half ('d')",
    "holds a private key ('d'): enrol only public keys",
    ["registry", "add", "{dir}/registry.json", "{dir}/site-1.jwks.json"],
    {"site-1.jwks.json": json.dumps({"keys": [{**_SITE_1, "d": "c2VjcmV0"}]})},
)
case(
    "registry-add-kid-of-another-party",
    "flare-airflow registry add; a key handed in as site-2's carries site-1's key id",
    "is not this key's id",
    ["registry", "add", "{dir}/registry.json", "{dir}/site-2.jwks.json"],
    {"site-2.jwks.json": json.dumps({"keys": [{**_SITE_1, "flare_party": "site-2"}]})},
)
case(
    "registry-revoke-unknown-kid",
    "flare-airflow registry revoke of a key id the registry does not list",
    "lists no key 'site-1.nope'",
    ["registry", "revoke", "{dir}/registry.json", "site-1.nope"],
    {"registry.json": _JWKS},
)

_SITE_2 = public_jwk("site-2", Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33))).public_key())
_TWO_SITES = {"keys": [_SITE_1, _SITE_2]}
case(
    "registry-grant-queue-of-another-site",
    "flare-airflow registry grant of a queue another site is granted",
    "queue 'hospital-b' is granted to both 'site-1' and 'site-2'; a queue or worker name belongs to one site",
    ["registry", "grant", "{dir}/registry.json", "site-1", "--queues", "hospital-b"],
    {"registry.json": json.dumps({**_TWO_SITES, "flare_sites": {"site-2": {"queues": ["hospital-b"]}}})},
)
case(
    "registry-grant-no-queue",
    "flare-airflow registry grant of no queue at all",
    "flare_sites['site-1'].queues is empty: a site's worker serves its queues",
    ["registry", "grant", "{dir}/registry.json", "site-1", "--queues", ""],
    {"registry.json": json.dumps(_TWO_SITES)},
)
case(
    "registry-grant-unenrolled-site",
    "flare-airflow registry grant for a site with no enrolled key",
    "names ['site-9'], which have no enrolled signing key; enrol them first",
    ["registry", "grant", "{dir}/registry.json", "site-9", "--queues", "site-9"],
    {"registry.json": json.dumps(_TWO_SITES)},
)
case(
    "site-worker-no-registry",
    "flare-airflow site worker on a worker with no consortium registry configured",
    "site worker site-1: no consortium registry is configured ([flare] site_keys or FLARE_SITE_KEYS)",
    ["site", "worker", "site-1"],
)


def _nan_model() -> bytes:
    import numpy as np
    from safetensors.numpy import save

    return save({"w": np.array([1.0, np.nan], dtype=np.float32)})


def build(tmp: pathlib.Path, bad: Bad) -> list[str]:
    (tmp / "train.py").write_text("print('training')\n")
    (tmp / "init.safetensors").write_bytes(INITIAL_MODEL.read_bytes())
    for name, content in bad.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:
            path.mkdir()
        elif content == "nan-model":
            path.write_bytes(_nan_model())
        elif isinstance(content, str) and content.startswith("->"):
            path.symlink_to(tmp / content[2:])
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return [a.replace("{dir}", str(tmp)) for a in bad.argv]


@pytest.fixture(scope="module")
def metadata_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A migrated metadata database of this module's own for ``flare-airflow run``, which reads and
    writes it in this process: without it the cases would use whatever AIRFLOW_HOME the shell has
    (``make`` sets one; a bare pytest gets ~/airflow, unmigrated: "no such table: dag_run")."""
    import airflow.settings

    home = AirflowHome(tmp_path_factory.mktemp("cli-airflow"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", home.db_url)
        airflow.settings.configure_vars()
        airflow.settings.reconfigure_orm()
        try:
            yield
        finally:
            airflow.settings.dispose_orm()
    # Back to the shell's database: later tests in this process read Airflow's settings too.
    airflow.settings.configure_vars()
    airflow.settings.configure_orm()


@pytest.mark.parametrize("bad_case", CASES, ids=lambda c: c.id)
def test_bad_command_line_gets_a_clear_error(
    bad_case: Case, tmp_path: pathlib.Path, capsys, monkeypatch, request: pytest.FixtureRequest
) -> None:
    bad = INPUTS[bad_case.id]
    argv = build(tmp_path, bad)
    if "--dagfile" in argv:  # Airflow parses DAG files only inside its dags folder
        import airflow.settings

        request.getfixturevalue("metadata_db")

        dags = tmp_path / "dags" if bad.outside_with_examples else tmp_path
        dags.mkdir(exist_ok=True)
        monkeypatch.setenv("AIRFLOW__CORE__DAGS_FOLDER", str(dags))
        monkeypatch.setattr(airflow.settings, "DAGS_FOLDER", str(dags))
        if bad.outside_with_examples:
            monkeypatch.setenv("AIRFLOW__CORE__LOAD_EXAMPLES", "True")
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capsys.readouterr()
    assert code == bad.code, f"{bad_case.id}: exit {code}\n{out}\n{err}"
    assert_clear(bad_case, err)
    if (tmp_path / "victim").exists():
        assert (tmp_path / "victim").read_text() == "precious\n"
