/* x @ W^T with bf16 weights and fp32 activations, for CPUs with AVX2 + FMA but no AVX512-BF16.
 *
 * A decode step streams every weight once per token, so on such a CPU the fp32 model reads
 * 4 bytes per weight (torch's fp32 matmul at one row reached ~7 GB/s of a model that does not fit
 * the caches, measured here). Keeping W in bf16 halves the bytes; each bf16 is widened to fp32
 * in a register, which is exact: a bf16 is the top half of an fp32.
 *
 * W is packed as gemm_bf16.c packs it, [N/16][K/2][16][2]: a 32-byte load holds the pair
 * (w[c][k], w[c][k+1]) of 8 output columns c in its 32-bit lanes, so a shift left by 16 gives
 * the 8 weights of k and a mask of the low halves gives those of k+1, each then one FMA with a
 * broadcast x[k] or x[k+1] into fp32 sums. Activations, sums and outputs are fp32; results
 * differ from F.linear on the bf16-rounded weight only by summation order.
 *
 * Output columns are split in blocks of two tiles (32 columns) across OpenMP threads (the same
 * libgomp as torch's, see build.py); each block takes the rows two at a time, so its K * 64
 * bytes of W stay in L2 across row pairs. K must be even; N need not be a multiple of 16.
 *
 * act=1 (SwiGLU): W holds gate and up tiles alternately (cpu_gemm.pack_swiglu), and each block
 * stores silu(gate) * up for its 16 columns: the [M, 2I] intermediate is never written.
 */
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

/* Rows of x per pass over a weight block: 4 sums per row in registers. Two measured best here
   (three or four spill; one re-reads W per row). */
#define ROWS 2

/* Bytes ahead of the current weight line to prefetch: one line per 64 bytes read, into the next
   tile (and the next weight: the tiled weights lie one after another, kernels/hugepages.py) at a
   tile's end. With it one thread streamed a decode step's 269 MB of SmolLM2 weights at 12.5 GB/s
   instead of 10.3 (torch.sum's read: 13.5; 768: 12.2, 1536: 11.7, 4096: 10.7; measured here). */
#define PREFETCH 1024

/* Sums of R (<= ROWS) rows of x (row stride xs) with one 16-column tile w of K inner elements:
   s[r][0] holds columns 0-7, s[r][1] columns 8-15. Every row gets the same four sums (even and
   odd k of each half: four FMA chains in flight even for one row, so latency does not bound a
   decode step) added in the same order, so a row's result does not depend on the other rows of
   the call: a request's tokens do not change with what it is batched with. */
static inline __attribute__((always_inline)) void tile_dot(const float *x, long xs, const uint16_t *w, long K,
                                                           __m256 s[ROWS][2], const int R) {
    const long kp = K / 2;
    const __m256i high = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a[ROWS][4];
    for (int r = 0; r < R; r++) a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
    for (long p = 0; p < kp; p++) {
        _mm_prefetch((const char *)(w + p * 32) + PREFETCH, _MM_HINT_T0);
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w + p * 32));
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w + p * 32 + 16));
        const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(v0, 16));
        const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(v0, high));
        const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(v1, 16));
        const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(v1, high));
        for (int r = 0; r < R; r++) {
            const __m256 xe = _mm256_broadcast_ss(x + r * xs + 2 * p);
            const __m256 xo = _mm256_broadcast_ss(x + r * xs + 2 * p + 1);
            a[r][0] = _mm256_fmadd_ps(e0, xe, a[r][0]);
            a[r][1] = _mm256_fmadd_ps(o0, xo, a[r][1]);
            a[r][2] = _mm256_fmadd_ps(e1, xe, a[r][2]);
            a[r][3] = _mm256_fmadd_ps(o1, xo, a[r][3]);
        }
    }
    for (int r = 0; r < R; r++) {
        s[r][0] = _mm256_add_ps(a[r][0], a[r][1]);
        s[r][1] = _mm256_add_ps(a[r][2], a[r][3]);
    }
}

/* Columns [n0, n0 + 16) of R rows (only those below `cols`), plus the residual if given. */
static inline void put(__m256 s[ROWS][2], const float *res, float *y, long ys, long n0, long cols, int R) {
    float buf[16];
    const long c = cols - n0 < 16 ? cols - n0 : 16;
    for (int r = 0; r < R; r++) {
        float *yr = y + r * ys + n0;
        const float *rr = res ? res + r * ys + n0 : 0;
        if (c == 16) {
            __m256 v0 = s[r][0], v1 = s[r][1];
            if (rr) {
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(rr));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(rr + 8));
            }
            _mm256_storeu_ps(yr, v0);
            _mm256_storeu_ps(yr + 8, v1);
        } else {
            _mm256_storeu_ps(buf, s[r][0]);
            _mm256_storeu_ps(buf + 8, s[r][1]);
            for (long i = 0; i < c; i++) yr[i] = buf[i] + (rr ? rr[i] : 0.0f);
        }
    }
}

static inline __attribute__((always_inline)) void block(const float *x, const uint16_t *wp, const float *res,
                                                        float *y, long N, long K, long t, int two, int act,
                                                        const int R) {
    const long ts = 16 * K;
    __m256 s0[ROWS][2], s1[ROWS][2];
    tile_dot(x, K, wp + t * ts, K, s0, R);
    if (two) tile_dot(x, K, wp + (t + 1) * ts, K, s1, R);
    if (act) { /* tiles t, t+1 = gate, up of output columns 8t..8t+15; y has N/2 columns */
        const long cols = N / 2;
        for (int r = 0; r < R; r++) {
            float g[16], u[16];
            _mm256_storeu_ps(g, s0[r][0]);
            _mm256_storeu_ps(g + 8, s0[r][1]);
            _mm256_storeu_ps(u, s1[r][0]);
            _mm256_storeu_ps(u + 8, s1[r][1]);
            float *yr = y + r * cols + t * 8;
            const float *rr = res ? res + r * cols + t * 8 : 0;
            for (int i = 0; i < 16; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i] + (rr ? rr[i] : 0.0f);
        }
        return;
    }
    put(s0, res, y, N, t * 16, N, R);
    if (two) put(s1, res, y, N, t * 16 + 16, N, R);
}

/* Output blocks [b0, b1) (32 columns each; 16 of y with act) of all M rows: what one thread does
   with its share, whatever the split (decode_helpers.c shares them out too), so a row's result
   does not depend on how the columns were divided. */
void ps_bf16w_blocks(const float *x, const uint16_t *wp, const float *res, float *y, long M, long N, long K,
                     int act, long b0, long b1) {
    const long tiles = (N + 15) / 16, cols = act ? N / 2 : N;
    for (long b = b0; b < b1; b++) {
        const long t = 2 * b;
        const int two = t + 1 < tiles;
        for (long r = 0; r < M; r += ROWS) {
            const float *xr = x + r * K;
            const float *rr = res ? res + r * cols : 0;
            float *yr = y + r * cols;
            if (M - r >= 2) block(xr, wp, rr, yr, N, K, t, two, act, 2);
            else block(xr, wp, rr, yr, N, K, t, two, act, 1);
        }
    }
}

/* y[M][N] = x[M][K] @ W^T (+ res[M][N]), all fp32 but W (bf16, packed). With act=1, N is the
   packed gate+up rows (a multiple of 32) and y is [M][N/2] = silu(gate) * up (+ res). */
int ps_gemm_bf16w_f32(const float *x, const uint16_t *wp, const float *res, float *y, long M, long N, long K,
                      int threads, int act) {
    if (K % 2 || K < 2 || M < 0 || N < 1 || threads < 1 || (act && N % 32)) return -1;
    const long tiles = (N + 15) / 16, blocks = (tiles + 1) / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
    for (long b = 0; b < blocks; b++) ps_bf16w_blocks(x, wp, res, y, M, N, K, act, b, b + 1);
    return 0;
}
