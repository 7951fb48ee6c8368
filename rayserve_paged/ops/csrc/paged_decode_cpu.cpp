// Paged decode attention on the CPU: one query token per sequence attends over that
// sequence's cached keys and values, read in place through its block table.
//
//   key_cache / value_cache  [num_blocks, block_size, num_kv_heads, head_dim]  float32
//   query / out              [num_seqs, num_heads, head_dim]                   float32
//   block_tables             [num_seqs, max_blocks] int32;  seq_lens [num_seqs] int32
//
// Each work item is one sequence: its keys, then its values, are read once, block by block in
// memory order, by all its query heads (grouped-query heads share a kv head's row). Only
// positions < seq_len are read, so nothing is gathered, padded or zero-filled, and stale slots
// past a sequence's end are never touched. With a sliding window only the last `window`
// positions are read (the blocks before them may already be back in the pool), and with a
// soft-cap every score s becomes cap * tanh(s / cap) before the softmax. Items are handed out longest-first (OpenMP dynamic schedule), so threads stay busy when
// lengths differ.
//
// A plain C ABI with no torch headers: it compiles in about a second (torch's headers take
// most of a minute on a small machine) and is called through ctypes. OpenMP is the runtime
// torch itself loaded (same soname), and the thread count is passed in from torch.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

namespace {

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float* __restrict y, float alpha, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

struct DecodeArgs {
  float* out;
  const float* query;
  const float* key_cache;
  const float* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t max_blocks;
  float scale;
  int64_t window;  // <= 0: the whole context
  float soft_cap;  // <= 0: none
};

// All query heads of one sequence. Keys and values are read block by block in memory order
// (a block's [block_size, num_kv_heads, head_dim] is contiguous), each row once;
// scratch is per-thread: [num_heads, num_keys] scores, then [num_heads] 1 / sum.
void attend(const DecodeArgs& a, int64_t seq, std::vector<float>& scratch) {
  const int64_t num_heads = a.num_heads, num_kv_heads = a.num_kv_heads;
  const int64_t group = num_heads / num_kv_heads;
  const int64_t d = a.head_dim;
  const int64_t bs = a.block_size;
  const int64_t seq_len = a.seq_lens[seq];
  const int64_t token_stride = num_kv_heads * d;  // between two tokens of one block
  const int64_t block_stride = bs * token_stride;
  const int32_t* table = a.block_tables + seq * a.max_blocks;
  const float* q = a.query + seq * num_heads * d;  // [num_heads, d]; head h reads kv head h / group
  float* out = a.out + seq * num_heads * d;        // [num_heads, d]
  std::fill(out, out + num_heads * d, 0.f);
  if (seq_len <= 0) return;
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, seq_len - a.window) : 0;
  const int64_t num_keys = seq_len - first;  // positions [first, seq_len)
  scratch.resize(num_heads * num_keys + num_heads);
  float* scores = scratch.data();  // [num_heads, num_keys]
  float* inv_sum = scores + num_heads * num_keys;

  // scores[h, t] = scale * q_h . k_(first + t)[h / group], soft-capped when asked
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t offset = pos % bs;
    const float* k = a.key_cache + table[pos / bs] * block_stride + offset * token_stride;
    const int64_t n = std::min(bs - offset, seq_len - pos);
    for (int64_t t = 0; t < n; ++t, k += token_stride)
      for (int64_t h = 0; h < num_heads; ++h) {
        float score = a.scale * dot(q + h * d, k + (h / group) * d, d);
        if (a.soft_cap > 0.f) score = a.soft_cap * std::tanh(score / a.soft_cap);
        scores[h * num_keys + pos - first + t] = score;
      }
    pos += n;
  }
  // softmax numerators in place; the 1 / sum is applied to the output at the end
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores + h * num_keys;
    const float peak = *std::max_element(s, s + num_keys);
    float sum = 0.f;
    for (int64_t t = 0; t < num_keys; ++t) {
      s[t] = std::exp(s[t] - peak);
      sum += s[t];
    }
    inv_sum[h] = 1.f / sum;
  }
  // out_h = sum_t p[h, t] v_t[h / group]
  for (int64_t pos = first; pos < seq_len;) {
    const int64_t offset = pos % bs;
    const float* v = a.value_cache + table[pos / bs] * block_stride + offset * token_stride;
    const int64_t n = std::min(bs - offset, seq_len - pos);
    for (int64_t t = 0; t < n; ++t, v += token_stride)
      for (int64_t h = 0; h < num_heads; ++h)
        axpy(out + h * d, scores[h * num_keys + pos - first + t], v + (h / group) * d, d);
    pos += n;
  }
  for (int64_t h = 0; h < num_heads; ++h)
    for (int64_t i = 0; i < d; ++i) out[h * d + i] *= inv_sum[h];
}

// 0; or 1 when seq_lens[bad[0]] is negative or does not fit max_blocks blocks; or 2 when block
// id block_tables[bad[0], bad[1]] is outside [0, num_blocks). Reads only the tables and lengths.
int check_decode_tables(const int32_t* block_tables, const int32_t* seq_lens, int64_t num_seqs, int64_t num_blocks,
                        int64_t block_size, int64_t max_blocks, int64_t window, int64_t* bad) {
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t used = (static_cast<int64_t>(seq_lens[s]) + block_size - 1) / block_size;
    if (seq_lens[s] < 0 || used > max_blocks) {
      bad[0] = s;
      return 1;
    }
    // blocks before the window are never read (their entries may be stale or released)
    const int64_t first = window > 0 ? std::max<int64_t>(0, seq_lens[s] - window) / block_size : 0;
    for (int64_t b = first; b < used; ++b) {
      const int32_t id = block_tables[s * max_blocks + b];
      if (id < 0 || id >= num_blocks) {
        bad[0] = s;
        bad[1] = b;
        return 2;
      }
    }
  }
  return 0;
}

}  // namespace

// Returns check_decode_tables' status: nothing is read from the caches before every
// sequence's table has been checked.
extern "C" int rayserve_paged_decode_f32(float* out, const float* query, const float* key_cache,
                                         const float* value_cache, const int32_t* block_tables,
                                         const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                                         int64_t num_kv_heads, int64_t head_dim, int64_t num_blocks,
                                         int64_t block_size, int64_t max_blocks, float scale,
                                         int64_t window, float soft_cap, int num_threads, int64_t* bad) {
  const int status = check_decode_tables(block_tables, seq_lens, num_seqs, num_blocks, block_size, max_blocks, window, bad);
  if (status != 0) return status;
  const DecodeArgs args{out,       query,        key_cache,  value_cache, block_tables, seq_lens, num_heads,
                        num_kv_heads, head_dim, block_size, max_blocks,  scale,        window,   soft_cap};
  if (num_threads <= 1 || num_seqs <= 1) {
    std::vector<float> scratch;
    for (int64_t s = 0; s < num_seqs; ++s) attend(args, s, scratch);
    return 0;
  }
  std::vector<int64_t> order(num_seqs);  // longest first
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return seq_lens[x] > seq_lens[y]; });
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < num_seqs; ++i) attend(args, order[i], scratch);
  }
  return 0;
}
