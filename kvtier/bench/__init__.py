"""Benchmarks of kvtier's data path, run as ``kvtier-bench <name>`` (see :mod:`kvtier.bench.cli`).

``reload`` (:mod:`kvtier.bench.reload`): save a prompt's KV from engine blocks into the tiers and
reload it into other blocks, next to a raw memcpy and the naive per-block copy, with a row per
chunk-checksum candidate on a CPU. ``ttft`` (:mod:`kvtier.bench.ttft_tiers`): time to first token
by where the KV comes from. ``overhead`` (:mod:`kvtier.bench.overhead`): a mixed batch's
throughput with kvtier saving and no hits, against no connector.
"""

import os
import sys
import time

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


def token_lengths(parser, text: str, parse_tokens, flag: str = "--prompt-lens") -> list[int]:
    """``8k,32k`` -> ``[8192, 32768]``; a bad item stops the command with one sentence naming ``flag``."""
    try:
        lengths = [parse_tokens(x) for x in text.split(",") if x.strip()]
    except Exception as exc:  # noqa: BLE001 - argparse.ArgumentTypeError, with its own sentence
        parser.error(f"argument {flag}: {exc}")
    if not lengths:
        parser.error(f"argument {flag}: give at least one length, e.g. 8k,32k.")
    return lengths


def names_from(parser, text: str, allowed, flag: str = "--engines") -> list[str]:
    """``a,b`` -> ``["a", "b"]``, each one of ``allowed``; else the command stops naming ``flag``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in allowed for n in names):
        parser.error(f"argument {flag}: choose from {', '.join(allowed)}.")
    return names


def progress_printer(name: str):
    """``progress(message)``: a line on stderr with the seconds since this call, for ``kvtier-bench name``."""
    start = time.perf_counter()

    def progress(message: str) -> None:
        print(f"kvtier-bench {name} [{time.perf_counter() - start:6.1f}s] {message}", file=sys.stderr, flush=True)

    progress.start = start
    return progress


class BenchError(RuntimeError):
    """The bench could not measure what it set out to: a chunk not stored, a load that failed."""


class VerifyError(BenchError):
    """Reloaded blocks differ from the saved ones."""
