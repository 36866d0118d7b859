// VecKernels for any x86-64 CPU (at::vec's portable DEFAULT implementation); built with no ISA flags.
#include "vec_kernels.h"

AMXOPT_VEC_TABLE(kVecDefault, "default")
