/* RMSNorm of bf16 rows in one call: y = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w), the rounding
 * Hugging Face's LlamaRMSNorm does in bf16, with the sum of squares in float32. In torch the same
 * takes eight ops per call; at decode sizes their dispatch costs more than the arithmetic.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

#include "vec_math.h"

static inline __m512 round_bf16(__m512 v) {
    return bf16_to_f32((__m256i)_mm512_cvtneps_pbh(v));
}

int ps_rms_norm_bf16(const uint16_t *x, const uint16_t *w, uint16_t *y, long M, long K, float eps, int threads) {
    if (K % 16) return -1;
#pragma omp parallel for num_threads(threads) if (threads > 1 && M >= 64) schedule(static)
    for (long m = 0; m < M; m++) {
        const uint16_t *xr = x + m * K;
        __m512 ss = _mm512_setzero_ps();
        for (long k = 0; k < K; k += 16) {
            __m512 v = bf16_to_f32(_mm256_loadu_si256((const __m256i *)(xr + k)));
            ss = _mm512_fmadd_ps(v, v, ss);
        }
        __m512 r = _mm512_set1_ps(1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)K + eps));
        for (long k = 0; k < K; k += 16) {
            __m512 v = round_bf16(_mm512_mul_ps(bf16_to_f32(_mm256_loadu_si256((const __m256i *)(xr + k))), r));
            __m512 g = bf16_to_f32(_mm256_loadu_si256((const __m256i *)(w + k)));
            _mm256_storeu_si256((__m256i *)(y + m * K + k), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(v, g)));
        }
    }
    return 0;
}
