/* GGUF block types as quant_gemm.c and quant_x16.c (two translation units, built for different
 * instruction sets) both read them: one definition of the type ids, the packed-type offset and
 * the bytes per block. cpu_quant.py mirrors these numbers (Q8_0, X16, BLOCK_BYTES). */
#ifndef PHASESPLIT_QUANT_BLOCKS_H
#define PHASESPLIT_QUANT_BLOCKS_H

#define QK 32 /* weights per block */
#define T_Q4_0 2
#define T_Q4_1 3
#define T_Q8_0 8
#define X16 100 /* + the GGUF type: 16 rows interleaved (quant_x16.c) */
/* Tiles of 16 rows quant_x16.c computes in one pass over the activation rows: callers that share a
 * call's tiles among threads hand them out this many at a time. */
#define X16_PASS 2
/* Activation rows per pass over a weight in the wide (prefill) calls: their int8 copy (up to
 * 128 x K bytes) stays in L2 while every tile goes by, instead of all rows streaming from memory
 * once per tile. */
#define Q_ROW_BLOCK 128

/* Bytes of one block of a GGUF type, packed or not; 0 for a type the kernels do not take. */
static inline long block_bytes(int type) {
  if (type > X16) type -= X16;
  return type == T_Q8_0 ? 34 : type == T_Q4_1 ? 20 : type == T_Q4_0 ? 18 : 0;
}

#endif
