"""Sealed boxes (core/trust/sealed.py): only the recipient's box key opens, only for its context."""

from __future__ import annotations

import pathlib

import pytest

from flare_airflow.core.trust import CENTRAL, generate_keys
from flare_airflow.core.trust.keys import party_dir
from flare_airflow.core.trust.registry import Registry
from flare_airflow.core.trust.sealed import SealedOpenError, load_box_key, open_sealed, seal, seal_context


@pytest.fixture
def key_dir(tmp_path) -> pathlib.Path:
    for party in ("site-1", "site-2", CENTRAL):
        generate_keys(party, party_dir(tmp_path, party))
    return tmp_path


def test_sealed_to_a_site_opens_with_its_box_key_for_its_context(key_dir):
    box = Registry.from_key_dir(key_dir).box_key("site-1")
    ctx = seal_context("links", job="j", run_id="r", round=2, site="site-1")
    sealed = seal(box.public, box.kid, b"secret links", context=ctx)
    assert b"secret" not in sealed.encode() and box.kid in sealed
    assert open_sealed(load_box_key(key_dir, "site-1"), sealed, context=ctx, what="links") == b"secret links"


def test_another_sites_key_last_rounds_context_or_a_changed_byte_do_not_open(key_dir):
    box = Registry.from_key_dir(key_dir).box_key("site-1")
    ctx = seal_context("links", job="j", run_id="r", round=2, site="site-1")
    sealed = seal(box.public, box.kid, b"secret links", context=ctx)
    with pytest.raises(SealedOpenError, match="not to this worker's box key"):
        open_sealed(load_box_key(key_dir, "site-2"), sealed, context=ctx, what="links")
    replay = seal_context("links", job="j", run_id="r", round=3, site="site-1")
    with pytest.raises(SealedOpenError, match="another job, run, round or party"):
        open_sealed(load_box_key(key_dir, "site-1"), sealed, context=replay, what="links")
    flipped = sealed[:-5] + ("A" if sealed[-5] != "A" else "B") + sealed[-4:]
    with pytest.raises(SealedOpenError):
        open_sealed(load_box_key(key_dir, "site-1"), flipped, context=ctx, what="links")
    with pytest.raises(SealedOpenError, match="not a sealed message"):
        open_sealed(load_box_key(key_dir, "site-1"), {"url": "http://x"}, context=ctx, what="links")


def test_the_central_side_has_a_box_key_and_the_registry_names_a_missing_one(key_dir, tmp_path_factory):
    assert Registry.from_key_dir(key_dir).box_key(CENTRAL).party == CENTRAL
    lone = tmp_path_factory.mktemp("lone")
    generate_keys("site-3", party_dir(lone, "site-3"), box=False)
    with pytest.raises(Exception, match=r"no box .X25519. key in the registry.*site keygen site-3"):
        Registry.from_key_dir(lone).box_key("site-3")
