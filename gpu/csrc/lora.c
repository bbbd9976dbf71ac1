/* lora_add: the LoRA products of a step's rows, each row with its own adapter, added into a
   linear's output in place (punica's shrink and expand, fused; gpu/lora/slots.py).

   x [T, K] (row stride xs) are the linear's inputs, y [T, N] (row stride ys) its outputs. The
   adapters sit in S slots: a [S, PR, K] their A factors (the P parts of a fused linear, R rows
   each, zero rows past an adapter's rank), b [S, PR, N] their B factors (part p's rows reach
   only its columns off[p] .. off[p + 1]). Row t runs with slot slots[t] (-1: none, left as it
   is): h = (a[s] . x[t]) * scale[s], then y[t, off[p]:off[p+1]] += h[p*R:(p+1)*R] . b[s].

   The rows are grouped by slot (a counting sort) and taken LORA_ROWS at a time, so each factor
   row loaded serves that many rows; each row meets only its own slot's factors. Float32
   accumulation; a bfloat16 output is rounded once (to nearest even). */

#define LORA_MAX_PR 512 /* parts x rank: 3 x 128 at most (ops.cpp checks) */
#define LORA_ROWS 8     /* rows of one slot per block */

static inline float lora_ld(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t lora_round(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__)
static inline void lora_st(uint16_t *p, __m512 v) { /* 16 floats rounded to bfloat16 */
#if defined(__AVX512BF16__)
    _mm256_storeu_si256((__m256i *)p, (__m256i)_mm512_cvtneps_pbh(v));
#else
    float tmp[16];
    _mm512_storeu_ps(tmp, v);
    for (int q = 0; q < 16; q++) p[q] = lora_round(tmp[q]);
#endif
}
#endif

/* the rows of each slot, in order: rows[start[s] .. start[s + 1]] (start has S + 1 entries) */
static void lora_group(const int64_t *slots, int64_t T, int64_t S, int64_t *start, int64_t *rows) {
    for (int64_t s = 0; s <= S; s++) start[s] = 0;
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= 0) start[slots[t] + 1]++;
    for (int64_t s = 0; s < S; s++) start[s + 1] += start[s];
    int64_t *fill = start + S + 1; /* S more entries, scratch */
    for (int64_t s = 0; s < S; s++) fill[s] = start[s];
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= 0) rows[fill[slots[t]]++] = t;
}

/* h[i][j] = scale * a[j] . x[row i], for n rows (n <= LORA_ROWS) */
static void lora_shrink_f32(const float *x, int64_t xs, const int64_t *rows, int64_t n,
                            const float *a, int64_t PR, int64_t K, float scale,
                            float h[][LORA_MAX_PR]) {
    for (int64_t j = 0; j < PR; j++) {
        const float *aj = a + j * K;
        for (int64_t i = 0; i < n; i++) {
            const float *xr = x + rows[i] * xs;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += aj[k] * xr[k];
            h[i][j] = acc * scale;
        }
    }
}

static inline __attribute__((always_inline)) void lora_shrink_bf16_n(
    const uint16_t *x, int64_t xs, const int64_t *rows, const int64_t n,
                             const uint16_t *a, int64_t PR, int64_t K, float scale,
                             float h[][LORA_MAX_PR]) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    /* a tile of 4 factor rows x n input rows: each load feeds 4 or n pair dot products */
    int64_t k32 = K - K % 32;
    const uint16_t *xr[LORA_ROWS];
    for (int64_t i = 0; i < n; i++) xr[i] = x + rows[i] * xs;
    for (int64_t j = 0; j < PR; j += (n > 4 ? 2 : 4)) {
        const int64_t J = n > 4 ? 2 : 4;
        int64_t m = PR - j < J ? PR - j : J;
        __m512 acc[4][LORA_ROWS];
        for (int64_t u = 0; u < 4; u++)
            for (int64_t i = 0; i < LORA_ROWS; i++) acc[u][i] = _mm512_setzero_ps();
        for (int64_t k = 0; k < k32; k += 32) {
            __m512bh xv[LORA_ROWS];
            for (int64_t i = 0; i < n; i++)
                xv[i] = (__m512bh)_mm512_loadu_si512((const void *)(xr[i] + k));
            for (int64_t u = 0; u < m; u++) {
                __m512bh av = (__m512bh)_mm512_loadu_si512((const void *)(a + (j + u) * K + k));
                for (int64_t i = 0; i < n; i++) acc[u][i] = _mm512_dpbf16_ps(acc[u][i], av, xv[i]);
            }
        }
        for (int64_t u = 0; u < m; u++)
            for (int64_t i = 0; i < n; i++) {
                float d = _mm512_reduce_add_ps(acc[u][i]);
                for (int64_t k = k32; k < K; k++) d += lora_ld(a + (j + u) * K, k) * lora_ld(xr[i], k);
                h[i][j + u] = d * scale;
            }
    }
#else
    for (int64_t j = 0; j < PR; j++) {
        const uint16_t *aj = a + j * K;
        for (int64_t i = 0; i < n; i++) {
            const uint16_t *xr = x + rows[i] * xs;
            float acc = 0.f;
            for (int64_t k = 0; k < K; k++) acc += lora_ld(aj, k) * lora_ld(xr, k);
            h[i][j] = acc * scale;
        }
    }
#endif
}

/* y[row i, lo:hi] += sum_r h[i][r] b[r, lo:hi] over the part's rows r0 .. r1 */
static void lora_expand_f32(float *y, int64_t ys, const int64_t *rows, int64_t n, const float *b,
                            int64_t N, int64_t r0, int64_t r1, int64_t lo, int64_t hi,
                            float h[][LORA_MAX_PR]) {
    for (int64_t i = 0; i < n; i++) {
        float *yr = y + rows[i] * ys;
        for (int64_t r = r0; r < r1; r++) {
            float hr = h[i][r];
            if (hr == 0.f) continue; /* a rank below R: its zero rows */
            const float *br = b + r * N;
            for (int64_t c = lo; c < hi; c++) yr[c] += hr * br[c];
        }
    }
}

static inline __attribute__((always_inline)) void lora_expand_bf16_n(
    uint16_t *y, int64_t ys, const int64_t *rows, const int64_t n,
                             const uint16_t *b, int64_t N, int64_t r0, int64_t r1, int64_t lo,
                             int64_t hi, float h[][LORA_MAX_PR]) {
    int64_t c = lo;
#if defined(__AVX512F__)
    /* a tile of n rows x 16Q columns (16 accumulators): each factor chunk loaded feeds n rows */
    const int Q = n > 4 ? 2 : 4;
    for (; c + 16 * Q <= hi; c += 16 * Q) {
        __m512 acc[LORA_ROWS][4];
        for (int64_t i = 0; i < n; i++)
            for (int q = 0; q < Q; q++) acc[i][q] = vld_bf16(y + rows[i] * ys + c + 16 * q);
        for (int64_t r = r0; r < r1; r++) {
            const uint16_t *br = b + r * N + c;
            __m512 bv[4];
            for (int q = 0; q < Q; q++) bv[q] = vld_bf16(br + 16 * q);
            for (int64_t i = 0; i < n; i++) {
                __m512 hv = _mm512_set1_ps(h[i][r]);
                for (int q = 0; q < Q; q++) acc[i][q] = _mm512_fmadd_ps(hv, bv[q], acc[i][q]);
            }
        }
        for (int64_t i = 0; i < n; i++)
            for (int q = 0; q < Q; q++) lora_st(y + rows[i] * ys + c + 16 * q, acc[i][q]);
    }
    for (; c + 16 <= hi; c += 16) {
        __m512 acc[LORA_ROWS];
        for (int64_t i = 0; i < n; i++) acc[i] = vld_bf16(y + rows[i] * ys + c);
        for (int64_t r = r0; r < r1; r++) {
            __m512 bv = vld_bf16(b + r * N + c);
            for (int64_t i = 0; i < n; i++)
                acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(h[i][r]), bv, acc[i]);
        }
        for (int64_t i = 0; i < n; i++) lora_st(y + rows[i] * ys + c, acc[i]);
    }
#endif
    for (; c < hi; c++) {
        for (int64_t i = 0; i < n; i++) {
            uint16_t *yr = y + rows[i] * ys;
            float acc = lora_ld(yr, c);
            for (int64_t r = r0; r < r1; r++) acc += h[i][r] * lora_ld(b + r * N, c);
            yr[c] = lora_round(acc);
        }
    }
}

/* the tiles above with n a constant, so their accumulators stay in registers */
static void lora_shrink_bf16(const uint16_t *x, int64_t xs, const int64_t *rows, int64_t n,
                             const uint16_t *a, int64_t PR, int64_t K, float scale,
                             float h[][LORA_MAX_PR]) {
    switch (n) {
    case 8: lora_shrink_bf16_n(x, xs, rows, 8, a, PR, K, scale, h); break;
    case 7: lora_shrink_bf16_n(x, xs, rows, 7, a, PR, K, scale, h); break;
    case 6: lora_shrink_bf16_n(x, xs, rows, 6, a, PR, K, scale, h); break;
    case 5: lora_shrink_bf16_n(x, xs, rows, 5, a, PR, K, scale, h); break;
    case 4: lora_shrink_bf16_n(x, xs, rows, 4, a, PR, K, scale, h); break;
    case 3: lora_shrink_bf16_n(x, xs, rows, 3, a, PR, K, scale, h); break;
    case 2: lora_shrink_bf16_n(x, xs, rows, 2, a, PR, K, scale, h); break;
    default: lora_shrink_bf16_n(x, xs, rows, 1, a, PR, K, scale, h); break;
    }
}

static void lora_expand_bf16(uint16_t *y, int64_t ys, const int64_t *rows, int64_t n,
                             const uint16_t *b, int64_t N, int64_t r0, int64_t r1, int64_t lo,
                             int64_t hi, float h[][LORA_MAX_PR]) {
    switch (n) {
    case 8: lora_expand_bf16_n(y, ys, rows, 8, b, N, r0, r1, lo, hi, h); break;
    case 7: lora_expand_bf16_n(y, ys, rows, 7, b, N, r0, r1, lo, hi, h); break;
    case 6: lora_expand_bf16_n(y, ys, rows, 6, b, N, r0, r1, lo, hi, h); break;
    case 5: lora_expand_bf16_n(y, ys, rows, 5, b, N, r0, r1, lo, hi, h); break;
    case 4: lora_expand_bf16_n(y, ys, rows, 4, b, N, r0, r1, lo, hi, h); break;
    case 3: lora_expand_bf16_n(y, ys, rows, 3, b, N, r0, r1, lo, hi, h); break;
    case 2: lora_expand_bf16_n(y, ys, rows, 2, b, N, r0, r1, lo, hi, h); break;
    default: lora_expand_bf16_n(y, ys, rows, 1, b, N, r0, r1, lo, hi, h); break;
    }
}

#define LORA_ADD(NAME, TY, SHRINK, EXPAND)                                                        \
    void NAME(const TY *x, int64_t xs, const TY *a, const TY *b, const int64_t *slots,            \
              const float *scale, const int64_t *off, int64_t T, int64_t K, int64_t N,            \
              int64_t PR, int64_t P, int64_t S, int64_t *scratch, TY *y, int64_t ys) {            \
        int64_t *start = scratch, *rows = scratch + 2 * S + 1;                                    \
        lora_group(slots, T, S, start, rows);                                                     \
        int64_t R = PR / P, nblocks = 0;                                                          \
        int64_t *blocks = rows + T; /* each block's first position in rows */                     \
        for (int64_t s = 0; s < S; s++)                                                           \
            for (int64_t q = start[s]; q < start[s + 1]; q += LORA_ROWS) blocks[nblocks++] = q;   \
        _Pragma("omp parallel for if (nblocks > 1 && T * PR * K > 131072) schedule(static)")      \
        for (int64_t bi = 0; bi < nblocks; bi++) {                                                \
            int64_t q = blocks[bi], s = slots[rows[q]];                                           \
            int64_t n = start[s + 1] - q < LORA_ROWS ? start[s + 1] - q : LORA_ROWS;              \
            float h[LORA_ROWS][LORA_MAX_PR];                                                      \
            SHRINK(x, xs, rows + q, n, a + s * PR * K, PR, K, scale[s], h);                       \
            for (int64_t p = 0; p < P; p++)                                                       \
                EXPAND(y, ys, rows + q, n, b + s * PR * N, N, p * R, (p + 1) * R, off[p],         \
                       off[p + 1], h);                                                            \
        }                                                                                         \
    }

LORA_ADD(lora_add_f32, float, lora_shrink_f32, lora_expand_f32)
LORA_ADD(lora_add_bf16, uint16_t, lora_shrink_bf16, lora_expand_bf16)
