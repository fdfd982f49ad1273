"""Store links: what a site needs of the model store for one round, as time-limited capabilities.

A site holds no credential to the central store (issue 36 item 4, docs/model-store.md). Each
round, the aggregation side -- which holds the store's credential -- mints for each site:

- read links (presigned ``GET``) for the round's input global model and its record;
- write links (presigned ``PUT``) for that site's own update slot, its record and its failure
  record -- or, beyond what one ``PUT`` may carry, a multipart upload the central side opened,
  with a presigned link per part and one to complete it.

Nothing else: no link lists the bucket, reads another site's slot or writes a global model. The
links are bound to (job, run, round, site) and expire; the Airflow layer seals them to the site's
box key (:mod:`flare_airflow.core.trust.sealed`) before they go through XCom.

For stores that cannot presign, :func:`site_bucket_policy` writes the per-site policy that grants
the same and nothing more to a site's own store identity.

Pure core: the minting takes an S3 client (``boto3``'s, duck-typed); the transfers use the
standard library's HTTP client, so a site runner needs no object-store client at all.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from flare_airflow.core.errors import StoreError
from flare_airflow.core.store import ModelStore, failure_path, open_regular, record_path

# S3 takes at most 5 GiB in one PUT, but a PUT cut off midway starts again from its first byte;
# a multipart upload resumes from the parts that arrived (parts of 5 MiB to 5 GiB), so anything
# beyond two parts' worth goes up in parts.
PART_SIZE = 64 << 20
SINGLE_PUT_LIMIT = 2 * PART_SIZE
MIN_PART_SIZE = 5 << 20
MAX_PARTS = 10_000
# S3 lists at most 1,000 parts per ListParts answer: one presigned listing link per page.
PARTS_PER_LISTING = 1_000
# An update is the global model's tensors with the site's own header (metrics, counts): this much
# larger at most, or its upload is refused for want of parts.
HEADER_SLACK = 1 << 20
CHUNK = 8 << 20
TIMEOUT = 300.0


class LinksError(StoreError):
    """A site's store links cannot be used: expired, for another round or site, or refused by the store."""


@dataclass(frozen=True)
class Upload:
    """How to write one object: a single presigned ``PUT``, or a multipart upload's part links."""

    url: str | None = None
    parts: list[str] = field(default_factory=list)
    complete: str | None = None
    part_size: int = 0
    # Presigned ListParts of this upload, a page of PARTS_PER_LISTING each: what already arrived,
    # so a writer killed midway resumes without re-sending it.
    listings: list[str] = field(default_factory=list)

    @property
    def capacity(self) -> int | None:
        """The most bytes these links can write (None: one PUT, up to the store's own limit)."""
        return None if self.url else self.part_size * len(self.parts)


@dataclass(frozen=True)
class SiteLinks:
    """One site's capabilities for one round (identity, expiry and the links)."""

    job: str
    run_id: str
    round: int
    site: str
    expires: float  # seconds since the epoch
    global_model: str
    global_record: str
    update: Upload
    update_record: str
    failure: str

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> SiteLinks:
        try:
            data = json.loads(text)
            upload = Upload(**data.pop("update"))
            links = cls(update=upload, **data)
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise LinksError(f"{where}: not a site's store links ({type(exc).__name__}: {exc})") from None
        return links

    def check(self, *, job: str, run_id: str, round_num: int, site: str, now: float | None = None) -> None:
        """Refuse links minted for another (job, run, round, site), or expired."""
        expected = {"job": job, "run_id": run_id, "round": round_num, "site": site}
        for name, value in expected.items():
            if getattr(self, name) != value:
                raise LinksError(
                    f"site {site!r} round {round_num}: the store links are for {name} {getattr(self, name)!r}, "
                    f"not {value!r} (links of another round or site are never used)"
                )
        now = time.time() if now is None else now
        if now >= self.expires:
            raise LinksError(
                f"site {site!r} round {round_num}: the store links expired "
                f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(self.expires))}; clear the task that "
                "published this round's input global model (prepare, or the previous round's aggregation) to mint "
                "new ones"
            )


def bucket_key(path: Any) -> tuple[str, str]:
    """(bucket, key) of an object-store path (``s3://bucket/key``)."""
    parsed = urlparse(str(path))
    # Airflow's ObjectStoragePath names its connection in the URI: s3://<conn_id>@<bucket>/<key>.
    return parsed.netloc.rsplit("@", 1)[-1], parsed.path.lstrip("/")


def mint_site_links(
    client: Any,
    store: ModelStore,
    *,
    job: str,
    run_id: str,
    round_num: int,
    site: str,
    expires_in: int,
    update_size: int,
    single_put_limit: int = SINGLE_PUT_LIMIT,
    part_size: int = PART_SIZE,
) -> SiteLinks:
    """``site``'s links for ``round_num``: read the input global model (round ``round_num - 1``)
    and its record, write the site's own update slot. ``update_size``: about the update's size
    (the global model's); beyond ``single_put_limit`` the update is a multipart upload opened here."""
    global_in = store.global_model(job, run_id, round_num - 1)
    slot = store.site_update(job, run_id, round_num, site)

    def link(method: str, path: Any, **extra: Any) -> str:
        bucket, key = bucket_key(path)
        return str(
            client.generate_presigned_url(method, Params={"Bucket": bucket, "Key": key, **extra}, ExpiresIn=expires_in)
        )

    if update_size + HEADER_SLACK <= single_put_limit:
        upload = Upload(url=link("put_object", slot))
    else:
        size = part_size_for(update_size + HEADER_SLACK, part_size)
        count = math.ceil((update_size + HEADER_SLACK) / size)
        bucket, key = bucket_key(slot)
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        parts = [link("upload_part", slot, UploadId=upload_id, PartNumber=n) for n in range(1, count + 1)]
        listings = [
            link("list_parts", slot, UploadId=upload_id, PartNumberMarker=start, MaxParts=PARTS_PER_LISTING)
            for start in range(0, count, PARTS_PER_LISTING)
        ]
        upload = Upload(
            parts=parts,
            complete=link("complete_multipart_upload", slot, UploadId=upload_id),
            part_size=size,
            listings=listings,
        )
    return SiteLinks(
        job=job,
        run_id=run_id,
        round=round_num,
        site=site,
        expires=time.time() + expires_in,
        global_model=link("get_object", global_in),
        global_record=link("get_object", record_path(global_in)),
        update=upload,
        update_record=link("put_object", record_path(slot)),
        failure=link("put_object", failure_path(slot)),
    )


def abort_unfinished_uploads(
    client: Any, store: ModelStore, *, job: str, run_id: str, sites: Iterable[str], round_num: int | None = None
) -> list[str]:
    """Abort the multipart uploads still open on the update slots of ``sites`` in ``run_id`` (only
    round ``round_num``'s when given): their parts would otherwise stay in the store, billed and
    unaccounted for, after every writer that could complete them is gone. Returns the keys aborted.

    Only the central side calls this, with the store's credential, once no site task of that round
    (or run) can write any more; until then a retried writer resumes from the parts that arrived."""
    top = store.run_dir(job, run_id) if round_num is None else store.round_dir(job, run_id, round_num)
    bucket, prefix = bucket_key(top)
    prefix = prefix.rstrip("/") + "/"  # run "r-1" is not a prefix of run "r-10"
    slots = {store.site_update(job, run_id, 1, site).name for site in sites}
    aborted: list[str] = []
    for page in client.get_paginator("list_multipart_uploads").paginate(Bucket=bucket, Prefix=prefix):
        for pending in page.get("Uploads", []):
            key = str(pending["Key"])
            parent, _, name = key[len(prefix) :].rpartition("/")
            # A site's update slot (round-NNNN/sites/<site>.safetensors); anything else is not ours to end.
            if not key.startswith(prefix) or name not in slots or not parent.endswith("sites"):
                continue
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=pending["UploadId"])
            aborted.append(key)
    return aborted


def _refusal(exc: urllib.error.HTTPError, what: str) -> LinksError:
    body = exc.read(4096).decode(errors="replace") if exc.fp is not None else ""
    found = re.search(r"<Code>([A-Za-z]{1,64})</Code>", body)  # S3's error code, e.g. AccessDenied
    code = f" {found.group(1)}" if found else ""
    if code == " NoSuchUpload":
        return LinksError(
            f"{what}: the store refused the link (HTTP {exc.code}{code}): the central side aborted this round's "
            "upload once the round was aggregated or the run ended; clear the task that published this round's "
            "input global model (prepare, or the previous round's aggregation) to mint new links"
        )
    return LinksError(f"{what}: the store refused the link (HTTP {exc.code}{code})")


def _request(url: str, *, method: str, data: Any = None, headers: Mapping[str, str] | None = None) -> Any:
    if urlparse(url).scheme not in ("http", "https"):
        raise LinksError(f"a store link must be http(s), got {urlparse(url).scheme!r}")
    # urllib labels a body form data unless told otherwise (servers may then parse it away).
    sent = {"Content-Type": "application/octet-stream", **(headers or {})} if data is not None else dict(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=sent)  # noqa: S310 -- scheme checked above
    return urllib.request.urlopen(req, timeout=TIMEOUT)  # noqa: S310 -- scheme checked above


def download(url: str, local: Path, what: str) -> bool:
    """The object behind ``url`` into ``local``; False when the store has no such object (404)."""
    local.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _request(url, method="GET") as resp, open(local, "wb") as fh:
            while chunk := resp.read(CHUNK):
                fh.write(chunk)
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return False
        raise _refusal(exc, what) from None
    except OSError as exc:
        raise LinksError(f"{what}: the store could not be reached: {exc}") from None
    return True


def _put(url: str, data: bytes | Any, length: int, what: str) -> str:
    try:
        with _request(url, method="PUT", data=data, headers={"Content-Length": str(length)}) as resp:
            return str(resp.headers.get("ETag", ""))
    except urllib.error.HTTPError as exc:
        raise _refusal(exc, what) from None
    except OSError as exc:
        raise LinksError(f"{what}: the store could not be reached: {exc}") from None


_LISTED_PART = re.compile(
    r"<Part>.*?<PartNumber>(\d{1,5})</PartNumber>.*?<ETag>([^<]{1,80})</ETag>.*?<Size>(\d{1,13})</Size>.*?</Part>", re.S
)


def arrived_parts(upload: Upload, what: str) -> dict[int, tuple[str, int]]:
    """The parts of ``upload`` the store already holds: part number -> (ETag, size)."""
    arrived: dict[int, tuple[str, int]] = {}
    for url in upload.listings:
        try:
            with _request(url, method="GET") as resp:
                text = resp.read(1 << 20).decode(errors="replace")  # 1,000 parts' entries fit easily
        except urllib.error.HTTPError as exc:
            raise _refusal(exc, f"{what} (listing the parts that arrived)") from None
        except OSError as exc:
            raise LinksError(f"{what}: the store could not be reached: {exc}") from None
        for number, etag, size in _LISTED_PART.findall(text):
            arrived[int(number)] = (etag.replace("&quot;", '"').replace("&#34;", '"'), int(size))
    return arrived


def part_size_for(size: int, part_size: int = PART_SIZE) -> int:
    """``part_size``, grown so that ``size`` bytes fit in S3's 10,000 parts (beyond 640 GB at 64 MiB)."""
    return max(part_size, MIN_PART_SIZE, math.ceil(size / MAX_PARTS))


def send_parts(
    fh: Any, count: int, part_size: int, arrived: Mapping[int, tuple[str, int]], put: Callable[[int, bytes], str]
) -> tuple[list[tuple[int, str]], int]:
    """Read ``fh`` part by part (one in memory) and ``put(number, piece)`` each part the store does not
    already hold with the same bytes (``arrived``: what a cut-off writer of this upload sent).
    Returns ``(part number, ETag)`` of every part for the completion, and the bytes sent. Both ways
    up a multipart upload use it: through links and through a site's own connection."""
    etags: list[tuple[int, str]] = []
    sent = 0
    for n in range(1, count + 1):
        piece = fh.read(part_size)
        if not piece and n > 1:
            break
        if same_part(arrived.get(n), piece):
            etags.append((n, arrived[n][0]))
            continue
        etags.append((n, put(n, piece)))
        sent += len(piece)
    return etags, sent


def same_part(listed: tuple[str, int] | None, piece: bytes) -> bool:
    """Whether the store's part is ``piece``: S3's ETag of a part is the MD5 of its bytes (not under
    SSE-KMS or SSE-C -- there it never matches and the part is sent again, which is still correct)."""
    if listed is None or listed[1] != len(piece):
        return False
    return listed[0].strip('"') == hashlib.md5(piece, usedforsecurity=False).hexdigest()


def upload(upload: Upload, local: Path, what: str) -> int:
    """``local`` to the object the links name: one PUT, or its parts and the completion. Parts the
    store already holds with the same bytes (an earlier writer of this upload was cut off) are not
    sent again. Memory: one part at a time. Returns the bytes sent. ``local`` must be a regular file
    (:func:`~flare_airflow.core.store.open_regular`): a link to another file is never sent."""
    with open_to_send(local, what) as fh:
        return send(upload, fh, what)


def open_to_send(local: Path, what: str) -> Any:
    """``local`` opened for :func:`send`; :class:`LinksError` unless it is a regular file (not a link)."""
    try:
        return open_regular(local)
    except OSError as exc:
        raise LinksError(f"{what}: {local} {exc.strerror}; nothing was sent") from None


def send(upload: Upload, fh: Any, what: str) -> int:
    """The open file ``fh`` (from :func:`open_to_send`) to the object ``upload`` names; see :func:`upload`."""
    size = os.fstat(fh.fileno()).st_size
    if upload.url:
        _put(upload.url, fh, size, what)
        return size
    capacity = upload.capacity or 0
    if size > capacity:
        raise LinksError(
            f"{what}: {size} bytes, more than the {capacity} the round's links can write (an update much larger "
            "than the global model)"
        )
    etags, sent = send_parts(
        fh, len(upload.parts), upload.part_size, arrived_parts(upload, what),
        lambda n, piece: _put(upload.parts[n - 1], piece, len(piece), f"{what} (part {n})"),
    )  # fmt: skip
    body = "".join(f"<Part><PartNumber>{n}</PartNumber><ETag>{tag}</ETag></Part>" for n, tag in etags)
    data = f"<CompleteMultipartUpload>{body}</CompleteMultipartUpload>".encode()
    assert upload.complete is not None
    try:
        with _request(upload.complete, method="POST", data=data, headers={"Content-Length": str(len(data))}) as resp:
            text = resp.read(1 << 16).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        raise _refusal(exc, f"{what} (completing the upload)") from None
    except OSError as exc:
        raise LinksError(f"{what}: the store could not be reached: {exc}") from None
    if "<Error>" in text:  # S3 may answer 200 and report the failure in the body
        raise LinksError(f"{what}: the store did not complete the upload: {text[:300]}")
    return sent


def site_bucket_policy(store: ModelStore, *, job: str, site: str) -> dict[str, Any]:
    """The IAM policy for ``site``'s own store identity, where links cannot be presigned: read,
    write and clear only its own update slots (every run and round of ``job``), read only the global
    models and their records, list nothing. Nothing grants ``s3:ListBucket``: a listing would name
    the other sites' slots, and some S3 emulators ignore prefix conditions on it."""
    bucket, prefix = bucket_key(store.root)
    base = f"arn:aws:s3:::{bucket}/{prefix.rstrip('/') + '/' if prefix.strip('/') else ''}{job}/*/round-*"
    name = store.site_update(job, "r", 1, site).name.removesuffix(".safetensors")
    return {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Sid": "ReadGlobalModels",
                "Effect": "Allow",
                "Action": ["s3:GetObject"],
                "Resource": [f"{base}/global.safetensors", f"{base}/global.json"],
            },
            {
                "Sid": "OwnUpdateSlot",
                "Effect": "Allow",
                # Get and Delete: the site task clears its slot before a try and checks what is there.
                "Action": ["s3:PutObject", "s3:GetObject", "s3:DeleteObject", "s3:AbortMultipartUpload"],
                "Resource": [
                    f"{base}/sites/{name}.safetensors",
                    f"{base}/sites/{name}.json",
                    f"{base}/sites/{name}.failure.json",
                ],
            },
        ],
    }
