"""Store links and per-site bucket policies on moto's S3 server (an emulator: flare_airflow_testing/s3_server.py).

Sites hold no store credential (issue 36 item 4): the central side mints each site's round links,
sealed to the site's box key; the site reads the global model and writes its own slot through
them and reaches nothing else. Where links cannot be presigned, a generated per-site policy grants
the same -- tested on the emulator with IAM enforced, both what it allows and what it denies.

The emulator runs with IAM enforced and checks presigned links too (flare_airflow_testing/moto_presigned.py):
a link edited to name another key, an expired one and an unsigned request are refused by the store
itself; the site's own checks (another site's links, last round's, a replaced global) come first.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from urllib.parse import unquote, urlparse

import httpx
import numpy as np
import pytest

from flare_airflow.core.model import FLModel, write_artifact
from flare_airflow.core.store import ModelStore, failure_path, record_path
from flare_airflow.core.store_links import (
    LinksError,
    SiteLinks,
    arrived_parts,
    bucket_key,
    mint_site_links,
    site_bucket_policy,
    upload,
)
from flare_airflow.core.trust import CENTRAL, generate_keys
from flare_airflow.core.trust.keys import party_dir
from flare_airflow.core.trust.sealed import SealedOpenError
from flare_airflow.operators.links import LINKS_KEY, abort_site_uploads, mint_round_links, open_site_links
from flare_airflow.operators.staging import staged
from flare_airflow.site_task.build import train_run
from flare_airflow.site_task.checks import GlobalModelUnusable, check_global_model
from flare_airflow_testing.s3_server import BUCKET, S3Server
from tests.unit.airflow_layer import make_job

RUN = "manual__2026-12-06"
SITES = ("site-1", "site-2")
STORE = f"s3://{BUCKET}/store"


class Log:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def warning(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args)

    info = warning


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def keys(tmp_path, monkeypatch) -> pathlib.Path:
    """Every party's keys and a strict registry listing them: links are minted in strict mode only."""
    key_dir = tmp_path / "keys"
    jwks = [generate_keys(party, party_dir(key_dir, party)).jwks for party in (*SITES, CENTRAL)]
    registry = tmp_path / "registry.json"
    registry.write_text(json.dumps({"keys": [k for j in jwks for k in j["keys"]]}))
    monkeypatch.setenv("FLARE_KEY_DIR", str(key_dir))
    monkeypatch.setenv("FLARE_SITE_KEYS", str(registry))
    return key_dir


def put_model(s3: S3Server, path, model: FLModel, tmp: pathlib.Path):
    """Write ``model`` as the store would (tensors, then record) at ``path`` in the bucket."""
    local = tmp / "m.safetensors"
    record = write_artifact(local, model)
    bucket, key = bucket_key(path)
    s3.client().put_object(Bucket=bucket, Key=key, Body=local.read_bytes())
    s3.client().put_object(Bucket=bucket, Key=bucket_key(record_path(path))[1], Body=record_path(local).read_bytes())
    return record


def get(s3: S3Server, path) -> bytes:
    bucket, key = bucket_key(path)
    return s3.client().get_object(Bucket=bucket, Key=key)["Body"].read()


@pytest.fixture
def round_2(s3, keys, tmp_path):
    """Round 1's global model in the bucket, and the job: what round 2's links are minted for."""
    job = make_job(tmp_path, store=STORE, sites={s: {} for s in SITES})
    store = ModelStore.from_uri(STORE)
    run_id = f"{RUN}-{tmp_path.name}"
    record = put_model(
        s3, store.global_model(job.job, run_id, 1), FLModel(params={"w": np.ones(3, np.float32)}), tmp_path
    )
    return job, store, run_id, record


def site_run(job, store, run_id, site, global_sha256):
    return train_run(
        job, site, 2, store=store, run_id=run_id, total_rounds=2, hparams={}, argv=["true"], try_number=1,
        global_sha256=global_sha256, trust=None,
    )  # fmt: skip


def test_each_site_gets_links_only_for_the_global_model_and_its_own_slot(s3, round_2, tmp_path):
    job, store, run_id, record = round_2
    sealed = mint_round_links(job, store, run_id, 2, record.size, Log(), client=s3.client())
    assert sealed is not None and set(sealed) == set(SITES)
    assert all("http" not in v and "X-Amz" not in v for v in sealed.values()), "XCom carries ciphertext only"
    links = open_site_links({LINKS_KEY: sealed}, job=job.job, run_id=run_id, round_num=2, site="site-1")
    assert links is not None
    urls = [links.global_model, links.global_record, links.update.url, links.update_record, links.failure]
    keys = sorted(unquote(urlparse(str(u)).path) for u in urls)
    prefix = f"/{BUCKET}/store/unit/{store.run_dir(job.job, run_id).name}"
    assert keys == sorted([
        f"{prefix}/round-0001/global.safetensors", f"{prefix}/round-0001/global.json",
        f"{prefix}/round-0002/sites/site-1.safetensors", f"{prefix}/round-0002/sites/site-1.json",
        f"{prefix}/round-0002/sites/site-1.failure.json",
    ])  # fmt: skip

    # The site stages through them: the global model checks out, its update lands in its own slot.
    run = site_run(job, store, run_id, "site-1", record.sha256)
    with staged(run, store, links) as local:
        check_global_model(local)
        update = write_artifact(pathlib.Path(local.output), FLModel(params={"w": np.full(3, 2.0, np.float32)}))
    slot = store.site_update(job.job, run_id, 2, "site-1")
    assert json.loads(get(s3, record_path(slot)))["sha256"] == update.sha256
    assert not s3.keys(bucket_key(store.site_update(job.job, run_id, 2, "site-2"))[1])


def test_a_sites_links_are_signed_for_its_own_view_of_the_store(s3, round_2, keys, monkeypatch):
    """A grant's ``store_endpoint``: where that site reaches the store (a split network view). Its
    links name that host (SigV4 signs it); a site without one gets the connection's endpoint. The
    central connection is read, and its boto3 session made, once for all the sites' endpoints."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook

    job, store, run_id, record = round_2
    job = job.model_copy(update={"store_conn_id": "flare_store"})
    monkeypatch.setenv("AIRFLOW_CONN_FLARE_STORE", s3.connection())
    sessions: list[str | None] = []
    get_session = S3Hook.get_session

    def counted(hook, *args, **kwargs):
        sessions.append(hook.aws_conn_id)
        return get_session(hook, *args, **kwargs)

    monkeypatch.setattr(S3Hook, "get_session", counted)
    registry = pathlib.Path(os.environ["FLARE_SITE_KEYS"])
    data = json.loads(registry.read_text())

    def hosts_with(grants: dict) -> dict[str, str]:
        data["flare_sites"] = grants
        registry.write_text(json.dumps(data))
        sealed = mint_round_links(job, store, run_id, 2, record.size, Log())
        assert sealed is not None
        hosts = {}
        for site in SITES:
            opened = open_site_links({LINKS_KEY: sealed}, job=job.job, run_id=run_id, round_num=2, site=site)
            assert opened is not None
            hosts[site] = urlparse(opened.global_model).netloc
        return hosts

    own = {"site-1": {"store_endpoint": "http://10.77.0.2:9000"}, "site-2": {"store_endpoint": "http://10.77.0.1:9000"}}
    assert hosts_with(own) == {"site-1": "10.77.0.2:9000", "site-2": "10.77.0.1:9000"}
    # One for the clients of the connection's endpoint and of both sites' views, one the hook makes
    # to resolve the connection's region; a hook and session per client made 6.
    assert sessions == ["flare_store"] * 2
    sessions.clear()
    assert hosts_with({"site-2": own["site-2"]}) == {"site-1": f"{s3.host}:{s3.port}", "site-2": "10.77.0.1:9000"}
    assert sessions == ["flare_store"] * 2


def test_site_1_cannot_open_site_2s_links_nor_last_rounds(s3, round_2, keys):
    job, store, run_id, record = round_2
    sealed = mint_round_links(job, store, run_id, 2, record.size, Log(), client=s3.client())
    assert sealed is not None
    with pytest.raises(SealedOpenError, match="not to this worker's box key"):
        # site-1's worker, handed site-2's entry (an XCom copied between sites)
        open_site_links(
            {LINKS_KEY: {"site-1": sealed["site-2"]}}, job=job.job, run_id=run_id, round_num=2, site="site-1"
        )
    # Last round's genuine links, put in this round's XCom: bound to round 2, they do not open for 3.
    with pytest.raises(SealedOpenError, match="another job, run, round or party"):
        open_site_links({LINKS_KEY: sealed}, job=job.job, run_id=run_id, round_num=3, site="site-1")
    links = open_site_links({LINKS_KEY: sealed}, job=job.job, run_id=run_id, round_num=2, site="site-1")
    assert links is not None
    with pytest.raises(LinksError, match="for round 2, not 3"):
        links.check(job=job.job, run_id=run_id, round_num=3, site="site-1")
    with pytest.raises(LinksError, match=r"expired.*clear the task that published"):
        links.check(job=job.job, run_id=run_id, round_num=2, site="site-1", now=links.expires + 1)


def test_a_global_model_replaced_after_minting_is_refused_before_the_trainer(s3, round_2, tmp_path):
    job, store, run_id, record = round_2
    sealed = mint_round_links(job, store, run_id, 2, record.size, Log(), client=s3.client())
    assert sealed is not None
    # Whoever can write the store replaces the global model and its record after round 1 signed it.
    put_model(
        s3, store.global_model(job.job, run_id, 1), FLModel(params={"w": np.full(3, -10.0, np.float32)}), tmp_path
    )
    links = open_site_links({LINKS_KEY: sealed}, job=job.job, run_id=run_id, round_num=2, site="site-2")
    assert links is not None
    run = site_run(job, store, run_id, "site-2", record.sha256)  # the signed record's digest
    with pytest.raises(GlobalModelUnusable, match="it was replaced"), staged(run, store, links) as local:
        check_global_model(local)


def test_an_update_beyond_one_put_goes_up_in_parts(s3, round_2, tmp_path):
    job, store, run_id, record = round_2
    links = mint_site_links(
        s3.client(), store, job=job.job, run_id=run_id, round_num=2, site="site-1", expires_in=600,
        update_size=11 << 20, single_put_limit=1 << 20, part_size=5 << 20,
    )  # fmt: skip
    assert links.update.url is None and len(links.update.parts) == 3
    links = SiteLinks.from_json(links.to_json(), "test")
    run = site_run(job, store, run_id, "site-1", record.sha256)
    with staged(run, store, links) as local:
        params = {"w": np.arange((11 << 20) // 4, dtype=np.float32)}
        update = write_artifact(pathlib.Path(local.output), FLModel(params=params))
    slot = store.site_update(job.job, run_id, 2, "site-1")
    got = get(s3, slot)
    assert len(got) == update.size > 10 << 20
    assert json.loads(get(s3, record_path(slot)))["size"] == len(got)


# A writer that SIGKILLs itself right after its second part arrived: a site worker killed midway.
_KILLED_WRITER = """
import os, pathlib, signal, sys
from flare_airflow.core import store_links
links = store_links.SiteLinks.from_json(pathlib.Path(sys.argv[1]).read_text(), "test")
put, sent = store_links._put, []
def put_then_die(*args, **kwargs):
    sent.append(put(*args, **kwargs))
    if len(sent) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return sent[-1]
store_links._put = put_then_die
store_links.upload(links.update, pathlib.Path(sys.argv[2]), "killed writer")
"""


def test_an_upload_killed_midway_resumes_without_resending_what_arrived(s3, round_2, tmp_path):
    job, store, run_id, _ = round_2
    part = 5 << 20  # S3's smallest part
    links = mint_site_links(
        s3.client(), store, job=job.job, run_id=run_id, round_num=2, site="site-1", expires_in=600,
        update_size=4 * part, single_put_limit=part, part_size=part,
    )  # fmt: skip
    assert links.update.listings and len(links.update.parts) == 5
    rng = np.random.default_rng(7)
    local = tmp_path / "update.bin"
    local.write_bytes(rng.bytes(4 * part + 12345))  # the last part short
    (tmp_path / "links.json").write_text(links.to_json())
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "links.json"), str(local)], check=False, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL
    slot = store.site_update(job.job, run_id, 2, "site-1")
    assert not s3.keys(bucket_key(slot)[1]), "a killed writer completes nothing"
    assert sorted(arrived_parts(links.update, "test")) == [1, 2]

    sent = upload(links.update, local, "the resumed writer")
    assert sent == local.stat().st_size - 2 * part  # parts 1 and 2 were not sent again
    assert get(s3, slot) == local.read_bytes()


def test_a_resumed_upload_sends_again_a_part_whose_bytes_changed(s3, round_2, tmp_path):
    """A retried site task that trained again writes other bytes: a listed part counts only if its
    ETag is the MD5 of the part the new writer holds."""
    job, store, run_id, _ = round_2
    part = 5 << 20
    links = mint_site_links(
        s3.client(), store, job=job.job, run_id=run_id, round_num=2, site="site-2", expires_in=600,
        update_size=2 * part, single_put_limit=part, part_size=part,
    )  # fmt: skip
    local = tmp_path / "update.bin"
    first = np.random.default_rng(1).bytes(2 * part)
    local.write_bytes(first)
    _put_part(links.update, 1, first[:part])
    _put_part(links.update, 2, first[part:])
    second = first[:part] + np.random.default_rng(2).bytes(part)  # part 2 differs
    local.write_bytes(second)
    assert upload(links.update, local, "the retried writer") == part
    assert get(s3, store.site_update(job.job, run_id, 2, "site-2")) == second


def _open_uploads(s3: S3Server) -> set[str]:
    return {u["Key"] for u in s3.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])}


def test_unfinished_uploads_resume_within_the_round_and_are_aborted_after_it(s3, keys, tmp_path, monkeypatch) -> None:
    """Site-1's writer is killed after two of its three parts and its retry resumes; site-2's
    stops for good after one. The round's real aggregation (strict mode, the central connection)
    counts site-1 and aborts what is left of round 2 -- not another run's upload; the run's
    verdict would end the rest (test_aggregate.py checks it calls the same)."""
    from flare_airflow.core.store_links import Upload
    from flare_airflow.operators.aggregate import AggregateOperator
    from flare_airflow.operators.trust import sign_global
    from tests.unit.airflow_layer import FakeTI, context

    monkeypatch.setenv("AIRFLOW_CONN_FLARE_STORE", s3.connection())
    job = make_job(tmp_path, store=STORE, store_conn_id="flare_store", rounds=2, min_clients=1,
                   sites={s: {} for s in SITES})  # fmt: skip
    store = ModelStore.from_uri(STORE)
    run_id = f"{RUN}-{tmp_path.name}"
    part, n = 5 << 20, (10 << 20) // 4  # 10 MiB of float32: with the header, three 5 MiB parts
    global_1 = FLModel(params={"w": np.zeros(n, np.float32)})
    record = put_model(s3, store.global_model(job.job, run_id, 1), global_1, tmp_path)

    def slot(site: str, run: str = run_id) -> str:
        return bucket_key(store.site_update(job.job, run, 2, site))[1]

    def mint(site: str) -> SiteLinks:
        return mint_site_links(
            s3.client(), store, job=job.job, run_id=run_id, round_num=2, site=site, expires_in=600,
            update_size=record.size, single_put_limit=part, part_size=part,
        )  # fmt: skip

    links = {site: mint(site) for site in SITES}
    local = tmp_path / "update.safetensors"
    update = write_artifact(local, FLModel(params={"w": np.ones(n, np.float32)}, meta={"num_samples": 10}))
    assert len(links["site-1"].update.parts) == 3 and update.size > 2 * part
    (tmp_path / "links.json").write_text(links["site-1"].to_json())
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(tmp_path / "links.json"), str(local)], check=False, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL
    _put_part(links["site-2"].update, 1, local.read_bytes()[:part])
    # Another run whose id starts with this one's: none of its uploads is this run's to end.
    other_run = s3.client().create_multipart_upload(Bucket=BUCKET, Key=slot("site-1", f"{run_id}0"))
    assert {slot("site-1"), slot("site-2")} <= _open_uploads(s3)

    # site-1's task retried within the round: the upload is still open and resumes.
    assert upload(links["site-1"].update, local, "the retried writer") == update.size - 2 * part
    upload(Upload(url=links["site-1"].update_record), record_path(local), "its record")

    ti = FakeTI(run_id=run_id)
    ti.xcoms[("round_1.global_model", "return_value")] = {
        "sha256": record.sha256, "signed": sign_global(job.job, run_id, 1, record),
    }  # fmt: skip
    aggregation = AggregateOperator(task_id="round_2.global_model", job=job, round_num=2,
                                    global_task_id="round_1.global_model")  # fmt: skip
    summary = aggregation.execute({**context(ti), "run_id": run_id})
    assert summary["accepted"] == ["site-1"] and "site-2" in summary["rejected"]
    assert slot("site-2") not in _open_uploads(s3), "the round's unfinished upload was aborted"
    assert slot("site-1", f"{run_id}0") in _open_uploads(s3)
    # A site-2 task run again after its round was aggregated is told why and what to clear.
    with pytest.raises(LinksError, match=r"NoSuchUpload\).*aborted this round's upload.*mint new links"):
        upload(links["site-2"].update, local, "a late writer")
    s3.client().abort_multipart_upload(Bucket=BUCKET, Key=other_run["Key"], UploadId=other_run["UploadId"])


def test_the_runs_end_aborts_every_round_the_aggregations_did_not(s3, round_2, keys):
    """A round that failed (no aggregation ended it) and the next round's upload: the verdict's call."""
    job, store, run_id, _ = round_2
    for r in (2, 3):
        mint_site_links(
            s3.client(), store, job=job.job, run_id=run_id, round_num=r, site="site-1", expires_in=600,
            update_size=2 << 20, single_put_limit=1 << 20, part_size=5 << 20,
        )  # fmt: skip
    log = Log()
    aborted = abort_site_uploads(job, run_id, log, store=store, client=s3.client())
    assert sorted(aborted) == sorted(bucket_key(store.site_update(job.job, run_id, r, "site-1"))[1] for r in (2, 3))
    assert f"run {run_id}: aborted 2 unfinished site upload(s)" in log.lines[-1]
    assert not any(key.startswith(bucket_key(store.run_dir(job.job, run_id))[1] + "/") for key in _open_uploads(s3))


def test_links_minted_again_abort_the_uploads_of_the_links_they_replace(s3, round_2):
    """The publishing task retried (or cleared for fresh links): each site's earlier upload of the
    round is ended, only the new links' upload stays open."""
    job, store, run_id, _ = round_2
    size = 200 << 20  # the global model's size: beyond one PUT, so each site's update is an upload in parts
    first = mint_round_links(job, store, run_id, 2, size, Log(), client=s3.client())
    log = Log()
    again = mint_round_links(job, store, run_id, 2, size, log, client=s3.client())
    assert first and again
    slots = {bucket_key(store.site_update(job.job, run_id, 2, site))[1]: site for site in SITES}
    open_ids = {
        u["UploadId"]: slots[u["Key"]]
        for u in s3.client().list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])
        if u["Key"] in slots
    }
    assert sorted(open_ids.values()) == sorted(SITES), "one upload per site: the new links'"
    for site in SITES:
        links = open_site_links({LINKS_KEY: again}, job=job.job, run_id=run_id, round_num=2, site=site)
        assert links is not None and any(upload_id in links.update.complete for upload_id in open_ids)
    assert "round 2: aborted 2 unfinished site upload(s)" in log.lines[0]
    assert abort_site_uploads(job, run_id, log, store=store, client=s3.client())  # the run's end, for the next test


def test_uploads_are_aborted_only_where_links_were_minted(s3, round_2, monkeypatch):
    """Outside strict mode no link opened an upload: nothing is listed or aborted (the store may
    be the sites' own to manage); a store that cannot be reached is logged, not raised."""
    job, store, run_id, _ = round_2
    monkeypatch.delenv("FLARE_SITE_KEYS")

    class Unused:
        def __getattr__(self, name: str) -> object:
            raise AssertionError(f"the store was asked {name}")

    assert abort_site_uploads(job, run_id, Log(), store=store, client=Unused()) == []


def _put_part(up, n: int, piece: bytes) -> None:
    httpx.put(up.parts[n - 1], content=piece, timeout=60).raise_for_status()


def test_the_store_checks_each_link_it_serves(s3, round_2):
    """Allow and deny at the store (IAM on): a site's genuine links read the global model and
    write its slot; the same links edited to name another key (another site's slot, another round's,
    another run's global), expired, or a request with no signature at all are refused."""
    job, store, run_id, _ = round_2
    links = mint_site_links(
        s3.client(), store, job=job.job, run_id=run_id, round_num=2, site="site-2", expires_in=600, update_size=64
    )
    put = str(links.update.url)
    assert httpx.get(links.global_model, timeout=30).read() == get(s3, store.global_model(job.job, run_id, 1))
    assert httpx.put(put, content=b"site-2's update", timeout=30).status_code == 200
    other_run = store.run_dir(job.job, run_id).name
    refused = {
        "site-1's slot": ("PUT", put.replace("/sites/site-2.", "/sites/site-1.")),
        "round 3's slot": ("PUT", put.replace("/round-0002/", "/round-0003/")),
        "another run's global": ("GET", links.global_model.replace(other_run, "another-run")),
        "no signature": ("GET", put.split("?", 1)[0]),
    }
    codes = {}
    for what, (verb, url) in refused.items():
        r = httpx.request(verb, url, content=b"-10x" if verb == "PUT" else None, timeout=30)
        codes[what] = (r.status_code, r.text.partition("<Code>")[2].partition("</Code>")[0] or r.reason_phrase)
    assert codes == {
        "site-1's slot": (403, "SignatureDoesNotMatch"),
        "round 3's slot": (403, "SignatureDoesNotMatch"),
        "another run's global": (403, "SignatureDoesNotMatch"),
        "no signature": (403, "FORBIDDEN"),  # moto's ACL check for an existing object, before IAM
    }
    assert not s3.keys(bucket_key(store.site_update(job.job, run_id, 2, "site-1"))[1])
    expired = mint_site_links(
        s3.client(), store, job=job.job, run_id=run_id, round_num=2, site="site-2", expires_in=1, update_size=64
    )
    time.sleep(2)
    r = httpx.get(expired.global_model, timeout=30)
    assert (r.status_code, "Request has expired" in r.text) == (403, True), r.text


def test_a_per_site_policy_allows_its_slot_and_the_global_and_denies_the_rest(s3):
    store = ModelStore.from_uri(STORE)
    admin = s3.client()
    slots = {s: bucket_key(store.site_update("unit", RUN, 1, s))[1] for s in SITES}
    global_key = bucket_key(store.global_model("unit", RUN, 0))[1]
    admin.put_object(Bucket=BUCKET, Key=global_key, Body=b"global")
    admin.put_object(Bucket=BUCKET, Key=slots["site-2"], Body=b"site-2's update")
    site_1 = s3.client(*s3.user_key("site-1", site_bucket_policy(store, job="unit", site="site-1")))

    def denied(call, **kw) -> bool:
        try:
            call(Bucket=BUCKET, **kw)
        except Exception as exc:  # botocore's ClientError
            return "AccessDenied" in str(exc)
        return False

    # allowed: read the global model, write and read back its own slot
    assert site_1.get_object(Bucket=BUCKET, Key=global_key)["Body"].read() == b"global"
    site_1.put_object(Bucket=BUCKET, Key=slots["site-1"], Body=b"site-1's update")
    assert site_1.get_object(Bucket=BUCKET, Key=slots["site-1"])["Body"].read() == b"site-1's update"
    # denied: another site's slot (read or write), the global model (write), listing the bucket
    assert denied(site_1.get_object, Key=slots["site-2"])
    assert denied(site_1.put_object, Key=slots["site-2"], Body=b"-10x")
    assert denied(site_1.put_object, Key=global_key, Body=b"poisoned")
    assert denied(site_1.list_objects_v2, Prefix="store/")
    assert admin.get_object(Bucket=BUCKET, Key=slots["site-2"])["Body"].read() == b"site-2's update"
    assert admin.get_object(Bucket=BUCKET, Key=global_key)["Body"].read() == b"global"


def test_a_site_task_with_refused_links_fails_before_its_trainer_saying_why(s3, round_2) -> None:
    from flare_airflow.operators.links import site_links
    from flare_airflow.operators.site_steps import SiteJobFailed
    from tests.unit.airflow_layer import FakeTI, context

    class TI(FakeTI):
        def xcom_push(self, key: str, value: object) -> None:
            self.xcoms[("self", key)] = value

    job, store, run_id, record = round_2
    sealed = mint_round_links(job, store, run_id, 2, record.size, Log(), client=s3.client())
    assert sealed is not None
    ti = TI(run_id=run_id)
    ctx = {**context(ti), "run_id": run_id}
    ti.xcoms[("round_1.global_model", "return_value")] = {"sha256": record.sha256, LINKS_KEY: sealed}
    links = site_links(ctx, job, "site-2", 2, "round_1.global_model")
    assert links is not None and links.site == "site-2"
    # site-1's entry overwritten with site-2's: site-1's task refuses, its reason in its XCom.
    ti.xcoms[("round_1.global_model", "return_value")] = {
        "sha256": record.sha256,
        LINKS_KEY: {"site-1": sealed["site-2"]},
    }
    with pytest.raises(SiteJobFailed, match=r"not to this worker's box key.*the trainer was not started"):
        site_links(ctx, job, "site-1", 2, "round_1.global_model")
    assert "not to this worker's box key" in ti.xcoms[("self", "failure")]


def test_a_site_task_without_any_store_connection_runs_its_round_through_its_links(
    s3, keys, tmp_path, monkeypatch
) -> None:
    """The real site-task lifecycle (operators/lifecycle.py) with the fake backend of its unit
    tests: no store connection is defined or named, the job is launched on local files, and its
    result -- here a failure record -- lands in the site's slot through the links."""
    from flare_airflow.core.spec import JobReturnCode
    from flare_airflow.operators import lifecycle, site_steps
    from flare_airflow.operators.site_steps import SiteJobFailed
    from flare_airflow.operators.trust import sign_global
    from tests.unit.airflow_layer import RUN_ID, FakeTI, context
    from tests.unit.operators.fake_site_task import FakeLauncher, fake_task

    job = make_job(tmp_path, store=STORE, sites={s: {} for s in SITES})
    assert job.store_conn_id is None  # nothing on this worker could reach the store by itself
    store = ModelStore.from_uri(STORE)
    for module in (lifecycle, site_steps):
        monkeypatch.setattr(module, "store_for", lambda job, conn_id=None: store)
    record = put_model(
        s3, store.global_model(job.job, RUN_ID, 0), FLModel(params={"w": np.ones(3, np.float32)}), tmp_path
    )
    sealed = mint_round_links(job, store, RUN_ID, 1, record.size, Log(), client=s3.client())
    ti = FakeTI()
    ti.xcoms[("prepare", "return_value")] = {
        "sha256": record.sha256, "signed": sign_global(job.job, RUN_ID, 0, record), LINKS_KEY: sealed,
    }  # fmt: skip
    launcher = FakeLauncher(JobReturnCode.EXECUTION_ERROR)
    task = fake_task(job, launcher, stages=True)
    task.global_task_id = "prepare"
    with pytest.raises(SiteJobFailed, match=r"EXECUTION_ERROR"):
        task.execute(context(ti))
    (launched,) = launcher.launched
    assert not launched.env["FLARE_GLOBAL_MODEL"].startswith("s3://")  # a local copy, read through a link
    assert "EXECUTION_ERROR" in get(s3, failure_path(store.site_update(job.job, RUN_ID, 1, "site-1"))).decode()
