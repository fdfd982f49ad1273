"""Bad trigger confs (the run form's values) and a corrupted warm-start pointer.

Each case runs the prepare task's checks for real: :func:`run_params` with the trigger conf as
Airflow hands it over (``dag_run.conf`` and the resolved ``params``), or the prepare operator
itself against a store whose ``latest.json`` is damaged.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.builder import job_params
from flare_airflow.core.config import load_job
from flare_airflow.operators.common import RunParamsError, run_params
from flare_airflow.operators.prepare import PrepareRunOperator
from tests.bad_inputs.cases import Case, assert_clear

REPO = pathlib.Path(__file__).resolve().parents[2]
INITIAL_MODEL = REPO / "examples" / "digits" / "initial_model.safetensors"
SHA = "0" * 64


@dataclass(frozen=True)
class Bad:
    conf: dict[str, Any] = field(default_factory=dict)
    pointer: bytes | None = None  # the job's latest.json, for warm-start cases


CASES: list[Case] = []
INPUTS: dict[str, Bad] = {}


def case(id: str, bad_input: str, error: str, **bad: Any) -> None:
    CASES.append(Case(id, "trigger_conf", bad_input, error))
    INPUTS[id] = Bad(**bad)


case(
    "conf-typo-round",
    '{"round": 1} (typo: all rounds would run)',
    "unknown run parameter(s) 'round' (did you mean 'rounds'?)",
    conf={"round": 1},
)
case(
    "conf-unknown-key",
    '{"epochs": 3} (not a run parameter)',
    "allowed: rounds, min_clients, warm_start, hp_epochs, hp_lr",
    conf={"epochs": 3},
)
case(
    "conf-hparam-without-prefix",
    '{"lr": 0.5} (the form field is hp_lr)',
    "'lr' (did you mean 'hp_lr'?)",
    conf={"lr": 0.5},
)
case(
    "conf-unknown-hparam",
    '{"hp_momentum": 0.9} (the job has no such hyper-parameter)',
    "unknown run parameter(s) 'hp_momentum'",
    conf={"hp_momentum": 0.9},
)
case(
    "conf-rounds-string",
    '{"rounds": "2"}',
    "rounds must be an integer in 1..3 (the job's configured maximum), got '2'",
    conf={"rounds": "2"},
)
case("conf-rounds-true", '{"rounds": true}', "rounds must be an integer in 1..3", conf={"rounds": True})
case(
    "conf-rounds-fraction",
    '{"rounds": 2.5}',
    "rounds must be an integer in 1..3 (the job's configured maximum), got 2.5",
    conf={"rounds": 2.5},
)
case("conf-rounds-zero", '{"rounds": 0}', "rounds=0 is outside 1..3 (the job's configured maximum)", conf={"rounds": 0})
case("conf-rounds-too-many", '{"rounds": 50}', "rounds=50 is outside 1..3", conf={"rounds": 50})
case(
    "conf-rounds-null",
    '{"rounds": null}',
    "rounds must be an integer in 1..3 (the job's configured maximum), got None",
    conf={"rounds": None},
)
case(
    "conf-rounds-inf",
    '{"rounds": Infinity}',
    "rounds must be an integer in 1..3 (the job's configured maximum), got inf",
    conf={"rounds": float("inf")},
)
case(
    "conf-min-clients-over-sites",
    '{"min_clients": 5} with 2 sites',
    "min_clients=5 is outside 1..2 (the job's number of sites)",
    conf={"min_clients": 5},
)
case("conf-min-clients-negative", '{"min_clients": -1}', "min_clients=-1 is outside 1..2", conf={"min_clients": -1})
case(
    "conf-warm-start-string",
    '{"warm_start": "false"} (a non-empty string is truthy)',
    "warm_start must be true or false, got 'false'",
    conf={"warm_start": "false"},
)
case("conf-warm-start-number", '{"warm_start": 1}', "warm_start must be true or false, got 1", conf={"warm_start": 1})
case(
    "conf-hparam-nan",
    '{"hp_lr": NaN}',
    "hp_lr must be a finite number like the job's default 0.1, got nan",
    conf={"hp_lr": float("nan")},
)
case(
    "conf-hparam-string-for-number",
    '{"hp_lr": "fast"}',
    "hp_lr must be a finite number like the job's default 0.1, got 'fast'",
    conf={"hp_lr": "fast"},
)
case(
    "conf-hparam-float-for-int",
    '{"hp_epochs": 2.5}',
    "hp_epochs must be an integer like the job's default 2, got 2.5",
    conf={"hp_epochs": 2.5},
)
case(
    "conf-hparam-bool-for-int",
    '{"hp_epochs": true}',
    "hp_epochs must be an integer like the job's default 2, got True",
    conf={"hp_epochs": True},
)
case(
    "conf-hparam-list",
    '{"hp_lr": [0.1, 0.2]}',
    "hp_lr must be a finite number like the job's default 0.1, got [0.1, 0.2]",
    conf={"hp_lr": [0.1, 0.2]},
)
case(
    "conf-hparam-long-value",
    "a 100 000-character string for a number (the message stays short)",
    "hp_lr must be a finite number",
    conf={"hp_lr": "9" * 100_000},
)
case(
    "conf-hparam-exponent-mangled",
    '{"hp_lr": 13} (a number field read the typed 1e-3 as 13) with hparam_ranges lr max 1',
    "hp_lr=13.0 is above the job's maximum 1.0 (trainer.hparam_ranges)",
    conf={"hp_lr": 13},
)
case(
    "conf-hparam-text-above-range",
    '{"hp_lr": "1e39"} (text, as the form keeps it) with hparam_ranges lr max 1',
    "hp_lr=1e+39 is above the job's maximum 1.0",
    conf={"hp_lr": "1e39"},
)
case(
    "conf-hparam-below-range",
    '{"hp_lr": -0.5} with hparam_ranges lr min 0',
    "hp_lr=-0.5 is below the job's minimum 0.0",
    conf={"hp_lr": -0.5},
)
case(
    "conf-hparam-int-above-range",
    '{"hp_epochs": 50} with hparam_ranges epochs max 10',
    "hp_epochs=50 is above the job's maximum 10",
    conf={"hp_epochs": 50},
)
case(
    "conf-hparam-text-not-a-number",
    '{"hp_lr": "1e-3x"} (text that is no number)',
    "hp_lr must be a finite number like the job's default 0.1, got '1e-3x'",
    conf={"hp_lr": "1e-3x"},
)
case(
    "conf-hparam-text-infinity",
    '{"hp_lr": "inf"} (text Python would read as infinity)',
    "hp_lr must be a finite number like the job's default 0.1, got 'inf'",
    conf={"hp_lr": "inf"},
)
# Issue 37: text a form re-reading 0.001 at each keystroke sent; float() would read it as 1.0.
case(
    "conf-hparam-text-leading-zero",
    '{"hp_lr": "001"} (typed 0.001, mangled by a form; inside lr\'s range [0, 1] as 1.0)',
    "hp_lr must be a number as written, like the job's default 0.1; got '001', a leading zero followed by digits",
    conf={"hp_lr": "001"},
)
case(
    "conf-hparam-text-leading-zero-signed",
    '{"hp_lr": "-0005"}',
    "got '-0005', a leading zero followed by digits: write 0.001 (or 1e-3) in full",
    conf={"hp_lr": "-0005"},
)
case(
    "warm-start-pointer-not-json",
    "warm start; latest.json is not JSON",
    "latest.json is not valid JSON",
    conf={"warm_start": True},
    pointer=b"{not json",
)
case(
    "warm-start-pointer-empty",
    "warm start; latest.json is empty",
    "latest.json is not valid JSON",
    conf={"warm_start": True},
    pointer=b"",
)
case(
    "warm-start-pointer-list",
    "warm start; latest.json is a JSON list",
    "latest.json must hold a JSON object, got list",
    conf={"warm_start": True},
    pointer=b"[]",
)
case(
    "warm-start-pointer-missing-key",
    "warm start; latest.json lacks model_uri",
    "'model_uri' is missing (expected keys: run_id, model_uri, sha256, round)",
    conf={"warm_start": True},
    pointer=b'{"run_id": "r", "sha256": "' + SHA.encode() + b'", "round": 1}',
)
case(
    "warm-start-pointer-wrong-type",
    "warm start; latest.json round is a string",
    "'round' is not a int",
    conf={"warm_start": True},
    pointer=b'{"run_id": "r", "model_uri": "m", "sha256": "' + SHA.encode() + b'", "round": "1"}',
)
case(
    "warm-start-pointer-bad-sha",
    "warm start; latest.json sha256 is not a digest",
    "'sha256' is not 64 hex digits",
    conf={"warm_start": True},
    pointer=b'{"run_id": "r", "model_uri": "m", "sha256": "abc", "round": 1}',
)
case(
    "warm-start-pointer-outside-store",
    "warm start; latest.json points outside the store",
    "to start from initial_model instead, trigger with warm_start off",
    conf={"warm_start": True},
    pointer=b'{"run_id": "r", "model_uri": "/etc/passwd", "sha256": "' + SHA.encode() + b'", "round": 1}',
)
case(
    "warm-start-pointer-binary",
    "warm start; latest.json holds binary bytes",
    "latest.json is not valid JSON",
    conf={"warm_start": True},
    pointer=b"\xff\xfe\x00",
)


@pytest.fixture
def job(tmp_path: pathlib.Path) -> Any:
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "init.safetensors").write_bytes(INITIAL_MODEL.read_bytes())
    data = {
        "job": "demo",
        "rounds": 3,
        "min_clients": 1,
        "initial_model": "init.safetensors",
        "store": str(tmp_path / "store"),
        "trainer": {
            "script": "train.py",
            "hparams": {"lr": 0.1, "epochs": 2},
            "hparam_ranges": {"lr": {"min": 0.0, "max": 1.0}, "epochs": {"min": 1, "max": 10}},
        },
        "sites": {"site-1": {}, "site-2": {}},
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    return load_job(tmp_path / "job.yaml")


def context(job: Any, conf: dict[str, Any]) -> dict[str, Any]:
    """What Airflow hands the prepare task: the declared params with the conf applied."""
    declared = job_params(job)
    params = {name: p.value for name, p in declared.items()} | conf
    return {
        "params": params,
        "dag_run": SimpleNamespace(conf=conf),
        "dag": SimpleNamespace(params=declared),
        "run_id": "manual__bad",
    }


@pytest.mark.parametrize("bad_case", CASES, ids=lambda c: c.id)
def test_bad_trigger_conf_gets_a_clear_error(bad_case: Case, job: Any, tmp_path: pathlib.Path) -> None:
    bad = INPUTS[bad_case.id]
    ctx = context(job, bad.conf)
    if bad.pointer is None:
        with pytest.raises(RunParamsError) as info:
            run_params(ctx, job)
    else:
        pointer = tmp_path / "store" / job.job / "latest.json"
        pointer.parent.mkdir(parents=True)
        pointer.write_bytes(bad.pointer)
        with pytest.raises(AirflowFailException) as info:
            PrepareRunOperator(task_id="prepare", job=job).execute(ctx)  # type: ignore[arg-type]
        assert "latest.json" in str(info.value)
        assert not (tmp_path / "store" / job.job / "manual__bad").exists(), "a round-0 model was written"
    assert_clear(bad_case, str(info.value))
    assert len(str(info.value)) < 600


def test_the_form_defaults_and_declared_dag_params_are_accepted(job: Any) -> None:
    ctx = context(job, {"rounds": 2, "hp_lr": 1, "warm_start": False})
    ctx["dag"].params = {**ctx["dag"].params, "owner_note": None}
    ctx["dag_run"].conf = {**ctx["dag_run"].conf, "owner_note": "retrain"}
    params = run_params(ctx, job)
    assert (params.rounds, params.min_clients, params.warm_start) == (2, 1, False)
    assert params.hparams == {"lr": 1.0, "epochs": 2}


@pytest.mark.parametrize(
    ("typed", "expected"),
    [("1e-3", 0.001), ("5e-4", 0.0005), (" .5 ", 0.5), ("0.001", 0.001), ("0", 0.0), ("0e0", 0.0), (0.25, 0.25)],
)
def test_a_float_hyper_parameter_keeps_what_was_typed(job: Any, typed: Any, expected: float) -> None:
    """The form's field for a float is text (a number field reads 1e-3 as 13): prepare parses it."""
    schema = job_params(job)["hp_lr"].schema
    # Airflow's plain text input (examples, not a multi-type JSON box); the range is prepare's.
    assert schema["type"] == ["string", "number"] and schema["examples"] == ["0.1"] and "maximum" not in schema
    job_params(job)["hp_lr"].resolve(typed)  # the form's (and the REST API's) schema takes it
    assert run_params(context(job, {"hp_lr": typed}), job).hparams["lr"] == expected


# Hyper-parameters a strategy defines (issue 35): aggregator fedprox hands `mu` to the trainers as
# hp_fedprox_mu; its bounds hold for a run's value in prepare, before any site trains.
FEDPROX_CASES = [
    Case("conf-fedprox-mu-huge", "trigger_conf", '{"hp_fedprox_mu": 1e300} with aggregator fedprox',
         "hp_fedprox_mu=1e+300 is above the job's maximum 1000000.0"),
    Case("conf-fedprox-mu-negative", "trigger_conf", '{"hp_fedprox_mu": -5} with aggregator fedprox',
         "hp_fedprox_mu=-5.0 is below the job's minimum 0.0"),
    Case("conf-fedprox-mu-above-job-range", "trigger_conf",
         '{"hp_fedprox_mu": 0.5} with the job\'s hparam_ranges.fedprox_mu max 0.1',
         "hp_fedprox_mu=0.5 is above the job's maximum 0.1"),
]  # fmt: skip
FEDPROX_CONF = {"conf-fedprox-mu-huge": 1e300, "conf-fedprox-mu-negative": -5, "conf-fedprox-mu-above-job-range": 0.5}
CASES = CASES + FEDPROX_CASES  # a new list: the cases above keep their own test


def fedprox_job(tmp_path: pathlib.Path, ranges: dict[str, Any]) -> Any:
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "init.safetensors").write_bytes(INITIAL_MODEL.read_bytes())
    data = {
        "job": "demo", "rounds": 3, "min_clients": 1, "initial_model": "init.safetensors",
        "store": str(tmp_path / "store"), "aggregator": {"name": "fedprox", "mu": 0.01},
        "trainer": {"script": "train.py", "hparams": {"lr": 0.1}, "hparam_ranges": ranges},
        "sites": {"site-1": {}, "site-2": {}},
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    return load_job(tmp_path / "job.yaml")


@pytest.mark.parametrize("bad_case", FEDPROX_CASES, ids=lambda c: c.id)
def test_a_strategy_hyper_parameter_is_bounded_in_prepare(bad_case: Case, tmp_path: pathlib.Path) -> None:
    ranges = {"fedprox_mu": {"max": 0.1}} if bad_case.id == "conf-fedprox-mu-above-job-range" else {}
    job = fedprox_job(tmp_path, ranges)
    with pytest.raises(RunParamsError) as info:
        run_params(context(job, {"hp_fedprox_mu": FEDPROX_CONF[bad_case.id]}), job)
    assert_clear(bad_case, str(info.value))


def test_the_form_shows_the_strategy_bounds_and_takes_a_value_inside(tmp_path: pathlib.Path) -> None:
    job = fedprox_job(tmp_path, {})
    param = job_params(job)["hp_fedprox_mu"]
    # A float's bounds are said in its description, not put in its schema: Airflow would refuse with
    # its JSON-schema dump; prepare refuses with a sentence (the cases above).
    assert "allowed: 0.0 <= fedprox_mu <= 1000000.0" in param.description
    assert "minimum" not in param.schema and "maximum" not in param.schema
    assert run_params(context(job, {"hp_fedprox_mu": 0.5}), job).hparams["fedprox_mu"] == 0.5


# The Sites field of a job run by the sites' data (issue 39): names of the job's sites, once each.
DATA_CASES = [
    Case("conf-sites-unknown", "trigger_conf", '{"sites": ["site-9"]} in a job of site-1 and site-2',
         "sites: 'site-9' not in job 'demo' (its sites: site-1, site-2)"),
    Case("conf-sites-not-a-list", "trigger_conf", '{"sites": "site-1"} (a name, not a list)',
         "sites must be a list of site names, got 'site-1'"),
    Case("conf-sites-twice", "trigger_conf", '{"sites": ["site-1", "site-1"]}',
         "sites names a site twice"),
]  # fmt: skip
DATA_CONF = {"conf-sites-unknown": ["site-9"], "conf-sites-not-a-list": "site-1", "conf-sites-twice": ["site-1"] * 2}
CASES = CASES + DATA_CASES


@pytest.mark.parametrize("bad_case", DATA_CASES, ids=lambda c: c.id)
def test_the_sites_of_a_data_driven_job_are_its_own(bad_case: Case, tmp_path: pathlib.Path) -> None:
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "init.safetensors").write_bytes(INITIAL_MODEL.read_bytes())
    data = {
        "job": "demo", "rounds": 1, "min_clients": 1, "initial_model": "init.safetensors",
        "trainer": {"script": "train.py"}, "trigger": {"on_data": {"min_sites": 1}},
        "sites": {"site-1": {}, "site-2": {}},
    }  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(data))
    job = load_job(tmp_path / "job.yaml")
    with pytest.raises(RunParamsError) as info:
        run_params(context(job, {"sites": DATA_CONF[bad_case.id]}), job)
    assert_clear(bad_case, str(info.value))
