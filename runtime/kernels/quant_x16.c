// GGUF block weights with 16 weight rows interleaved ("X16"), multiplied with AVX512-VNNI.
//
// Why: quant_gemm.c's kernel works one weight row at a time, and each 32-weight block costs ~15
// instructions (unpack, sign tricks, two multiply-add steps, a float conversion and a scale per
// block and row), so it is compute-bound wherever a weight serves more than one activation row,
// and for Q4 even at one: on a Zen 4 (2 threads, tests/bench/quant_kernel.py) SmolLM2's
// projections at 32 rows took 70-80 ms (Q8_0) in that layout and 23-27 packed, Q4_1 at one row
// 5.3-7.4 ms and 3.1-3.6 packed, where reading its 84 MB takes 2.1-3.1. Here one vpdpbusd
// multiplies 4 weights of 16 rows by 4 activation bytes broadcast to every lane, so a block of 16
// rows is 8 dot-product instructions for Q8_0 (16 for Q4_x, high and low nibbles) with the scale
// work shared by the 16 rows: about a sixth of the instructions per weight.
//
// The layout (cpu_quant.pack_x16 writes it; its bytes per weight are the GGUF file's): rows in
// tiles of 16; a tile holds its blocks in order, and block b of a tile is
//   Q8_0: 16 fp16 scales (row order), then 8 groups g of 16 rows x 4 bytes: weights 4g..4g+3 of
//         each row, each byte q ^ 0x80 (= q + 128, unsigned, for vpdpbusd's unsigned side);
//   Q4_1: 16 fp16 scales, 16 fp16 minimums, then 4 groups g of 16 rows x 4 bytes: bytes 4g..4g+3
//         of each row's 16 (low nibble: weight 4g+i, high nibble: weight 16+4g+i);
//   Q4_0: 16 fp16 scales, then the 4 groups as Q4_1.
// The activation rows are quantize_row's (quant_gemm.c): int8 blocks q, scales d, and each
// block's sum of q (exact, as a float). The +128 of Q8_0's weights and the -8 of Q4_0's are taken
// out in the integer sum, which starts at -128 (-8) times the activation block's sum; so each
// block's dot product is exact, and a block adds dw * d * dot (+ Q4_1's m * d * sum), the
// arithmetic of quant_gemm.c's row_dot in another order of additions.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "quant_blocks.h"

#define X16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")))

// Whether this CPU runs the X16 kernel (the caller packs weights only then).
int ps_qx16_supported(void) {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

static inline X16_TARGET __m512i bcast4(const int8_t *y) {
  int32_t v;
  memcpy(&v, y, 4);
  return _mm512_set1_epi32(v);
}

// R activation rows (stride k bytes in q, nb in d and s) against the 16 rows of one tile: acc[r]
// lane c is row r's dot with weight row c of the tile. Inlined with constant type and R.
static inline X16_TARGET __attribute__((always_inline)) void x16_rows(const int type, const int R,
                                                                      const uint8_t *tile, long nb,
                                                                      const int8_t *q, const float *d,
                                                                      const float *s, long k, __m512 *acc) {
  const long tb = 16 * block_bytes(type);
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
  for (long b = 0; b < nb; b++) {
    const uint8_t *blk = tile + b * tb;
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
    if (type == T_Q8_0) {
      __m512i w[8];
      for (int g = 0; g < 8; g++) w[g] = _mm512_loadu_si512((const void *)(blk + 32 + 64 * g));
      for (int r = 0; r < R; r++) {
        const int8_t *y = q + r * k + b * QK;
        // two chains of four: the dot products of a block need not wait on each other
        __m512i i0 = _mm512_set1_epi32(-128 * (int)s[r * nb + b]), i1 = _mm512_setzero_si512();
        for (int g = 0; g < 8; g += 2) {
          i0 = _mm512_dpbusd_epi32(i0, w[g], bcast4(y + 4 * g));
          i1 = _mm512_dpbusd_epi32(i1, w[g + 1], bcast4(y + 4 * g + 4));
        }
        const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(d[r * nb + b])), f, acc[r]);
      }
    } else {
      const uint8_t *nib = blk + (type == T_Q4_1 ? 64 : 32);
      __m512i lo[4], hi[4];
      for (int g = 0; g < 4; g++) {
        const __m512i v = _mm512_loadu_si512((const void *)(nib + 64 * g));
        lo[g] = _mm512_and_si512(v, low4);
        hi[g] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
      }
      const __m512 mw = type == T_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)))
                                       : _mm512_setzero_ps();
      for (int r = 0; r < R; r++) {
        const int8_t *y = q + r * k + b * QK;
        const float sum = s[r * nb + b], dy = d[r * nb + b];
        __m512i i0 = type == T_Q4_0 ? _mm512_set1_epi32(-8 * (int)sum) : _mm512_setzero_si512();
        __m512i i1 = _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
          i0 = _mm512_dpbusd_epi32(i0, lo[g], bcast4(y + 4 * g));
          i1 = _mm512_dpbusd_epi32(i1, hi[g], bcast4(y + 16 + 4 * g));
        }
        const __m512 f = _mm512_cvtepi32_ps(_mm512_add_epi32(i0, i1));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dw, _mm512_set1_ps(dy)), f, acc[r]);
        if (type == T_Q4_1) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(dy * sum), acc[r]);
      }
    }
  }
}

static inline X16_TARGET __attribute__((always_inline)) void x16_tile(const int type, const uint8_t *tile, long j0,
                                                                      long m, long n, long k, const int8_t *q,
                                                                      const float *d, const float *s,
                                                                      const float *residual, float *out) {
  const long nb = k / QK;
  __m512 acc[4];
  for (long i = 0; i < m; i += 4) {
    const long left = m - i;
    const int8_t *qi = q + i * k;
    const float *di = d + i * nb, *si = s + i * nb;
    int rows;
    if (left >= 4) { x16_rows(type, 4, tile, nb, qi, di, si, k, acc); rows = 4; }
    else if (left == 3) { x16_rows(type, 3, tile, nb, qi, di, si, k, acc); rows = 3; }
    else if (left == 2) { x16_rows(type, 2, tile, nb, qi, di, si, k, acc); rows = 2; }
    else { x16_rows(type, 1, tile, nb, qi, di, si, k, acc); rows = 1; }
    for (int r = 0; r < rows; r++) {
      const long o = (i + r) * n + j0;
      __m512 v = acc[r];
      if (residual) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + o));
      _mm512_storeu_ps(out + o, v);
    }
  }
}

// Tiles [t0, t1) of 16 output columns each (`type` the GGUF type; w the packed weight, n % 16 == 0).
X16_TARGET void ps_qx16_tiles(int type, const uint8_t *w, long t0, long t1, long m, long n, long k,
                              const int8_t *q, const float *d, const float *s, const float *residual, float *out) {
  const long tile_bytes = 16 * (k / QK) * block_bytes(type);
  for (long t = t0; t < t1; t++) {
    const uint8_t *tile = w + t * tile_bytes;
    if (type == T_Q8_0) x16_tile(T_Q8_0, tile, t * 16, m, n, k, q, d, s, residual, out);
    else if (type == T_Q4_1) x16_tile(T_Q4_1, tile, t * 16, m, n, k, q, d, s, residual, out);
    else x16_tile(T_Q4_0, tile, t * 16, m, n, k, q, d, s, residual, out);
  }
}

// Block b of a packed tile back to the 16 rows' GGUF blocks (out: 16 blocks, block_bytes apart),
// for the dequantizing path (quant_gemm.c's ps_qdequant).
void ps_qx16_unpack_block(int type, const uint8_t *tile, long b, uint8_t *out) {
  const long bb = block_bytes(type);
  const uint8_t *blk = tile + b * 16 * bb;
  const int scales = type == T_Q4_1 ? 2 : 1, groups = type == T_Q8_0 ? 8 : 4;
  const uint8_t *vals = blk + 32 * scales;
  for (int r = 0; r < 16; r++) {
    uint8_t *o = out + r * bb;
    for (int c = 0; c < scales; c++) memcpy(o + 2 * c, blk + 32 * c + 2 * r, 2);
    for (int g = 0; g < groups; g++)
      for (int i = 0; i < 4; i++) {
        const uint8_t v = vals[64 * g + 4 * r + i];
        o[2 * scales + 4 * g + i] = type == T_Q8_0 ? (uint8_t)(v ^ 0x80) : v;
      }
  }
}
