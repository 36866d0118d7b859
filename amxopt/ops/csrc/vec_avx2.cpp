// VecKernels for AVX2 + FMA CPUs (e.g. AMD Zen 3); built with -mavx2 -mfma -mf16c (amxopt/ops/build.py).
#include "vec_kernels.h"

AMXOPT_VEC_TABLE(kVecAvx2, "avx2")
