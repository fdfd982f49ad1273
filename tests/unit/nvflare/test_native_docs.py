"""docs/coming-from-nvflare.md's native mode stays true: its state table is the code's, its FLARE
deployment shapes are valid (Kubernetes manifests against the JSON schemas, offline; compose's
services and argv lists), and its connection line is what the hook reads."""

from __future__ import annotations

import json
import pathlib
import re

import kubernetes_validate
import pytest
import yaml

from flare_airflow.core.spec import JobReturnCode
from flare_airflow.nvflare_native.states import STATUS_TABLE, map_status

DOC = pathlib.Path(__file__).resolve().parents[3] / "docs" / "coming-from-nvflare.md"


def block(marker: str) -> str:
    found = re.search(rf"<!-- {marker} -->\n```yaml\n(.*?)```", DOC.read_text(), re.S)
    assert found, f"docs/coming-from-nvflare.md lost its {marker} block"
    return found.group(1)


def test_the_state_table_is_the_codes() -> None:
    section = DOC.read_text().split("### FLARE's job states", 1)[1].split("###", 1)[0]
    rows = re.findall(r"^\| `([A-Z_:]+)` \| (\w+) \| (\d+)", section, re.M)
    assert {status: (state, int(rc)) for status, state, rc in rows} == {
        status: (state.value, int(rc)) for status, (state, rc, _) in STATUS_TABLE.items()
    }
    # The two rows without a literal status: an unknown end state fails, anything else waits.
    assert not map_status("FINISHED:SOMETHING_NEW").succeeded and map_status("FINISHED:SOMETHING_NEW").done
    assert map_status("PAUSED").return_code is JobReturnCode.UNKNOWN and not map_status("PAUSED").done


def test_the_kubernetes_shapes_are_valid_manifests() -> None:
    manifests = list(yaml.safe_load_all(block("flare-k8s")))
    assert [m["kind"] for m in manifests] == ["Deployment", "Service", "Deployment"]
    version = kubernetes_validate.latest_version()
    for manifest in manifests:
        kubernetes_validate.validate(manifest, version, strict=True)
    server, service, _client = manifests
    assert server["spec"]["replicas"] == 1 and server["spec"]["strategy"]["type"] == "Recreate"
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    ports = {p["name"] for p in server["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == ports
    broken = json.loads(json.dumps(server))
    broken["spec"]["template"]["spec"]["containers"][0]["comand"] = ["typo"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, version, strict=True)


def test_the_compose_shape_runs_each_participant_in_the_foreground() -> None:
    services = yaml.safe_load(block("flare-compose"))["services"]
    assert set(services) == {"flare-server", "site-1"}
    for name, service in services.items():
        argv = service["command"]
        assert isinstance(argv, list) and argv[:3] == ["python", "-u", "-m"], name  # an argv list, no shell
        assert service["init"] is True  # SIGTERM reaches NVFlare (podman without systemd: docs/deploy-compose.md)
    assert "nvflare.private.fed.app.server.server_train" in services["flare-server"]["command"]
    assert "uid=site-1" in services["site-1"]["command"]


def test_the_documented_connection_is_what_the_hook_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from flare_airflow.hooks.flare_admin import DEFAULT_CONN_ID, FlareAdminHook

    line = next(x for x in DOC.read_text().splitlines() if x.startswith("export AIRFLOW_CONN_FLARE_ADMIN_DEFAULT="))
    value = line.split("=", 1)[1].strip("'")
    monkeypatch.setenv(f"AIRFLOW_CONN_{DEFAULT_CONN_ID.upper()}", value)
    admin = FlareAdminHook().admin()
    assert (admin.python, admin.startup_kit, admin.username) == (
        "/opt/nvflare-venv/bin/python",
        "/opt/flare/admin@nvidia.com",
        "admin@nvidia.com",
    )
    assert admin.argv("status")[0] == admin.python  # the bridge runs with NVFlare's interpreter, argv list
