"""Pod names and labels (flare_airflow.launchers.kubernetes.naming)."""

from __future__ import annotations

import hashlib
import re

from hypothesis import example, given, settings
from hypothesis import strategies as st

from flare_airflow.launchers.kubernetes import (
    pod_labels,
    pod_name,
)
from tests.unit.launchers.kubernetes.pods import (
    LABEL_VALUE,
    RFC1123,
)

JOBS = st.from_regex(r"[a-z0-9]([-a-z0-9_]{0,48}[a-z0-9])?", fullmatch=True)


SITES = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)


RUNS = st.text(min_size=1, max_size=250)


@settings(max_examples=300, deadline=None)
@given(job=JOBS, site=SITES, round_num=st.integers(0, 1000), run_id=RUNS, try_number=st.integers(0, 100))
def test_pod_names_are_short_rfc1123_stable_and_readable(job, site, round_num, run_id, try_number) -> None:
    name = pod_name(job, site, round_num, run_id, try_number)
    assert len(name) <= 63
    assert RFC1123.match(name), name
    assert name == pod_name(job, site, round_num, run_id, try_number)
    assert re.search(rf"-r{round_num}-[0-9a-f]{{8}}$", name), name
    readable = name.removeprefix("fl-").rsplit(f"-r{round_num}-", 1)[0]
    job_part = re.sub(r"_+", "-", job)
    room = 63 - len("fl--") - len(f"-r{round_num}-") - 8
    if len(job_part) + len(site) <= room:
        assert readable == f"{job_part}-{site}"
    else:  # shortened: job and site each keep a prefix of at least half the room (or all of it)
        assert readable.startswith(job_part[: min(len(job_part), room - room // 2)].strip("-"))
        assert site[: min(len(site), room // 2)].strip("-") in readable


@settings(max_examples=300, deadline=None)
@given(
    a=st.tuples(JOBS, SITES, st.integers(0, 50), RUNS, st.integers(1, 5)),
    b=st.tuples(JOBS, SITES, st.integers(0, 50), RUNS, st.integers(1, 5)),
)
def test_different_site_jobs_get_different_names(a, b) -> None:
    if a != b:
        assert pod_name(*a) != pod_name(*b)


def test_names_are_unique_across_run_round_site_and_try() -> None:
    jobs = ["digits", "a" * 50, "x_y"]
    # Sites that differ only past the part a long name keeps: the hash still tells them apart.
    sites = ["site-1", "site-2", "h" * 60 + "-01", "h" * 60 + "-02"]
    runs = ["manual__2025-01-01T00:00:00+00:00", "manual__2025-01-01T00:00:01+00:00", "a:b", "a_b", "scheduled__x"]
    combos = [(j, s, r, run, t) for j in jobs for s in sites for r in range(10) for run in runs for t in (1, 2, 3)]
    names = {pod_name(*c) for c in combos}
    assert len(names) == len(combos) == 1800


def _label_digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()[:8]


@settings(max_examples=300, deadline=None)
@given(job=JOBS, site=SITES, round_num=st.integers(0, 1000), run_id=RUNS, try_number=st.integers(1, 100))
@example(job="j", site="0-00000000", round_num=0, run_id="r", try_number=1)  # a site named like a hashed value
def test_labels_are_valid_label_values(job, site, round_num, run_id, try_number) -> None:
    labels = pod_labels(job, run_id, round_num, site, try_number)
    assert labels["app.kubernetes.io/managed-by"] == "flare-airflow"
    assert labels["flare-airflow/round"] == str(round_num)
    assert labels["flare-airflow/try"] == str(try_number)
    for key, name in (("flare-airflow/job", job), ("flare-airflow/site", site)):
        if re.search(r"-[0-9a-f]{8}$", name):
            # looks like a shortened value ("<name>-<hash>"): hashed too, so the two can never meet
            assert labels[key] != name and labels[key].endswith(_label_digest(name)), (name, labels[key])
        else:
            assert labels[key] == name
    for value in labels.values():
        assert len(value) <= 63 and LABEL_VALUE.match(value), value


def test_run_labels_keep_plain_run_ids_and_tell_look_alikes_apart() -> None:
    run = lambda r: pod_labels("j", r, 1, "s", 1)["flare-airflow/run"]  # noqa: E731
    assert run("nightly_42") == "nightly_42"
    assert run("a:b") != run("a_b") != run("a_b-9b4e6c6c")
    long = "manual__" + "x" * 100
    assert len(run(long)) <= 63 and run(long) != run(long + "y")
    assert run(":::") and LABEL_VALUE.match(run(":::"))
