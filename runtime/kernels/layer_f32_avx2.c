/* The fp32 ops of a decoder layer besides its matmuls, for CPUs with AVX2 + FMA but no
 * AVX512-BF16, where dtype auto runs fp32 activations, norms and KV cache beside bf16 weights
 * (gemm_bf16w_avx2.c). Each replaces several torch ops whose dispatch costs more than their
 * arithmetic at decode sizes; they mirror the bf16 kernels' interfaces (rms_norm_bf16.c,
 * rope_bf16.c, decode_attention_bf16.c), so cpu_norm.py, cpu_rope.py and cpu_attention.py call
 * them unchanged.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "attention_args.h"

/* e^x as 2^n * p(r) (Cephes polynomial, |rel err| < 2e-7); x is clamped to [-87, 88.7], so a
   -inf score gives ~0 rather than NaN. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.7f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    /* 2^n: n + 127 in the exponent field (n is within [-126, 128] after the clamp) */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* ---------------------------------------------------------------------------------- RMSNorm */

/* y = w * (x * rsqrt(mean(x^2) + eps)) for M rows of K (a multiple of 8), as F.rms_norm in fp32;
   only the order of the sum of squares differs. */
int ps_rms_norm_f32(const float *x, const float *w, float *y, long M, long K, float eps, int threads) {
    if (K % 8 || K < 8) return -1;
#pragma omp parallel for num_threads(threads) if (threads > 1 && M >= 64) schedule(static)
    for (long m = 0; m < M; m++) {
        const float *xr = x + m * K;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        long k = 0;
        for (; k + 16 <= K; k += 16) {
            const __m256 a = _mm256_loadu_ps(xr + k), b = _mm256_loadu_ps(xr + k + 8);
            s0 = _mm256_fmadd_ps(a, a, s0);
            s1 = _mm256_fmadd_ps(b, b, s1);
        }
        if (k < K) {
            const __m256 a = _mm256_loadu_ps(xr + k);
            s0 = _mm256_fmadd_ps(a, a, s0);
        }
        const __m256 r = _mm256_set1_ps(1.0f / sqrtf(hsum256(_mm256_add_ps(s0, s1)) / (float)K + eps));
        for (k = 0; k < K; k += 8)
            _mm256_storeu_ps(y + m * K + k,
                             _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), r)));
    }
    return 0;
}

/* ------------------------------------------------------------------------ RoPE + K/V write */

/* qkv: [M, heads + 2*kv_heads, dim] fp32, contiguous: Q and K heads rotated in place
 * (rotate-half layout); cos, sin: [M, dim/2]; slots: [M] (negative: not written); the rotated K
 * and the V of row m are copied to cache slot slots[m] ([slots, kv_heads, dim] each). */
int ps_rope_write_f32(float *qkv, long M, long heads, long kv_heads, long dim, const float *cos,
                      const float *sin, const int64_t *slots, float *k_cache, float *v_cache, int threads) {
    const long half = dim / 2;
    if (dim % 16) return -1;
    const long row = (heads + 2 * kv_heads) * dim;
#pragma omp parallel for num_threads(threads) if (threads > 1 && M >= 64) schedule(static)
    for (long m = 0; m < M; m++) {
        float *r = qkv + m * row;
        for (long h = 0; h < heads + kv_heads; h++) {
            float *p = r + h * dim;
            for (long i = 0; i < half; i += 8) {
                const __m256 c = _mm256_loadu_ps(cos + m * half + i), s = _mm256_loadu_ps(sin + m * half + i);
                const __m256 x1 = _mm256_loadu_ps(p + i), x2 = _mm256_loadu_ps(p + half + i);
                _mm256_storeu_ps(p + i, _mm256_fmsub_ps(x1, c, _mm256_mul_ps(x2, s)));
                _mm256_storeu_ps(p + half + i, _mm256_fmadd_ps(x2, c, _mm256_mul_ps(x1, s)));
            }
        }
        if (slots[m] >= 0) {
            memcpy(k_cache + slots[m] * kv_heads * dim, r + heads * dim, kv_heads * dim * sizeof(float));
            memcpy(v_cache + slots[m] * kv_heads * dim, r + (heads + kv_heads) * dim, kv_heads * dim * sizeof(float));
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------ decode attention */

/* Blocks are scattered over the cache, so a new block starts on lines the hardware prefetcher
   has not seen: ask for the next block's rows of this KV head while this one is read. */
static inline void prefetch_block(const float *base, long rows, long row, long dim) {
    for (long j = 0; j < rows; j++)
        for (long o = 0; o < dim; o += 16) _mm_prefetch((const char *)(base + j * row + o), _MM_HINT_T0);
}

/* One (sequence, KV head): the G query heads sharing it (C*8 dims each). Scores of all G heads
 * go to `scores` ([G][ctx]) in one pass over the K rows, block by block as the table names them;
 * an exact fp32 softmax per head; then one pass over the V rows, each block's rows serving all G
 * heads while in L1 (the accumulators of a head live in `acc` between blocks). Inlined with G and
 * C constant for the common shapes. */
static inline __attribute__((always_inline)) void head_impl(const float *q, const float *k_cache,
                                                            const float *v_cache, const int64_t *table, long ctx,
                                                            float *out, long kv_heads, long kv_head,
                                                            long block_size, float scale, float *scores,
                                                            const int G, const int C) {
    const long dim = C * 8, row = kv_heads * dim;
    for (long t0 = 0, b = 0; t0 < ctx; t0 += block_size, b++) {
        const long n = ctx - t0 < block_size ? ctx - t0 : block_size;
        const float *kb = k_cache + table[b] * block_size * row + kv_head * dim;
        if (t0 + block_size < ctx) prefetch_block(k_cache + table[b + 1] * block_size * row + kv_head * dim,
                                                  block_size, row, dim);
        for (long j = 0; j < n; j++) {
            const float *k = kb + j * row;
            for (int g = 0; g < G; g++) {
                const float *qg = q + g * dim;
                __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(k));
                __m256 a1 = C > 1 ? _mm256_mul_ps(_mm256_loadu_ps(qg + 8), _mm256_loadu_ps(k + 8))
                                  : _mm256_setzero_ps();
                for (int c = 2; c + 1 < C; c += 2) {
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c * 8), _mm256_loadu_ps(k + c * 8), a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + c * 8 + 8), _mm256_loadu_ps(k + c * 8 + 8), a1);
                }
                if (C > 2 && C % 2)
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + (C - 1) * 8), _mm256_loadu_ps(k + (C - 1) * 8), a0);
                scores[g * ctx + t0 + j] = hsum256(_mm256_add_ps(a0, a1)) * scale;
            }
        }
    }
    float inv[MAX_GROUP];
    for (int g = 0; g < G; g++) {
        float *s = scores + g * ctx;
        float mx = -INFINITY;
        for (long t = 0; t < ctx; t++) mx = s[t] > mx ? s[t] : mx;
        const __m256 vmx = _mm256_set1_ps(mx);
        __m256 vsum = _mm256_setzero_ps();
        long t = 0;
        for (; t + 8 <= ctx; t += 8) {
            const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx));
            _mm256_storeu_ps(s + t, e);
            vsum = _mm256_add_ps(vsum, e);
        }
        float sum = hsum256(vsum);
        for (; t < ctx; t++) {
            s[t] = expf(s[t] - mx);
            sum += s[t];
        }
        inv[g] = 1.0f / sum;
    }
    __m256 acc[G][C];
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) acc[g][c] = _mm256_setzero_ps();
    for (long t0 = 0, b = 0; t0 < ctx; t0 += block_size, b++) {
        const long n = ctx - t0 < block_size ? ctx - t0 : block_size;
        const float *vb = v_cache + table[b] * block_size * row + kv_head * dim;
        if (t0 + block_size < ctx) prefetch_block(v_cache + table[b + 1] * block_size * row + kv_head * dim,
                                                  block_size, row, dim);
        for (int g = 0; g < G; g++) {
            const float *p = scores + g * ctx + t0;
            for (long j = 0; j < n; j++) {
                const __m256 pj = _mm256_broadcast_ss(p + j);
                for (int c = 0; c < C; c++)
                    acc[g][c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vb + j * row + c * 8), acc[g][c]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int c = 0; c < C; c++) _mm256_storeu_ps(out + g * dim + c * 8, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
}

#define HEAD(G, C) head_impl(q, k_cache, v_cache, table, ctx, out, kv_heads, kv_head, block_size, scale, scores, G, C)

/* One query head of any dim up to MAX_DIM (a multiple of 8). */
static void generic_head(const float *q, const float *k_cache, const float *v_cache, const int64_t *table, long ctx,
                         float *out, long kv_heads, long kv_head, long dim, long block_size, float scale,
                         float *scores) {
    switch (dim / 8) {
    case 1: HEAD(1, 1); break;
    case 2: HEAD(1, 2); break;
    case 4: HEAD(1, 4); break;
    case 6: HEAD(1, 6); break;
    case 8: HEAD(1, 8); break;
    case 12: HEAD(1, 12); break;
    case 16: HEAD(1, 16); break;
    default: { /* other multiples of 8: plain loops, a slot lookup per key */
        const long row = kv_heads * dim;
        for (long t = 0; t < ctx; t++) {
            const long slot = table[t / block_size] * block_size + t % block_size;
            const float *k = k_cache + slot * row + kv_head * dim;
            __m256 a = _mm256_setzero_ps();
            for (long i = 0; i < dim; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a);
            scores[t] = hsum256(a) * scale;
        }
        float mx = -INFINITY, sum = 0.0f;
        for (long t = 0; t < ctx; t++) mx = scores[t] > mx ? scores[t] : mx;
        for (long t = 0; t < ctx; t++) sum += (scores[t] = expf(scores[t] - mx));
        for (long i = 0; i < dim; i += 8) {
            __m256 a = _mm256_setzero_ps();
            for (long t = 0; t < ctx; t++) {
                const long slot = table[t / block_size] * block_size + t % block_size;
                a = _mm256_fmadd_ps(_mm256_set1_ps(scores[t]), _mm256_loadu_ps(v_cache + slot * row + kv_head * dim + i), a);
            }
            _mm256_storeu_ps(out + i, _mm256_mul_ps(a, _mm256_set1_ps(1.0f / sum)));
        }
        break;
    }
    }
}

static void one_head(const float *q, const float *k_cache, const float *v_cache, const int64_t *table, long ctx,
                     float *out, long group, long kv_heads, long kv_head, long dim, long block_size, float scale,
                     float *scores) {
    /* common shapes get a copy with G and C known; others go one query head at a time */
    if (dim == 64) {
        switch (group) {
        case 1: HEAD(1, 8); return;
        case 2: HEAD(2, 8); return;
        case 3: HEAD(3, 8); return;
        case 4: HEAD(4, 8); return;
        case 8: HEAD(8, 8); return;
        }
    } else if (dim == 128) {
        switch (group) {
        case 1: HEAD(1, 16); return;
        case 2: HEAD(2, 16); return;
        case 4: HEAD(4, 16); return;
        case 8: HEAD(8, 16); return;
        }
    }
    for (long g = 0; g < group; g++)
        generic_head(q + g * dim, k_cache, v_cache, table, ctx, out + g * dim, kv_heads, kv_head, dim, block_size,
                     scale, scores);
}

/* 0 if ps_decode_attention_f32 takes these arguments (-1: the shape, -2: a length). */
int ps_attention_args_f32(const int64_t *lens, long n, long heads, long kv_heads, long dim, long block_size,
                          long max_blocks, long scratch_per_thread) {
    return ps_attention_args(lens, n, heads, kv_heads, dim, 8, block_size, max_blocks, scratch_per_thread);
}

/* Tasks [t0, t1) of a decode attention call (task = sequence * kv_heads + KV head), arguments
   checked: what decode_helpers.c shares out, each task computed as the call computes it. */
void ps_attention_tasks_f32(const float *q, long q_row, const float *k_cache, const float *v_cache,
                            const int64_t *tables, long max_blocks, const int64_t *lens, float *out, long heads,
                            long kv_heads, long dim, long block_size, float scale, float *scores, long t0, long t1) {
    const long group = heads / kv_heads;
    for (long task = t0; task < t1; task++) {
        const long i = task / kv_heads, h = task % kv_heads;
        one_head(q + i * q_row + h * group * dim, k_cache, v_cache, tables + i * max_blocks, lens[i],
                 out + (i * heads + h * group) * dim, group, kv_heads, h, dim, block_size, scale, scores);
    }
}

/* q: [n, heads, dim] with row stride q_row (elements; each row's heads contiguous); out: [n, heads,
 * dim] contiguous; k_cache, v_cache: [slots, kv_heads, dim]; tables: [n, max_blocks]; lens: [n]
 * (tokens incl. the new one); scratch: `threads` x heads/kv_heads x max(lens) floats. */
int ps_decode_attention_f32(const float *q, long q_row, const float *k_cache, const float *v_cache,
                            const int64_t *tables, long max_blocks, const int64_t *lens, float *out, long n,
                            long heads, long kv_heads, long dim, long block_size, float scale, float *scratch,
                            long scratch_per_thread, int threads) {
    const int bad = ps_attention_args_f32(lens, n, heads, kv_heads, dim, block_size, max_blocks, scratch_per_thread);
    if (bad) return bad;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(dynamic, 1)
    for (long task = 0; task < n * kv_heads; task++)
        ps_attention_tasks_f32(q, q_row, k_cache, v_cache, tables, max_blocks, lens, out, heads, kv_heads, dim,
                               block_size, scale, scratch + omp_get_thread_num() * scratch_per_thread, task,
                               task + 1);
    return 0;
}

/* ------------------------------------------------------------------------------------ SwiGLU */

/* y [M, I] = silu(gu[:, :I]) * gu[:, I:] for gu [M, 2I] (a gate/up projection's output in GGUF
   row order), for weights whose kernel has no fused epilogue (quant_gemm.c, quant_x16.c), in one
   call instead of torch's chunk, silu and multiply. Vectorized (exp256) and, for prefill chunks,
   on OpenMP's threads: with packed GGUF weights a 2048-row chunk's matmuls got fast enough that
   expf one element at a time on one thread was two fifths of their time. Decode steps (fewer
   rows) stay on the calling thread, which shares its matmuls with the decode helpers instead.
   Each element's arithmetic depends only on its position in the row, never on M or threads. */
static void swiglu_row(const float *g, float *yr, long I) {
    const float *u = g + I;
    long i = 0;
    for (; i + 8 <= I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), e)),
                                               _mm256_loadu_ps(u + i)));
    }
    for (; i < I; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
}

int ps_swiglu_f32(const float *gu, float *y, long M, long I) {
    if (M < 0 || I < 1) return -1;
    if (M < 128) { /* not even an inactive OpenMP region: a decode step makes 30 of these calls */
        for (long m = 0; m < M; m++) swiglu_row(gu + m * 2 * I, y + m * I, I);
        return 0;
    }
#pragma omp parallel for schedule(static)
    for (long m = 0; m < M; m++) swiglu_row(gu + m * 2 * I, y + m * I, I);
    return 0;
}
