/* The layout of a model's projections and layers that the one-call decode steps read
 * (decode_step_f32.c, decode_step_bf16.c; cpu_decode_step.py's ctypes structures mirror it). */
#ifndef PHASESPLIT_DECODE_STEP_H
#define PHASESPLIT_DECODE_STEP_H
#include <stdint.h>

/* One projection: bf16 tiles (cpu_gemm's layout, row_bytes 0; swiglu: gate/up tiles alternating,
   the epilogue fused) or GGUF blocks (row_bytes per weight row, qtype). n: output rows of W. */
typedef struct {
    const void *w;
    long n, k, row_bytes;
    int qtype, swiglu;
} ps_proj_t;

/* Norm weights and caches in the activations' dtype (fp32, or bf16); caches [slots, kv_heads, dim]. */
typedef struct {
    ps_proj_t qkv, o, gate_up, down;
    const void *attn_norm, *mlp_norm;
    void *k_cache, *v_cache;
} ps_layer_t;

#endif
