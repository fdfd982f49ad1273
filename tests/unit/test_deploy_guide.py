"""docs/deploy-across-sites.md still has every block the Edge e2e test follows (flare_airflow_testing/deploy_guide.py),
checked without servers so that a doc edit that breaks the e2e test fails here first."""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow_testing import deploy_guide as guide


def test_the_guide_gives_the_job_central_config_worker_env_policy_and_command() -> None:
    keys = guide.job_keys()
    assert keys["site_queues"] is True and keys["store"].startswith("s3://")
    central = guide.central_config(base="http://10.1.1.1:9", root=pathlib.Path("/c"))
    assert central["AIRFLOW__CORE__EXECUTOR"].endswith("EdgeExecutor")
    # No shared secret: the central side signs with its own key, workers with their sites' keys.
    assert "AIRFLOW__API_AUTH__JWT_SECRET" not in central
    assert central["AIRFLOW__API_AUTH__JWT_PRIVATE_KEY_PATH"] == "/c/central/jwt.pem"
    assert central["AIRFLOW__EDGE__TRUSTED_JWKS_URL"] == central["AIRFLOW__FLARE__SITE_KEYS"] == "/c/registry.json"
    assert central["AIRFLOW__EDGE__JWT_VERIFIER"] == "flare_airflow.edge.verifier.authorize"
    assert central["AIRFLOW__EDGE__API_URL"] == "http://10.1.1.1:9/edge_worker/v1/rpcapi"
    env = guide.worker_env(base="http://10.1.1.1:9", root=pathlib.Path("/w"), store_connection="{}")
    assert not [k for k in env if "JWT" in k or "SECRET" in k], env
    assert (env["FLARE_KEY_DIR"], env["FLARE_SITE_KEYS"]) == ("/w/keys", "/w/registry.json")
    assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://10.1.1.1:9/execution/"
    assert (env["AIRFLOW_HOME"], env["FLARE_SITE_CONFIG"]) == ("/w/airflow", "/w/site.yaml")
    assert env[f"AIRFLOW_CONN_{guide.store_connection_name().upper()}"] == "{}"
    policy = guide.site_policy("site-7", pathlib.Path("/w"))
    assert policy["sites"]["site-7"]["store_conn_id"] == guide.store_connection_name()
    assert guide.worker_argv("site-7") == ["flare-airflow", "site", "worker", "site-7"]


def test_a_guide_without_a_placeholder_the_test_fills_is_an_error(tmp_path, monkeypatch) -> None:
    page = tmp_path / "deploy-across-sites.md"
    text = guide.GUIDE.read_text()
    page.write_text(text.replace("https://airflow.example.org/edge_worker", "https://central/edge_worker"))
    monkeypatch.setattr(guide, "GUIDE", page)
    with pytest.raises(
        guide.GuideError, match=r"api_url .* no longer has the placeholder 'https://airflow.example.org'"
    ):
        guide.central_config(base="http://x", root=tmp_path)
    page.write_text(text.replace("AIRFLOW_CONN_SITE_STORE='", "AIRFLOW_CONN_SITE_STORE='x").replace("...", "x"))
    with pytest.raises(guide.GuideError, match="no placeholder value for AIRFLOW_CONN_SITE_STORE"):
        guide.worker_env(base="http://x", root=tmp_path, store_connection="{}")
