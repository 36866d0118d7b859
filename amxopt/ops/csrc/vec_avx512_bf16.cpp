// VecKernels for AVX-512 CPUs with AVX512-BF16 (Zen 4, Xeons with AMX): the AVX-512 table, with
// bf16 rounding in one instruction (round_bf16); built with those flags (amxopt/ops/build.py).
#include "vec_kernels.h"

AMXOPT_VEC_TABLE(kVecAvx512Bf16, "avx512_bf16")
