/* Small-batch matrix products for memory-bound decode on AVX2 + FMA CPUs, and bf16 x bf16 on AVX512_BF16 (at
 * the end of this file).
 *
 * y[m, n] = sum_k x[m, k] * W[n, k] (* scale[n])   for m < M, n < N, k < K
 *
 * x and y are row-major float32; W is row-major [N, K] in bfloat16 (uint16 bit patterns) or int8 with one
 * float32 scale per output row. Each weight element is read from memory once per call: four weight rows are
 * streamed together against every x row while they sit in L1, so at M = 1 the loop runs at the memory
 * bandwidth of the weight bytes (half of fp32's for bf16, a quarter for int8). Single-threaded; the caller
 * owns every buffer. Built by engine/model/kernels/build.py with -O3 -mavx2 -mfma (the AVX512_BF16 function
 * by its target attribute).
 */
#include <immintrin.h>
#include <stdint.h>

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256 load_bf16x8(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

static inline __m256 load_i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = { (uint32_t)v << 16 };
    return c.f;
}

#define ROWS 4
/* How far ahead each weight row is prefetched: the same row of the next block of ROWS rows. Without it the
 * int8 loop ran at ~4-6 GB/s (the hardware prefetcher does not follow four short interleaved rows far enough
 * ahead); with it ~9 GB/s, as fast as bf16's. */
#define PREFETCH_ROWS ROWS

/* Defines gemv_<name>(x, w, scale, y, M, N, K): LOAD8 reads 8 weights as floats, LOAD1 one weight. The inner
 * loop takes 16 weights of each row per pass into two accumulators per row (a and b: the FMA latency chain is
 * split in two); the sum of a row is (a + b) reduced, then the tail, so a row's result does not depend on M. */
#define DEFINE_GEMV(name, wtype, LOAD8, LOAD1)                                                          \
void gemv_##name(const float *x, const wtype *w, const float *scale, float *y,                          \
                 int64_t M, int64_t N, int64_t K) {                                                     \
    int64_t K16 = K & ~(int64_t)15;                                                                    \
    int64_t n = 0;                                                                                      \
    for (; n + ROWS <= N; n += ROWS) {                                                                  \
        const wtype *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;                          \
        for (int64_t m = 0; m < M; m++) {                                                               \
            const float *xm = x + m * K;                                                                \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0; \
            for (int64_t k = 0; k < K16; k += 16) {                                                     \
                if (m == 0) {                                                                           \
                    _mm_prefetch((const char *)(w0 + k + PREFETCH_ROWS * K), _MM_HINT_T0);              \
                    _mm_prefetch((const char *)(w1 + k + PREFETCH_ROWS * K), _MM_HINT_T0);              \
                    _mm_prefetch((const char *)(w2 + k + PREFETCH_ROWS * K), _MM_HINT_T0);              \
                    _mm_prefetch((const char *)(w3 + k + PREFETCH_ROWS * K), _MM_HINT_T0);              \
                }                                                                                       \
                __m256 xa = _mm256_loadu_ps(xm + k), xb = _mm256_loadu_ps(xm + k + 8);                  \
                a0 = _mm256_fmadd_ps(xa, LOAD8(w0 + k), a0); b0 = _mm256_fmadd_ps(xb, LOAD8(w0 + k + 8), b0); \
                a1 = _mm256_fmadd_ps(xa, LOAD8(w1 + k), a1); b1 = _mm256_fmadd_ps(xb, LOAD8(w1 + k + 8), b1); \
                a2 = _mm256_fmadd_ps(xa, LOAD8(w2 + k), a2); b2 = _mm256_fmadd_ps(xb, LOAD8(w2 + k + 8), b2); \
                a3 = _mm256_fmadd_ps(xa, LOAD8(w3 + k), a3); b3 = _mm256_fmadd_ps(xb, LOAD8(w3 + k + 8), b3); \
            }                                                                                           \
            float s0 = hsum8(_mm256_add_ps(a0, b0)), s1 = hsum8(_mm256_add_ps(a1, b1));                 \
            float s2 = hsum8(_mm256_add_ps(a2, b2)), s3 = hsum8(_mm256_add_ps(a3, b3));                 \
            for (int64_t k = K16; k < K; k++) {                                                         \
                s0 += xm[k] * LOAD1(w0[k]); s1 += xm[k] * LOAD1(w1[k]);                                 \
                s2 += xm[k] * LOAD1(w2[k]); s3 += xm[k] * LOAD1(w3[k]);                                 \
            }                                                                                           \
            float *ym = y + m * N + n;                                                                  \
            ym[0] = s0; ym[1] = s1; ym[2] = s2; ym[3] = s3;                                             \
            if (scale) { ym[0] *= scale[n]; ym[1] *= scale[n + 1]; ym[2] *= scale[n + 2];               \
                         ym[3] *= scale[n + 3]; }                                                       \
        }                                                                                               \
    }                                                                                                   \
    for (; n < N; n++) {                                                                                \
        const wtype *wn = w + n * K;                                                                    \
        for (int64_t m = 0; m < M; m++) {                                                               \
            const float *xm = x + m * K;                                                                \
            __m256 a = _mm256_setzero_ps(), b = a;                                                      \
            for (int64_t k = 0; k < K16; k += 16) {                                                     \
                a = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k), LOAD8(wn + k), a);                         \
                b = _mm256_fmadd_ps(_mm256_loadu_ps(xm + k + 8), LOAD8(wn + k + 8), b);                 \
            }                                                                                           \
            float s = hsum8(_mm256_add_ps(a, b));                                                       \
            for (int64_t k = K16; k < K; k++) s += xm[k] * LOAD1(wn[k]);                                \
            y[m * N + n] = scale ? s * scale[n] : s;                                                    \
        }                                                                                               \
    }                                                                                                   \
}

#define I8_TO_F32(v) ((float)(v))
DEFINE_GEMV(bf16, uint16_t, load_bf16x8, bf16_to_f32)
DEFINE_GEMV(int8, int8_t, load_i8x8, I8_TO_F32)

/* bf16 activations against bf16 weights on CPUs with AVX512_BF16 (Zen 4, Cooper Lake and later Xeons):
 * vdpbf16ps multiplies 32 bf16 pairs and adds each adjacent pair of products into one of 16 float32 lanes, so
 * a weight element costs one lane of one instruction and no conversion (the AVX2 loop above widens every
 * weight to float32 once per x row, which bounds it at M > 1). Same blocking as above: four weight rows
 * against every x row while they sit in L1, two accumulators per row; K's tail through masked loads. A row's
 * result depends only on its own x row (fixed summation order), so it is the same at any M. Products of two
 * bf16 are exact in float32; the instruction flushes denormals (its DAZ/FTZ semantics). Compiled for these
 * instructions by the function's target attribute; call it only where has_avx512_bf16() says so. */
int has_avx512_bf16(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
}

#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

BF16_TARGET static inline __m512bh load_bh32(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

BF16_TARGET static inline void prefetch_rows(const uint16_t *w0, const uint16_t *w1, const uint16_t *w2,
                                             const uint16_t *w3, int64_t ahead) {
    _mm_prefetch((const char *)(w0 + ahead), _MM_HINT_T0);
    _mm_prefetch((const char *)(w1 + ahead), _MM_HINT_T0);
    _mm_prefetch((const char *)(w2 + ahead), _MM_HINT_T0);
    _mm_prefetch((const char *)(w3 + ahead), _MM_HINT_T0);
}

/* Each (x row, weight row) pair sums its 32-element steps in k order into two accumulators (even and odd
 * steps: two dependency chains), then the masked tail into the first; nothing depends on the other rows. */
BF16_TARGET void gemm_bf16_native(const uint16_t *x, const uint16_t *w, const float *unused, float *y,
                                  int64_t M, int64_t N, int64_t K) {
    (void)unused;
    const __mmask32 all = 0xFFFFFFFFu;
    int64_t K64 = K & ~(int64_t)63, K32 = K & ~(int64_t)31;
    __mmask32 tail = (K - K32) ? (__mmask32)((1u << (K - K32)) - 1u) : 0;
    int64_t n = 0;
    for (; n + ROWS <= N; n += ROWS) {
        const uint16_t *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *xm = x + m * K;
            __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
            int64_t k = 0;
            for (; k < K64; k += 64) {
                if (m == 0) {
                    prefetch_rows(w0, w1, w2, w3, k + PREFETCH_ROWS * K);
                    prefetch_rows(w0, w1, w2, w3, k + 32 + PREFETCH_ROWS * K);
                }
                __m512bh xa = load_bh32(xm + k, all), xb = load_bh32(xm + k + 32, all);
                a0 = _mm512_dpbf16_ps(a0, xa, load_bh32(w0 + k, all));
                b0 = _mm512_dpbf16_ps(b0, xb, load_bh32(w0 + k + 32, all));
                a1 = _mm512_dpbf16_ps(a1, xa, load_bh32(w1 + k, all));
                b1 = _mm512_dpbf16_ps(b1, xb, load_bh32(w1 + k + 32, all));
                a2 = _mm512_dpbf16_ps(a2, xa, load_bh32(w2 + k, all));
                b2 = _mm512_dpbf16_ps(b2, xb, load_bh32(w2 + k + 32, all));
                a3 = _mm512_dpbf16_ps(a3, xa, load_bh32(w3 + k, all));
                b3 = _mm512_dpbf16_ps(b3, xb, load_bh32(w3 + k + 32, all));
            }
            for (; k < K; k += 32) {   /* at most one whole step of 32, then the masked tail */
                __mmask32 mask = k + 32 <= K ? all : tail;
                __m512bh xa = load_bh32(xm + k, mask);
                a0 = _mm512_dpbf16_ps(a0, xa, load_bh32(w0 + k, mask));
                a1 = _mm512_dpbf16_ps(a1, xa, load_bh32(w1 + k, mask));
                a2 = _mm512_dpbf16_ps(a2, xa, load_bh32(w2 + k, mask));
                a3 = _mm512_dpbf16_ps(a3, xa, load_bh32(w3 + k, mask));
            }
            float *ym = y + m * N + n;
            ym[0] = _mm512_reduce_add_ps(_mm512_add_ps(a0, b0));
            ym[1] = _mm512_reduce_add_ps(_mm512_add_ps(a1, b1));
            ym[2] = _mm512_reduce_add_ps(_mm512_add_ps(a2, b2));
            ym[3] = _mm512_reduce_add_ps(_mm512_add_ps(a3, b3));
        }
    }
    for (; n < N; n++) {
        const uint16_t *wn = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            const uint16_t *xm = x + m * K;
            __m512 a = _mm512_setzero_ps(), b = a;
            int64_t k = 0;
            for (; k < K64; k += 64) {
                a = _mm512_dpbf16_ps(a, load_bh32(xm + k, all), load_bh32(wn + k, all));
                b = _mm512_dpbf16_ps(b, load_bh32(xm + k + 32, all), load_bh32(wn + k + 32, all));
            }
            for (; k < K; k += 32) {
                __mmask32 mask = k + 32 <= K ? all : tail;
                a = _mm512_dpbf16_ps(a, load_bh32(xm + k, mask), load_bh32(wn + k, mask));
            }
            y[m * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
        }
    }
}
