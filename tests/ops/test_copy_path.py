"""The copy-path rule, as a pure function of the paths it is told run here (no GPU needed)."""

from kvtier.ops import cuda_ops, triton_ops
from kvtier.ops.copy_path import STAGED_MIN_BYTES, CopyPath, choose_path

ALL = ("triton", "cuda", "dma")


def test_busy_gpu_or_large_batch_takes_staged_dma():
    assert choose_path(gpu_busy=True, batch_bytes=1, paths=ALL) == CopyPath("dma", None, "staged")
    assert choose_path(gpu_busy=False, batch_bytes=STAGED_MIN_BYTES, paths=ALL) == CopyPath("dma", None, "staged")


def test_idle_gpu_and_small_batch_takes_a_zero_copy_kernel():
    small = STAGED_MIN_BYTES - 1
    assert choose_path(gpu_busy=False, batch_bytes=small, paths=ALL) == CopyPath("triton", triton_ops.DEFAULT_MAX_CTAS)
    assert choose_path(gpu_busy=False, batch_bytes=small, paths=("cuda", "dma")) == CopyPath("cuda", cuda_ops.DEFAULT_MAX_CTAS)


def test_busy_gpu_without_staging():
    assert choose_path(gpu_busy=True, batch_bytes=1, paths=ALL, staging=False) == CopyPath("dma", None, "batch")
    assert choose_path(gpu_busy=True, batch_bytes=1, paths=("triton", "dma"), staging=False) == CopyPath("triton", 4)
    assert choose_path(gpu_busy=True, batch_bytes=1, paths=("cuda",), staging=False) == CopyPath("cuda", 1)


def test_no_cuda_path_takes_torch():
    assert choose_path(gpu_busy=True, batch_bytes=1 << 30, paths=()) == CopyPath("torch")
