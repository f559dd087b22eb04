/* A decode step's bf16-weight matmuls on the calling thread plus persistent helper threads, with
 * waits that cannot collapse when a helper's core is taken by another process.
 *
 * At a batch of a few rows a decode step is a stream of the weights, ~120 matmuls of 0.1-3 ms
 * each. OpenMP's two-thread regions end in a barrier: with sleeping waits every region pays a
 * wake-up, and beside a busy process a descheduled thread makes the other wait a timeslice at
 * every region (measured here: 1,172 ms a step instead of ~30); spinning waits take the busy
 * neighbour's core. So the engine ran these steps on one thread, reading the weights at one
 * core's bandwidth.
 *
 * Here a matmul's output blocks (32 columns each, gemm_bf16w_avx2.c; or 16-column tiles of a
 * matmul with GGUF block weights, quant_gemm.c; or the AVX512-BF16 kernel's blocks of 32 columns,
 * gemm_bf16.c, built in another library and handed over by address) are claimed in runs (a
 * shrinking share of what is left, at most MAX_SPAN) from one shared counter by the caller and any
 * helper that is awake; the caller never waits for a fixed share. When the counter runs out, the
 * caller settles the runs helpers claimed: a finished one is copied from that helper's scratch
 * rows; one still unfinished after a short spin (its helper descheduled) is taken back and
 * computed by the caller. Every chunk is computed by
 * the same code whoever runs it (ps_bf16w_blocks), so the result is the same bits as one thread's.
 *
 * So that a helper still inside a run the caller took back can never touch memory the caller
 * has moved on from, helpers read only the weights (held by the model for its lifetime) and this
 * pool's own copies of x and the residual, and write only their own scratch rows; pool buffers
 * outgrown are kept, not freed (a late helper may still read or write them; they are discarded).
 * A claim is checked against the job's generation, so a late helper never works on a later job
 * with an earlier job's arguments.
 *
 * Helpers wait for work by spinning briefly (the gaps between a step's matmuls are tens of us),
 * then sleep on a futex: nothing between steps, and nothing taken from a busy neighbour. A weight
 * freed while a late helper still reads it is the one hazard left: the model keeps its weights
 * for its lifetime, and a helper is late by at most the time it was descheduled.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <immintrin.h>

void ps_bf16w_blocks(const float *x, const uint16_t *wp, const float *res, float *y, long M, long N, long K,
                     int act, long b0, long b1);
int ps_gemm_bf16w_f32(const float *x, const uint16_t *wp, const float *res, float *y, long M, long N, long K,
                      int threads, int act);
void ps_q_quantize_rows(const float *x, long m, long k, int8_t *q, float *d, float *s);
void ps_q_tiles(int type, const uint8_t *w, long row_bytes, long t0, long t1, long m, long n, long k,
                const int8_t *q, const float *d, const float *s, const float *residual, float *out);
int ps_q_args_ok(long m, long n, long k, long row_bytes, int type);
int ps_qgemm(const float *x, const uint8_t *w, const float *residual, float *out, long m, long n, long k,
             long row_bytes, int type, int threads);
int ps_attention_args_f32(const int64_t *lens, long n, long heads, long kv_heads, long dim, long block_size,
                          long max_blocks, long scratch_per_thread);
void ps_attention_tasks_f32(const float *q, long q_row, const float *k_cache, const float *v_cache,
                            const int64_t *tables, long max_blocks, const int64_t *lens, float *out, long heads,
                            long kv_heads, long dim, long block_size, float scale, float *scores, long t0, long t1);
int ps_decode_attention_f32(const float *q, long q_row, const float *k_cache, const float *v_cache,
                            const int64_t *tables, long max_blocks, const int64_t *lens, float *out, long n,
                            long heads, long kv_heads, long dim, long block_size, float scale, float *scratch,
                            long scratch_per_thread, int threads);

#define MAX_HELPERS 64
#define MAX_CHUNKS 4096
/* Most chunks one claim takes: what a caller recomputes when it takes back a descheduled
   helper's claim (8 chunks of 32 columns of K = 576: ~300 KB, ~25 us of streaming). */
#define MAX_SPAN 8
/* Rows a shared call takes by default (decode batches: the one-call step's limit,
   cpu_decode_step.MAX_ROWS); more rows go to the one-thread kernel, since a process with helpers of
   its own runs such calls (prefill) on its OpenMP threads. Helpers on borrowed CPUs
   (ps_helpers_borrow) take prefill chunks too: pool.max_rows. */
#define MAX_ROWS 64

/* Chunk states: generation << 32 | helper << 8 | state. */
enum { FREE = 0, CLAIMED = 1, DONE = 2, TAKEN = 3, MINE = 4 };
#define STATE(g, h, s) (((uint64_t)(uint32_t)(g) << 32) | ((uint64_t)(h) << 8) | (uint64_t)(s))

/* What a job multiplies: bf16 weights with fp32 activations (gemm_bf16w_avx2.c's blocks of 32
   columns, 16 with the SwiGLU epilogue), GGUF blocks (quant_gemm.c's tiles of 16 columns,
   activations quantized once by the caller), or bf16 weights and activations on AVX512-BF16
   (gemm_bf16.c's blocks, through the function pointer bf16_fn; output bf16 or fp32); or the
   decode attention over the paged cache, one (sequence, KV head) a block: fp32 (layer_f32_avx2.c)
   or bf16 (decode_attention_bf16.c, through the function pointer attn_fn). */
enum { BF16W = 0, QUANT = 1, BF16 = 2, ATTN = 3, ATTN_BF16 = 4 };

typedef void (*bf16_blocks_fn)(const uint16_t *x, const uint16_t *wp, const uint16_t *res, void *y, long M, long N,
                               long K, int out_f32, int act, long b0, long b1);
/* decode_attention_bf16.c's ps_attention_tasks_bf16 */
typedef void (*attn_bf16_fn)(const uint16_t *q, long q_row, const uint16_t *k_cache, const uint16_t *v_cache,
                             const int64_t *tables, long max_blocks, const int64_t *lens, uint16_t *out, long heads,
                             long kv_heads, long dim, long block_size, float scale, float *scores, long t0, long t1);

typedef struct {
    long kind;
    bf16_blocks_fn bf16_fn;           /* BF16 */
    attn_bf16_fn attn_fn;             /* ATTN_BF16 */
    const uint16_t *wp;               /* BF16W, BF16 */
    const uint8_t *qw;                /* QUANT: the blocks, row_bytes apart, of type qtype */
    long row_bytes, qtype;
    const void *x, *res;              /* the pool's copies (BF16W, BF16: x; all: the residual) */
    const int8_t *q;                  /* QUANT: the pool's quantized activation rows */
    const float *qd, *qs;             /* their blocks' scales and scale x sum */
    char *scratch;                    /* helper h writes rows of M x cols at scratch + h * M * cols * elem */
    long M, N, K, act, out_f32, elem;  /* elem: bytes per output value */
    long cols, blocks, block_cols, per_chunk, chunks, parts;
    /* ATTN, ATTN_BF16: x is the pool's copy of q ([n, heads, dim]), `res` each thread's scores
       (helper h's at the pool's scores + h * scores_per); tables and lens the pool's copies; the
       caches are read in place (a late helper's reads of slots rewritten meanwhile are discarded
       with its claim) */
    const void *k_cache, *v_cache;
    const int64_t *tables, *lens;
    long max_blocks, heads, kv_heads, dim, block_size, scores_per;
    float scale;
} job_t;

typedef struct {
    /* The job of generation `gen` (written by the caller before it publishes gen). */
    job_t job;
    char pad0[64];
    uint32_t gen; /* futex word: the latest job published */
    char pad1[60];
    uint64_t next; /* gen << 32 | the next chunk to claim */
    char pad2[56];
    int sleeping; /* helpers asleep on the futex */
    char pad3[60];
    uint64_t state[MAX_CHUNKS];
    int helpers, use, pinned, caller_cpu, busy;
    long max_rows; /* rows a shared call takes (MAX_ROWS, or more with borrowed CPUs) */
    pthread_t threads[MAX_HELPERS];
    long helped, taken, waited_ns; /* chunks the caller copied from helpers, took back; its wait */
    long spin_ns, steal_ns;
    uint32_t last_gen; /* the caller's count of jobs */
    float *xbuf, *rbuf, *sbuf, *qbuf, *dbuf, *tbuf, *abuf;
    long xcap, rcap, scap, qcap, dcap, tcap, acap;
} pool_t;

static pool_t pool = {.spin_ns = 200000, .steal_ns = 50000, .caller_cpu = -1, .max_rows = MAX_ROWS};
static pthread_mutex_t start_lock = PTHREAD_MUTEX_INITIALIZER;

static inline long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static long futex(uint32_t *addr, int op, uint32_t val) {
    return syscall(SYS_futex, addr, op, val, NULL, NULL, 0);
}

/* Chunks a claim starting at chunk c takes: a share of what is left, shrinking towards the end
   (guided scheduling). Few claims keep each thread on long runs of weights (the prefetchers
   follow them) and the shared counter's cache line still; the small last ones even out the
   finish. A function of c alone, so the caller can walk the claims others made. */
static inline long span(const job_t *j, long c) {
    const long left = j->chunks - c, s = left / (2 * j->parts);
    return s < 1 ? 1 : s > MAX_SPAN ? MAX_SPAN : s;
}

/* Claim the next run of chunks of generation g: its first chunk, or -1 when none is left (or g
   is over). */
static long claim(uint32_t g, const job_t *j) {
    uint64_t cur = __atomic_load_n(&pool.next, __ATOMIC_ACQUIRE);
    for (;;) {
        const long c = (long)(cur & 0xffffffffu);
        if ((uint32_t)(cur >> 32) != g || c >= j->chunks) return -1;
        if (__atomic_compare_exchange_n(&pool.next, &cur, cur + (uint64_t)span(j, c), 1, __ATOMIC_ACQ_REL,
                                        __ATOMIC_ACQUIRE))
            return c;
    }
}

static void chunk_blocks(const job_t *j, long c, long *b0, long *b1) {
    const long e = (c + span(j, c)) * j->per_chunk;
    *b0 = c * j->per_chunk;
    *b1 = e < j->blocks ? e : j->blocks;
}

/* Output blocks [b0, b1) of job j into y (rows of j->cols), from activations x (BF16W, BF16) and
   residual res: the one place any of the three kernels is called, by the caller and helpers alike. */
static void run_blocks(const job_t *j, const void *x, const void *res, void *y, long b0, long b1) {
    if (j->kind == ATTN)
        ps_attention_tasks_f32(x, j->heads * j->dim, j->k_cache, j->v_cache, j->tables, j->max_blocks, j->lens, y,
                               j->heads, j->kv_heads, j->dim, j->block_size, j->scale, (float *)res, b0, b1);
    else if (j->kind == ATTN_BF16)
        j->attn_fn(x, j->heads * j->dim, j->k_cache, j->v_cache, j->tables, j->max_blocks, j->lens, y, j->heads,
                   j->kv_heads, j->dim, j->block_size, j->scale, (float *)res, b0, b1);
    else if (j->kind == QUANT)
        ps_q_tiles((int)j->qtype, j->qw, j->row_bytes, b0, b1, j->M, j->N, j->K, j->q, j->qd, j->qs, res, y);
    else if (j->kind == BF16)
        j->bf16_fn(x, j->wp, res, y, j->M, j->N, j->K, (int)j->out_f32, (int)j->act, b0, b1);
    else
        ps_bf16w_blocks(x, j->wp, res, y, j->M, j->N, j->K, (int)j->act, b0, b1);
}

/* A helper's part of generation g: claim, compute into its scratch, mark done, until none left. */
static void help(int h, uint32_t g) {
    job_t j;
    memcpy(&j, (const void *)&pool.job, sizeof j); /* valid if a claim of g succeeds (see claim's caller) */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (j.chunks > MAX_CHUNKS || j.M < 1 || j.M > pool.max_rows || j.parts < 2 || j.cols < 1 || j.elem < 1) return;
    char *mine = j.scratch + (long)h * j.M * j.cols * j.elem;
    for (;;) {
        /* A successful claim of g means the caller had not finished g, so the job read above
           (after seeing g published) is g's: the caller rewrites it only after finishing g. */
        const long c = claim(g, &j);
        if (c < 0) return;
        uint64_t seen = __atomic_load_n(&pool.state[c], __ATOMIC_ACQUIRE);
        if ((uint32_t)(seen >> 32) == g) continue; /* already taken back by the caller */
        if (!__atomic_compare_exchange_n(&pool.state[c], &seen, STATE(g, h, CLAIMED), 0, __ATOMIC_ACQ_REL,
                                         __ATOMIC_ACQUIRE))
            continue;
        long b0, b1;
        chunk_blocks(&j, c, &b0, &b1);
        const int attn = j.kind == ATTN || j.kind == ATTN_BF16;
        run_blocks(&j, j.x, attn ? (const void *)((float *)j.res + (long)h * j.scores_per) : j.res, mine, b0, b1);
        uint64_t want = STATE(g, h, CLAIMED);
        __atomic_compare_exchange_n(&pool.state[c], &want, STATE(g, h, DONE), 0, __ATOMIC_RELEASE,
                                    __ATOMIC_RELAXED);
    }
}

static void *helper_main(void *arg) {
    const int h = (int)(long)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals go to the process's own threads */
    uint32_t seen = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE);
    long idle_since = now_ns();
    for (;;) {
        const uint32_t g = __atomic_load_n(&pool.gen, __ATOMIC_ACQUIRE);
        if (g != seen) {
            seen = g;
            help(h, g);
            idle_since = now_ns();
            continue;
        }
        if (now_ns() - idle_since < pool.spin_ns) {
            for (int i = 0; i < 32; i++) _mm_pause();
            continue;
        }
        __atomic_add_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
        futex(&pool.gen, FUTEX_WAIT_PRIVATE, g); /* returns at once if gen moved on */
        __atomic_sub_fetch(&pool.sleeping, 1, __ATOMIC_SEQ_CST);
        idle_since = now_ns();
    }
    return NULL;
}

/* Pinning (ps_helpers_start's `pinned`): helper h runs on the h-th allowed CPU after the one the
   caller ran on at its last shared call (wrapping), re-pinned when the caller moves. A helper
   woken by the caller is otherwise often placed on the caller's own CPU (the two then take turns
   there while another CPU idles, or runs a busy neighbour that the helper should share instead). */
static void pin_all(int here) {
    cpu_set_t allowed, one;
    if (here < 0 || sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
    const int n = CPU_COUNT(&allowed);
    if (n < 2) return;
    int cpus[CPU_SETSIZE], k = 0, at = -1;
    for (int c = 0; c < CPU_SETSIZE && k < n; c++)
        if (CPU_ISSET(c, &allowed)) {
            if (c == here) at = k;
            cpus[k++] = c;
        }
    if (at < 0) return;
    for (int h = 0; h < pool.helpers; h++) {
        CPU_ZERO(&one);
        CPU_SET(cpus[(at + 1 + h % (n - 1)) % n], &one);
        pthread_setaffinity_np(pool.threads[h], sizeof one, &one);
    }
    pool.caller_cpu = here;
}

static void after_fork_child(void) { pool.helpers = 0; } /* the child has no helper threads */

/* Start helpers until there are n (at most MAX_HELPERS); returns how many run. spin_us: how long
   an idle helper spins before it sleeps; steal_us: how long the caller waits for a chunk a helper
   holds before it computes it itself (< 0: keep the current value); pin: pin each new helper to
   a CPU other than the caller's (see pin). */
int ps_helpers_start(int n, int pinned, long spin_us, long steal_us) {
    pthread_mutex_lock(&start_lock);
    static int atfork;
    if (!atfork) {
        pthread_atfork(NULL, NULL, after_fork_child);
        atfork = 1;
    }
    if (spin_us >= 0) pool.spin_ns = spin_us * 1000;
    if (steal_us >= 0) pool.steal_ns = steal_us * 1000;
    if (n > MAX_HELPERS) n = MAX_HELPERS;
    while (pool.helpers < n) {
        pthread_t t;
        pthread_attr_t a;
        pthread_attr_init(&a);
        pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
        const int rc = pthread_create(&t, &a, helper_main, (void *)(long)pool.helpers);
        pthread_attr_destroy(&a);
        if (rc != 0) break;
        pool.threads[pool.helpers++] = t;
    }
    pool.pinned = pinned;
    pool.caller_cpu = -1; /* (re)pinned at the next shared call */
    const int got = pool.helpers;
    pthread_mutex_unlock(&start_lock);
    return got;
}

/* Helpers on CPUs this process does not own (another worker's, pinned there by `phasesplit up`):
   one helper per CPU of cpus[0..n), pinned to it and run at SCHED_IDLE, so it computes only while
   that CPU has nothing else to run, and the worker that owns it preempts it at once (a helper
   preempted holding a claim costs the caller the steal wait, then the caller computes it). Shared
   calls of up to max_rows rows use them: prefill chunks too. Returns how many helpers are placed
   (fewer than n where the kernel refuses a CPU, e.g. outside the cgroup's cpuset; those are
   pinned nowhere and still idle-priority). Call once, before any shared call, instead of
   ps_helpers_start. */
int ps_helpers_borrow(const int *cpus, int n, long max_rows) {
    const int got = ps_helpers_start(n, 0, -1, -1);
    int placed = 0;
    const struct sched_param idle = {.sched_priority = 0};
    for (int h = 0; h < got && h < n; h++) {
        pthread_setschedparam(pool.threads[h], SCHED_IDLE, &idle);
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(cpus[h], &one);
        if (pthread_setaffinity_np(pool.threads[h], sizeof one, &one) == 0) placed++;
    }
    if (max_rows > pool.max_rows) pool.max_rows = max_rows;
    return placed;
}

/* Whether shared calls use the helpers (on: 1) or run on the caller alone (0); returns the
   previous setting. Call between matmuls, from the thread that makes them. */
int ps_helpers_use(int on) {
    const int was = pool.use;
    pool.use = on;
    return was;
}

int ps_helpers_count(void) { return pool.helpers; }

/* Chunks computed by helpers and used, chunks the caller took back from a helper, and the time
   the caller spent waiting for helpers' chunks, so far. */
void ps_helpers_stats(long out[3]) {
    out[0] = pool.helped;
    out[1] = pool.taken;
    out[2] = pool.waited_ns;
}

/* A buffer of at least n floats; an outgrown one is left allocated (a late helper may use it). */
static float *grow(float **buf, long *cap, long n) {
    if (n <= *cap) return *buf;
    long want = *cap ? *cap : 4096;
    while (want < n) want *= 2;
    float *b = aligned_alloc(64, (size_t)want * sizeof(float));
    if (!b) return NULL;
    *buf = b;
    *cap = want;
    return b;
}

static int run_job(job_t job, const void *x, const void *res, void *y, int helpers);

/* Whether a call of M rows of `bytes` output each is shared: within max_rows, and its helpers'
   scratch within SCRATCH_MAX (a prefill with prompt logprobs runs the head over every row: a
   vocabulary-wide scratch per helper, kept for the process's lifetime, is not worth one call). */
#define SCRATCH_MAX (64L << 20)
static int shareable(long M, long bytes, int helpers) {
    return helpers > 0 && M > 0 && M <= pool.max_rows && (M <= MAX_ROWS || helpers * M * bytes <= SCRATCH_MAX);
}

/* As ps_gemm_bf16w_f32 with one thread, the output blocks shared with the helpers (see above).
   The same bits as the one-thread kernel. */
int ps_gemm_bf16w_f32_shared(const float *x, const uint16_t *wp, const float *res, float *y, long M, long N, long K,
                             int act) {
    if (K % 2 || K < 2 || M < 0 || N < 1 || (act && N % 32)) return -1;
    const int helpers = pool.use ? pool.helpers : 0;
    const long tiles = (N + 15) / 16, blocks = (tiles + 1) / 2, cols = act ? N / 2 : N;
    if (!shareable(M, cols * 4, helpers) || blocks < 2) return ps_gemm_bf16w_f32(x, wp, res, y, M, N, K, 1, act);
    /* One job at a time: a second thread calling meanwhile computes alone. */
    if (__atomic_exchange_n(&pool.busy, 1, __ATOMIC_ACQUIRE)) return ps_gemm_bf16w_f32(x, wp, res, y, M, N, K, 1, act);
    float *xb = grow(&pool.xbuf, &pool.xcap, M * K);
    float *rb = res ? grow(&pool.rbuf, &pool.rcap, M * cols) : NULL;
    float *sb = grow(&pool.sbuf, &pool.scap, (long)helpers * M * cols);
    int rc;
    if (!xb || (res && !rb) || !sb) {
        rc = ps_gemm_bf16w_f32(x, wp, res, y, M, N, K, 1, act);
    } else {
        memcpy(xb, x, (size_t)(M * K) * sizeof(float));
        if (res) memcpy(rb, res, (size_t)(M * cols) * sizeof(float));
        rc = run_job((job_t){.kind = BF16W, .wp = wp, .x = xb, .res = rb, .scratch = (char *)sb, .M = M, .N = N,
                             .K = K, .act = act, .elem = 4, .cols = cols, .blocks = blocks,
                             .block_cols = act ? 16 : 32},
                     x, res, y, helpers);
    }
    __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
    return rc;
}

/* As ps_qgemm with one thread (GGUF block weights, quant_gemm.c), its 16-column tiles shared with
   the helpers; the caller quantizes the activation rows once, into the pool. The same bits as the
   one-thread kernel. */
int ps_qgemm_shared(const float *x, const uint8_t *w, const float *res, float *y, long M, long N, long K,
                    long row_bytes, int type) {
    if (!ps_q_args_ok(M, N, K, row_bytes, type)) return -1;
    const int helpers = pool.use ? pool.helpers : 0;
    const long tiles = (N + 15) / 16, nb = K / 32;
    if (!shareable(M, N * 4, helpers) || tiles < 2) return ps_qgemm(x, w, res, y, M, N, K, row_bytes, type, 1);
    if (__atomic_exchange_n(&pool.busy, 1, __ATOMIC_ACQUIRE)) return ps_qgemm(x, w, res, y, M, N, K, row_bytes, type, 1);
    int8_t *q = (int8_t *)grow(&pool.qbuf, &pool.qcap, (M * K + 3) / 4);
    float *dq = grow(&pool.dbuf, &pool.dcap, 2 * M * nb);
    float *rb = res ? grow(&pool.rbuf, &pool.rcap, M * N) : NULL;
    float *sb = grow(&pool.sbuf, &pool.scap, (long)helpers * M * N);
    int rc;
    if (!q || !dq || (res && !rb) || !sb) {
        rc = ps_qgemm(x, w, res, y, M, N, K, row_bytes, type, 1);
    } else {
        ps_q_quantize_rows(x, M, K, q, dq, dq + M * nb);
        if (res) memcpy(rb, res, (size_t)(M * N) * sizeof(float));
        rc = run_job((job_t){.kind = QUANT, .qw = w, .row_bytes = row_bytes, .qtype = type, .res = rb, .q = q,
                             .qd = dq, .qs = dq + M * nb, .scratch = (char *)sb, .M = M, .N = N, .K = K,
                             .elem = 4, .cols = N, .blocks = tiles, .block_cols = 16},
                     NULL, res, y, helpers);
    }
    __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
    return rc;
}

/* As ps_gemm_bf16 with one thread (gemm_bf16.c: bf16 x, W and residual; y bf16, or fp32 when
   out_f32), its blocks shared with the helpers. `fn` is that library's ps_bf16_blocks. The same
   bits as the one-thread kernel. */
int ps_bf16_shared(void *fn, const uint16_t *x, const uint16_t *wp, const uint16_t *res, void *y, long M, long N,
                   long K, int out_f32, int act) {
    if (!fn || K % 2 || M < 0 || N < 0 || (act && N % 32)) return -1;
    const bf16_blocks_fn f = (bf16_blocks_fn)fn;
    const int helpers = pool.use ? pool.helpers : 0;
    const long tiles = (N + 15) / 16, blocks = (tiles + 1) / 2, cols = act ? N / 2 : N, elem = out_f32 ? 4 : 2;
    if (!shareable(M, cols * elem, helpers) || blocks < 2 ||
        __atomic_exchange_n(&pool.busy, 1, __ATOMIC_ACQUIRE)) {
        /* one thread (or another thread's job is running): the caller alone, in one pass */
        f(x, wp, res, y, M, N, K, out_f32, act, 0, blocks);
        return 0;
    }
    /* bf16 copies (2 bytes a value) in the pool's float buffers */
    uint16_t *xb = (uint16_t *)grow(&pool.xbuf, &pool.xcap, (M * K + 1) / 2);
    uint16_t *rb = res ? (uint16_t *)grow(&pool.rbuf, &pool.rcap, (M * cols + 1) / 2) : NULL;
    float *sb = grow(&pool.sbuf, &pool.scap, ((long)helpers * M * cols * elem + 3) / 4);
    int rc = 0;
    if (!xb || (res && !rb) || !sb) {
        f(x, wp, res, y, M, N, K, out_f32, act, 0, blocks);
    } else {
        memcpy(xb, x, (size_t)(M * K) * 2);
        if (res) memcpy(rb, res, (size_t)(M * cols) * 2);
        rc = run_job((job_t){.kind = BF16, .bf16_fn = f, .wp = wp, .x = xb, .res = rb, .scratch = (char *)sb,
                             .M = M, .N = N, .K = K, .act = act, .out_f32 = out_f32, .elem = elem, .cols = cols,
                             .blocks = blocks, .block_cols = act ? 16 : 32},
                     x, res, y, helpers);
    }
    __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
    return rc;
}

/* A decode attention call's (sequence, KV head) tasks shared with the helpers, arguments checked
   by the caller: `elem` bytes a value of q and out (4: fp32, the kind ATTN; 2: bf16, ATTN_BF16
   through `fn`). The caller copies q, the tables and the lengths into the pool; `scratch` is its
   own scores (scratch_per_thread floats). Returns 1 where it did not run (no helpers, or another
   thread's job is running): the caller then computes alone. */
static int share_attention(int kind, attn_bf16_fn fn, const void *q, long q_row, long elem, const void *k_cache,
                           const void *v_cache, const int64_t *tables, long max_blocks, const int64_t *lens,
                           void *out, long n, long heads, long kv_heads, long dim, long block_size, float scale,
                           float *scratch, long scratch_per_thread) {
    const int helpers = pool.use ? pool.helpers : 0;
    const long tasks = n * kv_heads, group = heads / kv_heads;
    if (helpers == 0 || tasks < 2 || tasks > MAX_CHUNKS || __atomic_exchange_n(&pool.busy, 1, __ATOMIC_ACQUIRE))
        return 1;
    const long qn = n * heads * dim;
    char *qb = (char *)grow(&pool.xbuf, &pool.xcap, (qn * elem + 3) / 4);
    int64_t *tb = (int64_t *)grow(&pool.tbuf, &pool.tcap, 2 * (n * max_blocks + n));
    float *ab = grow(&pool.abuf, &pool.acap, (long)helpers * scratch_per_thread);
    float *sb = grow(&pool.sbuf, &pool.scap, ((long)helpers * qn * elem + 3) / 4);
    int rc = 1;
    if (qb && tb && ab && sb) {
        for (long i = 0; i < n; i++)
            memcpy(qb + i * heads * dim * elem, (const char *)q + i * q_row * elem, (size_t)(heads * dim * elem));
        memcpy(tb, tables, (size_t)(n * max_blocks) * sizeof(int64_t));
        memcpy(tb + n * max_blocks, lens, (size_t)n * sizeof(int64_t));
        /* The caller reads the pool's q too (q_row = heads * dim, as the helpers do). */
        rc = run_job((job_t){.kind = kind, .attn_fn = fn, .x = qb, .res = ab, .scratch = (char *)sb, .M = 1,
                             .N = qn, .K = 0, .elem = elem, .cols = qn, .blocks = tasks, .block_cols = group * dim,
                             .k_cache = k_cache, .v_cache = v_cache, .tables = tb, .lens = tb + n * max_blocks,
                             .max_blocks = max_blocks, .heads = heads, .kv_heads = kv_heads, .dim = dim,
                             .block_size = block_size, .scores_per = scratch_per_thread, .scale = scale},
                     qb, scratch, out, helpers);
    }
    __atomic_store_n(&pool.busy, 0, __ATOMIC_RELEASE);
    return rc;
}

/* As ps_decode_attention_f32 with one thread (layer_f32_avx2.c), its tasks shared with the
   helpers. The same bits as one thread. */
int ps_decode_attention_f32_shared(const float *q, long q_row, const float *k_cache, const float *v_cache,
                                   const int64_t *tables, long max_blocks, const int64_t *lens, float *out, long n,
                                   long heads, long kv_heads, long dim, long block_size, float scale, float *scratch,
                                   long scratch_per_thread) {
    const int bad = ps_attention_args_f32(lens, n, heads, kv_heads, dim, block_size, max_blocks, scratch_per_thread);
    if (bad) return bad;
    if (share_attention(ATTN, NULL, q, q_row, 4, k_cache, v_cache, tables, max_blocks, lens, out, n, heads, kv_heads,
                        dim, block_size, scale, scratch, scratch_per_thread))
        return ps_decode_attention_f32(q, q_row, k_cache, v_cache, tables, max_blocks, lens, out, n, heads, kv_heads,
                                       dim, block_size, scale, scratch, scratch_per_thread, 1);
    return 0;
}

/* As decode_attention_bf16.c's ps_decode_attention_bf16 with one thread, its tasks shared with the
   helpers; `fn` is that library's ps_attention_tasks_bf16, and the caller has checked the
   arguments (its ps_attention_args_bf16). The same bits as one thread. */
int ps_decode_attention_bf16_shared(void *fn, const uint16_t *q, long q_row, const uint16_t *k_cache,
                                    const uint16_t *v_cache, const int64_t *tables, long max_blocks,
                                    const int64_t *lens, uint16_t *out, long n, long heads, long kv_heads, long dim,
                                    long block_size, float scale, float *scratch, long scratch_per_thread) {
    if (!fn || kv_heads < 1 || heads % kv_heads) return -1;
    const attn_bf16_fn f = (attn_bf16_fn)fn;
    if (share_attention(ATTN_BF16, f, q, q_row, 2, k_cache, v_cache, tables, max_blocks, lens, out, n, heads,
                        kv_heads, dim, block_size, scale, scratch, scratch_per_thread))
        f(q, q_row, k_cache, v_cache, tables, max_blocks, lens, out, heads, kv_heads, dim, block_size, scale, scratch,
          0, n * kv_heads);
    return 0;
}

/* Publish `job` (its pool copies filled in), compute claims on the caller (from its own x and res
   where the kind reads them), then settle the helpers' claims into y. */
static int run_job(job_t job, const void *x, const void *res, void *y, int helpers) {
    if (pool.pinned) {
        const int here = sched_getcpu();
        if (here != pool.caller_cpu) pin_all(here);
    }
    const long M = job.M, cols = job.cols, elem = job.elem;
    job.per_chunk = (job.blocks + MAX_CHUNKS - 1) / MAX_CHUNKS;
    job.chunks = (job.blocks + job.per_chunk - 1) / job.per_chunk;
    job.parts = helpers + 1;
    /* Close the last job's counter before rewriting the job: a helper holding a stale copy of
       the job (its chunk count among it) can then never claim in the old generation. */
    __atomic_store_n(&pool.next, ((uint64_t)pool.last_gen << 32) | 0xffffffffu, __ATOMIC_SEQ_CST);
    const uint32_t g = ++pool.last_gen;
    pool.job = job;
    __atomic_store_n(&pool.next, (uint64_t)g << 32, __ATOMIC_RELEASE);
    __atomic_store_n(&pool.gen, g, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&pool.sleeping, __ATOMIC_SEQ_CST)) futex(&pool.gen, FUTEX_WAKE_PRIVATE, helpers);
    const job_t *j = &pool.job;
    const char *sb = j->scratch;
    char *yb = (char *)y;
    long c;
    while ((c = claim(g, j)) >= 0) {
        long b0, b1;
        chunk_blocks(j, c, &b0, &b1);
        run_blocks(j, x, res, y, b0, b1);
        __atomic_store_n(&pool.state[c], STATE(g, 0, MINE), __ATOMIC_RELAXED);
    }
    /* Settle the chunks helpers claimed. */
    long wait_from = 0;
    for (c = 0; c < j->chunks; c += span(j, c)) {
        uint64_t s = __atomic_load_n(&pool.state[c], __ATOMIC_ACQUIRE);
        if (s == STATE(g, 0, MINE)) continue;
        for (;;) {
            if ((uint32_t)(s >> 32) == g && (s & 0xff) == DONE) {
                const long h = (long)((s >> 8) & 0xffffff);
                long b0, b1;
                chunk_blocks(j, c, &b0, &b1);
                const long c0 = j->block_cols * b0, c1 = j->block_cols * b1 < cols ? j->block_cols * b1 : cols;
                const char *from = sb + h * M * cols * elem;
                for (long r = 0; r < M; r++)
                    memcpy(yb + (r * cols + c0) * elem, from + (r * cols + c0) * elem, (size_t)((c1 - c0) * elem));
                pool.helped++;
                break;
            }
            if (!wait_from) wait_from = now_ns();
            if (now_ns() - wait_from < pool.steal_ns) {
                _mm_pause();
                s = __atomic_load_n(&pool.state[c], __ATOMIC_ACQUIRE);
                continue;
            }
            /* Its helper is descheduled (or has not marked its claim yet): take it back. */
            if (__atomic_compare_exchange_n(&pool.state[c], &s, STATE(g, 0, TAKEN), 0, __ATOMIC_ACQ_REL,
                                            __ATOMIC_ACQUIRE)) {
                long b0, b1;
                chunk_blocks(j, c, &b0, &b1);
                run_blocks(j, x, res, y, b0, b1);
                pool.taken++;
                break;
            }
            /* s now holds the state that beat us (done meanwhile): loop to copy it */
        }
    }
    if (wait_from) pool.waited_ns += now_ns() - wait_from;
    return 0;
}
