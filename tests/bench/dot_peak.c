// The dot-product instructions' peak on one core: int8 `vpdpbusd` (AVX512-VNNI, 64 multiply-adds
// per zmm instruction) against bf16 `vdpbf16ps` (AVX512-BF16, 32), twelve independent chains
// each, so that throughput and not latency is measured, five rounds taking turns.
//
// Why: the native Q8_0 path (runtime/kernels/quant_x16.c) multiplies with the first and the bf16
// path (gemm_bf16.c) with the second; what the core gives each bounds how much faster Q8_0 can
// compute than bf16 where the work is compute-bound (prefill, the offline batch), before any
// scale or layout overhead of the kernels themselves.
//
// Usage (an AVX512-VNNI + AVX512-BF16 CPU):
//   gcc -O3 -o /tmp/dot_peak tests/bench/dot_peak.c && taskset -c 1 /tmp/dot_peak
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

// Twelve accumulators in registers (separate variables: an array would live on the stack, and
// a store and reload per step would make each chain latency-bound). Inputs come through volatile
// loads, so the compiler cannot fold the chains away.
#define CHAINS 12
#define STEP12(op, x, y)                                                                      \
  a0 = op(a0, x, y), a1 = op(a1, x, y), a2 = op(a2, x, y), a3 = op(a3, x, y), a4 = op(a4, x, y), \
  a5 = op(a5, x, y), a6 = op(a6, x, y), a7 = op(a7, x, y), a8 = op(a8, x, y), a9 = op(a9, x, y),   \
  a10 = op(a10, x, y), a11 = op(a11, x, y)

static volatile int seed_int = 0x01020304;
static volatile float seed_float = 1.0f;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// int8 multiply-adds per second.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) static double int8_rate(long n) {
  const __m512i x = _mm512_set1_epi32(seed_int), y = _mm512_set1_epi32(seed_int);
  // distinct starts, or the compiler would see twelve equal chains and compute one
#define I(i) _mm512_add_epi32(x, _mm512_set1_epi32(i))
  __m512i a0 = I(0), a1 = I(1), a2 = I(2), a3 = I(3), a4 = I(4), a5 = I(5), a6 = I(6), a7 = I(7), a8 = I(8),
          a9 = I(9), a10 = I(10), a11 = I(11);
#undef I
  double t = now();
  for (long k = 0; k < n; k++) STEP12(_mm512_dpbusd_epi32, x, y);
  t = now() - t;
  __m512i s = _mm512_add_epi32(_mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)),
                               _mm512_add_epi32(_mm512_add_epi32(a4, a5), _mm512_add_epi32(a6, a7)));
  s = _mm512_add_epi32(s, _mm512_add_epi32(_mm512_add_epi32(a8, a9), _mm512_add_epi32(a10, a11)));
  seed_int = _mm512_reduce_add_epi32(s) & 0x01010101;  // the result is used
  return n * (double)CHAINS * 64 / t;
}

// bf16 multiply-adds per second.
__attribute__((target("avx512f,avx512bf16"))) static double bf16_rate(long n) {
  const __m512 f = _mm512_set1_ps(seed_float);
  const __m512bh x = _mm512_cvtne2ps_pbh(f, f), y = x;
#define F(i) _mm512_add_ps(f, _mm512_set1_ps(i))
  __m512 a0 = F(0), a1 = F(1), a2 = F(2), a3 = F(3), a4 = F(4), a5 = F(5), a6 = F(6), a7 = F(7), a8 = F(8),
         a9 = F(9), a10 = F(10), a11 = F(11);
#undef F
  double t = now();
  for (long k = 0; k < n; k++) STEP12(_mm512_dpbf16_ps, x, y);
  t = now() - t;
  __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                           _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  s = _mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11)));
  seed_float = _mm512_reduce_add_ps(s) > 0 ? 1.0f : 0.5f;
  return n * (double)CHAINS * 32 / t;
}

int main(void) {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512vnni") || !__builtin_cpu_supports("avx512bf16")) {
    fprintf(stderr, "this CPU lacks AVX512-VNNI or AVX512-BF16\n");
    return 2;
  }
  const long n = 20000000;
  for (int r = 0; r < 5; r++) {
    const double i8 = int8_rate(n), bf = bf16_rate(n);
    printf("int8 vpdpbusd %.1f GMAC/s, bf16 vdpbf16ps %.1f GMAC/s: int8 / bf16 %.2fx\n", i8 / 1e9, bf / 1e9,
           i8 / bf);
  }
  return 0;
}
