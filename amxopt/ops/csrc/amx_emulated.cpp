// AMX tiles in software, so that the amx tier runs where the CPU has no AMX: with AMXOPT_EMULATE_AMX=1
// on a CPU with AVX-512-BF16 but without AMX (cpu.cpp), the tier is amx and the tile kernel's entry
// points (gemm_amx.cpp) run the same block loop (amx_tile_block.h) on the tiles below. The amx tier's
// drivers (gemm.cpp's tiled and K-blocked engines, attention's tile path, conv2d's GEMM path) and
// the kernel's addressing are then tested on every such CPU; only the speed needs an AMX CPU.
//
// The tiles are eight thread-local 16 x 64-byte registers, in the one configuration the kernel
// loads (16 rows x 64 bytes each). A product follows TDPBF16PS's definition: per row of C, per k
// pair in order, c += a0 * b0 then c += a1 * b1 in fp32 (the hardware also flushes denormals, which
// this does not). Plain x86-64 code, many times slower than the hardware: for tests only.
#include <atomic>
#include <cstring>

#include "common.h"

namespace amxopt {
namespace {

struct alignas(64) Tiles {
  uint8_t bytes[8][16][64];
};
thread_local Tiles tiles;
std::atomic<int64_t> blocks_run{0};

void tile_load(int t, const void* base, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(tiles.bytes[t][r], static_cast<const char*>(base) + r * stride, 64);
}

void tile_zero(int t) { std::memset(tiles.bytes[t], 0, sizeof(tiles.bytes[t])); }

void tile_store(int t, void* base, int64_t stride) {
  for (int r = 0; r < 16; ++r) std::memcpy(static_cast<char*>(base) + r * stride, tiles.bytes[t][r], 64);
}

// C (16 x 16 fp32) += A (16 rows x 16 k pairs) x B (16 k pairs x 16 columns x 2).
void tile_dot(int c, int a, int b) {
  float C[16][16];
  bf16 A[16][32], B[16][32];
  std::memcpy(C, tiles.bytes[c], sizeof(C));
  std::memcpy(A, tiles.bytes[a], sizeof(A));
  std::memcpy(B, tiles.bytes[b], sizeof(B));
  for (int m = 0; m < 16; ++m)
    for (int k = 0; k < 16; ++k) {
      const float a0 = float(A[m][2 * k]), a1 = float(A[m][2 * k + 1]);
      for (int n = 0; n < 16; ++n) {
        C[m][n] += a0 * float(B[k][2 * n]);
        C[m][n] += a1 * float(B[k][2 * n + 1]);
      }
    }
  std::memcpy(tiles.bytes[c], C, sizeof(C));
}

}  // namespace
}  // namespace amxopt

#define AMXOPT_TILE_LOAD(t, base, stride) tile_load(t, base, stride)
#define AMXOPT_TILE_ZERO(t) tile_zero(t)
#define AMXOPT_TILE_DOT(c, a, b) tile_dot(c, a, b)
#define AMXOPT_TILE_STORE(t, base, stride) tile_store(t, base, stride)
#include "amx_tile_block.h"

namespace amxopt {

void amx_emulated_32x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc,
                        bool accumulate, OverlappedEpilogue* pending) {
  blocks_run.fetch_add(1, std::memory_order_relaxed);
  tile_block<32>(A, lda, panel, K, acc, ldc, accumulate, pending);
}

void amx_emulated_16x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc,
                        bool accumulate, OverlappedEpilogue* pending) {
  blocks_run.fetch_add(1, std::memory_order_relaxed);
  tile_block<16>(A, lda, panel, K, acc, ldc, accumulate, pending);
}

int64_t amx_emulated_blocks() { return blocks_run.load(); }

}  // namespace amxopt
