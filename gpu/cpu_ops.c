/* Elementwise chains of the float32 forward in one pass each (built with gpu/paged_decode.c into
 * one library, see gpu/paged_kernel.py). torch runs each as 4-8 ops, each with its own
 * dispatch, allocation and pass over memory; at decode sizes (64 rows of 512) that overhead is
 * most of their cost.
 *
 * rope: x * cos + roll(x, D / 2) * sin_signed, each product rounded before the add (no FMA
 * contraction), so the result is bit-identical to the torch expression it replaces.
 * rms_norm: w * (x * rsqrt(mean(x * x) + eps)) per row, the sum of squares in float32 with a
 * vectorized (reassociated) sum: equal to torch's up to float rounding. */
#include <math.h>
#include <stdint.h>

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
