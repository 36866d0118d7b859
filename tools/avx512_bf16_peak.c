/* AVX-512-BF16 peak of this machine: a register-only loop of VDPBF16PS (24 independent accumulators,
 * no memory traffic) on every OpenMP thread: the limit a bf16 kernel without AMX can approach.
 * Build and run:  gcc -O3 -march=x86-64-v4 -mavx512bf16 -fopenmp avx512_bf16_peak.c -o peak && ./peak
 * Prints the total TFLOP/s over all threads (best of 3). */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
  const long iters = 4000000;
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) {
    double t0 = 0, t1 = 0;
    float sink = 0;
    int threads = 1;
#pragma omp parallel reduction(+ : sink)
    {
      __m512 acc[24];
      for (int i = 0; i < 24; i++) acc[i] = _mm512_setzero_ps();
      const __m512bh a = (__m512bh)_mm512_set1_epi32(0x3f803f80), b = (__m512bh)_mm512_set1_epi32(0x3c003c00);
#pragma omp barrier
#pragma omp master
      {
        threads = omp_get_num_threads();
        t0 = now();
      }
      for (long it = 0; it < iters; it++) {
#pragma GCC unroll 24
        for (int i = 0; i < 24; i++) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
      }
#pragma omp barrier
#pragma omp master
      t1 = now();
      for (int i = 0; i < 24; i++) sink += _mm512_reduce_add_ps(acc[i]);
    }
    const double flops = (double)iters * 24 * 16 * 4 * threads; /* 16 lanes x 2 products x (mul + add) */
    const double tf = flops / (t1 - t0) / 1e12;
    if (tf > best) best = tf;
    if (sink == 1234.5f) printf("-");
  }
  printf("%.3f\n", best);
  return 0;
}
