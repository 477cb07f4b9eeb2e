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

__attribute__((target("avx2"))) static uint64_t avx2_words(const uint32_t *src, uint32_t *dst, int64_t words,
                                                            uint32_t pos, int sum) {
    int64_t n = words & ~(int64_t)7;
    int stream = dst && ((uintptr_t)dst & 31) == 0 && words * 4 >= NT_MIN_BYTES;
    __m256i acc = _mm256_setzero_si256();
    __m256i idx = _mm256_add_epi32(_mm256_set1_epi32((int)pos), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const __m256i eight = _mm256_set1_epi32(8), k1 = _mm256_set1_epi32((int)K1), k2 = _mm256_set1_epi32((int)K2);
    const __m256i one = _mm256_set1_epi32(1);
    for (int64_t i = 0; i < n; i += 8) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(src + i));
        if (stream)
            _mm256_stream_si256((__m256i *)(dst + i), x);
        else if (dst)
            _mm256_storeu_si256((__m256i *)(dst + i), x);
        if (sum) {
            __m256i h = _mm256_mullo_epi32(idx, k1);
            h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));
            h = _mm256_mullo_epi32(h, k2);
            h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));
            h = _mm256_or_si256(h, one);
            acc = _mm256_add_epi64(acc, _mm256_mul_epu32(x, h));  // even lanes
            acc = _mm256_add_epi64(acc, _mm256_mul_epu32(_mm256_srli_epi64(x, 32), _mm256_srli_epi64(h, 32)));
            idx = _mm256_add_epi32(idx, eight);
        }
    }
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, acc);
    uint64_t total = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    return total + scalar_words(src + n, dst ? dst + n : NULL, words - n, pos + (uint32_t)n, sum);
}

#define GRAB_BYTES (1 << 20)  // units a thread claims at a time: about this many bytes

typedef struct {
    const int64_t *units;
    int64_t n_units, grab;
    int64_t *next;  // shared: first unit nobody has claimed yet
    int gather, sum, avx2;
    uint64_t *sums;  // [n_spans], this thread's own
} run_t;

// Threads claim runs of units from a shared counter rather than fixed shares: on a machine where
// another process takes a core, the thread still running does the rest instead of waiting.
static void *run_units(void *arg) {
    run_t *r = (run_t *)arg;
    for (;;) {
    int64_t begin = __atomic_fetch_add(r->next, r->grab, __ATOMIC_RELAXED);
    if (begin >= r->n_units) break;
    int64_t end = begin + r->grab < r->n_units ? begin + r->grab : r->n_units;
    for (int64_t u = begin; u < end; u++) {
        const int64_t *t = r->units + 5 * u;
        uint32_t *engine = (uint32_t *)(uintptr_t)t[0], *chunk = (uint32_t *)(uintptr_t)t[1];
        int64_t words = t[2] / 4, span = t[4] >> 1, write = t[4] & 1;
        const uint32_t *src = r->gather ? engine : chunk;
        uint32_t *dst = write ? (r->gather ? chunk : engine) : NULL;
        if (!r->sum && dst) {
            memcpy(dst, src, (size_t)t[2]);
            continue;
        }
        uint64_t s = r->avx2 ? avx2_words(src, dst, words, (uint32_t)t[3], r->sum)
                             : scalar_words(src, dst, words, (uint32_t)t[3], r->sum);
        r->sums[span] += s;
    }
    }
    if (r->avx2) _mm_sfence();  // streaming stores are globally visible before the call returns
    return NULL;
}

// Copies every unit (engine -> chunk when gather, else chunk -> engine) on up to ``threads``
// threads and, when ``sums`` is not NULL, adds each span's KVSUM64 terms to ``sums[span]``
// (uint64, wrapping). Bytes per unit must be a multiple of 4. Returns 0, or -1 when out of memory.
int kvt_copy(const int64_t *units, int64_t n_units, int gather, uint64_t *sums, int64_t n_spans, int threads) {
    if (n_units <= 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > n_units) threads = (int)n_units;
    int avx2 = __builtin_cpu_supports("avx2");
    run_t *runs = calloc((size_t)threads, sizeof(run_t));
    uint64_t *partial = calloc((size_t)threads * (size_t)(n_spans > 0 ? n_spans : 1), sizeof(uint64_t));
    pthread_t *ids = calloc((size_t)threads, sizeof(pthread_t));
    if (!runs || !partial || !ids) {
        free(runs); free(partial); free(ids);
        return -1;
    }
    int64_t total = 0, next = 0;
    for (int64_t u = 0; u < n_units; u++) total += units[5 * u + 2];
    int64_t grab = GRAB_BYTES / (total / n_units > 0 ? total / n_units : 1);
    if (grab < 1) grab = 1;
    for (int t = 0; t < threads; t++)
        runs[t] = (run_t){units, n_units, grab, &next, gather, sums != NULL, avx2, partial + (size_t)t * (size_t)n_spans};
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
            for (int64_t s = 0; s < n_spans; s++) sums[s] += runs[t].sums[s];
    free(runs); free(partial); free(ids);
    return 0;
}

// Two KVSUM64s of the same words in one pass: at word positions ``pa`` (into *sa) and ``pb`` (into
// *sb), copying them to ``dst`` unless it is NULL. What a join of other ranks' pieces needs: each
// piece's own checksum (its words at their places in the piece) and the joined chunk's (at theirs).
__attribute__((target("avx2"))) static void avx2_words2(const uint32_t *src, uint32_t *dst, int64_t words,
                                                         uint32_t pa, uint32_t pb, uint64_t *sa, uint64_t *sb) {
    int64_t n = words & ~(int64_t)7;
    int stream = dst && ((uintptr_t)dst & 31) == 0 && words * 4 >= NT_MIN_BYTES;
    __m256i acc_a = _mm256_setzero_si256(), acc_b = _mm256_setzero_si256();
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256i ia = _mm256_add_epi32(_mm256_set1_epi32((int)pa), lane), ib = _mm256_add_epi32(_mm256_set1_epi32((int)pb), lane);
    const __m256i eight = _mm256_set1_epi32(8), k1 = _mm256_set1_epi32((int)K1), k2 = _mm256_set1_epi32((int)K2);
    const __m256i one = _mm256_set1_epi32(1);
#define KVT_WEIGHTED(acc, idx, x)                                                                           \
    do {                                                                                                   \
        __m256i h = _mm256_mullo_epi32(idx, k1);                                                           \
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 16));                                                 \
        h = _mm256_mullo_epi32(h, k2);                                                                     \
        h = _mm256_xor_si256(h, _mm256_srli_epi32(h, 13));                                                 \
        h = _mm256_or_si256(h, one);                                                                       \
        acc = _mm256_add_epi64(acc, _mm256_mul_epu32(x, h));                                               \
        acc = _mm256_add_epi64(acc, _mm256_mul_epu32(_mm256_srli_epi64(x, 32), _mm256_srli_epi64(h, 32))); \
        idx = _mm256_add_epi32(idx, eight);                                                                \
    } while (0)
    for (int64_t i = 0; i < n; i += 8) {
        __m256i x = _mm256_loadu_si256((const __m256i *)(src + i));
        if (stream)
            _mm256_stream_si256((__m256i *)(dst + i), x);
        else if (dst)
            _mm256_storeu_si256((__m256i *)(dst + i), x);
        KVT_WEIGHTED(acc_a, ia, x);
        KVT_WEIGHTED(acc_b, ib, x);
    }
#undef KVT_WEIGHTED
    uint64_t la[4], lb[4];
    _mm256_storeu_si256((__m256i *)la, acc_a);
    _mm256_storeu_si256((__m256i *)lb, acc_b);
    *sa += la[0] + la[1] + la[2] + la[3] + scalar_words(src + n, dst ? dst + n : NULL, words - n, pa + (uint32_t)n, 1);
    *sb += lb[0] + lb[1] + lb[2] + lb[3] + scalar_words(src + n, NULL, words - n, pb + (uint32_t)n, 1);
}

static void scalar_words2(const uint32_t *src, uint32_t *dst, int64_t words, uint32_t pa, uint32_t pb,
                          uint64_t *sa, uint64_t *sb) {
    *sa += scalar_words(src, dst, words, pa, 1);
    *sb += scalar_words(src, NULL, words, pb, 1);
}

typedef struct {
    const int64_t *units;
    int64_t n_units, grab;
    int64_t *next;
    int avx2;
    uint64_t *sums;  // [n_sums], this thread's own
} run2_t;

static void *run_units2(void *arg) {
    run2_t *r = (run2_t *)arg;
    for (;;) {
        int64_t begin = __atomic_fetch_add(r->next, r->grab, __ATOMIC_RELAXED);
        if (begin >= r->n_units) break;
        int64_t end = begin + r->grab < r->n_units ? begin + r->grab : r->n_units;
        for (int64_t u = begin; u < end; u++) {
            const int64_t *t = r->units + 7 * u;
            const uint32_t *src = (const uint32_t *)(uintptr_t)t[0];
            uint32_t *dst = (uint32_t *)(uintptr_t)t[1];
            int64_t words = t[2] / 4;
            if (t[6] < 0) {  // one sum: at position t[3] into sums[t[4]]
                uint64_t s = r->avx2 ? avx2_words(src, dst, words, (uint32_t)t[3], 1)
                                     : scalar_words(src, dst, words, (uint32_t)t[3], 1);
                r->sums[t[4]] += s;
            } else if (r->avx2) {
                avx2_words2(src, dst, words, (uint32_t)t[3], (uint32_t)t[5], &r->sums[t[4]], &r->sums[t[6]]);
            } else {
                scalar_words2(src, dst, words, (uint32_t)t[3], (uint32_t)t[5], &r->sums[t[4]], &r->sums[t[6]]);
            }
        }
    }
    if (r->avx2) _mm_sfence();
    return NULL;
}

// Walks ``units``, int64 [n_units, 7] = source address, destination address (0: only summed),
// bytes, word position a, sum index a, word position b, sum index b (-1: no second sum), on up to
// ``threads`` threads: copies each unit's words and adds their KVSUM64 terms at position a to
// ``sums[a]`` and at position b to ``sums[b]`` (uint64 [n_sums], wrapping). Bytes per unit must be
// a multiple of 4. Returns 0, or -1 when out of memory.
int kvt_copy2(const int64_t *units, int64_t n_units, uint64_t *sums, int64_t n_sums, int threads) {
    if (n_units <= 0) return 0;
    if (threads < 1) threads = 1;
    if (threads > n_units) threads = (int)n_units;
    int avx2 = __builtin_cpu_supports("avx2");
    run2_t *runs = calloc((size_t)threads, sizeof(run2_t));
    uint64_t *partial = calloc((size_t)threads * (size_t)(n_sums > 0 ? n_sums : 1), sizeof(uint64_t));
    pthread_t *ids = calloc((size_t)threads, sizeof(pthread_t));
    if (!runs || !partial || !ids) {
        free(runs); free(partial); free(ids);
        return -1;
    }
    int64_t total = 0, next = 0;
    for (int64_t u = 0; u < n_units; u++) total += units[7 * u + 2];
    int64_t grab = GRAB_BYTES / (total / n_units > 0 ? total / n_units : 1);
    if (grab < 1) grab = 1;
    for (int t = 0; t < threads; t++)
        runs[t] = (run2_t){units, n_units, grab, &next, avx2, partial + (size_t)t * (size_t)n_sums};
    int started = 0;
    for (int t = 1; t < threads; t++) {
        if (pthread_create(&ids[t], NULL, run_units2, &runs[t]) != 0) break;
        started = t;
    }
    run_units2(&runs[0]);
    for (int t = started + 1; t < threads; t++) run_units2(&runs[t]);
    for (int t = 1; t <= started; t++) pthread_join(ids[t], NULL);
    for (int t = 0; t < threads; t++)
        for (int64_t s = 0; s < n_sums; s++) sums[s] += runs[t].sums[s];
    free(runs); free(partial); free(ids);
    return 0;
}
