// What the one-call layer loops share (planned_layers.cpp, block_layers.cpp): the typed lookup of a
// registered servelab kernel, so each loop calls it through the dispatcher as Python does (torch.profiler
// names it, the fake registrations hold), and the profiler range names of the loop's parts
// (engine/kernels/forward_plan.py PLAN_RANGE_PREFIX, PLAN_PARTS).
#pragma once
#include <ATen/core/dispatch/Dispatcher.h>

namespace servelab {

template <class Fn>
c10::TypedOperatorHandle<Fn> op(const char* name) {
  // typed() checks Fn against the registered kernel's C++ signature: a kernel whose parameters
  // change fails here, at the first call, with the operator's name
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Fn>();
}

inline constexpr const char* kPlanNorm = "servelab::plan:norm";
inline constexpr const char* kPlanLinears = "servelab::plan:linears";
inline constexpr const char* kPlanAttention = "servelab::plan:attention";
inline constexpr const char* kPlanMlp = "servelab::plan:mlp";

}  // namespace servelab
