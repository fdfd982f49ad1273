"""The client app's ``config_fed_client``: its one Client API executor becomes the job's trainer."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flare_airflow.nvflare.configs import Component, ConfigFile, Where
from flare_airflow.nvflare.filters import read_filters
from flare_airflow.nvflare.paths import plain_name, relative_inside
from flare_airflow.nvflare.reading import Reading, known_or_refused

CLIENT_API_EXECUTOR = "ClientAPIExecutor"  # 2.9: execution_mode in_process | external_process
IN_PROCESS_EXECUTORS = {"InProcessClientAPIExecutor", "PTInProcessClientAPIExecutor"}  # 2.5-2.8
LAUNCHER_EXECUTORS = {"ClientAPILauncherExecutor", "PTClientAPILauncherExecutor"}  # 2.5-2.8
LAUNCHERS = {"SubprocessLauncher"}
SUPPORTED_TRANSFER = ("FULL", "DIFF")
EXCHANGE_FORMATS = {"numpy": "numpy", "pytorch": "pytorch"}


def _split(line: str) -> list[str] | None:
    """A command line's words as a POSIX shell splits them; None when it cannot (an unclosed quote)."""
    try:
        return shlex.split(line)
    except ValueError:
        return None


def _script_of_command(command: str | list[str]) -> tuple[str, list[str]] | None:
    """``python3 -u custom/train.py --epochs 2`` -> (``custom/train.py``, ``["--epochs", "2"]``)."""
    tokens = (_split(command) or []) if isinstance(command, str) else [str(t) for t in command]
    for index, token in enumerate(tokens):
        if token.endswith(".py"):
            return token, tokens[index + 1 :]
    return None


@dataclass
class Trainer:
    script: str  # relative to the client app's custom/ folder
    args: list[str]
    exchange: str
    transfer: str
    where: Where


def _custom_relative(script: str) -> str | None:
    """Where NVFlare finds the script in the app: ``custom/x.py``, or the exporting machine's
    absolute path of a file the Job API copied into ``custom/`` (its name); None when the path
    climbs out of ``custom/`` (``../..``)."""
    relative = Path(script).name if script.startswith("/") else script.removeprefix("custom/")
    return relative if relative_inside(relative) and plain_name(Path(relative).name) else None


def _executor_trainer(
    executor: Component, components: dict[str, Component], used: set[str], reading: Reading
) -> Trainer | None:
    """The trainer of a Client API executor (2.9's ClientAPIExecutor, 2.5-2.8's in-process or launcher one)."""
    args = executor.args
    name = executor.class_name
    exchange = str(args.get("params_exchange_format", "numpy")).lower()
    if exchange not in EXCHANGE_FORMATS:
        reading.refuse(
            executor.where,
            f"params_exchange_format {exchange!r}",
            "flare-airflow exchanges tensors (numpy arrays or torch tensors) through safetensors",
            "use params_exchange_format numpy or pytorch",
        )
        return None
    transfer = str(args.get("params_transfer_type", "FULL")).upper()
    if transfer not in SUPPORTED_TRANSFER:
        reading.refuse(executor.where, f"params_transfer_type {transfer!r}", "unknown", "use FULL or DIFF")
        return None
    launch_once = bool(args.get("launch_once", True))
    where = executor.where
    if (name == CLIENT_API_EXECUTOR and args.get("execution_mode") == "external_process") or name in LAUNCHER_EXECUTORS:
        if name == CLIENT_API_EXECUTOR:
            command: Any = args.get("command")
        else:
            launcher_id = str(args.get("launcher_id", "launcher"))
            launcher = components.get(launcher_id)
            used.add(launcher_id)
            if launcher is None or launcher.class_name not in LAUNCHERS:
                reading.refuse(
                    launcher.where if launcher else executor.where,
                    f"launcher {launcher.path if launcher else launcher_id!r}",
                    "only NVFlare's SubprocessLauncher (a script command line) is carried over",
                    "launch the client script with SubprocessLauncher, or use ScriptRunner",
                )
                return None
            command, where = launcher.args.get("script"), launcher.where
            launch_once = bool(launcher.args.get("launch_once", launch_once))
        parsed = _script_of_command(command) if isinstance(command, str | list) else None
        if parsed is None:
            reading.refuse(
                where,
                f"command {command!r}",
                "no Python script in the command line",
                "the client must run `python custom/<script>.py ARGS`",
            )
            return None
        script, script_args = parsed
    elif name == CLIENT_API_EXECUTOR and args.get("execution_mode", "in_process") != "in_process":
        reading.refuse(
            executor.where,
            f"execution_mode {args.get('execution_mode')!r}",
            "unknown",
            "use in_process or external_process",
        )
        return None
    else:
        path = args.get("task_script_path")
        if not isinstance(path, str) or not path:
            reading.refuse(executor.where, executor.path, "no task_script_path", "name the client script")
            return None
        script = path
        split_args = _split(str(args.get("task_script_args") or ""))
        if split_args is None:
            reading.refuse(executor.where, "task_script_args", "an unclosed quote", "close the quote")
            return None
        script_args = split_args
    if launch_once:
        reading.note(
            where,
            "launch_once",
            "NVFlare runs the client script once for all rounds; flare-airflow runs it once per round "
            "(state kept in memory across rounds starts afresh each round)",
        )
    relative = _custom_relative(script)
    if relative is None:
        reading.refuse(
            where,
            f"client script {script[:120]!r}",
            "it lies outside the client app's custom/ folder",
            "put the script in custom/ and name it custom/<script>.py",
        )
        return None
    return Trainer(relative, script_args, EXCHANGE_FORMATS[exchange], transfer, where)


def read_client(cfg: ConfigFile, reading: Reading) -> tuple[Trainer | None, list[dict[str, Any]]]:
    components = {c.id: c for c in cfg.components("components")}
    used: set[str] = set()
    trainer: Trainer | None = None
    executors = cfg.data.get("executors") or []
    if not isinstance(executors, list) or not executors:
        reading.refuse(cfg.path, "executors", "the client config has no executor", "add a Client API executor")
        return None, []
    for index, entry in enumerate(executors):
        raw = entry.get("executor") if isinstance(entry, Mapping) else None
        executor = cfg.component(raw, f"executors[{index}].executor")
        tasks = entry.get("tasks", ["*"]) if isinstance(entry, Mapping) else []
        if executor.class_name not in {CLIENT_API_EXECUTOR} | IN_PROCESS_EXECUTORS | LAUNCHER_EXECUTORS:
            reading.refuse(
                executor.where,
                f"executor {executor.path} (tasks {tasks})",
                "only NVFlare's Client API executors (ScriptRunner's) are carried over",
                "rewrite the executor's work as a Client API script (flare.receive()/flare.send()) "
                "and use ScriptRunner",
            )
            continue
        if trainer is not None:
            reading.refuse(
                executor.where,
                f"executor {executor.path} (tasks {tasks})",
                "a second Client API executor: flare-airflow runs one trainer script per job",
                "keep one executor for the train task",
            )
            continue
        trainer = _executor_trainer(executor, components, used, reading)
    filters = read_filters(cfg, reading, client=True)
    for cid, component in components.items():
        if cid not in used:  # the launcher was carried over (or refused) with its executor
            known_or_refused(component, reading)
    return trainer, filters
