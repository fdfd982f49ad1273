"""The Rendered Templates tab of site tasks: job, site and round are there; secret values never are.

Rendering goes through the operators' own ``render_template_fields`` and then the Task SDK's
``_serialize_rendered_fields`` -- what a worker sends the API server for the UI.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

from airflow.sdk.execution_time.task_runner import _serialize_rendered_fields

from flare_airflow.operators.pod import SitePodOperator
from flare_airflow.operators.site import SiteTrainOperator
from tests.unit.airflow_layer import context, make_job

CANARY = "canary-7f3a9c-secret-value"
KUBECONFIG = f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "https://127.0.0.1:6443"}}}}]
users: [{{name: u, user: {{token: {CANARY}}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
"""


def rendered(op: Any) -> dict[str, Any]:
    op.render_template_fields(context())
    return _serialize_rendered_fields(op)


def test_a_process_site_task_shows_its_job_site_and_round_and_no_secret_value(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("AIRFLOW_VAR_SITE_TOKEN", CANARY)
    job = make_job(
        tmp_path,
        sites={
            "site-1": {"launcher_spec": {"process": {"secret_env": {"API_TOKEN": {"variable": "site_token"}}}}},
            "site-2": {},
        },
    )
    fields = rendered(SiteTrainOperator(task_id="site-1_r2", job=job, site="site-1", round_num=2))
    assert (fields["job_name"], fields["site"], fields["round_num"]) == ("unit", "site-1", 2)
    assert "flare_airflow.site_task" in fields["bash_command"]
    assert CANARY not in json.dumps(fields)


def test_a_pod_site_task_shows_its_job_site_round_and_pod_placement_and_no_secret_value(tmp_path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG)
    store = pathlib.Path(tmp_path / "store")
    k8s = {
        "image": "registry.example/flare/trainer:1",
        "namespace": "site-ns",
        "config_file": str(kubeconfig),
        "store_mount": {"host_path": str(store), "mount_path": "/flare-store"},
        "env": {"MODE": "fast"},
        "secret_env": {"API_TOKEN": {"secret": "site-secrets", "key": "token"}},
    }
    job = make_job(tmp_path, sites={"site-1": {"launcher": "k8s", "launcher_spec": {"k8s": k8s}}}, min_clients=1)
    op = SitePodOperator(task_id="site-1_r1", job=job, site="site-1", round_num=1)
    fields = rendered(op)
    assert (fields["job_name"], fields["site"], fields["round_num"]) == ("unit", "site-1", 1)
    assert (fields["image"], fields["namespace"], fields["config_file"]) == (
        "registry.example/flare/trainer:1",
        "site-ns",
        str(kubeconfig),
    )
    text = json.dumps(fields)
    assert CANARY not in text  # the kubeconfig's token: only its path is a template field
    for excluded in ("env_vars", "env_from", "pod_template_dict", "configmaps", "volumes", "trigger_kwargs"):
        assert excluded not in op.template_fields
