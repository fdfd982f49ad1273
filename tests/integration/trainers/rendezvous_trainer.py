"""A distributed trainer in miniature: every rank receives the global model, rank 0 gathers each
rank's number over TCP at MASTER_ADDR:MASTER_PORT (torchrun's variables), then every rank sends;
only rank 0's send() writes the site's update (global + world size). Ranks listed in
``--die-rank`` SIGKILL themselves after a second (a node's process dying mid-job)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time

import flare_airflow.client as flare


def gather(rank: int, world: int, addr: str, port: int) -> list[int]:
    if rank == 0:
        server = socket.create_server(("0.0.0.0", port))
        server.settimeout(60)
        got = [0]
        for _ in range(world - 1):
            conn, _ = server.accept()
            got.append(int(conn.recv(16)))
            conn.close()
        return sorted(got)
    for _ in range(300):
        try:
            with socket.create_connection((addr, port), timeout=1) as conn:
                conn.sendall(str(rank).encode())
            return []
        except OSError:
            time.sleep(0.1)
    sys.exit(f"rank {rank} could not reach rank 0 at {addr}:{port}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--die-rank", type=int, action="append", default=[])
    args = p.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank in args.die_rank:
        time.sleep(1)
        os.kill(os.getpid(), signal.SIGKILL)
    if args.die_rank:
        time.sleep(300)
    model = flare.receive()
    ranks = gather(rank, world, os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    if rank == 0:
        print(f"rank 0 of {world} at {os.environ['MASTER_ADDR']} gathered {ranks}", flush=True)
    params = {k: v + world for k, v in model.params.items()}
    flare.send(flare.FLModel(params=params, meta={"num_samples": world}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
