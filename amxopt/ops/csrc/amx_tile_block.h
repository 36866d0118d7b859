// The AMX tile kernel's block (gemm_amx.cpp), written once for two translation units: gemm_amx.cpp
// runs it on the CPU's tiles, amx_emulated.cpp on software tiles, so that the amx tier's drivers and
// this kernel's addressing are tested on CPUs without AMX too (AMXOPT_EMULATE_AMX=1, cpu.cpp). The
// includer defines, for tile registers given as literal numbers (the intrinsics paste them into
// their assembly):
//   AMXOPT_TILE_LOAD(t, base, stride)   tile t <- 16 rows of 64 bytes, stride bytes apart
//   AMXOPT_TILE_ZERO(t)
//   AMXOPT_TILE_DOT(c, a, b)            fp32 tile c += bf16 tile a x bf16 VNNI tile b
//   AMXOPT_TILE_STORE(t, base, stride)
// Tiles 0-3: C (16 rows x 16 fp32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 k pairs x 16 columns x 2).
#pragma once

#include <immintrin.h>

#include "common.h"

namespace amxopt {
namespace {

// acc rows [0, Rows) of a 32-column block: Rows = 32 uses both A tiles (4 C tiles), 16 the first.
// Software-pipelined: a load into a tile cannot start before the last product reading that tile
// is done (8 tile registers, no renaming to rely on), and a product waits for its loads; placed
// right before the products that use them, the loads' latency adds to every step. Each load is
// therefore issued right after the last product reading its tile and one or two products before
// the first product that needs it (the next step's A0 and B0 go out before the current step's A1
// products), so that the latency hides behind the products.
// B is a panel of 32 columns ([K / 2][32][2]); acc has ldc floats per row; with accumulate, the
// products add to what acc holds. With stream (16 rows: 2 products per 2 KB step of B, which then
// comes from memory, not the caches), each step prefetches the next one's B (in-process A/B, 2
// threads of an AMX Xeon: 1.07-1.10x at M = 16; 2-3 steps ahead, or into L2, 0.96-1.06x).
template <int Rows>
void tile_block(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc, bool accumulate,
                OverlappedEpilogue* pending) {
  constexpr bool stream = Rows == 16;
  constexpr bool both = Rows == 32;
  const int64_t sc = ldc * 4;
  if (accumulate) {
    AMXOPT_TILE_LOAD(0, acc, sc);
    AMXOPT_TILE_LOAD(1, acc + 16, sc);
    if constexpr (both) {
      AMXOPT_TILE_LOAD(2, acc + 16 * ldc, sc);
      AMXOPT_TILE_LOAD(3, acc + 16 * ldc + 16, sc);
    }
  } else {
    AMXOPT_TILE_ZERO(0);
    AMXOPT_TILE_ZERO(1);
    if constexpr (both) {
      AMXOPT_TILE_ZERO(2);
      AMXOPT_TILE_ZERO(3);
    }
  }
  const char* a0 = reinterpret_cast<const char*>(A);
  const char* a1 = reinterpret_cast<const char*>(A + 16 * lda);
  const char* b = reinterpret_cast<const char*>(panel);
  const int64_t sa = lda * 2, sb = 128;  // bytes between A rows, between B rows (k pairs)
  AMXOPT_TILE_LOAD(4, a0, sa);
  AMXOPT_TILE_LOAD(6, b, sb);
  // rows of the pending epilogue per K step, so that they end by the last of the steps they are spread
  // over: this call's, or the more that pending->steps names (counted down)
  const int64_t steps = pending ? std::max(K / 32, pending->steps) : 1;
  const int64_t share = pending ? (pending->rows - pending->done + steps - 1) / steps : 0;
  if (pending) pending->steps -= std::min(pending->steps, K / 32);
  int64_t k = 0;  // the k pairs of step k start sb * k / 2 bytes into B
  for (;; k += 32) {
    if (stream)  // the next step's 2 KB of B into L1 (32 lines), as far ahead as its first use
      for (int l = 0; l < 32; ++l) _mm_prefetch(b + sb * (k / 2 + 16) + 64 * l, _MM_HINT_T0);
    AMXOPT_TILE_LOAD(7, b + sb * k / 2 + 64, sb);
    if constexpr (both) AMXOPT_TILE_LOAD(5, a1 + 2 * k, sa);
    AMXOPT_TILE_DOT(0, 4, 6);
    AMXOPT_TILE_DOT(1, 4, 7);
    if (pending) pending->run(share);
    if (k + 32 == K) break;
    AMXOPT_TILE_LOAD(4, a0 + 2 * k + 64, sa);
    if constexpr (both) AMXOPT_TILE_DOT(2, 5, 6);
    AMXOPT_TILE_LOAD(6, b + sb * (k / 2 + 16), sb);
    if constexpr (both) AMXOPT_TILE_DOT(3, 5, 7);
  }
  if constexpr (both) {
    AMXOPT_TILE_DOT(2, 5, 6);
    AMXOPT_TILE_DOT(3, 5, 7);
  }
  AMXOPT_TILE_STORE(0, acc, sc);
  AMXOPT_TILE_STORE(1, acc + 16, sc);
  if constexpr (both) {
    AMXOPT_TILE_STORE(2, acc + 16 * ldc, sc);
    AMXOPT_TILE_STORE(3, acc + 16 * ldc + 16, sc);
  }
}

}  // namespace
}  // namespace amxopt
