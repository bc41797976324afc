// AMX's tile state, for the kernels that use the tile unit (paged attention, the decode linears).
#pragma once
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <immintrin.h>

namespace servelab {

// Whether Linux granted this process AMX's tile data (arch_prctl ARCH_REQ_XCOMP_PERM for
// XTILEDATA), asked once: without it the first tile instruction faults.
static bool amx_tiles_granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // arch_prctl: ask for AMX tile state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// This thread's tile registers as 8 tiles of 16 rows x 64 bytes (what every AMX kernel here uses).
static inline void configure_tiles() {
  TileConfig c{};
  c.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  _tile_loadconfig(&c);
}

}  // namespace servelab
#endif
