"""moto's S3 server with IAM enforced for presigned links too: ``python moto_presigned.py
-H HOST -p PORT`` (the arguments of ``moto_server``).

moto 5.2 with IAM on reads only the ``Authorization`` header: a presigned link (SigV4 in the query
string, what the central side mints for the sites) and an anonymous request both fail with HTTP 500
(a KeyError), so strict mode could only be tested with IAM off -- where moto checks no signature at
all and a link edited to name another key passes. This launcher teaches moto's one IAM request class
what AWS does (https://docs.aws.amazon.com/AmazonS3/latest/API/sigv4-query-string-auth.html):

- a request with neither a signature header nor a query signature is anonymous: ``AccessDenied``;
- a query-signed request is checked like a header-signed one -- the signature over method, path,
  query and signed headers with the signer's key (``SignatureDoesNotMatch``), its expiry
  (``AccessDenied``: "Request has expired"), then the signer's IAM policy for the action.

The signature is recomputed with botocore's own presigner maths (``S3SigV4QueryAuth``), the code
that made the link, so what passes here is exactly what a correct S3 signer would accept.
"""

from __future__ import annotations

import datetime
import sys
from typing import Any
from urllib.parse import parse_qsl, urlsplit


def _patch() -> None:
    from botocore.auth import S3SigV4QueryAuth
    from botocore.awsrequest import AWSRequest
    from moto.iam import access_control
    from moto.s3.exceptions import S3ClientError

    # moto's own S3AccessDeniedError goes out with an empty body on object requests; these say why.
    class RequestExpired(S3ClientError):
        def __init__(self) -> None:
            super().__init__("AccessDenied", "Request has expired")

    class Anonymous(S3ClientError):
        def __init__(self) -> None:
            super().__init__("AccessDenied", "Access Denied: the request is not signed")

    base = access_control.S3IAMRequest

    class S3IAMRequest(base):  # type: ignore[valid-type,misc]
        def __init__(self, account_id: str, method: str, path: str, data: Any, body: bytes, headers: Any, action: Any):
            raw_query = urlsplit(path).query
            query = dict(parse_qsl(raw_query, keep_blank_values=True))
            self._presigned = "X-Amz-Credential" in query and "X-Amz-Signature" in query
            if "Authorization" not in headers and not self._presigned:
                raise Anonymous()
            if self._presigned:
                self._query, self._raw_query = query, raw_query
                # The base class reads the signer and scope from an Authorization header: give it
                # the same fields from the query string (on a copy; the request is not changed).
                headers = dict(headers)
                headers["Authorization"] = (
                    f"AWS4-HMAC-SHA256 Credential={query['X-Amz-Credential']}, "
                    f"SignedHeaders={query['X-Amz-SignedHeaders']}, Signature={query['X-Amz-Signature']}"
                )
            super().__init__(account_id, method, path, data, body, headers, action)

        def check_signature(self) -> None:
            if not self._presigned:
                super().check_signature()
                return
            q = self._query
            signed_at = datetime.datetime.strptime(q["X-Amz-Date"], "%Y%m%dT%H%M%SZ").replace(tzinfo=datetime.UTC)
            expires = int(q["X-Amz-Expires"])
            # The raw query minus the signature, as the presigner had it before signing.
            unsigned = "&".join(p for p in self._raw_query.split("&") if not p.startswith("X-Amz-Signature="))
            signed_headers = q["X-Amz-SignedHeaders"].split(";")
            headers = {k: v for k, v in self._headers.items() if k.lower() in signed_headers and k.lower() != "host"}
            host = self._headers.get("Host", "")
            request = AWSRequest(method=self._method, url=f"http://{host}{urlsplit(self._path).path}?{unsigned}")
            for k, v in headers.items():
                request.headers[k] = v
            request.context["timestamp"] = q["X-Amz-Date"]
            auth = S3SigV4QueryAuth(self._access_key.create_credentials(), self._service, self._region, expires)
            canonical = auth.canonical_request(request)
            if auth.signature(auth.string_to_sign(request, canonical), request) != q["X-Amz-Signature"]:
                self._raise_signature_does_not_match()
            if datetime.datetime.now(datetime.UTC) > signed_at + datetime.timedelta(seconds=expires):
                raise RequestExpired()

    access_control.S3IAMRequest = S3IAMRequest  # type: ignore[misc]


def main(argv: list[str] | None = None) -> None:
    _patch()
    from moto.server import main as moto_main

    moto_main(argv if argv is not None else sys.argv[1:])


if __name__ == "__main__":
    main()
