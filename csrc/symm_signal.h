// Bounded barrier over the `signal` / `epoch` / `status` regions, across processes that map the same
// shared-memory files (the compiled twin of symm_signal.symm_barrier_ref; same writes, same semantics):
//
//   post: epoch += 1 (int32, wraps); then signal_s[rank] = epoch on every rank s, in rank order, with
//         release semantics: every write this process made before the post is visible to a peer that
//         acquires the flag (at::parallel_for joins its workers before the post is reached).
//   wait: returns at once when status[0] != 0. Else polls MY signal[s] (acquire) until every s holds at
//         least `epoch` (int32 difference, so a wrapped epoch still compares right), or until `max_polls`
//         polls or `timeout_us` of steady-clock time ran out: then status = [1, epoch, missing[R]]
//         (status[0] written last, release).
// Waiting spins briefly, then yields, then sleeps a few microseconds per poll (processes may outnumber cores);
// the GIL is not held meanwhile (torch.ops releases it around every op call).
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <thread>
#include <vector>

#include "ep_layout.h"

namespace moe_ref {

inline int32_t load_acquire(int32_t* p) { return std::atomic_ref<int32_t>(*p).load(std::memory_order_acquire); }
inline int32_t load_relaxed(int32_t* p) { return std::atomic_ref<int32_t>(*p).load(std::memory_order_relaxed); }
inline void store_release(int32_t* p, int32_t v) { std::atomic_ref<int32_t>(*p).store(v, std::memory_order_release); }
inline void store_relaxed(int32_t* p, int32_t v) { std::atomic_ref<int32_t>(*p).store(v, std::memory_order_relaxed); }

inline int32_t wrap_add(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) + static_cast<uint32_t>(b));
}
inline int32_t wrap_sub(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint32_t>(a) - static_cast<uint32_t>(b));
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline void barrier_post(const Peers& peers, const Layout& L) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  int32_t* epoch = region<int32_t>(peers.mine(), L, kField_epoch);
  const int32_t next = wrap_add(load_relaxed(epoch), 1);
  store_relaxed(epoch, next);
  for (int64_t s = 0; s < L.R; ++s) {
    store_release(region<int32_t>(peers.base[s], L, kField_signal) + peers.rank, next);
  }
}

inline void barrier_wait(const Peers& peers, const Layout& L, double timeout_us, int64_t max_polls) {
  int32_t* status = region<int32_t>(peers.mine(), L, kField_status);
  if (load_acquire(status) != kStatusOk) return;
  const int32_t target = load_relaxed(region<int32_t>(peers.mine(), L, kField_epoch));
  int32_t* signal = region<int32_t>(peers.mine(), L, kField_signal);
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  // a bound beyond ~30 years is "no time bound" (and keeps the duration arithmetic finite)
  const bool timed = timeout_us < 1e15;
  const auto deadline = start + std::chrono::duration_cast<clock::duration>(
                                    std::chrono::duration<double, std::micro>(timed ? timeout_us : 0.0));
  std::vector<int32_t> missing(L.R, 0);
  int64_t polls = 0;
  while (true) {
    bool any = false;
    for (int64_t s = 0; s < L.R; ++s) {
      missing[s] = wrap_sub(load_acquire(signal + s), target) < 0 ? 1 : 0;
      any = any || missing[s];
    }
    if (!any) return;
    const auto now = clock::now();
    if (polls >= max_polls || (timed && now > deadline)) break;
    ++polls;
    if (polls < 256) {
      cpu_relax();
    } else if (now - start < std::chrono::microseconds(200)) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(5));
    }
  }
  store_relaxed(status + 1, target);
  for (int64_t s = 0; s < L.R; ++s) store_relaxed(status + 2 + s, missing[s]);
  store_release(status, kStatusPeerTimeout);
}

}  // namespace moe_ref
