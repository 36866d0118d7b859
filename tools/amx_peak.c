/* AMX BF16 limit of this machine: a register-only loop of TDPBF16PS (four independent accumulator
 * tiles fed by four source tiles, no memory traffic) on every OpenMP thread: the most a bf16 GEMM or
 * attention kernel on AMX tiles can reach here. On shared (virtual) cores it moves with what the
 * neighbours run, so bench_ops.py measures it in the same run as the kernels it compares.
 * Build and run:  gcc -O2 -mamx-tile -mamx-bf16 -fopenmp amx_peak.c -o amx_peak && ./amx_peak
 * Prints the total TFLOP/s over all threads (best of 3), or nothing and exit code 1 where the kernel
 * does not grant the AMX tile state. */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
  uint8_t palette;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t bytes_per_row[16];
  uint8_t rows[16];
} __attribute__((packed));

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return 1;
  const long iters = 4000000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = 0, t1 = 0;
    int threads = 1;
#pragma omp parallel
    {
      struct tile_config cfg;
      memset(&cfg, 0, sizeof cfg);
      cfg.palette = 1;
      for (int t = 0; t < 8; ++t) {
        cfg.rows[t] = 16;
        cfg.bytes_per_row[t] = 64;
      }
      _tile_loadconfig(&cfg);
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
