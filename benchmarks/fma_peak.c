/* The core's float32 multiply-add peak, as the kernels' instructions reach it: twelve independent
 * vector multiply-add chains (more than the FMA pipes' latency x width on any x86-64 core mdcli
 * builds for), nothing else in the loop. Built by benchmarks/branch_step.py with the flags the
 * block and attention kernels get on this host (mdcli.backends.native.build.X86_FLAGS).
 *
 * fma_peak_flops(vectors) runs `vectors` multiply-adds (rounded down to a multiple of 12) and
 * returns the float32 FLOPs they did; the caller times the call. */
#include <immintrin.h>
#include <stdint.h>

#if defined(__AVX512F__)
#define LANES 16
typedef __m512 vec;
#define vset1 _mm512_set1_ps
#define vfma _mm512_fmadd_ps
static inline float first(vec v) { return _mm512_cvtss_f32(v); }
#else
#define LANES 8
typedef __m256 vec;
#define vset1 _mm256_set1_ps
#define vfma _mm256_fmadd_ps
static inline float first(vec v) { return _mm256_cvtss_f32(v); }
#endif

#define CHAINS 12

volatile float fma_peak_sink; /* the chains' result is kept, so the loop cannot be dropped */

int64_t fma_peak_flops(int64_t vectors) {
    vec acc[CHAINS];
    for (int i = 0; i < CHAINS; i++)
        acc[i] = vset1(0.001f * (float)i);
    const vec scale = vset1(0.999f), shift = vset1(0.0001f);
    const int64_t rounds = vectors / CHAINS;
    for (int64_t n = 0; n < rounds; n++) {
#pragma GCC unroll 12
        for (int i = 0; i < CHAINS; i++)
            acc[i] = vfma(acc[i], scale, shift);
    }
    float total = 0.0f;
    for (int i = 0; i < CHAINS; i++)
        total += first(acc[i]);
    fma_peak_sink = total;
    return rounds * CHAINS * LANES * 2;
}
