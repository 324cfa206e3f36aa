/* What the core's vector pipes retire: eight independent chains of one instruction, or of a mix, in
 * an unrolled loop, each timed and printed in units of one 512-bit float32 multiply-add (the "F"
 * row: 1.00). How notebook/gguf-blocks.md's "The same files on a Zen 4 core" read its core:
 *
 *     cc -O2 -march=native benchmarks/vector_pipes.c -o /tmp/vector_pipes && /tmp/vector_pipes
 *
 * F: vfmadd231ps zmm; P: vpermps zmm; S: vpsrlvd zmm; T: vpternlogd zmm; A: vaddps zmm; D: vdpbf16ps
 * zmm (needs AVX512_BF16); f: vfmadd231ps ymm; C: vcvtdq2ps zmm; W: vpmovzxbd zmm. "3F+2P+2S" is the
 * Q4_K one-row rebuild's mix for 32 weights (mdcli/backends/native/gguf_blocks.c, k_weights with
 * tables); "9F+C+W+T" an eight-row pass's for 16 weights (8 products, the bytes widened, masked,
 * converted and scaled), "9F+S+T+C" the same in lane order, "8F+P+S" by table. AVX-512 hosts only. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 50000000L
#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    __m512 a0, a1, a2, a3, a4, a5, a6, a7, p0, p1, p2, p3, p4, p5, p6, p7;
    __m512i s0, s1, s2, s3, s4, s5, s6, s7;
    __m256 y0, y1, y2, y3, y4, y5, y6, y7;
    const __m512 b = _mm512_set1_ps(1.0001f), c = _mm512_set1_ps(0.999f);
    const __m256 yb = _mm256_set1_ps(1.0001f), yc = _mm256_set1_ps(0.999f);
    const __m512i idx = _mm512_set1_epi32(3);
#define INIT(j) a##j = _mm512_set1_ps(j); p##j = a##j; s##j = _mm512_set1_epi32(j); y##j = _mm256_set1_ps(j);
    R8(INIT)
#define F(j) a##j = _mm512_fmadd_ps(a##j, b, c);
#define P(j) p##j = _mm512_permutexvar_ps(idx, p##j);
#define S(j) s##j = _mm512_srlv_epi32(s##j, idx);
#define T(j) s##j = _mm512_ternarylogic_epi32(s##j, idx, idx, 0xE4);
#define A(j) p##j = _mm512_add_ps(p##j, b);
#define D(j) p##j = _mm512_dpbf16_ps(p##j, (__m512bh)idx, (__m512bh)idx);
#define C(j) p##j = _mm512_cvtepi32_ps(_mm512_castps_si512(p##j));
#define W(j) s##j = _mm512_cvtepu8_epi32(_mm512_castsi512_si128(s##j));
#define f(j) y##j = _mm256_fmadd_ps(y##j, yb, yc);
#define SUM(j) sink += _mm512_cvtss_f32(a##j) + _mm512_cvtss_f32(p##j) + _mm512_cvtss_f32(_mm512_castsi512_ps(s##j)) + _mm256_cvtss_f32(y##j);
    float sink = 0;
    double unit = 0, t;
#define RUN(name, BODY)                                                         \
    t = now();                                                                  \
    for (long i = 0; i < N / 8; i++) { BODY }                                   \
    t = (now() - t) / N;                                                        \
    if (unit == 0) unit = t;                                                    \
    R8(SUM)                                                                     \
    printf("%-10s %.3f ns per group, %.2f 512-bit multiply-adds\n", name, t * 1e9, t / unit);
    RUN("F", R8(F))
    RUN("f", R8(f))
    RUN("P", R8(P))
    RUN("S", R8(S))
    RUN("T", R8(T))
    RUN("A", R8(A))
    RUN("D", R8(D))
    RUN("F+P", R8(F) R8(P))
    RUN("F+S", R8(F) R8(S))
    RUN("F+A", R8(F) R8(A))
    RUN("P+S", R8(P) R8(S))
    RUN("3F+2P+2S", R8(F) R8(P) R8(S) R8(F) R8(P) R8(S) R8(F))
    RUN("C", R8(C))
    RUN("W", R8(W))
    RUN("F+C", R8(F) R8(C))
    RUN("F+W", R8(F) R8(W))
    RUN("F+T", R8(F) R8(T))
#define EIGHT R8(F) R8(F) R8(F) R8(F) R8(F) R8(F) R8(F) R8(F)
    RUN("8F", EIGHT)
    RUN("9F+C+W+T", R8(F) R8(F) R8(F) R8(F) R8(C) R8(F) R8(F) R8(F) R8(F) R8(W) R8(F) R8(T))
    RUN("9F+S+T+C", R8(F) R8(F) R8(F) R8(F) R8(C) R8(F) R8(F) R8(F) R8(F) R8(S) R8(F) R8(T))
    RUN("8F+P+S", R8(F) R8(F) R8(F) R8(F) R8(P) R8(F) R8(F) R8(F) R8(F) R8(S))
    printf("(%g)\n", sink);
    return 0;
}
