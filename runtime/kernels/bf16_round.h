/* fp32 <-> bf16 as torch converts (Tensor.float() widens exactly; Tensor.to(bfloat16) rounds to
 * nearest even), bit for bit but for NaNs: a NaN becomes 0x7fc0 here, as in torch's scalar code
 * (its vector code writes 0xffff; both are NaNs). For the C code that stands in for those
 * conversions (decode_step_bf16.c, quant_x16.c's bf16 matmul). vcvtneps2bf16 would flush
 * denormals, so the rounding is done in integers. AVX512F + BW, whatever the file's own flags. */
#ifndef PHASESPLIT_BF16_ROUND_H
#define PHASESPLIT_BF16_ROUND_H

#include <immintrin.h>
#include <stdint.h>

#define BF16_TARGET __attribute__((target("avx512f,avx512bw")))

static inline uint16_t bf16_round_one(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline BF16_TARGET void bf16_widen(const uint16_t *x, float *y, long n) {
    long i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(y + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(x + i))), 16)));
    for (; i < n; i++) {
        const uint32_t u = (uint32_t)x[i] << 16;
        __builtin_memcpy(y + i, &u, 4);
    }
}

static inline BF16_TARGET void bf16_narrow(const float *x, uint16_t *y, long n) {
    const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0x7fc0);
    long i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512i u = _mm512_castps_si512(v);
        __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias),
                                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
        r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
        _mm256_storeu_si256((__m256i *)(y + i), _mm512_cvtepi32_epi16(r));
    }
    for (; i < n; i++) y[i] = bf16_round_one(x[i]);
}

#endif
