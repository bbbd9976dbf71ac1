/* One translation unit of the C kernels (cpu_ops.c uses paged_decode.c's vector exp and bf16
 * helpers), compiled once per instruction set by setup.py, its entry points renamed per build
 * (kernels.h). */
#include "paged_decode.c"
#include "cpu_ops.c"
#include "decode_gemm.c"
