/* Where a 2 x 2 AMX tile kernel loses its speed on this machine: one thread runs the same inner loop
 * (per K step of 32: 2 A tiles, 2 B tiles, 4 TDPBF16PS into 4 fp32 C tiles, the loop of
 * amxopt/ops/csrc/gemm_amx.cpp) with its operands in different places, interleaved over 11 rounds
 * (medians, as a share of the register-only loop measured in the same rounds):
 *   registers  no loads at all (amx_peak.c's loop, one thread);
 *   L1         one 32-row A block and one 32-column B panel of K = 256 (32 KB), reused;
 *   L2         the same with K = 1024 (128 KB);
 *   GEMM       M x K x N in gemm_blocks' order (groups of 4 column panels, all row tiles of A, whole
 *              K per call, A read in place): what the op's loop gets on its own, without threads.
 * Then the GEMM loop on 2 threads, each on its own half of the columns (shared A), against 1 thread.
 * Build and run:  gcc -O2 -mamx-tile -mamx-bf16 -fopenmp amx_tile_probe.c -o probe && ./probe [M K N]
 * (default 768 1024 1536, one thread's share of the 784 x 1024 x 3072 linear; M a multiple of 32, K
 * of 32, N of 128). Exit code 1 where the kernel does not grant the AMX tile state. */
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

#include "amx_tiles.h"

#define ROUNDS 11

/* C[32 x 32] = A[32 x K] (row stride lda bytes) x one VNNI panel ([K/2][32][2], 128-byte rows). */
static void block(const char* a, long lda, const char* b, long K, float* c) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (long k = 0; k < K; k += 32, b += 2048) {
    _tile_loadd(4, a + 2 * k, lda);
    _tile_loadd(6, b, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(7, b + 64, 128);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a + 16 * lda + 2 * k, lda);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, 128);
  _tile_stored(1, c + 16, 128);
  _tile_stored(2, c + 512, 128);
  _tile_stored(3, c + 528, 128);
}

static long M = 768, K = 1024, N = 1536;
static char *A, *Bs[2];

/* Each case does M x K x N multiply-adds' worth of work; returns GFLOP/s. */
static double run(int which, const char* B, float* c) {
  double t0 = now();
  if (which == 0) {
    for (long i = 0; i < M * K * N / (32 * 32 * 32); ++i) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  } else if (which == 1 || which == 2) {
    const long k = which == 1 ? 256 : 1024;
    for (long i = 0; i < M * K * N / (32 * 32 * k); ++i) block(A, 2 * k, B, k, c);
  } else {
    for (long g = 0; g < N / 128; ++g)
      for (long m = 0; m < M; m += 32)
        for (long nb = 4 * g; nb < 4 * g + 4; ++nb) block(A + m * K * 2, K * 2, B + nb * K * 64, K, c);
  }
  return 2.0 * M * K * N / (now() - t0) / 1e9;
}

static int by_value(const void* x, const void* y) {
  const double a = *(const double*)x, b = *(const double*)y;
  return (a > b) - (a < b);
}

static double median(double* v) {
  qsort(v, ROUNDS, sizeof *v, by_value);
  return v[ROUNDS / 2];
}

int main(int argc, char** argv) {
  if (argc > 3) M = atol(argv[1]), K = atol(argv[2]), N = atol(argv[3]);
  if (M <= 0 || M % 32 || K % 32 || K < 1024 || N <= 0 || N % 128) {
    fprintf(stderr, "amx_tile_probe: M must be a multiple of 32, K of 32 and >= 1024, N of 128\n");
    return 2;
  }
  if (!amx_permitted()) return 1;
  A = aligned_alloc(4096, M * K * 2);
  memset(A, 0, M * K * 2);
  for (int t = 0; t < 2; ++t) Bs[t] = aligned_alloc(4096, K * N * 2), memset(Bs[t], 0, K * N * 2);
  static const char* names[] = {"registers", "L1 (32 KB)", "L2 (128 KB)", "GEMM loop"};
  double one[4][ROUNDS], two[ROUNDS], solo[ROUNDS];
#pragma omp parallel num_threads(2)
  {
    const int me = omp_get_thread_num();
    float* c = aligned_alloc(64, 32 * 32 * 4);
    configure_tiles();
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int r = 0; r < ROUNDS; ++r) {
      if (me == 0)
        for (int w = 0; w < 4; ++w) one[w][r] = run(w, Bs[0], c);
#pragma omp barrier
      double t0 = now();
      run(3, Bs[me], c);
#pragma omp barrier
      if (me == 0) two[r] = 2 * 2.0 * M * K * N / (now() - t0) / 1e9, solo[r] = one[3][r];
    }
    _tile_release();
    free(c);
  }
  printf("one thread, M=%ld K=%ld N=%ld (GFLOP/s, median of %d rounds)\n", M, K, N, ROUNDS);
  const double peak = median(one[0]);
  for (int w = 0; w < 4; ++w) {
    const double g = w ? median(one[w]) : peak;
    printf("  %-12s %6.0f  %3.0f%%\n", names[w], g, 100 * g / peak);
  }
  const double g2 = median(two), g1 = median(solo);
  printf("GEMM loop on 2 threads: %.0f GFLOP/s, %.2fx one thread\n", g2, g2 / g1);
  return 0;
}
