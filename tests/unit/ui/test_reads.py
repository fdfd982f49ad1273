"""The run page's REST reads (issue 37 #5): a finished run read before costs one call; a running
run's render reads only the XComs of tasks that finished since."""

from __future__ import annotations

import asyncio
from typing import Any

from flare_airflow.ui.reads import ReadCache, read_run


class FakeAPI:
    """Airflow's REST API for one run of 2 rounds x 4 sites, counting the calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.run: dict[str, Any] = {"dag_id": "d", "dag_run_id": "r", "state": "running", "end_date": None}
        tasks = [
            "prepare",
            *(f"round_{r}.{t}" for r in (1, 2) for t in ("site-1", "site-2", "site-3", "site-4", "global_model")),
        ]
        self.tis = {t: {"task_id": t, "state": None, "try_number": 1, "end_date": None} for t in [*tasks, "publish"]}

    def finish(self, *task_ids: str, state: str = "success") -> None:
        for t in task_ids:
            self.tis[t].update(state=state, end_date=f"end-{t}")

    async def get(self, path: str, missing_ok: bool = False, **params: Any) -> Any:
        self.calls.append("run")
        return dict(self.run)

    async def task_instances(self, dag_id: str, run_id: str) -> dict[str, dict[str, Any]]:
        self.calls.append("task_instances")
        return {t: dict(ti) for t, ti in self.tis.items()}

    async def xcom(self, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any:
        self.calls.append(f"xcom {task_id} {key}")
        return {"task": task_id, "key": key}


def _read(api: FakeAPI, cache: ReadCache) -> list[str]:
    api.calls.clear()
    asyncio.run(read_run(api, "d", "r", cache))  # type: ignore[arg-type]
    return list(api.calls)


def test_a_render_reads_only_what_changed_and_a_finished_run_costs_one_call() -> None:
    api, cache = FakeAPI(), ReadCache()
    round_1 = [f"round_1.{t}" for t in ("site-1", "site-2", "site-3", "site-4", "global_model")]
    api.finish("prepare", *round_1)
    assert len(_read(api, cache)) == 2 + 6  # the run, its tasks, six XComs
    api.finish("round_2.site-1")
    assert _read(api, cache) == ["run", "task_instances", "xcom round_2.site-1 return_value"]
    api.finish("round_2.site-2", "round_2.site-3", "round_2.global_model", "publish")
    api.finish("round_2.site-4", state="failed")
    api.run.update(state="success", end_date="end")
    assert len(_read(api, cache)) == 2 + 5 + 1  # and site-4's failure reason
    for _ in range(3):
        assert _read(api, cache) == ["run"]  # finished: one call per render
    # A cleared task changes the run (and the task's try): read again, the cleared task's XCom anew.
    api.run.update(state="queued", end_date=None)
    api.tis["round_2.site-4"].update(state="success", try_number=2, end_date="end-2")
    assert _read(api, cache) == ["run", "task_instances", "xcom round_2.site-4 return_value"]


def test_the_cache_is_bounded() -> None:
    api, cache = FakeAPI(), ReadCache(runs=1, xcoms=3)
    api.finish(*api.tis)
    api.run.update(state="success", end_date="end")
    _read(api, cache)
    assert len(cache._xcoms) == 3 and len(cache._runs) == 1
