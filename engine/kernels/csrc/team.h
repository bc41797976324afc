// A team: the threads of one OpenMP parallel region that run a decode step's layers together
// (planned_layers.cpp). Inside one, a kernel's loop over work items takes this thread's share of
// them (as at::parallel_for would have handed it out) and the team meets at a barrier after it;
// what one thread must do alone (a norm, the cache write) runs on thread 0 between two barriers.
// Outside a team both fall back to at::parallel_for and a plain call, so every kernel keeps its
// one code path.
#pragma once
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <omp.h>

namespace servelab {

// Whether this thread is running in a team (TeamScope): one flag per thread and per extension
// (each extension is its own library; only planned_layers.cpp opens a team).
inline thread_local bool tl_in_team = false;

struct TeamScope {
  TeamScope() { tl_in_team = true; }
  ~TeamScope() { tl_in_team = false; }
  TeamScope(const TeamScope&) = delete;
  TeamScope& operator=(const TeamScope&) = delete;
};

// The threads sharing a kernel's work, and this one's index among them: the team's inside one
// (at::get_thread_num() counts only at::parallel_for's own threads), else at::parallel_for's.
inline int64_t team_threads() { return tl_in_team ? omp_get_num_threads() : std::max(1, at::get_num_threads()); }
inline int64_t team_thread() { return tl_in_team ? omp_get_thread_num() : at::get_thread_num(); }

// f(b0, b1) over [begin, end) in contiguous ranges, one per thread: at::parallel_for's split with
// a grain of 1 (thread t from begin + t ceil(n / threads)), so a NextWeight hand-off prefetches
// the blocks the same thread reads next; in a team, the team waits for the last range.
template <class F>
inline void team_for(int64_t begin, int64_t end, const F& f) {
  if (!tl_in_team) {
    at::parallel_for(begin, end, 1, f);
    return;
  }
  const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
  const int64_t chunk = (end - begin + nt - 1) / nt;
  const int64_t b0 = begin + t * chunk, b1 = std::min(end, b0 + chunk);
  if (b0 < b1) f(b0, b1);
#pragma omp barrier
}

// f() once: on thread 0 of a team, the others waiting at the barrier after it; else here.
template <class F>
inline void team_single(const F& f) {
  if (!tl_in_team) {
    f();
    return;
  }
  if (omp_get_thread_num() == 0) f();
#pragma omp barrier
}

}  // namespace servelab
