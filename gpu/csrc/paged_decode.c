/* Decode attention read in place from the paged KV cache (the minirt::paged_decode operator,
 * ops.cpp; setup.py builds it once per instruction set). One task per (request, KV head): score the group's query heads against
 * the request's context, softmax, sum the values; float32 accumulation, K/V in float32 or bf16.
 *
 * Two bodies. With AVX-512 and a head_dim that is a multiple of 16 (every model here), the
 * vector body: scores 16 positions at a time with one vector accumulator per position, reduced
 * across lanes by a transpose-and-add tree (no horizontal sum per dot product); exp by range
 * reduction and a polynomial (outputs within 1e-6 of SDPA in the tests); the values summed with the group's
 * accumulators held in registers. While it scores 16 positions it prefetches the next 16's K
 * rows and these 16's V rows: a block's rows are one 4 KB page here, where the hardware
 * prefetcher stops, and with the decode batch's KV coming from DRAM (32 MB of L3 on a Zen 5)
 * that took a batch-32 layer of the 0.39B model's shapes from 302-370 to 268-311 us (2
 * threads, 24 layers cycled). Otherwise the portable body, which the compiler vectorizes as it
 * can. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float ld_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float ld_bf16(const void *p, int64_t i) {
    uint32_t u = ((uint32_t)((const uint16_t *)p)[i]) << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}
static inline void st_f32(void *p, int64_t i, float v) { ((float *)p)[i] = v; }
static inline void st_bf16(void *p, int64_t i, float v) {
    uint32_t u;
    __builtin_memcpy(&u, &v, 4);
    if (v != v) { /* a NaN stays a (quiet) NaN: the rounding below could carry it into -0 */
        ((uint16_t *)p)[i] = 0x7FC0;
        return;
    }
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    ((uint16_t *)p)[i] = (uint16_t)(u >> 16);
}

#define ARGS                                                                                  \
    const void *q, const void *kc, const void *vc, const int64_t *tables, const int64_t *lens, \
        int64_t r, int64_t h, int64_t heads, int64_t g, int64_t d, int64_t bs,                \
        int64_t num_slots, int64_t max_blocks, float scale, void *out

/* ------------------------------------------------------------------ portable body */
#define PORTABLE(NAME, LD, ST)                                                                \
    static void NAME(ARGS) {                                                                  \
        int64_t L = lens[r], D = d;                                                           \
        float *qv = (float *)malloc(sizeof(float) * (2 * g * D + D + g + g * L + 1));        \
        float *acc = qv + g * D, *kv = acc + g * D, *sum = kv + D, *s = sum + g;              \
        for (int64_t j = 0; j < g; j++)                                                       \
            for (int64_t e = 0; e < D; e++) {                                                 \
                qv[j * D + e] = LD(q, (r * heads + h * g + j) * D + e) * scale;               \
                acc[j * D + e] = 0.f;                                                         \
            }                                                                                 \
        const int64_t *tab = tables + r * max_blocks;                                         \
        for (int64_t l = 0, bi = 0, bo = 0; l < L; l++) { /* block bi, offset bo: no divisions */ \
            int64_t row = h * num_slots + tab[bi] * bs + bo;                                  \
            if (++bo == bs) bo = 0, bi++;                                                     \
            for (int64_t e = 0; e < D; e++) kv[e] = LD(kc, row * D + e);                      \
            for (int64_t j = 0; j < g; j++) {                                                 \
                float t = 0.f;                                                                \
                for (int64_t e = 0; e < D; e++) t += qv[j * D + e] * kv[e];                   \
                s[j * L + l] = t;                                                             \
            }                                                                                 \
        }                                                                                     \
        for (int64_t j = 0; j < g; j++) {                                                     \
            float *sj = s + j * L, m = -INFINITY, tot = 0.f;                                  \
            for (int64_t l = 0; l < L; l++) m = sj[l] > m ? sj[l] : m;                        \
            for (int64_t l = 0; l < L; l++) {                                                 \
                sj[l] = expf(sj[l] - m);                                                      \
                tot += sj[l];                                                                 \
            }                                                                                 \
            sum[j] = tot;                                                                     \
        }                                                                                     \
        for (int64_t l = 0, bi = 0, bo = 0; l < L; l++) {                                     \
            int64_t row = h * num_slots + tab[bi] * bs + bo;                                  \
            if (++bo == bs) bo = 0, bi++;                                                     \
            for (int64_t e = 0; e < D; e++) kv[e] = LD(vc, row * D + e);                      \
            for (int64_t j = 0; j < g; j++) {                                                 \
                float p = s[j * L + l], *aj = acc + j * D;                                    \
                for (int64_t e = 0; e < D; e++) aj[e] += p * kv[e];                           \
            }                                                                                 \
        }                                                                                     \
        for (int64_t j = 0; j < g; j++)                                                       \
            for (int64_t e = 0; e < D; e++)                                                   \
                ST(out, (r * heads + h * g + j) * D + e, acc[j * D + e] / sum[j]);            \
        free(qv);                                                                             \
    }
PORTABLE(portable_f32, ld_f32, st_f32)
PORTABLE(portable_bf16, ld_bf16, st_bf16)

#if defined(__AVX512F__)
#include <immintrin.h>
#define HAVE_VECTOR 1

static inline __m512 vld_f32(const void *p) { return _mm512_loadu_ps((const float *)p); }
static inline __m512 vld_bf16(const void *p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* lane i of the result = the sum of a[i]'s 16 lanes */
static inline __m512 sum16(__m512 *a) {
    __m512 b[8], c[4], e[2];
    for (int k = 0; k < 8; k++)
        b[k] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * k], a[2 * k + 1]),
                             _mm512_unpackhi_ps(a[2 * k], a[2 * k + 1]));
    for (int k = 0; k < 4; k++) {
        __m512d x = _mm512_castps_pd(b[2 * k]), y = _mm512_castps_pd(b[2 * k + 1]);
        c[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    for (int k = 0; k < 2; k++)
        e[k] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(c[2 * k], c[2 * k + 1], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e[0], e[1], 0x88),
                         _mm512_shuffle_f32x4(e[0], e[1], 0xDD));
}

/* exp(x) for x <= 0: x = n ln2 + f, |f| <= ln2/2; exp(f) by a degree-6 polynomial; 2^n by scalef */
static inline __m512 vexp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.f)); /* exp underflows to 0 below */
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), f);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(f, f), _mm512_add_ps(f, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}

/* C = head_dim / 16; HG = query heads whose value accumulators share the registers */
#define VECTOR(NAME, VLD, LD, ST, ESZ, C, HG)                                                      \
    static void NAME(ARGS) {                                                                  \
        const int64_t L = lens[r], Lp = (L + 15) & ~(int64_t)15, D = 16 * C;                  \
        const char *K = (const char *)kc, *V = (const char *)vc;                              \
        float *buf = (float *)malloc(sizeof(float) * (g * D + g * Lp + g));                   \
        float *qv = buf, *s = buf + g * D, *inv = s + g * Lp;                                 \
        for (int64_t j = 0; j < g; j++)                                                       \
            for (int64_t e = 0; e < D; e++)                                                   \
                qv[j * D + e] = LD(q, (r * heads + h * g + j) * D + e) * scale;               \
        const int64_t *tab = tables + r * max_blocks;                                         \
        const char *rows[16], *next[16];                                                      \
        int64_t bi = 0, bo = 0; /* block and offset of the next position: no divisions */     \
        for (int64_t i = 0; i < 16; i++) {                                                    \
            next[i] = i < L ? K + (h * num_slots + tab[bi] * bs + bo) * D * ESZ : next[0];    \
            if (i < L && ++bo == bs) bo = 0, bi++;                                            \
        }                                                                                     \
        for (int64_t l0 = 0; l0 < L; l0 += 16) {                                              \
            /* past the end: any valid row (those lanes are masked below), so the loop over   \
               the 16 positions has a constant count and its accumulators stay in registers */ \
            for (int64_t i = 0; i < 16; i++) rows[i] = next[i];                               \
            int64_t cnt = L - l0 - 16 < 16 ? L - l0 - 16 : 16;                                \
            for (int64_t i = 0; i < cnt; i++) {                                               \
                next[i] = K + (h * num_slots + tab[bi] * bs + bo) * D * ESZ;                  \
                if (++bo == bs) bo = 0, bi++;                                                 \
                for (int64_t e = 0; e < D * ESZ; e += 64) {                                   \
                    _mm_prefetch(next[i] + e, _MM_HINT_T0);                                   \
                    _mm_prefetch(V + (rows[i] - K) + e, _MM_HINT_T1);                         \
                }                                                                             \
            }                                                                                 \
            for (int64_t i = cnt < 0 ? 0 : cnt; i < 16; i++) {                                \
                next[i] = next[0];                                                            \
                for (int64_t e = 0; e < D * ESZ; e += 64)                                     \
                    _mm_prefetch(V + (rows[i] - K) + e, _MM_HINT_T1);                         \
            }                                                                                 \
            for (int64_t j = 0; j < g; j++) {                                                 \
                __m512 qj[C], a[16];                                                          \
                for (int c = 0; c < C; c++) qj[c] = _mm512_loadu_ps(qv + j * D + 16 * c);     \
                for (int i = 0; i < 16; i++) a[i] = _mm512_setzero_ps();                      \
                for (int i = 0; i < 16; i++)                                                  \
                    for (int c = 0; c < C; c++)                                               \
                        a[i] = _mm512_fmadd_ps(VLD(rows[i] + 16 * c * ESZ), qj[c], a[i]);     \
                _mm512_storeu_ps(s + j * Lp + l0, sum16(a));                                  \
            }                                                                                 \
        }                                                                                     \
        for (int64_t j = 0; j < g; j++) {                                                     \
            float *sj = s + j * Lp;                                                           \
            __m512 m = _mm512_set1_ps(-INFINITY), t = _mm512_setzero_ps();                    \
            for (int64_t l = 0; l < L; l += 16) {                                             \
                __mmask16 k = L - l >= 16 ? 0xFFFF : (__mmask16)((1u << (L - l)) - 1);        \
                m = _mm512_mask_max_ps(m, k, m, _mm512_loadu_ps(sj + l));                     \
            }                                                                                 \
            __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));                              \
            for (int64_t l = 0; l < L; l += 16) {                                             \
                __mmask16 k = L - l >= 16 ? 0xFFFF : (__mmask16)((1u << (L - l)) - 1);        \
                __m512 p = _mm512_maskz_mov_ps(k, vexp(_mm512_sub_ps(_mm512_loadu_ps(sj + l), mx))); \
                _mm512_storeu_ps(sj + l, p);                                                  \
                t = _mm512_add_ps(t, p);                                                      \
            }                                                                                 \
            inv[j] = 1.f / _mm512_reduce_add_ps(t);                                           \
        }                                                                                     \
        for (int64_t j0 = 0; j0 < g; j0 += HG) {                                              \
            __m512 acc[HG][C];                                                                \
            for (int jj = 0; jj < HG; jj++)                                                   \
                for (int c = 0; c < C; c++) acc[jj][c] = _mm512_setzero_ps();                 \
            int64_t jn = g - j0 < HG ? g - j0 : HG;                                           \
            for (int64_t l = 0, bi = 0, bo = 0; l < L; l++) {                                 \
                const char *row = V + (h * num_slots + tab[bi] * bs + bo) * D * ESZ;          \
                if (++bo == bs) bo = 0, bi++;                                                 \
                __m512 v[C];                                                                  \
                for (int c = 0; c < C; c++) v[c] = VLD(row + 16 * c * ESZ);                   \
                for (int jj = 0; jj < HG; jj++) {                                             \
                    if (jj >= jn) break;                                                      \
                    __m512 p = _mm512_set1_ps(s[(j0 + jj) * Lp + l]);                         \
                    for (int c = 0; c < C; c++) acc[jj][c] = _mm512_fmadd_ps(p, v[c], acc[jj][c]); \
                }                                                                             \
            }                                                                                 \
            for (int jj = 0; jj < jn; jj++) {                                                 \
                float o[16 * C];                                                              \
                __m512 iv = _mm512_set1_ps(inv[j0 + jj]);                                     \
                for (int c = 0; c < C; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(acc[jj][c], iv)); \
                for (int64_t e = 0; e < D; e++) ST(out, (r * heads + h * g + j0 + jj) * D + e, o[e]); \
            }                                                                                 \
        }                                                                                     \
        free(buf);                                                                            \
    }
VECTOR(vec_f32_1, vld_f32, ld_f32, st_f32, 4, 1, 8)
VECTOR(vec_f32_2, vld_f32, ld_f32, st_f32, 4, 2, 8)
VECTOR(vec_f32_4, vld_f32, ld_f32, st_f32, 4, 4, 4)
VECTOR(vec_f32_8, vld_f32, ld_f32, st_f32, 4, 8, 2)
VECTOR(vec_bf16_1, vld_bf16, ld_bf16, st_bf16, 2, 1, 8)
VECTOR(vec_bf16_2, vld_bf16, ld_bf16, st_bf16, 2, 2, 8)
VECTOR(vec_bf16_4, vld_bf16, ld_bf16, st_bf16, 2, 4, 4)
VECTOR(vec_bf16_8, vld_bf16, ld_bf16, st_bf16, 2, 8, 2)
#endif

typedef void (*body_fn)(ARGS);

static body_fn pick(int bf16, int64_t d) {
#ifdef HAVE_VECTOR
    switch (d) {
    case 16: return bf16 ? vec_bf16_1 : vec_f32_1;
    case 32: return bf16 ? vec_bf16_2 : vec_f32_2;
    case 64: return bf16 ? vec_bf16_4 : vec_f32_4;
    case 128: return bf16 ? vec_bf16_8 : vec_f32_8;
    }
#endif
    return bf16 ? portable_bf16 : portable_f32;
}

/* 1 when this build has the vector body for these shapes */
int64_t paged_decode_vector(int64_t bf16, int64_t d) {
    body_fn f = pick((int)bf16, d);
    return f != portable_f32 && f != portable_bf16;
}

static int by_first_block(const void *a, const void *b) {
    const int64_t *x = (const int64_t *)a, *y = (const int64_t *)b;
    return x[0] != y[0] ? (x[0] < y[0] ? -1 : 1) : (x[1] < y[1] ? -1 : x[1] > y[1]);
}

static void run(int bf16, const void *q, const void *kc, const void *vc, const int64_t *tables,
                const int64_t *lens, int64_t n, int64_t heads, int64_t kvh, int64_t d,
                int64_t bs, int64_t num_slots, int64_t max_blocks, float scale, void *out,
                int64_t portable) {
    int64_t g = heads / kvh;
    body_fn f = portable ? (bf16 ? portable_bf16 : portable_f32) : pick(bf16, d);
    /* rows that share a cached prefix (the same first block) run one after another, so the
       prefix is read from the cache of the core that just read it */
    int64_t *order = (int64_t *)malloc(sizeof(int64_t) * 2 * (n + 1));
    for (int64_t r = 0; r < n; r++) {
        order[2 * r] = tables[r * max_blocks];
        order[2 * r + 1] = r;
    }
    qsort(order, n, 2 * sizeof(int64_t), by_first_block);
#pragma omp parallel for schedule(dynamic)
    for (int64_t t = 0; t < n * kvh; t++) {
        int64_t r = order[2 * (t / kvh) + 1], h = (t % kvh);
        f(q, kc, vc, tables, lens, r, h, heads, g, d, bs, num_slots, max_blocks, scale, out);
    }
    free(order);
}

#define ENTRY(NAME, BF16)                                                                     \
    void NAME(const void *q, const void *kc, const void *vc, const int64_t *tables,          \
              const int64_t *lens, int64_t n, int64_t heads, int64_t kvh, int64_t d,         \
              int64_t bs, int64_t num_slots, int64_t max_blocks, float scale, void *out,     \
              int64_t portable) {                                                             \
        run(BF16, q, kc, vc, tables, lens, n, heads, kvh, d, bs, num_slots, max_blocks, scale, \
            out, portable);                                                                   \
    }
ENTRY(paged_decode_f32, 0)
ENTRY(paged_decode_bf16, 1)
