// The symmetric-buffer contract of moe_ref/kernels/ep/ep_regions.py, as the compiled CPU ops see it.
//
// Every op takes `int[] layout`: the EPRegions numbers in the order of MOE_REF_LAYOUT_FIELDS below
// (moe_ref/kernels/runtime/native.py builds it; the op `moe_ref::ep_layout_fields_cpu` returns the names, so a stale
// library is detected at import). Byte offsets are from each buffer's base; a region absent from the
// layout (x_scale / recv_x_scale without fp8) is -1.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace moe_ref {

#define MOE_REF_LAYOUT_FIELDS(X)                                                                          \
  X(num_ranks) X(num_local_experts) X(num_topk) X(cap) X(hidden) X(num_pool_rows) X(alignment) X(masked_rows) \
  X(fp8) X(activation_dtype) X(end) X(signal) X(epoch) X(status) X(counter) X(num_tokens) X(send_count)  \
  X(topk_ids) X(topk_weights) X(slot_rank) X(x) X(x_scale) X(recv_num_tokens) X(num_rows) X(row_start)   \
  X(recv_base) X(pool_end) X(recv_pos) X(recv_weight) X(recv_src) X(recv_x) X(recv_x_scale)              \
  X(combine_partial)

enum LayoutField : int {
#define MOE_REF_ENUM(name) kField_##name,
  MOE_REF_LAYOUT_FIELDS(MOE_REF_ENUM)
#undef MOE_REF_ENUM
  kNumLayoutFields
};

inline std::vector<std::string> layout_field_names() {
  return {
#define MOE_REF_NAME(name) #name,
      MOE_REF_LAYOUT_FIELDS(MOE_REF_NAME)
#undef MOE_REF_NAME
  };
}

// activation_dtype codes (same in native.py)
constexpr int64_t kActFloat32 = 0;
constexpr int64_t kActFloat16 = 1;
constexpr int64_t kActBFloat16 = 2;

// status[0] values (ep_regions.STATUS_*)
constexpr int32_t kStatusOk = 0;
constexpr int32_t kStatusPeerTimeout = 1;
constexpr int32_t kStatusPoolOverflow = 2;

constexpr int64_t kFp8Group = 128;

struct Layout {
  int64_t R, e, K, C, D, P, A;  // ranks, local experts, top-k, cap, row width, pool rows, alignment
  int64_t M;                     // rows of each expert segment of a masked pool; 0: contiguous pool
  bool fp8;
  int64_t act;  // activation dtype code
  int64_t end;  // bytes each buffer must hold
  int64_t off[kNumLayoutFields];

  explicit Layout(at::IntArrayRef v) {
    TORCH_CHECK(static_cast<int64_t>(v.size()) == kNumLayoutFields, "moe_ref native ops: layout has ", v.size(),
                " numbers, expected ", static_cast<int64_t>(kNumLayoutFields), " (stale library? run make install)");
    for (int i = 0; i < kNumLayoutFields; ++i) off[i] = v[i];
    R = v[kField_num_ranks];
    e = v[kField_num_local_experts];
    K = v[kField_num_topk];
    C = v[kField_cap];
    D = v[kField_hidden];
    P = v[kField_num_pool_rows];
    A = v[kField_alignment];
    M = v[kField_masked_rows];
    fp8 = v[kField_fp8] != 0;
    act = v[kField_activation_dtype];
    end = v[kField_end];
    TORCH_CHECK(R > 0 && e > 0 && K > 0 && C > 0 && D > 0 && P > 0 && A > 0, "moe_ref native ops: sizes must be positive");
    TORCH_CHECK(M >= 0 && M % A == 0 && (M == 0 || P == e * M), "moe_ref native ops: bad masked pool (M=", M, ")");
    TORCH_CHECK(act == kActFloat32 || act == kActFloat16 || act == kActBFloat16, "moe_ref native ops: bad activation dtype code ", act);
    TORCH_CHECK(!fp8 || (off[kField_x_scale] >= 0 && off[kField_recv_x_scale] >= 0), "moe_ref native ops: fp8 layout without scale regions");
  }

  int64_t act_bytes() const { return act == kActFloat32 ? 4 : 2; }
  int64_t wire_bytes() const { return fp8 ? 1 : act_bytes(); }   // bytes of one element of x / recv_x
  int64_t scale_cols() const { return (D + kFp8Group - 1) / kFp8Group; }
};

// The R mapped buffers of one rank (uint8, contiguous, >= layout.end bytes each).
struct Peers {
  int64_t rank;
  std::vector<uint8_t*> base;

  Peers(at::TensorList buffers, int64_t rank_, const Layout& L) : rank(rank_) {
    TORCH_CHECK(static_cast<int64_t>(buffers.size()) == L.R, "moe_ref native ops: ", buffers.size(),
                " buffers but R=", L.R, " in the layout");
    TORCH_CHECK(rank >= 0 && rank < L.R, "moe_ref native ops: rank ", rank, " outside [0, ", L.R, ")");
    base.reserve(buffers.size());
    for (size_t s = 0; s < buffers.size(); ++s) {
      const at::Tensor& b = buffers[s];
      TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == at::kByte && b.dim() == 1 && b.is_contiguous() &&
                      b.numel() >= L.end,
                  "moe_ref native ops: buffer of rank ", s, " must be a contiguous CPU uint8 tensor of >= ", L.end,
                  " bytes, got ", b.scalar_type(), " ", b.sizes(), " on ", b.device());
      base.push_back(static_cast<uint8_t*>(b.data_ptr()));
    }
  }

  uint8_t* mine() const { return base[rank]; }
};

template <class T>
inline T* region(uint8_t* buffer_base, const Layout& L, LayoutField field) {
  return reinterpret_cast<T*>(buffer_base + L.off[field]);
}

}  // namespace moe_ref
