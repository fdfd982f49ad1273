"""Submit one exported job to a running NVFlare POC system through its admin API and wait for it.

Runs in NVFlare's own virtual environment (the benchmark creates it). The admin session is opened
before the clock starts (as an operator's console is already logged in); then the job is submitted
(``Session.submit_job``, what ``nvflare job submit`` calls) and its status polled with
``Session.get_job_meta`` every ``--poll`` seconds until it is terminal. Afterwards (untimed) the
server's job workspace is downloaded (``Session.download_job_result``): its ``log.txt`` holds the
``Round k started.`` lines and ``models/server.npy`` the final global model.

    python poc_submit.py --startup-kit ADMIN_KIT_DIR --job JOB_FOLDER --download DIR

The last stdout line is ``RESULT {json}`` with wall-clock marks (``time.time()``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--startup-kit", required=True, help="the admin user's startup kit folder")
    p.add_argument("--username", default="admin@nvidia.com")
    p.add_argument("--job", required=True, help="an exported job folder")
    p.add_argument("--download", required=True, help="where the job's server workspace is downloaded")
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("--timeout", type=float, default=240.0)
    args = p.parse_args(argv)

    from nvflare.fuel.flare_api.flare_api import new_secure_session

    session = new_secure_session(args.username, args.startup_kit)
    try:
        submitted_at = time.time()
        job_id = session.submit_job(args.job)
        accepted_at = time.time()
        status = ""
        polls = 0
        while time.time() - submitted_at < args.timeout:
            status = str(session.get_job_meta(job_id).get("status", ""))
            polls += 1
            if status.startswith("FINISHED"):
                break
            time.sleep(args.poll)
        finished_at = time.time()
        meta = session.get_job_meta(job_id)
        result_dir = session.download_job_result(job_id, args.download) if status.startswith("FINISHED") else None
    finally:
        session.close()
    result = {
        "job_id": job_id,
        "status": status,
        "submitted": submitted_at,
        "accepted": accepted_at,
        "finished": finished_at,
        "polls": polls,
        "meta": {k: meta.get(k) for k in ("submit_time_iso", "start_time", "duration", "status")},
        "result_dir": result_dir,
    }
    print("RESULT " + json.dumps(result, default=str), flush=True)
    return 0 if status == "FINISHED:COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
