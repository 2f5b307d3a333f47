/* y[m, n] = sum_k x[m, k] * w[n, k] for a few rows of x (decode and verify on CPU).
 *
 * Why a kernel of our own: with one core, a 1-token decode and a 2..8-token verify are both bound
 * by streaming the weights from memory. MKL's sgemm reads them at under half that speed for
 * M = 2..8, and oneDNN still costs ~1.3-1.4x a 1-row gemv at M = 5. Here every weight is read
 * from memory once and used by every row of x while it is in registers or L1:
 * - M <= 2: groups of 4 weight rows, x rows two at a time (8 accumulators);
 * - M >= 3: groups of 2 weight rows against up to 6 x rows at once (12 accumulators + 2 weight
 *   vectors + 1 x vector = 15 of AVX2's 16 registers), so a verify of up to 6 tokens is a single
 *   pass over the weights and its FMAs hide under the memory stream (with two x rows per pass the
 *   later passes ran after the stream, from L1: a 5-token verify cost ~1.35x a decode, ~1.14x now).
 *
 * The first pass over each group of weight rows also prefetches the rows PREFETCH_ROWS ahead, so
 * the memory stream does not stall between groups.
 *
 * Batch invariance: every (m, n) is summed in the same order whatever M is (8-wide FMA lanes over
 * k, one fixed horizontal sum, then the k tail), so a token's logits are bitwise identical in a
 * 1-token decode and inside a 5-token verify.
 * Weights come as float32 or as bfloat16 (widened exactly in registers: half the bytes to stream;
 * a bf16-valued float32 matrix gives bitwise the same results through either entry point).
 * Built with -mavx2 -mfma -ffp-contract=off by tide/models/rowkernel.py; callers check the CPU.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define PREFETCH_GROUPS 2
#define PREFETCH_ROWS (4 * PREFETCH_GROUPS)
#define MAX_BLOCK_ROWS 6

#define PREFETCH2(p, K, k)                                                                         \
    do {                                                                                          \
        if (p) {                                                                                  \
            _mm_prefetch((const char *)((p) + (k)), _MM_HINT_T0);                                 \
            _mm_prefetch((const char *)((p) + (K) + (k)), _MM_HINT_T0);                           \
        }                                                                                         \
    } while (0)

/* 4 weight rows starting at p (the next groups' rows), k-th 8-wide step: one line ahead each */
#define PREFETCH4(p, K, k)                                                                         \
    do {                                                                                          \
        if (p) {                                                                                  \
            _mm_prefetch((const char *)((p) + (k)), _MM_HINT_T0);                                 \
            _mm_prefetch((const char *)((p) + (K) + (k)), _MM_HINT_T0);                           \
            _mm_prefetch((const char *)((p) + 2 * (K) + (k)), _MM_HINT_T0);                       \
            _mm_prefetch((const char *)((p) + 3 * (K) + (k)), _MM_HINT_T0);                       \
        }                                                                                         \
    } while (0)

static inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

static inline __m256 load_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline float scalar_f32(const float *p) { return *p; }
static inline __m256 load_bf16(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
static inline float scalar_bf16(const uint16_t *p) {
    uint32_t bits = (uint32_t)*p << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One kernel body per weight type. Every (m, n) is reduced in the same order on every path:
 * 8 FMA lanes over k, hsum, then the k tail in order. */
#define ROW_KERNEL(SUFFIX, WT, LOADW, SCALARW)                                                       \
static float dot1_##SUFFIX(const float *x, const WT *w, long K) {                                 \
    __m256 a = _mm256_setzero_ps();                                                               \
    long k = 0;                                                                                   \
    for (; k + 8 <= K; k += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), LOADW(w + k), a);      \
    float s = hsum(a);                                                                            \
    for (; k < K; k++) s += x[k] * SCALARW(w + k);                                                \
    return s;                                                                                     \
}                                                                                                 \
static void rows2x4_##SUFFIX(const float *xa, const float *xb, const WT *w0, long K, float *ya,    \
                             float *yb, const WT *ahead) {                                        \
    const WT *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;                                            \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;\
    long k = 0;                                                                                   \
    for (; k + 8 <= K; k += 8) {                                                                  \
        PREFETCH4(ahead, K, k);                                                                   \
        __m256 v0 = LOADW(w0 + k), v1 = LOADW(w1 + k), v2 = LOADW(w2 + k), v3 = LOADW(w3 + k);    \
        __m256 x = _mm256_loadu_ps(xa + k);                                                       \
        a0 = _mm256_fmadd_ps(x, v0, a0); a1 = _mm256_fmadd_ps(x, v1, a1);                         \
        a2 = _mm256_fmadd_ps(x, v2, a2); a3 = _mm256_fmadd_ps(x, v3, a3);                         \
        x = _mm256_loadu_ps(xb + k);                                                              \
        b0 = _mm256_fmadd_ps(x, v0, b0); b1 = _mm256_fmadd_ps(x, v1, b1);                         \
        b2 = _mm256_fmadd_ps(x, v2, b2); b3 = _mm256_fmadd_ps(x, v3, b3);                         \
    }                                                                                             \
    float s[8] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3), hsum(b0), hsum(b1), hsum(b2), hsum(b3)};\
    for (; k < K; k++) {                                                                          \
        float u0 = SCALARW(w0 + k), u1 = SCALARW(w1 + k), u2 = SCALARW(w2 + k), u3 = SCALARW(w3 + k);\
        s[0] += xa[k] * u0; s[1] += xa[k] * u1; s[2] += xa[k] * u2; s[3] += xa[k] * u3;           \
        s[4] += xb[k] * u0; s[5] += xb[k] * u1; s[6] += xb[k] * u2; s[7] += xb[k] * u3;           \
    }                                                                                             \
    for (int j = 0; j < 4; j++) { ya[j] = s[j]; yb[j] = s[4 + j]; }                               \
}                                                                                                 \
static void rows1x4_##SUFFIX(const float *x, const WT *w0, long K, float *y, const WT *ahead) {   \
    const WT *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;                                            \
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                   \
    long k = 0;                                                                                   \
    for (; k + 8 <= K; k += 8) {                                                                  \
        PREFETCH4(ahead, K, k);                                                                   \
        __m256 v = _mm256_loadu_ps(x + k);                                                        \
        a0 = _mm256_fmadd_ps(v, LOADW(w0 + k), a0); a1 = _mm256_fmadd_ps(v, LOADW(w1 + k), a1);  \
        a2 = _mm256_fmadd_ps(v, LOADW(w2 + k), a2); a3 = _mm256_fmadd_ps(v, LOADW(w3 + k), a3);  \
    }                                                                                             \
    float s[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};                                        \
    for (; k < K; k++) {                                                                          \
        s[0] += x[k] * SCALARW(w0 + k); s[1] += x[k] * SCALARW(w1 + k);                           \
        s[2] += x[k] * SCALARW(w2 + k); s[3] += x[k] * SCALARW(w3 + k);                           \
    }                                                                                             \
    for (int j = 0; j < 4; j++) y[j] = s[j];                                                      \
}                                                                                                 \
/* C (<= MAX_BLOCK_ROWS, a constant after inlining) rows of x against weight rows w0, w0 + K */   \
static inline __attribute__((always_inline)) void rowsCx2_##SUFFIX(                               \
    const float *x, long K, const int C, const WT *w0, float *y, long N, const WT *ahead) {       \
    const WT *w1 = w0 + K;                                                                        \
    __m256 a[MAX_BLOCK_ROWS], b[MAX_BLOCK_ROWS];                                                  \
    for (int c = 0; c < C; c++) a[c] = b[c] = _mm256_setzero_ps();                                \
    long k = 0;                                                                                   \
    for (; k + 8 <= K; k += 8) {                                                                  \
        PREFETCH2(ahead, K, k);                                                                   \
        __m256 v0 = LOADW(w0 + k), v1 = LOADW(w1 + k);                                           \
        for (int c = 0; c < C; c++) {                                                             \
            __m256 xv = _mm256_loadu_ps(x + c * K + k);                                           \
            a[c] = _mm256_fmadd_ps(xv, v0, a[c]);                                                 \
            b[c] = _mm256_fmadd_ps(xv, v1, b[c]);                                                 \
        }                                                                                         \
    }                                                                                             \
    for (int c = 0; c < C; c++) {                                                                 \
        float s0 = hsum(a[c]), s1 = hsum(b[c]);                                                   \
        for (long t = k; t < K; t++) {                                                            \
            s0 += x[c * K + t] * SCALARW(w0 + t);                                                 \
            s1 += x[c * K + t] * SCALARW(w1 + t);                                                 \
        }                                                                                         \
        y[c * N] = s0; y[c * N + 1] = s1;                                                         \
    }                                                                                             \
}                                                                                                 \
static void rows_many_##SUFFIX(const float *x, long M, long K, const WT *w, long N, float *y) {   \
    long n = 0;                                                                                   \
    for (; n + 2 <= N; n += 2) {                                                                  \
        const WT *wn = w + n * K;                                                                 \
        const WT *ahead = n + 2 + PREFETCH_ROWS <= N ? wn + PREFETCH_ROWS * K : NULL;             \
        for (long m = 0; m < M; m += MAX_BLOCK_ROWS, ahead = NULL) {                              \
            const float *xm = x + m * K;                                                          \
            float *ym = y + m * N + n;                                                            \
            switch (M - m < MAX_BLOCK_ROWS ? M - m : MAX_BLOCK_ROWS) {                            \
            case 1: rowsCx2_##SUFFIX(xm, K, 1, wn, ym, N, ahead); break;                          \
            case 2: rowsCx2_##SUFFIX(xm, K, 2, wn, ym, N, ahead); break;                          \
            case 3: rowsCx2_##SUFFIX(xm, K, 3, wn, ym, N, ahead); break;                          \
            case 4: rowsCx2_##SUFFIX(xm, K, 4, wn, ym, N, ahead); break;                          \
            case 5: rowsCx2_##SUFFIX(xm, K, 5, wn, ym, N, ahead); break;                          \
            default: rowsCx2_##SUFFIX(xm, K, 6, wn, ym, N, ahead); break;                         \
            }                                                                                     \
        }                                                                                         \
    }                                                                                             \
    for (; n < N; n++)                                                                            \
        for (long m = 0; m < M; m++) y[m * N + n] = dot1_##SUFFIX(x + m * K, w + n * K, K);       \
}                                                                                                 \
/* x: [M, K] float32, w: [N, K], y: [M, N] float32; all contiguous */                             \
void tide_linear_rows_##SUFFIX(const float *x, long M, long K, const WT *w, long N, float *y) {  \
    if (M > 2) {                                                                                  \
        rows_many_##SUFFIX(x, M, K, w, N, y);                                                     \
        return;                                                                                   \
    }                                                                                             \
    long n = 0;                                                                                   \
    for (; n + 4 <= N; n += 4) {                                                                  \
        const WT *wn = w + n * K;                                                                 \
        /* only the first pass prefetches, and never past the matrix */                          \
        const WT *ahead = n + 4 * PREFETCH_GROUPS + 4 <= N ? wn + 4 * PREFETCH_GROUPS * K : NULL; \
        long m = 0;                                                                               \
        for (; m + 2 <= M; m += 2, ahead = NULL)                                                  \
            rows2x4_##SUFFIX(x + m * K, x + (m + 1) * K, wn, K, y + m * N + n, y + (m + 1) * N + n,\
                             ahead);                                                              \
        if (m < M) rows1x4_##SUFFIX(x + m * K, wn, K, y + m * N + n, ahead);                      \
    }                                                                                             \
    for (; n < N; n++)                                                                            \
        for (long m = 0; m < M; m++) y[m * N + n] = dot1_##SUFFIX(x + m * K, w + n * K, K);       \
}

ROW_KERNEL(f32, float, load_f32, scalar_f32)
ROW_KERNEL(bf16, uint16_t, load_bf16, scalar_bf16)
