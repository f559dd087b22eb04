/* RoPE applied in place to the Q and K heads of a fused qkv activation, and the new K and V rows
 * written to their cache slots, in one call per layer (rotate-half layout, as Hugging Face's Llama).
 * The torch path spends about a dozen ops on this per layer (slices, roll, multiplies, two row
 * scatters), which at decode sizes cost more in dispatch than in arithmetic.
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "vec_math.h"

/* qkv: [M, heads + 2*kv_heads, dim] bf16, contiguous; cos, sin: [M, dim/2] float32 (per position);
 * slots: [M] int64 (negative: do not write); caches: [slots, kv_heads, dim] bf16. */
int ps_rope_write_bf16(uint16_t *qkv, long M, long heads, long kv_heads, long dim, const float *cos,
                       const float *sin, const int64_t *slots, uint16_t *k_cache, uint16_t *v_cache, int threads) {
    const long half = dim / 2;
    if (dim % 32) return -1;
    const long row = (heads + 2 * kv_heads) * dim;
#pragma omp parallel for num_threads(threads) if (threads > 1 && M >= 64) schedule(static)
    for (long m = 0; m < M; m++) {
        uint16_t *r = qkv + m * row;
        for (long h = 0; h < heads + kv_heads; h++) {
            uint16_t *p = r + h * dim;
            for (long i = 0; i < half; i += 16) {
                __m512 c = _mm512_loadu_ps(cos + m * half + i), s = _mm512_loadu_ps(sin + m * half + i);
                __m512 x1 = bf16_to_f32(_mm256_loadu_si256((const __m256i *)(p + i)));
                __m512 x2 = bf16_to_f32(_mm256_loadu_si256((const __m256i *)(p + half + i)));
                __m512 o1 = _mm512_fmsub_ps(x1, c, _mm512_mul_ps(x2, s));
                __m512 o2 = _mm512_fmadd_ps(x2, c, _mm512_mul_ps(x1, s));
                _mm256_storeu_si256((__m256i *)(p + i), (__m256i)_mm512_cvtneps_pbh(o1));
                _mm256_storeu_si256((__m256i *)(p + half + i), (__m256i)_mm512_cvtneps_pbh(o2));
            }
        }
        if (slots[m] >= 0) {
            memcpy(k_cache + slots[m] * kv_heads * dim, r + heads * dim, kv_heads * dim * 2);
            memcpy(v_cache + slots[m] * kv_heads * dim, r + (heads + kv_heads) * dim, kv_heads * dim * 2);
        }
    }
    return 0;
}
