"""Benchmarks of kvtier's data path, run as ``kvtier-bench <name>`` (see :mod:`kvtier.bench.cli`).

``reload`` (:mod:`kvtier.bench.reload`): save a prompt's KV from engine blocks into the tiers and
reload it into other blocks, next to a raw memcpy and the naive per-block copy, with a row per
chunk-checksum candidate on a CPU. ``ttft`` (:mod:`kvtier.bench.ttft_tiers`): time to first token
by where the KV comes from. ``overhead`` (:mod:`kvtier.bench.overhead`): a mixed batch's
throughput with kvtier saving and no hits, against no connector.

The benches import downward only: :mod:`kvtier.bench.cli` on top, each bench below it, then its
own lower modules (a report, the types it shares with the report), and :mod:`kvtier.bench.common`
(errors, progress lines, token counts, plots) at the bottom.
"""
