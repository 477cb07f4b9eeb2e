"""``python -m kvtier.ops.build``: compile the CUDA C++ copy kernels ahead of time.

An engine never compiles at start-up (see :func:`kvtier.ops.cuda_ops.allow_build`): until this has
run once on a machine (for these sources, this torch and this CUDA), its copies use the Triton
kernels, which are as fast for whole-chunk copies. Prints where the build went; exit status 1 if
it could not be built (the reason is printed).
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    from kvtier.ops import cuda_ops

    begin = time.perf_counter()
    if cuda_ops.available():
        print(f"kvtier CUDA copy kernels ready in {cuda_ops.build_directory()} ({time.perf_counter() - begin:.1f} s)")
        return 0
    print(f"kvtier CUDA copy kernels not built: {cuda_ops.build_error()}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
