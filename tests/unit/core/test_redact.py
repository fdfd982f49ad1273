"""Credentials out of URIs in what we log (issue 35): one function, :func:`redact_uris`."""

from __future__ import annotations

import pytest

from flare_airflow.core.redact import redact_uri, redact_uris, secret_query_key


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("http://alice:s3cr3t@mlflow.internal:5000/x", "http://***@mlflow.internal:5000/x"),
        ("https://tok3n@mlflow.example.org", "https://***@mlflow.example.org"),
        ("postgresql+psycopg2://u:p%40ss@db/mlflow?sslpassword=s3cr3t&sslmode=require",
         "postgresql+psycopg2://***@db/mlflow?sslpassword=***&sslmode=require"),
        ("https://m.example/mlflow?auth_token=s3cr3t", "https://m.example/mlflow?auth_token=***"),
        ("https://m/x?token=a&password=b&key=c&secret=d&access_key=e&X-Amz-Signature=f&page=2",
         "https://m/x?token=***&password=***&key=***&secret=***&access_key=***&X-Amz-Signature=***&page=2"),
        ("http://u:p@ss@host/", "http://***@host/"),  # an '@' in the password: the last '@' ends user info
        ("sqlite:////srv/store/mlflow.db", "sqlite:////srv/store/mlflow.db"),  # nothing secret: unchanged
        ("http://[::1:5000/x", "http://***"),  # not parseable: nothing after the scheme is shown
    ],
)  # fmt: skip
def test_redact_uri(uri: str, shown: str) -> None:
    assert redact_uri(uri) == shown


def test_every_uri_in_a_message_is_redacted() -> None:
    message = (
        "MlflowException: API request to http://alice:pw-1@127.0.0.1:5/api/2.0/mlflow/runs/create failed "
        "(HTTPConnectionPool(host='127.0.0.1')); retried 'https://m/x?auth_token=tok-2', see http://ok/docs"
    )
    shown = redact_uris(message)
    assert "pw-1" not in shown and "tok-2" not in shown
    assert "http://***@127.0.0.1:5/api/2.0/mlflow/runs/create failed" in shown
    assert "'https://m/x?auth_token=***'" in shown and "see http://ok/docs" in shown


@pytest.mark.parametrize("key", ["token", "auth_token", "sslpassword", "password", "key", "api-key", "clientSecret"])
def test_credential_like_query_keys(key: str) -> None:
    assert secret_query_key(key)


@pytest.mark.parametrize("key", ["page", "sslmode", "experiment", "run_id"])
def test_ordinary_query_keys(key: str) -> None:
    assert not secret_query_key(key)


def test_a_query_without_scheme_and_host_is_redacted() -> None:
    """urllib3's words for a failed request: "Max retries exceeded with url: /?auth_token=..."."""
    shown = redact_uris("Max retries exceeded with url: /?auth_token=tok-3&page=2/api/2.0/x&key=k-4 (Caused by")
    assert shown == "Max retries exceeded with url: /?auth_token=***&page=2/api/2.0/x&key=*** (Caused by"
