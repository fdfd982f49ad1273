"""Bad-input battery: a strict pod site whose worker cannot share the round's store links with its
pod (issue 36 item 4, docs/model-store.md "Pod sites"). The worker stages through the links into a
folder under the site's ``store_mount``; without one, or resumed on a worker that does not see the
folder the deferred task staged into, the site task is refused with a CONFIG_ERROR saying what to
set. No store or cluster is needed: the refusals come before either is reached (the failure record
through the links is tested against the S3 emulator in tests/integration/k8s/test_site_pod_operator.py).
"""

from __future__ import annotations

import os
import pathlib

import pytest

from flare_airflow.core.config import JobConfig
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import ModelStore, failure_path, record_path
from flare_airflow.core.store_links import SiteLinks, mint_site_links
from flare_airflow.operators.links import SharedLinksStaging
from flare_airflow.operators.pod import SitePodOperator
from flare_airflow.site_task.build import train_run
from flare_airflow.site_task.spec import SiteRun
from tests.bad_inputs.cases import Case, assert_clear
from tests.bad_inputs.test_store_links import Presigner
from tests.unit.airflow_layer import make_job

CASES = [
    Case("pod-links-without-store-mount", "kubernetes",
         "a pod site handed store links (strict mode: no store credential) has no store_mount to share with its pod",
         "set launcher_spec.k8s.store_mount (a host_path on the worker's node, or a PVC the worker mounts"),
    Case("pod-links-folder-not-shared", "kubernetes",
         "a deferred pod task resumes on a worker that does not see the folder its links were staged into",
         "every worker serving the site's queue must see the same store_mount folder"),
    Case("pod-links-result-a-symlink", "kubernetes",
         "the pod leaves its failure record in the shared folder as a symbolic link to the worker's private key",
         "is a symbolic link"),
    Case("pod-links-result-a-fifo", "kubernetes",
         "the pod leaves its update's record in the shared folder as a FIFO (the worker's read would block)",
         "is not a regular file"),
]  # fmt: skip
REFUSED_AT_START = [c for c in CASES if c.id in ("pod-links-without-store-mount", "pod-links-folder-not-shared")]
RESULT_CASES = [c for c in CASES if c not in REFUSED_AT_START]

STORE = "s3://flare/store"


def run_and_links(job: JobConfig) -> tuple[SiteRun, SiteLinks]:
    """Site-1's round-1 site run on the store and the round links minted for it."""
    store = ModelStore.from_uri(STORE)
    run = train_run(
        job, "site-1", 1, store=store, run_id="r", total_rounds=1, hparams={}, argv=["true"],
        try_number=1, global_sha256=None, trust=None,
    )  # fmt: skip
    links = mint_site_links(
        Presigner(), store, job=job.job, run_id="r", round_num=1, site="site-1", expires_in=600, update_size=1000
    )
    return run, links


@pytest.mark.parametrize("bad_case", REFUSED_AT_START, ids=[c.id for c in REFUSED_AT_START])
def test_a_pod_site_that_cannot_share_its_links_is_refused(bad_case: Case, tmp_path: pathlib.Path) -> None:
    k8s: dict[str, object] = {"image": "registry.example/flare/trainer:1"}
    if bad_case.id == "pod-links-folder-not-shared":
        k8s["store_mount"] = {"host_path": str(tmp_path / "mount"), "mount_path": "/flare-store"}
    site = {"launcher": "k8s", "launcher_spec": {"k8s": k8s}}
    job = make_job(tmp_path, store=STORE, min_clients=1, sites={"site-1": site})
    op = SitePodOperator(task_id="site-1", job=job, site="site-1", round_num=1)
    with pytest.raises(FlareAirflowError) as refused:
        mount = op.links_folder()
        run, links = run_and_links(job)
        SharedLinksStaging.of(run, links, mount, 1, resumed=True)
    assert_clear(bad_case, str(refused.value))


@pytest.mark.parametrize("bad_case", RESULT_CASES, ids=[c.id for c in RESULT_CASES])
def test_what_the_pod_left_in_the_shared_folder_goes_out_only_as_regular_files(
    bad_case: Case, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pod writes its output folder, which the worker later reads and sends through the links:
    a link planted there to a file the worker can read (its box key) must never be sent; a FIFO
    must not hang the worker. Refused before any byte leaves, and the folder is removed."""
    from flare_airflow.core import store_links

    sent: list[bytes] = []
    monkeypatch.setattr(store_links, "_put", lambda url, data, length, what: sent.append(bytes(length)) or '"e"')
    secret = tmp_path / "box.key"
    secret.write_bytes(b"the site's private box key")
    job = make_job(tmp_path, store=STORE, min_clients=1, sites={"site-1": {}})
    run, links = run_and_links(job)
    shared = SharedLinksStaging.of(run, links, tmp_path / "mount", 1, resumed=False)
    output = pathlib.Path(shared.local.output)
    output.parent.mkdir(parents=True)
    if bad_case.id == "pod-links-result-a-symlink":
        failure_path(output).symlink_to(secret)  # type: ignore[attr-defined]
    else:
        output.write_bytes(b"tensors")
        os.mkfifo(record_path(output))  # type: ignore[arg-type]
    assert shared.has_result
    with pytest.raises(FlareAirflowError) as refused:
        shared.stage_out()
    assert sent == [], "a byte left the worker"
    assert not shared.root.exists()
    assert_clear(bad_case, str(refused.value))
