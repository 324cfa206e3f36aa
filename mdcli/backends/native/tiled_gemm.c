/* y = x @ W^T for a few rows of x, reading W once: mdcli's small-row matrix product on AVX2 + FMA.
 *
 * W ([n, k], row-major, as torch stores a linear layer's weight) is copied once into tiles of
 * TILE output columns: tiled[j][c][t] = W[j * TILE + t][c], zero past n. A tile is one contiguous
 * run of k * TILE floats, so the product streams the whole weight once, front to back, and each
 * weight vector loaded serves every row of x (up to ROWS at a time, the rest re-read the tile from
 * the core's caches). torch's and numpy's kernels read the weight once per row or pack it again on
 * every call when x has 2-16 rows. mdcli.backends.weights.tiled builds it, holds the tiled copies
 * and says which forwards use it (measured: notebook/cpu-kernels.md, "Small products on Zen 3:
 * mdcli's own kernel").
 *
 * Each output sums blocks of BLOCK inputs, each block a fused multiply-add chain in input order (for
 * a lone row two chains, even and odd inputs): a different summation order from other BLAS kernels,
 * so results agree with them to float32 rounding, not bit for bit.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define TILE 16 /* output columns per tile: two 8-float registers */
#define ROWS 4  /* rows of x per pass: 2 x ROWS accumulators + 2 weight registers + 1 broadcast fit the 16 */
/* (the accumulators are named variables, not an array: gcc keeps an array's in memory for some row
 * counts, which makes the loop far slower; measured: notebook/cpu-kernels.md, "Small products on
 * Zen 3: mdcli's own kernel") */
#define BLOCK 128 /* inputs summed per chain before it is added to the output: shorter chains round less */

/* out = v, or out += v when add (a later block of inputs). */
static inline void put(float *out, __m256 v, int add) {
    _mm256_storeu_ps(out, add ? _mm256_add_ps(_mm256_loadu_ps(out), v) : v);
}

/* One row times one tile -> out[TILE]: the inputs alternate between two pairs of accumulators, so
 * four multiply-add chains run at once instead of two and the loads run further ahead: a lone row
 * then runs about as fast as OpenBLAS's sgemv (measured: notebook/cpu-kernels.md, "Small products
 * on Zen 3: mdcli's own kernel"). */
static void tile_row(const float *x, int64_t k, const float *tile, float *out, int add) {
    __m256 even0 = _mm256_setzero_ps(), even1 = even0, odd0 = even0, odd1 = even0;
    int64_t c = 0;
    for (; c + 2 <= k; c += 2) {
        const __m256 b0 = _mm256_broadcast_ss(x + c), b1 = _mm256_broadcast_ss(x + c + 1);
        even0 = _mm256_fmadd_ps(b0, _mm256_loadu_ps(tile + c * TILE), even0);
        even1 = _mm256_fmadd_ps(b0, _mm256_loadu_ps(tile + c * TILE + 8), even1);
        odd0 = _mm256_fmadd_ps(b1, _mm256_loadu_ps(tile + c * TILE + 16), odd0);
        odd1 = _mm256_fmadd_ps(b1, _mm256_loadu_ps(tile + c * TILE + 24), odd1);
    }
    if (c < k) {
        const __m256 b0 = _mm256_broadcast_ss(x + c);
        even0 = _mm256_fmadd_ps(b0, _mm256_loadu_ps(tile + c * TILE), even0);
        even1 = _mm256_fmadd_ps(b0, _mm256_loadu_ps(tile + c * TILE + 8), even1);
    }
    put(out, _mm256_add_ps(even0, odd0), add);
    put(out + 8, _mm256_add_ps(even1, odd1), add);
}

/* One pass: rows [0, r) of x (r <= ROWS, row stride ldx) times one tile -> out[r][TILE] (row stride ldo). */
static void tile_pass(const float *x, int64_t ldx, int r, int64_t k, const float *tile, float *out, int64_t ldo,
                      int add) {
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a10 = a00, a11 = a00, a20 = a00, a21 = a00, a30 = a00, a31 = a00;
    const float *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
#define ROW(i) { const __m256 b = _mm256_broadcast_ss(x##i + c); \
                 a##i##0 = _mm256_fmadd_ps(b, w0, a##i##0); a##i##1 = _mm256_fmadd_ps(b, w1, a##i##1); }
#define LOOP(body) for (int64_t c = 0; c < k; c++) { \
        const __m256 w0 = _mm256_loadu_ps(tile + c * TILE), w1 = _mm256_loadu_ps(tile + c * TILE + 8); body }
    switch (r) {
    case 2: LOOP(ROW(0) ROW(1)) break;
    case 3: LOOP(ROW(0) ROW(1) ROW(2)) break;
    default: LOOP(ROW(0) ROW(1) ROW(2) ROW(3)) break;
    }
#undef LOOP
#undef ROW
    put(out, a00, add); put(out + 8, a01, add);
    put(out + ldo, a10, add); put(out + ldo + 8, a11, add);
    if (r > 2) { put(out + 2 * ldo, a20, add); put(out + 2 * ldo + 8, a21, add); }
    if (r > 3) { put(out + 3 * ldo, a30, add); put(out + 3 * ldo + 8, a31, add); }
}

/* y[m][n] = sum_c x[m][c] * W[n][c]; x: [m, k], y: [m, n], both contiguous; tiled as above. */
void tiled_gemm(const float *x, int64_t m, int64_t k, const float *tiled, int64_t n, float *y) {
    float partial[ROWS * TILE]; /* the last tile's outputs when n is not a multiple of TILE */
    for (int64_t j = 0; j * TILE < n; j++) {
        const float *tile = tiled + j * k * TILE;
        const int64_t width = n - j * TILE < TILE ? n - j * TILE : TILE;
        for (int64_t row = 0; row < m; row += ROWS) {
            const int r = m - row < ROWS ? (int)(m - row) : ROWS;
            float *out = width == TILE ? y + row * n + j * TILE : partial;
            const int64_t ldo = width == TILE ? n : TILE;
            for (int64_t c = 0; c < k; c += BLOCK) {
                const int64_t kb = k - c < BLOCK ? k - c : BLOCK;
                if (r == 1)
                    tile_row(x + row * k + c, kb, tile + c * TILE, out, c > 0);
                else
                    tile_pass(x + row * k + c, k, r, kb, tile + c * TILE, out, ldo, c > 0);
            }
            if (width < TILE)
                for (int i = 0; i < r; i++) memcpy(y + (row + i) * n + j * TILE, partial + i * TILE, width * sizeof(float));
        }
    }
}
