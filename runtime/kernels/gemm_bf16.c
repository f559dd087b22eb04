/* bf16 matrix products for CPUs with AVX512-BF16 (x @ W^T, fp32 accumulation).
 *
 * W is packed once as [N/16][K/2][16][2]: one 64-byte load holds a pair of k values for 16
 * output columns, so a broadcast pair of x values and one vdpbf16ps add to 16 outputs at once
 * while W is read front to back. Measured here against oneDNN's packed bf16 matmul on one core
 * (SmolLM2-135M projections): 2.3x at 1 row (weight streaming at ~22 GB/s instead of ~10),
 * 2.8x at 4 rows, 1.3x at 32 rows, 1.1x at 512.
 *
 * Output columns are split in blocks of two tiles across OpenMP threads (the same libgomp as
 * torch's, see build.py). K must be even; N need not be a multiple of 16 (packed W is padded
 * with zeros, stores are masked).
 *
 * act=1 (SwiGLU): W holds gate and up tiles alternately (cpu_gemm.pack_swiglu), so each block of
 * two tiles is 16 gate and the same 16 up columns, and the block stores silu(gate) * up: the MLP's
 * [M, 2I] intermediate is never written and the activation costs no extra pass or op.
 */
#include <immintrin.h>
#include <stdint.h>

#include "gemm_block.h"

static void rows_block(const uint16_t *x, const uint16_t *wp, const uint16_t *res, void *y, long M, long N, long K,
                       int out_f32, long t, int two, int act) {
    const long ts = 16 * K;
    const long out_cols = act ? N / 2 : N;
    for (long r = 0; r < M; r += ROWS) {
        const uint16_t *xr = x + r * K;
        const uint16_t *rr = res ? res + r * out_cols : 0;
        void *yr = out_f32 ? (void *)((float *)y + r * out_cols) : (void *)((uint16_t *)y + r * out_cols);
        long left = M - r;
        block_rows(xr, K, wp, ts, rr, yr, out_cols, N, K, out_f32, t, two, act, left >= ROWS ? ROWS : left);
    }
}

/* Output blocks [b0, b1) (two tiles each) of ps_gemm_bf16 on the calling thread, for
   decode_helpers.c, which shares a call's blocks between the caller and its helper threads (it
   is handed this function's address). Each block is the same code as in ps_gemm_bf16's loop, so
   a shared call gives its bits. */
void ps_bf16_blocks(const uint16_t *x, const uint16_t *wp, const uint16_t *res, void *y, long M, long N, long K,
                    int out_f32, int act, long b0, long b1) {
    const long tiles = (N + 15) / 16;
    for (long b = b0; b < b1; b++) rows_block(x, wp, res, y, M, N, K, out_f32, 2 * b, 2 * b + 1 < tiles, act);
}

/* y[M][N] = x[M][K] @ W^T (+ res[M][N]); y is bf16, or fp32 when out_f32. With act=1, N is the
   packed gate+up rows (a multiple of 32) and y is [M][N/2] = silu(gate) * up (+ res). */
int ps_gemm_bf16(const uint16_t *x, const uint16_t *wp, const uint16_t *res, void *y, long M, long N, long K,
                 int out_f32, int threads, int act) {
    if (K % 2 || M < 0 || N < 0 || (act && N % 32)) return -1;
    long tiles = (N + 15) / 16, blocks = (tiles + 1) / 2;
    /* Few rows: one pass over W per row block, each thread streaming its share of W. Many rows:
       the same split; each thread's weight block stays in its L2 across row blocks. */
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (long b = 0; b < blocks; b++) {
        long t = 2 * b;
        rows_block(x, wp, res, y, M, N, K, out_f32, t, t + 1 < tiles, act);
    }
    return 0;
}
