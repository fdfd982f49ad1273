"""``flare-airflow doctor``: a central secret the Execution API would serve to site tasks is refused,
naming where it was found and how to move it (issue 36 item 3, docs/threat-model.md)."""

from __future__ import annotations

import airflow.configuration

from flare_airflow.cli import doctor
from flare_airflow.cli.commands import main
from tests.unit.airflow_layer import make_job


class MetastoreBackend:
    """Stands in for the metadata database: holds the central store connection."""

    def get_variable(self, key: str) -> None:
        return None

    def get_connection(self, conn_id: str) -> object | None:
        return object() if conn_id == "flare_store" else None


def test_doctor_refuses_central_secrets_the_api_server_would_serve(tmp_path, monkeypatch, capsys) -> None:
    job = make_job(tmp_path, store_conn_id="flare_store")
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "job: unit\nrounds: 1\nmin_clients: 1\ninitial_model: init.safetensors\ntrainer: {script: train.py}\n"
        "store_conn_id: flare_store\nsites: {site-1: {}}\n"
    )
    assert [s.name for s in doctor.central_secrets([job])] == ["flare_central_noise_secret", "flare_store"]
    monkeypatch.setattr(airflow.configuration, "ensure_secrets_loaded", lambda: [MetastoreBackend()])
    monkeypatch.setenv("AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET", "0" * 64)
    assert main(["doctor", str(job_file)]) == 1
    out = capsys.readouterr().out
    assert "REFUSED: variable 'flare_central_noise_secret'" in out
    assert "found in the api-server's environment (AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET)" in out
    assert "REFUSED: connection 'flare_store'" in out and "found in the metadata database" in out
    assert "`airflow connections delete flare_store`" in out
    assert "0" * 64 not in out  # never the value
    monkeypatch.delenv("AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET")
    monkeypatch.setattr(airflow.configuration, "ensure_secrets_loaded", lambda: [])
    assert main(["doctor", str(job_file)]) == 0
    assert "REFUSED" not in capsys.readouterr().out


def test_with_the_site_guard_doctor_refuses_only_a_central_secret_a_grant_lists(tmp_path, monkeypatch, capsys) -> None:
    import json

    from flare_airflow.core.trust import generate_keys

    make_job(tmp_path, store_conn_id="flare_store")  # the trainer and initial model the file names
    job_file = tmp_path / "job.yaml"
    job_file.write_text(
        "job: unit\nrounds: 1\nmin_clients: 1\ninitial_model: init.safetensors\ntrainer: {script: train.py}\n"
        "store_conn_id: flare_store\nsites: {site-1: {}}\n"
    )
    keys = generate_keys("site-1", tmp_path / "k").jwks["keys"]
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"keys": keys}))
    monkeypatch.setenv("FLARE_SITE_KEYS", str(registry))
    # Served by the api-server, but the guard refuses it to site tasks: fine.
    monkeypatch.setenv("AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET", "0" * 64)
    assert main(["doctor", str(job_file)]) == 0
    out = capsys.readouterr().out
    assert "ok: variable 'flare_central_noise_secret': the site guard refuses it to every site's task" in out
    registry.write_text(json.dumps({"keys": keys, "flare_sites": {"site-1": {"connections": ["flare_store"]}}}))
    assert main(["doctor", str(job_file)]) == 1
    out = capsys.readouterr().out
    assert "REFUSED: connection 'flare_store'" in out and "grants it to site(s) ['site-1']" in out
    assert "remove it from flare_sites['site-1'].connections" in out
    monkeypatch.setattr(doctor, "site_guard_installed", lambda: False)  # no guard: where it is found decides
    monkeypatch.setattr(airflow.configuration, "ensure_secrets_loaded", lambda: [])
    assert main(["doctor", str(job_file)]) == 1
    assert "found in the api-server's environment (AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET)" in capsys.readouterr().out
