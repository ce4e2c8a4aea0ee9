// AMX tile primitives for the amx kernel (amx_kernel.h): the tile configuration, and one
// macro per tile instruction it uses. The instructions' intrinsics take literal tile numbers
// (GCC pastes them into the assembly), so these are macros, not functions. In a compile
// with PAGED_AMX_EMULATED (isa_amx_emulated.cpp) they run the software model of
// amx_tile_model.h instead, which checks every use against the configuration. Part of the
// CPU kernel, inside its ISA namespace (see vec.h).
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

#if PAGED_AMX_EMULATED
#include "amx_tile_model.h"

#define PAGED_TILE_CONFIG(config) tile_model_loadconfig(config)
#define PAGED_TILE_ZERO(tile) tile_model_zero(tile)
#define PAGED_TILE_LOAD(tile, base, stride_bytes) tile_model_loadd(tile, base, stride_bytes)
#define PAGED_TILE_STORE(tile, base, stride_bytes) tile_model_stored(tile, base, stride_bytes)
#define PAGED_TILE_DPBF16PS(c, a, b) tile_model_dpbf16ps(c, a, b)
#define PAGED_TILE_RELEASE() tile_model_release()
#else
// GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the configuration: the stores
// of its rows and widths could be dropped as dead. The empty asm with a memory clobber
// keeps them.
#define PAGED_TILE_CONFIG(config)      \
  do {                                 \
    asm volatile("" ::: "memory");     \
    _tile_loadconfig(config);          \
  } while (0)
#define PAGED_TILE_ZERO(tile) _tile_zero(tile)
// GCC's _tile_loadd is an asm statement without a memory clobber: stores to the buffer it
// reads could be moved after it. The empty asm with one keeps them before.
#define PAGED_TILE_LOAD(tile, base, stride_bytes) \
  do {                                            \
    asm volatile("" ::: "memory");                \
    _tile_loadd(tile, base, stride_bytes);        \
  } while (0)
// _tile_stored declares no memory written: the empty asm after it keeps later loads of the
// stored rows after it.
#define PAGED_TILE_STORE(tile, base, stride_bytes) \
  do {                                             \
    _tile_stored(tile, base, stride_bytes);        \
    asm volatile("" ::: "memory");                 \
  } while (0)
#define PAGED_TILE_DPBF16PS(c, a, b) _tile_dpbf16ps(c, a, b)
#define PAGED_TILE_RELEASE() _tile_release()
#endif  // PAGED_AMX_EMULATED
#endif  // PAGED_ISA_AMX
