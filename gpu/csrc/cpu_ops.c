/* Elementwise chains of the float32 forward in one pass each (built with paged_decode.c into
 * one library of torch operators, see ops.cpp and setup.py). torch runs each as 4-8 ops, each with its own
 * dispatch, allocation and pass over memory; at decode sizes (64 rows of 512) that overhead is
 * most of their cost.
 *
 * rope: x * cos + roll(x, D / 2) * sin_signed, each product rounded before the add (no FMA
 * contraction), so the result is bit-identical to the torch expression it replaces.
 * rms_norm: w * (x * rsqrt(mean(x * x) + eps)) per row, the sum of squares in float32 with a
 * vectorized (reassociated) sum: equal to torch's up to float rounding.
 * argmax: the greedy pick, the same index torch's max(dim).indices gives (first maximum; the
 * first NaN if a row has one).
 * kv_write: the step's K or V rows copied into the paged cache at their slots (index_copy_ along
 * the cache's slot dimension costs ~80 us per call at 64 rows; this is a memcpy per row and head). */
#include <math.h>
#include <stdint.h>
#include <string.h>

/* src: n rows of `heads` vectors of vec_bytes each, rows at rs bytes, heads at hs bytes;
   cache: [heads, num_slots, vec] contiguous. Rows whose slot is outside [0, num_slots) are not
   written; returns how many there were (the caller raises). */
int64_t kv_write(const char *src, int64_t rs, int64_t hs, const int64_t *slots, int64_t n,
                 int64_t heads, int64_t vec_bytes, int64_t num_slots, char *cache) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t s = slots[i];
        if (s < 0 || s >= num_slots) {
            bad++;
            continue;
        }
        for (int64_t h = 0; h < heads; h++)
            memcpy(cache + (h * num_slots + s) * vec_bytes, src + i * rs + h * hs, (size_t)vec_bytes);
    }
    return bad;
}

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
/* x: rows of `heads` vectors of D at row stride xs (elements); out: contiguous [rows, heads, D];
   cos/sin: tables [max_pos, D], read at positions[t] */
void rope_f32(const float *x, int64_t xs, const float *cos_t, const float *sin_t,
              const int64_t *positions, int64_t rows, int64_t heads, int64_t D, float *out) {
    int64_t half = D / 2;
#pragma omp parallel for if (rows * heads * D > 65536) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_t + positions[t] * D, *s = sin_t + positions[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            const float *xi = x + t * xs + h * D;
            float *o = out + (t * heads + h) * D;
            for (int64_t i = 0; i < half; i++) {
                float a = xi[i] * c[i], b = xi[i + half] * s[i];
                o[i] = a + b;
            }
            for (int64_t i = half; i < D; i++) {
                float a = xi[i] * c[i], b = xi[i - half] * s[i];
                o[i] = a + b;
            }
        }
    }
}
#pragma GCC pop_options

/* x: rows of n at row stride xs; out: contiguous [rows, n] */
void rms_norm_f32(const float *x, int64_t xs, const float *w, int64_t rows, int64_t n, float eps,
                  float *out) {
#pragma omp parallel for if (rows * n > 65536) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *xi = x + t * xs;
        float ss = 0.f;
        for (int64_t i = 0; i < n; i++) ss += xi[i] * xi[i];
        float r = 1.f / sqrtf(ss / (float)n + eps);
        float *o = out + t * n;
        for (int64_t i = 0; i < n; i++) o[i] = w[i] * (xi[i] * r);
    }
}

/* per row of x ([rows, n] at row stride xs): the index of the first maximum, or of the first NaN
   if the row has one (what torch's max(dim).indices returns) */
#if defined(__AVX512F__)
#include <immintrin.h>
static int64_t argmax_row(const float *x, int64_t n) {
    __m512 m = _mm512_set1_ps(-INFINITY);
    int64_t i = 0, nan = 0;
    for (; i + 16 <= n && !nan; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
        m = _mm512_max_ps(m, v);
    }
    float best = _mm512_reduce_max_ps(m);
    for (int64_t j = i; j < n && !nan; j++) { /* the tail */
        nan = x[j] != x[j];
        if (x[j] > best) best = x[j];
    }
    if (nan) { /* the first NaN wins */
        for (int64_t j = 0; j < n; j++)
            if (x[j] != x[j]) return j;
    }
    __m512 b = _mm512_set1_ps(best);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + j), b, _CMP_EQ_OQ);
        if (k) return j + __builtin_ctz(k);
    }
    for (; j < n; j++)
        if (x[j] == best) return j;
    return 0;
}
#else
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t bi = 0;
    for (int64_t j = 0; j < n; j++) {
        if (x[j] != x[j]) return j;
        if (x[j] > x[bi]) bi = j;
    }
    return bi;
}
#endif

void argmax_f32(const float *x, int64_t xs, int64_t rows, int64_t n, int64_t *out) {
#pragma omp parallel for if (rows >= 8) schedule(static)
    for (int64_t t = 0; t < rows; t++) out[t] = argmax_row(x + t * xs, n);
}

/* silu_mul: the gated MLP's silu(gate) * up, from the gate_up output rows ([rows, 2F] at row
   stride gs, gate in the first F columns) into a contiguous [rows, F], in float32 (bfloat16 rows
   are widened first and the product rounded once, to nearest even). silu(x) = x * sigmoid(x),
   sigmoid through exp(-|x|) so that exp never overflows: equal to torch's F.silu(g) * u up to
   float rounding (a different exp). */
static inline float silu_f(float x) {
    float e = expf(-fabsf(x)), s = x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
    return x * s;
}
#if defined(__AVX512F__)
static inline __m512 vsilu(__m512 x) {
    __m512 ax = _mm512_abs_ps(x);
    __m512 e = vexp(_mm512_sub_ps(_mm512_setzero_ps(), ax)), d = _mm512_add_ps(_mm512_set1_ps(1.f), e);
    __mmask16 neg = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LT_OQ);
    __m512 num = _mm512_mask_blend_ps(neg, _mm512_set1_ps(1.f), e);
    return _mm512_mul_ps(x, _mm512_div_ps(num, d));
}
#endif

void silu_mul_f32(const float *gu, int64_t gs, int64_t rows, int64_t F, float *out) {
#pragma omp parallel for if (rows * F > 65536) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const float *g = gu + t * gs, *u = g + F;
        float *o = out + t * F;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= F; i += 16)
            _mm512_storeu_ps(o + i, _mm512_mul_ps(vsilu(_mm512_loadu_ps(g + i)), _mm512_loadu_ps(u + i)));
#endif
        for (; i < F; i++) o[i] = silu_f(g[i]) * u[i];
    }
}

void silu_mul_bf16(const uint16_t *gu, int64_t gs, int64_t rows, int64_t F, uint16_t *out) {
#pragma omp parallel for if (rows * F > 65536) schedule(static)
    for (int64_t t = 0; t < rows; t++) {
        const uint16_t *g = gu + t * gs, *u = g + F;
        uint16_t *o = out + t * F;
        int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        for (; i + 16 <= F; i += 16) {
            __m512 y = _mm512_mul_ps(vsilu(vld_bf16(g + i)), vld_bf16(u + i));
            _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(y));
        }
#endif
        for (; i < F; i++) st_bf16(o, i, silu_f(ld_bf16(g, i)) * ld_bf16(u, i)); /* paged_decode.c's */
    }
}
