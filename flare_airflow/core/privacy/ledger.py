"""A site's privacy odometer: the durable ledger of every distinct release that left the site.

Sites, not jobs, own their privacy. Every noised release a site task publishes is written here
-- at the site, on its worker, in a SQLite file the central side never reads -- before it is
published, under the name :func:`~flare_airflow.core.privacy.filters.release_id` gives it: a
retry that republishes the same bytes has the same name and is charged once; a try that releases
another update is another release and is charged again. The site's ε is the exact Gaussian-DP
composition over all its releases, in every job and run (:func:`~.accountant.epsilon_of_releases`).

Concurrent site tasks of one worker serialise on SQLite's write lock (``BEGIN IMMEDIATE``): the
check against the budget and the insert are one transaction, so two tasks cannot both spend the
last of a budget. Not Airflow's metadata DB: the ledger is the site's, and must survive a worker
restart (a plain file) and be readable without Airflow (``flare-airflow site budget``).
"""

from __future__ import annotations

import contextlib
import math
import os
import sqlite3
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from flare_airflow.core import envvars
from flare_airflow.core.privacy.accountant import epsilon_of_releases
from flare_airflow.core.privacy.filters import PrivacyRefused

LEDGER_ENV = envvars.FLARE_PRIVACY_LEDGER
_BUSY_TIMEOUT_S = 60.0  # how long a site task waits for the write lock (another task's charge takes ms)
_SCHEMA = """
CREATE TABLE IF NOT EXISTS releases (
    site TEXT NOT NULL,
    release_id TEXT NOT NULL,
    job TEXT NOT NULL,
    run_id TEXT NOT NULL,
    round INTEGER NOT NULL,
    mu REAL NOT NULL,
    noise_multiplier REAL NOT NULL,
    released_at TEXT NOT NULL,
    PRIMARY KEY (site, release_id)
)
"""


class BudgetExceeded(PrivacyRefused):
    """A release would take the site beyond its privacy budget: refused, nothing leaves."""


@dataclass(frozen=True)
class Budget:
    """A site's budget over all its runs: ε at δ."""

    max_epsilon: float
    delta: float


@dataclass(frozen=True)
class Charge:
    """What a charge did: whether this release was new, and the site's and the run's account after it."""

    new: bool
    site_releases: int
    site_epsilon: float | None  # at the budget's δ (None without a budget)
    run_releases: int
    run_mus: tuple[float, ...]


def default_ledger_path() -> Path:
    """``$FLARE_PRIVACY_LEDGER``, else ``$AIRFLOW_HOME/flare/privacy-ledger.sqlite`` on this worker."""
    if os.environ.get(LEDGER_ENV):
        return Path(os.environ[LEDGER_ENV])
    home = os.environ.get("AIRFLOW_HOME") or str(Path.home() / "airflow")
    return Path(home) / "flare" / "privacy-ledger.sqlite"


def would_be_refusal(site: str, budget: Budget, spent: float, would_be: float, releases: int) -> str:
    return (
        f"site {site!r}: privacy budget max_epsilon {budget.max_epsilon:g} (δ={budget.delta:g}) would be crossed: the "
        f"site has spent ε = {spent:.4f} over {releases} release(s) in all its runs, and one more release would make "
        f"it ε = {would_be:.4f}. Nothing was released. The site's admin may raise privacy.budget.max_epsilon in the "
        "site policy (a larger budget is a weaker guarantee), or the job may use a larger noise_multiplier; "
        "`flare-airflow site budget` prints the ledger"
    )


class PrivacyLedger:
    """The SQLite ledger at ``path`` (created with its folder on first use)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        # Fail closed: a release the ledger cannot record does not leave.
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            conn = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT_S, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:
            raise self._unusable(exc) from None
        try:
            conn.execute("PRAGMA synchronous=FULL")  # a charge that returned is on disk
            conn.execute(_SCHEMA)
            yield conn
        except sqlite3.Error as exc:
            raise self._unusable(exc) from None
        finally:
            conn.close()

    def _unusable(self, exc: BaseException) -> PrivacyRefused:
        return PrivacyRefused(
            f"the site's privacy ledger {self.path} cannot be used ({type(exc).__name__}: {exc}); nothing was "
            f"released. Make it a writable file on the site's worker: the site policy's privacy.budget.ledger, "
            f"or ${LEDGER_ENV}"
        )

    def mus(self, site: str) -> list[float]:
        """μ of every release of ``site``, oldest first."""
        with self._connect() as conn:
            rows = conn.execute("SELECT mu FROM releases WHERE site = ? ORDER BY rowid", (site,)).fetchall()
        return [float(r[0]) for r in rows]

    def run_count(self, site: str, job: str, run_id: str) -> int:
        """How many distinct releases ``site`` made in (job, run) (0 before the file exists)."""
        if not self.path.exists():
            return 0
        with self._connect() as conn:
            row = conn.execute(
                "SELECT COUNT(*) FROM releases WHERE site = ? AND job = ? AND run_id = ?", (site, job, run_id)
            ).fetchone()
        return int(row[0])

    def rows(self, site: str | None = None) -> list[dict[str, object]]:
        """Every release (of ``site``, or of every site), oldest first."""
        query = "SELECT site, release_id, job, run_id, round, mu, noise_multiplier, released_at FROM releases"
        args: tuple[str, ...] = ()
        if site is not None:
            query, args = query + " WHERE site = ?", (site,)
        with self._connect() as conn:
            cur = conn.execute(query + " ORDER BY rowid", args)
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    def check(self, site: str, mu: float, budget: Budget) -> tuple[float, float]:
        """Refuse (:class:`BudgetExceeded`) when one more release of ``mu`` would cross ``budget``;
        else (spent ε, would-be ε). Before the trainer starts: a retry is counted as a new release,
        since it may release another update."""
        mus = self.mus(site)
        spent = epsilon_of_releases(mus, budget.delta)
        would_be = epsilon_of_releases([*mus, mu], budget.delta)
        if not would_be <= budget.max_epsilon:
            raise BudgetExceeded(would_be_refusal(site, budget, spent, would_be, len(mus)))
        return spent, would_be

    def charge(
        self,
        *,
        site: str,
        release_id: str,
        job: str,
        run_id: str,
        round_num: int,
        noise_multiplier: float,
        budget: Budget | None,
    ) -> Charge:
        """Write the release (μ = 1/z) unless it is there already; with ``budget``, refuse it
        (:class:`BudgetExceeded`, nothing written) when it would cross. One transaction."""
        mu = 1.0 / noise_multiplier if noise_multiplier > 0 else math.inf
        with self._connect() as conn:
            conn.execute("BEGIN IMMEDIATE")  # the write lock: check and insert as one
            try:
                known = conn.execute(
                    "SELECT 1 FROM releases WHERE site = ? AND release_id = ?", (site, release_id)
                ).fetchone()
                mus = [float(r[0]) for r in conn.execute("SELECT mu FROM releases WHERE site = ?", (site,))]
                if known is None:
                    if budget is not None:
                        spent = epsilon_of_releases(mus, budget.delta)
                        would_be = epsilon_of_releases([*mus, mu], budget.delta)
                        if not would_be <= budget.max_epsilon:
                            raise BudgetExceeded(would_be_refusal(site, budget, spent, would_be, len(mus)))
                    conn.execute(
                        "INSERT INTO releases VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                        (site, release_id, job, run_id, int(round_num), mu, noise_multiplier, _now()),
                    )
                    mus.append(mu)
                run_mus = tuple(
                    float(r[0])
                    for r in conn.execute(
                        "SELECT mu FROM releases WHERE site = ? AND job = ? AND run_id = ? ORDER BY rowid",
                        (site, job, run_id),
                    )
                )
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise
        return Charge(
            new=known is None,
            site_releases=len(mus),
            site_epsilon=epsilon_of_releases(mus, budget.delta) if budget is not None else None,
            run_releases=len(run_mus),
            run_mus=run_mus,
        )


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
