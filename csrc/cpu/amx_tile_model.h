// A software model of the AMX tile instructions the amx kernel uses (amx_tiles.h's
// PAGED_TILE_* in the amx_emulated compile, isa_amx_emulated.cpp), so that the kernel runs
// and is tested on CPUs without AMX. Included by amx_tiles.h inside the ISA namespace.
//
// Modelled, after the Intel SDM: eight tile registers of 16 rows x 64 bytes per thread, and
// ldtilecfg's palette-1 configuration (rows and bytes per row of each tile; palette 0
// releases); tilezero, tileloadd and tilestored over a tile's configured rows and bytes (the
// bytes and rows past them read as zero); tdpbf16ps as the SDM's pseudo-code defines it:
// per row of C, the even and the odd bf16 products over A's dwords accumulated apart in
// fp32 (one rounding per multiply-add), their sum added to C; bf16 and C inputs that are
// denormal read as zero, denormal results flush to zero; tilerelease.
// Checked, aborting with the instruction and the shapes (a kernel bug, never user input):
// what the hardware faults on (#GP, #UD): a configuration other than palette 0 or 1, with
// reserved bytes set, more than 16 rows or 64 bytes, rows without bytes (or bytes without
// rows), tiles 8-15 configured; a tile instruction before a configuration (or after the
// release), on a tile register outside tmm0-tmm7 or one left unconfigured; a tdpbf16ps whose
// registers repeat or whose shapes disagree (A rows == C rows, A bytes / 4 == B rows,
// B bytes == C bytes).
// Not modelled: start_row (a restart after an interrupted load; the kernel always sets 0,
// which the model requires), the rounding of real hardware where it differs from the
// pseudo-code (the hardware's order of the pair sums is not documented beyond it), and
// speed: a tile instruction costs about as many scalar-width operations as its products.
// Nor what only the real instructions meet: the compiler's freedom to move memory accesses
// around their asm statements (amx_tiles.h's clobber on loads), and Linux's permission to
// use the tile registers (amx_permission.h).

struct TileModelState {
  bool configured = false;
  uint8_t rows[8] = {};
  uint16_t bytes[8] = {};
  alignas(64) uint8_t data[8][16][64] = {};
};

// Per thread, like the tile registers.
static thread_local TileModelState tile_model_state;

[[noreturn]] __attribute__((format(printf, 2, 3))) static void tile_model_fault(const char* instruction,
                                                                               const char* format, ...) {
  std::fprintf(stderr, "amx tile model: %s: ", instruction);
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fprintf(stderr, " (a bug in the amx kernel: the hardware would fault or compute otherwise)\n");
  std::fflush(stderr);
  std::abort();
}

static inline void tile_model_check(const char* instruction, int tile) {
  const TileModelState& s = tile_model_state;
  if (tile < 0 || tile > 7) tile_model_fault(instruction, "tmm%d is not a tile register (tmm0-tmm7)", tile);
  if (!s.configured) tile_model_fault(instruction, "tmm%d used before ldtilecfg (or after tilerelease)", tile);
  if (s.rows[tile] == 0) tile_model_fault(instruction, "tmm%d is not configured (0 rows, 0 bytes)", tile);
}

static inline void tile_model_release() { tile_model_state = TileModelState{}; }

static inline void tile_model_loadconfig(const TileConfig* config) {
  const char* name = "ldtilecfg";
  if (config->palette == 0) return tile_model_release();
  if (config->palette != 1) tile_model_fault(name, "palette %d (only palettes 0 and 1 exist)", config->palette);
  if (config->start_row != 0) tile_model_fault(name, "start_row %d (the model restarts no load)", config->start_row);
  for (int i = 0; i < 14; ++i)
    if (config->reserved[i] != 0) tile_model_fault(name, "reserved byte %d is %d, not 0", 2 + i, config->reserved[i]);
  TileModelState s;
  s.configured = true;
  for (int t = 0; t < 16; ++t) {
    const int rows = config->rows[t], bytes = config->bytes_per_row[t];
    if (t >= 8 && (rows != 0 || bytes != 0))
      tile_model_fault(name, "tile %d configured (%d rows x %d bytes) but palette 1 has 8 tiles", t, rows, bytes);
    if (rows > 16 || bytes > 64)
      tile_model_fault(name, "tmm%d of %d rows x %d bytes (at most 16 x 64)", t, rows, bytes);
    if ((rows == 0) != (bytes == 0)) tile_model_fault(name, "tmm%d of %d rows x %d bytes", t, rows, bytes);
    if (t < 8) s.rows[t] = uint8_t(rows), s.bytes[t] = uint16_t(bytes);
  }
  tile_model_state = s;  // the tiles' data zero, as ldtilecfg leaves them
}

static inline void tile_model_zero(int tile) {
  tile_model_check("tilezero", tile);
  std::memset(tile_model_state.data[tile], 0, sizeof(tile_model_state.data[tile]));
}

static inline void tile_model_loadd(int tile, const void* base, int64_t stride) {
  tile_model_check("tileloadd", tile);
  TileModelState& s = tile_model_state;
  std::memset(s.data[tile], 0, sizeof(s.data[tile]));
  for (int r = 0; r < s.rows[tile]; ++r)
    std::memcpy(s.data[tile][r], static_cast<const uint8_t*>(base) + r * stride, s.bytes[tile]);
}

static inline void tile_model_stored(int tile, void* base, int64_t stride) {
  tile_model_check("tilestored", tile);
  const TileModelState& s = tile_model_state;
  for (int r = 0; r < s.rows[tile]; ++r)
    std::memcpy(static_cast<uint8_t*>(base) + r * stride, s.data[tile][r], s.bytes[tile]);
}

// Denormal inputs read as zero (DAZ) and denormal results flush to zero (FTZ), sign kept.
static inline float tile_model_flush(float x) { return std::fabs(x) < 0x1p-126f ? std::copysign(0.0f, x) : x; }
static inline float tile_model_bf16(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return tile_model_flush(f);
}

static inline void tile_model_dpbf16ps(int c, int a, int b) {
  const char* name = "tdpbf16ps";
  tile_model_check(name, c);
  tile_model_check(name, a);
  tile_model_check(name, b);
  TileModelState& s = tile_model_state;
  if (c == a || c == b || a == b) tile_model_fault(name, "tmm%d, tmm%d, tmm%d: a register repeats", c, a, b);
  const int m = s.rows[c], k = s.bytes[a] / 4, n = s.bytes[c] / 4;
  if (s.rows[a] != m || s.bytes[a] % 4 != 0 || s.rows[b] != k || s.bytes[b] != s.bytes[c] || s.bytes[c] % 4 != 0)
    tile_model_fault(name,
                     "tmm%d (C) %d x %d bytes, tmm%d (A) %d x %d bytes, tmm%d (B) %d x %d bytes: shapes disagree "
                     "(A rows == C rows, A bytes / 4 == B rows, B bytes == C bytes)",
                     c, s.rows[c], s.bytes[c], a, s.rows[a], s.bytes[a], b, s.rows[b], s.bytes[b]);
  // B as fp32, its even and odd elements apart: [k][n].
  float b_even[16][16] = {}, b_odd[16][16] = {};
  for (int kk = 0; kk < k; ++kk) {
    const uint16_t* row = reinterpret_cast<const uint16_t*>(s.data[b][kk]);
    for (int j = 0; j < n; ++j) {
      b_even[kk][j] = tile_model_bf16(row[2 * j]);
      b_odd[kk][j] = tile_model_bf16(row[2 * j + 1]);
    }
  }
  for (int r = 0; r < m; ++r) {
    const uint16_t* a_row = reinterpret_cast<const uint16_t*>(s.data[a][r]);
    float even[16] = {}, odd[16] = {};
    for (int kk = 0; kk < k; ++kk) {
      const float a0 = tile_model_bf16(a_row[2 * kk]), a1 = tile_model_bf16(a_row[2 * kk + 1]);
      for (int j = 0; j < 16; ++j) {
        even[j] = tile_model_flush(std::fma(a0, b_even[kk][j], even[j]));
        odd[j] = tile_model_flush(std::fma(a1, b_odd[kk][j], odd[j]));
      }
    }
    float out[16];
    std::memcpy(out, s.data[c][r], sizeof(out));
    for (int j = 0; j < 16; ++j)
      out[j] = tile_model_flush(tile_model_flush(out[j]) + tile_model_flush(even[j] + odd[j]));
    std::memset(s.data[c][r], 0, sizeof(s.data[c][r]));
    std::memcpy(s.data[c][r], out, 4 * n);  // the bytes past C's zero
  }
}
