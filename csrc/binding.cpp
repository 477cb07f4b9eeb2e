// Python binding of csrc/kv_copy.cu. Plain pybind11 over integers (addresses, sizes, stream
// handles) so it builds without the heavy torch headers; kvtier/ops/cuda_ops.py passes
// tensor.data_ptr() and stream.cuda_stream.
#include <pybind11/pybind11.h>

#include <cstdint>

namespace kvtier {
void kv_copy(int64_t anchor, int64_t regions, int64_t blocks, int64_t ids, int64_t sums, int64_t R, int64_t T,
             bool gather, bool checksum, int64_t ctas, int64_t threads, int64_t stream);
void memcpy_batch(int64_t dsts, int64_t srcs, int64_t sizes, int64_t count, int64_t stream);
void memcpy_loop(int64_t dsts, int64_t srcs, int64_t sizes, int64_t count, int64_t stream);
bool has_memcpy_batch();
}  // namespace kvtier

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvtier KV block copy kernels (see csrc/kv_copy.cu)";
  m.def("kv_copy", &kvtier::kv_copy, "Enqueue the gather/scatter kernel of a CopyPlan.");
  m.def("memcpy_batch", &kvtier::memcpy_batch, "cudaMemcpyBatchAsync of count (dst, src, size) host arrays.");
  m.def("memcpy_loop", &kvtier::memcpy_loop, "One cudaMemcpyAsync per (dst, src, size).");
  m.def("has_memcpy_batch", &kvtier::has_memcpy_batch, "Whether cudaMemcpyBatchAsync was compiled in.");
}
