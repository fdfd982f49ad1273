"""Every command in README.md and docs/*.md is run by a test, or says why it cannot be run here.

Commands are the lines of ``bash``/``sh`` blocks and the inline code that starts with a command
(``flare-airflow ...``, ``airflow ...``, ``make ...``, ``pip ...``, ``kubectl ...``, ...). The lines of
blocks marked ``<!-- walkthrough: ... -->`` or ``<!-- client-install -->`` are run as written by
``tests/e2e/test_walkthrough.py``. Every other command must match an entry of :data:`COVERAGE`:
either the test that runs it (that test's file must contain the given text, so the entry cannot go
stale silently) or the reason it is not run here. A new command in the docs fails this test until
it is covered.
"""

from __future__ import annotations

import pathlib
import re
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
COMMAND_WORDS = ("flare-airflow", "airflow", "make", "pip", "kubectl", "python", "python3.11", "export", "podman")
_FENCE = re.compile(r"(<!-- ([\w-]+)(?::[^>]*)? -->\n)?```(\w*)\n(.*?)```", re.S)
_RUN_AS_WRITTEN = {"walkthrough", "client-install"}


@dataclass(frozen=True)
class RunBy:
    """A test runs this command (or the exact code path it names); ``evidence`` is in that test's file."""

    test: str
    evidence: str


@dataclass(frozen=True)
class NotRun:
    reason: str


WALKTHROUGH = RunBy("tests/e2e/test_walkthrough.py", "walkthrough_blocks()")
COVERAGE: list[tuple[str, RunBy | NotRun]] = [
    (
        r"^flare-airflow (validate|run|report)\b",
        RunBy("tests/e2e/test_walkthrough.py", "flare-airflow run flare_my_job"),
    ),
    (r"^flare-airflow validate\b", RunBy("tests/bad_inputs/test_cli.py", '["validate",')),
    (r"^flare-airflow try-trainer\b", RunBy("tests/unit/test_try_trainer.py", '"try-trainer"')),
    (r"^flare-airflow resume\b", RunBy("tests/e2e/test_resume.py", '"resume", dag_id, run_id')),
    (r"^flare-airflow pools sync\b", RunBy("tests/integration/test_gpu_pools.py", '"pools", "sync"')),
    (r"^flare-airflow doctor\b", RunBy("tests/unit/test_cli_doctor.py", '"doctor"')),
    # `make lm-image` is `docker/images.py lm-trainer`; the container-site LoRA test builds it the same way
    (
        r"^(python docker/images.py lm-trainer|make lm-image)$",
        RunBy("tests/e2e/test_llm_lora.py", 'build_images("lm-trainer")'),
    ),
    (
        r"^flare-airflow (site keygen|central keygen|registry (add|revoke|grant))\b",
        RunBy("tests/unit/test_cli_keys.py", '"registry", "revoke"'),
    ),
    (r"^flare-airflow site store-policy\b", RunBy("tests/unit/test_cli_keys.py", '"site", "store-policy"')),
    (r"^airflow (db migrate|dags (trigger|unpause|reserialize))\b", WALKTHROUGH),
    # `flare-airflow run` is `airflow dags test` in-process; every e2e test runs it (flare_airflow_testing/harness.py)
    (r"^airflow dags test$", RunBy("flare_airflow_testing/harness.py", '"flare-airflow"), "run"')),
    (
        r"^airflow standalone$",
        NotRun(
            "Airflow's own all-in-one command, named as an alternative; `make airflow` starts the same "
            "components and is tested (tests/integration/test_make_airflow.py)"
        ),
    ),
    # `flare-airflow site worker` runs it in-process with the site's registry queues and name
    (r"^airflow edge worker\b", RunBy("flare_airflow_testing/edge_sites.py", "guide.worker_argv(self.site)")),
    (
        r"^flare-airflow site worker\b",
        RunBy("flare_airflow_testing/deploy_guide.py", "(flare-airflow site worker [^`]+)"),
    ),
    (
        r"^mlflow ui\b",
        NotRun(
            "MLflow's own browser UI on the embedded store; the same MLflow server code is started and "
            "read by tests/e2e/test_tracking.py (mlflow server)"
        ),
    ),
    (
        r"^tensorboard --logdir\b",
        NotRun(
            "TensorBoard's web server; tests/e2e/test_tracking.py reads the same event files with the reader "
            "it serves them with (EventAccumulator)"
        ),
    ),
    (
        r"^AIRFLOW__FLARE_AIRFLOW__TRACKING=",
        RunBy("tests/e2e/test_tracking.py", '"AIRFLOW__FLARE_AIRFLOW__TRACKING"'),
    ),
    (r"^make airflow$", RunBy("tests/integration/test_make_airflow.py", '"airflow", f"AIRFLOW_HOME={home}"')),
    (r"^make test$", NotRun("the command that runs this suite (.ci/run calls it)")),
    (
        r"^make control-plane$",
        NotRun(
            "`make test` runs it in the background while the tiers run (its runner: tests/unit/test_background.py); "
            "the control_plane fixture runs the same k8s/build-control-plane.sh when the binaries are missing"
        ),
    ),
    (
        r"^make test-images$",
        NotRun(
            "`make test` runs it in the background while the tiers run (its runner: tests/unit/test_background.py); "
            "the trainer_image and images fixtures run the same docker/images.py, which waits for it "
            "(tests/unit/test_docker_images.py)"
        ),
    ),
    # make lm-env is `python -m flare_airflow_testing.side_venvs lm`: the LoRA tests build through lm_venv().
    (r"^make lm-env$", RunBy("tests/e2e/test_llm_lora.py", "lm_venv()")),
    (
        r"^make llm-demo$",
        NotRun(
            "the full demo (3 rounds of SmolLM2-135M, minutes of CPU); tests/e2e/test_llm_lora.py runs the same job "
            "through Airflow with 2 rounds and fewer steps"
        ),
    ),
    (
        r"^make llm-demo-gpu$",
        NotRun(
            "needs a CUDA device (none on these machines); its no-GPU paths (--count-cuda, FLARE_LM_DEVICE=cuda) "
            "are tests/unit/test_llm_gpu.py"
        ),
    ),
    (
        r"^make (setup|lint|unit)$",
        NotRun(
            "parts of `make test` (test: setup system-packages, then lint and pytest over every tier while the control "
            "plane and the LM side environment build in the background): "
            "they ran before and around this test"
        ),
    ),
    (
        r"^make demo$",
        NotRun(
            "`make setup` (done by `make test` before this test) then `flare-airflow run flare_digits`, "
            "which tests/e2e/test_demo.py runs on the same DAG"
        ),
    ),
    (
        r"^make bench$",
        NotRun("~35 min of measurements on a quiet machine: run by hand, reports in benchmarks/results/"),
    ),
    (
        r"^python benchmarks/run\.py --only tracking$",
        NotRun("measurements on a quiet machine: run by hand, report in benchmarks/results/tracking.md"),
    ),
    (r"^make lock$", NotRun("re-resolves every dependency from the registry and rewrites requirements.lock")),
    (
        r"^kubectl\b",
        NotRun(
            "no kubectl binary here: the Kubernetes tests drive the real API server with the Python client "
            "(flare_airflow_testing/k8s); these are a site admin's cluster commands"
        ),
    ),
    (
        r'^pip install "\./flare-airflow\[sites\]"$',
        NotRun(
            "the `sites` extra's packages are in requirements.lock and installed by `make setup` for the "
            "Edge tier (tests/e2e/test_edge_sites.py); this line installs them into a deployment"
        ),
    ),
    (
        r"^pip install 'flare-airflow\[tracking\]'$",
        NotRun(
            "the `tracking` extra (mlflow) is in requirements.lock and installed by `make setup` for "
            "tests/e2e/test_tracking.py; this line installs it into a deployment"
        ),
    ),
    (r"^airflow plugins$", WALKTHROUGH),
    # a site worker's settings: the Edge tier's workers are started with exactly these variables
    (
        r"^(AIRFLOW\w*|FLARE_SITE_CONFIG|FLARE_KEY_DIR|FLARE_SITE_KEYS)=",
        RunBy("flare_airflow_testing/deploy_guide.py", 'block("A site\'s worker", "bash")'),
    ),
    (r"^python -m tests\.bad_inputs\.table$", RunBy("tests/bad_inputs/test_table.py", "render(all_cases())")),
    (r"^export FLARE_K8S_ALLOWED_HOST_PATHS=", RunBy("tests/bad_inputs/test_kubernetes.py", "ALLOWED_HOST_PATHS_ENV")),
    (r"^export NAME='value'$", NotRun("the shape of a variable a site admin sets, not a command")),
    # docs/privacy.md: a site's noise secret in its worker's environment; the e2e run gives the sites
    # the same variable via the environment
    (
        r"^echo \"AIRFLOW_VAR_FLARE_NOISE_SECRET=",
        RunBy("tests/e2e/test_privacy.py", "AIRFLOW_VAR_FLARE_NOISE_SECRET"),
    ),
    # docs/privacy.md: the server's central-DP noise secret; the aggregation's tests set the same variable
    (
        r"^airflow variables set flare_central_noise_secret ",
        RunBy("tests/unit/operators/test_aggregate_central_dp.py", "AIRFLOW_VAR_FLARE_CENTRAL_NOISE_SECRET"),
    ),
    (
        r"^flare-airflow site data-ready\b",
        RunBy("tests/integration/test_data_runs.py", '"site", "data-ready", site, "--version"'),
    ),
    (
        r"^flare-airflow site budget\b",
        RunBy("tests/unit/core/test_privacy_ledger.py", '"site", "budget", "--policy"'),
    ),
    (r"^python -m flare_airflow\.site_task$", RunBy("tests/unit/site_task/test_runner.py", "flare_airflow.site_task")),
    (r"^flare-airflow import-nvflare\b", RunBy("tests/e2e/test_nvflare_jobs.py", '"import-nvflare", job_dir')),
    # docs/coming-from-nvflare.md, native mode: the e2e test runs against a FLARE POC with this very
    # connection line (its paths replaced by the POC's kit and the side environment's interpreter)
    (
        r"^export AIRFLOW_CONN_FLARE_ADMIN_DEFAULT=",
        RunBy("tests/e2e/test_nvflare_native.py", "export AIRFLOW_CONN_FLARE_ADMIN_DEFAULT="),
    ),
    (r"^pip install nvflare==2\.9\.0$", RunBy("flare_airflow_testing/side_venvs.py", 'NVFLARE_VERSION = "2.9.0"')),
    (
        r"^python benchmarks/run\.py --only nvflare-native$",
        NotRun("measurements on a quiet machine: run by hand, report in benchmarks/results/nvflare_native.md"),
    ),
    (r"^flare-airflow run flare_hello_numpy$", RunBy("tests/e2e/test_nvflare_jobs.py", 'airflow_home.run(f"flare_')),
    (
        r"^python -m flare_airflow\.core\.nvflare\.run\b",
        RunBy("tests/unit/core/test_nvflare_client.py", '"-m", "flare_airflow.core.nvflare.run"'),
    ),
    (r"^python -m compileall$", NotRun("for builders of their own images; ours compile with uv --compile-bytecode")),
    (r"^make images$", RunBy("flare_airflow_testing/containers.py", '"docker" / "images.py"')),
    # docker sites against podman's Docker-compatible API: the container tests' docker_env fixture
    (r"^podman system service --time=0 unix://", RunBy("flare_airflow_testing/containers.py", '"system", "service"')),
    # what the Edge test (and the container e2e) asks the engine after a run: none of the job's left
    (r"^podman ps( -a)?$", RunBy("flare_airflow_testing/containers.py", '"ps", "--all"')),
    # the entrypoints of docker/compose.yaml's Airflow services, which that test brings up
    (
        r"^airflow (db check-migrations|<component>)$",
        RunBy("tests/integration/containers/test_compose.py", "COMPOSE_FILE"),
    ),
    (r"^docker/secrets\.sh$", RunBy("tests/integration/containers/test_compose.py", '"docker" / "secrets.sh"')),
    (
        r"^podman-compose -f docker/compose\.yaml up -d$",
        RunBy("tests/integration/containers/test_compose.py", '"up", "-d"'),
    ),
    (
        r"^podman-compose -f docker/compose\.yaml down -v$",
        RunBy("tests/integration/containers/test_compose.py", '"down", "-v"'),
    ),
    (
        r"^podman-compose -f docker/compose\.yaml exec api-server cat ",
        RunBy("tests/integration/containers/test_compose.py", '"exec", "-T", "api-server", "cat"'),
    ),
]


def doc_commands() -> list[tuple[str, str, bool]]:
    """(doc, command, run_as_written) for every command in the docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in _FENCE.finditer(text):
            if m.group(3) not in ("bash", "sh", "shell"):
                continue
            for line in m.group(4).splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    found.append((doc.name, line, m.group(2) in _RUN_AS_WRITTEN))
        prose = _FENCE.sub("", text)
        for m in re.finditer(r"`([^`\n]+)`", prose):
            span = m.group(1).strip()
            if span.split(" ")[0] in COMMAND_WORDS and " " in span:
                found.append((doc.name, span, False))
    return found


def coverage_of(command: str) -> list[RunBy | NotRun]:
    return [how for pattern, how in COVERAGE if re.search(pattern, command)]


@pytest.mark.parametrize(("doc", "command"), [(d, c) for d, c, as_written in doc_commands() if not as_written])
def test_every_doc_command_is_run_by_a_test_or_says_why_not(doc: str, command: str) -> None:
    assert coverage_of(command), (
        f"{doc}: `{command}` is run by no test: add it to a walkthrough block, or add an entry to "
        f"COVERAGE in {pathlib.Path(__file__).name} naming the test that runs it or why it cannot run here"
    )


@pytest.mark.parametrize(("pattern", "how"), COVERAGE, ids=[p for p, _ in COVERAGE])
def test_each_coverage_entry_is_real_and_used(pattern: str, how: RunBy | NotRun) -> None:
    assert any(re.search(pattern, c) for _, c, _ in doc_commands()), f"no doc command matches {pattern!r} any more"
    if isinstance(how, RunBy):
        path = REPO / how.test
        assert path.is_file(), f"{how.test} does not exist"
        assert how.evidence in path.read_text(), f"{how.test} no longer contains {how.evidence!r}"
    else:
        assert len(how.reason) > 20


def test_run_as_written_blocks_are_the_ones_the_walkthrough_runs() -> None:
    walkthrough = (REPO / "tests" / "e2e" / "test_walkthrough.py").read_text()
    assert "<!-- walkthrough: (\\S+) -->" in walkthrough and "<!-- client-install -->" in walkthrough
    assert any(as_written for _, _, as_written in doc_commands())
