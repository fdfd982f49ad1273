"""Store links (core/store_links.py) without a store: their format, their checks, their limits."""

from __future__ import annotations

import math

import pytest

from flare_airflow.core.store import ModelStore
from flare_airflow.core.store_links import LinksError, SiteLinks, Upload, bucket_key, mint_site_links, upload


class Presigner:
    def __init__(self) -> None:
        self.opened: list[str] = []

    def generate_presigned_url(self, method: str, Params: dict, ExpiresIn: int) -> str:
        return f"https://s3.invalid/{Params['Bucket']}/{Params['Key']}?m={method}&p={Params.get('PartNumber', '')}"

    def create_multipart_upload(self, Bucket: str, Key: str) -> dict:
        self.opened.append(Key)
        return {"UploadId": "u1"}


def test_bucket_and_key_of_an_airflow_object_storage_uri_with_its_connection() -> None:
    assert bucket_key("s3://site_store@flare/store/j/r/x.json") == ("flare", "store/j/r/x.json")
    assert bucket_key("s3://flare/x") == ("flare", "x")


def test_beyond_one_put_the_update_is_a_multipart_upload_with_enough_parts() -> None:
    client = Presigner()
    store = ModelStore.from_uri("s3://flare/store")
    links = mint_site_links(
        client, store, job="j", run_id="r", round_num=3, site="site-1", expires_in=60,
        update_size=20 << 20, single_put_limit=8 << 20, part_size=5 << 20,
    )  # fmt: skip
    assert links.update.url is None and client.opened == [bucket_key(store.site_update("j", "r", 3, "site-1"))[1]]
    assert links.update.capacity is not None and links.update.capacity >= (20 << 20) + (1 << 20)
    assert "round-0002/global.safetensors" in links.global_model  # round 3 reads round 2's global model
    assert SiteLinks.from_json(links.to_json(), "x") == links


def test_an_update_larger_than_its_links_can_carry_is_refused_before_any_byte(tmp_path) -> None:
    big = tmp_path / "u.safetensors"
    big.write_bytes(b"x" * 100)
    with pytest.raises(LinksError, match="100 bytes, more than the 64"):
        upload(Upload(parts=["https://s3.invalid/a"], complete="https://s3.invalid/c", part_size=64), big, "update")


def test_garbage_links_and_links_of_other_schemes_are_refused(tmp_path) -> None:
    with pytest.raises(LinksError, match="not a site's store links"):
        SiteLinks.from_json('{"job": "j"}', "XCom")
    local = tmp_path / "u"
    local.write_bytes(b"1")
    with pytest.raises(LinksError, match="must be http"):
        upload(Upload(url="file:///etc/passwd"), local, "update")


def test_a_multipart_upload_gets_one_listing_link_per_thousand_parts() -> None:
    """What a resumed writer needs to learn which parts arrived: ListParts pages of 1,000 parts."""
    client = Presigner()
    store = ModelStore.from_uri("s3://flare/store")
    links = mint_site_links(
        client, store, job="j", run_id="r", round_num=1, site="site-1", expires_in=60,
        update_size=12 << 30, single_put_limit=8 << 20, part_size=1 << 20,
    )  # fmt: skip
    parts = len(links.update.parts)
    assert links.update.part_size == 5 << 20 and parts == 2_458  # S3's smallest part: (12 GiB + 1 MiB) / 5 MiB
    assert len(links.update.listings) == math.ceil(parts / 1_000)
    assert all("m=list_parts" in url for url in links.update.listings)
    assert SiteLinks.from_json(links.to_json(), "x") == links
