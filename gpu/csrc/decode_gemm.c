/* Decode-sized float32 linears: out[M, N] = x[M, K] @ W[N, K]^T (+ bias) for the few rows of a
 * decode step (gpu/model/linear.py). At those row counts every weight is read from memory once per step
 * for a few dozen multiply-adds, and a kernel that stalls on those reads costs about the sum of
 * the memory time and the arithmetic time. This one reads the weight as one sequential stream per
 * thread, from a copy laid out for it (rows_pack_f32: blocks of RB rows, k-major inside a block,
 * so the RB weights of one k are adjacent), and prefetches ahead of the stream while its
 * accumulators (all in registers) do the arithmetic.
 *
 * Every output is one float32 fused multiply-add chain over k in order, whatever M is and
 * whichever body runs: a row's result does not depend on the other rows of the batch.
 * Built into the paged kernel's library (gpu/csrc/ops.cpp), with OpenMP on torch's runtime. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define RB 12 /* rows per block of the packed copy */
/* float32 rows read in place (gemv_M); more go through the transposed scratch. On SmolLM2's
 * linears (Zen 4, 2 threads) 5-8 rows took 26.7-26.9 ms in place against 28.1-28.5 through the
 * 16-column body (a speculating lone request's 1 + 4 drafts), 10-12 rows 31 against 29-30 */
#define GEMV_MAX 8

int64_t rows_packed_len(int64_t n, int64_t k) {
    /* floats in the packed copy: whole blocks, plus one vector of slack for masked loads */
    return ((n + RB - 1) / RB) * RB * k + 16;
}

int64_t rows_scratch_len(int64_t m, int64_t k) {
    /* floats of rows_gemm_f32's xT scratch for m rows: x transposed, 16 columns for m <= 16,
       else groups of 32; none for m <= GEMV_MAX (those rows are read in place) */
    if (m <= GEMV_MAX) return 0;
    return (m <= 16 ? 16 : (m + 31) / 32 * 32) * k;
}

void rows_pack_f32(const float *w, int64_t n, int64_t k, float *out) {
    int64_t nb = (n + RB - 1) / RB;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++)
        for (int64_t kk = 0; kk < k; kk++)
            for (int64_t r = 0; r < RB; r++) {
                int64_t row = b * RB + r;
                out[(b * k + kk) * RB + r] = row < n ? w[row * k + kk] : 0.0f;
            }
    memset(out + nb * RB * k, 0, 16 * sizeof(float));
}

#if defined(__AVX512F__)
#include <immintrin.h>
#define PF_BYTES 3072 /* prefetch distance along a block's stream (measured: 2-4 KB best) */

/* R rows of W (R = 24: two blocks; 12: one) against 16 * C columns of xT ([K][16 * C], x
 * transposed and zero-padded); acc stored to tmp[R][16 * C]. */
#define BODY(R, C)                                                                          \
    static void body_##R##_##C(const void *xT_, const void *w_, int64_t K,                  \
                               float *restrict tmp) {                                      \
        const float *restrict xT = xT_, *restrict w = w_;                                   \
        __m512 acc[R][C];                                                                   \
        _Pragma("GCC unroll 24") for (int r = 0; r < R; r++)                               \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K; k++) {                                                   \
            _mm_prefetch((const char *)(w + k * RB) + PF_BYTES, _MM_HINT_T2);                 \
            if (R > RB) _mm_prefetch((const char *)(w + K * RB + k * RB) + PF_BYTES, _MM_HINT_T2); \
            __m512 xv[C];                                                                   \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                             \
                xv[c] = _mm512_load_ps(xT + k * 16 * C + 16 * c);                           \
            _Pragma("GCC unroll 24") for (int r = 0; r < R; r++) {                          \
                __m512 wv = _mm512_set1_ps(w[(r / RB) * K * RB + k * RB + r % RB]);          \
                _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                         \
                    acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);                      \
            }                                                                               \
        }                                                                                   \
        _Pragma("GCC unroll 24") for (int r = 0; r < R; r++)                               \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                             \
                _mm512_store_ps(tmp + (r * C + c) * 16, acc[r][c]);                         \
    }
BODY(24, 1)
BODY(12, 1)
BODY(12, 2)

/* 1-GEMV_MAX rows: the 12 weights of one k are one (masked) vector, times x[m][k] broadcast; one block
 * at a time. Lane r of acc[m] is output row b * RB + r. Streaming one block per thread beat
 * interleaving 2, 4 or 8 blocks' streams (more independent chains) by 10-25% on a Zen 5 with
 * the weights in DRAM (2 threads: the bench model's LM head at 1 row 1.73 vs 2.27 ms); the
 * single chain's FMA latency allows ~12 bytes a cycle, more than DRAM gives a thread. */
#define GEMV(M)                                                                             \
    static void gemv_##M(const void *x_, int64_t xs, const void *w_, int64_t K,             \
                         float *restrict tmp) {                                             \
        const float *restrict x = x_, *restrict w = w_;                                     \
        __m512 acc[M];                                                                      \
        _Pragma("GCC unroll 12") for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K; k++) {                                                   \
            _mm_prefetch((const char *)(w + k * RB) + PF_BYTES, _MM_HINT_T2);               \
            __m512 wv = _mm512_maskz_loadu_ps(0x0FFF, w + k * RB);                          \
            _Pragma("GCC unroll 12") for (int m = 0; m < M; m++)                            \
                acc[m] = _mm512_fmadd_ps(wv, _mm512_set1_ps(x[m * xs + k]), acc[m]);        \
        }                                                                                   \
        _Pragma("GCC unroll 12") for (int m = 0; m < M; m++)                                \
            _mm512_store_ps(tmp + m * 16, acc[m]);                                          \
    }
GEMV(1) GEMV(2) GEMV(3) GEMV(4) GEMV(5) GEMV(6) GEMV(7) GEMV(8)
/* The kernels of one dtype, for rows_drive: 1..gemv_max rows in place, more through xT. */
typedef void (*rows_gemv_fn)(const void *, int64_t, const void *, int64_t, float *);
typedef void (*rows_body_fn)(const void *, const void *, int64_t, float *);
/* tmp (float32 sums) + bias -> out[m][n0 + r], in the dtype's own element type */
typedef void (*rows_put_fn)(void *, int64_t, int64_t, int64_t, int64_t, const void *, const float *,
                       int64_t, int64_t);
typedef struct {
    const rows_gemv_fn *gemv;
    int64_t gemv_max;
    rows_body_fn b24_1, b12_1, b12_2;
    rows_put_fn put;
    int64_t out_bytes; /* of one output element */
} rows_kernels;
typedef uint32_t word __attribute__((may_alias)); /* a float, or a pair of bf16 along k */

static const rows_gemv_fn GEMV_M[GEMV_MAX + 1] = {0,      gemv_1, gemv_2, gemv_3, gemv_4,
                                                  gemv_5, gemv_6, gemv_7, gemv_8};

static void put_f32(void *out_, int64_t N, int64_t M, int64_t n0, int64_t rows, const void *bias_,
                    const float *tmp, int64_t m_step, int64_t r_step) {
    float *out = out_;
    const float *bias = bias_;
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < rows && n0 + r < N; r++)
            out[m * N + n0 + r] = tmp[m * m_step + r * r_step] + (bias ? bias[n0 + r] : 0.0f);
}

/* Both dtypes' linear on 32-bit words: x [M, K words] rows xs words apart, w the packed copy
 * (blocks of RB rows, K words each), out [M, N] elements of k->out_bytes, xT the scratch. */
static void rows_drive(const rows_kernels *kk, const word *x, int64_t xs, int64_t M,
                       const word *w, const void *bias, int64_t N, int64_t K, word *xT,
                       char *out) {
    int64_t nb = (N + RB - 1) / RB;
    if (M <= kk->gemv_max) {
#pragma omp parallel for schedule(static)
        for (int64_t b = 0; b < nb; b++) {
            float tmp[16 * 16] __attribute__((aligned(64)));
            kk->gemv[M](x, xs, w + b * K * RB, K, tmp);
            kk->put(out, N, M, b * RB, RB, bias, tmp, 16, 1);
        }
        return;
    }
    int64_t C = M <= 16 ? 1 : 2, W = 16 * C, G = (M + W - 1) / W;
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t k = 0; k < K; k++)
            for (int64_t g = 0; g < G; g++)
                for (int64_t j = 0; j < W; j++) {
                    int64_t m = g * W + j;
                    xT[(g * K + k) * W + j] = m < M ? x[m * xs + k] : 0u;
                }
        float tmp[24 * 16] __attribute__((aligned(64)));
        if (C == 1) {
            /* two blocks per call: 24 rows x 16 columns of accumulators */
#pragma omp for schedule(static)
            for (int64_t p = 0; p < (nb + 1) / 2; p++) {
                int64_t b = 2 * p;
                if (b + 1 < nb) {
                    kk->b24_1(xT, w + b * K * RB, K, tmp);
                    kk->put(out, N, M, b * RB, 2 * RB, bias, tmp, 1, 16);
                } else {
                    kk->b12_1(xT, w + b * K * RB, K, tmp);
                    kk->put(out, N, M, b * RB, RB, bias, tmp, 1, 16);
                }
            }
        } else {
            /* 32 columns at a time: a block's later column groups read it again, from cache */
#pragma omp for schedule(static)
            for (int64_t b = 0; b < nb; b++)
                for (int64_t g = 0; g < G; g++) {
                    int64_t mg = M - g * 32 < 32 ? M - g * 32 : 32;
                    kk->b12_2(xT + g * K * 32, w + b * K * RB, K, tmp);
                    kk->put(out + g * 32 * N * kk->out_bytes, N, mg, b * RB, RB, bias, tmp, 1, 32);
                }
        }
    }
}

int rows_gemm_vector(void) { return 1; }

/* x: [M, K] rows xs floats apart; w: rows_pack_f32's copy of [N, K]; out: [M, N] contiguous;
 * xT: 64-byte aligned scratch of rows_scratch_len(M, K) floats. */
void rows_gemm_f32(const float *x, int64_t xs, int64_t M, const float *w, const float *bias,
                   int64_t N, int64_t K, float *xT, float *out) {
    static const rows_kernels f32 = {GEMV_M, GEMV_MAX, body_24_1, body_12_1, body_12_2, put_f32, 4};
    rows_drive(&f32, (const word *)x, xs, M, (const word *)w, bias, N, K, (word *)xT, (char *)out);
}
#if defined(__AVX512BF16__)
/* bfloat16 (--dtype bfloat16's MLP): the same layout and bodies with each 32-bit word holding a
 * pair of bf16 along k (even k in the low half), one vdpbf16ps per pair: both products of a pair
 * are added to the float32 accumulator at once, the pairs in order along k. K even. The output
 * is rounded to bf16 once (to nearest even), as oneDNN's bf16 linear rounds its float32 sums. */
int64_t rows_packed_len_bf16(int64_t n, int64_t k) { return rows_packed_len(n, k / 2); }

int64_t rows_scratch_len_bf16(int64_t m, int64_t k) {
    return m <= 12 ? 0 : rows_scratch_len(m, k / 2); /* GEMVB_MAX rows: read in place */
}

void rows_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint32_t *out) {
    int64_t nb = (n + RB - 1) / RB, k2 = k / 2;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < nb; b++)
        for (int64_t kp = 0; kp < k2; kp++)
            for (int64_t r = 0; r < RB; r++) {
                int64_t row = b * RB + r;
                const uint16_t *src = w + row * k + 2 * kp;
                out[(b * k2 + kp) * RB + r] =
                    row < n ? (uint32_t)src[0] | ((uint32_t)src[1] << 16) : 0u;
            }
    memset(out + nb * RB * k2, 0, 16 * sizeof(uint32_t));
}

#define BODY_BF(R, C)                                                                       \
    static void bodyb_##R##_##C(const void *xT_, const void *w_, int64_t K2,                \
                                float *restrict tmp) {                                      \
        const word *restrict xT = xT_, *restrict w = w_;                                    \
        __m512 acc[R][C];                                                                   \
        _Pragma("GCC unroll 24") for (int r = 0; r < R; r++)                               \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++) acc[r][c] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K2; k++) {                                                  \
            _mm_prefetch((const char *)(w + k * RB) + PF_BYTES, _MM_HINT_T2);               \
            if (R > RB) _mm_prefetch((const char *)(w + K2 * RB + k * RB) + PF_BYTES, _MM_HINT_T2); \
            __m512bh xv[C];                                                                 \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                             \
                xv[c] = (__m512bh)_mm512_load_si512(xT + k * 16 * C + 16 * c);              \
            _Pragma("GCC unroll 24") for (int r = 0; r < R; r++) {                          \
                __m512bh wv = (__m512bh)_mm512_set1_epi32(                                  \
                    (int)w[(r / RB) * K2 * RB + k * RB + r % RB]);                          \
                _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                         \
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], wv, xv[c]);                     \
            }                                                                               \
        }                                                                                   \
        _Pragma("GCC unroll 24") for (int r = 0; r < R; r++)                               \
            _Pragma("GCC unroll 4") for (int c = 0; c < C; c++)                             \
                _mm512_store_ps(tmp + (r * C + c) * 16, acc[r][c]);                         \
    }
BODY_BF(24, 1)
BODY_BF(12, 1)
BODY_BF(12, 2)

#define GEMV_BF(M)                                                                          \
    static void gemvb_##M(const void *x_, int64_t xs, const void *w_, int64_t K2,           \
                          float *restrict tmp) {                                            \
        const word *restrict x = x_, *restrict w = w_;                                      \
        __m512 acc[M];                                                                      \
        _Pragma("GCC unroll 12") for (int m = 0; m < M; m++) acc[m] = _mm512_setzero_ps(); \
        for (int64_t k = 0; k < K2; k++) {                                                  \
            _mm_prefetch((const char *)(w + k * RB) + PF_BYTES, _MM_HINT_T2);               \
            __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi32(0x0FFF, w + k * RB);           \
            _Pragma("GCC unroll 12") for (int m = 0; m < M; m++)                            \
                acc[m] = _mm512_dpbf16_ps(                                                  \
                    acc[m], wv, (__m512bh)_mm512_set1_epi32((int)x[m * xs + k]));           \
        }                                                                                   \
        _Pragma("GCC unroll 12") for (int m = 0; m < M; m++)                                \
            _mm512_store_ps(tmp + m * 16, acc[m]);                                          \
    }
GEMV_BF(1) GEMV_BF(2) GEMV_BF(3) GEMV_BF(4) GEMV_BF(5) GEMV_BF(6)
GEMV_BF(7) GEMV_BF(8) GEMV_BF(9) GEMV_BF(10) GEMV_BF(11) GEMV_BF(12)
/* up to 12 rows in bf16 (12 of the 16 lanes busy; body_24_1's 16 columns would idle half of
 * theirs at 8 rows: 36.1 vs 32.1 ms for the 0.39B model's 24 MLPs at 8 rows, oneDNN's 32.1) */
#define GEMVB_MAX 12
static const rows_gemv_fn GEMVB_M[GEMVB_MAX + 1] = {
    0, gemvb_1, gemvb_2, gemvb_3, gemvb_4, gemvb_5, gemvb_6,
    gemvb_7, gemvb_8, gemvb_9, gemvb_10, gemvb_11, gemvb_12};

static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* quiet NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void put_bf(void *out_, int64_t N, int64_t M, int64_t n0, int64_t rows, const void *bias_,
                   const float *tmp, int64_t m_step, int64_t r_step) {
    uint16_t *out = out_;
    const uint16_t *bias = bias_;
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < rows && n0 + r < N; r++)
            out[m * N + n0 + r] =
                to_bf16(tmp[m * m_step + r * r_step] + (bias ? from_bf16(bias[n0 + r]) : 0.0f));
}

int rows_gemm_bf16_vector(void) { return 1; }

/* x: [M, K] bf16 rows xs elements apart (xs, K even); w: rows_pack_bf16's copy of [N, K]; out:
 * [M, N] bf16 contiguous; xT: 64-byte aligned scratch of rows_scratch_len_bf16(M, K) words. */
void rows_gemm_bf16(const uint16_t *x, int64_t xs, int64_t M, const uint32_t *w,
                    const uint16_t *bias, int64_t N, int64_t K, uint32_t *xT, uint16_t *out) {
    static const rows_kernels bf16 = {GEMVB_M,    GEMVB_MAX, bodyb_24_1, bodyb_12_1,
                                      bodyb_12_2, put_bf,    2};
    rows_drive(&bf16, (const word *)x, xs / 2, M, w, bias, N, K / 2, xT, (char *)out);
}
#endif
#else
int rows_gemm_vector(void) { return 0; }
void rows_gemm_f32(const float *x, int64_t xs, int64_t M, const float *w, const float *bias,
                   int64_t N, int64_t K, float *xT, float *out) {
    (void)x; (void)xs; (void)M; (void)w; (void)bias; (void)N; (void)K; (void)xT; (void)out;
}
#endif

#if !defined(__AVX512BF16__)
int rows_gemm_bf16_vector(void) { return 0; }
int64_t rows_packed_len_bf16(int64_t n, int64_t k) { (void)n; (void)k; return 0; }
int64_t rows_scratch_len_bf16(int64_t m, int64_t k) { (void)m; (void)k; return 0; }
void rows_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint32_t *out) {
    (void)w; (void)n; (void)k; (void)out;
}
void rows_gemm_bf16(const uint16_t *x, int64_t xs, int64_t M, const uint32_t *w,
                    const uint16_t *bias, int64_t N, int64_t K, uint32_t *xT, uint16_t *out) {
    (void)x; (void)xs; (void)M; (void)w; (void)bias; (void)N; (void)K; (void)xT; (void)out;
}
#endif
