"""What the site task checks around the trainer, and what it leaves when a site job fails.

Before the launch, the input global model against its record; after it, what the trainer sent:
an update must exist, be safetensors with a valid checksum, and match the global model's names,
shapes and dtypes with finite values. Only then is it published. A failed job leaves a failure
record next to the update (:mod:`flare_airflow.core.failure_record`), read by the aggregation
task to say why the site did not count.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pathlib
import stat
from typing import Any, cast

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import (
    MAX_RECORD_BYTES,
    WritablePath,
    failure_path,
    path_from_uri,
    read_at_most,
    record_path,
)
from flare_airflow.site_task.spec import SiteRun
from flare_airflow.site_task.tries import publish_current_try


class SentFileRefused(FlareAirflowError):
    """What the trainer left is not a regular file of its own in its staging directory."""


class GlobalModelUnusable(FlareAirflowError):
    """The input global model is missing or does not match its record: the trainer is not started."""


class BaseModelRefused(FlareAirflowError):
    """A LoRA job's base model at this site is missing or is not the one the job pins: no training."""


def check_base_model(run: SiteRun) -> None:
    """Hash the site's base model and compare it with the job's ``lora.base_model.sha256``.

    Adapters trained on another base model would be averaged with the others' as if they fitted the
    same weights: the site is refused before its trainer starts, saying which file and which digests.
    """
    if run.lora is None:
        return
    path = pathlib.Path(str(run.lora["base_model"]))
    expected = str(run.lora["base_model_sha256"])
    where = f"site {run.site} round {run.round}: the base model {path}"
    digest = hashlib.sha256()
    try:
        with path.open("rb") as fh:
            while chunk := fh.read(1 << 20):
                digest.update(chunk)
    except OSError as exc:
        raise BaseModelRefused(
            f"{where} cannot be read ({exc.strerror or exc}); put the job's base model there (sites.{run.site}."
            "base_model or lora.base_model.file); the trainer was not started"
        ) from None
    if digest.hexdigest() != expected:
        raise BaseModelRefused(
            f"{where} has sha256 {digest.hexdigest()[:16]}…, but the job pins {expected[:16]}… "
            f"(lora.base_model.sha256): this site holds a different base model, and adapters trained on it "
            f"would not fit the others'; install the job's base model at sites.{run.site}.base_model; "
            "the trainer was not started"
        )


def model_fingerprint(run: SiteRun) -> tuple[tuple[int, int, int], ...] | None:
    """(inode, size, mtime) of the global model and its record on a local store, else ``None``.

    After the trainer ran, an unchanged fingerprint proves the files were neither rewritten nor
    replaced, without hashing the model a second time (it was hashed before the launch).
    """
    path = path_from_uri(run.global_model)
    if not isinstance(path, pathlib.Path):
        return None
    try:
        record: Any = record_path(cast(Any, path))
        stats = (path.stat(), record.stat())
    except OSError:
        return None
    return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)


def check_global_model(run: SiteRun) -> None:
    """Verify the round's input global model against its record (size and sha256) before launching.

    Hashes the file with the standard library only (the update check's numpy loads later, while
    the trainer starts). Raises :class:`GlobalModelUnusable` saying what is wrong and what to do.
    """
    path = path_from_uri(run.global_model)
    record = record_path(path)
    where = f"site {run.site} round {run.round}: the input global model {run.global_model}"
    rerun = f"re-run the task that published it (round {run.round - 1}'s global model, or check initial_model)"
    if not path.exists():
        raise GlobalModelUnusable(f"{where} does not exist; {rerun}")
    if not record.exists():
        raise GlobalModelUnusable(f"{where} has no record {record.name} (never completed); {rerun}")
    try:
        with record.open("rb") as fh:
            text = read_at_most(fh, MAX_RECORD_BYTES)
        if len(text) > MAX_RECORD_BYTES:
            raise ValueError(f"more than {MAX_RECORD_BYTES} bytes")
        raw = json.loads(text)
        expected, size = str(raw["sha256"]), int(raw["size"])
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise GlobalModelUnusable(
            f"{where}: its record {record.name} is corrupted ({type(exc).__name__}); {rerun}"
        ) from None
    if run.global_sha256 and expected != run.global_sha256:
        raise GlobalModelUnusable(
            f"{where} is not the one its producer published (its record says sha256 {expected[:12]}…, the "
            f"producer's XCom {run.global_sha256[:12]}…): it was replaced; {rerun}"
        )
    digest = hashlib.sha256()
    got = 0
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
            got += len(chunk)
    if got != size or digest.hexdigest() != expected:
        raise GlobalModelUnusable(
            f"{where} does not match its record ({got} bytes, sha256 {digest.hexdigest()[:12]}…; the record says "
            f"{size} bytes, {expected[:12]}…): it was changed or corrupted after it was written; {rerun}"
        )


def budget_refusal(run: SiteRun) -> str | None:
    """Why the site's privacy budget (its ledger, every job and run) refuses this run's release
    before its trainer starts, or ``None`` when it may run."""
    from flare_airflow.core.privacy.filters import PrivacyRefused
    from flare_airflow.core.privacy.plan import PrivacyPlan, check_budget

    if run.privacy is None or run.task != "train":
        return None
    try:
        check_budget(PrivacyPlan.from_dict(run.privacy), run.site, job=run.job, run_id=run.run_id, round_num=run.round)
    except PrivacyRefused as exc:
        return f"round {run.round}: {exc}"
    return None


def clear_outputs(output: WritablePath) -> None:
    """Remove a previous try's result so that a re-run overwrites only this site's round."""
    for path in (output, record_path(output), failure_path(output)):
        path.unlink(missing_ok=True)


def check_result(run: SiteRun, output: WritablePath, noise_secret: str | None = None) -> dict[str, Any]:
    """Verify what the trainer sent, apply the site's privacy plan and publish it at ``output``;
    raise ``FlareAirflowError`` with the reason if it is unusable or may not leave the site.

    The trainer wrote into its try's staging directory (``run.staging``); only an update that
    passed every check is moved to ``output``, so a failed, killed or late trainer never leaves a
    published update, and it cannot overwrite one either. However the trainer wrote it (the
    Client API or the file directly), the plan's filters run here, after the trainer ended.
    ``noise_secret``: the site's secret that keys the noise of the plan's gaussian filters.
    """
    from flare_airflow.core.aggregation.update_reader import validate_update
    from flare_airflow.core.model import read_artifact, read_record

    sent = path_from_uri(run.staging) if run.staging else output
    if not record_path(sent).exists():
        raise FlareAirflowError(
            f"the trainer exited successfully but sent no {'update' if run.task == 'train' else 'result'} "
            "(did it call flare.send()?)"
        )
    check_sent_files(run, sent)
    params, record = read_artifact(sent)
    privacy = None
    if run.task == "train":
        # The global model's record has every tensor's dtype and shape: no need to read its weights.
        validate_update(run.site, read_record(path_from_uri(run.global_model)).tensors, params)
        if run.privacy is not None:
            record, privacy = apply_privacy(run, sent, params, record, noise_secret)
    del params
    # Signed before publishing: an update the site cannot sign (its key missing) never leaves.
    summary = published_summary(run, record, privacy)
    if run.staging:
        publish_current_try(sent, output)
    return summary


def published_summary(run: SiteRun, record: Any, privacy: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a site task returns (XCom) for the update at ``run.output`` whose record was verified:
    its summary, its privacy report, and -- where the site signs -- its signed record. The site
    task that published it and a cleared sensor that finds it published report the same."""
    summary = update_summary(run, record)
    if privacy is not None:
        summary["privacy"] = privacy
    if run.trust is not None and run.task == "train":
        summary["signed"] = sign_update(run, record, summary)
        summary = seal_report(run, summary)
    return summary


def seal_report(run: SiteRun, summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with its counts, metrics, privacy report and signed record sealed to the
    aggregation's (central) box key: XCom is readable by every site task of the run.

    Strict mode only (a registry is configured): there a missing central box key refuses the
    update (nothing of the site's leaves in clear). On one machine -- no registry, every party's
    keys in one directory of one user -- sealing would hide nothing from anyone, and the summary
    stays in clear as before.
    """
    import json

    from flare_airflow.core.trust import CENTRAL, TrustError, UnknownSigner
    from flare_airflow.core.trust.sealed import REPORT_FIELDS, REPORT_KEY, report_context, seal
    from flare_airflow.core.trust.settings import TrustSettings

    assert run.trust is not None
    settings = TrustSettings.from_dict(run.trust)
    if not settings.strict:
        return summary
    try:
        box = settings.registry().box_key(CENTRAL)
    except UnknownSigner as exc:
        raise TrustError(
            f"site {run.site} round {run.round}: the update's report cannot be sealed to the aggregation, so it "
            f"is not published: {exc} (keys made before box keys existed: `flare-airflow central keygen --rotate`)"
        ) from None
    report = {name: summary.pop(name) for name in REPORT_FIELDS if name in summary}
    text = json.dumps(report, sort_keys=True, separators=(",", ":")).encode()
    bound = report_context(run.job, run.run_id, run.round, run.site)
    summary[REPORT_KEY] = seal(box.public, box.kid, text, context=bound)
    return summary


def sign_update(run: SiteRun, record: Any, summary: dict[str, Any]) -> dict[str, Any]:
    """The site's signed record of the update it publishes: identity, try, digests, samples, privacy, trainer.

    Signs the record that already carries the digests (no second hash of the update); the
    aggregation verifies it against the registry (docs/threat-model.md).
    """
    from flare_airflow.core.trust import sign_record, update_payload
    from flare_airflow.core.trust.records import trainer_digest
    from flare_airflow.core.trust.settings import TrustSettings

    assert run.trust is not None
    kid, key = TrustSettings.from_dict(run.trust).signing_key(run.site)
    payload = update_payload(
        job=run.job,
        run_id=run.run_id,
        round_num=run.round,
        site=run.site,
        try_number=run.try_number,
        size=record.size,
        sha256=summary["sha256"],
        blake3=summary["blake3"],
        num_samples=summary["num_samples"],
        params_type=summary["params_type"],
        privacy=summary.get("privacy"),
        trainer=trainer_digest(run.argv),
    )
    return sign_record(payload, kid, key)


def check_sent_files(run: SiteRun, sent: WritablePath) -> None:
    """Refuse an update or record that is not a regular file the trainer wrote in its own directory.

    A trainer (or a pod, or a container: every backend's result comes through here) could leave
    ``update.safetensors`` as a symbolic link to the round's input global model, or to any file it
    can read, with a matching record, and have it counted; or a hard link to such a file, or a FIFO
    that blocks the reader. So each is opened without following a final link (``O_NOFOLLOW``,
    ``O_NONBLOCK`` for FIFOs), must be a regular file with one link, and its resolved path must be
    its directory's own entry: a symlinked staging directory is refused too. Object stores have
    no links: only local paths are checked.
    """
    if not isinstance(sent, pathlib.Path):
        return
    where = f"site {run.site} round {run.round}"
    what = "update" if run.task == "train" else "result"
    directory = sent.parent
    try:
        if not stat.S_ISDIR(os.lstat(directory).st_mode):
            raise SentFileRefused(
                f"{where}: the trainer's output directory {directory} is not a directory (a symbolic link?); "
                f"the {what} is not published"
            )
    except OSError as exc:
        raise SentFileRefused(
            f"{where}: cannot inspect the trainer's output directory {directory}: {exc.strerror}"
        ) from None
    home = os.path.realpath(directory)
    for path in (sent, record_path(sent)):
        refused = (
            f"{where}: the trainer's {what} file {path} {{}}; it must be a regular file the trainer wrote "
            f"in {directory}; not published"
        )
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SentFileRefused(refused.format(f"is a symbolic link (to {os.readlink(path)!r})")) from None
            raise SentFileRefused(refused.format(f"cannot be opened ({exc.strerror})")) from None
        try:
            info = os.fstat(fd)
        finally:
            os.close(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SentFileRefused(refused.format("is not a regular file"))
        if info.st_nlink != 1:
            raise SentFileRefused(refused.format(f"has {info.st_nlink} hard links (a link to another file)"))
        if os.path.realpath(path) != os.path.join(home, path.name):
            raise SentFileRefused(refused.format("resolves outside its directory"))


def apply_privacy(
    run: SiteRun, sent: WritablePath, params: Any, record: Any, noise_secret: str | None
) -> tuple[Any, dict[str, Any]]:
    """Filter the sent update by the site's privacy plan and write the release over it (same place).

    Returns the release's record and the privacy report (filters applied, the site's ε). Raises
    ``PrivacyRefused`` (fail closed) when something may not leave, or the update turned non-finite.
    """
    from flare_airflow.core.aggregation.update_reader import validate_update
    from flare_airflow.core.model import FLModel, ParamsType, read_artifact, write_artifact
    from flare_airflow.core.privacy.filters import PrivacyRefused, noise_key
    from flare_airflow.core.privacy.plan import PrivacyPlan, charge_release, release
    from flare_airflow.core.privacy.secret import set_on_site_worker

    assert run.privacy is not None
    plan = PrivacyPlan.from_dict(run.privacy)
    where = f"site {run.site} round {run.round}"
    key = None
    if plan.adds_noise:
        if not noise_secret:
            raise PrivacyRefused(
                f"{where}: the site's privacy plan adds noise but its noise secret (Airflow variable "
                f"{plan.noise_secret_variable!r}) was not available on this worker; the update is not published. "
                f"Create it: {set_on_site_worker(plan.noise_secret_variable)}"
            )
        key = noise_key(noise_secret.encode(), run.job, run.run_id, run.round, run.site)
    global_params, _ = read_artifact(path_from_uri(run.global_model))
    out = release(
        plan,
        params,
        global_params,
        diff_update=record.params_type is ParamsType.DIFF,
        metrics=record.metrics,
        meta=record.meta,
        round_num=run.round,
        key=key,
        where=where,
        # The strategy's frozen tensors (FFA-LoRA's A): checked unchanged, then left out of clip and noise.
        frozen=tuple((run.lora or {}).get("frozen") or ()),
    )
    try:
        validate_update(run.site, record.tensors, out.params)
    except FlareAirflowError as exc:
        raise PrivacyRefused(f"{where}: after the privacy filters: {exc}") from None
    # Charged at the site before it is published: a release that would cross the site's budget never leaves.
    charge_release(plan, out.report, site=run.site, job=run.job, run_id=run.run_id, round_num=run.round)
    meta = {**out.meta, "privacy": out.report}
    if record.num_samples is not None:
        meta["num_samples"] = record.num_samples
    new_record = write_artifact(
        sent, FLModel(params=out.params, params_type=record.params_type, metrics=out.metrics, meta=meta), where=where
    )
    return new_record, out.report


def update_summary(run: SiteRun, record: Any) -> dict[str, Any]:
    """What a site task returns (XCom) for an update whose record ``read_artifact`` just verified."""
    from flare_airflow.core.digests import BLAKE3, available

    return {
        "site": run.site,
        "round": run.round,
        "task": run.task,
        "uri": run.output,
        "sha256": record.sha256,
        # read_artifact verified it (when installed here): the aggregation may then check the file by it.
        "blake3": record.blake3 if BLAKE3 in available() else None,
        "num_samples": record.num_samples,
        "params_type": record.params_type.value,
        "metrics": record.metrics,
    }
