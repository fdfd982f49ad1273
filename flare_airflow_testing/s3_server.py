"""An S3 endpoint for the tests: moto's standalone server (``moto_server``, an S3 *emulator* from
PyPI, ``moto[server]``), on loopback on a free port, with request signing enforced.

Why moto: it installs from the registries here (no MinIO binary can be fetched), speaks the S3 REST
API that s3fs/aiobotocore use, and checks signatures when ``INITIAL_NO_AUTH_ACTION_COUNT`` is set:
the first requests create an IAM user and its access key, every later request must be signed with
it, so a site with a wrong secret gets a real 403 (SignatureDoesNotMatch / InvalidAccessKeyId), an
anonymous request AccessDenied, and a presigned link edited to name another key SignatureDoesNotMatch
(moto itself reads only header signatures: flare_airflow_testing/moto_presigned.py adds the query-string ones).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from flare_airflow_testing.ports import free_port

BIN = Path(sys.executable).parent
# moto's server, checking presigned links too (``moto_server`` checks header signatures only).
_MOTO = Path(__file__).with_name("moto_presigned.py")
BUCKET = "flare"
# Requests moto serves before it enforces signatures: the setup below makes exactly these.
_SETUP_REQUESTS = 4
_ADMIN_POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


class S3Server:
    def __init__(self, host: str = "127.0.0.1", prefix: list[str] | None = None, *, enforce_iam: bool = True) -> None:
        # ``prefix`` (e.g. ``ip netns exec NS``): the server runs in that network namespace on all
        # of its addresses, and the test process reaches it at ``host``.
        # ``enforce_iam=False``: every request is served, signed or not. With IAM on (the default)
        # every request after the setup below must be signed -- presigned links too, checked for
        # signature, expiry and their signer's policy (flare_airflow_testing/moto_presigned.py).
        self.host = host
        self.port = free_port()
        self.endpoint = f"http://{host}:{self.port}"
        bind = "0.0.0.0" if prefix else host  # all addresses of its own namespace
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": str(_SETUP_REQUESTS)} if enforce_iam else {**os.environ}
        for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
            env.pop(name, None)
        self.proc = subprocess.Popen(
            [*(prefix or []), sys.executable, str(_MOTO), "-H", bind, "-p", str(self.port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{self.endpoint}/moto-api/", timeout=1)
                break
            except httpx.HTTPError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"moto_server did not start on {self.endpoint}") from None
                time.sleep(0.1)
        import boto3

        anon = {"endpoint_url": self.endpoint, "region_name": "us-east-1"}
        iam = boto3.client("iam", aws_access_key_id="setup", aws_secret_access_key="setup", **anon)
        iam.create_user(UserName="flare")
        iam.put_user_policy(UserName="flare", PolicyName="all", PolicyDocument=json.dumps(_ADMIN_POLICY))
        key = iam.create_access_key(UserName="flare")["AccessKey"]
        self.key_id, self.secret = str(key["AccessKeyId"]), str(key["SecretAccessKey"])
        self.client().create_bucket(Bucket=BUCKET)

    def client(self, key_id: str | None = None, secret: str | None = None) -> Any:
        """An S3 client signing with SigV4 (presigned links too), as this server's admin user or
        with another access key."""
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=key_id or self.key_id,
            aws_secret_access_key=secret or self.secret,
            config=Config(signature_version="s3v4"),
        )

    def user_key(self, name: str, policy: dict[str, Any]) -> tuple[str, str]:
        """A new IAM user with ``policy`` (as its only policy) and its access key."""
        import boto3

        iam = boto3.client(
            "iam", endpoint_url=self.endpoint, region_name="us-east-1",
            aws_access_key_id=self.key_id, aws_secret_access_key=self.secret,
        )  # fmt: skip
        iam.create_user(UserName=name)
        iam.put_user_policy(UserName=name, PolicyName="site", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=name)["AccessKey"]
        return str(key["AccessKeyId"]), str(key["SecretAccessKey"])

    def connection(self, secret: str | None = None, host: str | None = None) -> str:
        """An Airflow connection (the JSON of ``AIRFLOW_CONN_<ID>``) to this endpoint, reached at
        ``host`` (default: where the test process reaches it)."""
        endpoint = f"http://{host}:{self.port}" if host else self.endpoint
        return json.dumps(
            {
                "conn_type": "aws",
                "login": self.key_id,
                "password": self.secret if secret is None else secret,
                "extra": {"endpoint_url": endpoint, "region_name": "us-east-1"},
            }
        )

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
