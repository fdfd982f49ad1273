"""`make airflow`'s launcher: a restart right after Ctrl-C, and no zombies while it runs (issue 37 #5, #6)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

from flare_airflow.ui.local import port_in_use


def test_a_port_whose_connections_linger_in_time_wait_is_free() -> None:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    assert port_in_use(port)  # listening: in use
    # The server side closes first, as an api-server stopped by Ctrl-C does: its end of the
    # connection stays in TIME_WAIT on the port, which a bind without SO_REUSEADDR refuses.
    accepted.close()
    server.close()
    client.close()
    assert not port_in_use(port)


def test_orphans_reparented_to_the_launcher_are_reaped() -> None:
    # In a process of its own: the subreaper setting is per process and this one must stay as it is.
    script = textwrap.dedent(
        """
        import os, pathlib, subprocess, time
        from flare_airflow.ui.local import become_subreaper, reap_orphans

        def zombies():
            found = []
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                state, ppid = stat[stat.rfind(")") + 2 :].split()[:2]
                if state == "Z" and int(ppid) == os.getpid():
                    found.append(int(pid))
            return found

        become_subreaper()
        keep = subprocess.Popen(["sleep", "0"])  # a component: its status is its Popen's
        # A task that leaves a child behind and exits: the child is re-parented here and ends.
        subprocess.run(["sh", "-c", "sleep 0.2 & exit 0"], check=True)
        time.sleep(1)
        before = zombies()
        assert len(before) == 2, before
        reaped = reap_orphans({keep.pid})
        assert zombies() == [keep.pid], zombies()
        assert keep.wait() == 0
        print("reaped", reaped)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "reaped 1"
