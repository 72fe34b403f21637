// What kvserve's AMX kernels share: whether AMX is compiled in (KVSERVE_AMX), the tile
// configuration record, and Linux's permission to use the tile state.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace kvserve {

// The 64-byte record _tile_loadconfig reads (palette 1: 8 tiles of up to 16 x 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// _tile_loadconfig tells GCC it reads one byte of the record, so without the barrier the
// other fields' stores may be sunk past it (and the CPU faults on the half-built record).
inline void load_tile_config(const TileConfig& cfg) {
  asm volatile("" ::: "memory");
  _tile_loadconfig(&cfg);
}

// Linux hands out AMX state only to processes that ask (once). KVSERVE_DISABLE_AMX=1
// withholds it from every kernel, which then runs as on a CPU without AMX (Zen 4): the
// one switch for timing or testing those paths on an AMX host. Read once per process.
inline bool amx_permitted() {
  static const bool ok = [] {
    const char* off = std::getenv("KVSERVE_DISABLE_AMX");
    if (off && *off && std::strcmp(off, "0") != 0) return false;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  }();
  return ok;
}

}  // namespace kvserve
#endif
