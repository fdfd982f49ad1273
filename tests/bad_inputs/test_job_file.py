"""Bad job files: each is loaded as ``flare-airflow validate`` and every task process would load it.

A case's input is a whole file (text or bytes), or the base job below with one field set. Each test
runs :func:`load_job` (plus the initial-model and store checks ``validate`` adds) and asserts the
ConfigError names the file, the field and what is allowed -- never a traceback, never a long repr.
"""

from __future__ import annotations

import json
import pathlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import yaml

from flare_airflow.core.config import check_store_backend, load_initial_model, load_job
from flare_airflow.core.errors import ConfigError
from tests.bad_inputs.cases import Case, assert_clear
from tests.config_lines import without_lines

REPO = pathlib.Path(__file__).resolve().parents[2]
INITIAL_MODEL = REPO / "examples" / "digits" / "initial_model.safetensors"
# Messages stay short whatever the input: a user reads them in a terminal or a task log.
MAX_MESSAGE = 1500


@dataclass(frozen=True)
class Bad:
    """How to build the bad input: a whole file, or one field of the base job set to ``value``."""

    text: str | bytes | None = None
    field: str | None = None
    value: Any = None
    model: bytes | None = None  # the initial model's bytes
    path: str = "job.yaml"  # relative to the job directory; a case may point elsewhere


CASES: list[Case] = []
INPUTS: dict[str, Bad] = {}


def case(id: str, bad_input: str, error: str, **bad: Any) -> None:
    CASES.append(Case(id, "job_file", bad_input, error))
    INPUTS[id] = Bad(**bad)


BASE = """\
job: demo
rounds: 3
min_clients: 1
initial_model: init.safetensors
trainer:
  script: train.py
  hparams: {lr: 0.1, epochs: 2}
sites:
  site-1: {}
  site-2: {}
"""

BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{n}: &{n} [{','.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefgh", "bcdefghi", strict=True)
)


def _safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header: dict[str, Any] = {}
    data = b""
    for name, arr in tensors.items():
        raw = arr.tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + data


# --- the file itself -------------------------------------------------------------------------
# --- sites at the sites: queues and executors -------------------------------------------------
case(
    "site-queue-with-space",
    "a site's queue with a space in it",
    "sites.site-1.queue (site 'site-1'): queue 'site 1' is not a queue name",
    field="sites.site-1.queue",
    value="site 1",
)
case(
    "site-queue-list",
    "a site's queue given as a list of queues",
    "sites.site-1.queue (site 'site-1'): must be a string",
    field="sites.site-1.queue",
    value=["site-1", "gpu"],
)
case(
    "site-queues-string",
    "site_queues: 'yes' (a string, not true/false)",
    "site_queues: must be true or false",
    field="site_queues",
    value="yes",
)
case(
    "store-conn-id-with-credentials",
    "store_conn_id written as a connection URI with a secret in it",
    "store_conn_id: store_conn_id must be an Airflow connection id: letters, digits, '.', '_' and '-'",
    field="store_conn_id",
    value="aws://AKIA:s3cr3t@",
)
case(
    "watch-sensor-on-a-process-site",
    "watch: sensor on a process site (its job ends with the task that launched it)",
    "watch: sensor needs a site job that outlives the task that launched it",
    field="sites.site-1.watch",
    value="sensor",
)
case(
    "confinement-in-the-job-file",
    "a job file turns its process trainers' confinement off (sites.site-1.confinement)",
    "confinement is the site admin's, not the job's: set it in the site policy",
    field="sites.site-1.confinement",
    value={"mode": "off"},
)
case(
    "watch-unknown",
    "watch: poll (neither task nor sensor)",
    "sites.site-1.watch (site 'site-1'): must be 'task' or 'sensor', got 'poll'",
    field="sites.site-1.watch",
    value="poll",
)
case(
    "site-executor-shell",
    "a site's executor that is not an executor name",
    "is not an Airflow executor name",
    field="sites.site-1.executor",
    value="EdgeExecutor; rm -rf /",
)

case(
    "file-missing",
    "the job file does not exist",
    "cannot read the job file (No such file or directory)",
    path="nope.yaml",
)
case(
    "file-is-a-directory", "a directory given as the job file", "is a directory; give the job's YAML file", path="jobs"
)
case(
    "file-binary",
    "a PNG image given as the job file",
    "not a text file (byte 0 is not UTF-8)",
    text=b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe",
)
case(
    "file-latin-1",
    "a job file saved as Latin-1 (é as one byte)",
    "not a text file (byte 8 is not UTF-8)",
    text=b"job: caf\xe9-x\nrounds: 3\n",
)
case("file-empty", "an empty job file", "the job file is empty", text="")
case("file-only-comments", "a job file with only comments", "the job file is empty", text="# job: demo\n")
case(
    "file-yaml-list",
    "a job file that is a YAML list",
    "must be a YAML mapping (job: ..., rounds: ..., sites: ...)",
    text="- job: demo\n- rounds: 3\n",
)
case("file-yaml-scalar", "a job file that is one word", "must be a YAML mapping", text="demo\n")
case(
    "file-alias-bomb",
    "a 700-byte YAML alias bomb (billion laughs, 9**9 values)",
    "expands to more than 200000 values through its aliases (an alias bomb?)",
    text=BOMB,
)
case(
    "file-self-reference",
    "a YAML alias that refers to the mapping containing it",
    "an alias refers to a value that contains it",
    text=BASE.replace("sites:\n", "sites: &s\n  loop: *s\n"),
)
case(
    "file-deep-nesting",
    "values nested 100 levels deep",
    "values are nested more than 64 levels deep",
    text=BASE + "evaluate: " + "[" * 100 + "]" * 100 + "\n",
)
case(
    "file-merge-key",
    "a YAML merge key (<<: *defaults)",
    "merge keys ('<<') are not supported",
    text=BASE.replace("  site-1: {}", "  site-1: &d {retries: 1}\n  site-3: {<<: *d}"),
)
case(
    "file-duplicate-key",
    "the same key twice (rounds)",
    "duplicate key 'rounds' (each key may appear once)",
    text=BASE + "rounds: 5\n",
)
case("file-unhashable-key", "a list used as a key", "keys must be plain names", text=BASE + "? [a, b]\n: 1\n")
case(
    "file-python-tag",
    "a !!python/object tag (code execution with an unsafe loader)",
    "could not determine a constructor for the tag",
    text=BASE + "evaluate: !!python/object/apply:os.system [id]\n",
)
case("file-malformed-yaml", "bad indentation", "malformed YAML", text="job: demo\nrounds: 3\n  min_clients: 1\n")
case(
    "file-control-character",
    "a control character in the file",
    "malformed YAML",
    text=BASE + 'schedule: "x\x07"\n'.replace('"', ""),
)
case(
    "file-too-large",
    "a 5 MiB job file",
    "larger than 4 MiB; a job file holds settings, not data",
    text=BASE + ("#" * 1023 + "\n") * 5 * 1024,
)
case(
    "file-date-as-name",
    "an unquoted date as the job name",
    "job: must be a string, got date",
    field="job",
    value="!date",
)

# --- numbers: integers are integers, numbers are finite and in range -------------------------
case(
    "rounds-true",
    "rounds: true",
    "rounds: must be an integer, got true (true/false is not a number)",
    field="rounds",
    value=True,
)
case(
    "min-clients-false",
    "min_clients: false",
    "min_clients: must be an integer, got false",
    field="min_clients",
    value=False,
)
case(
    "retries-true",
    "retries: true for a site",
    "sites.site-1.retries (site 'site-1'): must be an integer, got true",
    field="sites.site-1.retries",
    value=True,
)
case("rounds-string", "rounds: '3' (quoted)", "rounds: must be an integer, got str '3'", field="rounds", value="3")
case("rounds-fraction", "rounds: 2.5", "rounds: must be an integer, got float 2.5", field="rounds", value=2.5)
case("rounds-zero", "rounds: 0", "rounds: must be greater than or equal to 1, got 0", field="rounds", value=0)
case("rounds-huge", "rounds: 10**30", "rounds: must be less than or equal to 1000", field="rounds", value=10**30)
case("rounds-inf", "rounds: .inf", "rounds: must be an integer, got float inf", field="rounds", value=float("inf"))
case(
    "min-clients-over-sites",
    "min_clients larger than the number of sites",
    "min_clients is 3 but the job has only 2 site(s) (site-1, site-2); lower min_clients or add sites",
    field="min_clients",
    value=3,
)
case(
    "weight-inf",
    "weight: .inf",
    "sites.site-1.weight (site 'site-1'): must be a finite number (not .inf or .nan)",
    field="sites.site-1.weight",
    value=float("inf"),
)
case(
    "weight-nan",
    "weight: .nan",
    "must be a finite number (not .inf or .nan), got float nan",
    field="sites.site-2.weight",
    value=float("nan"),
)
case(
    "weight-zero",
    "weight: 0",
    "sites.site-1.weight (site 'site-1'): must be greater than or equal to 0.000001, got 0",
    field="sites.site-1.weight",
    value=0,
)
case(
    "weight-negative",
    "weight: -1",
    "must be greater than or equal to 0.000001, got -1",
    field="sites.site-1.weight",
    value=-1,
)
case(
    "weight-huge",
    "weight: 1e300 (overflows FedAvg's sums)",
    "must be less than or equal to 1000000, got 1e+300",
    field="sites.site-1.weight",
    value=1e300,
)
case(
    "weight-bool",
    "weight: true",
    "must be a number, got true (true/false is not a number)",
    field="sites.site-1.weight",
    value=True,
)
case(
    "timeout-inf",
    "trainer.timeout: .inf",
    "trainer.timeout: must be a finite number",
    field="trainer.timeout",
    value=float("inf"),
)
case(
    "timeout-huge",
    "trainer.timeout: 1e12 seconds (overflows Airflow's timedelta)",
    "trainer.timeout: must be less than or equal to 31622400",
    field="trainer.timeout",
    value=1e12,
)
case("timeout-zero", "trainer.timeout: 0", "trainer.timeout: must be greater than 0", field="trainer.timeout", value=0)
case(
    "launch-timeout-nan",
    "trainer.launch_timeout: .nan",
    "trainer.launch_timeout: must be a finite number",
    field="trainer.launch_timeout",
    value=float("nan"),
)
case(
    "shutdown-timeout-negative",
    "trainer.shutdown_timeout: -5",
    "trainer.shutdown_timeout: must be greater than or equal to 0",
    field="trainer.shutdown_timeout",
    value=-5,
)
case(
    "retry-delay-inf",
    "retry_delay_seconds: .inf",
    "sites.site-1.retry_delay_seconds (site 'site-1'): must be a finite",
    field="sites.site-1.retry_delay_seconds",
    value=float("inf"),
)
case(
    "cpus-inf",
    "num_of_cpus: .inf",
    "sites.site-2.resource_spec.num_of_cpus (site 'site-2'): must be a finite number",
    field="sites.site-2.resource_spec.num_of_cpus",
    value=float("inf"),
)
case(
    "cpus-bool",
    "num_of_cpus: true",
    "resource_spec.num_of_cpus (site 'site-1'): must be a number, got true",
    field="sites.site-1.resource_spec.num_of_cpus",
    value=True,
)
case(
    "cpus-zero",
    "num_of_cpus: 0",
    "num_of_cpus (site 'site-1'): must be greater than 0",
    field="sites.site-1.resource_spec.num_of_cpus",
    value=0,
)
case(
    "gpus-negative",
    "num_of_gpus: -1",
    "sites.site-2.resource_spec.num_of_gpus (site 'site-2'): must be greater than",
    field="sites.site-2.resource_spec.num_of_gpus",
    value=-1,
)
case(
    "gpus-fraction",
    "num_of_gpus: 0.5",
    "sites.site-2.resource_spec.num_of_gpus (site 'site-2'): must be an integer",
    field="sites.site-2.resource_spec.num_of_gpus",
    value=0.5,
)
case(
    "gpus-without-manager",
    "a site job asks for a GPU, the site declares none",
    "declares no resource_manager: add resource_manager",
    field="sites.site-1.resource_spec.num_of_gpus",
    value=1,
)
case("memory-zero", "memory: '0'", "'0' is less than one byte", field="sites.site-1.resource_spec.memory", value="0")
case(
    "memory-words",
    "memory: lots",
    "'lots' is not a quantity like '512Mi', '4Gi' or '2G'",
    field="sites.site-1.resource_spec.memory",
    value="lots",
)
case(
    "memory-1e400",
    "memory: 1e400",
    "'1e400' is more memory than any machine has",
    field="sites.site-1.resource_spec.memory",
    value="1e400",
)
case(
    "memory-bool",
    "memory: true",
    "must be a quantity like '512Mi', '4Gi' or '2G', got True",
    field="sites.site-1.resource_spec.memory",
    value=True,
)
case(
    "hparam-range-unknown-name",
    "hparam_ranges for a hyper-parameter the job does not have",
    "hparam_ranges: 'momentum' is not one of the hyper-parameters (lr, epochs)",
    field="trainer.hparam_ranges.momentum",
    value={"min": 0.0},
)
case(
    "hparam-range-min-over-max",
    "hparam_ranges with min above max",
    "min 1.0 is greater than max 0.001",
    field="trainer.hparam_ranges.lr",
    value={"min": 1.0, "max": 0.001},
)
case(
    "hparam-range-excludes-default",
    "hparam_ranges that exclude the hyper-parameter's own default",
    "hparam_ranges: the default of 'lr', 0.1, is above the job's maximum 0.01",
    field="trainer.hparam_ranges.lr",
    value={"max": 0.01},
)
case(
    "hparam-range-empty",
    "hparam_ranges entry with neither min nor max",
    "give min, max or both",
    field="trainer.hparam_ranges.lr",
    value={},
)
case(
    "hparam-inf",
    "a hyper-parameter .inf",
    "trainer.hparams: hyper-parameter 'lr' is inf: hyper-parameters must be finite",
    field="trainer.hparams.lr",
    value=float("inf"),
)
case(
    "hparam-nan",
    "a hyper-parameter .nan",
    "hyper-parameter 'lr' is nan",
    field="trainer.hparams.lr",
    value=float("nan"),
)
case(
    "hparam-list",
    "a hyper-parameter that is a list",
    "hyper-parameter 'layers' must be a number, a string or true/false, got list",
    field="trainer.hparams.layers",
    value=[64, 32],
)
case(
    "hparam-mapping",
    "a hyper-parameter that is a mapping",
    "hyper-parameter 'opt' must be a number, a string or true/false, got dict",
    field="trainer.hparams.opt",
    value={"name": "sgd"},
)
case(
    "hparam-null",
    "a hyper-parameter without a value",
    "hyper-parameter 'seed' must be a number, a string or true/false, got NoneType",
    field="trainer.hparams.seed",
    value=None,
)
case(
    "hparam-bad-name",
    "a hyper-parameter named 'learning rate'",
    "hyper-parameter name 'learning rate' is not allowed",
    field="trainer.hparams.learning rate",
    value=0.1,
)
case(
    "hparam-huge-int",
    "a hyper-parameter 2**60 (not exact in the form's JSON)",
    "integers must be within +-2**53",
    field="trainer.hparams.epochs",
    value=2**60,
)
case(
    "evaluate-string",
    "evaluate: 'yes' (quoted)",
    "evaluate: must be true or false, got str 'yes'",
    field="evaluate",
    value="yes",
)

# --- malformed blocks ------------------------------------------------------------------------
case(
    "default-site-list",
    '"@default": [1, 2]',
    "sites.@default must be a mapping of settings every site shares, got list",
    field="sites.@default",
    value=[1, 2],
)
case(
    "site-launcher-spec-string",
    "launcher_spec: x in a site",
    "sites.site-1.launcher_spec must be a mapping of backend -> settings",
    field="sites.site-1.launcher_spec",
    value="x",
)
case(
    "top-launcher-spec-string",
    "a top-level launcher_spec: x",
    "launcher_spec must be a mapping of site name -> launcher blocks",
    field="launcher_spec",
    value="x",
)
case(
    "top-resource-spec-string",
    "a top-level resource_spec: x",
    "resource_spec must be a mapping of site name -> resources, got str",
    field="resource_spec",
    value="x",
)
case(
    "site-resource-spec-string",
    "resource_spec: x in a site",
    "sites.site-2.resource_spec must be a mapping of keys to values, got str 'x'",
    field="sites.site-2.resource_spec",
    value="x",
)
case(
    "default-resource-spec-list",
    "sites.@default.resource_spec a list",
    "sites.@default.resource_spec must be a mapping of keys to values, got list",
    field="sites.@default",
    value={"resource_spec": [1]},
)
case(
    "process-block-string",
    "launcher_spec: {process: x}",
    "sites.site-1.launcher_spec.process must be a mapping",
    field="sites.site-1.launcher_spec",
    value={"process": "x"},
)
case(
    "unknown-backend",
    "launcher_spec: {dockr: {}} (typo)",
    "unknown launcher backend 'dockr'; allowed: process, k8s",
    field="sites.site-1.launcher_spec",
    value={"dockr": {}},
)
case("sites-empty-list", "sites: []", "sites: a job needs at least one site", field="sites", value=[])
case("sites-empty-mapping", "sites: {}", "sites: a job needs at least one site", field="sites", value={})
case(
    "sites-only-default",
    "sites with only @default",
    "a job needs at least one site",
    field="sites",
    value={"@default": {"retries": 1}},
)
case(
    "sites-string",
    "sites: site-1",
    "sites must be a mapping of site name -> settings (or a list of site names), got str",
    field="sites",
    value="site-1",
)
case(
    "sites-list-duplicate",
    "sites: [site-1, site-1]",
    "sites: site 'site-1' is listed twice",
    field="sites",
    value=["site-1", "site-1"],
)
case("sites-list-numbers", "sites: [1, 2]", "a list of sites holds site names, got int 1", field="sites", value=[1, 2])
case(
    "site-value-number",
    "site-1: 5",
    "sites.site-1 must be a mapping of settings (or empty for the defaults), got int 5",
    field="sites.site-1",
    value=5,
)
case(
    "site-name-invalid",
    "a site named Site_1",
    "site name 'Site_1' cannot be a pod name",
    field="sites.Site_1",
    value={},
)
case(
    "site-name-number",
    "a site named 7 (a YAML integer key)",
    "sites.7.[key] (site 7): must be a string, got the number 7",
    field="sites.7",
    value={},
    text="int-key",
)
case(
    "trainer-number", "trainer: 5", "trainer: must be a mapping of keys to values, got int 5", field="trainer", value=5
)
case("trainer-missing", "no trainer block", "trainer: required field is missing", field="trainer", value="!delete")
case(
    "trainer-args-string",
    "trainer.args as one shell string",
    "arguments are never run through a shell",
    field="trainer.args",
    value="--lr 0.1",
)
case(
    "trainer-args-inf",
    "trainer.args holding .inf",
    "argument inf is not a finite number",
    field="trainer.args",
    value=[float("inf")],
)
case(
    "trainer-args-nul", "an argument with a NUL byte", "contains a NUL character", field="trainer.args", value=["a\0b"]
)
case("trainer-script-empty", "trainer.script: ''", "must name the trainer script", field="trainer.script", value="")
case(
    "trainer-script-missing",
    "a trainer script that does not exist",
    "trainer.script 'nope.py' does not exist",
    field="trainer.script",
    value="nope.py",
)
case(
    "unknown-top-key",
    "round: 3 (typo for rounds)",
    "unknown key 'round'; allowed keys: job, rounds",
    field="round",
    value=3,
)
case(
    "unknown-site-key",
    "retry: 1 in a site (typo for retries)",
    "sites.site-1.retry (site 'site-1'): unknown key 'retry'",
    field="sites.site-1.retry",
    value=1,
)
case(
    "top-block-unknown-site",
    "a top-level resource_spec for a site not in sites",
    "resource_spec names site 'site-9', which is not in sites (site-1, site-2)",
    field="resource_spec",
    value={"site-9": {"num_of_gpus": 0}},
)
case(
    "aggregator-unknown",
    "aggregator: {name: fedsgd}",
    "aggregator.name: must be 'fedavg', 'fedprox', 'fedavgm', 'fedadam', 'fedyogi', 'fedadagrad', 'median', "
    "'trimmed_mean', 'krum' or 'ffa_lora', got 'fedsgd'",
    field="aggregator.name",
    value="fedsgd",
)
case(
    "aggregator-beta-negative",
    "aggregator: {name: trimmed_mean, beta: -0.1}",
    "aggregator.beta: must be greater than or equal to 0, got -0.1",
    field="aggregator",
    value={"name": "trimmed_mean", "beta": -0.1},
)
case(
    "aggregator-beta-half",
    "aggregator: {name: trimmed_mean, beta: 0.5} (nothing left to average)",
    "aggregator.beta: must be less than 0.5, got 0.5",
    field="aggregator",
    value={"name": "trimmed_mean", "beta": 0.5},
)
case(
    "aggregator-beta-missing",
    "aggregator: {name: trimmed_mean} without beta",
    "aggregator: trimmed_mean needs 'beta' (the share of values cut at each end, 0 <= beta < 0.5)",
    field="aggregator",
    value={"name": "trimmed_mean"},
)
case(
    "aggregator-trimmed-quorum",
    "trimmed_mean with beta 0.4 and min_clients 1 (a round of 1 or 2 updates keeps nothing)",
    "aggregator: trimmed_mean with beta=0.4 cuts ceil(beta x 1) = 1 value(s) at each end of 1 update(s), "
    "leaving nothing to average",
    field="aggregator",
    value={"name": "trimmed_mean", "beta": 0.4},
)
case(
    "aggregator-krum-f-too-large",
    "aggregator: {name: krum, f: 1} for 2 sites (Krum needs n >= 2f + 3)",
    "aggregator: krum with f=1 needs n >= 2f + 3 = 5 valid updates, got 1; raise min_clients, add sites",
    field="aggregator",
    value={"name": "krum", "f": 1},
)
case(
    "aggregator-krum-f-negative",
    "aggregator: {name: krum, f: -1}",
    "aggregator.f: must be greater than or equal to 0, got -1",
    field="aggregator",
    value={"name": "krum", "f": -1},
)
case(
    "aggregator-foreign-parameter",
    "aggregator: {name: median, beta: 0.2} (a parameter of another strategy)",
    "aggregator: 'beta' is not a parameter of 'median' (it belongs to trimmed_mean); median takes norm_bound",
    field="aggregator",
    value={"name": "median", "beta": 0.2},
)
case(
    "aggregator-unknown-parameter",
    "aggregator: {name: fedadam, lr: 0.1} (not a parameter of any strategy)",
    "aggregator.lr: unknown key 'lr'; allowed keys: name, norm_bound, eta, exclude, beta_1, tau, beta_2",
    field="aggregator",
    value={"name": "fedadam", "lr": 0.1},
)
case(
    "aggregator-eta-negative",
    "aggregator: {name: fedadam, eta: -0.1}",
    "aggregator.eta: must be greater than 0, got -0.1",
    field="aggregator",
    value={"name": "fedadam", "eta": -0.1},
)
case(
    "aggregator-momentum-one",
    "aggregator: {name: fedavgm, momentum: 1.0} (diverges)",
    "aggregator.momentum: must be less than 1, got 1.0",
    field="aggregator",
    value={"name": "fedavgm", "momentum": 1.0},
)
case(
    "aggregator-norm-bound-zero",
    "aggregator: {name: median, norm_bound: 0}",
    "aggregator.norm_bound: must be greater than 0, got 0",
    field="aggregator",
    value={"name": "median", "norm_bound": 0.0},
)
case(
    "aggregator-exclude-empty",
    "aggregator: {name: fedyogi, exclude: ['']}",
    "aggregator.exclude: patterns must not be empty",
    field="aggregator",
    value={"name": "fedyogi", "exclude": [""]},
)
case(
    "aggregator-beta-1-one",
    "aggregator: {name: fedadam, beta_1: 1.0} (the first moment never moves)",
    "aggregator.beta_1: must be less than 1, got 1.0",
    field="aggregator",
    value={"name": "fedadam", "beta_1": 1.0},
)
case(
    "aggregator-beta-2-negative",
    "aggregator: {name: fedyogi, beta_2: -0.5}",
    "aggregator.beta_2: must be greater than or equal to 0, got -0.5",
    field="aggregator",
    value={"name": "fedyogi", "beta_2": -0.5},
)
case(
    "aggregator-beta-2-for-fedadagrad",
    "aggregator: {name: fedadagrad, beta_2: 0.99} (Adagrad sums, it has no second-moment decay)",
    "aggregator: 'beta_2' is not a parameter of 'fedadagrad' (it belongs to fedadam, fedyogi); fedadagrad takes "
    "eta, exclude, beta_1, tau, norm_bound",
    field="aggregator",
    value={"name": "fedadagrad", "beta_2": 0.99},
)
case(
    "aggregator-tau-zero",
    "aggregator: {name: fedadam, tau: 0} (a zero second moment would divide by zero)",
    "aggregator.tau: must be greater than 0, got 0",
    field="aggregator",
    value={"name": "fedadam", "tau": 0.0},
)
case(
    "aggregator-krum-m-zero",
    "aggregator: {name: krum, f: 0, m: 0}",
    "aggregator.m: must be greater than or equal to 1, got 0",
    field="aggregator",
    value={"name": "krum", "f": 0, "m": 0},
)
case(
    "aggregator-multi-krum-m-too-large",
    "aggregator: {name: krum, f: 0, m: 4} for min_clients 3 (Multi-Krum selects at most n - f)",
    "aggregator: krum with f=0 selects m=4 update(s), at most n - f = 3 of 3",
    text=BASE.replace("min_clients: 1", "min_clients: 3").replace("  site-2: {}\n", "  site-2: {}\n  site-3: {}\n")
    + "aggregator: {name: krum, f: 0, m: 4}\n",
)
case(
    "aggregator-exclude-string",
    "aggregator: {name: fedadam, exclude: 'bn.*'} (a string, not a list)",
    "aggregator.exclude: must be a list",
    field="aggregator",
    value={"name": "fedadam", "exclude": "bn.*"},
)
case(
    "aggregator-exclude-matches-nothing",
    "aggregator: {name: fedadam, exclude: ['bn.*']} for a model without such tensors (a typo)",
    "aggregator.exclude: pattern 'bn.*' matches no tensor of initial_model 'init.safetensors' (its tensors: bias, "
    "weight)",
    field="aggregator",
    value={"name": "fedadam", "exclude": ["weight", "bn.*"]},
)
case(
    "aggregator-mu-negative",
    "aggregator: {name: fedprox, mu: -1}",
    "aggregator.mu: must be greater than or equal to 0, got -1",
    field="aggregator",
    value={"name": "fedprox", "mu": -1.0},
)
case(
    "aggregator-fedprox-mu-twice",
    "aggregator fedprox and a trainer hyper-parameter fedprox_mu of its own",
    "trainer.hparams.fedprox_mu is 0.5, but with aggregator fedprox it comes from aggregator.mu",
    text=BASE.replace("{lr: 0.1, epochs: 2}", "{lr: 0.1, fedprox_mu: 0.5}") + "aggregator: {name: fedprox, mu: 0.1}\n",
)
case(
    "job-name-long",
    "a 10 000-character job name (the message stays short)",
    "job name 'xxxxxxxx",
    field="job",
    value="x" * 10000,
)

# --- what a run would refuse: schedule, store, initial model, environment ---------------------
case(
    "trigger-min-sites-above-sites",
    "trigger: {on_data: {min_sites: 3}} in a job of 2 sites",
    "trigger.on_data.min_sites is 3 but the job has only 2 site(s)",
    field="trigger",
    value={"on_data": {"min_sites": 3}},
)
case(
    "trigger-window-words",
    "trigger.on_data.window: 'one day'",
    "window 'one day' is not a duration: write a whole number and a unit",
    field="trigger",
    value={"on_data": {"min_sites": 2, "window": "one day"}},
)
case(
    "trigger-window-too-long",
    "trigger.on_data.window: 9999w",
    "is longer than a year",
    field="trigger",
    value={"on_data": {"min_sites": 2, "window": "9999w"}},
)
case(
    "trigger-wait-words",
    "trigger.on_data.wait: 'six hours'",
    "wait 'six hours' is not a duration: write a whole number and a unit",
    field="trigger",
    value={"on_data": {"min_sites": 2, "wait": "six hours"}},
)
case(
    "trigger-wait-not-within-window",
    "trigger.on_data.wait: 1d with window: 1d (the first announcement is stale when the wait expires)",
    "trigger.on_data.wait 1d is not shorter than the window 1d",
    field="trigger",
    value={"on_data": {"min_sites": 2, "wait": "1d", "window": "1d"}},
)
case(
    "trigger-fallback-once",
    "schedule: '@once' with trigger.on_data (the schedule is the data run's fallback)",
    "schedule @once with trigger.on_data: the schedule is the fallback",
    text=BASE + "schedule: '@once'\ntrigger: {on_data: {min_sites: 2}}\n",
)
case(
    "trigger-min-sites-zero",
    "trigger.on_data.min_sites: 0",
    "min_sites",
    field="trigger",
    value={"on_data": {"min_sites": 0}},
)
case(
    "trigger-unknown-kind",
    "trigger: {on_file: ...} (a kind of trigger that does not exist)",
    "on_file",
    field="trigger",
    value={"on_file": {"path": "x"}},
)
case(
    "schedule-words",
    "schedule: every monday",
    "schedule 'every monday' is not a cron expression",
    field="schedule",
    value="every monday",
)
case(
    "schedule-out-of-range", "schedule: '61 * * * *'", "is not a cron expression", field="schedule", value="61 * * * *"
)
case(
    "schedule-unknown-preset",
    "schedule: '@fortnightly'",
    "use five fields like '0 3 * * 1'",
    field="schedule",
    value="@fortnightly",
)
case("schedule-number", "schedule: 5", "schedule: must be a string, got the number 5", field="schedule", value=5)
case(
    "store-unknown-scheme",
    "store: s4://bucket (typo)",
    "unknown scheme 's4'; use a directory, file:///path",
    field="store",
    value="s4://bucket/fl",
)
case(
    "store-file-relative",
    "store: file://relative/dir",
    "a file:// URI needs an absolute path",
    field="store",
    value="file://relative/dir",
)
case("store-no-bucket", "store: s3:// without a bucket", "name the bucket or host", field="store", value="s3://")
case("store-empty", "store: ''", "store: must not be empty", field="store", value="")
case(
    "initial-model-missing",
    "initial_model names no file",
    "initial_model 'nope.safetensors' does not exist",
    field="initial_model",
    value="nope.safetensors",
)
case(
    "initial-model-directory",
    "initial_model is a directory",
    "initial_model 'jobs' is not a file",
    field="initial_model",
    value="jobs",
)
case(
    "initial-model-pickle",
    "initial_model is a torch.save pickle",
    "this is a pickle/torch.save payload",
    model=b"\x80\x04\x95\x10\x00\x00\x00\x00\x00\x00\x00}\x94.",
)
case(
    "initial-model-truncated",
    "initial_model cut short",
    "not a valid safetensors file",
    model=_safetensors({"w": np.ones(8, np.float32)})[:-5],
)
case(
    "initial-model-nan",
    "initial_model holds a NaN",
    "tensor 'w' has NaN or infinite values",
    model=_safetensors({"w": np.array([1.0, np.nan], np.float32)}),
)
case("initial-model-empty", "initial_model with no tensors", "holds no tensors", model=_safetensors({}))
case("initial-model-text", "initial_model is a text file", "not a valid safetensors file", model=b"weights: [1, 2]\n")
case(
    "env-name-equals",
    "a process env name A=B",
    "env: 'A=B' is not a valid environment variable name",
    field="sites.site-1.launcher_spec",
    value={"process": {"env": {"A=B": "x"}}},
)
case(
    "env-name-empty",
    "an empty process env name",
    "env: '' is not a valid environment variable name",
    field="sites.site-1.launcher_spec",
    value={"process": {"env": {"": "x"}}},
)
case(
    "env-name-nul",
    "a process env name with NUL",
    "is not a valid environment variable name",
    field="sites.site-1.launcher_spec",
    value={"process": {"env": {"A\0B": "x"}}},
)
case(
    "env-name-flare",
    "a process env FLARE_SITE (the Client API's)",
    "env: 'FLARE_SITE' is reserved",
    field="sites.site-1.launcher_spec",
    value={"process": {"env": {"FLARE_SITE": "x"}}},
)
case(
    "env-name-airflow",
    "a process env AIRFLOW__CORE__EXECUTOR",
    "'AIRFLOW__CORE__EXECUTOR' is reserved (FLARE_*, AIRFLOW*",
    field="sites.@default",
    value={"launcher_spec": {"process": {"env": {"AIRFLOW__CORE__EXECUTOR": "x"}}}},
)
case(
    "env-value-nul",
    "a process env value with NUL",
    "env.A contains a NUL character",
    field="sites.site-1.launcher_spec",
    value={"process": {"env": {"A": "x\0y"}}},
)
case(
    "env-value-number",
    "a process env value 1 (unquoted)",
    "env.OMP_NUM_THREADS (site 'site-1'): must be a string, got the number 1 (quote it: '1')",
    field="sites.site-1.launcher_spec",
    value={"process": {"env": {"OMP_NUM_THREADS": 1}}},
)
case(
    "gpu-pool-shared-with-two-sizes",
    "sites site-1 and site-2 share resource_manager pool 'gpu-host' with num_of_gpus 2 and 4",
    "sites.site-2.resource_manager.num_of_gpus is 4, but sites site-1 and site-2 share GPU pool 'gpu-host' and "
    "site site-1 declares 2",
    field="sites",
    value={
        name: {
            "resource_spec": {"num_of_gpus": 1},
            "resource_manager": {"type": "gpu", "num_of_gpus": gpus, "pool": "gpu-host"},
        }
        for name, gpus in (("site-1", 2), ("site-2", 4))
    },
)
case(
    "cwd-nul",
    "a process cwd with NUL",
    "cwd contains a NUL character",
    field="sites.site-1.launcher_spec",
    value={"process": {"cwd": "/data\0/x"}},
)

case(
    "tracking-unknown-backend",
    "tracking: {backend: wandb} (a tracker flare-airflow does not write to)",
    "unknown tracking backend 'wandb': use one of mlflow",
    field="tracking",
    value={"backend": "wandb"},
)
case(
    "tracking-uri-with-credentials",
    "tracking.uri with a user and password in it",
    "tracking.uri holds credentials (a user name or password before '@'); a job file must not",
    field="tracking",
    value={"backend": "mlflow", "uri": "https://alice:s3cr3t@mlflow.example.org"},
)
case(
    "tracking-uri-with-token",
    "tracking.uri with an access token as a query parameter",
    "tracking.uri holds credentials (the query parameter 'token')",
    field="tracking",
    value={"backend": "mlflow", "uri": "https://mlflow.example.org/?token=s3cr3t"},
)
case(
    "tracking-conn-id-as-uri",
    "tracking.conn_id written as a URI with credentials",
    "tracking.conn_id must be an Airflow connection id",
    field="tracking",
    value={"backend": "mlflow", "conn_id": "http://alice:s3cr3t@mlflow:5000"},
)
case(
    "tracking-conn-id-and-uri",
    "tracking with both conn_id and uri",
    "tracking: give conn_id (a server through an Airflow connection) or uri, not both",
    field="tracking",
    value={"backend": "mlflow", "conn_id": "mlflow", "uri": "http://mlflow:5000"},
)
case(
    "tracking-mlflow-option-without-mlflow",
    "tracking: {backend: tensorboard, register_model: digits} (an MLflow option, MLflow not asked for)",
    "tracking: conn_id, uri, experiment and register_model are MLflow's; add mlflow to tracking.backend",
    field="tracking",
    value={"backend": "tensorboard", "register_model": "digits"},
)
case(
    "tracking-backend-twice",
    "tracking: {backend: [mlflow, mlflow]}",
    "tracking.backend names a tracker twice",
    field="tracking",
    value={"backend": ["mlflow", "mlflow"]},
)


def _set(data: dict[str, Any], field: str, value: Any) -> None:
    *parents, last = field.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
    if value == "!delete":
        node.pop(last)
    else:
        node[last] = value


def build(job_dir: pathlib.Path, bad: Bad) -> pathlib.Path:
    (job_dir / "jobs").mkdir()
    (job_dir / "train.py").write_text("print('training')\n")
    (job_dir / "init.safetensors").write_bytes(bad.model if bad.model is not None else INITIAL_MODEL.read_bytes())
    path = job_dir / bad.path
    if bad.field is not None:
        data = yaml.safe_load(BASE)
        _set(data, bad.field, bad.value)
        text = yaml.safe_dump(data, sort_keys=False)
        if bad.value == "!date":
            text = text.replace("'!date'", "2024-01-01")
        if bad.text == "int-key":
            text = text.replace("'7':", "7:")
        path.write_text(text)
    elif isinstance(bad.text, bytes):
        path.write_bytes(bad.text)
    elif bad.text is not None:
        path.write_text(bad.text)
    elif bad.model is not None:
        path.write_text(BASE)
    return path


def validate(path: pathlib.Path) -> str:
    """What ``flare-airflow validate`` checks; returns the error message."""
    with pytest.raises(ConfigError) as info:
        job = load_job(path)
        load_initial_model(job)
        check_store_backend(job)
    return without_lines(path, str(info.value))


@pytest.mark.parametrize("bad_case", CASES, ids=lambda c: c.id)
def test_bad_job_file_gets_a_clear_error(bad_case: Case, tmp_path: pathlib.Path) -> None:
    path = build(tmp_path, INPUTS[bad_case.id])
    message = validate(path)
    assert_clear(bad_case, message)
    assert str(path.name) in message or "initial_model" in message, message
    assert len(message) < MAX_MESSAGE, f"{bad_case.id}: {len(message)}-character message"


def test_the_shipped_jobs_still_validate() -> None:
    for path in sorted((REPO / "dags").glob("*.yaml")):
        load_initial_model(load_job(path))


def test_the_alias_bomb_is_refused_quickly(tmp_path: pathlib.Path) -> None:
    import time

    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    assert len(BOMB) < 800
    started = time.monotonic()
    validate(path)
    assert time.monotonic() - started < 0.5


def test_aliases_within_bounds_still_work(tmp_path: pathlib.Path) -> None:
    text = BASE.replace("  site-1: {}\n  site-2: {}\n", "  site-1: &s {retries: 2}\n  site-2: *s\n")
    build(tmp_path, Bad(text=text))
    job = load_job(tmp_path / "job.yaml")
    assert [s.retries for s in job.sites.values()] == [2, 2]


@pytest.mark.parametrize("schedule", ["@daily", "@once", "@continuous", "@quarterly", "0 3 * * 1", "*/5 * * * *"])
def test_valid_schedules_are_accepted(tmp_path: pathlib.Path, schedule: str) -> None:
    build(tmp_path, Bad(field="schedule", value=schedule))
    assert load_job(tmp_path / "job.yaml").schedule == schedule


def test_a_store_conn_id_that_looks_like_credentials_is_not_echoed(tmp_path: pathlib.Path) -> None:
    path = build(tmp_path, Bad(field="store_conn_id", value="aws://AKIA:s3cr3t@"))
    message = validate(path)
    assert "store_conn_id" in message and "s3cr3t" not in message, message


@pytest.mark.parametrize(
    "tracking",
    [{"backend": "mlflow", "uri": "https://alice:s3cr3t@x"}, {"backend": "mlflow", "conn_id": "http://a:s3cr3t@x"}],
)
def test_tracking_credentials_are_not_echoed(tmp_path: pathlib.Path, tracking: dict[str, str]) -> None:
    message = validate(build(tmp_path, Bad(field="tracking", value=tracking)))
    assert "tracking" in message and "s3cr3t" not in message, message
