/* The C kernels' entry points (paged_decode.c, cpu_ops.c, sample.c, decode_gemm.c, lora.c), declared once per
 * build of them: setup.py compiles the three files once per instruction set, each build's symbols
 * prefixed (minirt_generic_, minirt_v3_, minirt_v4_, minirt_v4bf16_), and ops.cpp picks one at
 * run time from the CPU's features. */
#pragma once
#include <stdint.h>

#define MINIRT_KERNELS(X)                                                                         \
    X(int64_t, kv_write, (const char *, int64_t, int64_t, const int64_t *, int64_t, int64_t,      \
                          int64_t, int64_t, char *))                                              \
    X(void, rope_f32, (const float *, int64_t, const float *, const float *, const int64_t *,     \
                       int64_t, int64_t, int64_t, float *))                                       \
    X(void, rms_norm_f32, (const float *, int64_t, const float *, int64_t, int64_t, float, float *)) \
    X(void, argmax_f32, (const float *, int64_t, int64_t, int64_t, int64_t *))                    \
    X(void, sample_f32, (const float *, int64_t, const int64_t *, int64_t, int64_t, const float *,  \
                         const float *, const float *, const double *, int64_t *))                \
    X(void, topk_f32, (const float *, int64_t, const int64_t *, int64_t, int64_t, int64_t, float *)) \
    X(void, silu_mul_f32, (const float *, int64_t, int64_t, int64_t, float *))                    \
    X(void, silu_mul_bf16, (const uint16_t *, int64_t, int64_t, int64_t, uint16_t *))             \
    X(int64_t, paged_decode_vector, (int64_t, int64_t))                                           \
    X(void, paged_decode_f32, (const void *, const void *, const void *, const int64_t *,         \
                               const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t,      \
                               int64_t, int64_t, float, void *, int64_t))                         \
    X(void, paged_decode_bf16, (const void *, const void *, const void *, const int64_t *,        \
                                const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t,     \
                                int64_t, int64_t, float, void *, int64_t))                        \
    X(int64_t, rows_packed_len, (int64_t, int64_t))                                               \
    X(int64_t, rows_scratch_len, (int64_t, int64_t))                                              \
    X(void, rows_pack_f32, (const float *, int64_t, int64_t, float *))                            \
    X(int, rows_gemm_vector, (void))                                                              \
    X(void, rows_gemm_f32, (const float *, int64_t, int64_t, const float *, const float *,        \
                            int64_t, int64_t, float *, float *))                                  \
    X(int64_t, rows_packed_len_bf16, (int64_t, int64_t))                                          \
    X(int64_t, rows_scratch_len_bf16, (int64_t, int64_t))                                         \
    X(void, rows_pack_bf16, (const uint16_t *, int64_t, int64_t, uint32_t *))                     \
    X(int, rows_gemm_bf16_vector, (void))                                                         \
    X(void, rows_gemm_bf16, (const uint16_t *, int64_t, int64_t, const uint32_t *,                \
                             const uint16_t *, int64_t, int64_t, uint32_t *, uint16_t *))         \
    X(void, lora_add_f32, (const float *, int64_t, const float *, const float *, const int64_t *,  \
                           const float *, const int64_t *, int64_t, int64_t, int64_t, int64_t,    \
                           int64_t, int64_t, int64_t *, float *, int64_t))                        \
    X(void, lora_add_bf16, (const uint16_t *, int64_t, const uint16_t *, const uint16_t *,        \
                            const int64_t *, const float *, const int64_t *, int64_t, int64_t,    \
                            int64_t, int64_t, int64_t, int64_t, int64_t *, uint16_t *, int64_t))
