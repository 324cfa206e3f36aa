/* Grouped-query attention of a few queries over a long cache, in one pass per step over the keys and
 * one over the values: softmax(q k^T * scale + mask) v for every query head of a key/value group.
 *
 * For each group g the R query rows of its heads (H/G heads x M queries, stacked as transformers
 * pairs them) are written transposed, qt [D][R], so one key's element k[p][d], broadcast, multiplies
 * a vector of R queries' elements: four keys and up to 3 (AVX2) or 4 (AVX-512) vectors of rows at a
 * time, 12 or 16 independent multiply-add chains. The scores are kept key-major, s [N][R], so the
 * softmax runs down the keys with vectors across the rows (maximum, exp, sum: no horizontal sums),
 * and the values are summed per row, VALUE_TILE keys at a time (a tile of v in the core's first
 * cache), the next tile's values fetched while one is summed. The outputs are written as the
 * forward reads them, [M][H * D].
 *
 * Float32 throughout; sums run in another order than torch's bmm and softmax, and exp is a
 * polynomial (Cephes' expf, within 2 ulp), so outputs agree with torch's to float32 rounding.
 *
 * Built twice from this file (mdcli.backends.attention.fused): with AVX-512 (16 lanes) and with AVX2 (8).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define LANES 16
#define ROW_VECTORS 4 /* 4 keys x 4 vectors of rows: 16 accumulators, 4 query vectors of the 32 registers */
typedef __m512 vec;
typedef __m512i ivec;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vfnma _mm512_fnmadd_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vsub _mm512_sub_ps
#define vmax _mm512_max_ps
#define vmin _mm512_min_ps
#define vround(x) _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vtoint _mm512_cvtps_epi32
#define vpow2(n) _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n, _mm512_set1_epi32(127)), 23))
#define vbelow_zero(x, lo, e) _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ), e, vzero())
#else
#define LANES 8
#define ROW_VECTORS 3 /* 4 keys x 3 vectors of rows: 12 accumulators, 3 query vectors and a key: the 16 registers */
typedef __m256 vec;
typedef __m256i ivec;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vfnma _mm256_fnmadd_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vsub _mm256_sub_ps
#define vmax _mm256_max_ps
#define vmin _mm256_min_ps
#define vround(x) _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define vtoint _mm256_cvtps_epi32
#define vpow2(n) _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n, _mm256_set1_epi32(127)), 23))
#define vbelow_zero(x, lo, e) _mm256_blendv_ps(e, vzero(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ))
#endif

#define KEYS 4        /* keys per step of the scores' micro-kernel */
#define VALUE_TILE 16 /* keys per tile of values summed, the next one prefetched: 16 beat 32 then (notebook/attention.md) */
#define VALUE_DIMS 4  /* value elements x ROW_VECTORS vectors of rows: 12 (AVX2) or 16 accumulators */
#define LINE 16       /* floats per cache line */

/* exp(x) for x <= 0 (a score minus its row's maximum), Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2,
 * exp(r) by a degree-6 polynomial, times 2^n; below -87 (past float32's normal range) exactly 0. */
static inline vec vexp(vec x) {
    const vec lowest = vset1(-87.0f);
    const vec clamped = vmax(x, lowest);
    const vec n = vround(vmul(clamped, vset1(1.44269504088896341f)));
    vec r = vfnma(n, vset1(0.693359375f), clamped);
    r = vfnma(n, vset1(-2.12194440e-4f), r);
    vec p = vset1(1.9875691500e-4f);
    p = vfma(p, r, vset1(1.3981999507e-3f));
    p = vfma(p, r, vset1(8.3334519073e-3f));
    p = vfma(p, r, vset1(4.1665795894e-2f));
    p = vfma(p, r, vset1(1.6666665459e-1f));
    p = vfma(p, r, vset1(5.0000001201e-1f));
    p = vfma(vmul(p, r), r, vadd(r, vset1(1.0f)));
    const vec e = vmul(p, vpow2(vtoint(n)));
    return vbelow_zero(x, lowest, e);
}

/* The keys KEYS_AHEAD on are asked into the caches while four are scored: with the hardware
 * prefetchers alone, 30 layers' attention over 1,825 cold slots took 0-7% longer at 8 queries and
 * 6-14% at one on a Zen 3 core (notebook/attention.md, "Keys fetched ahead"). Non-temporal, as a
 * step reads each key once per pass of rows; at 32 queries (four passes) it was no slower than an
 * ordinary prefetch or none. */
#define KEYS_AHEAD 32

static inline void fetch_keys(const float *keys, int64_t floats) {
    for (int64_t f = 0; f < floats; f += LINE)
        __builtin_prefetch(keys + f, 0, 0);
}

/* Key or value p of a call: row slots[p] of the cache where the call reads chosen slots (several
 * documents' trees in one forest: each document's queries read its own slots), else row p. */
#define SLOT(slots, p) ((slots) ? (slots)[p] : (p))

/* s[p][r0 .. r0 + V * LANES) = scale * sum_d k[SLOT(p)][d] qt[d][...] (+ mask_t[p][...]) for keys
 * [0, n); the rows' running maxima in mx. */
static inline __attribute__((always_inline)) void score_rows(int V, const float *qt, int64_t r_stride, int64_t d_size,
                                                             const float *k, int64_t n, const int64_t *slots,
                                                             const float *mask_t, float scale, float *s, float *mx) {
    const vec sc = vset1(scale);
    vec top[ROW_VECTORS];
#pragma GCC unroll 4
    for (int i = 0; i < V; i++)
        top[i] = vload(mx + i * LANES);
    int64_t p = 0;
    for (; p + KEYS <= n; p += KEYS) {
        vec acc[KEYS][ROW_VECTORS];
#pragma GCC unroll 4
        for (int j = 0; j < KEYS; j++)
#pragma GCC unroll 4
            for (int i = 0; i < V; i++)
                acc[j][i] = vzero();
        const float *kp[KEYS];
#pragma GCC unroll 4
        for (int j = 0; j < KEYS; j++)
            kp[j] = k + SLOT(slots, p + j) * d_size;
        if (!slots)
            fetch_keys(kp[0] + KEYS_AHEAD * d_size, KEYS * d_size); /* past the end: a hint, never a fault */
        else if (p + KEYS_AHEAD + KEYS <= n)
            for (int j = 0; j < KEYS; j++)
                fetch_keys(k + slots[p + KEYS_AHEAD + j] * d_size, d_size);
        for (int64_t d = 0; d < d_size; d++) {
            vec q[ROW_VECTORS];
#pragma GCC unroll 4
            for (int i = 0; i < V; i++)
                q[i] = vload(qt + d * r_stride + i * LANES);
#pragma GCC unroll 4
            for (int j = 0; j < KEYS; j++) {
                const vec key = vset1(kp[j][d]);
#pragma GCC unroll 4
                for (int i = 0; i < V; i++)
                    acc[j][i] = vfma(key, q[i], acc[j][i]);
            }
        }
#pragma GCC unroll 4
        for (int j = 0; j < KEYS; j++)
#pragma GCC unroll 4
            for (int i = 0; i < V; i++) {
                vec value = vmul(acc[j][i], sc);
                if (mask_t)
                    value = vadd(value, vload(mask_t + (p + j) * r_stride + i * LANES));
                vstore(s + (p + j) * r_stride + i * LANES, value);
                top[i] = vmax(top[i], value);
            }
    }
    for (; p < n; p++) {
        vec acc[ROW_VECTORS];
#pragma GCC unroll 4
        for (int i = 0; i < V; i++)
            acc[i] = vzero();
        for (int64_t d = 0; d < d_size; d++) {
            const vec key = vset1(k[SLOT(slots, p) * d_size + d]);
#pragma GCC unroll 4
            for (int i = 0; i < V; i++)
                acc[i] = vfma(key, vload(qt + d * r_stride + i * LANES), acc[i]);
        }
#pragma GCC unroll 4
        for (int i = 0; i < V; i++) {
            vec value = vmul(acc[i], sc);
            if (mask_t)
                value = vadd(value, vload(mask_t + p * r_stride + i * LANES));
            vstore(s + p * r_stride + i * LANES, value);
            top[i] = vmax(top[i], value);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < V; i++)
        vstore(mx + i * LANES, top[i]);
}

/* ot[d0 + j][r] += sum_p v[p][d0 + j] s[p][r] for j < VALUE_DIMS and V vectors of rows, keys [p0, p1):
 * the values summed as the scores were made, a key's element broadcast against a vector of rows. */
static inline __attribute__((always_inline)) void sum_values(int V, const float *s, int64_t R, const float *v,
                                                             int64_t D, int64_t p0, int64_t p1, const int64_t *slots,
                                                             float *ot) {
    vec acc[VALUE_DIMS][ROW_VECTORS];
#pragma GCC unroll 4
    for (int j = 0; j < VALUE_DIMS; j++)
#pragma GCC unroll 4
        for (int i = 0; i < V; i++)
            acc[j][i] = vload(ot + j * R + i * LANES);
    for (int64_t p = p0; p < p1; p++) {
        vec weights[ROW_VECTORS];
#pragma GCC unroll 4
        for (int i = 0; i < V; i++)
            weights[i] = vload(s + p * R + i * LANES);
#pragma GCC unroll 4
        for (int j = 0; j < VALUE_DIMS; j++) {
            const vec value = vset1(v[SLOT(slots, p) * D + j]);
#pragma GCC unroll 4
            for (int i = 0; i < V; i++)
                acc[j][i] = vfma(value, weights[i], acc[j][i]);
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < VALUE_DIMS; j++)
#pragma GCC unroll 4
        for (int i = 0; i < V; i++)
            vstore(ot + j * R + i * LANES, acc[j][i]);
}

/* Prefetches rows [p0, p1) of D floats into the first cache. */
static inline void fetch_rows(const float *rows, int64_t D, int64_t p0, int64_t p1) {
    for (const float *line = rows + p0 * D; line < rows + p1 * D; line += LINE)
        __builtin_prefetch(line, 0, 3);
}

/* One group: qt [D][R] (R a multiple of LANES), k and v [N][D], mask_t [N][R] additive or NULL ->
 * ot [D][R] (the weighted sums, the softmax's denominators not yet divided out) and sum [R] (those
 * denominators); work: N * R + R floats. */
static void group_attention(const float *qt, int64_t R, int64_t D, const float *k, const float *v, int64_t n,
                            const int64_t *slots, const float *mask_t, float scale, float *ot, float *sum,
                            float *work) {
    float *s = work, *mx = work + n * R;
    for (int64_t r = 0; r < R; r++)
        mx[r] = -__builtin_inff();
    for (int64_t r0 = 0; r0 < R; r0 += ROW_VECTORS * LANES) {
        const int64_t left = (R - r0) / LANES;
        const float *mask_r = mask_t ? mask_t + r0 : NULL;
        switch (left < ROW_VECTORS ? left : ROW_VECTORS) {
        case 1: score_rows(1, qt + r0, R, D, k, n, slots, mask_r, scale, s + r0, mx + r0); break;
        case 2: score_rows(2, qt + r0, R, D, k, n, slots, mask_r, scale, s + r0, mx + r0); break;
#if ROW_VECTORS >= 3
        case 3: score_rows(3, qt + r0, R, D, k, n, slots, mask_r, scale, s + r0, mx + r0); break;
#endif
#if ROW_VECTORS >= 4
        case 4: score_rows(4, qt + r0, R, D, k, n, slots, mask_r, scale, s + r0, mx + r0); break;
#endif
        }
    }
    /* the softmax's numerators, in place, and their sums: vectors across rows, down the keys */
    for (int64_t r0 = 0; r0 < R; r0 += LANES) {
        const vec top = vload(mx + r0);
        vec total = vzero();
        for (int64_t p = 0; p < n; p++) {
            const vec e = vexp(vsub(vload(s + p * R + r0), top));
            vstore(s + p * R + r0, e);
            total = vadd(total, e);
        }
        vstore(sum + r0, total);
    }
    /* ot[d][r] = sum_p v[p][d] s[p][r], a tile of keys at a time */
    memset(ot, 0, (size_t)(R * D) * sizeof(float));
    for (int64_t p0 = 0; p0 < n; p0 += VALUE_TILE) {
        const int64_t p1 = p0 + VALUE_TILE < n ? p0 + VALUE_TILE : n;
        if (!slots)
            fetch_rows(v, D, p1, p1 + VALUE_TILE < n ? p1 + VALUE_TILE : n); /* the next tile's values */
        for (int64_t r0 = 0; r0 < R; r0 += ROW_VECTORS * LANES) {
            const int64_t left = (R - r0) / LANES;
            for (int64_t d0 = 0; d0 < D; d0 += VALUE_DIMS) {
                float *o = ot + d0 * R + r0;
                switch (left < ROW_VECTORS ? left : ROW_VECTORS) {
                case 1: sum_values(1, s + r0, R, v + d0, D, p0, p1, slots, o); break;
                case 2: sum_values(2, s + r0, R, v + d0, D, p0, p1, slots, o); break;
#if ROW_VECTORS >= 3
                case 3: sum_values(3, s + r0, R, v + d0, D, p0, p1, slots, o); break;
#endif
#if ROW_VECTORS >= 4
                case 4: sum_values(4, s + r0, R, v + d0, D, p0, p1, slots, o); break;
#endif
                }
            }
        }
    }
}

#if defined(__AVX512F__)
/* ---- A few rows: the head's dimensions across the lanes ---------------------------------------
 * With one or two queries a group stacks 1-4 rows (H/G heads x M queries: 3 for SmolLM2's lone
 * branch), so the layout above fills 3 of a vector's 16 lanes and broadcasts every element of every
 * key. Here a key's D floats are loaded as D / 16 vectors and multiplied by each row's query held in
 * registers; the 16 keys' sums of a row are then added across lanes at once (sum_lanes), the softmax
 * runs along each row's scores, and the values are summed with D across the lanes, each value
 * vector read once for every row and each row's weight broadcast. The same scores, softmax and
 * weighted sums, summed in another order. The row count is made a constant for each of 1-4, so that
 * the rows' accumulators stay in registers: on a Zen 5 core a 1B model's lone-query attention over
 * 567 slots took 0.71x the time, the embedded model's over 1,825 0.80x, the numbers bit for bit the
 * same (each value's rows had been summed one row after another, on 4 chains). */
#define FEW_ROWS 4

/* out lane i = the sum of a[i]'s lanes: 16 vectors added across in a tree of in-register transposes. */
static inline vec sum_lanes(const vec a[LANES]) {
    vec x[8], y[4];
    for (int i = 0; i < 8; i++) /* per 128-bit block: [a0+a2, b0+b2, a1+a3, b1+b3] */
        x[i] = vadd(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per block: the block's sum of vectors 4i .. 4i + 3 */
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(x[2 * i]), _mm512_castps_pd(x[2 * i + 1]));
        y[i] = vadd(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    /* the four blocks of each y added: block j of the result is y[j]'s */
    const vec u01 = vadd(_mm512_shuffle_f32x4(y[0], y[1], 0x44), _mm512_shuffle_f32x4(y[0], y[1], 0xEE));
    const vec u23 = vadd(_mm512_shuffle_f32x4(y[2], y[3], 0x44), _mm512_shuffle_f32x4(y[2], y[3], 0xEE));
    return vadd(_mm512_shuffle_f32x4(u01, u23, 0x88), _mm512_shuffle_f32x4(u01, u23, 0xDD));
}

/* out[r] = inverse[r] * sum_p w[r][p] v[p] for R rows at once (w: row r's weights at w + r * padded),
 * 4 vectors of D at a time: each value vector read once for every row, R x 4 multiply-add chains. */
static inline __attribute__((always_inline)) void weighted_values(int R, int64_t C, int64_t D, const float *v, int64_t n,
                                                                  const int64_t *slots, const float *w, int64_t padded,
                                                                  const float *inverse, float *const *out) {
    for (int64_t c0 = 0; c0 < C; c0 += 4) {
        const int width = C - c0 < 4 ? (int)(C - c0) : 4;
        vec acc[FEW_ROWS][4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                acc[r][c] = vzero();
        if (width == 4)
            for (int64_t p = 0; p < n; p++) {
                const float *value = v + SLOT(slots, p) * D + c0 * LANES;
                vec part[4];
#pragma GCC unroll 4
                for (int c = 0; c < 4; c++)
                    part[c] = vload(value + c * LANES);
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const vec weight = vset1(w[r * padded + p]);
#pragma GCC unroll 4
                    for (int c = 0; c < 4; c++)
                        acc[r][c] = vfma(weight, part[c], acc[r][c]);
                }
            }
        else
            for (int64_t p = 0; p < n; p++)
                for (int r = 0; r < R; r++)
                    for (int c = 0; c < width; c++)
                        acc[r][c] = vfma(vset1(w[r * padded + p]), vload(v + SLOT(slots, p) * D + (c0 + c) * LANES), acc[r][c]);
#pragma GCC unroll 4
        for (int r = 0; r < R; r++)
#pragma GCC unroll 4
            for (int c = 0; c < 4; c++)
                if (c < width)
                    vstore(out[r] + (c0 + c) * LANES, vmul(acc[r][c], vset1(inverse[r])));
    }
}

/* One group's rows (R <= FEW_ROWS) of queries q[r] (D floats each, D a multiple of LANES) over keys
 * and values [n][D]; mask_t [n][mask_stride] additive (row r at column r) or NULL -> out[r] (D floats),
 * normalized, or where peaks is not NULL the weighted sums not yet divided by their softmax's sums,
 * which go to totals[r], each row's largest score to peaks[r] (a part of the keys: merged).
 * work: FEW_ROWS * (n rounded up to LANES) floats. */
static inline __attribute__((always_inline)) void few_rows_of(int R, const float *const *q, int64_t D, const float *k,
                                                              const float *v, int64_t n, const int64_t *slots,
                                                              const float *mask_t, int64_t mask_stride, float scale,
                                                              float *const *out, float *peaks, float *totals,
                                                              float *work) {
    const int64_t padded = (n + LANES - 1) / LANES * LANES, C = D / LANES;
    float *s = work; /* s[r * padded + p] */
    vec dots[FEW_ROWS][LANES];
    for (int64_t p0 = 0; p0 < padded; p0 += LANES) {
        for (int j = 0; j < LANES; j++) {
            const int64_t p = p0 + j;
            if (p >= n) {
                for (int r = 0; r < R; r++)
                    dots[r][j] = vzero();
                continue;
            }
            const float *key = k + SLOT(slots, p) * D;
            if (j == 0 && !slots)
                fetch_keys(key + KEYS_AHEAD * D, LANES * D); /* a hint past the end never faults */
            vec acc[FEW_ROWS];
            for (int r = 0; r < R; r++)
                acc[r] = vzero();
            for (int64_t c = 0; c < C; c++) {
                const vec kc = vload(key + c * LANES);
                for (int r = 0; r < R; r++)
                    acc[r] = vfma(kc, vload(q[r] + c * LANES), acc[r]);
            }
            for (int r = 0; r < R; r++)
                dots[r][j] = acc[r];
        }
        for (int r = 0; r < R; r++)
            vstore(s + r * padded + p0, vmul(sum_lanes(dots[r]), vset1(scale)));
    }
    float inverse[FEW_ROWS];
    for (int r = 0; r < R; r++) {
        float *row = s + r * padded;
        if (mask_t)
            for (int64_t p = 0; p < n; p++)
                row[p] += mask_t[p * mask_stride + r];
        for (int64_t p = n; p < padded; p++)
            row[p] = -__builtin_inff(); /* beyond the keys: weight 0 */
        vec top = vset1(-__builtin_inff());
        for (int64_t p = 0; p < padded; p += LANES)
            top = vmax(top, vload(row + p));
        const float largest = _mm512_reduce_max_ps(top);
        const vec peak = vset1(largest);
        vec total = vzero();
        for (int64_t p = 0; p < padded; p += LANES) {
            const vec e = vexp(vsub(vload(row + p), peak));
            vstore(row + p, e);
            total = vadd(total, e);
        }
        if (peaks) {
            peaks[r] = largest, totals[r] = _mm512_reduce_add_ps(total);
            inverse[r] = 1.0f;
        } else
            inverse[r] = 1.0f / _mm512_reduce_add_ps(total);
    }
    weighted_values(R, C, D, v, n, slots, s, padded, inverse, out);
}

/* few_rows_of with the rows a constant (1-4), so that their accumulators stay in registers. */
static void few_rows(int R, const float *const *q, int64_t D, const float *k, const float *v, int64_t n,
                     const int64_t *slots, const float *mask_t, int64_t mask_stride, float scale,
                     float *const *out, float *peaks, float *totals, float *work) {
    switch (R) {
    case 1: few_rows_of(1, q, D, k, v, n, slots, mask_t, mask_stride, scale, out, peaks, totals, work); break;
    case 2: few_rows_of(2, q, D, k, v, n, slots, mask_t, mask_stride, scale, out, peaks, totals, work); break;
    case 3: few_rows_of(3, q, D, k, v, n, slots, mask_t, mask_stride, scale, out, peaks, totals, work); break;
    default: few_rows_of(4, q, D, k, v, n, slots, mask_t, mask_stride, scale, out, peaks, totals, work); break;
    }
}
#endif

/* Rows a group's heads stack: H/G heads x M queries, padded to a whole number of vectors (the
 * mask's rows, mask_t [N][R]). */
int64_t attention_rows(int64_t per_group, int64_t M) { return (per_group * M + LANES - 1) / LANES * LANES; }

/* Floats of scratch `attention` needs for n slots, H/G = per_group heads a group, M queries, head size D. */
int64_t attention_scratch_floats(int64_t n, int64_t per_group, int64_t M, int64_t D) {
    const int64_t R = attention_rows(per_group, M);
    const int64_t few = 4 * (n + 16); /* the few-rows path's scores: FEW_ROWS rows of n rounded up */
    const int64_t rows = 2 * D * R + n * R + 2 * R; /* qt, ot, the scores, the exp sums, the maxima */
    return rows > few ? rows : few;
}

/* D must be a multiple of this. */
int64_t attention_dim_multiple(void) { return VALUE_DIMS; }

#include "pool.h"

/* Where the key/value groups are not a power of two, a group's keys are cut into parts of at least
 * PART_KEYS (at most MAX_PARTS), each part a run of its own, and the parts merged after: each
 * part's weighted sums rescaled by exp(its largest score - the row's largest), as flash-decoding
 * merges its splits. Attention runs on the pool's threads by runs, and SmolLM2's 3 groups on 2
 * threads left one thread idle a third of the time; 6 halves share out evenly. On a Zen 4 core a
 * step's attention over 1,825 cold slots took 0.77x the time at one query and 0.94x at eight on two
 * threads, 1.02-1.09x on one (the parts' keys and values streamed apart). The parts depend on the
 * call's shape alone, so its numbers are the same at any thread count (notebook/attention.md, "A
 * group's keys in parts"). */
#ifndef PART_KEYS
#define PART_KEYS 768
#endif
#define MAX_PARTS 8

static int64_t parts_of(int64_t n, int64_t G) {
    const int64_t parts = (G & (G - 1)) == 0 ? 1 : n / PART_KEYS; /* 1, 2, 4, 8 groups share out evenly */
    return parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
}

/* One attention call's arguments, split by key/value group (and part of the keys) over the threads (pool.h). */
struct call {
    const float *q;
    int64_t q_head, q_query, H, M, G, D;
    const float *k, *v;
    int64_t n, group_stride;
    const int64_t *slots;
    const float *mask_t;
    float scale;
    float *out;
    int64_t parts;
    float *partials; /* parts > 1: each (group, part)'s partial_floats */
};

#if defined(__AVX512F__)
#define FEW(per_group, M, D) ((per_group) * (M) <= FEW_ROWS && (D) % LANES == 0)
#else
#define FEW(per_group, M, D) 0
#endif

/* Floats of a (group, part)'s unmerged results: its weighted sums (D x R: [D][R] from the rows'
 * layout, [R][D] from the few rows'), then its softmax's sums and its largest scores (R each). */
static int64_t partial_floats(int64_t D, int64_t R) { return D * R + 2 * R; }

/* Group g's R query rows into qt [D][R] (row r = h * M + m: query m of the group's head h; the
 * padding rows zero). */
static void transposed_queries(const struct call *c, int64_t g, float *qt) {
    const int64_t M = c->M, D = c->D, per_group = c->H / c->G, R = attention_rows(per_group, M);
    memset(qt, 0, (size_t)(D * R) * sizeof(float));
    for (int64_t h = 0; h < per_group; h++)
        for (int64_t m = 0; m < M; m++) {
            const float *row = c->q + (g * per_group + h) * c->q_head + m * c->q_query;
            for (int64_t d = 0; d < D; d++)
                qt[d * R + h * M + m] = row[d];
        }
}

/* Group g's attention over keys [p0, p1), with this thread's scratch (attention_scratch_floats):
 * normalized into the call's output where partial is NULL, else unmerged into partial. */
static void group_keys(const struct call *c, int64_t g, int64_t p0, int64_t p1, float *partial, float *scratch) {
    const int64_t H = c->H, M = c->M, D = c->D, per_group = H / c->G, R = attention_rows(per_group, M), n = p1 - p0;
    const int64_t *slots = c->slots ? c->slots + p0 : NULL;
    const int64_t first = c->slots ? 0 : p0; /* the keys' first row, where no slots are given */
    const float *k = c->k + g * c->group_stride + first * D, *v = c->v + g * c->group_stride + first * D;
    const float *mask_t = c->mask_t ? c->mask_t + p0 * R : NULL;
#if defined(__AVX512F__)
    if (FEW(per_group, M, D)) {
        const float *rows_q[FEW_ROWS];
        float *rows_out[FEW_ROWS];
        for (int64_t h = 0; h < per_group; h++)
            for (int64_t m = 0; m < M; m++) { /* row r = h * M + m, as the mask's columns */
                rows_q[h * M + m] = c->q + (g * per_group + h) * c->q_head + m * c->q_query;
                rows_out[h * M + m] = partial ? partial + (h * M + m) * D : c->out + m * H * D + (g * per_group + h) * D;
            }
        few_rows((int)(per_group * M), rows_q, D, k, v, n, slots, mask_t, R, c->scale, rows_out,
                 partial ? partial + D * R + R : NULL, partial ? partial + D * R : NULL, scratch);
        return;
    }
#endif
    float *qt = scratch, *ot = qt + D * R, *sum = ot + D * R, *work = sum + R;
    transposed_queries(c, g, qt);
    group_attention(qt, R, D, k, v, n, slots, mask_t, c->scale, ot, sum, work);
    if (partial) { /* the sums, the softmax's sums, the rows' largest scores (left after the scores) */
        memcpy(partial, ot, (size_t)(D * R + R) * sizeof(float));
        memcpy(partial + D * R + R, work + n * R, (size_t)R * sizeof(float));
        return;
    }
    for (int64_t h = 0; h < per_group; h++)
        for (int64_t m = 0; m < M; m++) {
            const int64_t r = h * M + m;
            const float inverse = 1.0f / sum[r];
            float *o = c->out + m * H * D + (g * per_group + h) * D;
            for (int64_t d = 0; d < D; d++)
                o[d] = ot[d * R + r] * inverse;
        }
}

/* Run `index` of a call: group index / parts, its part index % parts of the keys. */
static void part_run(const void *job, int index, float *scratch) {
    const struct call *c = job;
    const int64_t g = index / c->parts, part = index % c->parts;
    const int64_t p0 = c->n * part / c->parts, p1 = c->n * (part + 1) / c->parts;
    float *partial = c->parts > 1 ? c->partials + index * partial_floats(c->D, attention_rows(c->H / c->G, c->M)) : NULL;
    group_keys(c, g, p0, p1, partial, scratch);
}

static inline float exp_one(float x) { /* vexp's, of one number (x <= 0) */
#if defined(__AVX512F__)
    return _mm512_cvtss_f32(vexp(vset1(x)));
#else
    return _mm256_cvtss_f32(vexp(vset1(x)));
#endif
}

/* The parts of every group merged into the call's output: row r's sums rescaled by exp(the part's
 * largest score - the row's), added, divided by the softmax's sums rescaled alike. */
static void merged(const struct call *c) {
    const int64_t H = c->H, M = c->M, D = c->D, per_group = H / c->G, R = attention_rows(per_group, M);
    const int64_t size = partial_floats(D, R), P = c->parts;
    const int few = FEW(per_group, M, D);
    for (int64_t g = 0; g < c->G; g++)
        for (int64_t r = 0; r < per_group * M; r++) {
            const float *part = c->partials + g * P * size;
            float top = -__builtin_inff(), weight[MAX_PARTS], total = 0.0f;
            for (int64_t i = 0; i < P; i++)
                top = part[i * size + D * R + R + r] > top ? part[i * size + D * R + R + r] : top;
            for (int64_t i = 0; i < P; i++) {
                const float peak = part[i * size + D * R + R + r];
                weight[i] = peak == -__builtin_inff() ? 0.0f : exp_one(peak - top); /* a part the row sees none of: 0 */
                total += weight[i] * part[i * size + D * R + r];
            }
            const float inverse = 1.0f / total;
            float *o = c->out + (r % M) * H * D + (g * per_group + r / M) * D;
            for (int64_t d = 0; d < D; d++) {
                float sum = 0.0f;
                for (int64_t i = 0; i < P; i++)
                    if (weight[i] != 0.0f)
                        sum += weight[i] * part[i * size + (few ? r * D + d : d * R + r)];
                o[d] = sum * inverse;
            }
        }
}

/* This thread's buffer of a call's unmerged parts, kept for the next call (the calling thread's:
 * every layer's call reuses it). */
static float *partials_of(int64_t floats) {
    static __thread float *held;
    static __thread int64_t capacity;
    if (capacity < floats) {
        float *grown = realloc(held, (size_t)floats * sizeof(float));
        if (!grown)
            return NULL;
        held = grown, capacity = floats;
    }
    return held;
}

/* Every group's attention, the groups on the pool's threads. q: query head h, query m at q + h *
 * q_head + m * q_query (D contiguous floats); the n keys and values of group g: rows SLOT(slots, p)
 * at k + g * group_stride + row * D (slots: n cache rows, ascending, or NULL for rows 0 .. n - 1);
 * mask_t [n][R] additive, R = the padded rows (H/G heads x M queries, row (h mod H/G) * M + m;
 * padding rows see everything), the same for every group, or NULL -> out [M][H * D]. scratch:
 * attention_scratch_floats. */
void attention(const float *q, int64_t q_head, int64_t q_query, int64_t H, int64_t M, int64_t G, int64_t D,
               const float *k, const float *v, int64_t n, int64_t group_stride, const float *mask_t, float scale,
               float *out, float *scratch, const int64_t *slots) {
    struct call c = {q, q_head, q_query, H, M, G, D, k, v, n, group_stride, slots, mask_t, scale, out, parts_of(n, G), NULL};
    if (c.parts > 1 && !(c.partials = partials_of(G * c.parts * partial_floats(D, attention_rows(H / G, M)))))
        c.parts = 1; /* no memory for the parts: whole groups */
    parallel((int)(G * c.parts), part_run, &c, attention_scratch_floats(n, H / G, M, D), scratch);
    if (c.parts > 1)
        merged(&c);
}
