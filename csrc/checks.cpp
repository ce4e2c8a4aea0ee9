#include "checks.h"


#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dtypes.h"
#include "errors.h"
#include "layout.h"

namespace paged {

namespace {

bool is_supported_float(ScalarType t) {
  return t == kFloat || t == kHalf || t == kBFloat16;
}

bool is_cache_dtype(ScalarType t) { return is_supported_float(t) || is_fp8(t) || is_per_token(t); }

// Caches that are quantized on the way in take inputs (query, key, value) of any float dtype.
bool is_quantized(ScalarType t) { return is_fp8(t) || is_per_token(t); }

void check_rank(const char* op, const char* name, const Tensor& t, int64_t rank,
                const char* layout) {
  PAGED_CHECK_VALUE(t.dim() == rank, op, ": argument '", name, "' must be ", rank, "-D ", layout,
                    ", got shape ", t.sizes());
}

void check_dtype(const char* op, const char* name, const Tensor& t, ScalarType want) {
  PAGED_CHECK_TYPE(t.scalar_type() == want, op, ": argument '", name, "' must have dtype ", want,
                   ", got ", t.scalar_type());
}

void check_same_device(const char* op, const char* name, const Tensor& t,
                       const Tensor& reference, const char* reference_name = "query") {
  PAGED_CHECK_VALUE(t.device() == reference.device(), op, ": argument '", name,
                    "' must be on the same device as '", reference_name, "' (",
                    reference.device(), "), got ", t.device());
}

void check_head_size(const char* op, const char* name, int64_t head_size, int64_t most) {
  PAGED_CHECK_VALUE(head_size > 0 && head_size % 8 == 0 && head_size <= most, op,
                    ": argument '", name, "' has head_size ", head_size,
                    "; supported head sizes are multiples of 8 up to ", most);
}

// Python's name of a dtype (the mirror's dtype_name): the fix the messages suggest is Python.
std::string dtype_name(ScalarType t) {
  switch (t) {
    case kFloat: return "float32";
    case kHalf: return "float16";
    case kBFloat16: return "bfloat16";
    case ScalarType::Double: return "float64";
    case kFloat8_e4m3fn: return "float8_e4m3fn";
    case kFloat8_e5m2: return "float8_e5m2";
    case kChar: return "int8";
    case kByte: return "uint8";
    default: return detail::concat(t);
  }
}

// An input (the query, or write_kv's key / value) of another dtype than its float cache:
// the message names both sides and both fixes.
void check_input_dtype(const char* op, const char* name, const Tensor& input,
                       const char* cache_name, const Tensor& cache, const char* inputs) {
  PAGED_CHECK_TYPE(input.scalar_type() == cache.scalar_type(), op, ": ", name, " is ",
                   dtype_name(input.scalar_type()), " but ", cache_name, " is ",
                   dtype_name(cache.scalar_type()), ": ", inputs, " and the caches must have the "
                   "same dtype (or the caches are fp8 or per-token, with k_scale and v_scale); "
                   "cast with ",
                   name, ".to(", cache_name, ".dtype) or allocate the caches in ",
                   dtype_name(input.scalar_type()));
}

// Said when a cache's num_kv_heads does not fit but its dim 2 would: the cache is likely
// NHD [num_blocks, block_size, num_kv_heads, head_size] (vLLM's, transformers').
std::string nhd_hint(const char* name) {
  return detail::concat("; ", name, " looks like NHD [blocks, block_size, kv_heads, head_size]: "
                        "the ops take HND [blocks, kv_heads, block_size, head_size] or a strided "
                        "view of it: pass paged_attention_ext.layouts.from_nhd(", name,
                        ") (the view ", name, ".transpose(1, 2), no copy), and the same for "
                        "value_cache");
}

// Said when two caches' block dims differ by a swap of dims 1 and 2.
std::string swapped_layout_hint(const Tensor& a, const Tensor& b) {
  if (a.dim() != 4 || b.dim() != 4 || a.size(0) != b.size(0) || a.size(1) != b.size(2) ||
      a.size(2) != b.size(1))
    return "";
  return "; the two differ by a swap of dims 1 and 2, so one looks like NHD [blocks, "
         "block_size, kv_heads, head_size]: pass both as HND [blocks, kv_heads, block_size, "
         "head_size], an NHD one through paged_attention_ext.layouts.from_nhd(cache) (the view "
         "cache.transpose(1, 2), no copy)";
}

// Two handles of one tensor: one address, one shape, the same strides where they matter.
bool same_view(const Tensor& a, const Tensor& b) {
  if (a.data_ptr() != b.data_ptr() || !a.sizes().equals(b.sizes())) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

int32_t read_i32(const Tensor& t, int64_t i) { return t.mutable_data_ptr<int32_t>()[i * t.stride(0)]; }

}  // namespace

void check_cache_tensor(const char* op, const char* name, const Tensor& cache) {
  check_rank(op, name, cache, 4, "[num_blocks, num_kv_heads, block_size, head_size]");
  PAGED_CHECK_TYPE(is_cache_dtype(cache.scalar_type()), op, ": argument '", name,
                   "' must be float32, float16, bfloat16, float8_e4m3fn, float8_e5m2, int8 "
                   "(int8_per_token_head) or uint8 (int4_per_token_head), got ",
                   cache.scalar_type());
  PAGED_CHECK_VALUE(cache.stride(3) == 1 || cache.size(3) <= 1, op, ": argument '", name,
                    "' must be contiguous in its last dimension (head_size), got strides ",
                    cache.strides());
  PAGED_CHECK_VALUE(!overlaps_itself(cache), op, ": argument '", name,
                    "' is a view that overlaps itself (strides ", cache.strides(), " for shape ",
                    cache.sizes(), "); two cache slots would share memory");
}

namespace {

// A per-token cache's scale tensor: fp32 [num_blocks, num_kv_heads, block_size] (int8) or
// [..., 2] (int4: scale, low; the pair contiguous), any strides otherwise, not overlapping
// itself (write_kv writes it).
void check_token_scales(const char* op, const char* name, const Tensor& t, const Tensor& cache) {
  const bool int4 = cache.scalar_type() == kByte;
  std::vector<int64_t> want{cache.size(0), cache.size(1), cache.size(2)};
  if (int4) want.push_back(2);
  PAGED_CHECK_VALUE(t.sizes().equals(Sizes(want.data(), want.size())), op, ": argument '", name,
                    "' must have shape ",
                    int4 ? "[num_blocks, num_kv_heads, block_size, 2] (scale, low)"
                         : "[num_blocks, num_kv_heads, block_size]",
                    " = ", want, ", one per slot of the ", dtype_name(cache.scalar_type()),
                    " cache, got ", t.sizes());
  PAGED_CHECK_VALUE(!int4 || t.stride(3) == 1, op, ": argument '", name,
                    "' must be contiguous in its last dimension (scale, low), got strides ",
                    t.strides());
  PAGED_CHECK_VALUE(!overlaps_itself(t), op, ": argument '", name, "' is a view that overlaps "
                    "itself (strides ", t.strides(), " for shape ", t.sizes(),
                    "); two slots would share a scale");
}

}  // namespace

void check_cache_scale(const char* op, const char* name, const std::optional<Tensor>& scale,
                       const Tensor& cache, const Tensor& reference, const char* reference_name) {
  const ScalarType cache_dtype = cache.scalar_type();
  if (!is_quantized(cache_dtype)) {
    PAGED_CHECK_VALUE(!scale.has_value(), op, ": argument '", name, "' is only for fp8 "
                      "(float8_e4m3fn, float8_e5m2) and per-token (int8, uint8) caches, but "
                      "the caches are ", cache_dtype, "; pass None");
    return;
  }
  const bool per_token = is_per_token(cache_dtype);
  PAGED_CHECK_VALUE(scale.has_value(), op, ": the caches are ", cache_dtype,
                    ", which needs argument '", name, "' (a float32 tensor of shape ",
                    !per_token ? "[], [1] or [num_kv_heads]"
                    : cache_dtype == kByte ? "[num_blocks, num_kv_heads, block_size, 2]"
                                           : "[num_blocks, num_kv_heads, block_size]",
                    "); got None");
  const Tensor& t = *scale;
  check_dtype(op, name, t, kFloat);
  check_same_device(op, name, t, reference, reference_name);
  if (per_token) return check_token_scales(op, name, t, cache);
  const int64_t num_kv_heads = cache.size(1);
  const bool per_layer = t.numel() == 1 && t.dim() <= 1;
  const bool per_head = t.dim() == 1 && t.size(0) == num_kv_heads;
  PAGED_CHECK_VALUE(per_layer || per_head, op, ": argument '", name, "' must have shape [], [1] "
                    "or [num_kv_heads] = [", num_kv_heads, "], got ", t.sizes());
}

void check_kv_scales(const char* op, const Tensor& key_cache, const Tensor& value_cache,
                     const std::optional<Tensor>& k_scale,
                     const std::optional<Tensor>& v_scale, const Tensor& reference,
                     const char* reference_name) {
  check_cache_scale(op, "k_scale", k_scale, key_cache, reference, reference_name);
  check_cache_scale(op, "v_scale", v_scale, value_cache, reference, reference_name);
}

void check_layer_caches(const char* op, const TensorList& key_caches,
                        const TensorList& value_caches) {
  PAGED_CHECK_VALUE(key_caches.size() == value_caches.size(), op,
                    ": arguments 'key_caches' and 'value_caches' must list the same number of "
                    "layers, got ", key_caches.size(), " and ", value_caches.size());
  for (size_t l = 0; l < key_caches.size(); ++l) {
    // A per-token cache's scales move with it: int8's are 3-D fp32 [num_blocks,
    // num_kv_heads, block_size] (int4's are 4-D fp32 and pass as a cache).
    const auto check_paged = [&](const char* name, const Tensor& t) {
      if (t.dim() == 3 && t.scalar_type() == kFloat)
        PAGED_CHECK_VALUE(!overlaps_itself(t), op, ": argument '", name,
                          "' is a view that overlaps itself (strides ", t.strides(),
                          " for shape ", t.sizes(), ")");
      else
        check_cache_tensor(op, name, t);
    };
    check_paged("key_caches", key_caches[l]);
    check_paged("value_caches", value_caches[l]);
    PAGED_CHECK_VALUE(key_caches[l].dim() == value_caches[l].dim() &&
                          same_block_layout(key_caches[l], value_caches[l]) &&
                          key_caches[l].scalar_type() == value_caches[l].scalar_type(),
                      op, ": key_caches[", l, "] and value_caches[", l,
                      "] must have the same dtype and shape (the head size may differ), got ",
                      key_caches[l].sizes(), " and ", value_caches[l].sizes());
    const std::string layer = "[" + std::to_string(l) + "]";
    check_same_device(op, ("key_caches" + layer).c_str(), key_caches[l], key_caches[0],
                      "key_caches[0]");
    check_same_device(op, ("value_caches" + layer).c_str(), value_caches[l], key_caches[0],
                      "key_caches[0]");
    PAGED_CHECK_VALUE(key_caches[l].size(0) == key_caches[0].size(0), op,
                      ": every layer must have the same num_blocks");
  }
}

void check_swap_pools(const char* op, const Tensor& src, const Tensor& dst) {
  PAGED_CHECK_TYPE(src.scalar_type() == dst.scalar_type(), op,
                   ": arguments 'src' and 'dst' must have the same dtype, got ", src.scalar_type(),
                   " and ", dst.scalar_type());
  PAGED_CHECK_VALUE(src.dim() >= 1 && src.dim() == dst.dim() &&
                        src.sizes().slice(1).equals(dst.sizes().slice(1)),
                    op, ": arguments 'src' and 'dst' must have the same block shape, got ",
                    src.sizes(), " and ", dst.sizes());
  PAGED_CHECK_VALUE(!overlaps_itself(dst), op, ": argument 'dst' is a view that overlaps itself "
                    "(strides ", dst.strides(), " for shape ", dst.sizes(), ")");
  // One pool as both (a copy within it) is fine; two different views of one storage that
  // share an element would make the parallel copies depend on their order.
  const bool same_view = src.data_ptr() == dst.data_ptr() && src.strides().equals(dst.strides());
  PAGED_CHECK_VALUE(same_view || !share_an_element(src, dst), op,
                    ": arguments 'src' and 'dst' are different views that share memory; pass "
                    "one pool as both, or disjoint pools");
}

AttentionShape check_attention_args(const char* op, const AttentionArgs& args,
                                    const Tensor* out, const Tensor* lse) {
  check_rank(op, "query", args.query, 3, "[num_tokens, num_heads, head_size]");
  PAGED_CHECK_TYPE(is_supported_float(args.query.scalar_type()), op,
                   ": argument 'query' must be float32, float16 or bfloat16, got ",
                   args.query.scalar_type());
  check_cache_tensor(op, "key_cache", args.key_cache);
  check_cache_tensor(op, "value_cache", args.value_cache);
  // A float cache has the query's dtype; an fp8 or per-token cache takes a query of any
  // float dtype.
  if (!is_quantized(args.key_cache.scalar_type()))
    check_input_dtype(op, "query", args.query, "key_cache", args.key_cache, "the query");
  check_dtype(op, "value_cache", args.value_cache, args.key_cache.scalar_type());
  PAGED_CHECK_VALUE(same_block_layout(args.value_cache, args.key_cache), op,
                    ": argument 'value_cache' must have the num_blocks, num_kv_heads and "
                    "block_size of 'key_cache' ", args.key_cache.sizes(), ", got ",
                    args.value_cache.sizes(),
                    swapped_layout_hint(args.key_cache, args.value_cache));
  check_same_device(op, "key_cache", args.key_cache, args.query);
  check_same_device(op, "value_cache", args.value_cache, args.query);
  check_kv_scales(op, args.key_cache, args.value_cache, args.k_scale, args.v_scale, args.query,
                  "query");
  // Per-token caches may share memory only as latent rows: the values the keys' leading
  // columns, read with the keys' own scales (one tensor for k_scale and v_scale).
  PAGED_CHECK_VALUE(!is_per_token(args.key_cache.scalar_type()) ||
                        !(share_an_element(args.key_cache, args.value_cache) ||
                          share_an_element(*args.k_scale, *args.v_scale)) ||
                        (values_in_keys(args.key_cache, args.value_cache) &&
                         same_view(*args.k_scale, *args.v_scale)),
                    op, ": 'key_cache' and 'value_cache' (or 'k_scale' and 'v_scale') of a "
                    "per-token cache share memory; the one sharing allowed is latent rows "
                    "(paged.write_latent): 'value_cache' the leading columns of 'key_cache' "
                    "(key_cache[..., :head_size_v]) and 'v_scale' the very tensor 'k_scale'");

  AttentionShape s{};
  s.num_tokens = args.query.size(0);
  s.num_heads = args.query.size(1);
  s.head_size = args.query.size(2);
  const int64_t packing = values_per_element(args.key_cache.scalar_type());
  s.head_size_v = args.value_cache.size(3) * packing;
  s.num_blocks = args.key_cache.size(0);
  s.num_kv_heads = args.key_cache.size(1);
  s.block_size = args.key_cache.size(2);

  if (packing == 2) {
    PAGED_CHECK_VALUE(args.key_cache.size(3) * 2 == s.head_size, op,
                      ": argument 'key_cache' holds int4 rows of head_size ",
                      args.key_cache.size(3) * 2, " (", args.key_cache.size(3),
                      " bytes, two values a byte) but 'query' has head_size ", s.head_size,
                      "; an int4 cache's last dimension is head_size // 2");
  } else {
    PAGED_CHECK_VALUE(args.key_cache.size(3) == s.head_size, op,
                      ": argument 'key_cache' has head_size ", args.key_cache.size(3),
                      " but 'query' has head_size ", s.head_size);
  }
  // int4 latent rows are rotated whole, in blocks of the key row's rotation: the values
  // (leading columns) must be whole blocks of it to be turned back on their own.
  const int64_t key_block = std::min<int64_t>(s.head_size & -s.head_size, 512);
  PAGED_CHECK_VALUE(packing != 2 || key_block == 0 || !values_in_keys(args.key_cache, args.value_cache) ||
                        s.head_size_v % key_block == 0,
                    op, ": int4 latent rows of ", s.head_size, " values are rotated in blocks of ",
                    key_block, ", so their values (the leading ", s.head_size_v,
                    " columns) must be whole blocks; use an int8 latent cache");
  check_head_size(op, "query", s.head_size, kMaxKeyHeadSize);
  check_head_size(op, "value_cache", s.head_size_v, kMaxValueHeadSize);
  PAGED_CHECK_VALUE(s.block_size > 0, op, ": argument 'key_cache' has block_size 0");
  PAGED_CHECK_VALUE(s.num_kv_heads > 0 && s.num_heads % s.num_kv_heads == 0, op,
                    ": num_heads of 'query' (", s.num_heads,
                    ") must be a multiple of num_kv_heads of 'key_cache' (", s.num_kv_heads, ")",
                    s.block_size > 0 && s.num_heads % s.block_size == 0 ? nhd_hint("key_cache")
                                                                       : std::string());
  PAGED_CHECK_VALUE(args.query.stride(2) == 1 || s.head_size == 1, op,
                    ": argument 'query' must be contiguous in its last dimension, got strides ",
                    args.query.strides());

  check_rank(op, "seq_lens", args.seq_lens, 1, "[num_seqs]");
  check_dtype(op, "seq_lens", args.seq_lens, kInt);
  check_same_device(op, "seq_lens", args.seq_lens, args.query);
  s.num_seqs = args.seq_lens.size(0);

  check_rank(op, "block_tables", args.block_tables, 2, "[num_seqs, max_blocks_per_seq]");
  check_dtype(op, "block_tables", args.block_tables, kInt);
  check_same_device(op, "block_tables", args.block_tables, args.query);
  PAGED_CHECK_VALUE(args.block_tables.size(0) == s.num_seqs, op,
                    ": argument 'block_tables' has ", args.block_tables.size(0),
                    " rows but 'seq_lens' has ", s.num_seqs, " sequences");
  PAGED_CHECK_VALUE(args.block_tables.stride(1) == 1 || args.block_tables.size(1) <= 1, op,
                    ": argument 'block_tables' must be contiguous in its last dimension");
  s.max_blocks_per_seq = args.block_tables.size(1);

  if (args.query_start_loc.has_value()) {
    const Tensor& qsl = *args.query_start_loc;
    check_rank(op, "query_start_loc", qsl, 1, "[num_seqs + 1]");
    check_dtype(op, "query_start_loc", qsl, kInt);
    check_same_device(op, "query_start_loc", qsl, args.query);
    PAGED_CHECK_VALUE(qsl.size(0) == s.num_seqs + 1, op,
                      ": argument 'query_start_loc' must have num_seqs + 1 = ", s.num_seqs + 1,
                      " entries, got ", qsl.size(0));
  } else {
    PAGED_CHECK_VALUE(s.num_tokens == s.num_seqs, op,
                      ": without 'query_start_loc' (decode) 'query' must have one row per "
                      "sequence: got ", s.num_tokens, " rows for ", s.num_seqs, " sequences");
  }

  if (args.alibi_slopes.has_value()) {
    const Tensor& slopes = *args.alibi_slopes;
    check_rank(op, "alibi_slopes", slopes, 1, "[num_heads]");
    check_dtype(op, "alibi_slopes", slopes, kFloat);
    check_same_device(op, "alibi_slopes", slopes, args.query);
    PAGED_CHECK_VALUE(slopes.size(0) == s.num_heads, op, ": argument 'alibi_slopes' must have ",
                      s.num_heads, " entries (num_heads), got ", slopes.size(0));
  }

  if (args.sinks.has_value()) {
    check_rank(op, "sinks", *args.sinks, 1, "[num_heads]");
    check_dtype(op, "sinks", *args.sinks, kFloat);
    check_same_device(op, "sinks", *args.sinks, args.query);
    PAGED_CHECK_VALUE(args.sinks->size(0) == s.num_heads, op, ": argument 'sinks' must have ",
                      s.num_heads, " entries (num_heads), got ", args.sinks->size(0));
  }

  PAGED_CHECK_VALUE(std::isfinite(args.scale), op, ": argument 'scale' must be finite, got ",
                    args.scale);
  PAGED_CHECK_VALUE(std::isfinite(args.soft_cap) && args.soft_cap >= 0.0, op,
                    ": argument 'soft_cap' must be >= 0 (0 disables it), got ", args.soft_cap);
  PAGED_CHECK_VALUE(args.sliding_window >= -1 && args.sliding_window <= INT32_MAX, op,
                    ": argument 'sliding_window' must be -1 (disabled) or a window length, got ",
                    args.sliding_window);

  if (out != nullptr) {
    const auto want = std::vector<int64_t>{s.num_tokens, s.num_heads, s.head_size_v};
    PAGED_CHECK_VALUE(out->sizes().equals(Sizes(want.data(), want.size())), op,
                      ": argument 'out' must be [num_tokens, num_heads, head_size_v] = ",
                      want, ", got ", out->sizes());
    check_dtype(op, "out", *out, args.query.scalar_type());
    check_same_device(op, "out", *out, args.query);
    PAGED_CHECK_VALUE(out->stride(2) == 1, op,
                      ": argument 'out' must be contiguous in its last dimension");
  }
  if (lse != nullptr) {
    check_rank(op, "lse", *lse, 2, "[num_tokens, num_heads]");
    PAGED_CHECK_VALUE(lse->size(0) == s.num_tokens && lse->size(1) == s.num_heads, op,
                      ": argument 'lse' must have shape [", s.num_tokens, ", ", s.num_heads,
                      "], got ", lse->sizes());
    check_dtype(op, "lse", *lse, kFloat);
    check_same_device(op, "lse", *lse, args.query);
    PAGED_CHECK_VALUE(lse->stride(1) == 1, op, ": argument 'lse' must be contiguous in its last dimension");
  }
  PAGED_CHECK_VALUE(s.num_tokens <= INT32_MAX && s.max_blocks_per_seq * s.block_size <= INT32_MAX,
                    op, ": more tokens than int32 positions can address");
  return s;
}

void check_attention_metadata(const char* op, const AttentionShape& s, const AttentionArgs& args) {
  const bool queries_after_keys = args.placement == QueryPlacement::kAfterKeys;
  const int64_t capacity = s.max_blocks_per_seq * s.block_size;
  const int32_t* table = args.block_tables.mutable_data_ptr<int32_t>();
  const int64_t row_stride = args.block_tables.stride(0);
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int32_t len = read_i32(args.seq_lens, i);
    PAGED_CHECK_VALUE(len >= 0 && len <= capacity, op, ": seq_lens[", i, "] = ", len,
                      " is outside [0, ", capacity, "], the tokens its block_tables row covers (",
                      s.max_blocks_per_seq, " blocks of ", s.block_size, ")");
    const int64_t used_blocks = (len + s.block_size - 1) / s.block_size;
    // With a sliding window the blocks wholly before the row's first query's window are
    // never read: a block manager may have freed them (entries -1 or stale ids).
    int64_t first_block = 0;
    if (args.sliding_window > 0) {
      int64_t q_len = 1;
      if (args.query_start_loc.has_value())  // a bad q_len is refused below; clamp it until then
        q_len = std::clamp<int64_t>(int64_t(read_i32(*args.query_start_loc, i + 1)) -
                                        read_i32(*args.query_start_loc, i), 0, len);
      first_block = std::max<int64_t>(0, len - q_len - args.sliding_window + 1) / s.block_size;
    }
    for (int64_t b = first_block; b < used_blocks; ++b) {
      const int32_t block = table[i * row_stride + b];
      PAGED_CHECK_INDEX(block >= 0 && block < s.num_blocks, op, ": block_tables[", i, ", ", b,
                        "] = ", block, " is not a block of the cache (num_blocks = ",
                        s.num_blocks, ")");
    }
  }
  if (!args.query_start_loc.has_value()) return;
  const Tensor& qsl = *args.query_start_loc;
  PAGED_CHECK_VALUE(read_i32(qsl, 0) == 0, op, ": query_start_loc[0] must be 0, got ",
                    read_i32(qsl, 0));
  PAGED_CHECK_VALUE(read_i32(qsl, s.num_seqs) == s.num_tokens, op, ": query_start_loc[-1] = ",
                    read_i32(qsl, s.num_seqs), " must equal num_tokens of 'query' (",
                    s.num_tokens, ")");
  for (int64_t i = 0; i < s.num_seqs; ++i) {
    const int64_t q_len = int64_t(read_i32(qsl, i + 1)) - read_i32(qsl, i);
    PAGED_CHECK_VALUE(q_len >= 0, op, ": query_start_loc must be non-decreasing; entry ", i + 1,
                      " is below entry ", i);
    PAGED_CHECK_VALUE(queries_after_keys || q_len <= read_i32(args.seq_lens, i), op,
                      ": sequence ", i, " has ", q_len,
                      " query tokens in query_start_loc but seq_lens[", i, "] = ",
                      read_i32(args.seq_lens, i), " (queries are the last q_len tokens of the sequence)");
  }
}

void check_merge_args(const char* op, const TensorList& outputs, const TensorList& lses) {
  PAGED_CHECK_VALUE(!outputs.empty() && outputs.size() == lses.size(), op,
                    ": arguments 'outputs' and 'lses' must list the same number (>= 1) of partial "
                    "results, got ", outputs.size(), " and ", lses.size());
  const Tensor& first = outputs[0];
  check_rank(op, "outputs[0]", first, 3, "[num_tokens, num_heads, head_size]");
  PAGED_CHECK_TYPE(is_supported_float(first.scalar_type()), op,
                   ": argument 'outputs[0]' must be float32, float16 or bfloat16, got ",
                   first.scalar_type());
  for (size_t i = 0; i < outputs.size(); ++i) {
    const std::string o = "outputs[" + std::to_string(i) + "]";
    const std::string l = "lses[" + std::to_string(i) + "]";
    PAGED_CHECK_VALUE(outputs[i].sizes().equals(first.sizes()), op, ": argument '", o,
                      "' must have the shape of 'outputs[0]' ", first.sizes(), ", got ",
                      outputs[i].sizes());
    check_dtype(op, o.c_str(), outputs[i], first.scalar_type());
    check_same_device(op, o.c_str(), outputs[i], first, "outputs[0]");
    PAGED_CHECK_VALUE(outputs[i].stride(2) == 1 || first.size(2) <= 1, op, ": argument '", o,
                      "' must be contiguous in its last dimension, got strides ",
                      outputs[i].strides());
    check_rank(op, l.c_str(), lses[i], 2, "[num_tokens, num_heads]");
    PAGED_CHECK_VALUE(lses[i].size(0) == first.size(0) && lses[i].size(1) == first.size(1), op,
                      ": argument '", l, "' must have shape [", first.size(0), ", ", first.size(1),
                      "] (num_tokens, num_heads of 'outputs[0]'), got ", lses[i].sizes());
    check_dtype(op, l.c_str(), lses[i], kFloat);
    check_same_device(op, l.c_str(), lses[i], first, "outputs[0]");
  }
}

// slot_mapping: int64 [num_tokens], one slot per token of `rows` (the argument `rows_name`).
static void check_slot_mapping(const char* op, const Tensor& slot_mapping, const Tensor& rows,
                               const char* rows_name) {
  check_rank(op, "slot_mapping", slot_mapping, 1, "[num_tokens]");
  check_dtype(op, "slot_mapping", slot_mapping, kLong);
  PAGED_CHECK_VALUE(slot_mapping.size(0) == rows.size(0), op, ": argument 'slot_mapping' has ",
                    slot_mapping.size(0), " entries but '", rows_name, "' has ", rows.size(0),
                    " tokens");
}

void check_write_kv_args(const Tensor& key, const Tensor& value,
                         const Tensor& key_cache, const Tensor& value_cache,
                         const Tensor& slot_mapping, const std::optional<Tensor>& k_scale,
                         const std::optional<Tensor>& v_scale) {
  const char* op = "paged.write_kv";
  check_rank(op, "key", key, 3, "[num_tokens, num_kv_heads, head_size]");
  check_rank(op, "value", value, 3, "[num_tokens, num_kv_heads, head_size_v]");
  check_cache_tensor(op, "key_cache", key_cache);
  check_cache_tensor(op, "value_cache", value_cache);
  PAGED_CHECK_VALUE(same_block_layout(value_cache, key_cache), op,
                    ": argument 'value_cache' must have the num_blocks, num_kv_heads and "
                    "block_size of 'key_cache' ", key_cache.sizes(), ", got ", value_cache.sizes(),
                    swapped_layout_hint(key_cache, value_cache));
  check_dtype(op, "value_cache", value_cache, key_cache.scalar_type());
  if (is_quantized(key_cache.scalar_type())) {  // quantized on the way in: any float input
    PAGED_CHECK_TYPE(is_supported_float(key.scalar_type()), op,
                     ": argument 'key' must be float32, float16 or bfloat16, got ",
                     key.scalar_type());
    check_dtype(op, "value", value, key.scalar_type());
  } else {
    check_input_dtype(op, "key", key, "key_cache", key_cache, "key, value");
    check_input_dtype(op, "value", value, "value_cache", value_cache, "key, value");
  }
  // An int4 cache packs two values a byte: key and value rows of twice its last dimension.
  const int64_t packing = values_per_element(key_cache.scalar_type());
  PAGED_CHECK_VALUE(packing == 1 || (key.size(2) % 2 == 0 && value.size(2) % 2 == 0), op,
                    ": an int4 cache packs two values a byte: head_size ", key.size(2),
                    " (key) and ", value.size(2), " (value) must be even");
  const auto want_k =
      std::vector<int64_t>{key.size(0), key_cache.size(1), key_cache.size(3) * packing};
  PAGED_CHECK_VALUE(key.sizes().equals(Sizes(want_k.data(), want_k.size())), op,
                    ": argument 'key' must be [num_tokens, num_kv_heads=", key_cache.size(1),
                    ", head_size=", key_cache.size(3) * packing, "], got ", key.sizes(),
                    key_cache.size(1) != key.size(1) && key_cache.size(2) == key.size(1)
                        ? nhd_hint("key_cache") : std::string());
  const auto want_v =
      std::vector<int64_t>{key.size(0), value_cache.size(1), value_cache.size(3) * packing};
  PAGED_CHECK_VALUE(value.sizes().equals(Sizes(want_v.data(), want_v.size())), op,
                    ": argument 'value' must be [num_tokens=", key.size(0), ", num_kv_heads=",
                    value_cache.size(1), ", head_size_v=", value_cache.size(3) * packing, "], got ",
                    value.sizes());
  PAGED_CHECK_VALUE(key.stride(2) == 1 && value.stride(2) == 1, op,
                    ": arguments 'key' and 'value' must be contiguous in their last dimension");
  check_slot_mapping(op, slot_mapping, key, "key");
  const std::pair<const char*, const Tensor*> others[] = {
      {"value", &value}, {"key_cache", &key_cache}, {"value_cache", &value_cache},
      {"slot_mapping", &slot_mapping}};
  for (const auto& [name, t] : others) check_same_device(op, name, *t, key, "key");
  check_kv_scales(op, key_cache, value_cache, k_scale, v_scale, key, "key");
  // Each key and value row is quantized with its own scales: rows or scales written through
  // two views of the same memory (MLA latent rows, values a view of the keys) would
  // overwrite each other's scales.
  PAGED_CHECK_VALUE(!is_per_token(key_cache.scalar_type()) ||
                        (!share_an_element(key_cache, value_cache) &&
                         !share_an_element(*k_scale, *v_scale)),
                    op, ": a per-token cache quantizes each key and value row with its own "
                    "scales, so 'key_cache' and 'value_cache' (and 'k_scale' and 'v_scale') must "
                    "not share memory; MLA latent rows (values a view of the keys) are stored "
                    "whole, under one scale, with paged.write_latent");
}

void check_write_latent_args(const Tensor& latent, const Tensor& rotary_key, const Tensor& cache,
                             const Tensor& slot_mapping, const std::optional<Tensor>& scale) {
  const char* op = "paged.write_latent";
  check_rank(op, "latent", latent, 3, "[num_tokens, num_kv_heads, latent_size]");
  check_rank(op, "rotary_key", rotary_key, 3, "[num_tokens, num_kv_heads, rotary_size]");
  check_cache_tensor(op, "cache", cache);
  PAGED_CHECK_TYPE(is_supported_float(latent.scalar_type()), op,
                   ": argument 'latent' must be float32, float16 or bfloat16, got ",
                   latent.scalar_type());
  check_dtype(op, "rotary_key", rotary_key, latent.scalar_type());
  // A row is [latent | rotary_key]: an int4 cache packs it two values a byte.
  const int64_t packing = values_per_element(cache.scalar_type());
  const int64_t width = latent.size(2) + rotary_key.size(2);
  PAGED_CHECK_VALUE(latent.size(0) == rotary_key.size(0) && latent.size(1) == cache.size(1) &&
                        rotary_key.size(1) == cache.size(1) &&
                        width == cache.size(3) * packing,
                    op, ": arguments 'latent' ", latent.sizes(), " and 'rotary_key' ",
                    rotary_key.sizes(), " must be [num_tokens, num_kv_heads=", cache.size(1),
                    ", n] with the two widths adding up to the cache's rows (",
                    cache.size(3) * packing, packing == 2 ? " values, two a byte)" : " values)");
  PAGED_CHECK_VALUE(latent.stride(2) == 1 && rotary_key.stride(2) == 1, op,
                    ": arguments 'latent' and 'rotary_key' must be contiguous in their last "
                    "dimension");
  check_slot_mapping(op, slot_mapping, latent, "latent");
  const std::pair<const char*, const Tensor*> others[] = {
      {"rotary_key", &rotary_key}, {"cache", &cache}, {"slot_mapping", &slot_mapping}};
  for (const auto& [name, t] : others) check_same_device(op, name, *t, latent, "latent");
  check_cache_scale(op, "scale", scale, cache, latent, "latent");
}

void check_slots_in_range(const Tensor& slot_mapping, int64_t num_slots, const char* op) {
  const int64_t* slots = slot_mapping.mutable_data_ptr<int64_t>();
  const int64_t stride = slot_mapping.stride(0);
  for (int64_t i = 0; i < slot_mapping.size(0); ++i) {
    const int64_t slot = slots[i * stride];
    PAGED_CHECK_INDEX(slot < num_slots, op, ": slot_mapping[", i, "] = ", slot,
                      " is outside the cache (num_blocks * block_size = ", num_slots, ")");
  }
}

void check_block_mapping(const char* op, const Tensor& block_mapping) {
  PAGED_CHECK_VALUE(block_mapping.dim() == 2 && block_mapping.size(1) == 2, op,
                    ": argument 'block_mapping' must be [num_pairs, 2] (src, dst), got shape ",
                    block_mapping.sizes());
  check_dtype(op, "block_mapping", block_mapping, kLong);
}

void check_block_mapping_values(const char* op, const Tensor& block_mapping,
                                int64_t num_src_blocks, int64_t num_dst_blocks, bool same_pool) {
  const Tensor pairs = torch::stable::contiguous(block_mapping);
  const int64_t* p = pairs.mutable_data_ptr<int64_t>();
  std::vector<char> written(num_dst_blocks, 0);
  for (int64_t i = 0; i < pairs.size(0); ++i) {
    const int64_t src = p[2 * i], dst = p[2 * i + 1];
    PAGED_CHECK_INDEX(src >= 0 && src < num_src_blocks, op, ": block_mapping[", i, ", 0] = ", src,
                      " is not a source block (num_blocks = ", num_src_blocks, ")");
    PAGED_CHECK_INDEX(dst >= 0 && dst < num_dst_blocks, op, ": block_mapping[", i, ", 1] = ", dst,
                      " is not a destination block (num_blocks = ", num_dst_blocks, ")");
    PAGED_CHECK_VALUE(!written[dst], op, ": block_mapping writes destination block ", dst,
                      " more than once");
    written[dst] = 1;
  }
  if (!same_pool) return;
  for (int64_t i = 0; i < pairs.size(0); ++i) {
    PAGED_CHECK_VALUE(!written[p[2 * i]], op, ": block_mapping reads block ", p[2 * i],
                      " which it also writes; the result would depend on the copy order");
  }
}

}  // namespace paged
