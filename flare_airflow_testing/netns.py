"""Network namespaces for the sites-at-the-sites tier: a central namespace and one per site.

The central namespace holds PostgreSQL, the Airflow components and the S3 endpoint; each site's
namespace holds only its Edge worker. Each site is joined to the central namespace by a veth pair
of its own (a /30), the test process (the root namespace) by another. Nothing forwards between
links (``net.ipv4.ip_forward`` is 0 in every new namespace): a site reaches the central side's
address on its link and nothing else -- not another site, not the root namespace, not the
internet. Every address used lives in a namespace this class created; they are removed with it.
"""

from __future__ import annotations

import contextlib
import random
import secrets
import subprocess


def _ip(*args: str) -> None:
    out = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {out.stderr.strip()}")


class Namespaces:
    def __init__(self, sites: list[str]) -> None:
        tag = secrets.token_hex(2)
        net = random.randint(100, 250)  # a test subnet of its own, not a secret
        self.central = f"flc{tag}"
        self.site_ns = {site: f"fls{tag}{i}" for i, site in enumerate(sites, 1)}
        self.central_addr = f"10.{net}.0.2"  # the central side, as the test process sees it
        self.site_peer = {site: f"10.{net}.{i}.1" for i, site in enumerate(sites, 1)}  # as site i sees it
        self.site_addr = {site: f"10.{net}.{i}.2" for i, site in enumerate(sites, 1)}
        self._made: list[str] = []
        try:
            self._add(self.central)
            _ip("link", "add", f"fl{tag}r0", "type", "veth", "peer", "name", f"fl{tag}c0", "netns", self.central)
            _ip("addr", "add", f"10.{net}.0.1/30", "dev", f"fl{tag}r0")
            _ip("link", "set", f"fl{tag}r0", "up")
            _ip("-n", self.central, "addr", "add", f"{self.central_addr}/30", "dev", f"fl{tag}c0")
            _ip("-n", self.central, "link", "set", f"fl{tag}c0", "up")
            for i, site in enumerate(sites, 1):
                ns = self.site_ns[site]
                self._add(ns)
                c, s = f"fl{tag}c{i}", f"fl{tag}s{i}"
                _ip("-n", self.central, "link", "add", c, "type", "veth", "peer", "name", s, "netns", ns)
                _ip("-n", self.central, "addr", "add", f"{self.site_peer[site]}/30", "dev", c)
                _ip("-n", self.central, "link", "set", c, "up")
                _ip("-n", ns, "addr", "add", f"{self.site_addr[site]}/30", "dev", s)
                _ip("-n", ns, "link", "set", s, "up")
        except BaseException:
            self.remove()
            raise

    def _add(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        _ip("-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def prefix(ns: str) -> list[str]:
        """The argv prefix that runs a command in namespace ``ns`` with a mount namespace of its own.

        Not ``ip netns exec``: it remounts /sys as a fresh sysfs, without the cgroup hierarchies
        under /sys/fs/cgroup, and a container engine's runtime then fails (runc: "no cgroup mount
        found in mountinfo") -- docs/deploy-across-sites.md, "Container sites at a site". The
        private mount namespace (``unshare --mount``, mounts propagating in from the host but never
        out) keeps what a worker mounts, such as a site's data tmpfs, to its own processes.
        """
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--mount", "--propagation", "slave"]

    def remove(self) -> None:
        """Delete the namespaces (their veth ends go with them); call after their processes ended."""
        for ns in reversed(self._made):
            with contextlib.suppress(RuntimeError):
                _ip("netns", "del", ns)
        self._made.clear()
