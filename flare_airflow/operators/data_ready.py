"""A site announces fresh data, at the site: the asset event a data-driven job waits for.

:class:`DataReadyOperator` is the task a site puts at the end of its own ETL DAG (it runs on the
site's queue, so on the site's worker, with the site's key); ``flare-airflow site data-ready`` does
the same from the site's shell through the REST API. Both sign the announcement with the site's key
(:mod:`flare_airflow.core.data_ready`): the run's ``prepare`` counts only what a site signed for
itself.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from airflow.sdk import Asset, BaseOperator, Context
from airflow.sdk.exceptions import AirflowFailException

from flare_airflow.core.data_ready import SITE_DATA_ASSET, AnnouncementError, data_payload
from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.trust import TrustError, sign_record
from flare_airflow.operators.trust import trust_settings


def site_data_asset() -> Asset:
    """The sites' data announcements: one asset, one partition per site (its name)."""
    return Asset(name=SITE_DATA_ASSET)


class UnsignedAnnouncement(FlareAirflowError):
    """An announcement nobody could prove (no registry, no signature): it does not count."""


def announcement_verifier(log: Any) -> Any:
    """``verify(signed, site) -> payload`` for :func:`~flare_airflow.core.data_ready.fresh_sites`:
    the deployment's trust settings and key registry, read once."""
    settings = trust_settings()
    registry = settings.registry()

    def verify(signed: Any, site: str) -> dict[str, Any]:
        payload, note = settings.verify(
            signed, party=site, expect={"type": "data", "site": site}, what=f"site {site!r}'s data announcement",
            registry=registry,
        )  # fmt: skip
        if payload is None:
            log.warning("%s", note)
            raise UnsignedAnnouncement(str(note))
        return payload

    return verify


def signed_announcement(site: str, version: str, samples: int | None, *, create_key: bool) -> dict[str, Any]:
    """The event's extra: what the site announces, and its signature over it.

    ``create_key``: make the site's key on first use (a task in the one-machine deployment);
    the CLI never does -- an announcement is made with a key the site made and enrolled.
    """
    from pathlib import Path

    from flare_airflow.core.trust.keys import signing_key_for

    settings = trust_settings()
    payload = data_payload(site=site, version=version, samples=samples, announced_at=dt.datetime.now(dt.UTC))
    kid, key = signing_key_for(Path(settings.key_dir), site, create=create_key and not settings.strict)
    return {**{k: v for k, v in payload.items() if k != "type"}, "signed": sign_record(payload, kid, key)}


class DataReadyOperator(BaseOperator):
    """Announce that ``site`` has fresh data: version ``version`` with ``samples`` samples.

    Put it after the site's ETL in the site's own DAG. It runs on the site's queue (``queue``,
    default the site's name) and signs with the key of the worker that runs it, so it can only
    announce for the site whose worker that is.

    :param site: the site's name, as in the jobs it takes part in.
    :param version: the data's version (templated), e.g. ``{{ ds }}`` or an export's id.
    :param samples: the number of samples (templated), or None.
    """

    template_fields = ("version", "samples")
    ui_color = "#d4f1d4"

    def __init__(self, *, site: str, version: str, samples: int | str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("queue", site)
        kwargs.setdefault("outlets", [site_data_asset()])
        super().__init__(**kwargs)
        self.site = site
        self.version = version
        self.samples = samples

    def execute(self, context: Context) -> dict[str, Any]:
        samples = self.samples
        if isinstance(samples, str):
            samples = int(samples) if samples.strip().isdigit() else samples  # a rendered template
        try:
            extra = signed_announcement(self.site, str(self.version), samples, create_key=True)  # type: ignore[arg-type]
        except (AnnouncementError, TrustError) as exc:
            raise AirflowFailException(f"site {self.site!r} cannot announce its data: {exc}") from None
        for asset in self.outlets:
            if isinstance(asset, Asset) and asset.name == SITE_DATA_ASSET:
                event = context["outlet_events"][asset]
                event.add_partitions(self.site)
                event.extra = extra
        self.log.info("site %s announced data %s (%s samples)", self.site, extra["version"], extra["samples"])
        return {k: v for k, v in extra.items() if k != "signed"}


def announce_via_api(site: str, version: str, samples: int | None, conn_id: str | None = None) -> dict[str, Any]:
    """Sign the announcement with this worker's key of ``site`` and post it as the asset event.

    The REST API is reached through the http connection ``flare_airflow_api`` (as the pools
    check does). Raises ``AnnouncementError`` / ``TrustError`` with what to do.
    """
    from flare_airflow.core.trust import KeyMissing
    from flare_airflow.hooks.pools import API_CONN_ID, api_client

    try:
        extra = signed_announcement(site, version, samples, create_key=False)
    except KeyMissing as exc:
        raise AnnouncementError(
            f"this worker cannot announce data for site {site!r}: a site announces only for itself, signed with its "
            f"own key ({exc})"
        ) from None
    with api_client(conn_id or API_CONN_ID, what=f"announce site {site!r}'s data") as call:
        found = call("GET", "/api/v2/assets", params={"name_pattern": SITE_DATA_ASSET, "limit": 10})
        found.raise_for_status()
        ids = [a["id"] for a in found.json().get("assets", []) if a.get("name") == SITE_DATA_ASSET]
        if not ids:
            raise AnnouncementError(
                f"Airflow has no asset {SITE_DATA_ASSET!r}: no job with trigger.on_data is deployed there yet"
            )
        resp = call("POST", "/api/v2/assets/events", json={"asset_id": ids[0], "partition_key": site, "extra": extra})
        if resp.status_code >= 400:
            raise AnnouncementError(f"the Airflow API refused the announcement ({resp.status_code}: {resp.text[:200]})")
    return extra
