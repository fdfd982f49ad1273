"""``flare-airflow site budget``: a site's privacy odometer, read from its ledger on this worker.

Without Airflow: the ledger is a SQLite file at the site (docs/privacy.md, "The site's budget").
The site policy (``--policy``, else ``$FLARE_SITE_CONFIG``) gives each site's budget and ledger
file; without one, the default ledger is read and ε is given at ``--delta``.
"""

from __future__ import annotations

import os
from pathlib import Path

from flare_airflow.core import envvars
from flare_airflow.core.privacy.accountant import epsilon_of_releases
from flare_airflow.core.privacy.ledger import PrivacyLedger, default_ledger_path


def site_budget_text(*, policy: str | None, site: str | None, delta: float, releases: bool) -> str:
    """The ledger of each site (or of ``site``): releases, ε spent, the budget; with ``releases``, each release."""
    from flare_airflow.core.config.policy import load_site_policy

    policy = policy or os.environ.get(envvars.FLARE_SITE_CONFIG)
    budgets: dict[str, tuple[Path, float | None, float]] = {}
    if policy:
        for name, entry in load_site_policy(policy).sites.items():
            b = entry.privacy.budget if entry.privacy is not None else None
            path = Path(b.ledger) if b is not None and b.ledger else default_ledger_path()
            budgets[name] = (path, b.max_epsilon if b else None, b.delta if b else delta)
    else:
        path = default_ledger_path()
        for name in sorted({str(r["site"]) for r in PrivacyLedger(path).rows()} if path.exists() else set()):
            budgets[name] = (path, None, delta)
    if site is not None:
        budgets = {site: budgets.get(site, (default_ledger_path(), None, delta))}
    lines = [f"{'site':<16} {'releases':>8} {'epsilon':>10} {'max_epsilon':>11} {'delta':>8}  ledger"]
    for name, (path, max_epsilon, d) in budgets.items():
        rows = PrivacyLedger(path).rows(name) if path.exists() else []
        eps = epsilon_of_releases([float(str(r["mu"])) for r in rows], d)
        cap = f"{max_epsilon:g}" if max_epsilon is not None else "-"
        lines.append(f"{name:<16} {len(rows):>8} {eps:>10.4f} {cap:>11} {d:>8.0e}  {path}")
        if releases:
            for r in rows:
                lines.append(
                    f"  {r['released_at']}  job {r['job']} run {r['run_id']} round {r['round']}  "
                    f"z={float(str(r['noise_multiplier'])):g}  release {str(r['release_id'])[:16]}"
                )
    return "\n".join(lines)
