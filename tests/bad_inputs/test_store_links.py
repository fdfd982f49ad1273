"""Bad-input battery, category "site_env": store links a site task is handed that it must not use
(issue 36, docs/model-store.md). Each is refused by the site before anything is staged or trained,
naming why; no store is needed (the refusal is the site's own check), so a stand-in presigner
makes the links.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.store import ModelStore
from flare_airflow.core.store_links import SiteLinks, mint_site_links
from flare_airflow.core.trust import CENTRAL, generate_keys
from flare_airflow.core.trust.keys import party_dir
from flare_airflow.core.trust.registry import Registry
from flare_airflow.core.trust.sealed import links_context, seal
from flare_airflow.operators.links import LINKS_KEY, open_site_links
from tests.bad_inputs.cases import Case, assert_clear

CASES = [
    Case("links-sealed-to-another-site", "site_env", "site-1's task finds site-2's sealed store links under its name",
         "is sealed to key site-2."),
    Case("links-of-last-round", "site_env", "last round's genuine store links replayed in this round's XCom",
         "does not open for this context: sealed for another job, run, round or party"),
    Case("links-expired", "site_env", "the round's store links expired before the site task ran (a late resume)",
         "the store links expired"),
    Case("links-in-clear", "site_env", "the XCom holds plain store links (not sealed to the site's box key)",
         "is not a sealed message"),
]  # fmt: skip


class Presigner:
    """A stand-in for boto3's presigner: the site's checks never reach the store."""

    def generate_presigned_url(self, method: str, Params: dict[str, Any], ExpiresIn: int) -> str:
        return f"https://store.invalid/{Params['Bucket']}/{Params['Key']}?m={method}&e={ExpiresIn}"


def _links(site: str, round_num: int, expires_in: int = 600) -> SiteLinks:
    return mint_site_links(
        Presigner(), ModelStore.from_uri("s3://flare/store"), job="demo", run_id="r", round_num=round_num, site=site,
        expires_in=expires_in, update_size=1000,
    )  # fmt: skip


def _sealed(keys: pathlib.Path, site: str, round_num: int, expires_in: int = 600) -> str:
    links = _links(site, round_num, expires_in)
    box = Registry.from_key_dir(keys).box_key(site)
    return seal(box.public, box.kid, links.to_json().encode(), context=links_context("demo", "r", round_num, site))


@pytest.mark.parametrize("bad_case", CASES, ids=[c.id for c in CASES])
def test_links_a_site_must_not_use_are_refused(bad_case: Case, tmp_path: pathlib.Path) -> None:
    keys = tmp_path / "keys"
    for party in ("site-1", "site-2", CENTRAL):
        generate_keys(party, party_dir(keys, party))
    entry: Any = {
        "links-sealed-to-another-site": lambda: _sealed(keys, "site-2", 2),
        "links-of-last-round": lambda: _sealed(keys, "site-1", 1),
        "links-expired": lambda: _sealed(keys, "site-1", 2, expires_in=-1),
        "links-in-clear": lambda: json.loads(_links("site-1", 2).to_json()),
    }[bad_case.id]()  # fmt: skip
    with pytest.raises(FlareAirflowError) as refused:
        open_site_links({LINKS_KEY: {"site-1": entry}}, job="demo", run_id="r", round_num=2, site="site-1",
                        key_dir=str(keys))  # fmt: skip
    assert_clear(bad_case, str(refused.value))
