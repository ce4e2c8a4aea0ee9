// Runs the AMX tile model (csrc/cpu/amx_tile_model.h, through amx_tiles.h's macros) on its
// own, one case per run, for tests/test_amx_tile_model.py:
//   dot M K N   reads A (M rows of 2K bf16), B (K rows of 2N bf16) and C (M rows of N fp32)
//               from stdin, runs tdpbf16ps on tiles of those shapes, and writes the stored C
//               tile to stdout as M rows of 16 floats (the bytes past C's untouched: NaN)
//   <fault>     a misuse the hardware would fault on; the model aborts naming it
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define PAGED_ISA_AMX 1
#define PAGED_AMX_EMULATED 1
namespace model {
#include "amx_tiles.h"
}
using namespace model;

// Tiles 0 (C), 1 (A), 2 (B) of the given rows and bytes.
static TileConfig config(int c_rows, int c_bytes, int a_rows, int a_bytes, int b_rows, int b_bytes) {
  TileConfig c;
  c.rows[0] = uint8_t(c_rows), c.bytes_per_row[0] = uint16_t(c_bytes);
  c.rows[1] = uint8_t(a_rows), c.bytes_per_row[1] = uint16_t(a_bytes);
  c.rows[2] = uint8_t(b_rows), c.bytes_per_row[2] = uint16_t(b_bytes);
  return c;
}

static void read_all(void* data, size_t bytes) {
  if (std::fread(data, 1, bytes, stdin) != bytes) std::abort();
}

static int dot(int m, int k, int n) {
  std::vector<uint16_t> a(size_t(m) * 2 * k), b(size_t(k) * 2 * n);
  std::vector<float> c(size_t(m) * n), out(size_t(m) * 16, NAN);
  read_all(a.data(), a.size() * 2);
  read_all(b.data(), b.size() * 2);
  read_all(c.data(), c.size() * 4);
  const TileConfig cfg = config(m, 4 * n, m, 4 * k, k, 4 * n);
  PAGED_TILE_CONFIG(&cfg);
  PAGED_TILE_LOAD(0, c.data(), 4 * n);
  PAGED_TILE_LOAD(1, a.data(), 4 * k);
  PAGED_TILE_LOAD(2, b.data(), 4 * n);
  PAGED_TILE_DPBF16PS(0, 1, 2);
  PAGED_TILE_STORE(0, out.data(), 64);
  PAGED_TILE_RELEASE();
  std::fwrite(out.data(), 4, out.size(), stdout);
  return 0;
}

static int fault(const std::string& name) {
  alignas(64) static float buffer[16 * 16] = {};
  TileConfig cfg = config(16, 64, 16, 64, 16, 64);
  if (name == "before_config") {
    PAGED_TILE_LOAD(0, buffer, 64);
  } else if (name == "after_release") {
    PAGED_TILE_CONFIG(&cfg);
    PAGED_TILE_RELEASE();
    PAGED_TILE_STORE(0, buffer, 64);
  } else if (name == "unconfigured_tile") {
    PAGED_TILE_CONFIG(&cfg);
    PAGED_TILE_ZERO(5);
  } else if (name == "palette") {
    cfg.palette = 2;
    PAGED_TILE_CONFIG(&cfg);
  } else if (name == "too_many_bytes") {
    cfg.bytes_per_row[1] = 128;
    PAGED_TILE_CONFIG(&cfg);
  } else if (name == "reserved") {
    cfg.reserved[3] = 1;
    PAGED_TILE_CONFIG(&cfg);
  } else if (name == "start_row") {
    cfg.start_row = 2;
    PAGED_TILE_CONFIG(&cfg);
  } else if (name == "tile_8") {
    cfg.rows[8] = 16, cfg.bytes_per_row[8] = 64;
    PAGED_TILE_CONFIG(&cfg);
  } else if (name == "rows_without_bytes") {
    cfg.rows[3] = 4;
    PAGED_TILE_CONFIG(&cfg);
  } else {
    if (name == "a_rows") cfg = config(16, 64, 8, 64, 16, 64);
    if (name == "a_bytes") cfg = config(16, 64, 16, 32, 16, 64);
    if (name == "b_bytes") cfg = config(16, 64, 16, 64, 16, 32);
    if (name == "a_bytes_not_dwords") cfg = config(16, 64, 16, 62, 15, 64);
    PAGED_TILE_CONFIG(&cfg);
    if (name == "repeat") PAGED_TILE_DPBF16PS(0, 1, 1);
    PAGED_TILE_DPBF16PS(0, 1, 2);
  }
  std::puts("no fault");
  return 0;
}

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "dot") return dot(std::atoi(argv[2]), std::atoi(argv[3]), std::atoi(argv[4]));
  if (argc == 2) return fault(argv[1]);
  return 2;
}
