"""The FLARE admin bridge: one program, run by the interpreter of an environment where ``nvflare`` is
installed, that talks to a FLARE deployment through NVFlare's own Session API
(``nvflare.fuel.flare_api``) for flare-airflow's native mode.

Airflow's environment never imports ``nvflare`` (its pins are its own, and it is heavy): the
operator and the trigger run this file as ``[NVFLARE_PYTHON, bridge.py, COMMAND]`` (an argv list)
and pass the request as one JSON object on stdin, so that nothing of the admin credentials'
location appears in a process list. This file imports only the standard library and ``nvflare``:
it runs from flare-airflow's installed package directory, without flare-airflow importable.

Every answer is a stdout line ``@@flare-airflow {json}`` (NVFlare prints its own lines, e.g.
"Connecting to FLARE ...", which the reader skips). A failure ends with
``{"error": {"kind": KIND, "message": ...}}`` and exit code 3; ``kind`` is one of :data:`KINDS`.

Commands (request fields besides ``startup_kit``, ``username``, ``connect_timeout``):

=========  ===================================================  =============================================
command    request                                              answer
=========  ===================================================  =============================================
submit     ``job_folder``, ``token``, ``max_generations``,      ``{"job_id", "token", "adopted", "status",
           ``expected_clients`` (names or a count),             "clients"}``; first waits until the expected
           ``ready_timeout``                                    clients are connected (``not_ready`` if not)
status     ``job_id``                                           ``{"job_id", "status"}``
watch      ``job_id``, ``poll``, ``log_lines``, ``timeout``      a line per status change, then ``final: true``
abort      ``job_id``                                           ``{"job_id", "status"}`` (the status after it)
download   ``job_id``, ``destination``                          ``{"job_id", "path"}``
=========  ===================================================  =============================================

``submit`` is retry-safe with FLARE's own submit tokens (NVFlare >= 2.9: the server keeps a record
per (study, submitter, token) and returns the job it created for that token instead of a second
one). The token of generation ``g`` is ``TOKEN.g``: a job found under generation ``g`` that is
queued, running or completed is adopted; one that ended otherwise (failed, aborted) moves to
generation ``g + 1``, so an Airflow retry after a failed FLARE job submits again, and one after a
lost worker never does.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import traceback
from typing import Any

PREFIX = "@@flare-airflow "
KINDS = ("credential", "connection", "not_ready", "job", "conflict", "request", "internal")
EXIT_ERROR = 3
COMPLETED = "FINISHED:COMPLETED"


class BridgeError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(payload, default=str) + "\n")
    sys.stdout.flush()


def classify(exc: BaseException, startup_kit: str) -> BridgeError:
    """NVFlare's exception as one of our kinds, with what to do."""
    name = type(exc).__name__
    text = str(exc).strip().splitlines()[0][:400] if str(exc).strip() else name
    if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "nvflare":
        return BridgeError(
            "credential",
            f"{sys.executable} has no nvflare ({text}): set the Airflow connection's extra 'python' to the "
            "interpreter of an environment with nvflare >= 2.9 installed",
        )
    if name in ("InvalidCertChain", "AuthenticationError", "AuthorizationError", "SSLError", "CertificateError"):
        return BridgeError(
            "credential",
            f"the FLARE server refused the admin startup kit {startup_kit}: {name}: {text}. The kit's "
            "certificate must be one this deployment's provisioning issued (and its user allowed to do this): "
            "point the Airflow connection's startup_kit at the right admin kit",
        )
    if name in ("FileNotFoundError", "AssertionError", "ConfigError") or "startup kit" in text:
        return BridgeError(
            "credential",
            f"{startup_kit} is not a FLARE admin startup kit ({name}: {text}): the Airflow connection's "
            "startup_kit must be the folder of an admin user's kit (with startup/fed_admin.json)",
        )
    if name in ("NoConnection", "ConnectionError", "NoReply", "FLCommunicationError", "TimeoutError"):
        return BridgeError(
            "connection",
            f"cannot reach the FLARE server named in {startup_kit}/startup/fed_admin.json ({name}: {text}): "
            "is the server running and reachable from this worker?",
        )
    if name in ("JobNotFound", "InvalidJobDefinition", "InvalidTarget"):
        return BridgeError("job", f"{name}: {text}")
    if "SUBMIT_TOKEN_CONFLICT" in text:
        return BridgeError(
            "conflict",
            f"FLARE refused the submit: {text} -- the job folder changed since an earlier try of this task "
            "submitted it; restore it, or start a new DAG run",
        )
    return BridgeError("internal", f"{name}: {text}")


def open_session(request: dict[str, Any]) -> Any:
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    return new_secure_session(
        str(request.get("username") or "admin"),
        str(request["startup_kit"]),
        timeout=float(request.get("connect_timeout", 10.0)),
        auto_login_max_tries=int(request.get("login_tries", 3)),
    )


def connected_clients(session: Any) -> list[str]:
    return sorted(c.name for c in session.get_system_info().client_info)


def wait_ready(session: Any, request: dict[str, Any]) -> list[str]:
    """Wait until ``expected_clients`` (names, or a count) are connected (``ready_timeout`` seconds)."""
    expected = request.get("expected_clients")
    deadline = time.monotonic() + float(request.get("ready_timeout", 60.0))
    while True:
        clients = connected_clients(session)
        if isinstance(expected, int):
            missing = [] if len(clients) >= expected else [f"{expected - len(clients)} more client(s)"]
        else:
            missing = sorted(set(expected or []) - set(clients))
        if not missing:
            return clients
        if time.monotonic() > deadline:
            raise BridgeError(
                "not_ready",
                f"FLARE clients not connected after {request.get('ready_timeout', 60.0)} s: missing "
                f"{', '.join(missing)} (connected: {', '.join(clients) or 'none'}); start them, or wait longer "
                "(ready_timeout)",
            )
        time.sleep(float(request.get("poll", 2.0)))


def job_with_token(session: Any, token: str) -> dict[str, Any] | None:
    jobs = session.list_jobs(submit_token=token)
    return dict(jobs[0]) if jobs else None


def cmd_submit(session: Any, request: dict[str, Any]) -> None:
    # Readiness first, in the same session: one login (2-6 s on a busy machine) for both.
    clients = wait_ready(session, request) if request.get("expected_clients") else None
    base = str(request["token"])
    for generation in range(1, int(request.get("max_generations", 20)) + 1):
        token = f"{base}.{generation}"
        found = job_with_token(session, token)
        if found is not None:
            status = str(found.get("status", ""))
            if status == COMPLETED or not status.startswith("FINISHED"):
                emit({"job_id": found["job_id"], "token": token, "adopted": True, "status": status, "clients": clients})
                return
            continue  # that generation's job ended without completing: an Airflow retry submits anew
        job_id = session.submit_job(str(request["job_folder"]), submit_token=token)
        status = str(session.get_job_meta(job_id).get("status", ""))
        emit({"job_id": job_id, "token": token, "adopted": False, "status": status, "clients": clients})
        return
    raise BridgeError("job", f"{request.get('max_generations', 20)} FLARE jobs of this task ended unsuccessfully")


def status_of(session: Any, job_id: str) -> str:
    return str(session.get_job_meta(job_id).get("status", ""))


def log_tails(session: Any, job_id: str, lines: int) -> dict[str, str]:
    """The last ``lines`` lines of the job's log at each site that has one (the server's first)."""
    try:
        logs = session.get_job_logs(job_id, target="all", tail_lines=lines).get("logs", {})
    except Exception as exc:  # logs are for the message: their absence must not hide the status
        return {"(logs)": f"unavailable: {type(exc).__name__}: {exc}"}
    return {str(site): str(text) for site, text in sorted(logs.items(), key=lambda kv: kv[0] != "server")}


def cmd_status(session: Any, request: dict[str, Any]) -> None:
    emit({"job_id": request["job_id"], "status": status_of(session, str(request["job_id"]))})


def cmd_watch(session: Any, request: dict[str, Any]) -> None:
    job_id = str(request["job_id"])
    poll = float(request.get("poll", 2.0))
    timeout = request.get("timeout")
    started = time.monotonic()
    last = None
    while True:
        status = status_of(session, job_id)
        if status.startswith("FINISHED"):
            logs = log_tails(session, job_id, int(request.get("log_lines", 30)))
            emit({"job_id": job_id, "status": status, "final": True, "logs": logs})
            return
        if status != last:
            emit({"job_id": job_id, "status": status, "final": False})
            last = status
        if timeout is not None and time.monotonic() - started > float(timeout):
            emit({"job_id": job_id, "status": status, "final": False, "watch_timeout": True})
            return
        time.sleep(poll)


def cmd_abort(session: Any, request: dict[str, Any]) -> None:
    job_id = str(request["job_id"])
    if not status_of(session, job_id).startswith("FINISHED"):
        session.abort_job(job_id)
    emit({"job_id": job_id, "status": status_of(session, job_id)})


def cmd_download(session: Any, request: dict[str, Any]) -> None:
    path = session.download_job_result(str(request["job_id"]), str(request["destination"]))
    emit({"job_id": request["job_id"], "path": path})


COMMANDS = {
    "submit": cmd_submit,
    "status": cmd_status,
    "watch": cmd_watch,
    "abort": cmd_abort,
    "download": cmd_download,
}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] not in COMMANDS:
        emit({"error": {"kind": "request", "message": f"usage: bridge.py {{{'|'.join(COMMANDS)}}} < request.json"}})
        return EXIT_ERROR
    try:
        request = json.loads(sys.stdin.read())
    except ValueError as exc:
        emit({"error": {"kind": "request", "message": f"the request on stdin is not JSON: {exc}"}})
        return EXIT_ERROR
    kit = str(request.get("startup_kit", ""))
    session = None
    try:
        session = open_session(request)
        COMMANDS[argv[0]](session, request)
        return 0
    except BridgeError as exc:
        emit({"error": {"kind": exc.kind, "message": str(exc)}})
    except Exception as exc:
        error = classify(exc, kit)
        emit({"error": {"kind": error.kind, "message": str(error)}})
        if error.kind == "internal":
            traceback.print_exc()
    finally:
        if session is not None:
            # Closing a session whose login failed may raise: the answer is already out.
            with contextlib.suppress(Exception):
                session.close()
    return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
