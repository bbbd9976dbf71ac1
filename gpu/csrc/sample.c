/* sample_f32: one categorical draw per selected row of the logits, by the inverse of the
 * distribution's cumulative sum at a uniform u the caller derives from (seed, output index): the
 * token is the first i with e_0 + ... + e_i > u * (e_0 + ... + e_{n-1}), where
 * e_i = exp((x_i - max) / T) for x_i >= floor (the top-k / top-p / min-p cut, in logit space) and 0
 * otherwise. One uniform per row, so a row's token depends only on its logits and its u, whatever
 * else is in the batch; no noise tensor of the vocabulary's size is drawn (greedy reads the row
 * once, this reads it twice and exponentiates it once, plus one block of 256 again).
 * A row with a NaN gives its first NaN (as argmax does); a row with nothing kept, its argmax. */
#define SAMPLE_BLOCK 256

static inline float sample_exp(float v) { return expf(v); }

/* e of one block into buf (0 where cut), and its float sum */
static float sample_block(const float *x, int64_t n, float m, float sc, float fl, float *buf) {
    float sum = 0.f;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(m), vs = _mm512_set1_ps(sc), vf = _mm512_set1_ps(fl), acc = _mm512_setzero_ps();
    __m512 ninf = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __mmask16 keep = _mm512_cmp_ps_mask(v, vf, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, ninf, _CMP_GT_OQ);
        __m512 e = _mm512_maskz_mov_ps(keep, vexp(_mm512_mul_ps(_mm512_sub_ps(v, vm), vs)));
        if (buf) _mm512_storeu_ps(buf + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    sum = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; i++) {
        float e = (x[i] >= fl && x[i] > -INFINITY) ? sample_exp((x[i] - m) * sc) : 0.f;
        if (buf) buf[i] = e;
        sum += e;
    }
    return sum;
}

static int64_t sample_row(const float *x, int64_t n, float sc, float fl, float lmp, double u) {
    float m = -INFINITY;
    int nan = 0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n && !nan; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
        vmax = _mm512_max_ps(vmax, v);
    }
    m = _mm512_reduce_max_ps(vmax);
#endif
    for (; i < n && !nan; i++) {
        nan = x[i] != x[i];
        if (x[i] > m) m = x[i];
    }
    if (nan || !(m > -INFINITY)) return argmax_row(x, n);
    if (lmp > -INFINITY && m + lmp / sc > fl) fl = m + lmp / sc; /* min-p: p >= min_p * p_max */
    if (fl > m) fl = m; /* the best token is always kept */
    int64_t nb = (n + SAMPLE_BLOCK - 1) / SAMPLE_BLOCK;
    float *sums = (float *)malloc(sizeof(float) * (nb + SAMPLE_BLOCK));
    float *buf = sums + nb;
    double total = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * SAMPLE_BLOCK, len = n - lo < SAMPLE_BLOCK ? n - lo : SAMPLE_BLOCK;
        sums[b] = sample_block(x + lo, len, m, sc, fl, NULL);
        total += sums[b];
    }
    double target = u * total, acc = 0.0;
    int64_t pick = -1;
    for (int64_t b = 0; b < nb && pick < 0; b++) {
        if (sums[b] <= 0.f) continue;
        if (acc + sums[b] <= target && b + 1 < nb) {
            acc += sums[b];
            continue;
        }
        int64_t lo = b * SAMPLE_BLOCK, len = n - lo < SAMPLE_BLOCK ? n - lo : SAMPLE_BLOCK;
        sample_block(x + lo, len, m, sc, fl, buf);
        int64_t last = -1;
        for (int64_t j = 0; j < len; j++) {
            if (buf[j] <= 0.f) continue;
            last = lo + j;
            acc += buf[j];
            if (acc > target) break;
        }
        /* the block's own order of summing may fall short of its vector sum: its last kept token */
        pick = last;
    }
    free(sums);
    return pick >= 0 ? pick : argmax_row(x, n);
}

/* rows[r]: the row of x (row stride xs) that out[r] is drawn from, with 1/T inv_temp[r], cut
   floor[r] (-inf: none), ln(min_p) log_min_p[r] (-inf: none) and uniform u[r] in [0, 1) */
void sample_f32(const float *x, int64_t xs, const int64_t *rows, int64_t nrows, int64_t n,
                const float *inv_temp, const float *floor_, const float *log_min_p, const double *u,
                int64_t *out) {
#pragma omp parallel for if (nrows * n > 65536) schedule(static)
    for (int64_t r = 0; r < nrows; r++)
        out[r] = sample_row(x + rows[r] * xs, n, inv_temp[r], floor_[r], log_min_p[r], u[r]);
}

/* topk_f32: each selected row's k largest values, sorted descending (-inf past the row's finite
 * ones; NaNs skipped), for the top-k and top-p cuts. One pass: a vector compare against the k-th
 * largest so far lets few values through to a buffer, cut back to its k largest when full. */
static void select_desc(float *a, int64_t n, int64_t k) { /* a[0..k) = the k largest, any order */
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        float pivot = a[(lo + hi) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                float t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (k - 1 <= j) hi = j;
        else if (k - 1 >= i) lo = i;
        else return;
    }
}

static int cmp_desc(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

static void topk_row(const float *x, int64_t n, int64_t k, float *out) {
    int64_t cap = 2 * k + 32, cnt = 0;
    float *buf = (float *)malloc(sizeof(float) * cap);
    float thr = -INFINITY;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(x + i);
        __mmask16 keep = _mm512_cmp_ps_mask(v, _mm512_set1_ps(thr), _CMP_GT_OQ);
        if (!keep) continue;
        _mm512_mask_compressstoreu_ps(buf + cnt, keep, v);
        cnt += __builtin_popcount(keep);
        if (cnt > cap - 16) {
            select_desc(buf, cnt, k);
            cnt = k;
            thr = buf[0];
            for (int64_t j = 1; j < k; j++) thr = buf[j] < thr ? buf[j] : thr;
        }
    }
#endif
    for (; i < n; i++) {
        if (!(x[i] > thr)) continue;
        buf[cnt++] = x[i];
        if (cnt == cap) {
            select_desc(buf, cnt, k);
            cnt = k;
            thr = buf[0];
            for (int64_t j = 1; j < k; j++) thr = buf[j] < thr ? buf[j] : thr;
        }
    }
    if (cnt > k) select_desc(buf, cnt, k), cnt = k;
    qsort(buf, (size_t)cnt, sizeof(float), cmp_desc);
    for (int64_t j = 0; j < k; j++) out[j] = j < cnt ? buf[j] : -INFINITY;
    free(buf);
}

void topk_f32(const float *x, int64_t xs, const int64_t *rows, int64_t nrows, int64_t n, int64_t k,
              float *out) {
#pragma omp parallel for if (nrows * n > 65536) schedule(static)
    for (int64_t r = 0; r < nrows; r++) topk_row(x + rows[r] * xs, n, k, out + r * k);
}
