"""Site identity and signed records (issue 36 items 1 and 5), the core half: keys, registry, records."""

from __future__ import annotations

import json
import os
import stat

import pytest

from flare_airflow.core.trust import (
    CENTRAL,
    BadSignature,
    KeyMissing,
    RecordMismatch,
    Registry,
    RegistryError,
    TrustError,
    UnknownSigner,
    UnsignedRecord,
    WrongSigner,
    generate_keys,
    global_payload,
    load_signing_key,
    sign_record,
    update_payload,
    verify_record,
)
from flare_airflow.core.trust.keys import party_dir, signing_key_for
from flare_airflow.core.trust.settings import TrustSettings


def payload(site: str = "site-1", round_num: int = 1, sha256: str = "a" * 64) -> dict:
    return update_payload(
        job="j", run_id="r", round_num=round_num, site=site, try_number=1, size=10, sha256=sha256, blake3=None,
        num_samples=5, params_type="FULL", privacy=None, trainer="t" * 64,
    )  # fmt: skip


def registry_of(*jwks: dict, where: str = "test registry") -> Registry:
    return Registry.from_jwks({"keys": [k for j in jwks for k in j["keys"]]}, where)


def test_keygen_writes_private_halves_0600_in_a_0700_dir_and_the_public_jwks(tmp_path) -> None:
    keys = generate_keys("site-1", tmp_path / "k")
    assert stat.S_IMODE(os.stat(tmp_path / "k").st_mode) == 0o700
    for name in ("sign.pem", "box.pem"):
        assert stat.S_IMODE(os.stat(tmp_path / "k" / name).st_mode) == 0o600
    public = json.loads((tmp_path / "k" / "public.jwks.json").read_text())
    assert public == keys.jwks
    assert [(k["crv"], k["use"], k["flare_party"]) for k in public["keys"]] == [
        ("Ed25519", "sig", "site-1"),
        ("X25519", "enc", "site-1"),
    ]
    assert all("d" not in k for k in public["keys"])  # no private half in what is handed in
    assert keys.signing_kid.startswith("site-1.")
    assert load_signing_key(tmp_path / "k", "site-1")[0] == keys.signing_kid


def test_keygen_refuses_to_replace_a_key_and_rotation_keeps_the_old_one_retired(tmp_path) -> None:
    first = generate_keys("site-1", tmp_path)
    with pytest.raises(TrustError, match="--rotate"):
        generate_keys("site-1", tmp_path)
    second = generate_keys("site-1", tmp_path, rotate=True)
    assert second.retired == (first.signing_kid,) and second.signing_kid != first.signing_kid
    assert (tmp_path / f"sign.pem.{first.signing_kid}.retired").exists()


def test_a_signing_key_readable_by_others_or_missing_is_refused_with_what_to_do(tmp_path) -> None:
    with pytest.raises(KeyMissing, match="flare-airflow site keygen site-1"):
        load_signing_key(tmp_path, "site-1")
    generate_keys("site-1", tmp_path)
    os.chmod(tmp_path / "sign.pem", 0o644)
    with pytest.raises(TrustError, match="chmod 600"):
        load_signing_key(tmp_path, "site-1")


def test_sign_then_verify_and_every_change_is_refused_by_its_own_reason(tmp_path) -> None:
    k1 = generate_keys("site-1", tmp_path / "1")
    k2 = generate_keys("site-2", tmp_path / "2")
    reg = registry_of(k1.jwks, k2.jwks)
    kid1, key1 = load_signing_key(tmp_path / "1", "site-1")
    kid2, key2 = load_signing_key(tmp_path / "2", "site-2")
    signed = sign_record(payload(), kid1, key1)
    assert (
        verify_record(signed, reg, party="site-1", expect={"round": 1, "site": "site-1"}, what="u")["sha256"]
        == "a" * 64
    )

    tampered = json.loads(json.dumps(signed))
    tampered["payload"]["sha256"] = "b" * 64
    with pytest.raises(BadSignature, match="changed or forged"):
        verify_record(tampered, reg, party="site-1", expect={}, what="u")
    # site-2 signs a record that speaks for site-1's slot: its key is enrolled, but not for site-1.
    with pytest.raises(WrongSigner, match="signed with 'site-2'"):
        verify_record(sign_record(payload("site-1"), kid2, key2), reg, party="site-1", expect={}, what="u")
    # A genuine record of last round, replayed this round.
    with pytest.raises(RecordMismatch, match="round 1, expected 2"):
        verify_record(signed, reg, party="site-1", expect={"round": 2}, what="u")
    with pytest.raises(UnsignedRecord):
        verify_record({"payload": payload()}, reg, party="site-1", expect={}, what="u")
    # An update record is never taken for a global one (domain-separated signatures).
    as_global = {**signed, "payload": {**signed["payload"], "type": "global"}}
    with pytest.raises(BadSignature):
        verify_record(as_global, reg, party="site-1", expect={}, what="u")


def test_rotation_both_kids_verify_and_revocation_refuses_the_removed_one(tmp_path) -> None:
    old = generate_keys("site-1", tmp_path)
    old_signed = sign_record(payload(), *load_signing_key(tmp_path, "site-1"))
    new = generate_keys("site-1", tmp_path, rotate=True)
    new_signed = sign_record(payload(), *load_signing_key(tmp_path, "site-1"))
    during = registry_of(old.jwks, new.jwks)
    for signed in (old_signed, new_signed):
        verify_record(signed, during, party="site-1", expect={}, what="u")
    after = registry_of(new.jwks)  # revocation: the old key id is removed from the file
    verify_record(new_signed, after, party="site-1", expect={}, what="u")
    with pytest.raises(UnknownSigner, match=f"{old.signing_kid}.*never enrolled, or revoked"):
        verify_record(old_signed, after, party="site-1", expect={}, what="u")


def test_registry_refuses_malformed_entries_and_a_kid_that_is_not_its_keys(tmp_path) -> None:
    k = generate_keys("site-1", tmp_path)
    sig = dict(k.jwks["keys"][0])
    with pytest.raises(RegistryError, match="list 'keys'"):
        Registry.from_jwks([], "r")
    with pytest.raises(RegistryError, match="flare_party"):
        Registry.from_jwks({"keys": [{**sig, "flare_party": "../x"}]}, "r")
    with pytest.raises(RegistryError, match="not this key's id"):
        Registry.from_jwks({"keys": [{**sig, "flare_party": "site-2"}]}, "r")
    with pytest.raises(RegistryError, match="listed twice"):
        Registry.from_jwks({"keys": [sig, sig]}, "r")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(RegistryError, match="not JSON"):
        Registry.from_file(tmp_path / "bad.json")


def test_one_machine_mode_makes_keys_on_first_use_and_notes_what_it_cannot_prove(tmp_path) -> None:
    settings = TrustSettings(key_dir=str(tmp_path))
    kid, key = settings.signing_key("site-1")
    assert (party_dir(tmp_path, "site-1") / "box.pem").exists()
    assert settings.signing_key("site-1")[0] == kid  # made once
    central_kid, central = settings.signing_key(CENTRAL)
    # The central side has a box key too: sites seal their counts and metrics to it.
    assert (party_dir(tmp_path, CENTRAL) / "box.pem").exists()
    g = sign_record(
        global_payload(job="j", run_id="r", round_num=0, size=1, sha256="c" * 64, blake3=None), central_kid, central
    )
    assert settings.verify(g, party=CENTRAL, expect={"round": 0}, what="g") == (g["payload"], None)
    payload_, note = settings.verify(None, party="site-1", expect={}, what="u")
    assert payload_ is None and note is not None and "accepted unverified" in note
    with pytest.raises(RecordMismatch):  # a known key still binds its record to its place
        settings.verify(sign_record(payload(), kid, key), party="site-1", expect={"round": 2}, what="u")


def test_strict_mode_never_makes_keys_and_refuses_unsigned_and_unknown(tmp_path) -> None:
    (tmp_path / "registry.json").write_text(json.dumps({"keys": []}))
    settings = TrustSettings(key_dir=str(tmp_path / "keys"), registry_path=str(tmp_path / "registry.json"))
    with pytest.raises(KeyMissing, match="enrol"):
        settings.signing_key("site-1")
    assert not (tmp_path / "keys").exists()
    with pytest.raises(UnsignedRecord):
        settings.verify(None, party="site-1", expect={}, what="u")
    kid, key = signing_key_for(tmp_path / "other", "site-1", create=True)
    with pytest.raises(UnknownSigner):
        settings.verify(sign_record(payload(), kid, key), party="site-1", expect={}, what="u")


def test_a_record_survives_the_xcom_round_trip_with_a_privacy_report_of_infinite_epsilon(tmp_path) -> None:
    keys = generate_keys("site-1", tmp_path)
    p = {**payload(), "privacy": {"filters": ["clip"], "epsilon": float("inf"), "delta": 1e-5}}
    signed = sign_record(p, *load_signing_key(tmp_path, "site-1"))
    back = json.loads(json.dumps(signed))  # XCom stores JSON
    assert verify_record(back, registry_of(keys.jwks), party="site-1", expect={}, what="u")["privacy"][
        "epsilon"
    ] == float("inf")


def test_one_machine_mode_without_a_writable_key_dir_says_what_to_set(tmp_path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(KeyMissing, match=r"cannot make its keys .* set \[flare\] key_dir"):
        TrustSettings(key_dir=str(tmp_path / "file" / "keys")).signing_key("site-1")
