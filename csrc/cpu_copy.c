// Host gather/scatter between engine KV blocks and chunk buffers, with the KVSUM64 chunk checksum
// computed in the same pass (see kvtier/ops/checksum.py for its definition). Plain C, no Python or
// torch headers: kvtier/ops/cpu_ops.py compiles it with the system C compiler and calls it through
// ctypes, which releases the GIL for the whole call.
//
// A batch is a table of *units*, one per (region, chunk block): int64 [n_units, 5] =
//   engine address, chunk address, bytes, word index inside the chunk payload, span << 1 | write
// ``write`` 0 marks a unit that is only read for the checksum (the rest of a partially loaded
// chunk). Threads claim runs of about 1 MiB of units from a shared counter. ``kvt_copy2`` (at the
// end) sums each unit at two positions at once: a join of pieces checks them as it copies.
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define K1 0x9E3779B1u
#define K2 0x85EBCA6Bu
#define NT_MIN_BYTES 4096  // below this a streaming store's flush costs more than the cache it saves

static inline uint32_t weight(uint32_t i) {
    uint32_t h = i * K1;
    h ^= h >> 16;
    h *= K2;
    h ^= h >> 13;
    return h | 1u;
}

static uint64_t scalar_words(const uint32_t *src, uint32_t *dst, int64_t words, uint32_t pos, int sum) {
    uint64_t acc = 0;
    for (int64_t i = 0; i < words; i++) {
        uint32_t x = src[i];
        if (dst) dst[i] = x;
        if (sum) acc += (uint64_t)x * weight(pos + (uint32_t)i);
    }
    return acc;
}

// One step of KVSUM64 over eight words ``x`` at word positions ``idx``: the accumulator after it.
__attribute__((target("avx2"))) static inline __m256i weighted8(__m256i acc, __m256i idx, __m256i x) {
    const __m256i k1 = _mm256_set1_epi32((int)K1), k2 = _mm256_set1_epi32((int)K2), one = _mm256_set1_epi32(1);
    __m256i h = _mm256_mullo_epi32(idx, k1);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
    h = _mm256_mullo_epi32(h, k2);
    h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
    h = _mm256_or_si256(h, one);
    acc = _mm256_add_epi64(acc, _mm256_mul_epu32(x, h));  // even lanes
    return _mm256_add_epi64(acc, _mm256_mul_epu32(_mm256_srli_epi64(x, 32), _mm256_srli_epi64(h, 32)));
}

__attribute__((target("avx2"))) static inline uint64_t lanes_total(__m256i acc) {
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

__attribute__((target("avx2"))) static inline __m256i positions8(uint32_t pos) {
    return _mm256_add_epi32(_mm256_set1_epi32((int)pos), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// Eight words from ``src``, written to ``dst`` (a streaming store where ``stream``) unless it is NULL.
__attribute__((target("avx2"))) static inline __m256i copy8(const uint32_t *src, uint32_t *dst, int stream) {
    __m256i x = _mm256_loadu_si256((const __m256i *)src);
    if (stream)
        _mm256_stream_si256((__m256i *)dst, x);
    else if (dst)
        _mm256_storeu_si256((__m256i *)dst, x);
    return x;
}

__attribute__((target("avx2"))) static uint64_t avx2_words(const uint32_t *src, uint32_t *dst, int64_t words,
                                                            uint32_t pos, int sum) {
    int64_t n = words & ~(int64_t)7;
    int stream = dst && ((uintptr_t)dst & 31) == 0 && words * 4 >= NT_MIN_BYTES;
    __m256i acc = _mm256_setzero_si256(), idx = positions8(pos);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int64_t i = 0; i < n; i += 8) {
        __m256i x = copy8(src + i, dst ? dst + i : NULL, stream);
        if (sum) {
            acc = weighted8(acc, idx, x);
            idx = _mm256_add_epi32(idx, eight);
        }
    }
    return lanes_total(acc) + scalar_words(src + n, dst ? dst + n : NULL, words - n, pos + (uint32_t)n, sum);
}

// Two KVSUM64s of the same words in one pass: at word positions ``pa`` (into *sa) and ``pb`` (into
// *sb), copying them to ``dst`` unless it is NULL. What a join of other ranks' pieces needs: each
// piece's own checksum (its words at their places in the piece) and the joined chunk's (at theirs).
__attribute__((target("avx2"))) static void avx2_words2(const uint32_t *src, uint32_t *dst, int64_t words,
                                                         uint32_t pa, uint32_t pb, uint64_t *sa, uint64_t *sb) {
    int64_t n = words & ~(int64_t)7;
    int stream = dst && ((uintptr_t)dst & 31) == 0 && words * 4 >= NT_MIN_BYTES;
    __m256i acc_a = _mm256_setzero_si256(), acc_b = _mm256_setzero_si256(), ia = positions8(pa), ib = positions8(pb);
    const __m256i eight = _mm256_set1_epi32(8);
    for (int64_t i = 0; i < n; i += 8) {
        __m256i x = copy8(src + i, dst ? dst + i : NULL, stream);
        acc_a = weighted8(acc_a, ia, x);
        acc_b = weighted8(acc_b, ib, x);
        ia = _mm256_add_epi32(ia, eight);
        ib = _mm256_add_epi32(ib, eight);
    }
    *sa += lanes_total(acc_a) + scalar_words(src + n, dst ? dst + n : NULL, words - n, pa + (uint32_t)n, 1);
    *sb += lanes_total(acc_b) + scalar_words(src + n, NULL, words - n, pb + (uint32_t)n, 1);
}

static void scalar_words2(const uint32_t *src, uint32_t *dst, int64_t words, uint32_t pa, uint32_t pb,
                          uint64_t *sa, uint64_t *sb) {
    *sa += scalar_words(src, dst, words, pa, 1);
    *sb += scalar_words(src, NULL, words, pb, 1);
}

#define GRAB_BYTES (1 << 20)  // units a thread claims at a time: about this many bytes

typedef struct {
    const int64_t *units;
    int64_t cols, n_units, grab;  // cols: 5 for kvt_copy's units, 7 for kvt_copy2's
    int64_t *next;  // shared: first unit nobody has claimed yet
    int gather, sum, avx2;
    uint64_t *sums;  // [n_sums], this thread's own
} run_t;

// kvt_copy's unit: engine address, chunk address, bytes, word index, span << 1 | write.
static void copy_unit(const run_t *r, const int64_t *t) {
    uint32_t *engine = (uint32_t *)(uintptr_t)t[0], *chunk = (uint32_t *)(uintptr_t)t[1];
    int64_t words = t[2] / 4, span = t[4] >> 1, write = t[4] & 1;
    const uint32_t *src = r->gather ? engine : chunk;
    uint32_t *dst = write ? (r->gather ? chunk : engine) : NULL;
    if (!r->sum && dst) {
        memcpy(dst, src, (size_t)t[2]);
        return;
    }
    r->sums[span] += r->avx2 ? avx2_words(src, dst, words, (uint32_t)t[3], r->sum)
                             : scalar_words(src, dst, words, (uint32_t)t[3], r->sum);
}

// kvt_copy2's unit: source, destination (0: only summed), bytes, position a, sum a, position b, sum b (-1: none).
static void copy_unit2(const run_t *r, const int64_t *t) {
    const uint32_t *src = (const uint32_t *)(uintptr_t)t[0];
    uint32_t *dst = (uint32_t *)(uintptr_t)t[1];
    int64_t words = t[2] / 4;
    if (t[6] < 0)
        r->sums[t[4]] += r->avx2 ? avx2_words(src, dst, words, (uint32_t)t[3], 1)
                                 : scalar_words(src, dst, words, (uint32_t)t[3], 1);
    else if (r->avx2)
        avx2_words2(src, dst, words, (uint32_t)t[3], (uint32_t)t[5], &r->sums[t[4]], &r->sums[t[6]]);
    else
        scalar_words2(src, dst, words, (uint32_t)t[3], (uint32_t)t[5], &r->sums[t[4]], &r->sums[t[6]]);
}

// Threads claim runs of units from a shared counter rather than fixed shares: on a machine where
// another process takes a core, the thread still running does the rest instead of waiting.
static void *run_units(void *arg) {
    run_t *r = (run_t *)arg;
    for (;;) {
        int64_t begin = __atomic_fetch_add(r->next, r->grab, __ATOMIC_RELAXED);
        if (begin >= r->n_units) break;
        int64_t end = begin + r->grab < r->n_units ? begin + r->grab : r->n_units;
        for (int64_t u = begin; u < end; u++) {
            if (r->cols == 5)
                copy_unit(r, r->units + 5 * u);
            else
                copy_unit2(r, r->units + 7 * u);
        }
    }
    if (r->avx2) _mm_sfence();  // streaming stores are globally visible before the call returns
    return NULL;
}

// Walks ``units`` (``cols`` int64 each) on up to ``threads`` threads, then adds each thread's
// sums into ``sums`` (uint64 [n_sums], wrapping) unless it is NULL. Returns 0, or -1 when out of memory.
static int walk_units(const int64_t *units, int64_t cols, int64_t n_units, int gather, uint64_t *sums, int64_t n_sums,
                      int threads) {
    if (n_units <= 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > n_units) threads = (int)n_units;
    int avx2 = __builtin_cpu_supports("avx2");
    run_t *runs = calloc((size_t)threads, sizeof(run_t));
    uint64_t *partial = calloc((size_t)threads * (size_t)(n_sums > 0 ? n_sums : 1), sizeof(uint64_t));
    pthread_t *ids = calloc((size_t)threads, sizeof(pthread_t));
    if (!runs || !partial || !ids) {
        free(runs); free(partial); free(ids);
        return -1;
    }
    int64_t total = 0, next = 0;
    for (int64_t u = 0; u < n_units; u++) total += units[cols * u + 2];
    int64_t grab = GRAB_BYTES / (total / n_units > 0 ? total / n_units : 1);
    if (grab < 1) grab = 1;
    for (int t = 0; t < threads; t++)
        runs[t] = (run_t){units, cols, n_units, grab, &next, gather, sums != NULL, avx2,
                          partial + (size_t)t * (size_t)n_sums};
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[t], NULL, run_units, &runs[t]) != 0) break;
        started = t;
    }
    run_units(&runs[0]);
    for (int t = started + 1; t < threads; t++) run_units(&runs[t]);  // threads that failed to start
    for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
    if (sums)
        for (int t = 0; t < threads; t++)
            for (int64_t s = 0; s < n_sums; s++) sums[s] += runs[t].sums[s];
    free(runs); free(partial); free(ids);
    return 0;
}

// Copies every unit (engine -> chunk when gather, else chunk -> engine) on up to ``threads``
// threads and, when ``sums`` is not NULL, adds each span's KVSUM64 terms to ``sums[span]``
// (uint64, wrapping). Bytes per unit must be a multiple of 4. Returns 0, or -1 when out of memory.
int kvt_copy(const int64_t *units, int64_t n_units, int gather, uint64_t *sums, int64_t n_spans, int threads) {
    return walk_units(units, 5, n_units, gather, sums, n_spans, threads);
}

// Walks ``units``, int64 [n_units, 7] = source address, destination address (0: only summed),
// bytes, word position a, sum index a, word position b, sum index b (-1: no second sum), on up to
// ``threads`` threads: copies each unit's words and adds their KVSUM64 terms at position a to
// ``sums[a]`` and at position b to ``sums[b]`` (uint64 [n_sums], wrapping). Bytes per unit must be
// a multiple of 4. Returns 0, or -1 when out of memory.
int kvt_copy2(const int64_t *units, int64_t n_units, uint64_t *sums, int64_t n_sums, int threads) {
    return walk_units(units, 7, n_units, 0, sums, n_sums, threads);
}
