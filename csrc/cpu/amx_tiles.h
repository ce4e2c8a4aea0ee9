// AMX tile primitives for the amx kernel (amx_kernel.h): the tile configuration and tile
// loads that the compiler may not reorder around. Part of the CPU kernel, inside its ISA
// namespace (see vec.h).
#pragma once

#if PAGED_ISA_AMX
// The 64-byte operand of ldtilecfg (palette 1: eight tiles of up to 16 rows of 64 bytes).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// GCC's _tile_loadd is an asm statement without a memory clobber: stores to the buffer it
// reads could be moved after it. The empty asm with one keeps them before.
#define PAGED_TILE_LOAD(tile, base, stride_bytes) \
  do {                                            \
    asm volatile("" ::: "memory");                \
    _tile_loadd(tile, base, stride_bytes);        \
  } while (0)
#endif  // PAGED_ISA_AMX
