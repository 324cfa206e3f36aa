/* y = x @ W^T where W is stored as a GGUF file stores it: blocks of 32 weights (Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0), super-blocks of 256 read 32 at a time (the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K),
 * or F16 / BF16 read 32 at a time.
 *
 * The weights a GGUF-loaded model holds in float32 are these blocks dequantized (gguf-py's
 * `dequantize`, which transformers runs): Q4_1 w = d * q + m (q a 4-bit code, d and m float16),
 * Q8_0 w = d * q (q an int8 code), in float32. d * q is exact in float32 (an 11-bit significand
 * times at most 8 bits), so gguf-py's multiply-then-add and one fused multiply-add round the sum
 * once, the same way: the kernel multiplies by the model's own float32 weights bit for bit while
 * reading 5 bits a weight (Q4_1) or 8.5 (Q8_0) instead of 32. (Q4_K's and Q5_K's passes that look
 * codes up add each sub-block's minimum apart, once a super-block: MINIMUMS_APART.) `*_dequantize` writes those
 * weights out with the same code:
 * mdcli.backends.weights.gguf_blocks compares them with the model's before it uses a block copy.
 *
 * Each output of a row of x sums its inputs in float32 on multiply-add chains (two per output
 * row in the passes of up to ROWS rows, one in the shared rebuilds and the wider panels), one vector lane per input
 * position modulo the vector width, then across the lanes: another summation order than other
 * BLAS kernels, so results agree with them to float32 rounding, not bit for bit. (Built with
 * X_DIGITS, one row of x times a K-quant reads x rounded per block of 32 instead: x_digits.)
 *
 * Built twice from this file (mdcli.backends.weights.gguf_blocks): with AVX-512 (16 lanes) and with AVX2 (8).
 */
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32
#define Q4_1_BYTES 20 /* float16 d, float16 m, 16 bytes of codes: low nibbles are weights 0-15, high 16-31 */
#define Q8_0_BYTES 34 /* float16 d, 32 int8 codes */
#define Q4_0_BYTES 18 /* float16 d, 16 bytes of codes as Q4_1's, each minus 8 */
#define HALF_BYTES 64 /* F16 and BF16: 32 weights of two bytes, read as a block of 32 */
#define Q5_0_BYTES 22 /* float16 d, 32 high bits (a little-endian uint32), 16 bytes of low nibbles as Q4_0's */
#define Q5_1_BYTES 24 /* float16 d, float16 m, then as Q5_0 */
/* K-quants: 256 weights a super-block, read as 8 sub-blocks of 32 (ggml's block_q*_K layouts) */
#define SUPER 8
#define LINE_BYTES 64 /* a cache line */
#define Q2_K_BYTES 84  /* 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit codes, d, dmin */
#define Q3_K_BYTES 110 /* 32 bytes of high bits, 64 of 2-bit codes, 12 of packed 6-bit scales, d */
#define Q4_K_BYTES 144 /* d, dmin, 12 bytes of packed 6-bit scales and mins, 128 bytes of nibbles */
#define Q5_K_BYTES 176 /* as Q4_K, with 32 bytes of high bits before the nibbles */
#define Q6_K_BYTES 210 /* 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d */

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

/* 16 bytes at p, each widened to an int32 lane */
typedef __m512i ivec;
static inline ivec ibytes(const uint8_t *p) { return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)); }
#define iset1 _mm512_set1_epi32
#define iand _mm512_and_si512
#define ior _mm512_or_si512
#define iadd _mm512_add_epi32
#define isub _mm512_sub_epi32
#define isrlv _mm512_srlv_epi32
static inline ivec isrl(ivec a, int count) { return _mm512_srl_epi32(a, _mm_cvtsi32_si128(count)); }
static inline ivec isll(ivec a, int count) { return _mm512_sll_epi32(a, _mm_cvtsi32_si128(count)); }
static inline ivec lane_index(void) { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
/* 0, 1, ..., 15 as floats: a 4-bit code's values. With 16 lanes, the 16 weights a block's codes
 * stand for (scale times code, plus an offset) fit in one register, made with the multiply-add the
 * weights would each have had, and every weight is then one lookup (vpermps) instead of a
 * conversion and a multiply-add: the same numbers, fewer instructions. */
static inline vec code_values(void) { return vfloat(lane_index()); }
/* Lane order: a sub-block's 32 codes (one a byte, or a nibble or 2 bits of a byte) read without
 * widening bytes to lanes, which takes the shuffle unit a table lookup also needs: its 32 bytes
 * loaded into both halves of a register, lane i of each half holds bytes 4i .. 4i + 3, and a shift
 * of each lane by SHIFT_A (+ the code's place in its byte) puts byte 4i's code in the low bits of
 * lanes 0-7 and byte 4i + 2's in lanes 8-15; SHIFT_B bytes 4i + 1 and 4i + 3. The inputs are put in
 * the same order once per product (lane_ordered), so every weight still meets its own input. */
static inline ivec shift_a(void) { return _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 16, 16, 16, 16, 16, 16, 16, 16); }
static inline ivec shift_b(void) { return _mm512_setr_epi32(8, 8, 8, 8, 8, 8, 8, 8, 24, 24, 24, 24, 24, 24, 24, 24); }
static inline ivec both_halves(const uint8_t *bytes32) {
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)bytes32));
}
/* Every lane's bits moved so that bit `from` lands on bit `to` (one whole-register shift: the
 * callers' bits never leave their byte) */
static inline ivec bit_moved(ivec v, int from, int to) {
    return from < to ? _mm512_slli_epi32(v, to - from) : _mm512_srli_epi32(v, from - to);
}
/* Bit 0 of each of a sub-block's 32 bytes in both_halves' order: set in its second group of 16
 * (lane i of each half holds the bytes at places 4i .. 4i + 3: the second group's from lane 4) */
static inline ivec second_group(void) {
    return _mm512_setr_epi32(0, 0, 0, 0, 0x01010101, 0x01010101, 0x01010101, 0x01010101,
                             0, 0, 0, 0, 0x01010101, 0x01010101, 0x01010101, 0x01010101);
}
/* The two floats at p in every pair of lanes (p[0], p[1], p[0], p[1], ...): one 64-bit broadcast */
static inline vec pair_broadcast(const float *p) {
    double pair;
    memcpy(&pair, p, sizeof pair);
    return _mm512_castpd_ps(_mm512_set1_pd(pair));
}
/* Q6_K's 64 codes of quarter c (weights 64c .. 64c + 63) of the super-block at sb, byte p of the
 * register the code of weight 64c + p, bits 6 and 7 of each byte left unclear (the caller keeps 6 bits):
 * quarters 0 and 2 are the low nibbles of 64 bytes, 1 and 3 their high nibbles, and each weight's top two
 * bits sit in byte p mod 32 of the 32 high-bit bytes, at bits 0-1 (p < 32) or 2-3 (p >= 32) for the low
 * nibbles, 4-5 or 6-7 for the high ones. Four instructions make 64 codes, where assembling each code
 * in its own lane took four for 16: on a Zen 5 core a 1B model's Q6_K matrices (of a Q4_K_M file) took
 * 0.80x the time at one row, 0.86x at two (notebook/gguf-blocks.md). */
static inline ivec q6_codes(const uint8_t *sb, int c) {
    const __m512i low = _mm512_loadu_si512((const void *)(sb + (c / 2) * 64));
    const ivec high = both_halves(sb + 128 + (c / 2) * 32);
    const ivec half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2); /* p >= 32: two bits on */
    const ivec nibbles = c % 2 ? _mm512_srli_epi32(low, 4) : low;
    const ivec tops = c % 2 ? isrlv(high, half) : _mm512_sllv_epi32(high, isub(iset1(4), half)); /* to bits 4-5 */
    return _mm512_ternarylogic_epi32(nibbles, tops, iset1(0x0f0f0f0f), 0xE4); /* nibble's low 4 bits, tops' others */
}
/* Lane i of Q6_K quarter c's vectors in lane order (q6_codes' bytes 4i .. 4i + 3): inputs 64 c + 4 i
 * .. + 3, in group of 16 4 c + i / 4 */
static inline ivec quarter_groups(int c) { return iadd(_mm512_srli_epi32(lane_index(), 2), iset1(4 * c)); }
#define LANE_ORDERED(kind) ((kind) >= 7) /* the K-quants (Q2_K to Q6_K) in the passes of up to LANE_ROWS */
#define SPAN_ROWS(kind) ((kind) == 10 ? 2 : 1) /* Q4_K's and Q5_K's passes of up to this many rows read spans (span_row) */
#elif defined(__AVX2__)
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

/* 8 bytes at p, each widened to an int32 lane */
typedef __m256i ivec;
static inline ivec ibytes(const uint8_t *p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)); }
#define iset1 _mm256_set1_epi32
#define iand _mm256_and_si256
#define ior _mm256_or_si256
#define iadd _mm256_add_epi32
#define isub _mm256_sub_epi32
#define isrlv _mm256_srlv_epi32
static inline ivec isrl(ivec a, int count) { return _mm256_srl_epi32(a, _mm_cvtsi32_si128(count)); }
static inline ivec isll(ivec a, int count) { return _mm256_sll_epi32(a, _mm_cvtsi32_si128(count)); }
static inline ivec lane_index(void) { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
#define LANE_ORDERED(kind) 0
#else
/* Plain C for other machines (ARM's NEON, or whatever the compiler makes of GCC's and Clang's vector
 * extensions): 8 lanes as the AVX2 build, every operation written as its meaning. */
#define LANES 8
#define ROWS 4
typedef float vec __attribute__((vector_size(32)));
typedef uint32_t ivec __attribute__((vector_size(32))); /* shifts are logical, as the x86 builds' */
typedef int32_t svec __attribute__((vector_size(32)));
static inline vec vzero(void) { return (vec){0}; }
static inline vec vset1(float a) { return (vec){0} + a; }
static inline vec vload(const float *p) { vec v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vec v) { memcpy(p, &v, sizeof v); }
static inline vec vfma(vec a, vec b, vec c) { return a * b + c; } /* exact products here: the same rounding */
static inline vec vmul(vec a, vec b) { return a * b; }
static inline vec vadd(vec a, vec b) { return a + b; }
static inline vec vfloat(ivec a) { return __builtin_convertvector((svec)a, vec); } /* as signed, as cvtdq2ps */
static inline float vsum(vec v) {
    const float pairs[4] = {v[0] + v[4], v[1] + v[5], v[2] + v[6], v[3] + v[7]};
    return (pairs[0] + pairs[2]) + (pairs[1] + pairs[3]);
}
static inline ivec ibytes(const uint8_t *p) { return (ivec){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }
static inline ivec iset1(int a) { return (ivec){0} + (uint32_t)a; }
static inline ivec iand(ivec a, ivec b) { return a & b; }
static inline ivec ior(ivec a, ivec b) { return a | b; }
static inline ivec iadd(ivec a, ivec b) { return a + b; }
static inline ivec isub(ivec a, ivec b) { return a - b; }
static inline ivec isrlv(ivec a, ivec b) { return a >> b; }
static inline ivec isrl(ivec a, int count) { return a >> count; }
static inline ivec isll(ivec a, int count) { return a << count; }
static inline ivec lane_index(void) { return (ivec){0, 1, 2, 3, 4, 5, 6, 7}; }

static inline void q4_codes(const uint8_t *codes, vec w[4]) {
    const ivec low = ibytes(codes), high = ibytes(codes + 8);
    w[0] = vfloat(low & 15), w[1] = vfloat(high & 15), w[2] = vfloat(low >> 4), w[3] = vfloat(high >> 4);
}

static inline void q8_codes(const int8_t *codes, vec w[4]) {
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < LANES; i++)
            w[j][i] = (float)codes[8 * j + i];
}

/* A float16's float32 value, exactly (no F16C here). */
static inline float half_value(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    if (exponent == 0) { /* zero or subnormal: mantissa x 2^-24, exact in float32 */
        const float value = (float)mantissa * 0x1p-24f;
        return sign ? -value : value;
    }
    const uint32_t bits = sign | (exponent == 0x1f ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
    float value;
    memcpy(&value, &bits, 4);
    return value;
}

static inline void halves(const uint8_t *p, vec w[4]) {
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < LANES; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * (LANES * j + i), 2);
            w[j][i] = half_value(h);
        }
}

static inline void brains(const uint8_t *p, vec w[4]) { /* bf16: the high half of a float32 */
    for (int j = 0; j < 4; j++)
        for (int i = 0; i < LANES; i++) {
            uint16_t h;
            memcpy(&h, p + 2 * (LANES * j + i), 2);
            const uint32_t bits = (uint32_t)h << 16;
            memcpy(&w[j][i], &bits, 4);
        }
}
#define LANE_ORDERED(kind) 0
#endif

/* x's m rows (stride ldx) in lane order into out (stride k), as `kind`'s weights hold them: Q4_K's
 * (lane_ordered's both halves) each 32 inputs as inputs 4i + {0, 2} then 4i + {1, 3}, and each 128
 * as span_row reads them in its passes (SPAN_ROWS); Q6_K's
 * (q6_codes) each 64 inputs as four vectors, vector j lane i input 4i + j. For Q4_K on AVX-512 also
 * each row's sums of its blocks of 32 inputs, after ROWS rows (block_sums_at): ORDERED_FLOATS(k) in all. */
#define ORDERED_FLOATS(k) (ROWS * (k) + ROWS * ((k) / BLOCK))
/* Where row r's sums of its blocks of 32 inputs start, in floats from x's first row in lane order. */
static inline int64_t block_sums_at(int64_t k, int r) { return ROWS * k + r * (k / BLOCK); }
static void lane_ordered(int kind, const float *x, int64_t m, int64_t k, int64_t ldx, float *out) {
    static const int order[BLOCK] = {0, 4, 8, 12, 16, 20, 24, 28, 2, 6, 10, 14, 18, 22, 26, 30,
                                     1, 5, 9, 13, 17, 21, 25, 29, 3, 7, 11, 15, 19, 23, 27, 31};
#if defined(__AVX512F__)
    /* by permutes of two registers' 32 inputs, not element by element (THREADED makes the copy once
     * per product, on the calling thread, before the runs are handed out) */
    const ivec first = _mm512_loadu_si512((const void *)order), second = _mm512_loadu_si512((const void *)(order + 16));
    for (int64_t r = 0; r < m; r++) {
        const float *in = x + r * ldx;
        float *o = out + r * k;
        if (kind != 11)
            for (int64_t c = 0; c < k; c += BLOCK)
                out[block_sums_at(k, (int)r) + c / BLOCK] = vsum(vadd(vload(in + c), vload(in + c + 16)));
        if ((kind == 9 || kind == 10) && m <= SPAN_ROWS(kind)) /* span_row's order: each 128 inputs as 8
                                                                 * vectors, lane i of vector u = 2 place + h
                                                                 * input 64 (i / 8) + 32 h + 4 (i % 8) + place */
            for (int64_t c = 0; c < k; c += 4 * BLOCK) {
                for (int u = 0; u < 8; u++) { /* vector u = 2 place + h: lanes 0-7 chunk 0, 8-15 chunk 1 */
                    const int place = u / 2, h = u % 2; /* lane i: byte 4 (i % 8) + place of its chunk, nibble h */
                    const ivec index = iadd(_mm512_slli_epi32(iand(lane_index(), iset1(7)), 2), iset1(place));
                    vstore(o + c + 16 * u, _mm512_mask_blend_ps(
                        0xff00, _mm512_permutex2var_ps(vload(in + c + 32 * h), index, vload(in + c + 32 * h + 16)),
                        _mm512_permutex2var_ps(vload(in + c + 64 + 32 * h), index, vload(in + c + 64 + 32 * h + 16))));
                }
            }
        else if (kind == 11)
            for (int64_t c = 0; c < k; c += 2 * BLOCK) { /* vector j, lane l: input 4l + j of 64 */
                const vec a0 = vload(in + c), a1 = vload(in + c + 16), a2 = vload(in + c + 32), a3 = vload(in + c + 48);
                for (int j = 0; j < 4; j++) {
                    const ivec index = iand(iadd(_mm512_slli_epi32(lane_index(), 2), iset1(j)), iset1(31));
                    vstore(o + c + 16 * j, _mm512_mask_blend_ps(0xff00, _mm512_permutex2var_ps(a0, index, a1),
                                                                _mm512_permutex2var_ps(a2, index, a3)));
                }
            }
        else
            for (int64_t c = 0; c < k; c += BLOCK) {
                const vec a0 = vload(in + c), a1 = vload(in + c + 16);
                vstore(o + c, _mm512_permutex2var_ps(a0, first, a1));
                vstore(o + c + 16, _mm512_permutex2var_ps(a0, second, a1));
            }
    }
#else
    for (int64_t r = 0; r < m; r++)
        if (kind == 11)
            for (int64_t c = 0; c < k; c += 2 * BLOCK)
                for (int i = 0; i < 2 * BLOCK; i++)
                    out[r * k + c + i] = x[r * ldx + c + 4 * (i % 16) + i / 16];
        else
            for (int64_t c = 0; c < k; c += BLOCK)
                for (int i = 0; i < BLOCK; i++)
                    out[r * k + c + i] = x[r * ldx + c + order[i]];
#endif
}

#define PER (BLOCK / LANES) /* vectors per block */

static inline float half_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    return half_value(h);
#endif
}

/* One block's 32 weights, in input order, as PER vectors. kind: 0 = Q4_1, 1 = Q8_0, 2 = Q4_0,
 * 3 = F16, 4 = BF16 (gguf-py: Q4_0 w = d * (q - 8); F16 and BF16 widened to float32, exactly). */
static inline __attribute__((always_inline)) void weights_of(int kind, const uint8_t *block, vec w[PER], int lookup) {
    if (kind == 3) {
        halves(block, w);
        return;
    }
    if (kind == 4) {
        brains(block, w);
        return;
    }
    const vec d = vset1(half_at(block));
#if defined(__AVX512F__)
    if (lookup && (kind == 2 || kind == 0)) { /* a table of the 16 weights a code stands for, each weight looked up */
        const vec table = kind == 2 ? vmul(d, vadd(code_values(), vset1(-8.0f))) : vfma(d, code_values(), vset1(half_at(block + 2)));
        const ivec bytes = ibytes(block + (kind == 2 ? 2 : 4));
        w[0] = _mm512_permutexvar_ps(bytes, table); /* vpermps reads each index's low 4 bits: the low nibble */
        w[1] = _mm512_permutexvar_ps(isrl(bytes, 4), table);
        return;
    }
#endif
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

/* The kinds beyond weights_of's: 5 = Q5_0, 6 = Q5_1 (blocks of 32), 7 = Q2_K, 8 = Q3_K, 9 = Q4_K,
 * 10 = Q5_K, 11 = Q6_K (super-blocks of 256, read 32 weights at a time). Each is the float32 weight
 * gguf-py's `dequantize` makes, bit for bit: every scale times a code is exact in float32 (at most
 * 11 + 8 + 6 significant bits), so where gguf-py subtracts a minimum or adds an offset after the
 * product, one fused multiply-add rounds the same once; where it multiplies three numbers, every
 * order gives the same exact product. */
#define IS_SUPER(kind) ((kind) >= 7)

/* Bytes per block (32 weights) or super-block (256) of each kind. */
static inline int64_t bytes_of(int kind) {
    switch (kind) {
    case 0: return Q4_1_BYTES;
    case 1: return Q8_0_BYTES;
    case 2: return Q4_0_BYTES;
    case 5: return Q5_0_BYTES;
    case 6: return Q5_1_BYTES;
    case 7: return Q2_K_BYTES;
    case 8: return Q3_K_BYTES;
    case 9: return Q4_K_BYTES;
    case 10: return Q5_K_BYTES;
    case 11: return Q6_K_BYTES;
    default: return HALF_BYTES;
    }
}

/* Q5_0 (w = d * (q - 16)) and Q5_1 (w = d * q + m): q's low nibble as Q4_0's, its fifth bit bit i of
 * a little-endian uint32 for weight i. */
static inline __attribute__((always_inline)) void q5_weights(int with_min, const uint8_t *block, vec w[PER], int lookup) {
    const vec d = vset1(half_at(block));
    const uint8_t *high_bits = block + (with_min ? 4 : 2), *codes = high_bits + 4;
    uint32_t high;
    memcpy(&high, high_bits, 4);
#if defined(__AVX512F__)
    if (lookup) { /* the 32 weights a code stands for as two tables (fifth bit clear, set), each weight looked up by
       * its low nibble in the table its fifth bit names (a mask register): code_values' rule */
        const vec values = code_values(), m = with_min ? vset1(half_at(block + 2)) : vzero();
        const vec clear = with_min ? vfma(d, values, m) : vmul(d, vadd(values, vset1(-16.0f)));
        const vec set = with_min ? vfma(d, vadd(values, vset1(16.0f)), m) : vmul(d, values);
        const ivec bytes = ibytes(codes);
        for (int j = 0; j < PER; j++) {
            const ivec nibbles = j == 0 ? bytes : isrl(bytes, 4); /* vpermps reads the low 4 bits */
            w[j] = _mm512_mask_permutexvar_ps(_mm512_permutexvar_ps(nibbles, clear), (__mmask16)(high >> (16 * j)),
                                              nibbles, set);
        }
        return;
    }
#endif
    const ivec bits = iset1((int)high), index = lane_index();
    for (int j = 0; j < PER; j++) {
        const int o = j * LANES; /* weights o .. o + LANES of the block */
        const ivec low = o < 16 ? iand(ibytes(codes + o), iset1(15)) : isrl(ibytes(codes + o - 16), 4);
        const ivec fifth = isll(iand(isrlv(bits, iadd(index, iset1(o))), iset1(1)), 4);
        const ivec q = ior(low, fifth);
        w[j] = with_min ? vfma(d, vfloat(q), vset1(half_at(block + 2))) : vmul(d, vfloat(isub(q, iset1(16))));
    }
}

/* A K-quant super-block's scales, decoded once for its 8 sub-blocks, each exact in float32 (a float16
 * times a code of at most 8 bits). Q4_K and Q5_K: scale[s] = d * the 6-bit scale of sub-block s and
 * scale[8 + s] = -(dmin * its 6-bit minimum). The others: for each group of 16 weights, the scale its
 * codes are multiplied by, and the offset added after (0 where the kind has none). In vector
 * registers where the kind allows: decoded one by one, the scales took a third of a one-row Q4_K
 * product on a Zen 5 core. */
struct k_scales {
    float scale[16], offset[16];
};

/* The 16 bytes of a Q4_K or Q5_K super-block's 8 six-bit scales, then its 8 six-bit minimums, from
 * their 12 packed bytes at q, as 32-bit words u0 u1 u2 (q[s] and q[s + 4] hold sub-blocks s < 4 in
 * their low 6 bits; q[s + 4]'s nibbles and the top 2 bits of q[s - 4] and q[s] hold s >= 4): scales
 * 0-3 = u0 & 0x3f.., scales 4-7 = (u2 & 0x0f..) | ((u0 >> 6) & 0x03..) << 4, minimums 0-3 = u1 & 0x3f..,
 * minimums 4-7 = ((u2 >> 4) & 0x0f..) | ((u1 >> 6) & 0x03..) << 4. Reads 16 bytes from q. */
#if defined(__AVX2__) || defined(__AVX512F__)
static inline __m128i k_unpacked(const uint8_t *q) {
    const __m128i u = _mm_loadu_si128((const __m128i *)q);
    const __m128i low = _mm_shuffle_epi32(u, _MM_SHUFFLE(2, 1, 2, 0));  /* u0 u2 u1 u2 */
    const __m128i high = _mm_shuffle_epi32(u, _MM_SHUFFLE(1, 1, 0, 0)); /* u0 u0 u1 u1 */
    const __m128i x = _mm_srlv_epi32(low, _mm_setr_epi32(0, 0, 0, 4));
    const __m128i keep = _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f);
    const __m128i top = _mm_and_si128(_mm_srli_epi32(high, 6), _mm_setr_epi32(0, 0x03030303, 0, 0x03030303));
    return _mm_or_si128(_mm_and_si128(x, keep), _mm_slli_epi32(top, 4));
}
#else
static inline void k_unpacked(const uint8_t *q, uint8_t bytes[16]) { /* the same in 32-bit words (little-endian) */
    uint32_t u[4];
    memcpy(u, q, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const uint32_t minimums = u[1] & 0x3f3f3f3f;
    u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    u[2] = minimums;
    u[0] &= 0x3f3f3f3f;
    memcpy(bytes, u, 16);
}
#endif

#if defined(__AVX2__) || defined(__AVX512F__)
/* A Q3_K super-block's 16 six-bit scales (unsigned, before the - 32) from their 12 packed bytes at
 * q, as 32-bit words u0 u1 u2: scales 0-3 = (u0 & 0x0f..) | (u2 & 0x03..) << 4, 4-7 = (u1 & 0x0f..) |
 * ((u2 >> 2) & 0x03..) << 4, 8-11 = ((u0 >> 4) & 0x0f..) | ((u2 >> 4) & 0x03..) << 4, 12-15 = ((u1 >> 4)
 * & 0x0f..) | ((u2 >> 6) & 0x03..) << 4. Reads the 16 bytes from q - 4 (the last 4 of the block's
 * 2-bit codes, then the 12), never past the block, whose d follows. Decoded one by one, the scales
 * took a seventh of a lone row's Q3_K product. */
static inline __m128i q3_unpacked(const uint8_t *q) {
    const __m128i u = _mm_srli_si128(_mm_loadu_si128((const __m128i *)(q - 4)), 4); /* u0 u1 u2 0 */
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(1, 0, 1, 0)), _mm_setr_epi32(0, 0, 4, 4)),
                                      _mm_set1_epi32(0x0f0f0f0f));
    const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(u, _MM_SHUFFLE(2, 2, 2, 2)), _mm_setr_epi32(0, 2, 4, 6)),
                                       _mm_set1_epi32(0x03030303));
    return _mm_or_si128(low, _mm_slli_epi32(high, 4));
}
#endif

static inline __attribute__((always_inline)) void k_scales_of(int kind, const uint8_t *sb, struct k_scales *k) {
    if (kind == 9 || kind == 10) { /* Q4_K, Q5_K: d * scale and -(dmin * min) = (-dmin) * min per sub-block */
        const float d = half_at(sb), minus_dmin = -half_at(sb + 2);
#if defined(__AVX512F__)
        const __m128i codes = k_unpacked(sb + 4);
        const __m512 m = _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d), _mm512_set1_ps(minus_dmin));
        _mm512_storeu_ps(k->scale, _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(codes))));
#elif defined(__AVX2__)
        const __m128i codes = k_unpacked(sb + 4);
        _mm256_storeu_ps(k->scale, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(codes))));
        _mm256_storeu_ps(k->scale + 8, _mm256_mul_ps(_mm256_set1_ps(minus_dmin),
                                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8)))));
#else
        uint8_t codes[16];
        k_unpacked(sb + 4, codes);
        for (int i = 0; i < 16; i++)
            k->scale[i] = (i < 8 ? d : minus_dmin) * (float)codes[i];
#endif
    } else if (kind == 11) { /* Q6_K: d * an int8 scale per 16 */
        const float d = half_at(sb + 208);
#if defined(__AVX512F__)
        const __m512i codes = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb + 192)));
        _mm512_storeu_ps(k->scale, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(codes)));
#elif defined(__AVX2__)
        for (int h = 0; h < 2; h++) {
            const __m256i codes = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 192 + 8 * h)));
            _mm256_storeu_ps(k->scale + 8 * h, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(codes)));
        }
#else
        for (int g = 0; g < 16; g++)
            k->scale[g] = d * (float)((const int8_t *)(sb + 192))[g];
#endif
    } else if (kind == 7) { /* Q2_K: d * a 4-bit scale, -(dmin * a 4-bit min) = (-dmin) * min per 16 */
        const float d = half_at(sb + 80), dmin = half_at(sb + 82);
#if defined(__AVX512F__)
        const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sb));
        _mm512_storeu_ps(k->scale, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_and_si512(codes, _mm512_set1_epi32(15)))));
        _mm512_storeu_ps(k->offset, _mm512_mul_ps(_mm512_set1_ps(-dmin), _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4))));
        return;
#elif defined(__AVX2__)
        for (int h = 0; h < 2; h++) {
            const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(sb + 8 * h)));
            _mm256_storeu_ps(k->scale + 8 * h, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_and_si256(codes, _mm256_set1_epi32(15)))));
            _mm256_storeu_ps(k->offset + 8 * h, _mm256_mul_ps(_mm256_set1_ps(-dmin), _mm256_cvtepi32_ps(_mm256_srli_epi32(codes, 4))));
        }
        return;
#endif
        for (int g = 0; g < 16; g++) {
            k->scale[g] = d * (float)(sb[g] & 15);
            k->offset[g] = -(dmin * (float)(sb[g] >> 4));
        }
    } else { /* Q3_K: d * (a 6-bit scale - 32) per 16, its low 4 bits and high 2 bits packed apart (no offset) */
        const uint8_t *scales = sb + 96;
        const float d = half_at(sb + 108);
#if defined(__AVX2__) || defined(__AVX512F__)
        const __m128i codes = q3_unpacked(scales);
#if defined(__AVX512F__)
        _mm512_storeu_ps(k->scale, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_sub_epi32(
                                                     _mm512_cvtepu8_epi32(codes), _mm512_set1_epi32(32)))));
#else
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(k->scale + 8 * h, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_sub_epi32(
                                                                  _mm256_cvtepu8_epi32(h ? _mm_srli_si128(codes, 8) : codes),
                                                                  _mm256_set1_epi32(32)))));
#endif
        return;
#endif
        for (int g = 0; g < 16; g++) {
            const int low = g < 8 ? scales[g] & 15 : scales[g - 8] >> 4;
            const int high = (scales[8 + g % 4] >> (2 * (g / 4))) & 3;
            k->scale[g] = d * (float)((low | (high << 4)) - 32);
            k->offset[g] = 0.0f;
        }
    }
}

/* Sub-block s (weights 32 s .. 32 s + 32) of the K-quant super-block at sb, its scales decoded in k.
 * Vector j holds weights o .. o + LANES (o = j * LANES) of the sub-block: group 2 s + o / 16. */
static inline __attribute__((always_inline)) void k_weights(int kind, const uint8_t *sb, int s,
                                                            const struct k_scales *k, vec w[PER], int lookup) {
    if (kind == 9 || kind == 10) { /* Q4_K, Q5_K: w = (d * scale) * q - dmin * min */
        const vec ds = vset1(k->scale[s]), dm = vset1(k->scale[8 + s]);
        const uint8_t *codes = sb + (kind == 9 ? 16 : 48) + 32 * (s / 2);
#if defined(__AVX512F__)
        if (lookup && kind == 9) { /* Q4_K: a table of d * scale * code (code_values), in lane order; the
                                    * minimum's term is the pass's, once a super-block (MINIMUMS_APART) */
            const vec table = vmul(code_values(), ds);
            const ivec bytes = both_halves(codes), nibble = iset1(4 * (s % 2));
            w[0] = _mm512_permutexvar_ps(isrlv(bytes, iadd(shift_a(), nibble)), table); /* vpermps reads the low 4 bits */
            w[1] = _mm512_permutexvar_ps(isrlv(bytes, iadd(shift_b(), nibble)), table);
            return;
        }
        if (lookup) { /* Q5_K: as Q4_K's, with a table of the 32 weights in two registers. Each of the
                       * sub-block's 32 code bytes is made its weight's 5-bit code in one vpternlogd
                       * (0xca: the first operand's bits pick the second's, else the third's): bits
                       * 0-3 its nibble, bit 4 its fifth bit (bit s of the high-bit byte at the same
                       * place, shifted to bit 4; a whole-register shift, as no bit leaves its byte).
                       * vpermt2ps reads a lane's low 5 bits: one shuffle per 16 weights */
            const vec low = vmul(code_values(), ds), high = vmul(vadd(code_values(), vset1(16.0f)), ds);
            const ivec bytes = both_halves(codes), fifth = both_halves(sb + 16);
            const ivec moved = bit_moved(fifth, s, 4);
            const ivec code = s % 2 ? _mm512_ternarylogic_epi32(iset1(0x0f0f0f0f), _mm512_srli_epi32(bytes, 4), moved, 0xca)
                                    : _mm512_ternarylogic_epi32(iset1(0x10101010), moved, bytes, 0xca);
            w[0] = _mm512_permutex2var_ps(low, isrlv(code, shift_a()), high);
            w[1] = _mm512_permutex2var_ps(low, isrlv(code, shift_b()), high);
            return;
        }
#endif
        for (int j = 0; j < PER; j++) {
            const int o = j * LANES;
            ivec q = iand(isrl(ibytes(codes + o), 4 * (s % 2)), iset1(15));
            if (kind == 10) /* the fifth bit: bit s of high byte o + lane */
                q = ior(q, isll(iand(isrl(ibytes(sb + 16 + o), s), iset1(1)), 4));
            w[j] = vfma(ds, vfloat(q), dm);
        }
    } else if (kind == 11) { /* Q6_K: w = (d * scale) * (q - 32), a scale every 16 weights */
        const int h = s / 4, t = s % 4;
#if defined(__AVX512F__)
        if (lookup) { /* in lane order (q6_codes): the 64 codes of quarter s / 2, this sub-block's two vectors of them */
            const int quarter = s / 2;
            const ivec codes = q6_codes(sb, quarter);
            /* lane i of every vector holds input 4i + j of the quarter */
            const vec scale = _mm512_permutexvar_ps(quarter_groups(quarter), _mm512_loadu_ps(k->scale));
            const vec offset = vmul(scale, vset1(-32.0f)); /* exact: (q - 32) * scale = q * scale - 32 * scale, rounded once */
            for (int j = 0; j < PER; j++) {
                const int byte = 2 * (s % 2) + j; /* vector 2 (s % 2) + j of the quarter: byte `byte` of each lane */
                const ivec q = iand(byte == 0 ? codes : isrl(codes, 8 * byte), iset1(63));
                w[j] = vfma(vfloat(q), scale, offset);
            }
            return;
        }
#endif
        for (int j = 0; j < PER; j++) {
            const int o = j * LANES;
            const ivec low = iand(isrl(ibytes(sb + h * 64 + 32 * (t % 2) + o), 4 * (t / 2)), iset1(15));
            const ivec high = iand(isrl(ibytes(sb + 128 + h * 32 + o), 2 * t), iset1(3));
            const ivec q = isub(ior(low, isll(high, 4)), iset1(32));
            w[j] = vmul(vset1(k->scale[2 * s + o / 16]), vfloat(q));
        }
    } else if (kind == 7) { /* Q2_K: w = (d * scale) * q - dmin * min, a 4-bit scale and min every 16 */
        const int h = s / 4, u = s % 4;
#if defined(__AVX512F__)
        if (lookup) { /* as Q3_K's: in lane order, a table of the sub-block's 8 weights (twice over: a
                       * lane's index bit 3 is left unclear), entry 2c + g the 2-bit code c times the
                       * scale of the sub-block's group g plus its offset (one multiply-add, rounded once
                       * as the weight is); each code byte made its entry in one vpternlogd */
            const ivec low_at_1 = bit_moved(both_halves(sb + 16 + 32 * h), 2 * u, 1);
            const ivec code = _mm512_ternarylogic_epi32(iset1(0x06060606), low_at_1, second_group(), 0xca);
            const vec values = vfloat(iand(isrl(lane_index(), 1), iset1(3))); /* entry 2c + g: c */
            const vec table = vfma(values, pair_broadcast(k->scale + 2 * s), pair_broadcast(k->offset + 2 * s));
            w[0] = _mm512_permutexvar_ps(isrlv(code, shift_a()), table);
            w[1] = _mm512_permutexvar_ps(isrlv(code, shift_b()), table);
            return;
        }
#endif
        for (int j = 0; j < PER; j++) {
            const int o = j * LANES, g = 2 * s + o / 16;
            const ivec q = iand(isrl(ibytes(sb + 16 + h * 32 + o), 2 * u), iset1(3));
            w[j] = vfma(vset1(k->scale[g]), vfloat(q), vset1(k->offset[g]));
        }
    } else { /* Q3_K: w = (d * (scale - 32)) * (q - 4 * (1 - high bit)), a 6-bit scale every 16 */
        const int h = s / 4, u = s % 4;
#if defined(__AVX512F__)
        if (lookup) { /* in lane order: a table of the sub-block's 16 weights, entry 2c + g the 3-bit code c
                       * (2 low bits | high bit << 2) minus 4, times the scale of the sub-block's group g
                       * (its first 16 weights, its second). Each of its 32 code bytes is made its entry
                       * in two vpternlogd (0xca: the first operand's bits pick the second's, else the
                       * third's): bit 0 its group, bits 1-2 its low bits, bit 3 its high bit */
            const ivec low_at_1 = bit_moved(both_halves(sb + 32 + 32 * h), 2 * u, 1);
            const ivec high_at_3 = bit_moved(both_halves(sb), s, 3);
            const ivec code = _mm512_ternarylogic_epi32(iset1(0x06060606), low_at_1,
                                                        _mm512_ternarylogic_epi32(iset1(0x01010101), second_group(), high_at_3, 0xca), 0xca);
            const vec values = vadd(vfloat(isrl(lane_index(), 1)), vset1(-4.0f)); /* entry 2c + g: c - 4 */
            const vec table = vmul(values, pair_broadcast(k->scale + 2 * s));
            w[0] = _mm512_permutexvar_ps(isrlv(code, shift_a()), table);
            w[1] = _mm512_permutexvar_ps(isrlv(code, shift_b()), table);
            return;
        }
#endif
        for (int j = 0; j < PER; j++) {
            const int o = j * LANES;
            const ivec q2 = iand(isrl(ibytes(sb + 32 + h * 32 + o), 2 * u), iset1(3));
            const ivec bit = iand(isrl(ibytes(sb + o), s), iset1(1));
            const ivec q = isub(q2, isll(isub(iset1(1), bit), 2));
            w[j] = vmul(vset1(k->scale[2 * s + o / 16]), vfloat(q));
        }
    }
}

/* A hint that the line at p is read soon: non-temporal (prefetchnta: weights are read once a step),
 * or, `near`, temporal, into the outer caches (prefetcht2). On a Zen 4 core, in two runs, the
 * one-row products of a 1B model's Q6_K matrices took 0.85-0.87x the time with the nearer hint
 * (one thread and two), two rows 0.92-0.93x, and a bf16 folder's one row 0.79-0.96x (one thread),
 * 0.92-1.01x (two); Q4_K 0.93-1.01x; Q4_1 and Q8_0 took 1.00-1.06x, and eight rows of Q6_K
 * 1.03-1.07x (notebook/gguf-blocks.md, "Nearer hints on Zen 4"). So NEAR_AHEAD: those kinds'
 * passes of one and two rows (and F16's, read as BF16's are, unmeasured), where the build asks for
 * them (-DNEAR_HINTS=1: mdcli.backends.native.build's host_defines, on a Zen 4 host alone). */
#ifndef NEAR_HINTS
#define NEAR_HINTS 0
#endif
#define NEAR_AHEAD(kind, R) \
    (NEAR_HINTS && (R) <= 2 && ((kind) == 3 || (kind) == 4 || (kind) == 9 || (kind) == 11)) /* F16 BF16 Q4_K Q6_K */
static inline __attribute__((always_inline)) void hint(const uint8_t *p, int near) {
    if (near)
        __builtin_prefetch(p, 0, 1);
    else
        __builtin_prefetch(p, 0, 0);
}

/* Weights [b, b + count) (counted in 32s from `base`, a row's or a whole matrix's first block) of W
 * weight rows (1 or 2, `stride` bytes apart) passed to body(b, w, ks) one block of 32 at a time, w[o]
 * weight row o's PER vectors, and ks: a K-quant super-block's scales per weight row (NULL for the
 * other kinds); a K-quant's scales decoded once per super-block (b and count whole
 * super-blocks for those), a super-block ahead: decoded just before their use, their broadcast
 * loads waited on the stores that made them, and a one-row Q4_K product took 1.2x the time on a Zen
 * 5 core. `ahead` (bytes; 0: none): each block's bytes that far on are asked into the caches as it
 * is read, a steady stream of hints (see AHEAD_BYTES), temporal ones where `near` (hint). lookup:
 * 2- to 5-bit codes looked up in a table of their weights, and the K-quants' codes (Q2_K to
 * Q6_K) read in lane order (AVX-512; the same numbers, x lane-ordered to match), for passes of up to
 * LOOKUP_ROWS rows (LANE_ROWS for the K-quants), where the rebuild is
 * most of the work: on a Zen 5 core the embedded model's one-row products took 0.88x the time with
 * the tables, its eight-row products 1.08x, so the wider passes convert (notebook/gguf-blocks.md;
 * -DLOOKUP_ROWS=0 builds without them, for `benchmarks/file_products.py --build` to compare). */
#ifndef LOOKUP_ROWS
#define LOOKUP_ROWS 2
#endif
/* The passes that read `kind`'s codes as `lookup` says, up to this many rows (measured on a Zen 4
 * core, a 1B model's matrices, one thread and two; notebook/gguf-blocks.md):
 * - Q6_K's has no table (q6_codes makes 64 codes in four instructions, then each 16 are cut out and
 *   converted), and pays at every narrow pass: 0.78x, 0.86x, 0.90x, 0.98x, 0.94x and 0.96x the time
 *   at 3-8 rows in lane order ("Q6_K's codes in lane order at every narrow pass").
 * - Q5_K's table (32 weights, two registers) pays up to 4 rows: 0.76-0.78x the time at one row,
 *   0.81-0.82x at two, 0.82-0.86x at three, 0.90-0.93x at four; at every narrow pass it took
 *   0.97-1.01x at five and six rows, 1.07x at seven and 1.15x at eight ("Q5_K looked up"). Q4_K's
 *   as well: 0.86-0.88x at three rows, 0.95-0.96x at four. Q4_K's one-row passes and Q5_K's one-
 *   and two-row passes read spans instead: span_row.
 * - Q3_K's (16 weights, its two groups' scales in one register, no minimums) pays at every narrow
 *   pass: 0.64-0.68x at one and two rows, 0.73x at three, 0.79-0.80x at four, 0.88-0.90x at eight
 *   ("Q3_K looked up"). Q2_K's too (8 weights, its offsets in the table): 0.51-0.52x at one row,
 *   0.58-0.59x at two, 0.57x at three, 0.61-0.62x at four, 0.68-0.70x at eight ("Q2_K looked up"). */
#define LANE_ROWS(kind) (LOOKUP_ROWS == 0 ? 0 : (kind) == 7 || (kind) == 8 || (kind) == 11 ? ROWS : (kind) == 9 || (kind) == 10 ? 4 : LOOKUP_ROWS)
#define EACH_BLOCK(kind, W, base, stride, ahead, near, first, count, lookup, body)                \
    do {                                                                                          \
        if (IS_SUPER(kind)) {                                                                     \
            const int64_t B0_ = (first) / SUPER, B1_ = ((first) + (count)) / SUPER;               \
            struct k_scales ks_[2][2];                                                            \
            if (B0_ < B1_)                                                                        \
                _Pragma("GCC unroll 2") for (int o_ = 0; o_ < (W); o_++)                                                  \
                    k_scales_of(kind, (base) + o_ * (stride) + B0_ * bytes_of(kind), &ks_[0][o_]); \
            for (int64_t B_ = B0_; B_ < B1_; B_++) {                                              \
                const int now_ = (int)((B_ - B0_) & 1);                                           \
                if (ahead)                                                                        \
                    _Pragma("GCC unroll 2") for (int o_ = 0; o_ < (W); o_++)                      \
                        _Pragma("GCC unroll 4") for (int f_ = 0; f_ < bytes_of(kind); f_ += LINE_BYTES) \
                            hint((base) + o_ * (stride) + B_ * bytes_of(kind) + (ahead) + f_, near);           \
                if (B_ + 1 < B1_)                                                                 \
                    _Pragma("GCC unroll 2") for (int o_ = 0; o_ < (W); o_++)                                              \
                        k_scales_of(kind, (base) + o_ * (stride) + (B_ + 1) * bytes_of(kind), &ks_[now_ ^ 1][o_]); \
                __asm__("" : "+m"(ks_)); /* read back by broadcast loads, not by shuffles */      \
                _Pragma("GCC unroll 8") for (int s_ = 0; s_ < SUPER; s_++) {                      \
                    vec w_[2][PER];                                                               \
                    _Pragma("GCC unroll 2") for (int o_ = 0; o_ < (W); o_++)                                              \
                        k_weights(kind, (base) + o_ * (stride) + B_ * bytes_of(kind), s_, &ks_[now_][o_], w_[o_], lookup); \
                    body(B_ * SUPER + s_, w_, ks_[now_]);                                         \
                }                                                                                 \
            }                                                                                     \
        } else {                                                                                  \
            for (int64_t b_ = (first); b_ < (first) + (count); b_++) {                            \
                vec w_[2][PER];                                                                   \
                if (ahead)                                                                      \
                    _Pragma("GCC unroll 2") for (int o_ = 0; o_ < (W); o_++)                      \
                        hint((base) + o_ * (stride) + b_ * bytes_of(kind) + (ahead), near);                \
                _Pragma("GCC unroll 2") for (int o_ = 0; o_ < (W); o_++) {                                                \
                    const uint8_t *block_ = (base) + o_ * (stride) + b_ * bytes_of(kind);         \
                    if (kind == 5 || kind == 6)                                                   \
                        q5_weights(kind == 6, block_, w_[o_], lookup);                            \
                    else                                                                          \
                        weights_of(kind, block_, w_[o_], lookup);                                 \
                }                                                                                 \
                body(b_, w_, (const struct k_scales *)NULL);                                      \
            }                                                                                     \
        }                                                                                         \
    } while (0)

/* Bytes of a weight row of k inputs. */
static inline int64_t row_bytes_of(int kind, int64_t k) {
    return (IS_SUPER(kind) ? k / (BLOCK * SUPER) : k / BLOCK) * bytes_of(kind);
}

/* Weights [first, first + count) in 32s from `base` written out as float32 at out[32 (b - first)],
 * by the code the products use. */
#define STORE_BLOCK(b, w, ks)                               \
    for (int j_ = 0; j_ < PER; j_++)                        \
        vstore(out + ((b) - first) * BLOCK + j_ * LANES, (w)[0][j_]);

static inline __attribute__((always_inline)) void blocks_out(int kind, const uint8_t *base, int64_t first,
                                                             int64_t count, float *out) {
    EACH_BLOCK(kind, 1, base, 0, 0, 0, first, count, 0, STORE_BLOCK);
}

/* While one weight row is multiplied, the row AHEAD_ROWS on (the next panel, in the panels) is asked
 * into the caches: with the hardware prefetchers alone the step's products took 9-14% longer at 6-8
 * rows on a Zen 3 core, 1-15% at 1-4 rows, the same at 16 (weights are read once a step, so the hint
 * is non-temporal; notebook/gguf-blocks.md, "Weight rows fetched ahead"). A hint: it never faults
 * and never waits. The passes of up to ROWS rows ask for the bytes AHEAD_BYTES on (at least two rows
 * on) block by block instead: a row's worth of hints at once overflowed the core's queue of misses
 * when two rows were read together, and on a Zen 5 core the one-row products of a 1B model's Q8_0
 * file took 0.78x the time. Other distances build with -DAHEAD_ROWS=N, -DAHEAD_BYTES=N (and span
 * widths with -DSPAN=N, below), for a benchmark to compare them on another host kind
 * (benchmarks/native_kernels.py --define). */
#ifndef AHEAD_ROWS
#define AHEAD_ROWS 6
#endif
#ifndef AHEAD_BYTES
#define AHEAD_BYTES 8192
#endif

/* The rows on from a row of row_bytes that AHEAD_BYTES reaches, at least 2 (past a pair of rows). */
static inline int64_t rows_ahead(int64_t row_bytes) {
    const int64_t rows = (AHEAD_BYTES + row_bytes - 1) / row_bytes;
    return rows < 2 ? 2 : rows;
}

/* Always inlined: left to GCC 12, the shared passes' and the panels' hints vanished from a build
 * of this file, and 8-row Q8_0 products over 35 MB took 3-4x the time. */
static inline __attribute__((always_inline)) void fetch(const uint8_t *p, int64_t bytes) {
    for (int64_t f = 0; f < bytes; f += LINE_BYTES)
        __builtin_prefetch(p + f, 0, 0);
}

/* Q4_K's and Q5_K's passes that look codes up (AVX-512, up to LANE_ROWS rows) keep each sub-block's minimum
 * apart: the table holds d * scale * code (exact in float32), and once a super-block its 8 minimums'
 * terms, -(dmin * min), are multiplied by x's sums over those sub-blocks in one 8-lane multiply-add
 * (x's sums made once per product, beside x in lane order: lane_ordered). Folded into each
 * sub-block's table, the minimum cost a broadcast and a multiply-add per 32 weights: a 1B model's
 * Q4_K matrices took 1.14x the time at one row on a Zen 4 core, 1.09x at two
 * (notebook/gguf-blocks.md, "Q4_K's minimums apart"). The sums are then of d * scale * code * x and
 * of the minimums' terms: the product of the same float32 weights (d * scale * code - dmin * min,
 * rounded once) within float32 rounding, in another order. */
#if defined(__AVX512F__)
#define MINIMUMS_APART(kind, R) (((kind) == 9 || (kind) == 10) && (R) <= LANE_ROWS(kind))
static inline float sum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
#else
#define MINIMUMS_APART(kind, R) 0
#endif

/* Q4_K's one-row passes and Q5_K's of one and two rows (AVX-512) read the nibbles 64 bytes at a time: a span, two
 * chunks of 32 bytes (chunk c's low nibbles are sub-block 2c, its high ones 2c + 1). Lane i holds
 * bytes 4i .. 4i + 3 of the span, so lanes 0-7 hold the first chunk's, 8-15 the second's, and a
 * shift by 8 place + 4 h puts byte 4 (i % 8) + place's nibble h in the low bits that vpermps reads:
 * 7 shifts for 8 vectors of 16 weights, where the passes of 2-4 rows (both_halves) shift for every
 * vector. The table is the codes' own values (code_values; Q5_K's 32 in two registers, each byte's
 * fifth bit put at its bit 4 by a rotate and a vpternlogd per nibble), the same for every
 * sub-block, and each span's two sums (h = 0 and 1: sub-blocks 4s + h in lanes 0-7, 4s + 2 + h in
 * lanes 8-15, for span s) are multiplied by their sub-blocks' d * scale once, lane by lane; the
 * minimums' terms as MINIMUMS_APART's; both weight rows' scales decoded a super-block ahead into
 * registers (q4_k_scales_pair), not stored and loaded back. x in this order: lane_ordered. The
 * sums are of code * x, then times d * scale: the product of the same float32 weights within float32 rounding, in another order. On a
 * Zen 4 core a 1B model's Q5_K matrices took 0.78x the time at one row (one thread), 0.81x (two),
 * against the tables of the 2-4-row passes, and 0.84x and 0.87x at two rows; Q4_K's 0.95x and 0.91x
 * at one row, but 1.11x at two, where its tables (one multiply per sub-block) serve both rows and the
 * spans' scaling is per row (notebook/gguf-blocks.md, "One row read in spans"). */
#if defined(__AVX512F__)
#define SPAN_ROW(kind, R) (LOOKUP_ROWS != 0 && ((kind) == 9 || (kind) == 10) && (R) <= SPAN_ROWS(kind))
/* Each lane's sub-block in a span's vectors of nibble h: 4 span + h (lanes 0-7), 4 span + 2 + h (8-15) */
static inline ivec span_sub_blocks(int span, int h) {
    return iadd(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), iset1(4 * span + h));
}
/* Two Q4_K or Q5_K super-blocks' scales, at a and b: for each, lanes 0-7 d * scale and 8-15 -(dmin * min) of
 * its 8 sub-blocks, k_scales_of's numbers, kept in registers. */
static inline __attribute__((always_inline)) void q4_k_scales_pair(const uint8_t *a, const uint8_t *b, vec out[2]) {
    uint32_t da, db; /* d and dmin, two float16s */
    memcpy(&da, a, 4), memcpy(&db, b, 4);
    const __m128 halves = _mm_xor_ps(_mm_cvtph_ps(_mm_setr_epi32((int)da, (int)db, 0, 0)), _mm_setr_ps(0.0f, -0.0f, 0.0f, -0.0f));
    const __m512 both = _mm512_castps128_ps512(halves); /* d_a, -dmin_a, d_b, -dmin_b */
    out[0] = vmul(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), both),
                  vfloat(_mm512_cvtepu8_epi32(k_unpacked(a + 4))));
    out[1] = vmul(_mm512_permutexvar_ps(_mm512_setr_epi32(2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3), both),
                  vfloat(_mm512_cvtepu8_epi32(k_unpacked(b + 4))));
}
/* Lanes 8-15 of v */
static inline __m256 upper8(vec v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
/* A Q5_K span's fifth bits (high, in both_halves' order): in each lane, bit s of each byte (s its
 * sub-block: span_sub_blocks) rotated to bit 4 (no bit used leaves its byte) */
static inline ivec span_fifth(ivec high, int span, int h) {
    return _mm512_rolv_epi32(high, iand(isub(iset1(4), span_sub_blocks(span, h)), iset1(31)));
}
/* ---- One row of x in three 8-bit digits (AVX-512 VNNI builds with -DX_DIGITS=1) ---------------
 * A one-row product of a K-quant is bound by rebuilding each weight in float32: one lookup (or
 * shift, and, convert) and one multiply-add per 16 weights. Held another way the same sums cost
 * less: x, per block of 32, as a fixed-point number v * 2^(e - 22) (2^e above the block's largest
 * |x|, |v| <= 2^22), v in three signed 8-bit digits (v = 2^16 high + 2^8 middle + low); then per 64
 * weights their codes, as bytes, times each digit in one vpdpbusd (four u8 x s8 products summed in
 * each 32-bit lane), the three sums joined by two shifts (exact: below 2^30 for codes up to 63),
 * converted once and multiplied by the sub-block's d * scale * 2^(e - 22) lane by lane. Three
 * vpdpbusd do the work of four lookups and four multiply-adds. Every term reads x as the digits
 * hold it, its nearest multiple of its block's unit (ties to even): Q4_K's and Q5_K's minimums by
 * sums of it over blocks of 32 (as MINIMUMS_APART's), Q6_K's -32 by sums over groups of 16, once
 * a super-block (x_digits makes them). So a product is the float32 weights' product with x so
 * rounded, within float32 rounding: within that rounding plus, per block, sum |w| * unit / 2 of
 * x's own product, and an input more than 2^23 times smaller than its block's largest |x| reads
 * as zero (tests/test_kquant_files.py; docs/how-it-works.md). What it bought, measured:
 * notebook/gguf-blocks.md, "x in three 8-bit digits, in the kernel". Built where
 * build.host_defines says (the host kinds with VNNI where it was measured). */
#ifndef X_DIGITS
#define X_DIGITS 0
#endif
#if X_DIGITS && !defined(__AVX512VNNI__)
#error "-DX_DIGITS=1 needs AVX-512 VNNI (-mavx512vnni)"
#endif
#if X_DIGITS
#define DIGIT_BYTES 192 /* per 64 inputs: 64 high digits, 64 middle, 64 low */
#define DIGITS_KIND(kind) ((kind) == 9 || (kind) == 10 || (kind) == 11) /* Q4_K Q5_K Q6_K */
/* Where, in floats from the digits' start, the units (16 per super-block: lanes 0-7 its 8 blocks'
 * 2^(e - 22), lanes 8-15 1) and Q6_K's sums of x over its groups of 16 start */
static inline int64_t units_at(int64_t k) { return 3 * k / 4; }
static inline int64_t offsets_at(int64_t k) { return units_at(k) + k / 16; }
/* 2^p as a float, for -126 <= p <= 127 */
static inline float power_of_two(int p) {
    const uint32_t bits = (uint32_t)(p + 127) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
/* Each lane's sum of four codes (u8) times v (three digit planes at d: high, middle, low): exact */
static inline ivec digit_ints(ivec codes, const int8_t *d) {
    ivec acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512((const void *)d));
    acc = _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), codes, _mm512_loadu_si512((const void *)(d + 64)));
    return _mm512_dpbusd_epi32(_mm512_slli_epi32(acc, 8), codes, _mm512_loadu_si512((const void *)(d + 128)));
}
static inline vec digit_sums(ivec codes, const int8_t *d) { return vfloat(digit_ints(codes, d)); }
/* Block b's 32 inputs' place among the digits, in bytes: the 64-byte group the passes read them in
 * (Q4_K's and Q5_K's span_row: group 4 B + 2 span + h, the block's nibble h of span `span` of
 * super-block B, its half 32 c; Q6_K's q6_codes: quarter b / 2, in order) */
static inline int64_t digits_place(int kind, int64_t b) {
    if (kind == 11)
        return DIGIT_BYTES * (b / 2) + 32 * (b % 2);
    const int64_t B = b / SUPER, block = b % SUPER; /* block = 4 span + 2 c + h */
    return DIGIT_BYTES * (4 * B + 2 * (block / 4) + block % 2) + 32 * ((block % 4) / 2);
}
/* v's low byte as a signed digit, and what is left, (v - digit) / 2^8 (exact) */
static inline ivec low_digit(ivec v) { return _mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24); }
static inline ivec digits_above(ivec v, ivec digit) { return _mm512_srai_epi32(isub(v, digit), 8); }
/* One row of x (k floats) in digits for `kind`'s one-row passes, into out (ORDERED_FLOATS(k)): the
 * digits, the units, and the sums the minimums (Q4_K, Q5_K: per block of 32, at block_sums_at) or
 * the codes' -32 (Q6_K: per group of 16, at offsets_at) are multiplied by, each of x as the digits
 * hold it (an integer sum of v, converted once, times the unit). So every term reads the same x:
 * x rounded to its block's unit. 0 where x holds an infinity or a NaN: the float32 passes take it. */
static int x_digits(int kind, const float *x, int64_t k, float *out) {
    int8_t *digits = (int8_t *)out;
    float *units = out + units_at(k);
    for (int64_t b = 0; b < k / BLOCK; b++) {
        const vec a0 = vload(x + b * BLOCK), a1 = vload(x + b * BLOCK + 16);
        const vec m0 = _mm512_abs_ps(a0), m1 = _mm512_abs_ps(a1), finite = vset1(FLT_MAX);
        if (_mm512_cmp_ps_mask(m0, finite, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(m1, finite, _CMP_NLE_UQ))
            return 0; /* an infinity or a NaN (which vmaxps would pass over) */
        const float big = _mm512_reduce_max_ps(_mm512_max_ps(m0, m1));
        uint32_t bits;
        memcpy(&bits, &big, sizeof bits);
        const int field = (int)(bits >> 23);
        const int e = field - 126 < -100 ? -100 : field - 126; /* big < 2^e; tinier blocks share 2^-122 */
        const float unit = power_of_two(e - 22);
        const vec to = vset1(power_of_two(22 - e));
        int8_t *at = digits + digits_place(kind, b);
        ivec v[2];
#pragma GCC unroll 2
        for (int half = 0; half < 2; half++) { /* x * 2^(22 - e) is exact: a power of two */
            v[half] = _mm512_cvt_roundps_epi32(vmul(half ? a1 : a0, to), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const ivec low = low_digit(v[half]), rest = digits_above(v[half], low), middle = low_digit(rest);
            _mm_storeu_si128((__m128i *)(at + 16 * half), _mm512_cvtepi32_epi8(digits_above(rest, middle)));
            _mm_storeu_si128((__m128i *)(at + 64 + 16 * half), _mm512_cvtepi32_epi8(middle));
            _mm_storeu_si128((__m128i *)(at + 128 + 16 * half), _mm512_cvtepi32_epi8(low));
            if (kind == 11) /* a group of 16 */
                out[offsets_at(k) + 2 * b + half] = (float)_mm512_reduce_add_epi32(v[half]) * unit;
        }
        units[16 * (b / SUPER) + b % SUPER] = unit;
        units[16 * (b / SUPER) + SUPER + b % SUPER] = 1.0f;
        if (kind != 11) /* |sum| <= 2^27: exact in int32 */
            out[block_sums_at(k, 0) + b] = (float)_mm512_reduce_add_epi32(iadd(v[0], v[1])) * unit;
    }
    return 1;
}
#endif

/* W weight rows (1 or 2, `stride` bytes apart) of `supers` Q4_K (kind 9) or Q5_K (10) super-blocks
 * times R rows of x (1 or 2, k floats apart) in span_row's order (lane_ordered; their sums over
 * blocks of 32 at block_sums_at) -> y[r * ldy + o]; `digits`: one row of x in digits instead
 * (x_digits, R = 1). */
static inline __attribute__((always_inline)) void span_row(int kind, int R, int W, int digits, const float *x, int64_t k,
                                                           const uint8_t *row, int64_t stride, int64_t ahead, int64_t supers,
                                                           float *y, int64_t ldy) {
    const vec values = code_values(), above = vadd(code_values(), vset1(16.0f)); /* Q5_K's codes 16-31 */
    const int64_t bytes = bytes_of(kind), second = W == 2 ? stride : 0;
    vec total[2][2][2]; /* per weight row, row of x, nibble */
    __m256 minimums[2][2];
#pragma GCC unroll 2
    for (int o = 0; o < 2; o++)
#pragma GCC unroll 2
        for (int r = 0; r < 2; r++)
            total[o][r][0] = total[o][r][1] = vzero(), minimums[o][r] = _mm256_setzero_ps();
    vec scales[2], next[2] = {vzero(), vzero()}; /* the super-block's, the next one's (decoded a super-block ahead) */
    q4_k_scales_pair(row, row + second, scales);
    for (int64_t B = 0; B < supers; B++) {
        const uint8_t *sb = row + B * bytes;
#pragma GCC unroll 2
        for (int o = 0; o < W; o++)
#pragma GCC unroll 3
            for (int f = 0; f < bytes; f += LINE_BYTES)
                hint(sb + o * stride + ahead + f, NEAR_AHEAD(kind, R));
        if (B + 1 < supers)
            q4_k_scales_pair(sb + bytes, sb + second + bytes, next);
        const float *in = x + B * BLOCK * SUPER;
#if X_DIGITS
        if (digits) { /* one row of x in digits (x_digits): each span's codes times them, each sub-block's sums times d * scale * unit */
            const vec units = vload(x + units_at(k) + 16 * B); /* lanes 0-7 the sub-blocks' units (8-15, the minimums', unused) */
#pragma GCC unroll 2
            for (int span = 0; span < 2; span++)
#pragma GCC unroll 2
                for (int o = 0; o < W; o++) {
                    const uint8_t *at = sb + o * stride;
                    const ivec nibbles = _mm512_loadu_si512((const void *)(at + (kind == 9 ? 16 : 48) + 64 * span));
                    const ivec high = kind == 10 ? both_halves(at + 16) : nibbles;
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++) {
                        const ivec nibble = h ? _mm512_srli_epi32(nibbles, 4) : nibbles;
                        const ivec codes = kind == 9 ? iand(nibble, iset1(0x0f0f0f0f)) /* bit 4 its fifth bit, as above */
                                                     : iand(_mm512_ternarylogic_epi32(iset1(0x10101010), span_fifth(high, span, h), nibble, 0xca),
                                                            iset1(0x1f1f1f1f));
                        const vec scale = _mm512_permutexvar_ps(span_sub_blocks(span, h), vmul(scales[o], units));
                        total[o][0][h] = vfma(digit_sums(codes, (const int8_t *)x + DIGIT_BYTES * (4 * B + 2 * span + h)), scale, total[o][0][h]);
                    }
                }
        } else
#endif
#pragma GCC unroll 2
        for (int span = 0; span < 2; span++) {
            ivec codes[2][2] = {{_mm512_setzero_si512(), _mm512_setzero_si512()}, {_mm512_setzero_si512(), _mm512_setzero_si512()}};
            vec sum[2][2][2]; /* per weight row, row of x, nibble */
#pragma GCC unroll 2
            for (int o = 0; o < W; o++) { /* per nibble h, the codes with byte 4i + place's in byte place of lane i */
                const ivec nibbles = _mm512_loadu_si512((const void *)(sb + o * stride + (kind == 9 ? 16 : 48) + 64 * span));
                codes[o][0] = nibbles;
                if (kind == 10) { /* bit 4 of each byte its fifth bit (vpternlogd 0xca: the mask's bits pick the second's) */
                    const ivec high = both_halves(sb + o * stride + 16);
#pragma GCC unroll 2
                    for (int h = 0; h < 2; h++)
                        codes[o][h] = _mm512_ternarylogic_epi32(iset1(0x10101010), span_fifth(high, span, h),
                                                                h ? _mm512_srli_epi32(nibbles, 4) : nibbles, 0xca);
                }
            }
#pragma GCC unroll 8
            for (int u = 0; u < 8; u++) { /* u = 2 place + h */
                const int place = u / 2, h = u % 2;
#pragma GCC unroll 2
                for (int o = 0; o < W; o++) {
                    const ivec index = kind == 9 ? (u ? _mm512_srli_epi32(codes[o][0], 4 * u) : codes[o][0])
                                                 : place ? _mm512_srli_epi32(codes[o][h], 8 * place) : codes[o][h];
                    const vec w = kind == 9 ? _mm512_permutexvar_ps(index, values) /* reads the low 4 bits */
                                            : _mm512_permutex2var_ps(values, index, above); /* the low 5 */
#pragma GCC unroll 2
                    for (int r = 0; r < R; r++) {
                        const vec x_ = vload(in + r * k + 128 * span + 16 * u);
                        sum[o][r][h] = place == 0 ? vmul(w, x_) : vfma(w, x_, sum[o][r][h]);
                    }
                }
            }
#pragma GCC unroll 2
            for (int o = 0; o < W; o++)
#pragma GCC unroll 2
                for (int h = 0; h < 2; h++) {
                    const vec scale = _mm512_permutexvar_ps(span_sub_blocks(span, h), scales[o]);
#pragma GCC unroll 2
                    for (int r = 0; r < R; r++)
                        total[o][r][h] = vfma(sum[o][r][h], scale, total[o][r][h]);
                }
        }
#pragma GCC unroll 2
        for (int o = 0; o < W; o++)
#pragma GCC unroll 2
            for (int r = 0; r < R; r++)
                minimums[o][r] = _mm256_fmadd_ps(upper8(scales[o]), _mm256_loadu_ps(x + block_sums_at(k, r) + B * SUPER),
                                                 minimums[o][r]);
        scales[0] = next[0], scales[1] = next[1];
    }
#pragma GCC unroll 2
    for (int o = 0; o < W; o++)
#pragma GCC unroll 2
        for (int r = 0; r < R; r++)
            y[r * ldy + o] = vsum(vadd(total[o][r][0], total[o][r][1])) + sum8(minimums[o][r]);
}
#if X_DIGITS
/* One Q6_K weight row of `supers` super-blocks times one row of x in digits (x_digits) -> *y: per
 * quarter, the codes times v (integers, exact) times each group's d * scale * unit; the codes' -32
 * once a super-block, by x's sums over the groups. */
static inline __attribute__((always_inline)) void q6_digits_row(const float *x, int64_t k, const uint8_t *row, int64_t ahead,
                                                                int64_t supers, float *y) {
    const int8_t *digits = (const int8_t *)x;
    vec total = vzero(), offsets = vzero();
    for (int64_t B = 0; B < supers; B++) {
        const uint8_t *sb = row + B * Q6_K_BYTES;
#pragma GCC unroll 4
        for (int f = 0; f < Q6_K_BYTES; f += LINE_BYTES)
            hint(sb + ahead + f, NEAR_AHEAD(11, 1));
        /* d * scale (k_scales_of's), and times its block's unit (group g's: block g / 2's; exact) for the digits */
        const vec ds = vmul(vset1(half_at(sb + 208)), vfloat(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(sb + 192)))));
        const vec scales = vmul(ds, _mm512_permutexvar_ps(_mm512_srli_epi32(lane_index(), 1), vload(x + units_at(k) + 16 * B)));
        offsets = vfma(ds, vload(x + offsets_at(k) + 16 * B), offsets);
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) {
            const ivec codes = iand(q6_codes(sb, c), iset1(0x3f3f3f3f));
            total = vfma(digit_sums(codes, digits + DIGIT_BYTES * (4 * B + c)), _mm512_permutexvar_ps(quarter_groups(c), scales), total);
        }
    }
    *y = vsum(total) - 32.0f * vsum(offsets);
}
#endif
#else
#define SPAN_ROW(kind, R) 0
#define span_row(kind, R, W, digits, x, k, row, stride, ahead, supers, y, ldy) ((void)0)
#endif

/* Rows [0, R) of x (row stride ldx) times blocks [b0, b1) of W weight rows (1 or 2, `stride` bytes
 * apart) -> y[r * ldy + o], added to it if `add`: each block turned into weights in registers once for
 * the R rows, `chains` multiply-add chains per (row, weight row) (2 in the passes of up to ROWS rows,
 * 1 in the shared rebuilds). Each output's sums are the same, in the same order, for W = 1 and 2. */
static inline __attribute__((always_inline)) void pass(int kind, int R, int W, int chains, const float *x, int64_t ldx,
                                                       const uint8_t *row, int64_t stride, int64_t ahead, int64_t b0, int64_t b1,
                                                       float *y, int64_t ldy, int add) {
    vec acc[8][2], acc_b[8][2]; /* weight row 0's, weight row 1's (W = 2): two arrays the size a lone row's had, kept in registers */
#define ACC(r, o, c) (*((o) == 0 ? &acc[r][c] : &acc_b[r][c]))
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int o = 0; o < W; o++)
            ACC(r, o, 0) = ACC(r, o, 1) = vzero();
    /* a lone row of a K-quant: a second pair of chains, the pairs swapped after each block, so that
     * the multiply-add's latency does not bound it (the swap is a renaming: EACH_BLOCK unrolls the
     * sub-blocks). Its sums are then in another order than the wider passes' (within rounding). */
    const int pairs = R == 1 && chains == 2 && IS_SUPER(kind);
    vec spare[2][2] = {{vzero(), vzero()}, {vzero(), vzero()}};
#if defined(__AVX512F__)
    __m256 minimums[8][2]; /* MINIMUMS_APART: per (row, weight row), the minimums' terms in 8 lanes */
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
        minimums[r][0] = minimums[r][1] = _mm256_setzero_ps();
#define MINIMUMS(b, ks)                                                                    \
    if (MINIMUMS_APART(kind, R) && (b) % SUPER == 0)                                       \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                \
            _Pragma("GCC unroll 2") for (int o = 0; o < W; o++)                            \
                minimums[r][o] = _mm256_fmadd_ps(_mm256_loadu_ps((ks)[o].scale + 8),       \
                                                 _mm256_loadu_ps(x + block_sums_at(ldx, r) + (b)), minimums[r][o]);
#else
#define MINIMUMS(b, ks)
#endif
#define ACCUMULATE(b, w, ks)                                                               \
    MINIMUMS(b, ks)                                                                        \
    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                  \
        const float *in = x + r * ldx + (b) * BLOCK;                                       \
        _Pragma("GCC unroll 4") for (int j = 0; j < PER; j++) {                            \
            const vec x_ = vload(in + j * LANES);                                          \
            _Pragma("GCC unroll 2") for (int o = 0; o < W; o++)                            \
                ACC(r, o, j % chains) = vfma(x_, (w)[o][j], ACC(r, o, j % chains));          \
        }                                                                                  \
    }                                                                                      \
    if (pairs)                                                                             \
        _Pragma("GCC unroll 2") for (int o = 0; o < W; o++) {                              \
            const vec t0 = ACC(0, o, 0), t1 = ACC(0, o, 1);                                \
            ACC(0, o, 0) = spare[o][0], ACC(0, o, 1) = spare[o][1];                        \
            spare[o][0] = t0, spare[o][1] = t1;                                            \
        }
    EACH_BLOCK(kind, W, row, stride, ahead, NEAR_AHEAD(kind, R), b0, b1 - b0, R <= LANE_ROWS(kind), ACCUMULATE);
#undef ACCUMULATE
#undef MINIMUMS
#pragma GCC unroll 8
    for (int r = 0; r < R; r++)
#pragma GCC unroll 2
        for (int o = 0; o < W; o++) {
            if (pairs)
                ACC(0, o, 0) = vadd(ACC(0, o, 0), spare[o][0]), ACC(0, o, 1) = vadd(ACC(0, o, 1), spare[o][1]);
            float total = vsum(chains == 2 ? vadd(ACC(r, o, 0), ACC(r, o, 1)) : ACC(r, o, 0));
#if defined(__AVX512F__)
            if (MINIMUMS_APART(kind, R))
                total += sum8(minimums[r][o]);
#endif
            y[r * ldy + o] = add ? y[r * ldy + o] + total : total;
        }
}
#undef ACC

/* The narrow passes (up to ROWS rows of x) times a K-quant, on AVX-512: two weight rows a pass,
 * their blocks' rebuilds and multiply-adds interleaved and x's vectors loaded once for both, each
 * output summed as a lone weight row's pass sums it, bit for bit (past 2 rows, one chain per row
 * and weight row, alone or paired). The rebuilds' latencies then overlap, and at 3-8 rows x's
 * vectors, read from the second cache (8 rows of 2,048 floats outgrow the first), serve twice the
 * products. On a Zen 5 core a 1B model's Q4_K_M file's products took 0.69x the time at one and two
 * rows (with the scales decoded a super-block ahead; 0.84x without), 0.60-0.78x at 3-8; the other
 * kinds' took the same or longer at one row (Q5_0, Q8_0, BF16: 1.0-1.25x), and so did the AVX2
 * build's (16 registers: 1.05x at one row, 1.29x at two). */
#if defined(__AVX512F__)
#define PAIRED(kind) IS_SUPER(kind)
#else
#define PAIRED(kind) 0
#endif
/* Multiply-add chains per (row of x, weight row) in a narrow pass of R rows. */
#define NARROW_CHAINS(kind, R) (PAIRED(kind) && (R) > 2 ? 1 : 2)
#define NARROW(kind, R)                                                                                          \
    if (SPAN_ROW(kind, R))                                                                                       \
        span_row(kind, R, W_, 0, xr, k, row, row_bytes, ahead, blocks / SUPER, yr, ldy);                        \
    else if (W_ == 2)                                                                                            \
        pass(kind, R, 2, NARROW_CHAINS(kind, R), xr, k, row, row_bytes, ahead, 0, blocks, yr, ldy, 0);         \
    else                                                                                                         \
        pass(kind, R, 1, NARROW_CHAINS(kind, R), xr, k, row, 0, ahead, 0, blocks, yr, ldy, 0);

#if ROWS == 8
#define PASSES(kind) \
    case 1: NARROW(kind, 1) break; \
    case 2: NARROW(kind, 2) break; \
    case 3: NARROW(kind, 3) break; \
    case 4: NARROW(kind, 4) break; \
    case 5: NARROW(kind, 5) break; \
    case 6: NARROW(kind, 6) break; \
    case 7: NARROW(kind, 7) break; \
    default: NARROW(kind, 8) break;
#else
#define PASSES(kind) \
    case 1: NARROW(kind, 1) break; \
    case 2: NARROW(kind, 2) break; \
    case 3: NARROW(kind, 3) break; \
    default: NARROW(kind, 4) break;
#endif


/* Past ROWS rows and up to ONE_REBUILD_ROWS (AVX2 only: its passes take 4 rows), each block is
 * turned into weights in registers once for every row, with one accumulator per row (8 rows: 8
 * multiply-add chains, both FMA pipes busy), and x is read SPAN blocks at a time so those inputs of
 * every row stay in the core's first cache (8 x 768 floats, 24 KB) while the weight rows stream by.
 * On a Zen 3 core at 5-8 rows this beat the panels below, which write each block out and read it
 * back (6 and 8 rows: 0.90x; notebook/gguf-blocks.md, "In-register rebuilds for 5-8 rows"). Each output
 * sums its inputs lane by lane in order within a span, the spans added in order. */
#define ONE_REBUILD_ROWS 8
/* On AVX-512 (passes of 8 rows) too, for 7 and 8 rows, where a block's rebuild is cheap next to its
 * rows' products: then the inputs' reads from the second cache, not the rebuild, bound the passes.
 * On a Zen 5 core the 8-row products of a bf16 folder took 0.87x the time this way, of a Q8_0 file
 * 0.92x; 5 and 6 rows 1.02-1.03x; the K-quants' 8 rows 1.1-1.6x. */
#define CHEAP_REBUILD(kind) ((kind) == 1 || (kind) == 3 || (kind) == 4) /* Q8_0, F16, BF16 */
#ifndef SPAN
#define SPAN 24
#endif

#define SHARED_PASSES(kind) \
    case 5: pass(kind, 5, 1, 1, x, k, row, 0, 0, b0, b1, yr, ldy, b0 > 0); break; \
    case 6: pass(kind, 6, 1, 1, x, k, row, 0, 0, b0, b1, yr, ldy, b0 > 0); break; \
    case 7: pass(kind, 7, 1, 1, x, k, row, 0, 0, b0, b1, yr, ldy, b0 > 0); break; \
    default: pass(kind, 8, 1, 1, x, k, row, 0, 0, b0, b1, yr, ldy, b0 > 0); break;

/* y = x @ W^T for ROWS < m <= ONE_REBUILD_ROWS, a span of inputs at a time. */
#define SHARED_PRODUCT(kind)                                                                       \
    for (int64_t b0 = 0; b0 < blocks; b0 += SPAN) {                                                \
        const int64_t b1 = b0 + SPAN < blocks ? b0 + SPAN : blocks;                                \
        const int64_t skip = row_bytes_of(kind, b0 * BLOCK), span = row_bytes_of(kind, (b1 - b0) * BLOCK); \
        for (int64_t j = 0; j < n; j++) {                                                          \
            const uint8_t *row = w + j * row_bytes;                                                \
            if (j + AHEAD_ROWS < n)                                                                \
                fetch(row + AHEAD_ROWS * row_bytes + skip, span);                                  \
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
    case 1: panel_pass(1, O, xr, k, panel, k, yr, ldy); break; \
    case 2: panel_pass(2, O, xr, k, panel, k, yr, ldy); break; \
    case 3: panel_pass(3, O, xr, k, panel, k, yr, ldy); break; \
    case 4: panel_pass(4, O, xr, k, panel, k, yr, ldy); break; \
    case 5: panel_pass(5, O, xr, k, panel, k, yr, ldy); break; \
    case 6: panel_pass(6, O, xr, k, panel, k, yr, ldy); break; \
    case 7: panel_pass(7, O, xr, k, panel, k, yr, ldy); break; \
    default: panel_pass(8, O, xr, k, panel, k, yr, ldy); break;
#else
#define PANEL_PASSES(O) \
    case 1: panel_pass(1, O, xr, k, panel, k, yr, ldy); break; \
    case 2: panel_pass(2, O, xr, k, panel, k, yr, ldy); break; \
    case 3: panel_pass(3, O, xr, k, panel, k, yr, ldy); break; \
    default: panel_pass(4, O, xr, k, panel, k, yr, ldy); break;
#endif

/* Every row of x [m, k] times O weight rows written out in `panel` -> y[:, 0:O] (row stride ldy). */
static inline __attribute__((always_inline)) void panel_rows_of(int O, const float *x, int64_t m, int64_t k,
                                                                const float *panel, float *y, int64_t ldy) {
    for (int64_t r0 = 0; r0 < m; r0 += WIDE_ROWS) {
        const float *xr = x + r0 * k;
        float *yr = y + r0 * ldy;
        switch (m - r0) { PANEL_PASSES(O) }
    }
}

/* Floats of scratch a thread's run of a product of inner size k needs: a panel of weight rows. */
static int64_t run_scratch_floats(int64_t k) { return PANEL * k; }

/* Floats of scratch a product of inner size k needs (the caller's, one per thread): up to ROWS
 * rows of x in lane order and their blocks' sums (ORDERED_FLOATS), then the calling thread's run's. */
int64_t scratch_floats(int64_t k) { return ORDERED_FLOATS(k) + run_scratch_floats(k); }

/* y[m][0:n] = sum_c x[m][c] * W[n][c]; x: [m, k] contiguous float32 (in lane order where the
 * passes read the codes so, its blocks' sums beside it: THREADED, lane_ordered), y: m rows of
 * stride ldy (>= n: a product may fill some
 * columns of a wider output), W: n rows of k / 32 blocks (k / 256 super-blocks for the K-quants);
 * scratch: run_scratch_floats(k) floats. Up to ROWS rows: each weight
 * row is read from memory once and turned into weights in registers per pass (passes after the
 * first over more rows of x find it in the core's caches). Up to ONE_REBUILD_ROWS rows (AVX2): one
 * rebuild in registers for every row. More rows: PANEL weight rows at a time written out once into
 * the scratch, then multiplied by every row of x. */
#define PRODUCT(name, kind)                                                                        \
    static void name(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y, \
                     int64_t ldy, float *scratch) {                                                \
        const int64_t blocks = k / BLOCK, row_bytes = row_bytes_of(kind, k);                      \
        if (m <= ONE_REBUILD_ROWS && (ROWS < ONE_REBUILD_ROWS ? m > ROWS : CHEAP_REBUILD(kind) && m > 6)) { \
            SHARED_PRODUCT(kind)                                                                   \
            return;                                                                                \
        }                                                                                          \
        if (m > ROWS) {                                                                            \
            int64_t j = 0;                                                                         \
            for (; j + PANEL <= n; j += PANEL) {                                                   \
                if (j + 2 * PANEL <= n)                                                            \
                    fetch(w + (j + PANEL) * row_bytes, PANEL * row_bytes);                         \
                blocks_out(kind, w + j * row_bytes, 0, PANEL * blocks, scratch);                  \
                panel_rows_of(PANEL, x, m, k, scratch, y + j, ldy);                                \
            }                                                                                      \
            for (; j < n; j++) {                                                                   \
                blocks_out(kind, w + j * row_bytes, 0, blocks, scratch);                          \
                panel_rows_of(1, x, m, k, scratch, y + j, ldy);                                    \
            }                                                                                      \
            return;                                                                                \
        }                                                                                          \
        const int64_t ahead = rows_ahead(row_bytes) * row_bytes;                                   \
        for (int64_t j = 0; j < n;) {                                                              \
            const int W_ = PAIRED(kind) && j + 1 < n ? 2 : 1;                                    \
            const uint8_t *row = w + j * row_bytes;                                                \
            const float *xr = x; /* in lane order where the pass reads codes so (THREADED) */      \
            float *yr = y + j;                                                                     \
            switch (m) { PASSES(kind) }                                                            \
            j += W_;                                                                               \
        }                                                                                          \
    }


/* ---- Threads: one product split by weight rows (pool.h) --------------------------------------
 * A product's weight rows are cut into runs of whole panels (a few per thread), each multiplied by
 * the same code into its own columns of y. */
#include "pool.h"

typedef void (*rows_fn)(const float *, int64_t, int64_t, const uint8_t *, int64_t, float *, int64_t, float *);

#define MIN_SPLIT_ROWS 48 /* products of fewer weight rows run on the calling thread alone */
#define RUNS_PER_THREAD 4

struct product {
    rows_fn fn;
    const float *x;
    int64_t m, k, n, ldy, row_bytes;
    const uint8_t *w;
    float *y;
    int runs;
};

/* Weight rows [start, stop) of run `index`: `runs` near-equal runs, each a whole number of panels. */
static void run_bounds(int64_t n, int runs, int index, int64_t *start, int64_t *stop) {
    const int64_t panels = (n + PANEL - 1) / PANEL, per = panels / runs, extra = panels % runs;
    const int64_t first = index * per + (index < extra ? index : extra);
    const int64_t count = per + (index < extra);
    *start = first * PANEL < n ? first * PANEL : n;
    *stop = (first + count) * PANEL < n ? (first + count) * PANEL : n;
}

static void product_run(const void *job, int index, float *scratch) {
    const struct product *p = job;
    int64_t start, stop;
    run_bounds(p->n, p->runs, index, &start, &stop);
    if (stop > start)
        p->fn(p->x, p->m, p->k, p->w + start * p->row_bytes, stop - start, p->y + start, p->ldy, scratch);
}

static void split_product(rows_fn fn, const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y,
                          int64_t ldy, int64_t row_bytes, float *scratch) {
    const int64_t panels = (n + PANEL - 1) / PANEL;
    const int threads = pool_threads();
    const int64_t most = threads <= 1 || n < MIN_SPLIT_ROWS ? 1 : threads * RUNS_PER_THREAD;
    const struct product p = {fn, x, m, k, n, ldy, row_bytes, w, y, (int)(panels < most ? panels : most)};
    parallel(p.runs, product_run, &p, run_scratch_floats(k), scratch);
}

/* ---- A prefill's products: a GEMM on panels rebuilt from the blocks (AVX-512 builds) ----------
 * A forward of many rows (a prefill) is bound by its float32 multiply-adds, not by the blocks. The
 * rows of x are packed input-major, GEMM_ROWS at a time, once per product (on all threads, into the
 * caller's buffer). Each thread takes runs of weight rows, GEMM_BLOCK of them (output columns) at a
 * time, and GEMM_DEPTH inputs at a time: for each panel of GEMM_COLS weight rows it writes those
 * inputs' blocks out as float32 (blocks_out, the weights bit for bit) and turns them input-major in
 * 16 x 16 tiles; then every group of rows of x is multiplied by the run's panels in registers: 28
 * accumulators (GEMM_ROWS rows x two vectors of a panel's columns) gain a broadcast input times two
 * weight vectors per input, the BLIS micro-kernel's shape. The run's panels stay in the core's L2
 * while the groups pass, each group in L1 for its four tiles; the outputs gather in the thread's scratch, rows
 * GEMM_LD floats apart (a prefill's outputs are wide: rows of y 8-64 KB apart share the caches'
 * sets), and are copied into their columns of y once per run. No float32 tile of weights goes
 * through memory and each thread rebuilds its own rows. Each output sums its inputs in order, one
 * multiply-add chain per span of GEMM_DEPTH inputs, added to the earlier spans' sum: another
 * summation order than other BLAS kernels, so results agree with them to float32 rounding.
 * Measured against the tiles and oneDNN's GEMM: notebook/gguf-blocks.md, "A prefill on the
 * kernel's own GEMM". */
#if defined(__AVX512F__)
#define GEMM_DEPTH 256 /* inputs a panel holds: one K-quant super-block, 8 blocks of 32 */
#define GEMM_COLS 32   /* weight rows (output columns) a panel holds: two vectors */
#define GEMM_ROWS 14   /* rows of x a micro-kernel takes: 28 accumulators, 2 weight vectors, a broadcast */
#define GEMM_STRIDE 16 /* floats per input of a packed group of GEMM_ROWS rows (two unused: whole vectors) */
/* Output columns a thread takes at a time (a run, handed out one at a time, so a thread slowed by
 * another process's work leaves the rest to the others): 4 panels, 0.98x the time of runs of one
 * on one thread (a run's packed inputs serve more panels from L2), the same on two. */
#define GEMM_BLOCK 128
#define GEMM_LD (GEMM_BLOCK + 16) /* floats between the rows of the gathered outputs: 9 cache lines, not 8 */

#define GEMM_PANELS (GEMM_BLOCK / GEMM_COLS) /* panels of a run */

/* Floats of scratch a wide product of m rows needs on each thread: a panel as written out, a run's
 * panels input-major (128 KB, kept in L2 while every group of rows passes), then the run's outputs
 * (m rows of GEMM_LD). */
static int64_t gemm_scratch_floats(int64_t m) { return (1 + GEMM_PANELS) * GEMM_COLS * GEMM_DEPTH + m * GEMM_LD; }

/* Floats of the caller's buffer for x [m, k] packed (pack_group). */
int64_t gemm_packed_floats(int64_t m, int64_t k) { return (m + GEMM_ROWS - 1) / GEMM_ROWS * GEMM_STRIDE * k; }

/* r[i][j] -> r[j][i] for 16 vectors of 16: pairs, then quads, then 128-bit lanes exchanged. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
#define PD_ _mm512_castps_pd
#define PS_ _mm512_castpd_ps
#pragma GCC unroll 4
    for (int g = 0; g < 4; g++) { /* u[4 g + j], lane L: rows 4 g .. 4 g + 3 at column 4 L + j */
        u[4 * g] = PS_(_mm512_unpacklo_pd(PD_(t[4 * g]), PD_(t[4 * g + 2])));
        u[4 * g + 1] = PS_(_mm512_unpackhi_pd(PD_(t[4 * g]), PD_(t[4 * g + 2])));
        u[4 * g + 2] = PS_(_mm512_unpacklo_pd(PD_(t[4 * g + 1]), PD_(t[4 * g + 3])));
        u[4 * g + 3] = PS_(_mm512_unpackhi_pd(PD_(t[4 * g + 1]), PD_(t[4 * g + 3])));
    }
#undef PD_
#undef PS_
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++) {
        const __m512 v0 = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 v1 = _mm512_shuffle_f32x4(u[j], u[4 + j], _MM_SHUFFLE(3, 2, 3, 2));
        const __m512 v2 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(1, 0, 1, 0));
        const __m512 v3 = _mm512_shuffle_f32x4(u[8 + j], u[12 + j], _MM_SHUFFLE(3, 2, 3, 2));
        r[j] = _mm512_shuffle_f32x4(v0, v2, _MM_SHUFFLE(2, 0, 2, 0));
        r[4 + j] = _mm512_shuffle_f32x4(v0, v2, _MM_SHUFFLE(3, 1, 3, 1));
        r[8 + j] = _mm512_shuffle_f32x4(v1, v3, _MM_SHUFFLE(2, 0, 2, 0));
        r[12 + j] = _mm512_shuffle_f32x4(v1, v3, _MM_SHUFFLE(3, 1, 3, 1));
    }
}

/* x's rows of group g (GEMM_ROWS rows a group; x [m, k]) -> packed[g][c][GEMM_STRIDE]: the group's
 * rows side by side for each input c < k, zero past m. */
static void pack_group(const float *x, int64_t m, int64_t k, int64_t g, float *packed) {
    for (int64_t c = 0; c < k; c += 16) {
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            const int64_t row = g * GEMM_ROWS + i;
            r[i] = i < GEMM_ROWS && row < m ? _mm512_loadu_ps(x + row * k + c) : _mm512_setzero_ps();
        }
        transpose16(r);
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++)
            _mm512_storeu_ps(packed + (g * k + c + i) * GEMM_STRIDE, r[i]);
    }
}

/* panel[c][o] = weight row o (of `cols`; zero past them), input c0 + c, for c < depth, by way of
 * `rows` (the rows as written out, GEMM_DEPTH floats apart). */
static inline __attribute__((always_inline)) void panel_of(int kind, const uint8_t *w, int64_t row_bytes, int cols,
                                                           int64_t c0, int64_t depth, float *rows, float *panel) {
    for (int o = 0; o < cols; o++)
        blocks_out(kind, w + o * row_bytes, c0 / BLOCK, depth / BLOCK, rows + o * GEMM_DEPTH);
    for (int o = cols; o < GEMM_COLS; o++)
        memset(rows + o * GEMM_DEPTH, 0, depth * sizeof(float));
    for (int64_t c = 0; c < depth; c += 16)
        for (int o = 0; o < GEMM_COLS; o += 16) {
            __m512 r[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                r[i] = _mm512_loadu_ps(rows + (o + i) * GEMM_DEPTH + c);
            transpose16(r);
#pragma GCC unroll 16
            for (int i = 0; i < 16; i++)
                _mm512_storeu_ps(panel + (c + i) * GEMM_COLS + o, r[i]);
        }
}

/* Ask the caches for the blocks of the panel at column j of a run of `cols` weight rows from w
 * (past the last: the run's first panel at the next span of inputs): each panel reads a short
 * stretch of 32 rows far apart, which the hardware does not fetch ahead, and waited on memory for
 * each. */
static inline __attribute__((always_inline)) void fetch_panel(int kind, const uint8_t *w, int64_t row_bytes,
                                                              int64_t cols, int64_t j, int64_t c0, int64_t k) {
    if (j >= cols) {
        j = 0;
        c0 += GEMM_DEPTH;
        if (c0 >= k)
            return;
    }
    const int64_t depth = k - c0 < GEMM_DEPTH ? k - c0 : GEMM_DEPTH, rows = cols - j < GEMM_COLS ? cols - j : GEMM_COLS;
    const int64_t first = row_bytes_of(kind, c0), bytes = row_bytes_of(kind, c0 + depth) - first;
    for (int64_t o = 0; o < rows; o++)
        fetch(w + (j + o) * row_bytes + first, bytes);
}

/* y[0:R][0:32] (+)= a packed group's R rows times the panel, over `depth` inputs. add: the outputs
 * hold earlier inputs' sums. ahead: the next group's packed inputs (or NULL), asked of L2 one cache
 * line an input: a group's 16 KB span four pages that the hardware does not fetch across, and from
 * L3 the down projection's 8,192 inputs of 567 rows ran at 204 GFLOP/s, at 250 with them asked for
 * (notebook/gguf-blocks.md, "A run's panels before its rows"). */
static inline __attribute__((always_inline)) void gemm_tile(int R, const float *packed, const float *panel,
                                                            int64_t depth, float *y, int64_t ldy, int add,
                                                            const float *ahead) {
    __m512 acc[GEMM_ROWS][2];
#pragma GCC unroll 14
    for (int r = 0; r < R; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t c = 0; c < depth; c++) {
        const __m512 w0 = _mm512_loadu_ps(panel + c * GEMM_COLS), w1 = _mm512_loadu_ps(panel + c * GEMM_COLS + 16);
        if (ahead)
            _mm_prefetch((const char *)(ahead + c * GEMM_STRIDE), _MM_HINT_T1);
#pragma GCC unroll 14
        for (int r = 0; r < R; r++) {
            const __m512 in = _mm512_set1_ps(packed[c * GEMM_STRIDE + r]);
            acc[r][0] = _mm512_fmadd_ps(in, w0, acc[r][0]);
            acc[r][1] = _mm512_fmadd_ps(in, w1, acc[r][1]);
        }
    }
#pragma GCC unroll 14
    for (int r = 0; r < R; r++) {
        float *out = y + r * ldy;
        if (add) {
            acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_loadu_ps(out));
            acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_loadu_ps(out + 16));
        }
        _mm512_storeu_ps(out, acc[r][0]);
        _mm512_storeu_ps(out + 16, acc[r][1]);
    }
}

#define GEMM_TILE_CASE(R) case R: gemm_tile(R, packed, panel, depth, y, ldy, add, ahead); break;
static void gemm_tile_of(int R, const float *packed, const float *panel, int64_t depth, float *y, int64_t ldy,
                         int add, const float *ahead) {
    switch (R) {
        GEMM_TILE_CASE(1) GEMM_TILE_CASE(2) GEMM_TILE_CASE(3) GEMM_TILE_CASE(4) GEMM_TILE_CASE(5)
        GEMM_TILE_CASE(6) GEMM_TILE_CASE(7) GEMM_TILE_CASE(8) GEMM_TILE_CASE(9) GEMM_TILE_CASE(10)
        GEMM_TILE_CASE(11) GEMM_TILE_CASE(12) GEMM_TILE_CASE(13)
        default: gemm_tile(GEMM_ROWS, packed, panel, depth, y, ldy, add, ahead); break;
    }
}

/* y[m][0:n] = x [m, k] (packed by pack_group) times n <= GEMM_BLOCK weight rows of `kind` (as
 * PRODUCT's), on one thread. For each span of inputs the run's panels are rebuilt first, then each
 * group of rows meets all of them: a group's packed inputs (16 KB) stay in L1 for the run's four
 * tiles and the panels in L2, so L2 holds a fixed 128 KB of panels rather than the span's packed
 * rows for every row of x. On the 1B file's products at 256 rows (a causal piece) 0.97-0.98x the
 * time of a panel meeting every group in turn, the down projection's at 567 rows 0.92x
 * (notebook/gguf-blocks.md, "A run's panels before its rows"). */
#define WIDE_PRODUCT(name, kind)                                                                   \
    static void name(const float *packed, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y, \
                     int64_t ldy, float *scratch) {                                                \
        const int64_t row_bytes = row_bytes_of(kind, k), groups = (m + GEMM_ROWS - 1) / GEMM_ROWS; \
        const int64_t panel_floats = GEMM_COLS * GEMM_DEPTH;                                       \
        float *rows = scratch, *panels = rows + panel_floats, *out = panels + GEMM_PANELS * panel_floats; \
        for (int64_t c0 = 0; c0 < k; c0 += GEMM_DEPTH) {                                           \
            const int64_t depth = k - c0 < GEMM_DEPTH ? k - c0 : GEMM_DEPTH;                       \
            for (int64_t j = 0; j < n; j += GEMM_COLS) {                                           \
                const int here = n - j < GEMM_COLS ? (int)(n - j) : GEMM_COLS;                     \
                panel_of(kind, w + j * row_bytes, row_bytes, here, c0, depth, rows,                \
                         panels + j / GEMM_COLS * panel_floats);                                   \
                fetch_panel(kind, w, row_bytes, n, j + GEMM_COLS, c0, k);                          \
            }                                                                                      \
            for (int64_t g = 0; g < groups; g++) {                                                 \
                const int R = m - g * GEMM_ROWS < GEMM_ROWS ? (int)(m - g * GEMM_ROWS) : GEMM_ROWS; \
                const float *next = g + 1 < groups ? packed + ((g + 1) * k + c0) * GEMM_STRIDE     \
                                    : c0 + GEMM_DEPTH < k ? packed + (c0 + GEMM_DEPTH) * GEMM_STRIDE : NULL; \
                for (int64_t j = 0; j < n; j += GEMM_COLS)                                         \
                    gemm_tile_of(R, packed + (g * k + c0) * GEMM_STRIDE, panels + j / GEMM_COLS * panel_floats, \
                                 depth, out + g * GEMM_ROWS * GEMM_LD + j, GEMM_LD, c0 > 0, j == 0 ? next : NULL); \
            }                                                                                      \
        }                                                                                          \
        for (int64_t r = 0; r < m; r++)                                                            \
            memcpy(y + r * ldy, out + r * GEMM_LD, n * sizeof(float));                             \
    }

/* This thread's scratch of at least `floats` floats, kept for its next wide product (each thread of
 * the team its own). */
static __thread float *held_scratch;
static __thread int64_t held_floats;
static float *thread_scratch(int64_t floats) {
    if (held_floats < floats) {
        free(held_scratch);
        held_scratch = malloc(floats * sizeof(float));
        held_floats = held_scratch ? floats : 0;
    }
    return held_scratch;
}

/* 1 if wide products run on OpenMP's threads (a build with -fopenmp), else 0: they run on the calling
 * thread alone. */
int gemm_parallel(void) {
#if defined(_OPENMP)
    return 1;
#else
    return 0;
#endif
}

/* The wide product on torch's OpenMP threads: x packed into `packed` (gemm_packed_floats(m, k)),
 * then runs of GEMM_BLOCK weight rows handed out one at a time. Not on the pool: a prefill alternates its
 * products with torch's operations (norms, attention), and each hand-over of the cores from
 * OpenMP's threads, which spin a while after an operation, to the pool's cost a product of the
 * embedded model 1.2-1.3x its time on two threads; built with -fopenmp, this library binds the
 * libgomp.so.1 that torch loaded, so its parallel regions take the same threads as torch's
 * (notebook/gguf-blocks.md, "A prefill on the kernel's own GEMM"). Returns 0, or -1 where a
 * thread's scratch could not be allocated (y is then incomplete). */
#define WIDE_THREADED(name, rows, kind)                                                            \
    int name(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y,         \
             int64_t ldy, float *packed) {                                                         \
        const int64_t groups = (m + GEMM_ROWS - 1) / GEMM_ROWS, row_bytes = row_bytes_of(kind, k); \
        int failed = 0;                                                                            \
        _Pragma("omp parallel reduction(|: failed)")                                               \
        {                                                                                          \
            _Pragma("omp for schedule(static)")                                                    \
            for (int64_t g = 0; g < groups; g++)                                                   \
                pack_group(x, m, k, g, packed);                                                    \
            float *scratch = thread_scratch(gemm_scratch_floats(m));                               \
            _Pragma("omp for schedule(dynamic, 1)")                                                \
            for (int64_t start = 0; start < n; start += GEMM_BLOCK) {                              \
                const int64_t stop = start + GEMM_BLOCK < n ? start + GEMM_BLOCK : n;              \
                if (scratch == NULL)                                                               \
                    failed = 1;                                                                    \
                else                                                                               \
                    rows(packed, m, k, w + start * row_bytes, stop - start, y + start, ldy, scratch); \
            }                                                                                      \
        }                                                                                          \
        return failed ? -1 : 0;                                                                    \
    }
#define WIDE(prefix, kind) WIDE_PRODUCT(prefix##_wide_rows, kind) WIDE_THREADED(prefix##_wide, prefix##_wide_rows, kind)
#else
#define WIDE(prefix, kind)
#endif

/* out[n][k] = the weights, float32, computed as the products above compute them. */
#define DEQUANTIZE(name, kind)                                                                     \
    void name(const uint8_t *w, int64_t n, int64_t k, float *out) {                               \
        blocks_out(kind, w, 0, n * (k / BLOCK), out);                                              \
    }

/* 1 if the weights are `expected` ([n][k] float32) bit for bit, else 0: the check before a copy is
 * used, without writing the weights out. */
#define MATCHES(name, kind)                                                                        \
    int name(const uint8_t *w, int64_t n, int64_t k, const float *expected) {                     \
        float out[BLOCK * SUPER];                                                                  \
        const int64_t step = IS_SUPER(kind) ? SUPER : 1; /* a super-block at a time for K-quants */ \
        for (int64_t b = 0; b < n * (k / BLOCK); b += step) {                                      \
            blocks_out(kind, w, b, step, out);                                                     \
            if (memcmp(out, expected + b * BLOCK, step * BLOCK * sizeof(float)) != 0)              \
                return 0;                                                                          \
        }                                                                                          \
        return 1;                                                                                  \
    }

/* The product on the pool's threads, each on its run of weight rows (a lone run below MIN_SPLIT_ROWS),
 * x put in lane order first, once, where the passes read the codes so: done in each run, the copy
 * cost 2-6% of a 1B model's products at 4-8 rows on two threads (notebook/gguf-blocks.md). */
#define THREADED(name, rows, digits_rows, kind)                                                    \
    void name(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y,        \
              int64_t ldy, float *scratch) {                                                       \
        DIGITS_FIRST(digits_rows, kind)                                                            \
        const int ordered = LANE_ORDERED(kind) && m <= LANE_ROWS(kind);                            \
        if (ordered)                                                                               \
            lane_ordered(kind, x, m, k, k, scratch);                                               \
        split_product(rows, ordered ? scratch : x, m, k, w, n, y, ldy, row_bytes_of(kind, k), scratch + ORDERED_FLOATS(k)); \
    }

/* One row of x times a K-quant in digits (X_DIGITS: x_digits made once per product, on the calling
 * thread), one weight row a pass: Q4_K's and Q5_K's span_row, Q6_K's q6_digits_row. Not two, as the
 * float32 passes take them: on a Zen 5 core a 1B Q4_K_M file's one-row products took 0.88x the time
 * one row a pass at two threads, 1.00x at one (notebook/gguf-blocks.md, "x in three 8-bit digits,
 * in the kernel"). */
#if X_DIGITS
#define DIGITS_PRODUCT(name, kind)                                                                 \
    static void name(const float *x, int64_t m, int64_t k, const uint8_t *w, int64_t n, float *y, \
                     int64_t ldy, float *scratch) {                                                \
        (void)m, (void)scratch;                                                                    \
        const int64_t row_bytes = row_bytes_of(kind, k), ahead = rows_ahead(row_bytes) * row_bytes; \
        const int64_t supers = k / (BLOCK * SUPER);                                                \
        for (int64_t j = 0; j < n; j++) {                                                          \
            if (kind == 11)                                                                        \
                q6_digits_row(x, k, w + j * row_bytes, ahead, supers, y + j);                      \
            else                                                                                   \
                span_row(kind, 1, 1, 1, x, k, w + j * row_bytes, 0, ahead, supers, y + j, ldy);    \
        }                                                                                          \
    }
/* x in digits where the kind has a digits pass and x one row of finite numbers; else as before */
#define DIGITS_FIRST(digits_rows, kind)                                                            \
    if (DIGITS_KIND(kind) && m == 1 && x_digits(kind, x, k, scratch)) {                            \
        split_product(digits_rows, scratch, m, k, w, n, y, ldy, row_bytes_of(kind, k), scratch + ORDERED_FLOATS(k)); \
        return;                                                                                    \
    }
#else
#define DIGITS_PRODUCT(name, kind)
#define DIGITS_FIRST(digits_rows, kind)
#endif

/* 1 if a lone row of x times a K-quant reads x in digits (a build with X_DIGITS: x_digits), else 0. */
int digits_built(void) {
#if defined(X_DIGITS) && X_DIGITS
    return 1;
#else
    return 0;
#endif
}

/* Each kind's entry points: <kind>_gemm, <kind>_dequantize, <kind>_matches, and on AVX-512 <kind>_wide. */
#define KIND(prefix, kind) PRODUCT(prefix##_rows, kind) DIGITS_PRODUCT(prefix##_digits_rows, kind) \
    THREADED(prefix##_gemm, prefix##_rows, prefix##_digits_rows, kind) \
    DEQUANTIZE(prefix##_dequantize, kind) MATCHES(prefix##_matches, kind) WIDE(prefix, kind)

KIND(q4_1, 0)
KIND(q8_0, 1)
KIND(q4_0, 2)
KIND(f16, 3)
KIND(bf16, 4)
KIND(q5_0, 5)
KIND(q5_1, 6)
KIND(q2_k, 7)
KIND(q3_k, 8)
KIND(q4_k, 9)
KIND(q5_k, 10)
KIND(q6_k, 11)
