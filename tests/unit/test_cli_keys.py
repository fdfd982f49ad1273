"""The trust commands as docs/threat-model.md runs them: keygen at a site and centrally, enrol,
rotate, revoke -- and the registry they leave verifies exactly the enrolled, unrevoked keys."""

from __future__ import annotations

import json
import os
import stat

from flare_airflow.cli.commands import main
from flare_airflow.core.trust import Registry


def test_keygen_enrol_rotate_revoke(tmp_path, capsys) -> None:
    keys, registry = tmp_path / "keys", tmp_path / "registry.json"
    assert main(["site", "keygen", "site-1", "--out", str(keys)]) == 0
    printed = capsys.readouterr().out
    public = keys / "sites" / "site-1" / "public.jwks.json"
    assert json.loads(printed[printed.index("{") :]) == json.loads(public.read_text())
    assert stat.S_IMODE(os.stat(keys / "sites" / "site-1" / "sign.pem").st_mode) == 0o600
    assert main(["central", "keygen", "--out", str(keys)]) == 0
    assert main(["registry", "add", str(registry), str(public)]) == 0
    assert main(["registry", "add", str(registry), str(keys / "central" / "public.jwks.json")]) == 0
    old = Registry.from_file(registry).kids("site-1")
    assert len(old) == 1 and len(Registry.from_file(registry).kids("central")) == 1
    assert main(["site", "keygen", "site-1", "--out", str(keys)]) == 2  # refuses to replace a key
    assert "--rotate" in capsys.readouterr().err
    assert main(["site", "keygen", "site-1", "--out", str(keys), "--rotate"]) == 0
    assert main(["registry", "add", str(registry), str(public)]) == 0
    both = Registry.from_file(registry).kids("site-1")
    assert len(both) == 2 and old[0] in both  # during rotation both key ids verify
    assert main(["registry", "revoke", str(registry), old[0]]) == 0
    assert old[0] not in Registry.from_file(registry).kids("site-1")
    assert main(["registry", "revoke", str(registry), old[0]]) == 2
    # A JWKS that carries a private half ('d') is never enrolled.
    assert main(["site", "keygen", "site-3", "--out", str(keys)]) == 0
    leak = json.loads((keys / "sites" / "site-3" / "public.jwks.json").read_text())
    leak["keys"][0]["d"] = "c2VjcmV0"
    (tmp_path / "leak.json").write_text(json.dumps(leak))
    assert main(["registry", "add", str(registry), str(tmp_path / "leak.json")]) == 2
    assert "private key" in capsys.readouterr().err
    assert Registry.from_file(registry).kids("site-3") == []


def test_site_store_policy_prints_the_sites_own_slots_and_the_global_models(tmp_path, capsys) -> None:
    import shutil

    from flare_airflow_testing.harness import REPO

    (tmp_path / "dags").mkdir()
    job = tmp_path / "dags" / "digits.yaml"  # its initial_model and trainer are under ../examples
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    job.write_text((REPO / "dags" / "digits.yaml").read_text() + "\nstore: s3://flare/store\n")
    assert main(["site", "store-policy", str(job), "site-1"]) == 0
    policy = json.loads(capsys.readouterr().out)
    resources = [r for statement in policy["Statement"] for r in statement["Resource"]]
    assert "arn:aws:s3:::flare/store/digits/*/round-*/sites/site-1.safetensors" in resources
    assert "arn:aws:s3:::flare/store/digits/*/round-*/global.safetensors" in resources
    assert not [r for r in resources if "site-2" in r or r.endswith("/*")]
    assert not [a for s in policy["Statement"] for a in s["Action"] if "List" in a]
    assert main(["site", "store-policy", str(job), "site-9"]) == 2


def test_registry_grant_sets_a_sites_queues_and_refuses_a_shared_queue(tmp_path, capsys) -> None:
    import json

    keys, registry = tmp_path / "keys", tmp_path / "registry.json"
    for site in ("site-1", "site-2"):
        assert main(["site", "keygen", site, "--out", str(keys)]) == 0
        assert main(["registry", "add", str(registry), str(keys / "sites" / site / "public.jwks.json")]) == 0
    assert main(["registry", "grant", str(registry), "site-2", "--queues", "hospital-b,site-2"]) == 0
    assert json.loads(registry.read_text())["flare_sites"] == {"site-2": {"queues": ["hospital-b", "site-2"]}}
    capsys.readouterr()
    assert main(["registry", "grant", str(registry), "site-1", "--queues", "hospital-b"]) == 2
    assert "queue 'hospital-b' is granted to both 'site-1' and 'site-2'" in capsys.readouterr().err
    assert "site-1" not in json.loads(registry.read_text())["flare_sites"]  # refused before writing
    assert main(["registry", "grant", str(registry), "site-9", "--queues", "x"]) == 2
