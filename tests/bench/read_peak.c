// A plain read of a buffer on N threads with AVX512 loads (64-bit loads without AVX512): the bound that decode_bound.py holds a
// decode step's weight streaming against, beside torch.sum's read.
//
// Why: torch.sum is a reduction, not a read at the memory's speed; in one run of decode_bound.py
// the bf16 decode step streamed its weights faster than torch.sum read the same bytes (1.10x,
// docs/benchmarks.md), so that figure bounded nothing. This loop does nothing but load: each
// thread takes one contiguous part (as the step's matmuls take runs of tiles), four 64-byte loads
// per 256 bytes folded with XOR into independent registers, optionally with a software prefetch
// `distance` bytes ahead. The XOR of everything read is returned so the loads cannot be dropped.
//
// Built by decode_bound.py (gcc -O2 -shared -fPIC -pthread); no runtime code uses it.
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>

#define MAX_THREADS 64

typedef struct {
  const uint8_t *p;
  long n;
  long distance;
  uint64_t out;
} part_t;

__attribute__((target("avx512f"))) static void *read_part(void *arg) {
  part_t *t = (part_t *)arg;
  const uint8_t *p = t->p;
  const long n = t->n & ~255L, d = t->distance;
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (long i = 0; i < n; i += 256) {
    if (d) {
      _mm_prefetch((const char *)(p + i + d), _MM_HINT_T0);
      _mm_prefetch((const char *)(p + i + d + 64), _MM_HINT_T0);
      _mm_prefetch((const char *)(p + i + d + 128), _MM_HINT_T0);
      _mm_prefetch((const char *)(p + i + d + 192), _MM_HINT_T0);
    }
    a0 = _mm512_xor_si512(a0, _mm512_loadu_si512((const void *)(p + i)));
    a1 = _mm512_xor_si512(a1, _mm512_loadu_si512((const void *)(p + i + 64)));
    a2 = _mm512_xor_si512(a2, _mm512_loadu_si512((const void *)(p + i + 128)));
    a3 = _mm512_xor_si512(a3, _mm512_loadu_si512((const void *)(p + i + 192)));
  }
  uint64_t lanes[8];
  _mm512_storeu_si512((void *)lanes, _mm512_xor_si512(_mm512_xor_si512(a0, a1), _mm512_xor_si512(a2, a3)));
  uint64_t x = 0;
  for (int i = 0; i < 8; i++) x ^= lanes[i];
  for (long i = n; i < t->n; i++) x ^= p[i];
  t->out = x;
  return NULL;
}

// The same on CPUs without AVX512 (the AVX2 machines this bench also runs on): 64-bit loads, four
// independent XOR chains, which GCC vectorizes with what -O2 allows.
static void *read_part_plain(void *arg) {
  part_t *t = (part_t *)arg;
  const uint64_t *p = (const uint64_t *)t->p;
  const long n = t->n / 8;
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (long i = 0; i + 4 <= n; i += 4) a0 ^= p[i], a1 ^= p[i + 1], a2 ^= p[i + 2], a3 ^= p[i + 3];
  uint64_t x = a0 ^ a1 ^ a2 ^ a3;
  for (long i = n & ~3L; i < n; i++) x ^= p[i];
  for (long i = n * 8; i < t->n; i++) x ^= t->p[i];
  t->out = x;
  return NULL;
}

// Reads `bytes` of `buf` once on `threads` threads (this one and threads - 1 started for the
// call), each a contiguous part; returns the XOR of the data as 64-bit words (a checksum).
uint64_t ps_read_bytes(const void *buf, long bytes, int threads, long distance) {
  if (threads < 1) threads = 1;
  if (threads > MAX_THREADS) threads = MAX_THREADS;
  part_t parts[MAX_THREADS];
  pthread_t ids[MAX_THREADS];
  const long share = (bytes / threads) & ~4095L;  // parts start on page boundaries of the buffer
  for (int i = 0; i < threads; i++) {
    parts[i].p = (const uint8_t *)buf + i * share;
    parts[i].n = i == threads - 1 ? bytes - i * share : share;
    parts[i].distance = distance;
  }
  __builtin_cpu_init();
  void *(*part)(void *) = __builtin_cpu_supports("avx512f") ? read_part : read_part_plain;
  int started = 1;
  for (; started < threads; started++)
    if (pthread_create(&ids[started], NULL, part, &parts[started])) break;
  for (int i = started; i < threads; i++) part(&parts[i]);  // threads that did not start: here
  part(&parts[0]);
  uint64_t x = parts[0].out;
  for (int i = 1; i < started; i++) {
    pthread_join(ids[i], NULL);
    x ^= parts[i].out;
  }
  for (int i = started; i < threads; i++) x ^= parts[i].out;
  return x;
}
