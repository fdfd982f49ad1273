"""Central differential privacy as an aggregation step: clip each update, noise the sum, fixed denominator.

The server (the run's aggregation task) releases ``global + (Σ clip_C(Δ_s) + N(0, (zC)² I)) / n``
where ``n`` is the number of sites in the job -- fixed before the round, never the number that
arrived and never a sample-weighted mean: adding or removing one site's data changes the clipped
sum by at most C, so the noise N(0, (zC)²) makes the round μ = 1/z GDP (the accountant's
:func:`~flare_airflow.core.privacy.accountant.epsilon_after`). Weighting by ``num_samples`` would
let one site's weight scale its contribution beyond C, and a denominator that counts the sites
that arrived would depend on the data as well: both break the calibration.

A robust rule (median, trimmed mean, Krum) selects or discards updates by their values, so the
sum that the noise was calibrated for is not what it releases: central DP and the robust rules are
refused together (:func:`flare_airflow.core.aggregation.central_dp.central_dp_problem`).

The noise is keyed by the round *and what is summed*: the accepted set with each update's clipped
digest (:func:`accepted_set_digest`). A round aggregated again after a cleared site (the normal
recovery) sums another set and draws independent noise; keyed by the round alone, the two global
models would differ by exactly that site's clipped update / n, with no noise at all.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping

import numpy as np

from flare_airflow.core.errors import ConfigError, FlareAirflowError
from flare_airflow.core.privacy.filters import (
    Params,
    add_gaussian_in_place,
    clip_in_place,
    clipped_digest,
    noise_generator,
    release_noise_key,
)
from flare_airflow.core.tensors import is_float

_KEY_DOMAIN = b"flare-airflow/central-noise/v1"  # apart from the sites' noise keys, whatever the secret
_SET_DOMAIN = b"flare-airflow/central-set/v1"


def central_noise_key(secret: bytes, job: str, run_id: str, round_num: int) -> bytes:
    """The 32-byte key of (job, run, round)'s central noise under the server's ``secret``.

    HMAC-SHA256 as the sites' keys (:func:`~flare_airflow.core.privacy.filters.noise_key`), in its
    own domain: the identity part of the round's noise key; :meth:`CentralDP.result` adds the
    accepted set (:func:`accepted_set_digest`), so a retried aggregation of the same updates draws
    the same noise (the same release, no second spend), another set independent noise, and without
    the secret nobody can regenerate -- and subtract -- it.
    """
    message = b"\0".join([_KEY_DOMAIN, job.encode(), run_id.encode(), str(int(round_num)).encode()])
    return hmac.new(secret, message, hashlib.sha256).digest()


CENTRAL_RELEASES_FILE = "central-releases.json"  # in each round's folder of the store: the round's releases


def central_release_id(round_num: int, accepted_sha256: Mapping[str, str | None]) -> str:
    """The name of one central release in the run's account: the round and each accepted site's
    update (the sha256 its site task vouched for). A retried aggregation of the same updates is the
    same release; one after a cleared site succeeded sums another set and is another release."""
    body = json.dumps({"round": int(round_num), "accepted": dict(sorted(accepted_sha256.items()))})
    return hashlib.sha256(body.encode()).hexdigest()


def accepted_set_digest(digests: Mapping[str, bytes], *, clip: float, noise_multiplier: float, num_sites: int) -> bytes:
    """SHA-256 of what a central release sums: each accepted site with its clipped update's digest,
    and the calibration (clip, z, denominator) the noise is drawn for."""
    h = hashlib.sha256(_SET_DOMAIN)
    h.update(json.dumps({"clip": clip, "noise_multiplier": noise_multiplier, "num_sites": num_sites}).encode())
    for site in sorted(digests):
        h.update(site.encode() + b"\0" + digests[site])
    return h.digest()


class CentralDP:
    """Streaming central-DP aggregation of one round: :meth:`add` each update, then :meth:`result`.

    Memory is the float64 sum plus one update's difference at a time.
    """

    def __init__(
        self, global_params: Params, *, clip: float, noise_multiplier: float, num_sites: int, key: bytes
    ) -> None:
        if not clip > 0:
            raise ConfigError(f"privacy.central.clip must be > 0, got {clip!r}")
        if not noise_multiplier > 0:
            raise ConfigError(f"privacy.central.noise_multiplier must be > 0, got {noise_multiplier!r}")
        if num_sites < 1:
            raise ConfigError(f"central DP needs the job's number of sites (>= 1), got {num_sites}")
        self.global_params = global_params
        self.clip, self.noise_multiplier, self.num_sites, self.key = clip, noise_multiplier, num_sites, key
        self._sum = {k: np.zeros(v.shape, dtype=np.float64) for k, v in global_params.items() if is_float(v.dtype)}
        self.counted: list[str] = []
        self.norms: dict[str, float] = {}
        self.digests: dict[str, bytes] = {}  # each counted update's clipped difference: keys the noise

    def add(self, site: str, params: Params, *, diff_update: bool) -> None:
        """Clip ``site``'s update (its difference to the global model) to ``clip`` and add it to the sum."""
        if site in self.counted:
            raise FlareAirflowError(f"site {site!r} already counted in this round")
        diff = {
            name: params[name].astype(np.float64) - (0 if diff_update else self.global_params[name].astype(np.float64))
            for name in self._sum
        }
        self.norms[site], _ = clip_in_place(diff, self.clip)
        self.digests[site] = clipped_digest(diff, {"site": site})
        for name, d in diff.items():
            self._sum[name] += d
        self.counted.append(site)

    def release_digest(self) -> bytes:
        """What this release sums (:func:`accepted_set_digest` of the updates counted so far)."""
        return accepted_set_digest(
            self.digests, clip=self.clip, noise_multiplier=self.noise_multiplier, num_sites=self.num_sites
        )

    def result(self) -> Params:
        """The new global model: global + (clipped sum + noise) / number of sites in the job.

        Non-float tensors keep the global model's values (they cannot be noised). The noise is keyed
        by the round key and :meth:`release_digest`.
        """
        noisy = {k: v.copy() for k, v in self._sum.items()}
        key = release_noise_key(self.key, self.release_digest())
        add_gaussian_in_place(noisy, self.noise_multiplier * self.clip, noise_generator(key, 0))
        out: Params = {}
        for name, ref in self.global_params.items():
            if name in noisy:
                out[name] = (ref.astype(np.float64) + noisy[name] / self.num_sites).astype(ref.dtype)
            else:
                out[name] = np.array(ref, copy=True)
        return out


def central_dp_round(
    global_params: Params,
    updates: Iterable[tuple[str, Params, bool]],
    *,
    clip: float,
    noise_multiplier: float,
    num_sites: int,
    key: bytes,
) -> Params:
    """One round of central DP over ``(site, params, diff_update)`` updates (see :class:`CentralDP`)."""
    agg = CentralDP(global_params, clip=clip, noise_multiplier=noise_multiplier, num_sites=num_sites, key=key)
    for site, params, diff_update in updates:
        agg.add(site, params, diff_update=diff_update)
    return agg.result()
