"""The server app's ``config_fed_server``: one FedAvg workflow, its persistor and aggregator."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from flare_airflow.nvflare.configs import Component, ConfigFile
from flare_airflow.nvflare.filters import read_filters
from flare_airflow.nvflare.model import NVFLARE_DEFAULT_MODEL, inline_model
from flare_airflow.nvflare.reading import Reading, known_or_refused, whole

FEDAVG_WORKFLOWS = {"FedAvg", "BaseFedAvg", "PTFedAvg", "ScatterAndGather"}
REFUSED_WORKFLOW_HINT = {
    "Scaffold": "SCAFFOLD's control variates are not implemented in flare-airflow",
    "ScatterAndGatherScaffold": "SCAFFOLD's control variates are not implemented in flare-airflow",
    "CyclicController": "cyclic weight transfer (one site after another) is not a FedAvg round",
    "Cyclic": "cyclic weight transfer (one site after another) is not a FedAvg round",
    "CrossSiteModelEval": "cross-site evaluation is not carried over; evaluate the published model with the trainer",
    "CrossSiteEval": "cross-site evaluation is not carried over; evaluate the published model with the trainer",
    "FedAvgEarlyStopping": "early stopping is not carried over",
    "PTFedAvgEarlyStopping": "early stopping is not carried over",
}
AGGREGATORS = {"InTimeAccumulateWeightedAggregator"}
SHAREABLE_GENERATORS = {"FullModelShareableGenerator"}
NP_PERSISTORS = {"NPModelPersistor"}
MODEL_PERSISTORS = {"PTFileModelPersistor", "TFModelPersistor", "NPModelPersistor"}
# FedAvg / ScatterAndGather arguments whose behaviour flare-airflow has (or that only tune NVFlare itself).
WORKFLOW_ARGS_CARRIED = {
    "num_rounds": "rounds",
    "num_clients": "min_clients",
    "min_clients": "min_clients",
    "aggregation_weights": "the sites' weight",
    "persistor_id": "initial_model",
    "aggregator_id": "FedAvg",
    "shareable_generator_id": "FULL model to every site",
    "start_round": "must be 0",
    "task_name": "the train task",
    "train_task_name": "the train task",
    "wait_time_after_min_received": "a round ends when every site task ended",
    "train_timeout": "trainer.timeout",
    "save_filename": "the published global model",
    "memory_gc_rounds": "NVFlare's memory tuning",
    "enable_tensor_disk_offload": "NVFlare's memory tuning; flare-airflow streams updates from the store",
    "ignore_result_error": "a failed site does not count; min_clients decides",
    "allow_empty_global_weights": "the initial model is required",
}
WORKFLOW_ARGS_REFUSED = {
    "stop_cond": ("early stopping is not carried over", "remove stop_cond and patience"),
    "patience": ("early stopping is not carried over", "remove stop_cond and patience"),
    "exclude_vars": ("every tensor of the model is averaged in flare-airflow", "remove exclude_vars"),
    "fedprox_mu": ("FedProx's proximal term is not carried over", "add the proximal term to the client's loss"),
    "aggregator": ("a custom aggregator object is not carried over", "use the default weighted FedAvg"),
    "model": (
        "an initial model given inline to the workflow is not read",
        "save it as safetensors and pass --initial-model FILE",
    ),
}
# Components whose job flare-airflow does another way: carried over as a note each.


@dataclass
class Server:
    rounds: int | None = None
    min_clients: int | None = None
    initial: dict[str, np.ndarray] | None = None
    weights: dict[str, float] = field(default_factory=dict)


def read_server(cfg: ConfigFile, reading: Reading, *, have_initial_model: bool) -> Server:
    server = Server()
    components = {c.id: c for c in cfg.components("components")}
    workflows = list(cfg.components("workflows"))
    if not workflows:
        reading.refuse(cfg.path, "workflows", "the server config has no workflow", "add a FedAvg workflow")
    used: set[str] = set()
    fedavg: Component | None = None
    for wf in workflows:
        if wf.class_name not in FEDAVG_WORKFLOWS or fedavg is not None:
            why = REFUSED_WORKFLOW_HINT.get(
                wf.class_name,
                "a second workflow" if fedavg is not None else "flare-airflow runs FedAvg rounds only",
            )
            reading.refuse(
                wf.where,
                f"workflow {wf.path}",
                why,
                "keep one FedAvg (or ScatterAndGather) workflow; other controllers run in NVFlare itself",
            )
            continue
        fedavg = wf
    if fedavg is None:
        return server
    args = fedavg.args
    rounds = args.get("num_rounds")
    server.rounds = rounds if whole(rounds) and rounds > 0 else None
    if server.rounds is None:
        reading.refuse(fedavg.where, f"{fedavg.path} num_rounds", f"is {rounds!r}", "set a whole number >= 1")
    for key in ("min_clients", "num_clients"):
        value = args.get(key)
        if value is not None and not (whole(value) and value >= 0):
            reading.refuse(fedavg.where, f"{fedavg.path} {key}", f"is {value!r}", "set a whole number >= 1")
        elif server.min_clients is None and whole(value) and value > 0:
            server.min_clients = value
    for key, value in args.items():
        if key in WORKFLOW_ARGS_REFUSED and value not in (None, "", {}, []):
            why, todo = WORKFLOW_ARGS_REFUSED[key]
            reading.refuse(fedavg.where, f"{fedavg.class_name} {key}", why, todo)
        elif key not in WORKFLOW_ARGS_CARRIED and key not in WORKFLOW_ARGS_REFUSED:
            reading.note(fedavg.where, f"{fedavg.class_name} {key}={value!r}", "not carried over (no equivalent)")
    if args.get("start_round") not in (None, 0) or isinstance(args.get("start_round"), bool):
        reading.refuse(
            fedavg.where,
            f"{fedavg.path} start_round {args['start_round']!r}",
            "an imported job starts at round 0",
            "remove start_round (resume a flare-airflow run instead)",
        )
    _weights(fedavg, server, reading)
    # FedAvg (2.9) finds its persistor under the id "persistor" unless told otherwise.
    if fedavg.class_name != "ScatterAndGather":
        args = {"persistor_id": "persistor", **args}
    for key, kinds in (
        ("persistor_id", MODEL_PERSISTORS),
        ("aggregator_id", AGGREGATORS),
        ("shareable_generator_id", SHAREABLE_GENERATORS),
    ):
        cid = args.get(key)
        if not cid:
            continue
        used.add(str(cid))
        component = components.get(str(cid))
        if component is None and key == "persistor_id" and "persistor_id" not in fedavg.args:
            continue  # FedAvg without a persistor: the initial model must come from --initial-model
        if component is None:
            reading.refuse(fedavg.where, f"{key} {cid!r}", "no component has this id", "fix the id")
            continue
        if component.class_name not in kinds:
            reading.refuse(
                component.where,
                f"{key.removesuffix('_id')} {component.path}",
                "not one flare-airflow can carry over",
                f"use one of {', '.join(sorted(kinds))}",
            )
            continue
        if key == "persistor_id":
            server.initial = _initial_model(component, reading, have_initial_model=have_initial_model)
        elif key == "aggregator_id":
            _aggregator(component, server, reading)
    read_filters(cfg, reading, client=False)
    for cid, component in components.items():
        if cid not in used:
            known_or_refused(component, reading)
    return server


def _initial_model(component: Component, reading: Reading, *, have_initial_model: bool) -> dict[str, np.ndarray] | None:
    if have_initial_model:
        return None
    if component.class_name in NP_PERSISTORS:
        if component.args.get("source_ckpt_file_full_name"):
            reading.refuse(
                component.where,
                f"persistor {component.path} source_ckpt_file_full_name",
                "the checkpoint is a path on NVFlare's server",
                "pass that checkpoint as a safetensors file: --initial-model FILE",
            )
            return None
        initial = component.args.get("model")
        if initial is None:
            initial = NVFLARE_DEFAULT_MODEL
            reading.note(component.where, component.path, "no model given: NVFlare's default 3 x 3 array, as NVFlare")
        # NVFlare's NPModelPersistor holds the model as float32 (np.array(model, dtype=np.float32)).
        model, why = inline_model(initial)
        if why is not None:
            reading.refuse(
                component.where,
                f"persistor {component.path} model",
                f"it {why}",
                "give nested lists of numbers of one shape, or pass --initial-model FILE (safetensors)",
            )
        return model
    reading.refuse(
        component.where,
        f"persistor {component.path}",
        "it builds the initial model from framework code (e.g. a torch.nn.Module class) on the server",
        "save that model's state_dict as safetensors "
        "(safetensors.torch.save_file(Net().state_dict(), 'init.safetensors')) "
        "and pass --initial-model init.safetensors",
    )
    return None


def _weights(component: Component, server: Server, reading: Reading) -> None:
    """``aggregation_weights``: each site's finite, non-negative weight."""
    weights = component.args.get("aggregation_weights")
    if weights is None:
        return
    if not isinstance(weights, Mapping):
        reading.refuse(
            component.where,
            f"{component.path} aggregation_weights",
            f"is {type(weights).__name__}, not an object of site: weight",
            "write {site-1: 1.0, site-2: 2.0}",
        )
        return
    for site, weight in weights.items():
        number = float(weight) if isinstance(weight, numbers.Real) and not isinstance(weight, bool) else math.nan
        if not (math.isfinite(number) and number >= 0):
            reading.refuse(
                component.where,
                f"{component.path} aggregation_weights[{str(site)[:60]!r}]",
                f"is {str(weight)[:40]!r}, not a finite number >= 0",
                "give each site a number",
            )
            continue
        server.weights[str(site)] = number


def _aggregator(component: Component, server: Server, reading: Reading) -> None:
    args = component.args
    if args.get("exclude_vars"):
        reading.refuse(
            component.where,
            f"{component.path} exclude_vars",
            "every tensor of the model is averaged in flare-airflow",
            "remove exclude_vars",
        )
    _weights(component, server, reading)
    kind = args.get("expected_data_kind", "WEIGHTS")
    if kind not in ("WEIGHTS", "WEIGHT_DIFF"):
        reading.refuse(
            component.where,
            f"{component.path} expected_data_kind {kind!r}",
            "flare-airflow aggregates weights (FULL) or weight differences (DIFF)",
            "use WEIGHTS or WEIGHT_DIFF",
        )
