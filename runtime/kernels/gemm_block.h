/* The register-blocked bf16 product both the matmul and prefill attention are built from.
 * W is packed as [tiles][K/2][16][2] (see gemm_bf16.c). */
#ifndef PHASESPLIT_GEMM_BLOCK_H
#define PHASESPLIT_GEMM_BLOCK_H
#include <immintrin.h>
#include <stdint.h>

#include "vec_math.h"

#ifndef ROWS
/* Rows of x per pass over a weight block: 2 tiles x ROWS accumulators. On a Zen 4 (AVX512-BF16,
   2026-12-07) 4 rows left `vdpbf16ps` waiting on its own results (8 chains); 8 made a 512-token
   prefill 1.32x faster (0.205 -> 0.155 s on 2 threads), 10-12 only 2-5 % more, and decode steps
   of 8-64 rows did not move. */
#define ROWS 8
#endif

static inline __m512bh pair(const uint16_t *x, long p) {
    return (__m512bh)_mm512_set1_epi32(((const int32_t *)x)[p]);
}

static inline void store(__m512 v, const uint16_t *res, void *y, long o, __mmask16 mask, int out_f32) {
    if (res) {
        __m256i r = _mm256_maskz_loadu_epi16(mask, res + o);
        v = _mm512_add_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(r), 16)));
    }
    if (out_f32)
        _mm512_mask_storeu_ps((float *)y + o, mask, v);
    else
        _mm256_mask_storeu_epi16((uint16_t *)y + o, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

static inline __mmask16 tile_mask(long n0, long N) {
    long left = N - n0;
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
}

/* M (<= ROWS) rows of x (row stride xs) against tiles t and t+1 of W packed with tile stride ts
 * (t+1 may be past the end: `two` == 0), over the first K inner elements; y and res have row
 * stride ys, N columns in all. */
static inline __attribute__((always_inline)) void block(const uint16_t *x, long xs, const uint16_t *wp, long ts,
                                                        const uint16_t *res, void *y, long ys, long N, long K,
                                                        int out_f32, long t, int two, int act, const int M) {
    const long kp = K / 2;
    const uint16_t *w0 = wp + t * ts, *w1 = w0 + ts;
    __m512 a0[ROWS], a1[ROWS];
    for (int m = 0; m < M; m++) a0[m] = a1[m] = _mm512_setzero_ps();
    if (two) {
        for (long p = 0; p < kp; p++) {
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + p * 32);
            __m512bh b1 = (__m512bh)_mm512_loadu_si512(w1 + p * 32);
            for (int m = 0; m < M; m++) {
                __m512bh xv = pair(x + m * xs, p);
                a0[m] = _mm512_dpbf16_ps(a0[m], b0, xv);
                a1[m] = _mm512_dpbf16_ps(a1[m], b1, xv);
            }
        }
    } else {
        /* one tile: split k in even/odd pairs so that two dependency chains run per row */
        long p = 0;
        for (; p + 2 <= kp; p += 2) {
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + p * 32);
            __m512bh b1 = (__m512bh)_mm512_loadu_si512(w0 + p * 32 + 32);
            for (int m = 0; m < M; m++) {
                a0[m] = _mm512_dpbf16_ps(a0[m], b0, pair(x + m * xs, p));
                a1[m] = _mm512_dpbf16_ps(a1[m], b1, pair(x + m * xs, p + 1));
            }
        }
        if (p < kp) {
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(w0 + p * 32);
            for (int m = 0; m < M; m++) a0[m] = _mm512_dpbf16_ps(a0[m], b0, pair(x + m * xs, p));
        }
        for (int m = 0; m < M; m++) {
            a0[m] = _mm512_add_ps(a0[m], a1[m]);
        }
    }
    if (act) { /* tiles t, t+1 = gate, up of output columns 8t..8t+15; y has N/2 columns */
        for (int m = 0; m < M; m++)
            store(_mm512_mul_ps(silu_ps(a0[m]), a1[m]), res, y, m * ys + t * 8, 0xffff, out_f32);
        return;
    }
    long n0 = t * 16;
    __mmask16 m0 = tile_mask(n0, N), m1 = tile_mask(n0 + 16, N);
    for (int m = 0; m < M; m++) {
        store(a0[m], res, y, m * ys + n0, m0, out_f32);
        if (two) store(a1[m], res, y, m * ys + n0 + 16, m1, out_f32);
    }
}

/* block() for any M <= ROWS: a constant M per call, so each case keeps its accumulators in
 * registers. */
static inline __attribute__((always_inline)) void block_rows(const uint16_t *x, long xs, const uint16_t *wp,
                                                             long ts, const uint16_t *res, void *y, long ys, long N,
                                                             long K, int out_f32, long t, int two, int act, long M) {
    switch (M) { /* only cases up to ROWS: block()'s accumulator arrays hold ROWS rows */
#if ROWS >= 8
    case 8: block(x, xs, wp, ts, res, y, ys, N, K, out_f32, t, two, act, 8); break;
    case 7: block(x, xs, wp, ts, res, y, ys, N, K, out_f32, t, two, act, 7); break;
#endif
#if ROWS >= 6
    case 6: block(x, xs, wp, ts, res, y, ys, N, K, out_f32, t, two, act, 6); break;
    case 5: block(x, xs, wp, ts, res, y, ys, N, K, out_f32, t, two, act, 5); break;
#endif
    case 4: block(x, xs, wp, ts, res, y, ys, N, K, out_f32, t, two, act, 4); break;
    case 3: block(x, xs, wp, ts, res, y, ys, N, K, out_f32, t, two, act, 3); break;
    case 2: block(x, xs, wp, ts, res, y, ys, N, K, out_f32, t, two, act, 2); break;
    default: block(x, xs, wp, ts, res, y, ys, N, K, out_f32, t, two, act, 1); break;
    }
}

#if ROWS > 8
#error "block_rows dispatches at most 8 rows"
#endif

#endif
