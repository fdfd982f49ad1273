"""``flare-airflow site keygen``, ``central keygen``, ``registry add|revoke``, ``site store-policy``:
a party's keys, the consortium registry of public keys, a site's store policy (docs/threat-model.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from flare_airflow.core.trust import CENTRAL, Registry, RegistryError, generate_keys
from flare_airflow.core.trust.keys import party_dir


def _key_dir(args: argparse.Namespace) -> Path:
    if args.out:
        return Path(args.out)
    from flare_airflow.operators.trust import trust_settings

    return Path(trust_settings().key_dir)


def _keygen(party: str, args: argparse.Namespace) -> int:
    directory = party_dir(_key_dir(args), party)
    keys = generate_keys(party, directory, rotate=args.rotate)
    for old in keys.retired:
        print(f"rotated: the old key {old} is kept at {directory} (*.{old}.retired); revoke it once no run needs it")
    print(f"{party}: private keys in {directory} (mode 0600, never copy them off this machine)")
    print(f"public keys to enrol in the consortium registry ({directory / 'public.jwks.json'}):")
    print(json.dumps(keys.jwks, indent=2))
    return 0


def cmd_site_keygen(args: argparse.Namespace) -> int:
    return _keygen(args.site, args)


def cmd_central_keygen(args: argparse.Namespace) -> int:
    return _keygen(CENTRAL, args)


def _read(path: Path, *, missing_ok: bool = True) -> dict[str, Any]:
    """A JWKS file, refused (``RegistryError``) unless it is readable, JSON and well-formed."""
    if missing_ok and not path.exists():
        return {"keys": []}
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except OSError as exc:
        raise RegistryError(f"cannot read {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise RegistryError(f"{path} is not JSON: {exc}") from None
    Registry.from_jwks(data, str(path))  # refuses a malformed registry before it is changed
    return data


def _write(path: Path, data: dict[str, Any]) -> None:
    Registry.from_jwks(data, str(path))
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def cmd_registry_add(args: argparse.Namespace) -> int:
    """Enrol (or rotate in) a party's public keys: the JWKS its keygen printed, after review."""
    registry = Path(args.registry)
    data = _read(registry)
    new = _read(Path(args.public_jwks), missing_ok=False)
    known = {k.get("kid") for k in data["keys"]}
    added = [k for k in new["keys"] if k.get("kid") not in known]
    if any("d" in k for k in added):
        raise RegistryError(f"{args.public_jwks} holds a private key ('d'): enrol only public keys")
    data["keys"].extend(added)
    _write(registry, data)
    print(f"{registry}: enrolled {', '.join(k['kid'] for k in added) or 'nothing new'}")
    return 0


def cmd_registry_revoke(args: argparse.Namespace) -> int:
    """Revoke a key id: its records are refused from now on; nobody else is re-provisioned."""
    registry = Path(args.registry)
    data = _read(registry)
    kept = [k for k in data["keys"] if k.get("kid") != args.kid]
    if len(kept) == len(data["keys"]):
        raise RegistryError(f"{registry} lists no key {args.kid!r}")
    data["keys"] = kept
    _write(registry, data)
    print(f"{registry}: revoked {args.kid}")
    return 0


def cmd_site_store_policy(args: argparse.Namespace) -> int:
    """Print the IAM policy for one site's own store identity (stores that cannot presign links)."""
    from flare_airflow.core.config import load_job
    from flare_airflow.core.store import ModelStore
    from flare_airflow.core.store_links import site_bucket_policy

    job = load_job(args.job)
    if args.site not in job.sites:
        print(f"{args.job}: no site {args.site!r} (sites: {', '.join(sorted(job.sites))})", file=sys.stderr)
        return 2
    if job.store is None or not job.store.startswith(("s3://", "s3a://")):
        print(f"{args.job}: the store {job.store or 'file:// (default)'} is not S3: no policy", file=sys.stderr)
        return 2
    print(json.dumps(site_bucket_policy(ModelStore.from_uri(job.store), job=job.job, site=args.site), indent=2))
    return 0


def cmd_registry_grant(args: argparse.Namespace) -> int:
    """Set what an enrolled site may ask of the central side: its queues, worker names, and the
    central Variables/Connections its tasks may resolve (each a comma-separated list; "" for none)."""
    from flare_airflow.core.trust.grants import SECTION, Grants

    registry = Path(args.registry)
    data = _read(registry, missing_ok=False)
    section = data.setdefault(SECTION, {})
    entry = dict(section.get(args.site) or {})
    for field in ("queues", "workers", "variables", "connections"):
        value = getattr(args, field)
        if value is not None:
            entry[field] = [v.strip() for v in value.split(",") if v.strip()]
    section[args.site] = entry
    Grants.from_registry(data, Registry.from_jwks(data, str(registry)))  # refuses an invalid grant unwritten
    _write(registry, data)
    print(f"{registry}: {args.site} may {json.dumps(entry, sort_keys=True)}")
    return 0


def cmd_site_worker(args: argparse.Namespace) -> int:
    """Start the site's Edge worker, signing with its own key (docs/deploy-across-sites.md)."""
    from flare_airflow.edge.worker import run_site_worker

    extra = list(args.edge_args)
    return run_site_worker(args.site, args.name, extra[1:] if extra[:1] == ["--"] else extra)


def add_parsers(sub: Any, site_sub: Any) -> None:
    """The trust commands, under the CLI's sub-parsers (``site_sub``: the ``site`` command's own,
    which holds a site's other commands too)."""
    central_sub = sub.add_parser("central", help="the central (aggregation) side's own state").add_subparsers(
        dest="central_command", required=True
    )
    for role, group, func, help_text in (
        ("site", site_sub, cmd_site_keygen, "a site's own keys (run at the site)"),
        ("central", central_sub, cmd_central_keygen, "the central (aggregation) side's keys"),
    ):
        # The central box key is what sites seal their sample counts and metrics to (issue 36 item 3).
        p = group.add_parser("keygen", help=f"make {help_text}: an Ed25519 signing key and an X25519 box key")
        if role == "site":
            p.add_argument("site", help="the site's name, as in the job")
        p.add_argument("--out", help="the worker's key directory (default: [flare] key_dir, $AIRFLOW_HOME/flare-keys)")
        p.add_argument("--rotate", action="store_true", help="replace existing keys with new ones (new key ids)")
        p.set_defaults(func=func)
    p = site_sub.add_parser(
        "worker", help="start the site's Airflow Edge worker on its registry queues, signing with the site's key"
    )
    p.add_argument("site", help="the site's name, as in the job and the registry")
    p.add_argument("--name", help="the worker's name (default: the first the registry grants, <site>-worker)")
    p.add_argument("edge_args", nargs=argparse.REMAINDER, help="after --: more `airflow edge worker` options")
    p.set_defaults(func=cmd_site_worker)
    group = sub.add_parser("registry", help="the consortium registry of public keys").add_subparsers(
        dest="registry_command", required=True
    )
    p = site_sub.add_parser(
        "store-policy",
        help="print the IAM policy of a site's own store identity: read the global models, write only its own "
        "slot, no listing (for stores that cannot presign links; docs/model-store.md)",
    )
    p.add_argument("job", help="the job file (its store: and job: name the bucket, prefix and paths)")
    p.add_argument("site", help="the site's name, as in the job")
    p.set_defaults(func=cmd_site_store_policy)
    p = group.add_parser("add", help="enrol a party's public keys (the public.jwks.json its keygen wrote)")
    p.add_argument("registry")
    p.add_argument("public_jwks")
    p.set_defaults(func=cmd_registry_add)
    p = group.add_parser("revoke", help="remove a key id: its records are refused from then on")
    p.add_argument("registry")
    p.add_argument("kid")
    p.set_defaults(func=cmd_registry_revoke)
    p = group.add_parser(
        "grant", help="what an enrolled site may ask: its queues, worker names, central Variables/Connections"
    )
    p.add_argument("registry")
    p.add_argument("site")
    for field, default in (("queues", "<site>"), ("workers", "<site>-worker"), ("variables", ""), ("connections", "")):
        p.add_argument(f"--{field}", help=f"comma-separated (default: {default!r}; '' for none)")
    p.set_defaults(func=cmd_registry_grant)
