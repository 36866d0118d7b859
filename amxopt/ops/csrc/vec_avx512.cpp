// VecKernels for AVX-512 F/BW/VL/DQ CPUs (Zen 4, Xeon); built with the AVX-512 flags (amxopt/ops/build.py).
#include "vec_kernels.h"

AMXOPT_VEC_TABLE(kVecAvx512, "avx512")
