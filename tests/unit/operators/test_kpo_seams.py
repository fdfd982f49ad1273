"""What SitePodOperator relies on in the installed cncf provider beyond its documented API.

Public seams are used wherever one exists (the kubeconfig is read from ``config_file`` rather than
the operator's private ``_config_dict``; pods are deleted through our own ``delete_pod``). What
remains is pinned here, one test per method, against the provider versions it was checked with: a
provider upgrade that changes any of it fails these tests by name instead of a pod task at run time.

Remaining private or internal seams:

- ``KubernetesPodOperator._get_ti_pod_labels(context, include_try_number=True)``: the stock operator's
  identifying labels, added to our pods so that Airflow's own tooling finds them.
- the ``_redefer_count`` key: the stock ``trigger_reentry`` reads it from an ``error`` event and
  hands it back in ``trigger_kwargs`` before calling our ``invoke_defer_method``.
- ``execute_async`` passes ``context=`` to ``invoke_defer_method`` only when its signature names it
  (our override needs the context for the execution deadline).
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from airflow.providers.cncf.kubernetes import __version__ as provider_version
from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator
from packaging.version import Version

from flare_airflow.operators.pod import SitePodOperator

CHECKED = (Version("10.25.0"), Version("11"))  # [checked, next major): pyproject pins the same range


def test_the_installed_provider_is_a_checked_version() -> None:
    low, high = CHECKED
    assert low <= Version(provider_version) < high, (
        f"apache-airflow-providers-cncf-kubernetes {provider_version} was not checked: re-check the seams "
        "in this module (and SitePodOperator's overrides), then widen CHECKED"
    )


def test_get_ti_pod_labels_keeps_its_signature_and_labels() -> None:
    member = inspect.getattr_static(KubernetesPodOperator, "_get_ti_pod_labels")
    assert isinstance(member, staticmethod)
    params = inspect.signature(KubernetesPodOperator._get_ti_pod_labels).parameters
    assert list(params) == ["context", "include_try_number"]
    assert params["context"].default is None and params["include_try_number"].default is True
    ti = SimpleNamespace(dag_id="flare_job", task_id="round_1.site-1", map_index=-1, try_number=2)
    labels = KubernetesPodOperator._get_ti_pod_labels({"ti": ti, "run_id": "manual__1", "dag": SimpleNamespace()})
    assert labels == {
        "dag_id": "flare_job",
        "task_id": "round_1.site-1",
        "run_id": "manual__1",
        "kubernetes_pod_operator": "True",
        "try_number": "2",
    }


def test_trigger_reentry_hands_the_redefer_count_back_through_trigger_kwargs() -> None:
    source = inspect.getsource(KubernetesPodOperator.trigger_reentry)
    assert 'event.get("_redefer_count", 0)' in source
    assert 'self.trigger_kwargs["_redefer_count"] = redefer_count + 1' in source
    assert "self.invoke_defer_method(" in source
    assert isinstance(KubernetesPodOperator.MAX_REDEFER_ATTEMPTS, int)


def test_execute_async_passes_the_context_to_our_invoke_defer_method() -> None:
    source = inspect.getsource(KubernetesPodOperator.execute_async)
    assert 'if "context" in sig.parameters:' in source
    assert "self.invoke_defer_method(context=context)" in source
    assert "context" in inspect.signature(SitePodOperator.invoke_defer_method).parameters


def test_the_overridden_methods_keep_the_stock_signatures() -> None:
    for name in ("build_pod_request_obj", "execute_sync", "trigger_reentry", "invoke_defer_method"):
        ours = inspect.signature(getattr(SitePodOperator, name))
        stock = inspect.signature(getattr(KubernetesPodOperator, name))
        assert list(ours.parameters) == list(stock.parameters), name
