"""The ``FLARE_*`` environment variable names: one home for every name flare-airflow sets or reads.

Pure constants (no imports), so that the Client API in a site image, the site runner, the
launchers and the Airflow operators all spell each name the same way. Each constant is named
after its value, so a grep for the variable finds both.
"""

from __future__ import annotations

# ---------------------------------------------------------------- the Client API's launch environment
FLARE_JOB = "FLARE_JOB"
"""The job's name."""
FLARE_RUN_ID = "FLARE_RUN_ID"
"""The Airflow run id."""
FLARE_SITE = "FLARE_SITE"
"""The site's name."""
FLARE_ROUND = "FLARE_ROUND"
"""The current round (1-based)."""
FLARE_TOTAL_ROUNDS = "FLARE_TOTAL_ROUNDS"
"""The number of rounds in the run."""
FLARE_TASK = "FLARE_TASK"
"""``train`` or ``evaluate``."""
FLARE_GLOBAL_MODEL = "FLARE_GLOBAL_MODEL"
"""Path or URI of the global model the trainer starts from."""
FLARE_OUTPUT = "FLARE_OUTPUT"
"""Path or URI where the trainer's ``send()`` writes its update."""
FLARE_HPARAMS = "FLARE_HPARAMS"
"""JSON object of the trainer's hyper-parameters."""
FLARE_GLOBAL_SHA256 = "FLARE_GLOBAL_SHA256"
"""(Optional) the sha256 the global model must have; ``receive()`` checks it."""
FLARE_LORA = "FLARE_LORA"
"""(LoRA jobs) JSON of the job's ``lora`` block for the trainer, with the site's verified base model path."""
FLARE_HANDSHAKE = "FLARE_HANDSHAKE"
"""(Optional) a file ``receive()`` creates: the process launcher's launch-timeout handshake."""

FLARE_NVFLARE_PARAMS_EXCHANGE = "FLARE_NVFLARE_PARAMS_EXCHANGE"
"""(NVFlare compatibility) ``numpy`` or ``pytorch``: what ``nvflare.client.receive()`` hands the script."""
FLARE_NVFLARE_TRANSFER = "FLARE_NVFLARE_TRANSFER"
"""(NVFlare compatibility) ``FULL`` or ``DIFF``: DIFF sends a FULL update as its difference to the model received."""

CLIENT_API_VARS = (
    FLARE_JOB,
    FLARE_RUN_ID,
    FLARE_SITE,
    FLARE_ROUND,
    FLARE_TOTAL_ROUNDS,
    FLARE_TASK,
    FLARE_GLOBAL_MODEL,
    FLARE_OUTPUT,
    FLARE_HPARAMS,
)
"""The variables every launch sets for the Client API (the optional ones are not listed)."""

STORE_PATH_VARS = (FLARE_GLOBAL_MODEL, FLARE_OUTPUT)
"""Client API variables that hold model store locations."""

# ---------------------------------------------------------------- site task -> site runner
FLARE_SITE_JOB_SPEC = "FLARE_SITE_JOB_SPEC"
"""The site job (a ``SiteRun`` as JSON) the site runner runs."""
FLARE_SITE_SECRETS = "FLARE_SITE_SECRETS"
"""Resolved ``secret_env`` values (JSON) for the trainer's environment, kept out of the ``SiteRun``."""
FLARE_SITE_OWNERS = "FLARE_SITE_OWNERS"
"""``pid:start_time ...``: the processes whose end ends the site job (the task process and its supervisor)."""
FLARE_SITE_RESULT_FILE = "FLARE_SITE_RESULT_FILE"
"""A local file (outside the store) where the site runner leaves its failure reason for the site task."""
FLARE_SITE_NOISE_SECRET = "FLARE_SITE_NOISE_SECRET"  # noqa: S105 - a variable name
"""The site's noise secret for its privacy filters; the runner removes it before the trainer starts."""
FLARE_PRIVACY_LEDGER = "FLARE_PRIVACY_LEDGER"
"""(Optional, on a site's worker) the site's privacy ledger (default ``$AIRFLOW_HOME/flare/privacy-ledger.sqlite``)."""

# ---------------------------------------------------------------- launchers
FLARE_PROCESS_TREE = "FLARE_PROCESS_TREE"
"""The process launcher's job mark, inherited by every process a trainer starts."""
FLARE_GPU_LOCK_DIR = "FLARE_GPU_LOCK_DIR"
"""Host-wide directory of the local GPU allocator's lock files."""
FLARE_K8S_ALLOWED_HOST_PATHS = "FLARE_K8S_ALLOWED_HOST_PATHS"
"""Site policy on the worker: the host path prefixes pods may mount, ``':'``-separated."""
FLARE_SITE_CONFIG = "FLARE_SITE_CONFIG"
"""Site policy on the worker: the path of the site's policy file (``core/config/policy.py``)."""

# ---------------------------------------------------------------- trust (docs/threat-model.md)
FLARE_KEY_DIR = "FLARE_KEY_DIR"
"""A worker's key directory (its party's private keys), overriding Airflow's ``[flare] key_dir``."""
FLARE_SITE_KEYS = "FLARE_SITE_KEYS"
"""The consortium registry of public keys (a JWKS), overriding ``[flare] site_keys``: strict mode."""
FLARE_STORE_LINK_SECONDS = "FLARE_STORE_LINK_SECONDS"
"""Central side: how long a round's store links stay valid, overriding ``[flare] store_link_seconds``."""
FLARE_UPLOAD_STATE_DIR = "FLARE_UPLOAD_STATE_DIR"
"""Site worker: where it keeps the ids of its open resumable uploads (``core/store_resume.py``)."""
