/* The argument checks of the paged decode attention, one definition for both kernels
 * (decode_attention_bf16.c, layer_f32_avx2.c: built into different libraries). */
#ifndef PHASESPLIT_ATTENTION_ARGS_H
#define PHASESPLIT_ATTENTION_ARGS_H
#include <stdint.h>

#define MAX_GROUP 16 /* query heads per KV head the kernels handle */
#define MAX_DIM 256

/* 0 if a decode attention call takes these arguments: -1 the shape (dim a multiple of dim_align,
   at most MAX_DIM; whole groups of at most MAX_GROUP), -2 a length (empty, past its block table, or
   more scores than a thread's scratch holds). */
static inline int ps_attention_args(const int64_t *lens, long n, long heads, long kv_heads, long dim, long dim_align,
                                    long block_size, long max_blocks, long scratch_per_thread) {
    if (dim % dim_align || dim > MAX_DIM || kv_heads < 1 || heads % kv_heads || heads / kv_heads > MAX_GROUP)
        return -1;
    const long group = heads / kv_heads;
    for (long i = 0; i < n; i++)
        if (lens[i] < 1 || group * lens[i] > scratch_per_thread || (lens[i] - 1) / block_size >= max_blocks)
            return -2;
    return 0;
}

#endif
