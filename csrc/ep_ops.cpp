// Compiled CPU twins of the EP data path over the shared-memory symmetric heap (moe_ref/kernels/ep_*.py):
//
//   ep_pre_dispatch_cpu -> symm_barrier_cpu -> ep_dispatch_cpu -> experts -> ep_combine_push_cpu
//       -> symm_barrier_cpu -> ep_combine_reduce_cpu          (the barrier halves can be fused, like ep_chunk's)
//
// Each op does the same writes as its torch twin (`*_ref`), bit for bit: rows are moved as bytes, fp8 is
// quantized with c10's e4m3 conversion (what torch's `.to(float8_e4m3fn)` uses), every fp32 sum adds in the
// twin's order with separate multiply and add roundings (built with -ffp-contract=off), and fp32 -> bf16/fp16
// rounds to nearest even (c10's conversions). Work is split with at::parallel_for over tokens; each output
// element is written by exactly one task, so results do not depend on the thread count.
//
// One documented difference: after a peer timeout (status[0] == 1) ep_dispatch_cpu receives nothing from any
// source (the kernels' contract, ep_dispatch.py module doc); the torch twin still reads the sources' rows.
//
// Shape legend: R ranks, e local experts, K top-k, C cap, T tokens, D row width, Db = ceil(D/128), P pool rows.
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "ep_layout.h"
#include "symm_signal.h"

namespace moe_ref {
namespace {

// ------------------------------------------------------------------------------------------------
// element conversions (bitwise what torch's CPU casts do)
// ------------------------------------------------------------------------------------------------
template <class T>
inline float to_float(T v) {
  return static_cast<float>(v);
}

template <class T>
inline T from_float(float v) {
  return static_cast<T>(v);  // c10::BFloat16 / c10::Half: round to nearest even
}

template <class F>
void with_act_type(int64_t code, F&& f) {
  switch (code) {
    case kActFloat32: f(float{}); break;
    case kActFloat16: f(c10::Half{}); break;
    case kActBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "moe_ref native ops: bad dtype code ", code);
  }
}

template <class F>
void with_float_type(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(c10::Half{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    default: TORCH_CHECK(false, "moe_ref native ops: expected fp32/fp16/bf16, got ", t);
  }
}

int64_t act_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return kActFloat32;
    case at::kHalf: return kActFloat16;
    case at::kBFloat16: return kActBFloat16;
    default: TORCH_CHECK(false, "moe_ref native ops: expected fp32/fp16/bf16, got ", t);
  }
  return -1;
}

// ------------------------------------------------------------------------------------------------
// pre-dispatch: my send regions + layout (counts, slot ranks, num_tokens)
// ------------------------------------------------------------------------------------------------

// quantize_fp8_per_128 of one row: scale = max(amax, 1e-4) / 448 (IEEE division), q = e4m3(x / scale).
template <class T>
void quantize_rows_fp8(const T* x, int64_t T_, int64_t D, uint8_t* q, float* scale) {
  const int64_t Db = (D + kFp8Group - 1) / kFp8Group;
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* row = x + t * D;
      for (int64_t g = 0; g < Db; ++g) {
        const int64_t c0 = g * kFp8Group, c1 = std::min(D, c0 + kFp8Group);
        float amax = 0.0f;  // the padding columns of the twin's F.pad are zeros
        bool nan = false;
        for (int64_t c = c0; c < c1; ++c) {
          const float a = std::fabs(to_float(row[c]));
          if (a != a) nan = true;
          else if (a > amax) amax = a;
        }
        if (nan) amax = std::numeric_limits<float>::quiet_NaN();
        else if (amax < 1e-4f) amax = 1e-4f;
        const float s = amax / 448.0f;
        scale[t * Db + g] = s;
        uint8_t* qrow = q + t * D;
        for (int64_t c = c0; c < c1; ++c) qrow[c] = c10::Float8_e4m3fn(to_float(row[c]) / s).x;
      }
    }
  });
}

// send_count / slot_rank / num_tokens (ep_layout_ref): slot (t, j)'s rank among my slots to its expert in
// row-major order. Chunks of slots are counted in parallel, then ranked from per-chunk prefix sums.
void write_layout(const int64_t* ids, int64_t T_, const Peers& peers, const Layout& L) {
  uint8_t* my = peers.mine();
  const int64_t N = T_ * L.K, E = L.R * L.e;
  int32_t* slot_rank = region<int32_t>(my, L, kField_slot_rank);
  const int64_t grain = 16384;
  const int64_t nchunks = N == 0 ? 0 : std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (N + grain - 1) / grain));
  const int64_t per = nchunks ? (N + nchunks - 1) / nchunks : 0;
  std::vector<int64_t> counts(static_cast<size_t>(nchunks * E + E), 0);  // [nchunks, E] then totals [E]
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* cnt = counts.data() + c * E;
      for (int64_t n = c * per, stop = std::min(N, (c + 1) * per); n < stop; ++n) {
        const int64_t id = ids[n];
        if (id >= 0 && id < E) ++cnt[id];
      }
    }
  });
  int64_t* total = counts.data() + nchunks * E;
  for (int64_t c = 0; c < nchunks; ++c) {  // counts[c] becomes the exclusive prefix of chunks < c
    int64_t* cnt = counts.data() + c * E;
    for (int64_t g = 0; g < E; ++g) {
      const int64_t here = cnt[g];
      cnt[g] = total[g];
      total[g] += here;
    }
  }
  at::parallel_for(0, nchunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      std::vector<int64_t> next(counts.begin() + c * E, counts.begin() + (c + 1) * E);
      for (int64_t n = c * per, stop = std::min(N, (c + 1) * per); n < stop; ++n) {
        const int64_t id = ids[n];
        slot_rank[n] = (id >= 0 && id < E) ? static_cast<int32_t>(next[id]++) : -1;
      }
    }
  });
  int32_t* send_count = region<int32_t>(my, L, kField_send_count);
  for (int64_t g = 0; g < E; ++g) send_count[g] = static_cast<int32_t>(total[g]);
  region<int32_t>(my, L, kField_num_tokens)[0] = static_cast<int32_t>(T_);
}

// ep_pre_dispatch_ref (x and weights given) or ep_layout_ref (both None).
void ep_pre_dispatch_cpu(const std::optional<at::Tensor>& x, const at::Tensor& topk_ids,
                         const std::optional<at::Tensor>& topk_weights, at::TensorList buffers, int64_t rank,
                         at::IntArrayRef layout, bool post) {
  const Layout L(layout);
  const Peers peers(buffers, rank, L);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.scalar_type() == at::kLong && topk_ids.size(1) == L.K,
              "ep_pre_dispatch_cpu: topk_ids must be int64 [T, ", L.K, "]");
  const int64_t T_ = topk_ids.size(0);
  TORCH_CHECK(T_ <= L.C, "ep_pre_dispatch_cpu: ", T_, " tokens exceed the cap ", L.C);
  TORCH_CHECK(x.has_value() == topk_weights.has_value(), "ep_pre_dispatch_cpu: pass x and topk_weights together");
  const at::Tensor ids = topk_ids.contiguous();
  uint8_t* my = peers.mine();
  if (x.has_value() && T_ > 0) {
    const at::Tensor xc = x->contiguous();
    const at::Tensor w = topk_weights->contiguous();
    TORCH_CHECK(xc.dim() == 2 && xc.size(0) == T_ && xc.size(1) == L.D && act_code(xc.scalar_type()) == L.act,
                "ep_pre_dispatch_cpu: x must be [T, D] in the layout's activation dtype");
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == T_ && w.size(1) == L.K,
                "ep_pre_dispatch_cpu: topk_weights must be fp32 [T, K]");
    uint8_t* dst = region<uint8_t>(my, L, kField_x);
    if (L.fp8) {
      float* scale = region<float>(my, L, kField_x_scale);
      with_float_type(xc.scalar_type(), [&](auto tag) {
        using T = decltype(tag);
        quantize_rows_fp8<T>(static_cast<const T*>(xc.data_ptr()), T_, L.D, dst, scale);
      });
    } else {
      const int64_t row_bytes = L.D * L.act_bytes();
      const auto* src = static_cast<const uint8_t*>(xc.data_ptr());
      at::parallel_for(0, T_, 64, [&](int64_t t0, int64_t t1) {
        std::memcpy(dst + t0 * row_bytes, src + t0 * row_bytes, static_cast<size_t>((t1 - t0) * row_bytes));
      });
    }
    std::memcpy(region<int64_t>(my, L, kField_topk_ids), ids.data_ptr(), static_cast<size_t>(T_ * L.K * 8));
    std::memcpy(region<float>(my, L, kField_topk_weights), w.data_ptr(), static_cast<size_t>(T_ * L.K * 4));
  }
  write_layout(static_cast<const int64_t*>(ids.data_ptr()), T_, peers, L);
  if (post) barrier_post(peers, L);
}

// ------------------------------------------------------------------------------------------------
// barrier
// ------------------------------------------------------------------------------------------------
void symm_barrier_cpu(at::TensorList buffers, int64_t rank, at::IntArrayRef layout, bool post, bool wait,
                      double timeout_us, int64_t max_polls) {
  const Layout L(layout);
  const Peers peers(buffers, rank, L);
  TORCH_CHECK(post || wait, "symm_barrier_cpu: post and wait are both False: nothing to do");
  if (post) barrier_post(peers, L);
  if (wait) barrier_wait(peers, L, timeout_us, max_polls);
}

// ------------------------------------------------------------------------------------------------
// dispatch: pull the rows routed to my experts into my expert-major pool (ep_dispatch_ref)
// ------------------------------------------------------------------------------------------------
void ep_dispatch_cpu(at::TensorList buffers, int64_t rank, at::IntArrayRef layout, bool wait, double timeout_us,
                     int64_t max_polls) {
  const Layout L(layout);
  const Peers peers(buffers, rank, L);
  if (wait) barrier_wait(peers, L, timeout_us, max_polls);
  uint8_t* my = peers.mine();
  const int64_t R = L.R, e = L.e, K = L.K, C = L.C, P = L.P, A = L.A;
  int32_t* status = region<int32_t>(my, L, kField_status);
  const bool live = load_acquire(status) != kStatusPeerTimeout;

  // receive layout
  std::vector<int32_t> num_tokens(R, 0);
  std::vector<int64_t> counts(R * e, 0), num_rows(e, 0), aligned(e, 0), row_start(e, 0), recv_base(R * e, 0);
  for (int64_t s = 0; s < R; ++s) {
    if (!live) break;
    num_tokens[s] = load_relaxed(region<int32_t>(peers.base[s], L, kField_num_tokens));
    const int32_t* sc = region<int32_t>(peers.base[s], L, kField_send_count) + rank * e;
    for (int64_t i = 0; i < e; ++i) counts[s * e + i] = sc[i];
  }
  int64_t pool_end = 0;
  int64_t most_rows = 0;
  std::vector<int64_t> segment(e, 0);  // aligned rows (contiguous pool) or M (masked pool)
  for (int64_t i = 0; i < e; ++i) {
    for (int64_t s = 0; s < R; ++s) num_rows[i] += counts[s * e + i];
    aligned[i] = (num_rows[i] + A - 1) / A * A;
    segment[i] = L.M > 0 ? L.M : aligned[i];
    most_rows = std::max(most_rows, num_rows[i]);
    row_start[i] = pool_end;
    pool_end += segment[i];
    int64_t below = 0;
    for (int64_t s = 0; s < R; ++s) {
      recv_base[s * e + i] = row_start[i] + below;
      below += counts[s * e + i];
    }
  }
  std::memcpy(region<int32_t>(my, L, kField_recv_num_tokens), num_tokens.data(), R * 4);
  std::memcpy(region<int64_t>(my, L, kField_num_rows), num_rows.data(), e * 8);
  std::memcpy(region<int64_t>(my, L, kField_row_start), row_start.data(), e * 8);
  std::memcpy(region<int64_t>(my, L, kField_recv_base), recv_base.data(), R * e * 8);
  region<int64_t>(my, L, kField_pool_end)[0] = pool_end;
  if (pool_end > P) {
    status[1] = static_cast<int32_t>(pool_end);
    status[0] = kStatusPoolOverflow;
  }
  if (L.M > 0 && most_rows > L.M) {
    status[1] = static_cast<int32_t>(most_rows);
    status[0] = kStatusPoolOverflow;
  }
  int32_t* recv_src = region<int32_t>(my, L, kField_recv_src);
  for (int64_t i = 0; i < e; ++i) {  // padding rows of each segment, below P
    for (int64_t p = row_start[i] + num_rows[i]; p < row_start[i] + std::min(aligned[i], segment[i]); ++p) {
      if (p >= 0 && p < P) recv_src[p * 3] = recv_src[p * 3 + 1] = recv_src[p * 3 + 2] = -1;
    }
  }

  // rows: one task per (source, token)
  int32_t* recv_pos = region<int32_t>(my, L, kField_recv_pos);
  float* recv_weight = region<float>(my, L, kField_recv_weight);
  uint8_t* recv_x = region<uint8_t>(my, L, kField_recv_x);
  const int64_t row_bytes = L.D * L.wire_bytes();
  const int64_t scale_bytes = L.scale_cols() * 4;
  uint8_t* recv_scale = L.fp8 ? region<uint8_t>(my, L, kField_recv_x_scale) : nullptr;
  at::parallel_for(0, R * C, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t s = n / C, t = n % C;
      if (t >= num_tokens[s]) continue;
      uint8_t* src = peers.base[s];
      const int64_t* ids = region<int64_t>(src, L, kField_topk_ids) + t * K;
      const int32_t* srank = region<int32_t>(src, L, kField_slot_rank) + t * K;
      const float* weights = region<float>(src, L, kField_topk_weights) + t * K;
      int32_t* pos_out = recv_pos + n * K;
      std::memcpy(recv_weight + n * K, weights, K * 4);
      for (int64_t j = 0; j < K; ++j) {
        const int64_t id = ids[j], local = id - rank * e;
        int64_t pos = -1;
        if (id >= 0 && local >= 0 && local < e) {
          const int64_t p = recv_base[s * e + local] + static_cast<int64_t>(srank[j]);
          const int64_t segment_end = L.M > 0 ? (local + 1) * L.M : P;
          if (p >= 0 && p < P && p < segment_end) pos = p;
        }
        pos_out[j] = static_cast<int32_t>(pos);
        if (pos < 0) continue;
        recv_src[pos * 3] = static_cast<int32_t>(s);
        recv_src[pos * 3 + 1] = static_cast<int32_t>(t);
        recv_src[pos * 3 + 2] = static_cast<int32_t>(j);
        std::memcpy(recv_x + pos * row_bytes, region<uint8_t>(src, L, kField_x) + t * row_bytes, row_bytes);
        if (recv_scale) {
          std::memcpy(recv_scale + pos * scale_bytes, region<uint8_t>(src, L, kField_x_scale) + t * scale_bytes,
                      scale_bytes);
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------
// combine push: one weighted fp32 partial per (source, token), stored in the source's buffer
// ------------------------------------------------------------------------------------------------
template <class Y, class Part>
void combine_push_impl(const Y* y, int64_t y_rows, int64_t y_stride, const Peers& peers, const Layout& L) {
  uint8_t* my = peers.mine();
  const int64_t C = L.C, K = L.K, D = L.D, rank = peers.rank;
  const int32_t* num_tokens = region<int32_t>(my, L, kField_recv_num_tokens);
  const int32_t* recv_pos = region<int32_t>(my, L, kField_recv_pos);
  const float* recv_weight = region<float>(my, L, kField_recv_weight);
  at::parallel_for(0, L.R * C, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> acc(D);
    for (int64_t n = n0; n < n1; ++n) {
      const int64_t s = n / C, t = n % C;
      if (t >= num_tokens[s]) continue;
      const int32_t* pos = recv_pos + n * K;
      const float* w = recv_weight + n * K;
      bool any = false;
      for (int64_t j = 0; j < K; ++j) any = any || pos[j] >= 0;
      if (!any) continue;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < K; ++j) {
        if (pos[j] < 0) continue;
        const float wj = w[j];
        if (pos[j] == y_rows) {  // the twin's zero row past y (y_pad)
          for (int64_t d = 0; d < D; ++d) {
            const float prod = wj * 0.0f;
            acc[d] = acc[d] + prod;
          }
          continue;
        }
        const Y* row = y + static_cast<int64_t>(pos[j]) * y_stride;
        for (int64_t d = 0; d < D; ++d) {
          const float prod = wj * to_float(row[d]);
          acc[d] = acc[d] + prod;
        }
      }
      Part* out = region<Part>(peers.base[s], L, kField_combine_partial) + (rank * C + t) * D;
      for (int64_t d = 0; d < D; ++d) out[d] = from_float<Part>(acc[d]);
    }
  });
}

void ep_combine_push_cpu(const at::Tensor& y, at::TensorList buffers, int64_t rank, at::IntArrayRef layout,
                         bool post) {
  const Layout L(layout);
  const Peers peers(buffers, rank, L);
  TORCH_CHECK(y.device().is_cpu() && y.dim() == 2 && y.size(1) == L.D && (y.numel() == 0 || y.stride(1) == 1),
              "ep_combine_push_cpu: y must be a CPU [rows, D] tensor with a contiguous last dimension");
  const int64_t y_rows = y.size(0);
  // every received row must be covered (the twin raises for a row past y; one past is its zero row)
  {
    uint8_t* my = peers.mine();
    const int32_t* num_tokens = region<int32_t>(my, L, kField_recv_num_tokens);
    const int32_t* recv_pos = region<int32_t>(my, L, kField_recv_pos);
    for (int64_t s = 0; s < L.R; ++s) {
      const int64_t Ts = std::min<int64_t>(num_tokens[s], L.C);
      for (int64_t k = 0; k < Ts * L.K; ++k) {
        const int32_t p = recv_pos[s * L.C * L.K + k];
        TORCH_CHECK(p < 0 || p <= y_rows, "ep_combine_push_cpu: received row ", p, " is past y's ", y_rows, " rows");
      }
    }
  }
  with_float_type(y.scalar_type(), [&](auto ytag) {
    using Y = decltype(ytag);
    with_act_type(L.act, [&](auto ptag) {
      using Part = decltype(ptag);
      combine_push_impl<Y, Part>(static_cast<const Y*>(y.data_ptr()), y_rows, y_rows ? y.stride(0) : L.D, peers, L);
    });
  });
  if (post) barrier_post(peers, L);
}

// ------------------------------------------------------------------------------------------------
// combine reduce: out[t] = sum over owning ranks in rank order (fp32) -> out dtype
// ------------------------------------------------------------------------------------------------
template <class Part, class Out>
void combine_reduce_impl(int64_t T_, Out* out, const Peers& peers, const Layout& L) {
  uint8_t* my = peers.mine();
  const int64_t R = L.R, C = L.C, K = L.K, D = L.D, e = L.e;
  const int64_t* ids = region<int64_t>(my, L, kField_topk_ids);
  const Part* part = region<Part>(my, L, kField_combine_partial);
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(D);
    std::vector<char> owns(R);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(owns.begin(), owns.end(), 0);
      for (int64_t j = 0; j < K; ++j) {
        const int64_t id = ids[t * K + j];
        if (id >= 0 && id / e < R) owns[id / e] = 1;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t src = 0; src < R; ++src) {
        if (!owns[src]) continue;
        const Part* row = part + (src * C + t) * D;
        for (int64_t d = 0; d < D; ++d) acc[d] = acc[d] + to_float(row[d]);
      }
      Out* o = out + t * D;
      for (int64_t d = 0; d < D; ++d) o[d] = from_float<Out>(acc[d]);
    }
  });
}

at::Tensor ep_combine_reduce_cpu(int64_t num_tokens, at::TensorList buffers, int64_t rank, at::IntArrayRef layout,
                                 at::ScalarType out_dtype, bool wait, double timeout_us, int64_t max_polls) {
  const Layout L(layout);
  const Peers peers(buffers, rank, L);
  TORCH_CHECK(num_tokens >= 0 && num_tokens <= L.C, "ep_combine_reduce_cpu: num_tokens=", num_tokens,
              " must be in [0, C=", L.C, "]");
  if (wait) barrier_wait(peers, L, timeout_us, max_polls);
  at::Tensor out = at::empty({num_tokens, L.D}, at::TensorOptions().dtype(out_dtype).device(at::kCPU));
  if (num_tokens == 0) return out;
  with_act_type(L.act, [&](auto ptag) {
    using Part = decltype(ptag);
    with_float_type(out_dtype, [&](auto otag) {
      using Out = decltype(otag);
      combine_reduce_impl<Part, Out>(num_tokens, static_cast<Out*>(out.data_ptr()), peers, L);
    });
  });
  return out;
}

std::vector<std::string> ep_layout_fields_cpu() { return layout_field_names(); }

}  // namespace
}  // namespace moe_ref

// FRAGMENT: the namespace stays open for the Python-side custom ops (torch.library) of the same library.
TORCH_LIBRARY_FRAGMENT(moe_ref, m) {
  m.def("ep_layout_fields_cpu() -> str[]", &moe_ref::ep_layout_fields_cpu);
  m.def("ep_pre_dispatch_cpu(Tensor? x, Tensor topk_ids, Tensor? topk_weights, Tensor(a!)[] buffers, int rank, "
        "int[] layout, bool post) -> ()");
  m.def("symm_barrier_cpu(Tensor(a!)[] buffers, int rank, int[] layout, bool post, bool wait, float timeout_us, "
        "int max_polls) -> ()");
  m.def("ep_dispatch_cpu(Tensor(a!)[] buffers, int rank, int[] layout, bool wait, float timeout_us, "
        "int max_polls) -> ()");
  m.def("ep_combine_push_cpu(Tensor y, Tensor(a!)[] buffers, int rank, int[] layout, bool post) -> ()");
  m.def("ep_combine_reduce_cpu(int num_tokens, Tensor(a!)[] buffers, int rank, int[] layout, ScalarType out_dtype, "
        "bool wait, float timeout_us, int max_polls) -> Tensor");
}

TORCH_LIBRARY_IMPL(moe_ref, CPU, m) {
  m.impl("ep_pre_dispatch_cpu", &moe_ref::ep_pre_dispatch_cpu);
  m.impl("symm_barrier_cpu", &moe_ref::symm_barrier_cpu);
  m.impl("ep_dispatch_cpu", &moe_ref::ep_dispatch_cpu);
  m.impl("ep_combine_push_cpu", &moe_ref::ep_combine_push_cpu);
  m.impl("ep_combine_reduce_cpu", &moe_ref::ep_combine_reduce_cpu);
}

// A Python module with no functions: importing moe_ref._C loads the library, which registers the ops above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_C", "moe_ref compiled CPU EP ops (torch.ops.moe_ref.*_cpu)", -1, nullptr};
  return PyModule_Create(&module);
}
