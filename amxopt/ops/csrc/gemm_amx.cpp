// A hand-written AMX tile kernel for the GEMM engine's blocks and attention's block GEMMs: acc[32 x
// 32] (+)= A[32 x K] x 32 columns of a VNNI B, in 2 x 2 tiles (4 fp32 C tiles, 2 A tiles, 2 B
// tiles), K in steps of 32. Compiled with the AMX flags (amxopt/ops/build.py); called only on the
// amx tier, after amx_tiles_usable().
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

#include "common.h"

namespace amxopt {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-3: C (16 rows x 16 fp32), 4-5: A (16 rows x 32 bf16), 6-7: B (16 k pairs x 16 columns x 2).
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
    return cpu_tier() == Tier::Amx && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

AmxTiles::AmxTiles() {
  static const TileConfig config = make_config();
  at::native::cpublas::brgemm_release(true);
  _tile_loadconfig(&config);
}

AmxTiles::~AmxTiles() { _tile_release(); }

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
    _tile_loadd(0, acc, sc);
    _tile_loadd(1, acc + 16, sc);
    if constexpr (both) {
      _tile_loadd(2, acc + 16 * ldc, sc);
      _tile_loadd(3, acc + 16 * ldc + 16, sc);
    }
  } else {
    _tile_zero(0);
    _tile_zero(1);
    if constexpr (both) {
      _tile_zero(2);
      _tile_zero(3);
    }
  }
  const char* a0 = reinterpret_cast<const char*>(A);
  const char* a1 = reinterpret_cast<const char*>(A + 16 * lda);
  const char* b = reinterpret_cast<const char*>(panel);
  const int64_t sa = lda * 2, sb = 128;  // bytes between A rows, between B rows (k pairs)
  _tile_loadd(4, a0, sa);
  _tile_loadd(6, b, sb);
  // rows of the pending epilogue per K step, so that the last step's share ends it
  const int64_t share = pending ? (pending->rows - pending->done + K / 32 - 1) / (K / 32) : 0;
  int64_t k = 0;  // the k pairs of step k start sb * k / 2 bytes into B
  for (;; k += 32) {
    if (stream)  // the next step's 2 KB of B into L1 (32 lines), as far ahead as its first use
      for (int l = 0; l < 32; ++l) _mm_prefetch(b + sb * (k / 2 + 16) + 64 * l, _MM_HINT_T0);
    _tile_loadd(7, b + sb * k / 2 + 64, sb);
    if constexpr (both) _tile_loadd(5, a1 + 2 * k, sa);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (pending) pending->run(share);
    if (k + 32 == K) break;
    _tile_loadd(4, a0 + 2 * k + 64, sa);
    if constexpr (both) _tile_dpbf16ps(2, 5, 6);
    _tile_loadd(6, b + sb * (k / 2 + 16), sb);
    if constexpr (both) _tile_dpbf16ps(3, 5, 7);
  }
  if constexpr (both) {
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, acc, sc);
  _tile_stored(1, acc + 16, sc);
  if constexpr (both) {
    _tile_stored(2, acc + 16 * ldc, sc);
    _tile_stored(3, acc + 16 * ldc + 16, sc);
  }
}

}  // namespace

void amx_tile_32x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc,
                    bool accumulate, OverlappedEpilogue* pending) {
  tile_block<32>(A, lda, panel, K, acc, ldc, accumulate, pending);
}

void amx_tile_16x32(const bf16* A, int64_t lda, const bf16* panel, int64_t K, float* acc, int64_t ldc,
                    bool accumulate, OverlappedEpilogue* pending) {
  tile_block<16>(A, lda, panel, K, acc, ldc, accumulate, pending);
}

}  // namespace amxopt
