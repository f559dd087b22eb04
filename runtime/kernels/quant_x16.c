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
#include <stdlib.h>
#include <string.h>

#include "bf16_round.h"
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

// Activation rows x tiles per pass: 4 x 2 keeps 8 integer sums, 8 fp32 sums and the two tiles'
// current weights in registers, and each 4-byte broadcast of an activation feeds two vpdpbusd
// (one tile: one), the block's scale work covering 32 columns. One core, a 3072 x 576 Q8_0 weight
// in cache, 32-256 rows: 4 x 1 (the layout's first kernel) 267-275 GMAC/s, 4 x 2 358-378,
// 4 x 3 362-377, 2 x 4 239-244; 8 x 1 as 4 x 1. (dot_peak.c: vpdpbusd's own peak here is ~560.)
#define XR 4
#define XT X16_PASS

// R activation rows (stride k bytes in q, nb in d and s) against T tiles of 16 weight rows each
// (`stride` bytes apart): acc[r * T + t] lane c is row r's dot with weight row c of tile t; `next`
// (or NULL): T tiles at `stride` whose blocks b with b % pf_step == pf_phase are prefetched.
// Inlined with constant type, R, T.
static inline X16_TARGET __attribute__((always_inline)) void x16_rows(const int type, const int R, const int T,
                                                                      const uint8_t *tile, long stride,
                                                                      long nb, const int8_t *q, const float *d,
                                                                      const float *s, long k, __m512 *acc,
                                                                      const uint8_t *next, long pf_phase,
                                                                      long pf_step) {
  const long bb = 16 * block_bytes(type);
  const long vals = type == T_Q4_1 ? 64 : 32;  // the 16 rows' fp16 header values come first
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  for (int i = 0; i < R * T; i++) acc[i] = _mm512_setzero_ps();
  for (long b = 0; b < nb; b++) {
    __m512 dw[XT], mw[XT];
    if (next && b % pf_step == pf_phase)  // the block's 16 rows, a few cache lines
      for (int t = 0; t < T; t++)
        for (long o = 0; o < bb; o += 64) _mm_prefetch((const char *)(next + t * stride + b * bb + o), _MM_HINT_T0);
    for (int t = 0; t < T; t++) {
      const uint8_t *blk = tile + t * stride + b * bb;
      dw[t] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
      mw[t] = type == T_Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32))) : _mm512_setzero_ps();
    }
    __m512i iv[XR * XT];
    for (int r = 0; r < R; r++) {
      // The weights' unsigned offset, taken out of the integer sum at its start.
      const int sum = (int)s[r * nb + b];
      const __m512i init = _mm512_set1_epi32(type == T_Q8_0 ? -128 * sum : type == T_Q4_0 ? -8 * sum : 0);
      for (int t = 0; t < T; t++) iv[r * T + t] = init;
    }
    // Eight groups of 4 weights per row: Q8_0's bytes 4g..4g+3; Q4_x's low nibbles of bytes
    // 4g..4g+3 (weights 4g..) for g < 4, then their high nibbles (weights 16 + 4(g - 4)..).
    for (int g = 0; g < 8; g++) {
      __m512i wv[XT];
      for (int t = 0; t < T; t++) {
        const uint8_t *blk = tile + t * stride + b * bb;
        if (type == T_Q8_0) {
          wv[t] = _mm512_loadu_si512((const void *)(blk + 32 + 64 * g));
        } else {
          const __m512i v = _mm512_loadu_si512((const void *)(blk + vals + 64 * (g & 3)));
          wv[t] = _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), low4);
        }
      }
      const long off = type == T_Q8_0 ? 4 * g : g < 4 ? 4 * g : 16 + 4 * (g - 4);
      for (int r = 0; r < R; r++) {
        const __m512i y = bcast4(q + r * k + b * QK + off);
        for (int t = 0; t < T; t++) iv[r * T + t] = _mm512_dpbusd_epi32(iv[r * T + t], wv[t], y);
      }
    }
    for (int r = 0; r < R; r++) {
      const float dy = d[r * nb + b];
      for (int t = 0; t < T; t++) {
        const int i = r * T + t;
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw[t], _mm512_set1_ps(dy)), _mm512_cvtepi32_ps(iv[i]), acc[i]);
        if (type == T_Q4_1) acc[i] = _mm512_fmadd_ps(mw[t], _mm512_set1_ps(dy * s[r * nb + b]), acc[i]);
      }
    }
  }
}

// T tiles (T == XT, or 1 for a last odd tile; `stride` bytes apart), all m rows, XR at a time:
// out[r * ldo + 16 * t + c] = the sums of row r with weight row c of tile t (+ the same element of
// `residual`, which may be `out`). `next`: the next call's T tiles, prefetched while these run, so
// that streaming the weights overlaps the products (decode steps of 8-32 rows, where each tile
// is read from memory once), block b during row group b % groups. 2 threads, Q8_0: all blocks
// during the first group gave 1.5x at 8 rows and 1.1x at 32 over no prefetch (a 30 MB weight);
// shared out over the groups, 1.7x and 1.2x more (a 120 MB one): fewer prefetches in flight at once.
static inline X16_TARGET __attribute__((always_inline)) void x16_tiles(const int type, const int T,
                                                                       const uint8_t *tile, long stride,
                                                                       const uint8_t *next, long m, long k,
                                                                       const int8_t *q, const float *d,
                                                                       const float *s, const float *residual,
                                                                       float *out, long ldo) {
  const long nb = k / QK;
  __m512 acc[XR * XT];
  for (long i = 0; i < m; i += XR) {
    const long left = m - i;
    const int8_t *qi = q + i * k;
    const float *di = d + i * nb, *si = s + i * nb;
    const int rows = left >= XR ? XR : (int)left;
    // the next tiles' blocks shared out over the row groups, so few prefetches are in flight at once
    const long groups = (m + XR - 1) / XR, gi = i / XR;
    switch (rows) {
      case 4: x16_rows(type, 4, T, tile, stride, nb, qi, di, si, k, acc, next, gi, groups); break;
      case 3: x16_rows(type, 3, T, tile, stride, nb, qi, di, si, k, acc, next, gi, groups); break;
      case 2: x16_rows(type, 2, T, tile, stride, nb, qi, di, si, k, acc, next, gi, groups); break;
      default: x16_rows(type, 1, T, tile, stride, nb, qi, di, si, k, acc, next, gi, groups); break;
    }
    for (int r = 0; r < rows; r++)
      for (int t = 0; t < T; t++) {
        const long o = (i + r) * ldo + 16 * t;
        __m512 v = acc[r * T + t];
        if (residual) v = _mm512_add_ps(v, _mm512_loadu_ps(residual + o));
        _mm512_storeu_ps(out + o, v);
      }
  }
}

// x16_tiles with the type and T (XT or 1) as constants, whatever the caller's: a T known only at
// run time would leave the sums in arrays on the stack (a store and reload per product).
static inline X16_TARGET __attribute__((always_inline)) void x16_unit(int type, int T, const uint8_t *tile,
                                                                      long stride, const uint8_t *next, long mb,
                                                                      long k, const int8_t *q, const float *d,
                                                                      const float *s, const float *res, float *y,
                                                                      long ldo) {
  if (type == T_Q8_0) {
    if (T == XT) x16_tiles(T_Q8_0, XT, tile, stride, next, mb, k, q, d, s, res, y, ldo);
    else x16_tiles(T_Q8_0, 1, tile, stride, next, mb, k, q, d, s, res, y, ldo);
  } else if (type == T_Q4_1) {
    if (T == XT) x16_tiles(T_Q4_1, XT, tile, stride, next, mb, k, q, d, s, res, y, ldo);
    else x16_tiles(T_Q4_1, 1, tile, stride, next, mb, k, q, d, s, res, y, ldo);
  } else {
    if (T == XT) x16_tiles(T_Q4_0, XT, tile, stride, next, mb, k, q, d, s, res, y, ldo);
    else x16_tiles(T_Q4_0, 1, tile, stride, next, mb, k, q, d, s, res, y, ldo);
  }
}

// Tiles [t0, t1) of 16 output columns each, XT at a time (`type` the GGUF type; w the packed
// weight, n % 16 == 0; out and residual [m, n]).
X16_TARGET void ps_qx16_tiles(int type, const uint8_t *w, long t0, long t1, long m, long n, long k,
                              const int8_t *q, const float *d, const float *s, const float *residual, float *out) {
  const long tb = 16 * (k / QK) * block_bytes(type);
  for (long t = t0; t < t1;) {
    const int T = t + XT <= t1 ? XT : 1;
    const uint8_t *tile = w + t * tb, *next = tile + T * tb;
    x16_unit(type, T, tile, tb, next, m, k, q, d, s, residual ? residual + 16 * t : NULL, out + 16 * t, n);
    t += T;
  }
}

int ps_q_args_ok(long m, long n, long k, long row_bytes, int type);
void ps_q_quantize_row_bf16(const uint16_t *x, long i, long k, int8_t *q, float *d, float *s);
int8_t *ps_q_rows_alloc(long m, long k, float **d, float **s);
typedef int (*swiglu_fn)(const float *gu, float *y, long m, long inter);

// out [m, n] bf16 = x [m, k] bf16 @ W^T (+ residual [m, n] bf16), W packed (type X16 + the GGUF
// type); with `swiglu` (layer_f32_avx2.c's ps_swiglu_f32; no residual) W holds gate rows then
// up rows and out [m, n/2] = swiglu(gate, up).
//
// Why: cpu_quant.matmul on bf16 activations widened x (and the residual) with torch, kept fp32
// sums of [m, n] and rounded them with torch, plus a separate SwiGLU over [m, n] fp32 for the MLP:
// passes over prefill-sized arrays that cost as much as a third of the products. Here each
// thread widens, multiplies, applies SwiGLU and rounds one unit of columns (two tiles; or with
// `swiglu` a gate tile and its up tile) for Q_ROW_BLOCK rows at a time, in its own cache. The
// arithmetic is that path's, element for element, so the same bits: exact widening, the same
// kernel, the residual added to the fp32 sum, ps_swiglu_f32's per-element SwiGLU, torch's
// rounding (bf16_round.h).
// Returns 0, -1 for arguments it does not take, -2 when out of memory, or swiglu's code.
X16_TARGET int ps_qx16_gemm_bf16(const uint16_t *x, const uint8_t *w, const uint16_t *residual, uint16_t *out,
                                 long m, long n, long k, int type, swiglu_fn swiglu, int threads) {
  const int base = type - X16;
  if (type <= X16 || threads < 1 || !ps_q_args_ok(m, n, k, (k / QK) * block_bytes(base), type)) return -1;
  const long inter = n / 2;
  if (swiglu && (residual || inter % 16)) return -1;
  const long nb = k / QK, tb = 16 * nb * block_bytes(base), tiles = n / 16;
  const long units = swiglu ? inter / 16 : (tiles + XT - 1) / XT;
  float *d, *s;
  int8_t *q = ps_q_rows_alloc(m, k, &d, &s);
  if (!q) return -2;
  int rc = 0;
#pragma omp parallel num_threads(threads)
  {
    float y[Q_ROW_BLOCK * 16 * XT], z[Q_ROW_BLOCK * 16];  // 24 KB: this thread's unit, in L1/L2
#pragma omp for schedule(static)
    for (long i = 0; i < m; i++) ps_q_quantize_row_bf16(x, i, k, q, d, s);
    for (long i0 = 0; i0 < m; i0 += Q_ROW_BLOCK) {
      const long mb = m - i0 < Q_ROW_BLOCK ? m - i0 : Q_ROW_BLOCK;
      const int8_t *qi = q + i0 * k;
      const float *di = d + i0 * nb, *si = s + i0 * nb;
#pragma omp for schedule(static) nowait
      for (long u = 0; u < units; u++) {
        if (swiglu) {
          // gate tile u and up tile inter / 16 + u, as one unit of two tiles
          const uint8_t *tile = w + u * tb;
          x16_unit(base, XT, tile, (inter / 16) * tb, tile + tb, mb, k, qi, di, si, NULL, y, 32);
          // a row at a time: ps_swiglu_f32 opens a parallel region of its own from 128 rows on
          for (long r = 0; r < mb; r++) {
            const int e = swiglu(y + r * 32, z + r * 16, 1, 16);
            if (e) {
#pragma omp atomic write
              rc = e;
            }
          }
          for (long r = 0; r < mb; r++) bf16_narrow(z + r * 16, out + (i0 + r) * inter + 16 * u, 16);
          continue;
        }
        const long t = u * XT;
        const int T = t + XT <= tiles ? XT : 1;
        const long cols = 16 * T;
        const uint8_t *tile = w + t * tb;
        if (residual)
          for (long r = 0; r < mb; r++) bf16_widen(residual + (i0 + r) * n + 16 * t, y + r * cols, cols);
        x16_unit(base, T, tile, tb, tile + T * tb, mb, k, qi, di, si, residual ? y : NULL, y, cols);
        for (long r = 0; r < mb; r++) bf16_narrow(y + r * cols, out + (i0 + r) * n + 16 * t, cols);
      }
    }
  }
  free(q);
  return rc;
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
