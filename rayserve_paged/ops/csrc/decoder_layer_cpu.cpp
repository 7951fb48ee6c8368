// One pre-norm decoder layer's decode step on the CPU, in one call: every token of the step
// is one row with its own position, slot and sequence length (no prefill), weights are
// group-quantized codes in the layout of quant_gemm_cpu.cpp, activations and KV float32.
// Several rows may be one sequence's consecutive tokens over the same block table (a
// speculative verification, worker/static_decode.py expanded_draft_rows): every row's k, v
// are written to the caches before any row attends, so row j sees the rows before it.
//
//   x, residual [T, hidden] float32, both updated in place (as DecoderLayer.forward returns them):
//
//   residual = x (first layer) | residual + x          h = rmsnorm(residual) * w_in
//   q|k|v = h Wqkv^T (+ b)     q, k = rope(q), rope(k) (rotate-half, cos/sin [T, D])
//   k, v -> the paged caches at slots[t]                a = paged decode attention(q)
//   residual += a Wo^T (+ b)   h = rmsnorm(residual) * w_post
//   g|u = h Wgu^T (+ b)        x = (silu(g) * u) Wdown^T (+ b)
//
// The products are the compiled group-quantized GEMM's and the attention is the compiled
// paged-decode kernel's (this file includes both sources, so each is the same code as its
// standalone library); between them the per-token work (norms, RoPE, cache writes,
// activation) runs on the calling thread, which for the few rows of a decode step costs less
// than handing it to the thread pool. What the layer replaces in Python is ~60 small torch
// calls (DecoderLayer.forward with its RMSNorm, RotaryEmbedding, backend and linear layers),
// which on a small model cost as much as the GEMMs themselves.
//
// A plain C ABI with no torch headers, called through ctypes (ops/cpu_layer.py).

#include "paged_decode_cpu.cpp"
#include "quant_gemm_cpu.cpp"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" {

// A group-quantized weight [N, K] in quant_gemm_cpu.cpp's layout; N_padded = its rows padded
// to 16 (the width of the GEMM's output rows). bias [N] or null.
struct RspQuantWeight {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;
  const float* bias;
  int64_t num_rows;         // N
  int64_t num_padded_rows;  // N rounded up to 16
  int64_t num_cols;         // K
  int64_t group_size;
  int64_t bits;
};

// What one layer holds: set once at load (the caches' addresses do not change).
struct RspLayer {
  const float* input_norm;  // [hidden]
  const float* post_norm;   // [hidden]
  float eps;
  RspQuantWeight qkv;  // [(H + 2 Hkv) D, hidden]
  RspQuantWeight o;    // [hidden, H D]
  RspQuantWeight gate_up;  // [2 I, hidden]
  RspQuantWeight down;     // [hidden, I]
  int64_t num_heads, num_kv_heads, head_dim;
  float scale;
  int64_t window;  // <= 0: none
  float soft_cap;  // <= 0: none
  float* key_cache;    // [num_blocks, block_size, Hkv, D]
  float* value_cache;
  int64_t num_blocks, block_size;
};

// What every layer of one step shares: set once per step.
struct RspStep {
  int64_t num_tokens;  // T: one per decode sequence
  int64_t hidden;
  const float* cos;  // [T, D]
  const float* sin;  // [T, D]
  const int64_t* slots;  // [T]: block * block_size + offset, or -1 (nothing written)
  const int32_t* block_tables;  // [T, max_blocks]
  const int32_t* seq_lens;      // [T]
  int64_t max_blocks;
  int32_t num_threads;
};

}  // extern "C"

namespace {

// y [T, hidden] = rmsnorm(x) * w, in float32 as RMSNorm computes it: w * (x / sqrt(mean(x^2) + eps))
void rms_norm(float* y, const float* x, const float* w, int64_t rows, int64_t hidden, float eps) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* xt = x + t * hidden;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < hidden; ++i) sum += xt[i] * xt[i];
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
    float* yt = y + t * hidden;
#pragma omp simd
    for (int64_t i = 0; i < hidden; ++i) yt[i] = w[i] * (xt[i] * inv);
  }
}

// x [heads, D] rotated in place: x * cos + rotate_half(x) * sin, rotate_half = cat(-x2, x1)
void rope(float* x, const float* cos, const float* sin, int64_t heads, int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = xh[i], x2 = xh[i + half];
      xh[i] = x1 * cos[i] + -x2 * sin[i];
      xh[i + half] = x2 * cos[i + half] + x1 * sin[i + half];
    }
  }
}

// y [rows, padded N] = x [rows, K] W^T (+ bias); 0, or 1 when the kernel refuses the shapes
int linear(const RspQuantWeight& w, const float* x, float* y, int64_t rows, int num_threads) {
  const int status = rayserve_group_quant_gemm_f32(x, y, w.codes, w.scales, w.offsets, rows, w.num_padded_rows,
                                                   w.num_cols, w.group_size, w.bits, num_threads);
  if (status != 0 || w.bias == nullptr) return status;
  for (int64_t t = 0; t < rows; ++t) {
    float* yt = y + t * w.num_padded_rows;
#pragma omp simd
    for (int64_t n = 0; n < w.num_rows; ++n) yt[n] += w.bias[n];
  }
  return 0;
}

inline float silu(float g) { return g / (1.f + std::exp(-g)); }

}  // namespace

extern "C" {

// Returns 0; 1 or 2 as the paged-decode kernel does (bad[] names the sequence and block);
// 3 when a slot is outside the cache (bad[0] = the token); 4 when a GEMM refuses its shapes.
// Nothing is written to the caches before every slot, length and block id has been checked.
int rayserve_decoder_layer_decode_f32(const RspLayer* layer, const RspStep* step, float* x, float* residual,
                                      int32_t is_first, int64_t* bad) {
  const RspLayer& L = *layer;
  const RspStep& S = *step;
  const int64_t T = S.num_tokens, hidden = S.hidden, d = L.head_dim;
  const int64_t q_size = L.num_heads * d, kv_size = L.num_kv_heads * d;
  const int64_t num_slots = L.num_blocks * L.block_size;
  for (int64_t t = 0; t < T; ++t)
    if (S.slots[t] >= num_slots || S.slots[t] < -1) {
      bad[0] = t;
      return 3;
    }
  const int checked = check_decode_tables(S.block_tables, S.seq_lens, T, L.num_blocks, L.block_size, S.max_blocks,
                                          L.window, bad);
  if (checked != 0) return checked;
  if (T == 0) return 0;
  const int threads = S.num_threads;
  std::vector<float> h(T * hidden);
  std::vector<float> qkv(T * L.qkv.num_padded_rows);
  std::vector<float> attn(T * q_size);
  std::vector<float> gate_up(T * L.gate_up.num_padded_rows);
  const int64_t inter = L.gate_up.num_rows / 2;
  std::vector<float> act(T * inter);
  std::vector<float> down(T * L.down.num_padded_rows);

  // attention block
  if (is_first) {
    std::memcpy(residual, x, sizeof(float) * T * hidden);
  } else {
    for (int64_t i = 0; i < T * hidden; ++i) residual[i] += x[i];
  }
  rms_norm(h.data(), residual, L.input_norm, T, hidden, L.eps);
  if (linear(L.qkv, h.data(), qkv.data(), T, threads)) return 4;
  std::vector<float> query(T * q_size);
  // every row's k, v into the caches first, then attention over them (see the top)
  for (int64_t t = 0; t < T; ++t) {
    float* row = qkv.data() + t * L.qkv.num_padded_rows;  // [q | k | v]
    rope(row, S.cos + t * d, S.sin + t * d, L.num_heads, d);
    rope(row + q_size, S.cos + t * d, S.sin + t * d, L.num_kv_heads, d);
    std::memcpy(query.data() + t * q_size, row, sizeof(float) * q_size);
    const int64_t slot = S.slots[t];
    if (slot >= 0) {
      std::memcpy(L.key_cache + slot * kv_size, row + q_size, sizeof(float) * kv_size);
      std::memcpy(L.value_cache + slot * kv_size, row + q_size + kv_size, sizeof(float) * kv_size);
    }
  }
  const int status = rayserve_paged_decode_f32(
      attn.data(), query.data(), L.key_cache, L.value_cache, S.block_tables, S.seq_lens, T, L.num_heads,
      L.num_kv_heads, d, L.num_blocks, L.block_size, S.max_blocks, L.scale, L.window, L.soft_cap, threads, bad);
  if (status != 0) return status;
  if (linear(L.o, attn.data(), down.data(), T, threads)) return 4;  // `down` holds o's rows for now
  for (int64_t t = 0; t < T; ++t) {
    const float* o = down.data() + t * L.o.num_padded_rows;
    float* r = residual + t * hidden;
    for (int64_t i = 0; i < hidden; ++i) r[i] += o[i];
  }

  // MLP block
  rms_norm(h.data(), residual, L.post_norm, T, hidden, L.eps);
  if (linear(L.gate_up, h.data(), gate_up.data(), T, threads)) return 4;
  for (int64_t t = 0; t < T; ++t) {
    const float* g = gate_up.data() + t * L.gate_up.num_padded_rows;
    const float* u = g + inter;
    float* a = act.data() + t * inter;
    for (int64_t i = 0; i < inter; ++i) a[i] = silu(g[i]) * u[i];
  }
  if (linear(L.down, act.data(), down.data(), T, threads)) return 4;
  for (int64_t t = 0; t < T; ++t) std::memcpy(x + t * hidden, down.data() + t * L.down.num_padded_rows, sizeof(float) * hidden);
  return 0;
}

}  // extern "C"
