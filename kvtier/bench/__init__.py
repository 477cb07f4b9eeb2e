"""Benchmarks of kvtier's data path, run as ``kvtier-bench <name>`` (see :mod:`kvtier.bench.cli`).

``reload`` (:mod:`kvtier.bench.reload`): save a prompt's KV from engine blocks into the tiers and
reload it into other blocks, next to a raw memcpy and the naive per-block copy, with a row per
chunk-checksum candidate on a CPU. ``ttft`` (:mod:`kvtier.bench.ttft_tiers`): time to first token
by where the KV comes from. ``overhead`` (:mod:`kvtier.bench.overhead`): a mixed batch's
throughput with kvtier saving and no hits, against no connector.
"""

import os

NO_MATPLOTLIB = "matplotlib is not installed; skipped the plot (pip install matplotlib)."


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend, or None when matplotlib is not installed
    (a bench then skips its plot with :data:`NO_MATPLOTLIB`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(fig, path: str, dpi: int = 120) -> None:
    """Lay ``fig`` out, write it to ``path`` (PNG; its folder made if missing) and free it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


class BenchError(RuntimeError):
    """The bench could not measure what it set out to: a chunk not stored, a load that failed."""


class VerifyError(BenchError):
    """Reloaded blocks differ from the saved ones."""
