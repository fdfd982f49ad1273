"""Bad-input battery, category "site_env": a site admin's policy file (FLARE_SITE_CONFIG on the worker).

Each case loads the policy as the site task does on the site's worker and applies it to a job's
request; the admin (or the job author) is told the file, the site, the field and what to do.
"""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow.core.config import apply_site_policy, load_site_policy
from flare_airflow.core.errors import ConfigError
from tests.bad_inputs.cases import Case, assert_clear
from tests.unit.airflow_layer import make_job

CASES = [
    Case("policy-missing", "site_env", "FLARE_SITE_CONFIG names a file that does not exist",
         "site policy (FLARE_SITE_CONFIG / [flare] site_config): "),
    Case("policy-not-a-mapping", "site_env", "the policy file is a YAML list", "must be a YAML mapping"),
    Case("policy-unknown-key", "site_env", "a policy entry with a key the policy does not know (retries)",
         "sites.site-1.retries (site 'site-1'): unknown key 'retries'"),
    Case("policy-unknown-backend", "site_env", "launcher_spec names a backend that does not exist",
         "unknown key 'podman'"),
    Case("policy-bad-conn-id", "site_env", "store_conn_id with a space in it",
         "store_conn_id must be an Airflow connection id: letters, digits, '.', '_' and '-'"),
    Case("policy-too-few-gpus", "site_env", "the job asks for 4 GPUs, the site's policy allows 2",
         "the job's request does not fit the site's policy: a site job asks for 4 GPUs but the site has only 2"),
    Case("policy-other-site", "site_env", "a task of site-2 reaches the worker of site-1 (wrong --queues)",
         "covers only site-1; a task of site 'site-2' reached a worker of another site"),
    Case("policy-other-launcher", "site_env", "the site runs k8s, the job built a process task for it",
         "the site runs its jobs with launcher 'k8s' but this job's DAG built a 'process' task for it"),
    Case("policy-confinement-bad-mode", "site_env", "confinement mode 'yes' (not auto, required or off)",
         "sites.site-1.confinement.mode (site 'site-1'): must be 'auto', 'required' or 'off'"),
    Case("policy-confinement-off-with-rules", "site_env", "confinement mode off with network: false",
         "mode 'off' runs the trainer unconfined, so network, writable and devices would not apply"),
    Case("policy-confinement-relative-writable", "site_env", "confinement.writable names a relative path",
         "writable entry 'scratch' must be an absolute path on the site's worker"),
    Case("policy-confinement-root-writable", "site_env", "confinement.writable makes / writable",
         "writable entry '/' is the whole file system: that is mode 'off', say so"),
    Case("policy-confinement-dotdot-writable", "site_env", "confinement.writable with '..' in it",
         "writable entry '/data/../etc' must not contain '..'"),
    Case("policy-confinement-not-a-device", "site_env", "confinement.devices names a file outside /dev",
         "devices entry '/etc/shadow' is not a device node under /dev/"),
    Case("policy-confinement-network-string", "site_env", "confinement.network: 'no' (a string)",
         "sites.site-1.confinement.network (site 'site-1'): must be true or false"),
    Case("policy-confinement-k8s-site", "site_env", "confinement on a Kubernetes site",
         "confinement applies to process sites; a 'k8s' site's trainers are confined by their pod"),
]  # fmt: skip

TEXT = {
    "policy-not-a-mapping": "- site-1\n",
    "policy-unknown-key": "sites:\n  site-1: {retries: 3}\n",
    "policy-unknown-backend": "sites:\n  site-1: {launcher_spec: {podman: {}}}\n",
    "policy-bad-conn-id": "sites:\n  site-1: {store_conn_id: my store}\n",
    "policy-too-few-gpus": "sites:\n  site-1: {resource_manager: {type: gpu, num_of_gpus: 2}}\n",
    "policy-other-site": "sites:\n  site-1: {}\n",
    "policy-other-launcher": "sites:\n  site-1: {launcher: k8s, launcher_spec: {k8s: {image: 'trainer:1'}}}\n",
    "policy-confinement-bad-mode": "sites:\n  site-1: {confinement: {mode: 'yes'}}\n",
    "policy-confinement-off-with-rules": "sites:\n  site-1: {confinement: {mode: 'off', network: false}}\n",
    "policy-confinement-relative-writable": "sites:\n  site-1: {confinement: {writable: [scratch]}}\n",
    "policy-confinement-root-writable": "sites:\n  site-1: {confinement: {writable: [/]}}\n",
    "policy-confinement-dotdot-writable": "sites:\n  site-1: {confinement: {writable: [/data/../etc]}}\n",
    "policy-confinement-not-a-device": "sites:\n  site-1: {confinement: {devices: [/etc/shadow]}}\n",
    "policy-confinement-network-string": "sites:\n  site-1: {confinement: {network: 'no'}}\n",
    "policy-confinement-k8s-site": "sites:\n  site-1: {launcher: k8s, confinement: {mode: required}}\n",
}
SITE = {"policy-other-site": "site-2"}


@pytest.mark.parametrize("bad_case", CASES, ids=[c.id for c in CASES])
def test_bad_site_policy_gets_a_clear_error(bad_case: Case, tmp_path: pathlib.Path) -> None:
    job = make_job(
        tmp_path,
        sites={
            "site-1": {"resource_spec": {"num_of_gpus": 4}, "resource_manager": {"type": "gpu", "num_of_gpus": 4}},
            "site-2": {},
        },
    )
    path = tmp_path / "site.yaml"
    if bad_case.id in TEXT:
        path.write_text(TEXT[bad_case.id])
    with pytest.raises(ConfigError) as info:
        apply_site_policy(job, SITE.get(bad_case.id, "site-1"), load_site_policy(path))
    assert_clear(bad_case, str(info.value))
    assert str(path) in str(info.value)
    if bad_case.id == "policy-missing":
        assert "cannot read the site policy file (No such file or directory)" in str(info.value)
