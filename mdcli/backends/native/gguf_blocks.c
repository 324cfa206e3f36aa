/* y = x @ W^T where W is stored as a GGUF file stores it: blocks of 32 weights, Q4_1, Q8_0 or Q4_0,
 * or F16 / BF16 read 32 at a time.
 *
 * The weights a GGUF-loaded model holds in float32 are these blocks dequantized (gguf-py's
 * `dequantize`, which transformers runs): Q4_1 w = d * q + m (q a 4-bit code, d and m float16),
 * Q8_0 w = d * q (q an int8 code), in float32. d * q is exact in float32 (an 11-bit significand
 * times at most 8 bits), so gguf-py's multiply-then-add and one fused multiply-add round the sum
 * once, the same way: the kernel multiplies by the model's own float32 weights bit for bit while
 * reading 5 bits a weight (Q4_1) or 8.5 (Q8_0) instead of 32. `*_dequantize` writes those weights out with the same code:
 * mdcli.backends.weights.gguf_blocks compares them with the model's before it uses a block copy.
 *
 * Each output of a row of x sums its inputs in float32 on multiply-add chains (two per output
 * row in the passes of up to ROWS rows, one in the shared rebuilds and the wider panels), one vector lane per input
 * position modulo the vector width, then across the lanes: another summation order than other
 * BLAS kernels, so results agree with them to float32 rounding, not bit for bit.
 *
 * Built twice from this file (mdcli.backends.weights.gguf_blocks): with AVX-512 (16 lanes) and with AVX2 (8).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 32
#define Q4_1_BYTES 20 /* float16 d, float16 m, 16 bytes of codes: low nibbles are weights 0-15, high 16-31 */
#define Q8_0_BYTES 34 /* float16 d, 32 int8 codes */
#define Q4_0_BYTES 18 /* float16 d, 16 bytes of codes as Q4_1's, each minus 8 */
#define HALF_BYTES 64 /* F16 and BF16: 32 weights of two bytes, read as a block of 32 */

#if defined(__AVX512F__)
#define LANES 16
#define ROWS 8 /* rows of x per pass over a weight row: 2 x ROWS accumulators of the 32 registers */
typedef __m512 vec;
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
#define vmul _mm512_mul_ps
#define vadd _mm512_add_ps
#define vfloat _mm512_cvtepi32_ps
static inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }

static inline void q4_codes(const uint8_t *codes, vec w[2]) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes)); /* [16] */
    w[0] = vfloat(_mm512_and_si512(bytes, _mm512_set1_epi32(15)));
    w[1] = vfloat(_mm512_srli_epi32(bytes, 4));
}

static inline void q8_codes(const int8_t *codes, vec w[2]) {
    w[0] = vfloat(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)codes)));
    w[1] = vfloat(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16))));
}

static inline void halves(const uint8_t *p, vec w[2]) {
    w[0] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    w[1] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 32)));
}

static inline void brains(const uint8_t *p, vec w[2]) { /* bf16: the high half of a float32 */
    for (int j = 0; j < 2; j++)
        w[j] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(p + 32 * j))), 16));
}
#else
#define LANES 8
#define ROWS 4 /* 2 x ROWS accumulators, 4 weight vectors and 2 constants of the 16 registers */
typedef __m256 vec;
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
#define vmul _mm256_mul_ps
#define vadd _mm256_add_ps
#define vfloat _mm256_cvtepi32_ps
static inline float vsum(vec v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

static inline void q4_codes(const uint8_t *codes, vec w[4]) {
    const __m256i low = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)codes));     /* bytes 0-7 */
    const __m256i high = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8))); /* bytes 8-15 */
    const __m256i nibble = _mm256_set1_epi32(15);
    w[0] = vfloat(_mm256_and_si256(low, nibble));
    w[1] = vfloat(_mm256_and_si256(high, nibble));
    w[2] = vfloat(_mm256_srli_epi32(low, 4));
    w[3] = vfloat(_mm256_srli_epi32(high, 4));
}

static inline void q8_codes(const int8_t *codes, vec w[4]) {
    for (int j = 0; j < 4; j++)
        w[j] = vfloat(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 8 * j))));
}

static inline void halves(const uint8_t *p, vec w[4]) {
    for (int j = 0; j < 4; j++)
        w[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * j)));
}

static inline void brains(const uint8_t *p, vec w[4]) { /* bf16: the high half of a float32 */
    for (int j = 0; j < 4; j++)
        w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(p + 16 * j))), 16));
}
#endif

#define PER (BLOCK / LANES) /* vectors per block */

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* One block's 32 weights, in input order, as PER vectors. kind: 0 = Q4_1, 1 = Q8_0, 2 = Q4_0,
 * 3 = F16, 4 = BF16 (gguf-py: Q4_0 w = d * (q - 8); F16 and BF16 widened to float32, exactly). */
static inline __attribute__((always_inline)) void weights_of(int kind, const uint8_t *block, vec w[PER]) {
    if (kind == 3) {
        halves(block, w);
        return;
    }
    if (kind == 4) {
        brains(block, w);
        return;
    }
    const vec d = vset1(half_at(block));
    if (kind == 2) {
        q4_codes(block + 2, w);
        for (int j = 0; j < PER; j++)
            w[j] = vmul(d, vadd(w[j], vset1(-8.0f))); /* q - 8 exact, d * (q - 8) exact */
    } else if (kind == 0) {
        const vec m = vset1(half_at(block + 2));
        q4_codes(block + 4, w);
        for (int j = 0; j < PER; j++)
            w[j] = vfma(d, w[j], m); /* d * q exact, so rounded once as gguf-py's (d * q) + m */
    } else {
        q8_codes((const int8_t *)(block + 2), w);
        for (int j = 0; j < PER; j++)
            w[j] = vmul(d, w[j]);
    }
}

/* Bytes per block of 32 weights of each kind. */
static inline int64_t bytes_of(int kind) {
    return kind == 0 ? Q4_1_BYTES : kind == 1 ? Q8_0_BYTES : kind == 2 ? Q4_0_BYTES : HALF_BYTES;
}

/* One block's 32 weights written out as float32, by the code the products use. */
static inline __attribute__((always_inline)) void block_out(int kind, const uint8_t *block, float *out) {
    vec v[PER];
    weights_of(kind, block, v);
    for (int j = 0; j < PER; j++)
        vstore(out + j * LANES, v[j]);
}

/* While one weight row is multiplied, the row AHEAD_ROWS on (the next panel, in the panels) is asked
 * into the caches: with the hardware prefetchers alone the step's products took 9-14% longer at 6-8
 * rows on a Zen 3 core, 1-15% at 1-4 rows, the same at 16 (weights are read once a step, so the hint
 * is non-temporal; notebook/gguf-blocks.md, "Weight rows fetched ahead"). A hint: it never faults
 * and never waits. Other distances build with -DAHEAD_ROWS=N (and span widths with -DSPAN=N, below),
 * for a benchmark to compare them on another host kind (benchmarks/native_kernels.py --define). */
#ifndef AHEAD_ROWS
#define AHEAD_ROWS 6
#endif
#define LINE_BYTES 64

static inline void fetch(const uint8_t *p, int64_t bytes) {
    for (int64_t f = 0; f < bytes; f += LINE_BYTES)
        __builtin_prefetch(p + f, 0, 0);
}

/* Rows [0, R) of x (row stride ldx) times blocks [0, blocks) of one weight row -> y[r * ldy], added
 * to it if `add`: each block turned into weights in registers once for the R rows, `chains`
 * multiply-add chains per row (2 in the passes of up to ROWS rows, 1 in the shared rebuilds). */
static inline __attribute__((always_inline)) void pass(int kind, int R, int chains, const float *x, int64_t ldx,
                                                       const uint8_t *row, int64_t blocks, float *y, int64_t ldy,
                                                       int add) {
    const int64_t size = bytes_of(kind);
    vec acc[8][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        acc[r][0] = acc[r][1] = vzero();
    for (int64_t b = 0; b < blocks; b++) {
        vec w[PER];
        weights_of(kind, row + b * size, w);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const float *in = x + r * ldx + b * BLOCK;
#pragma GCC unroll 4
            for (int j = 0; j < PER; j++)
                acc[r][j % chains] = vfma(vload(in + j * LANES), w[j], acc[r][j % chains]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++) {
        const float total = vsum(chains == 2 ? vadd(acc[r][0], acc[r][1]) : acc[r][0]);
        y[r * ldy] = add ? y[r * ldy] + total : total;
    }
}

#if ROWS == 8
#define PASSES(kind) \
    case 1: pass(kind, 1, 2, xr, k, row, blocks, yr, n, 0); break; \
    case 2: pass(kind, 2, 2, xr, k, row, blocks, yr, n, 0); break; \
    case 3: pass(kind, 3, 2, xr, k, row, blocks, yr, n, 0); break; \
    case 4: pass(kind, 4, 2, xr, k, row, blocks, yr, n, 0); break; \
    case 5: pass(kind, 5, 2, xr, k, row, blocks, yr, n, 0); break; \
    case 6: pass(kind, 6, 2, xr, k, row, blocks, yr, n, 0); break; \
    case 7: pass(kind, 7, 2, xr, k, row, blocks, yr, n, 0); break; \
    default: pass(kind, 8, 2, xr, k, row, blocks, yr, n, 0); break;
#else
#define PASSES(kind) \
    case 1: pass(kind, 1, 2, xr, k, row, blocks, yr, n, 0); break; \
    case 2: pass(kind, 2, 2, xr, k, row, blocks, yr, n, 0); break; \
    case 3: pass(kind, 3, 2, xr, k, row, blocks, yr, n, 0); break; \
    default: pass(kind, 4, 2, xr, k, row, blocks, yr, n, 0); break;
#endif


/* Past ROWS rows and up to ONE_REBUILD_ROWS (AVX2 only: its passes take 4 rows), each block is
 * turned into weights in registers once for every row, with one accumulator per row (8 rows: 8
 * multiply-add chains, both FMA pipes busy), and x is read SPAN blocks at a time so those inputs of
 * every row stay in the core's first cache (8 x 768 floats, 24 KB) while the weight rows stream by.
 * On a Zen 3 core at 5-8 rows this beat the panels below, which write each block out and read it
 * back (6 and 8 rows: 0.90x; notebook/gguf-blocks.md, "In-register rebuilds for 5-8 rows"). Each output
 * sums its inputs lane by lane in order within a span, the spans added in order. */
#define ONE_REBUILD_ROWS 8
#ifndef SPAN
#define SPAN 24
#endif

#define SHARED_PASSES(kind) \
    case 5: pass(kind, 5, 1, xr, k, row, b1 - b0, yr, n, b0 > 0); break; \
    case 6: pass(kind, 6, 1, xr, k, row, b1 - b0, yr, n, b0 > 0); break; \
    case 7: pass(kind, 7, 1, xr, k, row, b1 - b0, yr, n, b0 > 0); break; \
    default: pass(kind, 8, 1, xr, k, row, b1 - b0, yr, n, b0 > 0); break;

/* y = x @ W^T for ROWS < m <= ONE_REBUILD_ROWS, a span of inputs at a time. */
#define SHARED_PRODUCT(kind)                                                                       \
    for (int64_t b0 = 0; b0 < blocks; b0 += SPAN) {                                                \
        const int64_t b1 = b0 + SPAN < blocks ? b0 + SPAN : blocks;                                \
        const float *xr = x + b0 * BLOCK;                                                          \
        for (int64_t j = 0; j < n; j++) {                                                          \
            const uint8_t *row = w + j * row_bytes + b0 * bytes_of(kind);                          \
            if (j + AHEAD_ROWS < n)                                                                \
                fetch(row + AHEAD_ROWS * row_bytes, (b1 - b0) * bytes_of(kind));                   \
            float *yr = y + j;                                                                     \
            switch (m) { SHARED_PASSES(kind) }                                                     \
        }                                                                                          \
    }

/* Wider products: PANEL weight rows at a time are written out as float32 into the caller's scratch
 * (PANEL x k floats) by the code the passes use, then every row of x is multiplied by them, up to
 * WIDE_ROWS rows of x at a time, with one accumulator per (row, weight row): each block is turned
 * back into weights once for all rows of x, not once per pass of ROWS rows, and the micro-kernel's
 * PANEL x WIDE_ROWS independent multiply-add chains keep both FMA pipes busy. Each output is summed
 * lane by lane over the inputs in order, then across the lanes. */
#define PANEL 3
#if defined(__AVX512F__)
#define WIDE_ROWS 8 /* 24 accumulators, 3 weight vectors and an input of the 32 registers */
#else
#define WIDE_ROWS 4 /* 12 accumulators, 3 weight vectors and an input: the 16 registers */
#endif

/* Rows [0, R) of x (row stride ldx) times O weight rows written out in `panel` (O rows of k) -> y. */
static inline __attribute__((always_inline)) void panel_pass(int R, int O, const float *x, int64_t ldx,
                                                             const float *panel, int64_t k, float *y, int64_t ldy) {
    vec acc[WIDE_ROWS][PANEL];
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int o = 0; o < O; o++)
            acc[r][o] = vzero();
    for (int64_t c = 0; c < k; c += LANES) {
        vec w[PANEL];
#pragma GCC unroll 3
        for (int o = 0; o < O; o++)
            w[o] = vload(panel + o * k + c);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            const vec in = vload(x + r * ldx + c);
#pragma GCC unroll 3
            for (int o = 0; o < O; o++)
                acc[r][o] = vfma(in, w[o], acc[r][o]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 3
        for (int o = 0; o < O; o++)
            y[r * ldy + o] = vsum(acc[r][o]);
}

#if WIDE_ROWS == 8
#define PANEL_PASSES(O) \
    case 1: panel_pass(1, O, xr, k, panel, k, yr, n); break; \
    case 2: panel_pass(2, O, xr, k, panel, k, yr, n); break; \
    case 3: panel_pass(3, O, xr, k, panel, k, yr, n); break; \
    case 4: panel_pass(4, O, xr, k, panel, k, yr, n); break; \
    case 5: panel_pass(5, O, xr, k, panel, k, yr, n); break; \
    case 6: panel_pass(6, O, xr, k, panel, k, yr, n); break; \
    case 7: panel_pass(7, O, xr, k, panel, k, yr, n); break; \
    default: panel_pass(8, O, xr, k, panel, k, yr, n); break;
#else
#define PANEL_PASSES(O) \
    case 1: panel_pass(1, O, xr, k, panel, k, yr, n); break; \
    case 2: panel_pass(2, O, xr, k, panel, k, yr, n); break; \
    case 3: panel_pass(3, O, xr, k, panel, k, yr, n); break; \
    default: panel_pass(4, O, xr, k, panel, k, yr, n); break;
#endif

/* Every row of x [m, k] times O weight rows written out in `panel` -> y[:, 0:O] (row stride n). */
static inline __attribute__((always_inline)) void panel_rows_of(int O, const float *x, int64_t m, int64_t k,
                                                                const float *panel, float *y, int64_t n) {
    for (int64_t r0 = 0; r0 < m; r0 += WIDE_ROWS) {
        const float *xr = x + r0 * k;
        float *yr = y + r0 * n;
        switch (m - r0) { PANEL_PASSES(O) }
    }
}

/* Floats of scratch a product of inner size k needs (the caller's, one per thread). */
int64_t scratch_floats(int64_t k) { return PANEL * k; }

/* y[m][n] = sum_c x[m][c] * W[n][c]; x: [m, k] and y: [m, n] contiguous float32, W: n rows of k / 32
 * blocks; scratch: scratch_floats(k) floats. Up to ROWS rows: each weight row is read from memory
 * once and turned into weights in registers per pass (passes after the first over more rows of x
 * find it in the core's caches). Up to ONE_REBUILD_ROWS rows (AVX2): one rebuild in registers for
 * every row. More rows: PANEL weight rows at a time written out once into the scratch, then
 * multiplied by every row of x. */
#define PRODUCT(name, kind)                                                                        \
    void name(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y,        \
              float *scratch) {                                                                    \
        const int64_t blocks = k / BLOCK, row_bytes = blocks * bytes_of(kind);                    \
        if (ROWS < ONE_REBUILD_ROWS && m > ROWS && m <= ONE_REBUILD_ROWS) {                       \
            SHARED_PRODUCT(kind)                                                                   \
            return;                                                                                \
        }                                                                                          \
        if (m > ROWS) {                                                                            \
            int64_t j = 0;                                                                         \
            for (; j + PANEL <= n; j += PANEL) {                                                   \
                if (j + 2 * PANEL <= n)                                                            \
                    fetch(w + (j + PANEL) * row_bytes, PANEL * row_bytes);                         \
                for (int64_t b = 0; b < PANEL * blocks; b++)                                       \
                    block_out(kind, w + j * row_bytes + b * bytes_of(kind), scratch + b * BLOCK);  \
                panel_rows_of(PANEL, x, m, k, scratch, y + j, n);                                  \
            }                                                                                      \
            for (; j < n; j++) {                                                                   \
                for (int64_t b = 0; b < blocks; b++)                                               \
                    block_out(kind, w + j * row_bytes + b * bytes_of(kind), scratch + b * BLOCK);  \
                panel_rows_of(1, x, m, k, scratch, y + j, n);                                      \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        for (int64_t j = 0; j < n; j++) {                                                          \
            const uint8_t *row = w + j * row_bytes;                                                \
            if (j + AHEAD_ROWS < n)                                                                \
                fetch(row + AHEAD_ROWS * row_bytes, row_bytes);                                    \
            const float *xr = x;                                                                   \
            float *yr = y + j;                                                                     \
            switch (m) { PASSES(kind) }                                                            \
        }                                                                                          \
    }

/* out[n][k] = the weights, float32, computed as the products above compute them. */
#define DEQUANTIZE(name, kind)                                                                     \
    void name(const uint8_t *w, int64_t n, int64_t k, float *out) {                               \
        for (int64_t b = 0; b < n * (k / BLOCK); b++)                                              \
            block_out(kind, w + b * bytes_of(kind), out + b * BLOCK);                              \
    }

/* 1 if the weights are `expected` ([n][k] float32) bit for bit, else 0: the check before a copy is
 * used, without writing the weights out. */
#define MATCHES(name, kind)                                                                        \
    int name(const uint8_t *w, int64_t n, int64_t k, const float *expected) {                     \
        float out[BLOCK];                                                                          \
        for (int64_t b = 0; b < n * (k / BLOCK); b++) {                                            \
            block_out(kind, w + b * bytes_of(kind), out);                                          \
            if (memcmp(out, expected + b * BLOCK, sizeof out) != 0)                                \
                return 0;                                                                          \
        }                                                                                          \
        return 1;                                                                                  \
    }

/* Each kind's three entry points: <kind>_gemm, <kind>_dequantize, <kind>_matches. */
#define KIND(prefix, kind) PRODUCT(prefix##_gemm, kind) DEQUANTIZE(prefix##_dequantize, kind) MATCHES(prefix##_matches, kind)

KIND(q4_1, 0)
KIND(q8_0, 1)
KIND(q4_0, 2)
KIND(f16, 3)
KIND(bf16, 4)
