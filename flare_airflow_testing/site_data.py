"""Start a site's worker with the site's data on a disk only it sees (run inside the site's namespaces).

    python flare_airflow_testing/site_data.py DIR SITE TRAINER [TRAINER ARGS...] -- WORKER ARGV...

Mounts a fresh tmpfs (mode 0700) at DIR -- in the mount namespace of its own that the site's
prefix (``unshare --mount``, flare_airflow_testing/netns.py) gave this process, whose mounts do not
propagate back -- writes SITE's training shard there with the
trainer's ``--export-site``, then becomes the worker. Processes outside the namespace see DIR as
the empty directory it is on the host: the site's data file can be opened only by the worker and
the task processes it starts.
"""

from __future__ import annotations

import os
import subprocess
import sys


def main(argv: list[str]) -> int:
    split = argv.index("--")
    (folder, site, *trainer), worker = argv[:split], argv[split + 1 :]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0700,size=64m", "tmpfs", folder], check=True)
    path = os.path.join(folder, f"{site}.npz")
    subprocess.run([sys.executable, *trainer, "--export-site", site, path], check=True)
    os.chmod(path, 0o600)
    os.execv(worker[0], worker)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
