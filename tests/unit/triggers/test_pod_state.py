"""PodStateTrigger's serialize(): the triggerer rebuilds the trigger from it, so every field must survive."""

from __future__ import annotations

import importlib
import inspect

from flare_airflow.triggers.pod_state import PodStateTrigger

# A value for every constructor argument, none of them the default: a field serialize() dropped
# would come back as its default and fail the comparison below.
NON_DEFAULTS = {
    "pod_name": "flare-unit-site-1-r1",
    "pod_namespace": "fl",
    "kubernetes_conn_id": "site_cluster",
    "config_dict": {"apiVersion": "v1", "clusters": [{"name": "c"}]},
    "in_cluster": False,
    "cluster_context": "ctx",
    "connection_extras": {"namespace": "fl"},
    "pending_timeout": 12.5,
    "startup_timeout": 7.0,
    "execution_deadline": 1_900_000_000.0,
    "grace_period": 3,
    "delete_on_kill": False,
    "redefer_count": 2,
    "group_selector": "flare-airflow/job=unit,flare-airflow/try=1",
    "group_pods": ["fl-unit-site-1-r1-0a1b2c3d-n0", "fl-unit-site-1-r1-0a1b2c3d-n1"],
}


def test_the_test_covers_every_constructor_argument() -> None:
    params = inspect.signature(PodStateTrigger.__init__).parameters
    assert set(params) - {"self"} == set(NON_DEFAULTS)
    for name, value in NON_DEFAULTS.items():
        assert params[name].default != value, name


def test_serialize_round_trip_keeps_every_field() -> None:
    trigger = PodStateTrigger(**NON_DEFAULTS)
    path, kwargs = trigger.serialize()
    assert kwargs == NON_DEFAULTS
    module, _, name = path.rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    assert cls is PodStateTrigger
    rebuilt = cls(**kwargs)
    assert rebuilt.serialize() == (path, kwargs)
    for field, value in NON_DEFAULTS.items():
        assert getattr(rebuilt, field) == value, field


def test_defaults_serialize_too() -> None:
    path, kwargs = PodStateTrigger(pod_name="p", pod_namespace="default").serialize()
    assert PodStateTrigger(**kwargs).serialize() == (path, kwargs)
