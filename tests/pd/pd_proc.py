"""One engine's worker half (:func:`pd_workers.make_engine`) in a process of its own, driven over
a pipe, so that a test can kill it with SIGKILL mid-transfer (its NIXL agent and sockets die with
it, as an engine's would). See test_pd_kill.py."""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")


def engine_main(conn, tmp_path, name: str, seed: int, config: dict) -> None:
    sys.path.insert(0, os.path.dirname(__file__))
    from pd_workers import make_engine, publish, remote_job
    from kvtier.jobs import SaveJob

    engine = make_engine(tmp_path, name, seed, **config)
    if config.get("pd_transport") == "nixl":
        assert engine.side.nixl_ready()
    conn.send(engine.endpoint if engine.side.chunk_server else None)
    while True:
        cmd, *args = conn.recv()
        if cmd == "publish":  # (tokens, blocks, transfer id): the whole prompt in one step
            conn.send(publish(engine, *args))
        elif cmd == "publish_part":  # (keys, blocks, transfer id): some sealed chunks, more to come
            keys, blocks, transfer_id = args
            engine.side.save((SaveJob("p", tuple(keys), tuple(blocks), publish=transfer_id),))
            engine.side.transfers.drain()
            conn.send(True)
        elif cmd == "fetch":  # (req id, tokens, blocks, transfer id, endpoint, wait): start, do not wait
            req_id, tokens, blocks, transfer_id, endpoint, wait = args
            engine.side.start_loads((remote_job(req_id, tokens, blocks, transfer_id, endpoint, wait=wait),))
            conn.send(True)
        elif cmd == "blocks":
            conn.send(engine.blocks(args[0]))
        elif cmd == "close":
            engine.side.close()
            conn.send(True)
            return
        else:
            conn.send(f"unknown command {cmd}")
        time.sleep(0)
