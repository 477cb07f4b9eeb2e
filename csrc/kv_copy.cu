// kvtier: gather/scatter of paged KV blocks <-> chunk buffers (pinned host memory over UVA, or
// device memory), with the KVSUM64 checksum computed during the copy. Same descriptor tables and
// semantics as the Triton kernel in kvtier/ops/triton_ops.py (see CopyPlan there):
//   regions int64 [R, 4]: base, stride, size, prefix        (16-byte units; base from `anchor`)
//   blocks  int64 [T, 5]: span, j, write, payload, n        (payload in 16-byte units from `anchor`)
//   ids     int64 [T]   : engine block id per block row
// A unit u < R*T is region u / T of block row u % T; the warps of a persistent grid of `ctas`
// CTAs stride over units, so the copy occupies a bounded number of SMs.
// Also: batched DMA of scattered blocks (cudaMemcpyBatchAsync) and a per-block cudaMemcpyAsync loop.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace kvtier {
namespace {

constexpr int kUnroll = 8;  // 16-byte vectors in flight per thread: 4 KiB per warp

struct Unit {
  int64_t base, stride, vecs, prefix, span, j, write, payload, n, bid;
};

// Raw descriptor values of unit u; loaded one unit ahead so their latency overlaps a copy.
__device__ __forceinline__ Unit load_unit(const int64_t* __restrict__ regions, const int64_t* __restrict__ blocks,
                                          const int64_t* __restrict__ ids, int64_t u, int64_t T, int64_t total) {
  Unit d{};
  if (u < total) {
    const int64_t r = u / T, b = u - r * T;
    d.base = __ldg(regions + r * 4);
    d.stride = __ldg(regions + r * 4 + 1);
    d.vecs = __ldg(regions + r * 4 + 2);
    d.prefix = __ldg(regions + r * 4 + 3);
    d.span = __ldg(blocks + b * 5);
    d.j = __ldg(blocks + b * 5 + 1);
    d.write = __ldg(blocks + b * 5 + 2);
    d.payload = __ldg(blocks + b * 5 + 3);
    d.n = __ldg(blocks + b * 5 + 4);
    d.bid = __ldg(ids + b);
  }
  return d;
}

// KVSUM64 term of 32-bit word w at word index i of the chunk payload (kvtier/ops/checksum.py).
__device__ __forceinline__ uint64_t term(uint32_t w, uint32_t i) {
  uint32_t h = i * 0x9E3779B1u;
  h ^= h >> 16;
  h *= 0x85EBCA6Bu;
  h ^= h >> 13;
  return static_cast<uint64_t>(w) * (h | 1u);
}

__device__ __forceinline__ uint64_t vec_terms(const uint4& v, uint32_t i) {
  return term(v.x, i) + term(v.y, i + 1) + term(v.z, i + 2) + term(v.w, i + 3);
}

// One warp per unit: each warp walks its own units, so a CTA keeps (warps x 32 x kUnroll x 16 B)
// in flight (64 KiB at 512 threads) without any CTA-wide barrier, and a few fat CTAs (few SMs
// taken from the model) can saturate PCIe or outrun the copy engines when packing for DMA.
template <bool kGather, bool kChecksum>
__global__ void __launch_bounds__(512) kv_copy_kernel(uint4* anchor, const int64_t* __restrict__ regions,
                                                       const int64_t* __restrict__ blocks, const int64_t* __restrict__ ids,
                                                       unsigned long long* sums, int64_t R, int64_t T) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = blockDim.x >> 5;
  const int64_t workers = gridDim.x * warps;
  const int64_t total = R * T;
  int64_t u = blockIdx.x * warps + (threadIdx.x >> 5);
  Unit cur = load_unit(regions, blocks, ids, u, T, total);
  for (; u < total; u += workers) {
    const Unit nxt = load_unit(regions, blocks, ids, u + workers, T, total);
    const int64_t eng = cur.base + cur.bid * cur.stride;
    const int64_t pos = cur.n * cur.prefix + cur.j * cur.vecs;  // 16-byte units inside the payload
    const int64_t chk = cur.payload + pos;
    const uint4* src = anchor + (kGather ? eng : chk);
    uint4* dst = anchor + (kGather ? chk : eng);
    const bool write = cur.write != 0;
    const int64_t nv = cur.vecs;
    uint64_t acc = 0;
    for (int64_t i0 = lane; i0 < nv; i0 += 32 * kUnroll) {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {  // all loads first: kUnroll * 16 B in flight per thread
        const int64_t i = i0 + 32 * k;
        v[k] = i < nv ? __ldcs(src + i) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t i = i0 + 32 * k;
        if (i < nv) {
          if (write) __stcs(dst + i, v[k]);
          if (kChecksum) acc += vec_terms(v[k], static_cast<uint32_t>((pos + i) * 4));
        }
      }
    }
    if (kChecksum) {
      for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, o);
      if (lane == 0) atomicAdd(sums + cur.span, static_cast<unsigned long long>(acc));
    }
    cur = nxt;
  }
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
}

}  // namespace

void kv_copy(int64_t anchor, int64_t regions, int64_t blocks, int64_t ids, int64_t sums, int64_t R, int64_t T,
             bool gather, bool checksum, int64_t ctas, int64_t threads, int64_t stream) {
  if (threads < 32 || threads > 512 || threads % 32) throw std::invalid_argument("threads must be a multiple of 32 in [32, 512]");
  if (R <= 0 || T <= 0) return;
  const int64_t warps = threads / 32;
  const int64_t grid = std::max<int64_t>(1, std::min<int64_t>(ctas, (R * T + warps - 1) / warps));
  auto* a = reinterpret_cast<uint4*>(anchor);
  auto* rg = reinterpret_cast<const int64_t*>(regions);
  auto* bl = reinterpret_cast<const int64_t*>(blocks);
  auto* id = reinterpret_cast<const int64_t*>(ids);
  auto* sm = reinterpret_cast<unsigned long long*>(sums);
  auto st = reinterpret_cast<cudaStream_t>(stream);
  const dim3 g(static_cast<unsigned>(grid)), b(static_cast<unsigned>(threads));
  if (gather && checksum) kv_copy_kernel<true, true><<<g, b, 0, st>>>(a, rg, bl, id, sm, R, T);
  else if (gather) kv_copy_kernel<true, false><<<g, b, 0, st>>>(a, rg, bl, id, sm, R, T);
  else if (checksum) kv_copy_kernel<false, true><<<g, b, 0, st>>>(a, rg, bl, id, sm, R, T);
  else kv_copy_kernel<false, false><<<g, b, 0, st>>>(a, rg, bl, id, sm, R, T);
  check(cudaGetLastError(), "kvtier kv_copy launch");
}

// count copies; dsts/srcs/sizes are host arrays of int64 (addresses and byte counts).
// stream must not be the legacy default stream (cudaMemcpyBatchAsync refuses it).
void memcpy_batch(int64_t dsts, int64_t srcs, int64_t sizes, int64_t count, int64_t stream) {
  auto* d = reinterpret_cast<void**>(dsts);
  auto* s = reinterpret_cast<void**>(srcs);
  auto* n = reinterpret_cast<size_t*>(sizes);
  auto st = reinterpret_cast<cudaStream_t>(stream);
#if CUDART_VERSION >= 12080
  cudaMemcpyAttributes attr = {};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;  // a hint: keep the copy engines, not SMs
  size_t attr_index = 0;
  constexpr int64_t kMaxBatch = 1 << 16;
  for (int64_t at = 0; at < count; at += kMaxBatch) {
    const size_t c = static_cast<size_t>(std::min(kMaxBatch, count - at));
#if CUDART_VERSION >= 13000
    check(cudaMemcpyBatchAsync(d + at, s + at, n + at, c, &attr, &attr_index, 1, st), "cudaMemcpyBatchAsync");
#else
    size_t fail_index = 0;
    check(cudaMemcpyBatchAsync(d + at, s + at, n + at, c, &attr, &attr_index, 1, &fail_index, st), "cudaMemcpyBatchAsync");
#endif
  }
#else
  for (int64_t i = 0; i < count; ++i) check(cudaMemcpyAsync(d[i], s[i], n[i], cudaMemcpyDefault, st), "cudaMemcpyAsync");
#endif
}

void memcpy_loop(int64_t dsts, int64_t srcs, int64_t sizes, int64_t count, int64_t stream) {
  auto* d = reinterpret_cast<void**>(dsts);
  auto* s = reinterpret_cast<void**>(srcs);
  auto* n = reinterpret_cast<size_t*>(sizes);
  auto st = reinterpret_cast<cudaStream_t>(stream);
  for (int64_t i = 0; i < count; ++i) check(cudaMemcpyAsync(d[i], s[i], n[i], cudaMemcpyDefault, st), "cudaMemcpyAsync");
}

bool has_memcpy_batch() { return CUDART_VERSION >= 12080; }

}  // namespace kvtier
