/* AMX BF16 limit of this machine: a register-only loop of TDPBF16PS (four independent accumulator
 * tiles fed by four source tiles, no memory traffic) on every OpenMP thread: the most a bf16 GEMM or
 * attention kernel on AMX tiles can reach here. On shared (virtual) cores it moves with what the
 * neighbours run, so bench_ops.py measures it in the same run as the kernels it compares.
 * Build and run:  gcc -O2 -mamx-tile -mamx-bf16 -fopenmp amx_peak.c -o amx_peak && ./amx_peak
 * Prints the total TFLOP/s over all threads (best of 3), or nothing and exit code 1 where the kernel
 * does not grant the AMX tile state. */
#include <omp.h>
#include <stdio.h>

#include "amx_tiles.h"

int main(void) {
  if (!amx_permitted()) return 1;
  const long iters = 4000000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = 0, t1 = 0;
    int threads = 1;
#pragma omp parallel
    {
      configure_tiles();
      static __attribute__((aligned(64))) const uint16_t src[16 * 32] = {0};
      _tile_loadd(4, src, 64);
      _tile_loadd(5, src, 64);
      _tile_loadd(6, src, 64);
      _tile_loadd(7, src, 64);
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
#pragma omp barrier
#pragma omp master
      {
        threads = omp_get_num_threads();
        t0 = now();
      }
      for (long it = 0; it < iters; ++it) {
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
#pragma omp barrier
#pragma omp master
      t1 = now();
      _tile_release();
    }
    /* each TDPBF16PS: 16 x 16 outputs, 32 bf16 products each, mul + add */
    const double flops = (double)iters * 4 * 16 * 16 * 32 * 2 * threads;
    const double tf = flops / (t1 - t0) / 1e12;
    if (tf > best) best = tf;
  }
  printf("%.3f\n", best);
  return 0;
}
