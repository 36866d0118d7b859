// A hand-written AMX tile kernel for the GEMM engine's blocks and attention's block GEMMs: acc[32 x
// 32] (+)= A[32 x K] x 32 columns of a VNNI B, in 2 x 2 tiles (4 fp32 C tiles, 2 A tiles, 2 B
// tiles), K in steps of 32. Compiled with the AMX flags (amxopt/ops/build.py); called only on the
// amx tier, after amx_tiles_usable(). The block's loop is in amx_tile_block.h, which amx_emulated.cpp
// also compiles on software tiles: with AMXOPT_EMULATE_AMX=1 on a CPU without AMX, these entry points
// run that copy instead (for the tests: it is many times slower).
//
// Why not oneDNN's brgemm for this block: a brgemm call costs about 0.25 us of dispatch and tile
// configuration, which dominates small blocks: Wan's K = 64 patch embedding ran 2-2.6x faster here
// (6.97-8.98x Conv3d against 3.40x). At large K the two measured the same (784 x 1024 x 3072: 1.84
// against 1.86 TFLOP/s for eager, 2 threads of an AMX Xeon) before this kernel issued its tile
// loads ahead of the products (tile_block): paired calls in one process, 2 threads, put the
// pipelined loop 1.03-1.06x ahead of the plain one at M = 784 and 1280, level at M = 16 (where the
// weight stream is the limit). Tried in the same way and dropped: software prefetch of A 2 or 4
// steps ahead (0.69-0.86x), of B (0.93-0.98x), TILELOADDT1 for A (0.93-1.07x, no clear sign), and
// 2 or 8 column blocks per work item instead of 4 (0.74-1.03x).
// Packing A per K step (one sequential stream instead of 32 rows 2 KB apart) measured the same or
// slower (0.91-1.02x eager against 0.96-1.13x), so A is read in place.
//
// Tile state is per thread, and ATen's brgemm keeps its own configuration per thread: AmxTiles makes
// ATen forget it (cpublas::brgemm_release) before loading this kernel's, and releases the tiles at the
// end, so the next brgemm call configures afresh.
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMXOPT_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define AMXOPT_TILE_ZERO(t) _tile_zero(t)
#define AMXOPT_TILE_DOT(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMXOPT_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#include "amx_tile_block.h"

namespace amxopt {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes (their roles: amx_tile_block.h).
TileConfig make_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  return c;
}

}  // namespace

bool amx_tiles_usable() {
  // Linux hands out the AMX tile state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
  // XFEATURE_XTILEDATA); oneDNN asks too, asking again is harmless.
  static const bool ok = [] {
    constexpr int kReqXcompPerm = 0x1023, kXtiledata = 18;
    return cpu_tier() == Tier::Amx && (amx_emulated() || syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0);
  }();
  return ok;
}

AmxTiles::AmxTiles() {
  static const TileConfig config = make_config();
  at::native::cpublas::brgemm_release(true);
  if (!amx_emulated()) _tile_loadconfig(&config);  // software tiles have this configuration built in
}

AmxTiles::~AmxTiles() {
  if (!amx_emulated()) _tile_release();
}

void amx_tile_32x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc,
                    bool accumulate, OverlappedEpilogue* pending) {
  static const bool emulated = amx_emulated();  // a load and a branch per block, no call
  if (emulated) return amx_emulated_32x32(A, lda, panel, K, acc, ldc, accumulate, pending);
  tile_block<32>(A, lda, panel, K, acc, ldc, accumulate, pending);
}

void amx_tile_16x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc,
                    bool accumulate, OverlappedEpilogue* pending) {
  static const bool emulated = amx_emulated();
  if (emulated) return amx_emulated_16x32(A, lda, panel, K, acc, ldc, accumulate, pending);
  tile_block<16>(A, lda, panel, K, acc, ldc, accumulate, pending);
}

}  // namespace amxopt
