// out[M, N] = x[M, K] (fp32) @ W^T (+ residual), W kept in GGUF's block formats: Q8_0, Q4_0, Q4_1.
//
// Decode streams every weight once per token, so bytes per weight decide its speed: 1.06 (Q8_0),
// 0.56 (Q4_0) or 0.63 (Q4_1) instead of 4 (fp32) or 2 (bf16). The blocks are never expanded in
// memory: each 32-weight block is unpacked into one 256-bit register and multiplied there.
//
// As in llama.cpp's ggml, the activation rows are quantized once per call to 8-bit blocks of 32
// (scale d = max|x| / 127) so that a block's dot product is integer work: vpmaddubsw multiplies
// unsigned by signed bytes and adds pairs into 16-bit lanes, vpmaddwd adds pairs again into
// 32-bit lanes, and one fused multiply-add applies the product of the two blocks' scales.
//   Q4_x weights are 0..15 (unsigned), so they go straight into vpmaddubsw's unsigned side; their
//   offset (Q4_1's m, Q4_0's -8 d) multiplies the activation block's sum, which is precomputed
//   per block (s = sum(q), exact as a float), so it costs one scalar multiply-add per block.
//   Q8_0 weights are signed: |w| goes on the unsigned side and the activation takes w's sign
//   (vpsignb), which leaves each product unchanged.
// Products stay exact in 16 bits: 127 * 127 * 2 and 15 * 127 * 2 are below 32767.
//
// Work is split over output columns (weight rows) in tiles of TILE_N rows; within a tile the
// activation rows are taken four at a time, so each unpacked weight block serves four rows and
// the tile's weights and the four activation rows stay in L1.
//
// Weights packed 16 rows to a tile (types X16 + the GGUF type, cpu_quant.pack_x16) go to
// quant_x16.c's AVX512-VNNI kernel instead; this file quantizes their activations and
// dequantizes them for the wide calls all the same.
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16_round.h"
#include "quant_blocks.h"

#define TILE_N 16
// Bytes ahead of the block being read to prefetch: a weight row's blocks are read in order, rows
// one after another. Measured here (30 layers' Q8_0 matmuls at one row, 143 MB, A/B twice on a
// noisy host): one thread 17-19 -> 14.4-14.5 ms, shared with a helper 11.2-12.7 -> 10.9-11.7 ms.
#define Q_PREFETCH 2048

static inline float f16_at(const uint8_t *p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

static inline float hsum_ps(__m256 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  a = _mm_add_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

static inline float hmax_ps(__m256 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  a = _mm_max_ss(a, _mm_movehdup_ps(a));
  return _mm_cvtss_f32(a);
}

static inline int hsum_epi32(__m256i v) {
  __m128i a = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0x4e));
  a = _mm_add_epi32(a, _mm_shuffle_epi32(a, 0xb1));
  return _mm_cvtsi128_si32(a);
}

// One activation block (32 values) -> int8 q, its scale d and sum(q) (for the Q4 offsets, and the
// X16 kernel's unsigned weights).
static inline void quantize_block(const float *xb, int8_t *q, float *d, float *s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256 v0 = _mm256_loadu_ps(xb), v1 = _mm256_loadu_ps(xb + 8);
  __m256 v2 = _mm256_loadu_ps(xb + 16), v3 = _mm256_loadu_ps(xb + 24);
  __m256 amax = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1)),
                              _mm256_max_ps(_mm256_andnot_ps(sign, v2), _mm256_andnot_ps(sign, v3)));
  const float mx = hmax_ps(amax);
  const float db = mx / 127.0f;
  const __m256 inv = _mm256_set1_ps(mx > 0.0f ? 127.0f / mx : 0.0f);
  // Round to nearest (the default MXCSR mode), as ggml does.
  __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(v0, inv)), i1 = _mm256_cvtps_epi32(_mm256_mul_ps(v1, inv));
  __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(v2, inv)), i3 = _mm256_cvtps_epi32(_mm256_mul_ps(v3, inv));
  const int sum = hsum_epi32(_mm256_add_epi32(_mm256_add_epi32(i0, i1), _mm256_add_epi32(i2, i3)));
  // The packs work per 128-bit lane; the permute puts the 4-byte groups back in order.
  __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
  _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(p, order));
  *d = db;
  *s = (float)sum;
}

static void quantize_row(const float *x, long k, int8_t *q, float *d, float *s) {
  for (long b = 0; b < k / QK; b++) quantize_block(x + b * QK, q + b * QK, d + b, s + b);
}

// The same from bf16 values, widened exactly (so the same bits as quantize_row on x.float()).
static void quantize_row_bf16(const uint16_t *x, long k, int8_t *q, float *d, float *s) {
  float xb[QK];
  for (long b = 0; b < k / QK; b++) {
    bf16_widen(x + b * QK, xb, QK);  // AVX512: only quant_x16.c's bf16 matmul calls this
    quantize_block(xb, q + b * QK, d + b, s + b);
  }
}

// Dot products of one weight row (nb blocks of `type`) with R activation rows (stride k bytes
// in q, nb in d and s). Inlined with constant type and R, so the branches fold away.
static inline __attribute__((always_inline)) void row_dot(const int type, const int R, const uint8_t *w,
                                                          long nb, const int8_t *q, const float *d,
                                                          const float *s, long k, float *res) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  float offs[4] = {0, 0, 0, 0};
  for (long b = 0; b < nb; b++) {
    __m256i wv;
    float dw, mw = 0.0f;
    if (type == T_Q8_0) {
      const uint8_t *blk = w + b * 34;
      _mm_prefetch((const char *)blk + Q_PREFETCH, _MM_HINT_T0);
      dw = f16_at(blk);
      wv = _mm256_loadu_si256((const __m256i *)(blk + 2));
    } else {
      const uint8_t *blk = w + b * (type == T_Q4_1 ? 20 : 18);
      const uint8_t *nib = blk + (type == T_Q4_1 ? 4 : 2);
      _mm_prefetch((const char *)blk + Q_PREFETCH, _MM_HINT_T0);
      dw = f16_at(blk);
      mw = type == T_Q4_1 ? f16_at(blk + 2) : -8.0f * dw;
      // Byte j holds weight j (low nibble) and weight j + 16 (high nibble).
      const __m128i t = _mm_loadu_si128((const __m128i *)nib);
      wv = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), low4);
    }
    const __m256i wu = type == T_Q8_0 ? _mm256_sign_epi8(wv, wv) : wv;
    for (int r = 0; r < R; r++) {
      __m256i y = _mm256_loadu_si256((const __m256i *)(q + r * k + b * QK));
      if (type == T_Q8_0) y = _mm256_sign_epi8(y, wv);
      const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(wu, y), ones));
      acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * d[r * nb + b]), dot, acc[r]);
      if (type != T_Q8_0) offs[r] += mw * (d[r * nb + b] * s[r * nb + b]);
    }
  }
  for (int r = 0; r < R; r++) res[r] = hsum_ps(acc[r]) + offs[r];
}

static inline __attribute__((always_inline)) void tile(const int type, const uint8_t *w, long row_bytes,
                                                       long j0, long j1, long m, long n, long k,
                                                       const int8_t *q, const float *d, const float *s,
                                                       const float *residual, float *out) {
  const long nb = k / QK;
  float res[4];
  for (long i = 0; i < m; i += 4) {
    const long left = m - i;
    const int8_t *qi = q + i * k;
    const float *di = d + i * nb, *si = s + i * nb;
    for (long j = j0; j < j1; j++) {
      const uint8_t *wr = w + j * row_bytes;
      int rows;
      if (left >= 4) { row_dot(type, 4, wr, nb, qi, di, si, k, res); rows = 4; }
      else if (left == 3) { row_dot(type, 3, wr, nb, qi, di, si, k, res); rows = 3; }
      else if (left == 2) { row_dot(type, 2, wr, nb, qi, di, si, k, res); rows = 2; }
      else { row_dot(type, 1, wr, nb, qi, di, si, k, res); rows = 1; }
      for (int r = 0; r < rows; r++) {
        const long o = (i + r) * n + j;
        out[o] = residual ? res[r] + residual[o] : res[r];
      }
    }
  }
}

// The two halves of ps_qgemm on one thread, for decode_helpers.c, which shares a call's tiles
// between the caller and its helper threads: the activation rows quantized once (by the
// caller), then any range of tiles [t0, t1) by whoever claims it. Each output column is computed
// by the same row_dot whoever runs it, so a shared call gives ps_qgemm's bits.
void ps_q_quantize_rows(const float *x, long m, long k, int8_t *q, float *d, float *s) {
  const long nb = k / QK;
  for (long i = 0; i < m; i++) quantize_row(x + i * k, k, q + i * k, d + i * nb, s + i * nb);
}

// Row i of bf16 x [m, k] quantized, for quant_x16.c's bf16 matmul (inside its parallel region).
void ps_q_quantize_row_bf16(const uint16_t *x, long i, long k, int8_t *q, float *d, float *s) {
  const long nb = k / QK;
  quantize_row_bf16(x + i * k, k, q + i * k, d + i * nb, s + i * nb);
}

void ps_qx16_tiles(int type, const uint8_t *w, long t0, long t1, long m, long n, long k, const int8_t *q,
                   const float *d, const float *s, const float *residual, float *out);
void ps_qx16_unpack_block(int type, const uint8_t *tile, long b, uint8_t *out);

void ps_q_tiles(int type, const uint8_t *w, long row_bytes, long t0, long t1, long m, long n, long k,
                const int8_t *q, const float *d, const float *s, const float *residual, float *out) {
  if (type > X16) {
    ps_qx16_tiles(type - X16, w, t0, t1, m, n, k, q, d, s, residual, out);
    return;
  }
  for (long t = t0; t < t1; t++) {
    const long j0 = t * TILE_N, j1 = j0 + TILE_N < n ? j0 + TILE_N : n;
    if (type == T_Q8_0) tile(T_Q8_0, w, row_bytes, j0, j1, m, n, k, q, d, s, residual, out);
    else if (type == T_Q4_1) tile(T_Q4_1, w, row_bytes, j0, j1, m, n, k, q, d, s, residual, out);
    else tile(T_Q4_0, w, row_bytes, j0, j1, m, n, k, q, d, s, residual, out);
  }
}

// Whether ps_qgemm takes these arguments (its checks, for decode_helpers.c's shared call). Packed
// weights come in whole tiles of 16 rows with no gap between rows.
int ps_q_args_ok(long m, long n, long k, long row_bytes, int type) {
  const long bb = block_bytes(type);
  if (type > X16 && (n % 16 || row_bytes != (k / QK) * bb)) return 0;
  return bb != 0 && m >= 1 && n >= 1 && k >= QK && k % QK == 0 && row_bytes >= (k / QK) * bb;
}

// The activation rows' int8 copy q [m, k] with its blocks' scales d and sums s [m, k/32], in one
// allocation (free q alone); NULL when out of memory.
int8_t *ps_q_rows_alloc(long m, long k, float **d, float **s) {
  const long nb = k / QK, qbytes = (m * k + 63) / 64 * 64;
  int8_t *q = malloc((size_t)qbytes + sizeof(float) * (size_t)(2 * m * nb));
  if (!q) return NULL;
  *d = (float *)(q + qbytes);
  *s = *d + m * nb;
  return q;
}

// x [m, k] fp32, w [n rows of k/32 blocks, row_bytes apart], residual [m, n] or NULL, out [m, n].
// Returns 0, -1 for arguments the kernel does not take, -2 when out of memory.
int ps_qgemm(const float *x, const uint8_t *w, const float *residual, float *out, long m, long n, long k,
             long row_bytes, int type, int threads) {
  if (!ps_q_args_ok(m, n, k, row_bytes, type) || threads < 1) return -1;
  const long nb = k / QK;
  float *d, *s;
  int8_t *q = ps_q_rows_alloc(m, k, &d, &s);
  if (!q) return -2;
  const long tiles = (n + TILE_N - 1) / TILE_N;
  const long per = type > X16 ? X16_PASS : 1;
  // One parallel region for both loops: a decode step of a few dozen rows makes ~120 of these
  // calls, and each region's start and end (a futex wake with passive waits) cost more than
  // quantizing the rows.
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (long i = 0; i < m; i++) quantize_row(x + i * k, k, q + i * k, d + i * nb, s + i * nb);
    for (long i0 = 0; i0 < m; i0 += Q_ROW_BLOCK) {
      const long mb = m - i0 < Q_ROW_BLOCK ? m - i0 : Q_ROW_BLOCK;
#pragma omp for schedule(static) nowait
      for (long u = 0; u < (tiles + per - 1) / per; u++)
        ps_q_tiles(type, w, row_bytes, u * per, u * per + per < tiles ? u * per + per : tiles, mb, n, k, q + i0 * k,
                   d + i0 * nb, s + i0 * nb, residual ? residual + i0 * n : NULL, out + i0 * n);
    }
  }
  free(q);
  return 0;
}

// One GGUF block -> its 32 fp32 weights.
static inline void dequant_block(int type, const uint8_t *blk, float *o) {
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  __m256i v;
  float dw = f16_at(blk), mw = 0.0f;
  if (type == T_Q8_0) {
    v = _mm256_loadu_si256((const __m256i *)(blk + 2));
  } else {
    const __m128i t = _mm_loadu_si128((const __m128i *)(blk + (type == T_Q4_1 ? 4 : 2)));
    v = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), low4);
    mw = type == T_Q4_1 ? f16_at(blk + 2) : -8.0f * dw;
  }
  const __m256 d = _mm256_set1_ps(dw), m = _mm256_set1_ps(mw);
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  __m256i parts[4];
  if (type == T_Q8_0) {
    parts[0] = _mm256_cvtepi8_epi32(lo);
    parts[1] = _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8));
    parts[2] = _mm256_cvtepi8_epi32(hi);
    parts[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8));
  } else {
    parts[0] = _mm256_cvtepu8_epi32(lo);
    parts[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
    parts[2] = _mm256_cvtepu8_epi32(hi);
    parts[3] = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
  }
  for (int p = 0; p < 4; p++) _mm256_storeu_ps(o + 8 * p, _mm256_fmadd_ps(_mm256_cvtepi32_ps(parts[p]), d, m));
}

// Blocks -> fp32 rows w_out [n, k]: for many activation rows (prefill chunks) a dense fp32 matmul
// (oneDNN/MKL, 8 multiply-adds per instruction) beats the row layout's integer path, whose
// per-block scaling costs about as many instructions as its products; dequantizing a layer's
// weight once per call is then a small share of the call. (Packed weights are dequantized only
// when a caller asks: their kernel beats this at every row count, see cpu_quant.DENSE_ROWS.)
int ps_qdequant(const uint8_t *w, float *w_out, long n, long k, long row_bytes, int type, int threads) {
  if (!ps_q_args_ok(1, n, k, row_bytes, type) || threads < 1) return -1;
  const long nb = k / QK;
  if (type > X16) {
    // A packed tile's block back to the 16 rows' GGUF blocks (small, in L1), then as below.
    const int base = type - X16;
    const long bb = block_bytes(base);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (long t = 0; t < n / 16; t++) {
      uint8_t rows[16 * 34];
      const uint8_t *tile = w + t * 16 * row_bytes;
      for (long b = 0; b < nb; b++) {
        ps_qx16_unpack_block(base, tile, b, rows);
        for (int r = 0; r < 16; r++) dequant_block(base, rows + r * bb, w_out + (t * 16 + r) * k + b * QK);
      }
    }
    return 0;
  }
  const long bb = block_bytes(type);
#pragma omp parallel for schedule(static) num_threads(threads)
  for (long j = 0; j < n; j++) {
    const uint8_t *wr = w + j * row_bytes;
    float *o = w_out + j * k;
    for (long b = 0; b < nb; b++) dequant_block(type, wr + b * bb, o + b * QK);
  }
  return 0;
}
