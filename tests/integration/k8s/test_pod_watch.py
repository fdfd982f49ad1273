"""The pod-state trigger follows pods that run longer than every client-side timeout, through
dropped connections, with a few API requests per minute -- on the real control plane (the LOCAL
NODE AGENT test harness plays the kubelet).

The provider's async API client gives every request a 60 s total timeout unless the call names its
own; a watch that did not expect it ended with ``asyncio.TimeoutError`` after ~60 s and the task
failed with "Trigger failure" (issue 9, 0b). A 75 s pod through the deferrable SitePodOperator alone
is checked in test_pod_scheduler.py, at the same time as the same drill through Airflow's scheduler.
"""

from __future__ import annotations

import contextlib
import pathlib
import socket
import threading
from collections.abc import Iterator

import pytest
import yaml

from flare_airflow.triggers import pod_state
from tests.integration.k8s.test_site_pod_operator import context_for, make_op, pods, run_deferred


class _DroppingProxy:
    """A TCP proxy on loopback in front of the apiserver whose connections can all be cut at once."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def drop_all(self) -> int:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        return len(conns) // 2

    def close(self) -> None:
        self._closed = True
        self.server.close()
        self.drop_all()


@pytest.fixture
def proxy(control_plane) -> Iterator[_DroppingProxy]:
    host, port = control_plane.server.split("://", 1)[1].rsplit(":", 1)
    p = _DroppingProxy((host, int(port)))
    try:
        yield p
    finally:
        p.close()


def test_the_watch_resumes_after_dropped_connections_and_server_timeouts(
    tmp_path, control_plane, node_agent, namespace, core, audit, proxy, monkeypatch
) -> None:
    # Short watches (the server ends each after 3 s) and connections cut every 4 s while a 16 s pod
    # runs: every kind of watch end happens several times.
    monkeypatch.setattr(pod_state, "_MAX_WATCH_SECONDS", 3)
    config = yaml.safe_load(pathlib.Path(control_plane.kubeconfig).read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"https://127.0.0.1:{proxy.port}"
    kubeconfig = tmp_path / "via-proxy.kubeconfig"
    kubeconfig.write_text(yaml.safe_dump(config))
    op, _ = make_op(tmp_path, namespace, kubeconfig, args=["--sleep", "16"])
    mark = audit.mark()
    dropped: list[int] = []
    stop = threading.Event()

    def cut() -> None:
        while not stop.wait(4):
            dropped.append(proxy.drop_all())

    cutter = threading.Thread(target=cut, daemon=True)
    cutter.start()
    try:
        summary = run_deferred(op, context_for(op))
    finally:
        stop.set()
        cutter.join()
    assert summary["num_samples"] == 7
    assert sum(dropped) >= 2, f"connections were cut while the pod ran: {dropped}"
    assert pods(core, namespace) == []
    requests = audit.list_watch_requests(namespace, mark)
    print(f"\nlist/watch requests with cut connections: {requests}")
    # Resumed from the last resourceVersion, never listed again (no 410 here): one list in all,
    # plus the operator's own reads before deferring.
    assert requests.count("list pods") <= 2, requests
    assert requests.count("watch pods") >= 3, requests


def test_a_trigger_that_cannot_reach_the_api_yields_an_error_event(tmp_path, namespace, monkeypatch) -> None:
    """No raise out of run(): the operator gets an event and can clean up."""
    import asyncio

    monkeypatch.setattr(pod_state, "_MAX_FAILURES", 1)
    monkeypatch.setattr(asyncio, "sleep", _no_sleep)
    with socket.create_server(("127.0.0.1", 0)) as s:
        dead_port = s.getsockname()[1]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": f"https://127.0.0.1:{dead_port}", "insecure-skip-tls-verify": True}}
        ],
        "users": [{"name": "u", "user": {"token": "x"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "c",
    }
    trigger = pod_state.PodStateTrigger(pod_name="p", pod_namespace=namespace, config_dict=config)

    async def first() -> dict:
        async for event in trigger.run():
            return dict(event.payload)
        raise AssertionError("no event")

    event = asyncio.run(first())
    assert event["status"] == "error" and "watching the pod failed" in event["reason"], event


_real_sleep = __import__("asyncio").sleep


async def _no_sleep(seconds: float, *args, **kwargs):
    return await _real_sleep(0)


def test_every_trigger_field_survives_serialize() -> None:
    kwargs = {
        "pod_name": "p",
        "pod_namespace": "ns",
        "kubernetes_conn_id": "k",
        "config_dict": {"a": 1},
        "in_cluster": False,
        "cluster_context": "ctx",
        "connection_extras": {"e": 2},
        "pending_timeout": 11.0,
        "startup_timeout": 12.0,
        "execution_deadline": 13.0,
        "grace_period": 14,
        "delete_on_kill": False,
        "redefer_count": 2,
        "group_selector": "flare-airflow/try=1",
        "group_pods": ["p-n0", "p-n1"],
    }
    path, out = pod_state.PodStateTrigger(**kwargs).serialize()
    assert path == "flare_airflow.triggers.pod_state.PodStateTrigger"
    assert out == kwargs
    assert set(kwargs) == set(pod_state.PodStateTrigger._FIELDS)
