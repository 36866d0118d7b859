/* What the AMX tools (amx_peak.c, amx_tile_probe.c) share: the Linux permission for the tile state,
 * the tile configuration they all use (8 tiles of 16 rows x 64 bytes), and a clock. */
#ifndef AMXOPT_TOOLS_AMX_TILES_H
#define AMXOPT_TOOLS_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Whether Linux grants this process the AMX tile state (it must ask first). */
static inline int amx_permitted(void) { return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; }

/* Palette 1, tiles 0-7 each 16 rows x 64 bytes, on the calling thread. */
static inline void configure_tiles(void) {
  struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  } __attribute__((packed)) cfg;
  memset(&cfg, 0, sizeof cfg);
  cfg.palette = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.bytes_per_row[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

static inline double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#endif
