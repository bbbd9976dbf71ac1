/* One translation unit of the C kernels (cpu_ops.c and sample.c use paged_decode.c's vector exp
 * and bf16 helpers; sample.c, cpu_ops.c's argmax), compiled once per instruction set by setup.py, its entry points renamed per build
 * (kernels.h). */
#include "paged_decode.c"
#include "cpu_ops.c"
#include "sample.c"
#include "decode_gemm.c"
#include "lora.c"
