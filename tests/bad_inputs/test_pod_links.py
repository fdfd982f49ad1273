"""Bad-input battery: a strict pod site whose worker cannot share the round's store links with its
pod (issue 36 item 4, docs/model-store.md "Pod sites"). The worker stages through the links into a
folder under the site's ``store_mount``; without one, or resumed on a worker that does not see the
folder the deferred task staged into, the site task is refused with a CONFIG_ERROR saying what to
set. No store or cluster is needed: the refusals come before either is reached (the failure record
through the links is tested against the S3 emulator in tests/integration/k8s/test_site_pod_operator.py).
"""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import ModelStore
from flare_airflow.core.store_links import mint_site_links
from flare_airflow.operators.links import SharedLinksStaging
from flare_airflow.operators.pod import SitePodOperator
from flare_airflow.site_task.build import train_run
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
]  # fmt: skip

STORE = "s3://flare/store"


@pytest.mark.parametrize("bad_case", CASES, ids=[c.id for c in CASES])
def test_a_pod_site_that_cannot_share_its_links_is_refused(bad_case: Case, tmp_path: pathlib.Path) -> None:
    k8s: dict[str, object] = {"image": "registry.example/flare/trainer:1"}
    if bad_case.id == "pod-links-folder-not-shared":
        k8s["store_mount"] = {"host_path": str(tmp_path / "mount"), "mount_path": "/flare-store"}
    site = {"launcher": "k8s", "launcher_spec": {"k8s": k8s}}
    job = make_job(tmp_path, store=STORE, min_clients=1, sites={"site-1": site})
    op = SitePodOperator(task_id="site-1", job=job, site="site-1", round_num=1)
    with pytest.raises(FlareAirflowError) as refused:
        mount = op.links_folder()
        run = train_run(
            job, "site-1", 1, store=ModelStore.from_uri(STORE), run_id="r", total_rounds=1, hparams={}, argv=["true"],
            try_number=1, global_sha256=None, trust=None,
        )  # fmt: skip
        links = mint_site_links(
            Presigner(), ModelStore.from_uri(STORE), job=job.job, run_id="r", round_num=1, site="site-1",
            expires_in=600, update_size=1000,
        )  # fmt: skip
        SharedLinksStaging.of(run, links, mount, 1, resumed=True)
    assert_clear(bad_case, str(refused.value))
