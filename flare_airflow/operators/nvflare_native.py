"""NVFlare-native mode: one Airflow task runs one job on a real FLARE deployment.

For teams that keep FLARE's own server and clients (its other controllers, its provisioning, its
security model). The task:

1. reads the admin credentials from an Airflow connection (:class:`FlareAdminHook`: the startup
   kit's location and the user, never the DAG);
2. checks readiness: the expected FLARE clients are connected (``expected_clients``);
3. submits the job folder through FLARE's admin API with a submit token derived from
   (dag_id, run_id, task_id, map_index): an Airflow retry finds the job its earlier try submitted
   (queued, running or completed) and follows it instead of starting a second one; only when that
   job ended without completing does a retry submit again (the bridge's generations);
4. defers to :class:`FlareJobTrigger`, which follows the job's status: ``FINISHED:COMPLETED`` is
   success, every other end state fails the task with the status and the tail of the job's logs;
5. downloads the result, reads the global model (``models/server.npy`` by default, never a
   pickle) and publishes it into the model store as safetensors, with the job's ``latest.json``
   pointer and the Asset ``flare_airflow.<job>.global_model``, like a native run.

Killing the task aborts the FLARE job: ``on_kill`` here (a task waiting in the worker) and the
trigger's ``on_kill`` (a deferred task). ``nvflare`` is never imported in Airflow's environment:
every FLARE call runs the admin bridge with the connection's NVFlare interpreter
(:mod:`flare_airflow.nvflare_native.admin`).
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from airflow.sdk import Asset, BaseOperator, Context, ObjectStoragePath
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from flare_airflow.core.model import FLModel, atomic_write, write_artifact
from flare_airflow.core.store import ModelStore, safe_component
from flare_airflow.hooks.flare_admin import DEFAULT_CONN_ID, FlareAdminHook
from flare_airflow.nvflare_native.admin import FlareAdmin
from flare_airflow.nvflare_native.errors import FlareAdminError, FlareCredentialError, FlareResultError
from flare_airflow.nvflare_native.result import DEFAULT_MODEL_FILE, NUMPY_KEY, read_global_model, submit_token
from flare_airflow.nvflare_native.states import map_status
from flare_airflow.operators.common import default_store_uri, push_failure, run_id_of
from flare_airflow.triggers.flare_job import FlareJobTrigger, format_logs

JOB_ID_XCOM_KEY = "flare_job_id"


def flare_model_asset(job_name: str) -> Asset:
    """The Asset a completed FLARE job updates: the name a native run of the same job uses."""
    return Asset(name=f"flare_airflow.{job_name}.global_model")


class FlareJobOperator(BaseOperator):
    """Run an NVFlare job folder on a FLARE deployment and publish its global model.

    :param job_folder: the NVFlare job folder (``meta.json``, ``app*/config``) on the worker.
    :param flare_conn_id: the Airflow connection of the FLARE admin API (:mod:`flare_airflow.hooks.flare_admin`).
    :param job_name: the name the model is published under (store path, ``latest.json``, Asset);
        default: the job folder's name.
    :param expected_clients: FLARE client names (or how many) that must be connected before the
        job is submitted; ``None`` skips the check.
    :param ready_timeout: seconds to wait for them.
    :param store: the model store URI (default: ``file://$AIRFLOW_HOME/flare_store``, as native runs).
    :param store_conn_id: the Airflow connection of the store (s3:// etc.).
    :param model_file: the global model's file in the server's job workspace (``.npy`` or ``.safetensors``).
    :param model_key: the tensor name a ``.npy`` array is stored under (NVFlare's ``numpy_key``).
    :param poll_interval: seconds between status reads.
    :param log_lines: lines of each site's job log a failure carries.
    :param deferrable: follow the job in the triggerer (default) or in this worker.
    """

    template_fields: Sequence[str] = ("job_folder", "flare_conn_id", "store")
    ui_color = "#76b900"

    def __init__(
        self,
        *,
        job_folder: str,
        flare_conn_id: str = DEFAULT_CONN_ID,
        job_name: str | None = None,
        expected_clients: Sequence[str] | int | None = None,
        ready_timeout: float = 60.0,
        store: str | None = None,
        store_conn_id: str | None = None,
        model_file: str = DEFAULT_MODEL_FILE,
        model_key: str = NUMPY_KEY,
        poll_interval: float = 2.0,
        log_lines: int = 30,
        deferrable: bool = True,
        **kwargs: Any,
    ) -> None:
        self.job_name = safe_component(job_name or Path(job_folder).name, "job_name")
        kwargs.setdefault("outlets", [flare_model_asset(self.job_name)])
        super().__init__(**kwargs)
        self.job_folder = job_folder
        self.flare_conn_id = flare_conn_id
        self.expected_clients = expected_clients if isinstance(expected_clients, int) else list(expected_clients or [])
        self.ready_timeout = ready_timeout
        self.store = store
        self.store_conn_id = store_conn_id
        self.model_file = model_file
        self.model_key = model_key
        self.poll_interval = poll_interval
        self.log_lines = log_lines
        self.deferrable = deferrable
        self._admin: FlareAdmin | None = None
        self._job_id: str | None = None

    # --- FLARE calls ----------------------------------------------------------------------------

    def admin(self) -> FlareAdmin:
        if self._admin is None:
            self._admin = FlareAdminHook(self.flare_conn_id).admin()
        return self._admin

    def submit_job(self, context: Context) -> dict[str, Any]:
        """Check readiness, then submit (or find this task's earlier submission); the bridge's answer."""
        ti: Any = context["ti"]
        map_index = getattr(ti, "map_index", None)
        token = submit_token(ti.dag_id, run_id_of(context), ti.task_id, -1 if map_index is None else int(map_index))
        folder = str(Path(self.job_folder).resolve())
        if not (Path(folder) / "meta.json").is_file() and not (Path(folder) / "meta.conf").is_file():
            raise AirflowFailException(f"{folder} is not an NVFlare job folder (no meta.json or meta.conf)")
        answer = self.admin().submit(
            folder, token, expected_clients=self.expected_clients or None, ready_timeout=self.ready_timeout
        )
        if answer.get("clients") is not None:
            self.log.info("FLARE clients connected: %s", ", ".join(answer["clients"]))
        self._job_id = str(answer["job_id"])
        how = "found its earlier submission" if answer["adopted"] else "submitted"
        self.log.info("FLARE job %s: %s %s (status %s, token %s)", self._job_id, how, folder, answer["status"], token)
        return answer

    # --- the task -------------------------------------------------------------------------------

    def execute(self, context: Context) -> Any:
        try:
            answer = self.submit_job(context)
        except FlareCredentialError as exc:  # retrying cannot fix credentials
            push_failure(context, str(exc))
            raise AirflowFailException(str(exc)) from None
        except FlareAdminError as exc:
            push_failure(context, str(exc))
            raise AirflowException(str(exc)) from None
        job_id = str(answer["job_id"])
        context["ti"].xcom_push(key=JOB_ID_XCOM_KEY, value=job_id)
        trigger = FlareJobTrigger(
            job_id=job_id, flare_conn_id=self.flare_conn_id, poll_interval=self.poll_interval, log_lines=self.log_lines
        )
        if self.deferrable:
            self.defer(trigger=trigger, method_name="execute_complete")
        return self.execute_complete(context, self._wait_here(job_id))

    def _wait_here(self, job_id: str) -> dict[str, Any]:
        """Follow the job from this worker (``deferrable=False``): the same event a trigger sends."""
        admin = self.admin()
        last = ""
        while True:
            try:
                native = admin.status(job_id)
            except FlareAdminError as exc:
                return {"status": "error", "job_id": job_id, "native": "", "reason": str(exc), "logs": {}}
            if native != last:
                self.log.info("FLARE job %s: %s", job_id, native)
                last = native
            mapped = map_status(native)
            if mapped.done:
                status = "success" if mapped.succeeded else "failed"
                reason = f"FLARE job {job_id} ended {native} ({mapped.meaning})"
                return {"status": status, "job_id": job_id, "native": native, "reason": reason, "logs": {}}
            time.sleep(self.poll_interval)

    def execute_complete(self, context: Context, event: dict[str, Any]) -> dict[str, Any]:
        self._job_id = str(event.get("job_id") or self._job_id)
        if event.get("status") != "success":
            reason = str(event.get("reason") or event)
            if event.get("logs") and "last lines" not in reason:
                reason += "\n" + format_logs(dict(event["logs"]))
            push_failure(context, reason)
            raise AirflowException(reason)
        self._job_id = None  # finished: nothing to abort any more
        return self.publish(context, str(event["job_id"]))

    def publish(self, context: Context, job_id: str) -> dict[str, Any]:
        """Download the job's result and publish its global model like a native run's."""
        run_id = run_id_of(context)
        with tempfile.TemporaryDirectory(prefix="flare-result-") as tmp:
            try:
                result_dir = self.admin().download(job_id, tmp)
                params = read_global_model(result_dir, self.model_file, self.model_key)
            except FlareResultError as exc:
                push_failure(context, str(exc))
                raise AirflowFailException(f"FLARE job {job_id} completed, but {exc}") from None
            except FlareAdminError as exc:
                raise AirflowException(
                    f"FLARE job {job_id} completed, but its result was not downloaded: {exc}"
                ) from None
        store = self.model_store()
        final = store.final_dir(self.job_name, run_id)
        model_path = final / "model.safetensors"
        record = write_artifact(model_path, FLModel(params=params, meta={"flare_job_id": job_id, "run_id": run_id}))
        pointer: dict[str, Any] = {
            "run_id": run_id,
            "model_uri": str(model_path),
            "sha256": record.sha256,
            "flare_job_id": job_id,
        }
        atomic_write(store.latest_pointer(self.job_name), json.dumps(pointer, sort_keys=True).encode())
        for asset in self.outlets:
            context["outlet_events"][asset].extra = dict(pointer)
        self.log.info("FLARE job %s's global model published: %s", job_id, model_path)
        return {"final_model": str(model_path), **pointer}

    def model_store(self) -> ModelStore:
        uri = self.store or default_store_uri()
        if "://" not in uri:
            uri = "file://" + str(Path(uri).resolve())
        return ModelStore(ObjectStoragePath(uri, conn_id=self.store_conn_id))

    def on_kill(self) -> None:
        """The task was killed while following its job in the worker: abort the FLARE job."""
        if self._job_id is None:
            return
        self.log.info("task killed: aborting FLARE job %s", self._job_id)
        try:
            self.log.info("FLARE job %s is %s", self._job_id, self.admin().abort(self._job_id))
        except FlareAdminError as exc:
            self.log.warning("could not abort FLARE job %s: %s", self._job_id, exc)
