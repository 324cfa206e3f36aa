/* One row of x times a K-quant matrix, two ways each, over one matrix that stays in the caches, one
 * thread, alternating in one process:
 *
 *   Q4_K lookup:  as span_row (mdcli/backends/native/gguf_blocks.c) does: per 16 weights a shift, a
 *                 vpermps of the codes' values 0-15 and a float32 multiply-add with x; each span's
 *                 sums times their sub-blocks' d * scale lane by lane;
 *   Q6_K convert: as the Q6_K passes do: 64 codes built as q6_codes builds them, per 16 weights a
 *                 shift, an and, vcvtdq2ps and a multiply-add; each quarter's sums times their
 *                 groups' d * scale, the codes' -32 once a super-block by x's sums over groups of 16;
 *   digits:       x held per block of 32 as a fixed-point number of 23 bits (2^(e - 22) its unit,
 *                 2^e above the block's largest |x|), in three signed 8-bit digits; per 64 weights
 *                 the codes (bytes) times each digit in one vpdpbusd (u8 x s8, four products a
 *                 lane), the three sums joined by two shifts, converted once and scaled by
 *                 d * scale * 2^(e - 22) lane by lane ("in pairs": two weight rows share x's loads).
 *
 * The passes take the sub-blocks' d * scale ready-made (the kernel decodes them a super-block
 * ahead): what differs is the inner loop. Each prints G weights/s and its largest error against the
 * float64 product of the float32 weights, in units of sum |w x| * 2^-24 (the products tests allow
 * (k + 1) of them: tests/test_gguf_blocks.py, rounding_bound).
 *
 *     cc -O2 -march=native benchmarks/kquant_digits.c -o /tmp/kquant_digits -lm && /tmp/kquant_digits
 *
 * AVX-512 with VNNI only. What it read on a Zen 4 core: notebook/gguf-blocks.md, "x in three 8-bit
 * digits"; the kernel's own pass (mdcli/backends/native/gguf_blocks.c, x_digits) and what it read
 * on a Zen 5 core: "x in three 8-bit digits, in the kernel". */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define K 2048    /* a row: 8 super-blocks of 256 */
#define OUT 1024  /* weight rows: 1024 x 2048 at 4.5 bits, 1.2 MB, in L2 + L3 */
#define SUPERS (K / 256)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* a row's super-block, as the pass reads it: the 8 sub-blocks' d * scale and -dmin * min, 128 bytes of nibbles */
struct super { float scale[8], minimum[8]; uint8_t qs[128]; };

static float x[K], xs[K / 32];        /* x, its sums over blocks of 32 */
static int8_t dg[3][K];               /* x's digits in span order (high, middle, low) */
static float pow2[K / 32];            /* per block of 32: 2^(e - 22) */
static struct super W[OUT][SUPERS];
static float xl[K];                   /* x for the lookup pass, in its lane order: [super][span][u][16] */

/* the weight index of byte b of span s, nibble h: qs[32 j + l] low = weight 64 j + l, high = 64 j + 32 + l */
static int weight_of(int s, int h, int b) { return 64 * (2 * s + b / 32) + 32 * h + b % 32; }
/* its block of 32 within the super-block */
static int block_of(int s, int h, int b) { return 2 * (2 * s + b / 32) + h; }

/* x[i] in its block's unit (|v| < 2^22, exact in float), as three balanced digits: high (|.| <= 64), middle, low */
static void digits_of(int i, int8_t *high, int8_t *middle, int8_t *low) {
    int32_t v = (int32_t)lrintf(x[i] / pow2[i / 32]);
    const int32_t d0 = ((v + 128) & 255) - 128;
    v = (v - d0) >> 8;
    const int32_t d1 = ((v + 128) & 255) - 128;
    *high = (int8_t)((v - d1) >> 8), *middle = (int8_t)d1, *low = (int8_t)d0;
}

static void prepare_x(void) {
    for (int blk = 0; blk < K / 32; blk++) {
        float big = 0.0f, sum = 0.0f;
        for (int i = 0; i < 32; i++)
            big = fmaxf(big, fabsf(x[32 * blk + i])), sum += x[32 * blk + i];
        xs[blk] = sum;
        int e;
        frexpf(big, &e); /* big < 2^e */
        pow2[blk] = ldexpf(1.0f, e - 22);
    }
    for (int B = 0; B < SUPERS; B++)
        for (int s = 0; s < 2; s++)
            for (int h = 0; h < 2; h++)
                for (int b = 0; b < 64; b++) {
                    const int at = B * 256 + 128 * s + 64 * h + b;
                    digits_of(B * 256 + weight_of(s, h, b), &dg[0][at], &dg[1][at], &dg[2][at]);
                }
}

/* a row's result: its two nibbles' lane sums and its minimums' 8 */
static inline float row_sum(__m512 low, __m512 high, __m256 minimums) {
    float m[8];
    _mm256_storeu_ps(m, minimums);
    return _mm512_reduce_add_ps(_mm512_add_ps(low, high)) + m[0] + m[1] + m[2] + m[3] + m[4] + m[5] + m[6] + m[7];
}

/* lanes 0-7 the sub-block 4 s + h, 8-15 4 s + 2 + h */
static inline __m512i sub_blocks(int s, int h) {
    return _mm512_add_epi32(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), _mm512_set1_epi32(4 * s + h));
}

static float lookup_row(const struct super *row) {
    const __m512 values = _mm512_cvtepi32_ps(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    __m512 total[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 minimums = _mm256_setzero_ps();
    for (int B = 0; B < SUPERS; B++) {
        const __m512 scales = _mm512_loadu_ps(row[B].scale);
        for (int s = 0; s < 2; s++) {
            const __m512i nib = _mm512_loadu_si512(row[B].qs + 64 * s);
            __m512 sum[2];
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) { /* u = 2 place + h: the lane's byte `place`, nibble h */
                const __m512i index = u ? _mm512_srli_epi32(nib, 4 * u) : nib;
                const __m512 w = _mm512_permutexvar_ps(index, values);
                /* x's vector for (place, h): lane i's byte 4 i + place of nibble h */
                const __m512 x_ = _mm512_loadu_ps(xl + B * 256 + 128 * s + 16 * u);
                sum[u % 2] = u < 2 ? _mm512_mul_ps(w, x_) : _mm512_fmadd_ps(w, x_, sum[u % 2]);
            }
            for (int h = 0; h < 2; h++)
                total[h] = _mm512_fmadd_ps(sum[h], _mm512_permutexvar_ps(sub_blocks(s, h), scales), total[h]);
        }
        minimums = _mm256_fmadd_ps(_mm256_loadu_ps(row[B].minimum), _mm256_loadu_ps(xs + 8 * B), minimums);
    }
    return row_sum(total[0], total[1], minimums);
}

static void prepare_lanes(void) {
    for (int B = 0; B < SUPERS; B++)
        for (int s = 0; s < 2; s++)
            for (int u = 0; u < 8; u++)
                for (int i = 0; i < 16; i++) { /* lane i, byte place of its 4, nibble h */
                    const int place = u / 2, h = u % 2, b = 4 * i + place;
                    xl[B * 256 + 128 * s + 16 * u + i] = x[B * 256 + weight_of(s, h, b)];
                }
}

static float lane_pow2[SUPERS][2][2][16]; /* per lane of (s, h): its block's 2^(e - 22) */

static float digits_row(const struct super *row) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 total[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m256 minimums = _mm256_setzero_ps();
    for (int B = 0; B < SUPERS; B++) {
        const __m512 scales = _mm512_loadu_ps(row[B].scale);
#pragma GCC unroll 2
        for (int s = 0; s < 2; s++) {
            const __m512i nib = _mm512_loadu_si512(row[B].qs + 64 * s);
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const __m512i codes = h ? _mm512_and_si512(_mm512_srli_epi16(nib, 4), low) : _mm512_and_si512(nib, low);
                const int at = B * 256 + 128 * s + 64 * h;
                __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(dg[0] + at));
                acc = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), codes, _mm512_loadu_si512(dg[1] + at));
                acc = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), codes, _mm512_loadu_si512(dg[2] + at));
                const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(sub_blocks(s, h), scales), _mm512_loadu_ps(lane_pow2[B][s][h]));
                total[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, total[h]);
            }
        }
        minimums = _mm256_fmadd_ps(_mm256_loadu_ps(row[B].minimum), _mm256_loadu_ps(xs + 8 * B), minimums);
    }
    return row_sum(total[0], total[1], minimums);
}

/* two weight rows a pass, as span_row's W = 2: each digit vector loaded once for both */
static void digits_pair(const struct super *a, const struct super *b2, float *y) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    const struct super *rows[2] = {a, b2};
    __m512 total[2][2] = {{_mm512_setzero_ps(), _mm512_setzero_ps()}, {_mm512_setzero_ps(), _mm512_setzero_ps()}};
    __m256 minimums[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int B = 0; B < SUPERS; B++) {
        const __m512 scales[2] = {_mm512_loadu_ps(a[B].scale), _mm512_loadu_ps(b2[B].scale)};
#pragma GCC unroll 2
        for (int s = 0; s < 2; s++) {
            const __m512i nib[2] = {_mm512_loadu_si512(a[B].qs + 64 * s), _mm512_loadu_si512(b2[B].qs + 64 * s)};
#pragma GCC unroll 2
            for (int h = 0; h < 2; h++) {
                const int at = B * 256 + 128 * s + 64 * h;
                const __m512i d0 = _mm512_loadu_si512(dg[0] + at), d1 = _mm512_loadu_si512(dg[1] + at), d2 = _mm512_loadu_si512(dg[2] + at);
                const __m512 p2 = _mm512_loadu_ps(lane_pow2[B][s][h]);
#pragma GCC unroll 2
                for (int o = 0; o < 2; o++) {
                    const __m512i codes = h ? _mm512_and_si512(_mm512_srli_epi16(nib[o], 4), low) : _mm512_and_si512(nib[o], low);
                    __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, d0);
                    acc = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), codes, d1);
                    acc = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), codes, d2);
                    const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(sub_blocks(s, h), scales[o]), p2);
                    total[o][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, total[o][h]);
                }
            }
        }
        for (int o = 0; o < 2; o++)
            minimums[o] = _mm256_fmadd_ps(_mm256_loadu_ps(rows[o][B].minimum), _mm256_loadu_ps(xs + 8 * B), minimums[o]);
    }
    for (int o = 0; o < 2; o++)
        y[o] = row_sum(total[o][0], total[o][1], minimums[o]);
}

static double reference(int o, double *magnitude) {
    double sum = 0.0, mag = 0.0;
    for (int B = 0; B < SUPERS; B++)
        for (int s = 0; s < 2; s++)
            for (int h = 0; h < 2; h++)
                for (int b = 0; b < 64; b++) {
                    const int sub = block_of(s, h, b), code = (W[o][B].qs[64 * s + b] >> (4 * h)) & 15;
                    /* the float32 weight, as the file's rebuild gives it */
                    const float w = W[o][B].scale[sub] * (float)code + W[o][B].minimum[sub];
                    const double t = (double)w * x[B * 256 + weight_of(s, h, b)];
                    sum += t, mag += fabs(t);
                }
    *magnitude = mag;
    return sum;
}

static float out[OUT];
typedef float (*row_fn)(const struct super *);
typedef void (*matrix_fn)(void); /* one pass over every weight row into out */

/* the fastest of `rounds` passes, seconds */
static double timed(matrix_fn pass, int rounds) {
    double best = 1e30;
    for (int r = 0; r < rounds; r++) {
        const double t0 = now();
        pass();
        best = fmin(best, now() - t0);
    }
    return best;
}

static void lookup_all(void) { for (int o = 0; o < OUT; o++) out[o] = lookup_row(W[o]); }
static void digits_all(void) { for (int o = 0; o < OUT; o++) out[o] = digits_row(W[o]); }
static void pairs_all(void) { for (int o = 0; o < OUT; o += 2) digits_pair(W[o], W[o + 1], out + o); }

static double worst_error(row_fn f) {
    double worst = 0.0;
    for (int o = 0; o < OUT; o++) {
        double mag;
        const double ref = reference(o, &mag), got = f(W[o]);
        worst = fmax(worst, fabs(got - ref) / (mag * ldexp(1.0, -24)));
    }
    return worst;
}

/* ---- Q6_K: 64 codes of a quarter (64 weights in order) built as q6_codes builds them ---- */
struct super6 { float scale[16]; uint8_t ql[128], qh[64]; }; /* d * scale of each group of 16; codes as the file's */
static struct super6 V[OUT][SUPERS];
static float xn_lanes[K];       /* x for the convert pass: per quarter, vector j lane i = input 4 i + j */
static int8_t dn[3][K];         /* x's digits in natural order */
static float xs16[K / 16];      /* x's sums over groups of 16 */
static float lane_pow2_n[K / 64][16];

static inline __m512i q6_quarter(const struct super6 *sb, int c) { /* byte b: the code of weight 64 c + b */
    const __m512i low = _mm512_loadu_si512(sb->ql + (c / 2) * 64);
    const __m512i high = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(sb->qh + (c / 2) * 32)));
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2);
    const __m512i nibbles = c % 2 ? _mm512_srli_epi32(low, 4) : low;
    const __m512i tops = c % 2 ? _mm512_srlv_epi32(high, half) : _mm512_sllv_epi32(high, _mm512_sub_epi32(_mm512_set1_epi32(4), half));
    return _mm512_ternarylogic_epi32(nibbles, tops, _mm512_set1_epi32(0x0f0f0f0f), 0xE4);
}

/* lane i of quarter c's vectors: the group of 16 of inputs 64 c + 4 i .. + 3, 4 c + i / 4 */
static inline __m512i quarter_groups(int c) {
    return _mm512_add_epi32(_mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), 2),
                            _mm512_set1_epi32(4 * c));
}

static float convert_row6(const struct super6 *row) {
    const __m512i six = _mm512_set1_epi32(0x3f);
    __m512 total = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
    for (int B = 0; B < SUPERS; B++) {
        const __m512 scales = _mm512_loadu_ps(row[B].scale);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i codes = q6_quarter(&row[B], c);
            __m512 sum = _mm512_setzero_ps();
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                const __m512 w = _mm512_cvtepi32_ps(_mm512_and_si512(j ? _mm512_srli_epi32(codes, 8 * j) : codes, six));
                sum = _mm512_fmadd_ps(w, _mm512_loadu_ps(xn_lanes + B * 256 + 64 * c + 16 * j), sum);
            }
            total = _mm512_fmadd_ps(sum, _mm512_permutexvar_ps(quarter_groups(c), scales), total);
        }
        offsets = _mm512_fmadd_ps(scales, _mm512_loadu_ps(xs16 + 16 * B), offsets); /* the codes' -32, once a super-block */
    }
    return _mm512_reduce_add_ps(total) - 32.0f * _mm512_reduce_add_ps(offsets);
}

static float digits_row6(const struct super6 *row) {
    const __m512i six = _mm512_set1_epi8(0x3f);
    __m512 total = _mm512_setzero_ps(), offsets = _mm512_setzero_ps();
    for (int B = 0; B < SUPERS; B++) {
        const __m512 scales = _mm512_loadu_ps(row[B].scale);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const __m512i codes = _mm512_and_si512(q6_quarter(&row[B], c), six);
            const int at = B * 256 + 64 * c;
            __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(dn[0] + at));
            acc = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), codes, _mm512_loadu_si512(dn[1] + at));
            acc = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), codes, _mm512_loadu_si512(dn[2] + at));
            const __m512 scale = _mm512_mul_ps(_mm512_permutexvar_ps(quarter_groups(c), scales), _mm512_loadu_ps(lane_pow2_n[at / 64]));
            total = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), scale, total);
        }
        offsets = _mm512_fmadd_ps(scales, _mm512_loadu_ps(xs16 + 16 * B), offsets);
    }
    return _mm512_reduce_add_ps(total) - 32.0f * _mm512_reduce_add_ps(offsets);
}

static int code6(const struct super6 *sb, int w) { /* the code of weight w of a super-block, as gguf-py reads it */
    const int n = w / 128, r = w % 128, l = r % 32, part = r / 32; /* part: q1 q2 q3 q4 */
    const uint8_t ql = sb->ql[64 * n + l + (part % 2) * 32], qh = sb->qh[32 * n + l];
    return ((part < 2 ? ql & 15 : ql >> 4) | (((qh >> (2 * part)) & 3) << 4));
}

static void prepare_x6(void) {
    for (int i = 0; i < K; i++) {
        const int q = i / 64, b = i % 64;            /* natural: quarter q, byte b */
        xn_lanes[64 * q + 16 * (b % 4) + b / 4] = x[i]; /* vector b % 4, lane b / 4 */
        digits_of(i, &dn[0][i], &dn[1][i], &dn[2][i]);
    }
    for (int g = 0; g < K / 16; g++) {
        float sum = 0.0f;
        for (int i = 0; i < 16; i++)
            sum += x[16 * g + i];
        xs16[g] = sum;
    }
    for (int q = 0; q < K / 64; q++)
        for (int i = 0; i < 16; i++)
            lane_pow2_n[q][i] = pow2[(64 * q + 4 * i) / 32];
}

typedef float (*row6_fn)(const struct super6 *);

static double worst_error6(row6_fn f) {
    double worst = 0.0;
    for (int o = 0; o < OUT; o++) {
        double sum = 0.0, mag = 0.0;
        for (int B = 0; B < SUPERS; B++)
            for (int w = 0; w < 256; w++) {
                const float weight = V[o][B].scale[w / 16] * (float)(code6(&V[o][B], w) - 32);
                const double t = (double)weight * x[B * 256 + w];
                sum += t, mag += fabs(t);
            }
        worst = fmax(worst, fabs(f(V[o]) - sum) / (mag * ldexp(1.0, -24)));
    }
    return worst;
}

static void convert6_all(void) { for (int o = 0; o < OUT; o++) out[o] = convert_row6(V[o]); }
static void digits6_all(void) { for (int o = 0; o < OUT; o++) out[o] = digits_row6(V[o]); }

int main(void) {
    srand(7);
    for (int i = 0; i < K; i++) { /* activations with a few large features, as a model's have */
        const float g = ((float)rand() / RAND_MAX - 0.5f) * 2.0f;
        x[i] = (i % 97 == 0) ? 40.0f * g : g;
    }
    for (int o = 0; o < OUT; o++)
        for (int B = 0; B < SUPERS; B++) {
            const float d = 0.001f + 0.0001f * (float)(rand() % 10), dmin = 0.002f;
            for (int j = 0; j < 8; j++)
                W[o][B].scale[j] = d * (float)(rand() % 64), W[o][B].minimum[j] = -dmin * (float)(rand() % 64);
            for (int b = 0; b < 128; b++)
                W[o][B].qs[b] = (uint8_t)rand();
        }
    prepare_x();
    prepare_lanes();
    for (int B = 0; B < SUPERS; B++)
        for (int s = 0; s < 2; s++)
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 16; i++) /* lane i's 4 bytes 4i..4i+3 share a block */
                    lane_pow2[B][s][h][i] = pow2[B * 8 + block_of(s, h, 4 * i)];
    printf("lookup: largest error %.2f x sum|wx| 2^-24\n", worst_error(lookup_row));
    printf("digits: largest error %.2f x sum|wx| 2^-24\n", worst_error(digits_row));
    {
        double worst = 0.0;
        for (int o = 0; o < OUT; o += 2) {
            float y[2];
            digits_pair(W[o], W[o + 1], y);
            for (int i = 0; i < 2; i++) {
                double mag;
                const double ref = reference(o + i, &mag);
                worst = fmax(worst, fabs(y[i] - ref) / (mag * ldexp(1.0, -24)));
            }
        }
        printf("digits in pairs: largest error %.2f x sum|wx| 2^-24\n", worst);
    }
    for (int o = 0; o < OUT; o++)
        for (int B = 0; B < SUPERS; B++) {
            const float d = 0.0005f + 0.0001f * (float)(rand() % 10);
            for (int g = 0; g < 16; g++)
                V[o][B].scale[g] = d * (float)(rand() % 256 - 128);
            for (int b = 0; b < 128; b++)
                V[o][B].ql[b] = (uint8_t)rand();
            for (int b = 0; b < 64; b++)
                V[o][B].qh[b] = (uint8_t)rand();
        }
    prepare_x6();
    printf("Q6_K convert: largest error %.2f x sum|wx| 2^-24\n", worst_error6(convert_row6));
    printf("Q6_K digits: largest error %.2f x sum|wx| 2^-24\n", worst_error6(digits_row6));
    const double weights = (double)OUT * K;
    for (int round = 0; round < 4; round++) { /* alternating */
        const double a = timed(lookup_all, 50), b = timed(digits_all, 50), c = timed(pairs_all, 50);
        printf("round %d: lookup %.1f, digits %.1f, digits in pairs %.1f G weights/s; time against lookup: digits %.2fx, in pairs %.2fx\n",
               round, weights / a * 1e-9, weights / b * 1e-9, weights / c * 1e-9, b / a, c / a);
    }
    for (int round = 0; round < 4; round++) {
        const double a = timed(convert6_all, 50), b = timed(digits6_all, 50);
        printf("Q6_K round %d: convert %.1f, digits %.1f G weights/s; digits' time against convert %.2fx\n", round,
               weights / a * 1e-9, weights / b * 1e-9, b / a);
    }
    return 0;
}
