"""What a site applies to its update before it leaves: the filters of its privacy plan.

Filters act on the update's *difference* to the global model the site received (a FULL update is
turned into its difference, filtered, and added back): clipping or noising full weights would
protect nothing. The float64 working copy keeps the difference of two float32 tensors exact.

- ``exclude_vars``: named (or matching) tensors do not leave: a FULL update carries the global
  model's own values for them, a DIFF update zeros, so the aggregate keeps the previous global
  values (FedAvg of identical values) and nothing of the site's training reaches them.
- ``clip``: scale the whole difference so that its L2 norm over all float tensors is at most C;
  an update already inside is left bit-for-bit as it was.
- ``gaussian``: clip to C, then add N(0, (zC)²) to every element of the float tensors (local DP,
  μ = 1/z per round for adding or removing the site's data): the sensitivity is the clip norm,
  never a parameter.
- ``percentile``: NVIDIA FLARE's PercentilePrivacy (zero the differences whose magnitude is below
  the given percentile of all magnitudes, clip the rest to [-gamma, gamma]). A heuristic that hides small
  changes; it is **not** differential privacy and spends no ε.

The noise is keyed by what is released (:func:`release_noise_key`): an HMAC, under the site's
secret, of (job, run, round, site) *and* the digest of the clipped update the noise is added to
(:func:`clipped_digest`). A retried site task that sends the same update publishes the identical
release (same bytes, no second spend); a try that sends a different update -- a hostile trainer,
or any non-deterministic honest one -- gets independent noise. Keyed by the identity alone, two
tries' releases would differ by exactly the difference of their clipped updates, and the
difference of two releases of one try and the global model would be the raw update
(docs/privacy.md, "The noise secret, and retries").
"""

from __future__ import annotations

import fnmatch
import hashlib
import hmac
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from flare_airflow.core.errors import FlareAirflowError
from flare_airflow.core.tensors import is_float

Params = dict[str, np.ndarray]
# NumPy's generator for the noise: PCG64 (NumPy's default bit generator), seeded from a 256-bit key.
_KEY_DOMAIN = b"flare-airflow/noise/v1"
_RELEASE_DOMAIN = b"flare-airflow/noise-release/v2"  # the key of one release: identity + clipped update
_DIGEST_DOMAIN = b"flare-airflow/clipped-update/v1"
_RELEASE_ID_DOMAIN = b"flare-airflow/release-id/v1"
_NOISE_CHUNK = 1 << 20  # noise is drawn and added a cache-sized piece at a time


class PrivacyRefused(FlareAirflowError):
    """The update cannot leave the site under its privacy plan (fail closed); the reason says why."""


def noise_key(secret: bytes, job: str, run_id: str, round_num: int, site: str) -> bytes:
    """The 32-byte key of (job, run, round, site) under the site's ``secret``: the identity part of
    every release's key (:func:`release_noise_key` adds what is released).

    HMAC-SHA256 of the identity with the secret: without the secret the noise cannot be
    regenerated (and so not subtracted).
    """
    message = b"\0".join([_KEY_DOMAIN, job.encode(), run_id.encode(), str(int(round_num)).encode(), site.encode()])
    return hmac.new(secret, message, hashlib.sha256).digest()


def clipped_digest(diff: Mapping[str, np.ndarray], step: Mapping[str, Any]) -> bytes:
    """SHA-256 of the float tensors the noise is about to be added to (names, dtypes, shapes, bytes)
    and of the noising step's own parameters (its index, clip and z).

    The parameters are in it because the same noise scaled by two z's would let
    ``(z₂r₁ - z₁r₂) / (z₂ - z₁)`` cancel it.
    """
    h = hashlib.sha256(_DIGEST_DOMAIN)
    h.update(json.dumps(dict(step), sort_keys=True, default=str).encode())
    for name in sorted(diff):
        arr = diff[name]
        if not is_float(arr.dtype):
            continue
        h.update(b"\0".join([name.encode(), arr.dtype.str.encode(), repr(arr.shape).encode(), b""]))
        h.update(np.ascontiguousarray(arr).data)
    return h.digest()


def release_noise_key(key: bytes, update_digest: bytes) -> bytes:
    """The key of one release's noise: HMAC of the identity key (:func:`noise_key`, or the central
    round key) with the digest of what is noised. Same update, same key; another update, another key."""
    return hmac.new(key, _RELEASE_DOMAIN + update_digest, hashlib.sha256).digest()


def release_id(key: bytes, update_digests: Sequence[bytes]) -> str:
    """The release's name in the site's ledger: an HMAC (under the identity key) of the digests of
    every noised step, so one update republished is one release, and the name reveals nothing of
    the update to anyone without the secret."""
    return hmac.new(key, _RELEASE_ID_DOMAIN + b"".join(update_digests), hashlib.sha256).hexdigest()


def noise_generator(key: bytes, step: int) -> np.random.Generator:
    """The generator of the ``step``-th noising filter of a plan keyed by ``key``."""
    entropy = int.from_bytes(hashlib.sha256(key + step.to_bytes(4, "little")).digest(), "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


def l2_norm(diff: Mapping[str, np.ndarray]) -> float:
    """The L2 norm over every element of the float tensors of ``diff`` (float64 sums)."""
    total = 0.0
    for arr in diff.values():
        if is_float(arr.dtype):
            flat = arr.reshape(-1)
            for s in range(0, flat.size, _NOISE_CHUNK):
                piece = flat[s : s + _NOISE_CHUNK].astype(np.float64, copy=False)
                total += float(np.dot(piece, piece))
    return math.sqrt(total)


def clip_in_place(diff: dict[str, np.ndarray], clip: float) -> tuple[float, bool]:
    """Scale the float tensors of ``diff`` so that their joint L2 norm is at most ``clip``.

    Returns (norm before, whether it was scaled). Inside the ball nothing is touched.
    """
    if not clip > 0:
        raise FlareAirflowError(f"clip must be > 0, got {clip!r}")
    norm = l2_norm(diff)
    if norm <= clip:
        return norm, False
    scale = clip / norm
    for arr in diff.values():
        if is_float(arr.dtype):
            arr *= arr.dtype.type(scale)
    return norm, True


def add_gaussian_in_place(
    diff: dict[str, np.ndarray], sd: float, rng: np.random.Generator, skip: frozenset[str] = frozenset()
) -> None:
    """Add N(0, sd²) to every element of the float tensors of ``diff`` (except ``skip``), in name order."""
    for name in sorted(diff):
        arr = diff[name]
        if not is_float(arr.dtype) or name in skip:
            continue
        flat = arr.reshape(-1)
        for s in range(0, flat.size, _NOISE_CHUNK):
            piece = flat[s : s + _NOISE_CHUNK]
            noise = rng.standard_normal(piece.size, dtype=arr.dtype.type)
            noise *= arr.dtype.type(sd)
            piece += noise


def percentile_in_place(diff: dict[str, np.ndarray], percentile: float, gamma: float) -> float:
    """NVIDIA FLARE's PercentilePrivacy on ``diff``: zero the elements whose magnitude is below the
    ``percentile``-th percentile of all float magnitudes, clip the rest to [-gamma, gamma].
    Returns the cut-off. Not differential privacy."""
    floats = [arr.reshape(-1) for arr in diff.values() if is_float(arr.dtype)]
    if not floats:
        return 0.0
    cutoff = float(np.percentile(np.abs(np.concatenate(floats)), percentile))
    for arr in diff.values():
        if is_float(arr.dtype):
            arr[np.abs(arr) < cutoff] = 0
            np.clip(arr, -gamma, gamma, out=arr)
    return cutoff


def excluded_names(names: Sequence[str], exact: Sequence[str], pattern: str | None) -> frozenset[str]:
    """The tensor names an ``exclude_vars`` filter names: listed exactly, or fully matching ``pattern``."""
    regex = re.compile(pattern) if pattern else None
    return frozenset(n for n in names if n in exact or (regex is not None and regex.fullmatch(n)))


@dataclass
class UpdateInFilter:
    """The data the filters work on, in plan order: the float64 difference of the update's float
    tensors to the global model (excluded tensors left out), and the history each filter leaves."""

    diff: dict[str, np.ndarray]
    excluded: frozenset[str]
    key: bytes | None  # the noise key (:func:`noise_key`); a plan that noises has one
    applied: list[dict[str, Any]] = field(default_factory=list)  # one record per filter, in order
    digests: list[bytes] = field(default_factory=list)  # of every noised step (:func:`release_id`)
    changed: bool = False


@dataclass(frozen=True)
class SiteFilter:
    """One filter of a site's plan: its parameters and :meth:`apply`, the one method that filters.

    A filter is named by ``type`` (its entry in :data:`FILTERS` and in the job file's ``FilterSpec``
    union); its parameters are the dataclass fields of a subclass, the same as its config entry's.
    """

    type: ClassVar[str]

    def excludes(self, names: Sequence[str]) -> frozenset[str]:
        """The tensors this filter keeps home (decided before any filter runs)."""
        return frozenset()

    def noise(self) -> float | None:
        """The noise multiplier z of the noise this filter adds, or None when it adds none."""
        return None

    def apply(self, update: UpdateInFilter, index: int) -> None:
        """Filter ``update`` in place as the plan's ``index``-th step and append its record."""
        raise NotImplementedError


@dataclass(frozen=True)
class ExcludeVarsFilter(SiteFilter):
    """``exclude_vars``: the named (or matching) tensors do not leave the site."""

    type: ClassVar[str] = "exclude_vars"
    names: Sequence[str] = ()
    regex: str | None = None

    def excludes(self, names: Sequence[str]) -> frozenset[str]:
        return excluded_names(names, self.names, self.regex)

    def apply(self, update: UpdateInFilter, index: int) -> None:
        # The plan's exclusions are all applied when the difference is made: the record lists them.
        update.applied.append({"type": self.type, "excluded": sorted(update.excluded)})


@dataclass(frozen=True)
class ClipFilter(SiteFilter):
    """``clip``: scale the difference to an L2 norm of at most ``clip``."""

    type: ClassVar[str] = "clip"
    clip: float

    def apply(self, update: UpdateInFilter, index: int) -> None:
        norm, scaled = clip_in_place(update.diff, float(self.clip))
        update.changed |= scaled
        update.applied.append({"type": self.type, "clip": self.clip, "norm": norm, "scaled": scaled})


@dataclass(frozen=True)
class GaussianFilter(SiteFilter):
    """``gaussian``: clip to ``clip``, then add N(0, (noise_multiplier x clip)²) keyed by the release."""

    type: ClassVar[str] = "gaussian"
    clip: float
    noise_multiplier: float

    def noise(self) -> float | None:
        return float(self.noise_multiplier)

    def apply(self, update: UpdateInFilter, index: int) -> None:
        clip, z = float(self.clip), float(self.noise_multiplier)
        norm, _ = clip_in_place(update.diff, clip)
        assert update.key is not None  # apply_filters refuses a noising plan without its key
        digest = clipped_digest(update.diff, {"index": index, "clip": clip, "noise_multiplier": z})
        update.digests.append(digest)
        add_gaussian_in_place(update.diff, z * clip, noise_generator(release_noise_key(update.key, digest), index))
        update.changed = True
        update.applied.append({"type": self.type, "clip": clip, "noise_multiplier": z, "norm": norm})


@dataclass(frozen=True)
class PercentileFilter(SiteFilter):
    """``percentile``: NVIDIA FLARE's PercentilePrivacy (not differential privacy)."""

    type: ClassVar[str] = "percentile"
    percentile: float = 10.0
    gamma: float = 0.01

    def apply(self, update: UpdateInFilter, index: int) -> None:
        cutoff = percentile_in_place(update.diff, float(self.percentile), float(self.gamma))
        update.changed = True
        update.applied.append({"type": self.type, "percentile": self.percentile, "gamma": self.gamma, "cutoff": cutoff})


# The registry: every site filter by its type (one place to add a filter; the job file's
# ``FilterSpec`` union in core/config/filters.py names the same types, a test keeps them equal).
FILTERS: dict[str, type[SiteFilter]] = {
    cls.type: cls for cls in (ExcludeVarsFilter, ClipFilter, GaussianFilter, PercentileFilter)
}


def site_filter(spec: Mapping[str, Any], where: str = "plan") -> SiteFilter:
    """The filter a plan's entry (``{"type": ..., its parameters}``) names."""
    kind = spec.get("type")
    cls = FILTERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise FlareAirflowError(f"{where}: unknown filter type {kind!r}; the filters are {', '.join(FILTERS)}")
    params = {k: v for k, v in spec.items() if k != "type"}
    unknown = sorted(set(params) - {f.name for f in fields(cls)})
    if unknown:
        raise FlareAirflowError(
            f"{where}: {', '.join(map(repr, unknown))} is not a parameter of the {kind} filter; it takes "
            f"{', '.join(f.name for f in fields(cls)) or 'none'}"
        )
    return cls(**params)


def frozen_unchanged(
    params: Params,
    global_params: Params,
    *,
    diff_update: bool,
    frozen: Sequence[str],
    exclude: frozenset[str] | set[str],
    where: str,
) -> frozenset[str]:
    """The float tensors of ``params`` that ``frozen`` (glob patterns) names, each checked unchanged:
    the global model's bytes (FULL) or all zero (DIFF). A frozen tensor the trainer moved is refused
    here, at the site (fail closed): outside the filters, its change would leave unclipped and unnoised."""
    names = sorted(
        n
        for n, a in params.items()
        if n not in exclude and is_float(a.dtype) and any(fnmatch.fnmatchcase(n, p) for p in frozen)
    )
    for name in names:
        arr = params[name]
        moved = (
            bool(np.any(arr.astype(np.float64) != 0)) if diff_update else arr.tobytes() != global_params[name].tobytes()
        )
        if moved:
            raise PrivacyRefused(
                f"{where}: tensor {name!r} differs from the global model's, but the job's strategy keeps it frozen "
                f"(patterns {', '.join(map(repr, frozen))}); the update is not published. Freeze those tensors in "
                "the trainer (the Client API's get_lora()['frozen'] names them)"
            )
    return frozenset(names)


@dataclass
class FilterResult:
    """A filtered update and what was done to it (kept in the update's record and the site's summary)."""

    params: Params
    applied: list[dict[str, Any]]
    excluded: list[str]
    changed: bool
    release_id: str | None = None  # set when a noising step ran (:func:`release_id`)


def apply_filters(
    params: Params,
    global_params: Params,
    *,
    diff_update: bool,
    steps: Sequence[SiteFilter],
    key: bytes | None,
    public_tensors: Sequence[str] = (),
    frozen: Sequence[str] = (),
    where: str = "update",
) -> FilterResult:
    """Apply ``steps`` in order to an update (FULL: ``diff_update`` False; DIFF: True).

    Non-float tensors leave only when named in ``public_tensors`` or excluded (then they carry the
    global model's values); otherwise :class:`PrivacyRefused`. A plan with a noising filter needs
    ``key`` (:func:`noise_key`): each noising step draws from :func:`release_noise_key` of it and
    the digest of the clipped update it noises. The result has the update's names, shapes and
    dtypes; an update no filter changed is returned as the very same arrays.

    ``frozen`` (glob patterns, the strategy's frozen tensors: FFA-LoRA's A matrices) are tensors the
    strategy does not train: each must equal the global model's bit for bit (FULL) or be all zero
    (DIFF), else :class:`PrivacyRefused`; they then leave as they are, outside the filters. Clipping
    is unchanged by that (their difference is zero) and noise goes only to the trained tensors --
    noised, a frozen tensor would move and the strategy would reject the whole update. Leaving them
    out is safe only because they are checked: what leaves of them is the global model's own values.
    """
    exclude: set[str] = set()
    for step in steps:
        exclude |= step.excludes(list(params))
    private_ints = sorted(
        n for n, a in params.items() if not is_float(a.dtype) and n not in exclude and n not in public_tensors
    )
    if private_ints:
        raise PrivacyRefused(
            f"{where}: tensor(s) {', '.join(map(repr, private_ints[:10]))} are not floating-point, so no filter can "
            "clip or noise them, and they are not declared public; add them to the site's privacy.public_tensors "
            "(if they reveal nothing of the site's data) or to an exclude_vars filter"
        )
    if any(s.noise() is not None for s in steps) and key is None:
        raise PrivacyRefused(f"{where}: the plan adds noise but no noise key was given (the site's noise secret)")
    kept = frozen_unchanged(params, global_params, diff_update=diff_update, frozen=frozen, exclude=exclude, where=where)
    # The float64 difference to the global model; excluded tensors are zero from the start.
    diff: dict[str, np.ndarray] = {}
    for name, arr in params.items():
        if name in exclude or name in kept:
            continue
        if is_float(arr.dtype):
            d = arr.astype(np.float64)
            if not diff_update:
                d -= global_params[name].astype(np.float64)
            diff[name] = d
    update = UpdateInFilter(diff=diff, excluded=frozenset(exclude), key=key, changed=bool(exclude))
    for index, step in enumerate(steps):
        step.apply(update, index)
    applied, digests = update.applied, update.digests
    if not update.changed:
        return FilterResult(params=params, applied=applied, excluded=[], changed=False)
    out: Params = {}
    for name, arr in params.items():
        if name in exclude:
            out[name] = np.zeros_like(arr) if diff_update else np.array(global_params[name], copy=True)
        elif name in kept:
            out[name] = arr
        elif is_float(arr.dtype):
            d = diff[name] if diff_update else diff[name] + global_params[name].astype(np.float64)
            out[name] = d.astype(arr.dtype)
        else:
            out[name] = arr
    rid = release_id(key, digests) if digests and key is not None else None
    return FilterResult(params=out, applied=applied, excluded=sorted(exclude), changed=True, release_id=rid)
