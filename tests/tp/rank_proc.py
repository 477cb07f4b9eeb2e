"""One TP rank of kvtier's worker half in its own process: its own KV memory, store and reporter
(rank 0 also serves lookups), driven over a pipe by the test. See test_commit.py."""

from __future__ import annotations

import logging
import os
import time

os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

NUM_BLOCKS = 64
BLOCK = 16  # tokens per block
CHUNK_BLOCKS = 2


def rank_main(conn, rank: int, world_size: int, endpoint: str, config: dict) -> None:
    import torch

    from kvtier.config import KvtierConfig
    from kvtier.engines.vllm.worker_side import WorkerSide
    from kvtier.jobs import LoadJob, SaveJob

    logging.basicConfig(level=logging.WARNING, format=f"rank{rank} %(levelname)s %(name)s: %(message)s")
    torch.manual_seed(100 + rank)  # each rank holds its own shard of the KV: different bytes
    alloc = torch.randn(NUM_BLOCKS, 2, 2, BLOCK, 16)
    side = WorkerSide(KvtierConfig.from_dict(config), "tiny", BLOCK, NUM_BLOCKS, endpoint, rank, world_size)
    side.register({f"l{i}": alloc[:, i] for i in range(2)})
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "save":
            keys, block_ids = args
            side.save((SaveJob("r", tuple(keys), tuple(block_ids)),))
            side.transfers.drain()
            side.reporter.flush()
            conn.send(side.transfers.stats.saved_chunks)
        elif cmd == "fail_saves":  # every store.put on this rank raises, as a full or broken device would
            def broken_put(keys, buffers):
                raise OSError("injected: device gone")
            side.store.put = broken_put
            conn.send(True)
        elif cmd == "heal_saves":
            del side.store.put
            conn.send(True)
        elif cmd == "holds":  # which of these chain keys this rank's store holds, by tier
            conn.send([None if (t := side.store.contains(side.transfers.skey(k))) is None else t.value
                       for k in args[0]])
        elif cmd == "file_of":  # the disk file holding this rank's copy of a chain key
            from kvtier.storage import _lmcache as lm

            store = side.store
            key = lm.engine_key(side.transfers.skey(args[0]), store._config)
            deadline = time.monotonic() + 30
            while (meta := store._disk.backend.dict.get(key)) is None and time.monotonic() < deadline:
                time.sleep(0.01)  # LMCache writes disk copies on its own thread
            conn.send(None if meta is None else meta.path)
        elif cmd == "load":
            keys, block_ids, source_ids = args
            req = f"load-{time.monotonic_ns()}"
            side.start_loads((LoadJob(req, tuple(keys), 0, tuple(block_ids)),))
            while req not in side.finished_loads():
                time.sleep(0.001)
            failed = side.failed_blocks()
            ok = [b for b in block_ids if b not in failed]
            same = torch.equal(alloc[ok], alloc[source_ids[: len(ok)]])
            side.reporter.flush()
            conn.send((sorted(failed), same))
        elif cmd == "stats":
            conn.send(side.take_stats())
        elif cmd == "close":
            side.close()
            conn.send(True)
            return
