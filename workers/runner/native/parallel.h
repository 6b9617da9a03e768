// Work items handed out to the threads of one parallel region as they ask, instead of in
// equal halves fixed up front (at::parallel_for): on a machine this small, a thread the
// OS takes off its core for a few milliseconds (the worker's event loop, a client, a
// neighbour) held the whole region up by its half while the other thread waited. Here
// the other thread takes what is left (Zen 3, a busy loop on one of the two cores, the
// bf16 decode attention of 8 layers at batch 64: 14.1-14.5 -> 10.5-13.9 ms).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace switchyard {

// One thread's view of the items [0, n): `next()` is the thread's next item (n when all
// are taken), claimed `grain` at a time from the shared counter. Claiming the next item
// before the current one is done is how a kernel knows what to prefetch.
class Claims {
 public:
  Claims(std::atomic<int64_t>& counter, int64_t n, int64_t grain)
      : counter_(counter), n_(n), grain_(grain) {}

  int64_t next() {
    if (at_ == end_) {
      at_ = std::min(n_, counter_.fetch_add(grain_, std::memory_order_relaxed));
      end_ = std::min(n_, at_ + grain_);
      if (at_ == n_) return n_;
    }
    return at_++;
  }

 private:
  std::atomic<int64_t>& counter_;
  const int64_t n_, grain_;
  int64_t at_ = 0, end_ = 0;
};

// body(Claims&) on each thread of one parallel region (as many threads as there are
// grains, up to torch's count; inline within another region, where it claims them all).
template <typename Body>
void parallel_claims(int64_t n, int64_t grain, Body&& body) {
  if (n <= 0) return;
  std::atomic<int64_t> counter{0};
  const int64_t grains = (n + grain - 1) / grain;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), grains));
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Claims claims(counter, n, grain);
    body(claims);
  });
}

}  // namespace switchyard
