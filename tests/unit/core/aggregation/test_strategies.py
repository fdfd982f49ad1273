"""The strategy seam: golden server-optimizer sequences, robust rules equal to a naive stacked numpy
reference (bitwise), norm bounding, quorum per rule, FedAvg through the seam bitwise unchanged, and
server state that a retry or a killed aggregation reproduces to the byte."""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from flare_airflow.core.aggregation import engine
from flare_airflow.core.aggregation.accumulate import ACC_CHUNK
from flare_airflow.core.aggregation.engine import aggregate_from_store
from flare_airflow.core.aggregation.strategies import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedAvgRule,
    FedYogi,
    Krum,
    Median,
    StepContext,
    Strategy,
    TrimmedMean,
    proximal_gradient,
    proximal_term,
)
from flare_airflow.core.aggregation.strategies.krum import krum_select
from flare_airflow.core.aggregation.strategies.trimmed_mean import trimmed
from flare_airflow.core.aggregation.streaming import fedavg_from_store
from flare_airflow.core.config.aggregator import aggregator_spec
from flare_airflow.core.errors import FlareAirflowError, QuorumNotReached
from flare_airflow.core.model import FLModel, ParamsType, read_artifact, write_artifact

CTX = StepContext(job="j", run_id="r", round=1)


# --- server optimizers: the golden 1-D sequences --------------------------------------------
@pytest.mark.parametrize(
    ("optimizer", "expected"),
    [
        (FedAdam(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3), [0.099010, 0.232749, 0.389090]),
        (FedYogi(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3), [0.099010, 0.232417, 0.387981]),
        (FedAdagrad(eta=0.1, tau=1e-3), [0.099900, 0.170561, 0.228263]),
        (FedAvgM(eta=1.0, momentum=0.9), [1.0, 2.9, 5.61]),
    ],
    ids=lambda v: getattr(v, "name", ""),
)
def test_server_optimizer_golden_sequences(optimizer, expected: list[float]) -> None:
    x = {"w": np.zeros(1, np.float32)}
    state: dict = {}
    seen = []
    for _ in range(3):
        aggregate = {"w": x["w"] + np.float32(1)}  # the aggregate update is +1 every round
        x, state = optimizer.apply(x, aggregate, state, CTX)
        seen.append(float(x["w"][0]))
    assert seen == pytest.approx(expected, abs=5e-7)
    assert set(state) == {f"{slot}/w" for slot in optimizer.slots}


def test_server_optimizer_leaves_excluded_and_integer_tensors_to_plain_averaging() -> None:
    opt = FedAdam(exclude=["bn.*"])
    prev = {"w": np.zeros(3, np.float32), "bn.running_mean": np.zeros(2, np.float32), "steps": np.zeros(1, np.int64)}
    agg = {"w": np.ones(3, np.float32), "bn.running_mean": np.full(2, 7, np.float32), "steps": np.array([5])}
    out, state = opt.apply(prev, agg, {}, CTX)
    assert out["bn.running_mean"] is agg["bn.running_mean"] and out["steps"] is agg["steps"]
    assert not np.array_equal(out["w"], agg["w"]) and set(state) == {"m/w", "v/w"}


def test_strategy_names_and_parameters_from_the_job_spec() -> None:
    s = aggregator_spec({"name": "fedadam", "eta": 0.5, "beta_2": 0.9, "exclude": ["bn.*"]}).strategy()
    (step,) = s.steps
    assert (s.name, step.eta, step.beta_1, step.beta_2, step.tau, step.exclude) == (
        "fedadam",
        0.5,
        0.9,
        0.9,
        1e-3,
        ("bn.*",),
    )
    assert aggregator_spec({"name": "fedavg"}).strategy().streams()
    assert not aggregator_spec({"name": "fedavg", "norm_bound": 1.0}).strategy().streams()
    krum = aggregator_spec({"name": "krum", "f": 1, "m": 2}).strategy().rule
    assert (krum.f, krum.m) == (1, 2)
    assert aggregator_spec({"name": "fedprox", "mu": 0.1}).strategy().fedprox_mu == 0.1


# --- robust rules against a naive stacked reference --------------------------------------------------
def cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return (np.rint(values) if dtype.kind in "iu" else values).astype(dtype)


def naive(
    rule: str, stack: np.ndarray, weights: np.ndarray, whole: np.ndarray, beta: float = 0.2, f: int = 1, m: int = 1
) -> np.ndarray:
    """The whole stack of updates in memory, numpy's own functions on axis 0 (float64); ``whole``: every
    update's tensors flattened into one row (Krum's distances are over the whole model)."""
    n = stack.shape[0]
    if rule == "median":
        return np.median(stack, axis=0)
    if rule == "trimmed_mean":
        k = math.ceil(beta * n - 1e-9)
        return np.sort(stack, axis=0)[k : n - k].mean(axis=0)
    dist = np.array([[float(((whole[i] - whole[j]) ** 2).sum()) for j in range(n)] for i in range(n)])
    chosen = krum_select(dist, f, m)
    if len(chosen) == 1:
        return stack[chosen[0]]
    total = 0.0
    acc = np.zeros(stack.shape[1:])
    for i in chosen:
        acc += stack[i] * weights[i]
        total += float(weights[i])
    return acc / total


def write_updates(tmp: pathlib.Path, updates: list[dict], samples: list[int], kind=ParamsType.FULL) -> list:
    out = []
    for i, (params, n) in enumerate(zip(updates, samples, strict=True)):
        path = tmp / f"site-{i}.safetensors"
        write_artifact(path, FLModel(params=params, params_type=kind, meta={"num_samples": n}))
        out.append((f"site-{i}", path, None))
    return out


RULES = {"median": Median(), "trimmed_mean": TrimmedMean(beta=0.2), "krum": Krum(f=1), "multi_krum": Krum(f=1, m=3)}


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32"])
@pytest.mark.parametrize("n", [5, 6])
@pytest.mark.parametrize("rule", sorted(RULES))
def test_robust_rules_equal_the_naive_reference_exactly(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, rule: str, n: int, dtype: str
) -> None:
    # Chunks of a few elements: the reference's whole arrays against many chunks per tensor.
    monkeypatch.setattr(engine, "MIN_CHUNK", 7)
    monkeypatch.setattr(engine, "CHUNK_BYTES", 8 * 7 * n)
    rng = np.random.default_rng(n * 100 + len(dtype))
    shapes = {"w": (6, 9), "b": (5,), "s": ()}
    dt = np.dtype(dtype)

    def draw(shape: tuple) -> np.ndarray:
        if dt.kind == "i":
            return rng.integers(-3, 4, size=shape).astype(dt)  # few values: many ties
        return rng.standard_normal(shape).astype(dt)

    glob = {k: draw(s) for k, s in shapes.items()}
    updates = [{k: draw(s) for k, s in shapes.items()} for _ in range(n)]
    updates[1] = {k: v.copy() for k, v in updates[0].items()}  # an exact tie between two sites
    samples = [int(v) for v in rng.integers(1, 50, size=n)]
    outcome, state = aggregate_from_store(
        Strategy(rule=RULES[rule]), glob, write_updates(tmp_path, updates, samples), min_clients=n
    )
    weights = np.array(samples, dtype=np.float64)
    whole = np.stack([np.concatenate([u[k].astype(np.float64).reshape(-1) for k in shapes]) for u in updates])
    for name in shapes:
        stack = np.stack([u[name].astype(np.float64) for u in updates])
        kwargs = {"m": 3} if rule == "multi_krum" else {}
        expected = cast(naive(rule.removeprefix("multi_"), stack, weights, whole, **kwargs), dt)
        assert outcome.params[name].dtype == dt and outcome.params[name].shape == shapes[name]
        assert outcome.params[name].tobytes() == expected.tobytes(), (rule, name)
    assert state == {} and sorted(outcome.accepted) == [f"site-{i}" for i in range(n)]
    if rule.endswith("krum"):
        assert outcome.selected is not None and len(outcome.selected) == (3 if rule == "multi_krum" else 1)


def test_diff_updates_and_norm_bounding_against_the_reference(tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(7)
    glob = {"w": rng.standard_normal(50)}
    diffs = [rng.standard_normal(50) * s for s in (0.1, 0.2, 0.3, 50.0)]  # the last one far out
    paths = write_updates(tmp_path, [{"w": d} for d in diffs], [1, 1, 1, 1], kind=ParamsType.DIFF)
    bound = 2.0
    outcome, _ = aggregate_from_store(Strategy(rule=Median(), norm_bound=bound), glob, paths, min_clients=4)
    rows = []
    for d in diffs:
        norm = math.sqrt(float(np.dot(d, d)))
        rows.append(glob["w"] + d * (bound / norm) if norm > bound else glob["w"] + d)
    assert outcome.params["w"].tobytes() == np.median(np.stack(rows), axis=0).tobytes()
    assert list(outcome.clipped) == ["site-3"] and outcome.clipped["site-3"] < 0.1
    fedavg, _ = aggregate_from_store(Strategy(rule=FedAvgRule(), norm_bound=bound), glob, paths, min_clients=4)
    assert np.allclose(fedavg.params["w"], np.mean(np.stack(rows), axis=0), rtol=0, atol=1e-12)


def test_krum_drops_a_sign_flipped_scaled_update(tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(3)
    glob = {"w": np.zeros(100, np.float32)}
    true = rng.standard_normal(100).astype(np.float32)
    updates = [{"w": true + 0.05 * rng.standard_normal(100).astype(np.float32)} for _ in range(4)]
    updates.append({"w": -10 * true})
    outcome, _ = aggregate_from_store(
        Strategy(rule=Krum(f=1)), glob, write_updates(tmp_path, updates, [1] * 5), min_clients=5
    )
    assert outcome.selected is not None and "site-4" not in outcome.selected


def test_fedavg_through_the_seam_is_bitwise_fedavg(tmp_path: pathlib.Path) -> None:
    rng = np.random.default_rng(11)
    glob = {"w": rng.standard_normal((40, 30)).astype(np.float32), "n": np.arange(4, dtype=np.int64)}
    updates = [{"w": rng.standard_normal((40, 30)).astype(np.float32), "n": np.arange(4) * i} for i in range(3)]
    paths = write_updates(tmp_path, updates, [3, 5, 8])
    seam, state = aggregate_from_store(
        aggregator_spec({}).strategy(), glob, paths, min_clients=2, site_weights={"site-1": 2.0}
    )
    plain = fedavg_from_store(glob, paths, min_clients=2, site_weights={"site-1": 2.0})
    assert state == {} and seam.accepted == plain.accepted and seam.metrics == plain.metrics
    assert all(seam.params[k].tobytes() == plain.params[k].tobytes() for k in glob)


# --- quorum per rule ---------------------------------------------------------------------------------
def test_quorum_per_rule() -> None:
    assert Krum(f=1).quorum_problem(4) == "krum with f=1 needs n >= 2f + 3 = 5 valid updates, got 4"
    assert Krum(f=1).quorum_problem(5) is None and Krum(f=1, m=5).quorum_problem(5) is not None
    assert trimmed(5, 0.2) == 1 and TrimmedMean(0.2).quorum_problem(5) is None
    assert "leaving nothing to average" in (TrimmedMean(0.3).quorum_problem(4) or "")
    # 2 ceil(beta n) < n is not monotone in n: 3 sites pass with beta 0.3, 4 do not.
    spec = aggregator_spec({"name": "trimmed_mean", "beta": 0.3})
    assert spec.quorum_problem(3, 3) is None
    assert "a round may count any number from 3 to 4" in (spec.quorum_problem(3, 4) or "")


def test_the_rules_quorum_is_checked_again_at_aggregation(tmp_path: pathlib.Path) -> None:
    glob = {"w": np.zeros(4, np.float32)}
    paths = write_updates(tmp_path, [{"w": np.full(4, i, np.float32)} for i in range(5)], [1] * 5)
    paths[4] = ("site-4", None, "the trainer crashed")
    with pytest.raises(QuorumNotReached) as exc:
        aggregate_from_store(Strategy(rule=Krum(f=1)), glob, paths, min_clients=3)
    assert "krum with f=1 needs n >= 2f + 3 = 5 valid updates, got 4" in str(exc.value)
    assert "site-4: the trainer crashed" in str(exc.value) and "not updated" in str(exc.value)


def test_an_update_republished_between_the_phases_fails_the_round(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    glob = {"w": np.zeros(4, np.float32)}
    paths = write_updates(tmp_path, [{"w": np.full(4, i, np.float32)} for i in range(3)], [1] * 3)
    real = engine.open_for_reading

    def republish_then_open(path):
        if path == paths[1][1]:
            write_artifact(path, FLModel(params={"w": np.full(4, 99, np.float32)}, meta={"num_samples": 1}))
        return real(path)

    monkeypatch.setattr(engine, "open_for_reading", republish_then_open)
    with pytest.raises(
        FlareAirflowError, match=r"site 'site-1': its update .* was replaced while the round was aggregated"
    ):
        aggregate_from_store(Strategy(rule=Median()), glob, paths, min_clients=3)


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad", "fedavgm"])
def test_the_step_fused_into_fedavgs_pass_gives_the_bytes_of_the_step_after_it(tmp_path: pathlib.Path, name) -> None:
    """The store engine runs a server optimizer inside FedAvg's result pass, a piece of the mean at a
    time; model and state must be bitwise those of the step applied to the whole mean afterwards,
    over several pieces (ACC_CHUNK), mixed FULL/DIFF updates, excluded, float16 and integer tensors;
    a state handed over (consume_state) is written over, one kept is left alone."""
    rng = np.random.default_rng(11)
    glob = {
        "w": rng.standard_normal(ACC_CHUNK * 2 + 17).astype(np.float32),
        "h": rng.standard_normal((5, 3)).astype(np.float16),
        "bn.mean": rng.standard_normal(4).astype(np.float32),
        "steps": np.arange(3, dtype=np.int64),
    }
    ups = [{k: v + rng.standard_normal(v.shape).astype(v.dtype) if v.dtype.kind == "f" else v for k, v in glob.items()}
           for _ in range(3)]  # fmt: skip
    paths = write_updates(tmp_path, ups, [3, 1, 2])
    diff = {k: (v - glob[k]) for k, v in ups[1].items()}
    write_artifact(paths[1][1], FLModel(params=diff, params_type=ParamsType.DIFF, meta={"num_samples": 1}))
    strategy = aggregator_spec({"name": name, "exclude": ["bn.*"]}).strategy()
    (opt,) = strategy.steps
    plain = fedavg_from_store(glob, paths, min_clients=3)
    state = {f"{name}/{slot}/{k}": (np.abs(v) * 0.1).astype(v.dtype) for slot in opt.slots for k, v in glob.items()
             if k in ("w", "h")}  # fmt: skip
    kept = {k: v.copy() for k, v in state.items()}
    expected, expected_state = opt.apply(glob, plain.params, {k.split("/", 1)[1]: v for k, v in state.items()}, CTX)
    for consume in (False, True):
        outcome, new_state = aggregate_from_store(
            strategy, glob, paths, min_clients=3, state=state, context=CTX, consume_state=consume
        )
        assert sorted(outcome.params) == sorted(expected)
        assert all(outcome.params[k].tobytes() == expected[k].tobytes() for k in expected)
        assert {k: v.tobytes() for k, v in new_state.items()} == {
            f"{name}/{k}": v.tobytes() for k, v in expected_state.items()
        }
        same = all(np.array_equal(state[k], kept[k]) for k in state)
        assert same is not consume  # handed over: written over; kept: untouched
        assert all((new_state[k] is state[k]) is consume for k in state)
    # round 1 (no state) fused and not
    first, first_state = aggregate_from_store(strategy, glob, paths, min_clients=3, context=CTX)
    alone, alone_state = opt.apply(glob, plain.params, {}, CTX)
    assert all(first.params[k].tobytes() == alone[k].tobytes() for k in alone)
    assert {k: v.tobytes() for k, v in first_state.items()} == {
        f"{name}/{k}": v.tobytes() for k, v in alone_state.items()
    }


def test_a_server_state_of_another_shape_is_refused_by_name() -> None:
    opt = FedAdam()
    with pytest.raises(FlareAirflowError, match=r"'m' of tensor 'w' has shape \(2,\).*another model"):
        opt.apply({"w": np.zeros(3, np.float32)}, {"w": np.ones(3, np.float32)}, {"m/w": np.zeros(2, np.float32)}, CTX)


# --- server state in the store: retries and kill -9 --------------------------------------------------
def fedadam_rounds(tmp: pathlib.Path, rounds: int) -> list[str]:
    """Run ``rounds`` rounds of FedAdam from the store, state written before the model (as the task
    does); the sha256 of each round's global model."""
    strategy = aggregator_spec({"name": "fedadam"}).strategy()
    rng = np.random.default_rng(5)
    write_artifact(tmp / "global-0.safetensors", FLModel(params={"w": rng.standard_normal(1000).astype(np.float32)}))
    shas = []
    for r in range(1, rounds + 1):
        glob, _ = read_artifact(tmp / f"global-{r - 1}.safetensors")
        state = read_artifact(tmp / f"state-{r - 1}.safetensors")[0] if r > 1 else {}
        upd = [{"w": glob["w"] + rng.standard_normal(1000).astype(np.float32)} for _ in range(3)]
        outcome, new_state = aggregate_from_store(
            strategy, glob, write_updates(tmp / f"u{r}", upd, [1, 2, 3]) if (tmp / f"u{r}").mkdir() is None else [],
            min_clients=3, state=state, context=StepContext("j", "r", r),
        )  # fmt: skip
        write_artifact(tmp / f"state-{r}.safetensors", FLModel(params=new_state))
        shas.append(write_artifact(tmp / f"global-{r}.safetensors", FLModel(params=outcome.params)).sha256)
    return shas


def test_a_retried_round_reproduces_its_state_and_model_to_the_byte(tmp_path: pathlib.Path) -> None:
    first = fedadam_rounds(tmp_path / "a", 3) if (tmp_path / "a").mkdir() is None else []
    again = fedadam_rounds(tmp_path / "b", 3) if (tmp_path / "b").mkdir() is None else []
    assert first == again
    # Round 3 again from round 2's stored state (a cleared aggregation task): the same bytes.
    strategy = aggregator_spec({"name": "fedadam"}).strategy()
    a = tmp_path / "a"
    glob, _ = read_artifact(a / "global-2.safetensors")
    state, _ = read_artifact(a / "state-2.safetensors")
    paths = [(f"site-{i}", a / "u3" / f"site-{i}.safetensors", None) for i in range(3)]
    outcome, new_state = aggregate_from_store(strategy, glob, paths, min_clients=3, state=state, context=CTX)
    assert write_artifact(a / "again.safetensors", FLModel(params=outcome.params)).sha256 == first[2]
    assert (
        hashlib.sha256(a.joinpath("state-3.safetensors").read_bytes()).hexdigest()
        == write_artifact(a / "again-state.safetensors", FLModel(params=new_state)).sha256
    )


KILLED = textwrap.dedent(
    """
    import sys, pathlib, numpy as np
    from flare_airflow.core.config.aggregator import aggregator_spec
    from flare_airflow.core.model import FLModel, read_artifact, write_artifact
    from flare_airflow.core.aggregation.strategies import StepContext
    from flare_airflow.core.aggregation.engine import aggregate_from_store
    d = pathlib.Path(sys.argv[1])
    glob, _ = read_artifact(d / "global-1.safetensors")
    state, _ = read_artifact(d / "state-1.safetensors")
    paths = [(f"site-{i}", d / f"site-{i}.safetensors", None) for i in range(3)]
    strategy = aggregator_spec({"name": "fedadam"}).strategy()
    print("started", flush=True)
    while True:  # the aggregation task, over and over, until it is killed
        outcome, new = aggregate_from_store(strategy, glob, paths, min_clients=3, state=state,
                                            context=StepContext("j", "r", 2))
        write_artifact(d / "state-2.safetensors", FLModel(params=new))
        write_artifact(d / "global-2.safetensors", FLModel(params=outcome.params))
    """
)


def test_kill_9_of_the_aggregation_then_a_retry_gives_the_uninterrupted_bytes(tmp_path: pathlib.Path) -> None:
    """A real process aggregating round 2 of FedAdam (1M parameters) is killed with SIGKILL at once
    and mid-write; the retry's state and global model equal an uninterrupted run's, byte for byte."""
    rng = np.random.default_rng(9)
    size = 1 << 19
    glob = {"w": rng.standard_normal(size).astype(np.float32)}
    write_artifact(tmp_path / "global-1.safetensors", FLModel(params=glob))
    write_artifact(
        tmp_path / "state-1.safetensors",
        FLModel(
            params={
                "fedadam/m/w": rng.standard_normal(size).astype(np.float32),
                "fedadam/v/w": np.ones(size, np.float32),
            }
        ),
    )
    write_updates(
        tmp_path, [{"w": glob["w"] + rng.standard_normal(size).astype(np.float32)} for _ in range(3)], [1, 2, 3]
    )
    script = tmp_path / "aggregate.py"
    script.write_text(KILLED)
    for delay in (0.2, 1.0):
        proc = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        time.sleep(delay)
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    strategy = aggregator_spec({"name": "fedadam"}).strategy()
    state, _ = read_artifact(tmp_path / "state-1.safetensors")
    paths = [(f"site-{i}", tmp_path / f"site-{i}.safetensors", None) for i in range(3)]
    outcome, new = aggregate_from_store(
        strategy, glob, paths, min_clients=3, state=state, context=StepContext("j", "r", 2)
    )
    expected_state = write_artifact(tmp_path / "x-state.safetensors", FLModel(params=new)).sha256
    expected_model = write_artifact(tmp_path / "x-global.safetensors", FLModel(params=outcome.params)).sha256
    # The retry: whatever the killed tries left, round 2 from round 1's state.
    subprocess.run(
        [sys.executable, "-c", KILLED.replace("while True:", "for _ in range(1):"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    assert read_artifact(tmp_path / "state-2.safetensors")[1].sha256 == expected_state
    assert read_artifact(tmp_path / "global-2.safetensors")[1].sha256 == expected_model


# --- FedProx helpers ---------------------------------------------------------------------------------
def test_fedprox_term_and_gradient() -> None:
    w, g = {"a": np.array([1.0, 2.0], np.float32)}, {"a": np.array([0.0, 0.0], np.float32)}
    assert proximal_term(w, g, 0.1) == pytest.approx(0.5 * 0.1 * 5.0)
    grad = proximal_gradient(w["a"], g["a"], 0.1)
    assert grad.dtype == np.float32 and np.allclose(grad, [0.1, 0.2])
