#include "planned.h"

#include <ATen/Parallel.h>

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kNames[] = {
    "all_gather_matmul",        "matmul_reduce_scatter",        "matmul_all_reduce",        "matmul_all_gather",
    "all_gather_scaled_matmul", "scaled_matmul_reduce_scatter", "scaled_matmul_all_reduce",
};
static_assert(sizeof(kNames) / sizeof(kNames[0]) == static_cast<size_t>(PlannedOp::kCount), "one name per op");

std::mutex memo_mutex;
std::unordered_map<std::string, RememberedPlan> memo;
std::atomic<bool> memo_enabled{true};
// Per op, the id of its latest decision (-1: none yet).
struct Latest {
  std::array<std::atomic<int64_t>, static_cast<size_t>(PlannedOp::kCount)> ids;
  Latest() {
    for (auto& id : ids) id.store(-1);
  }
} latest;

}  // namespace

const char* planned_op_name(PlannedOp op) { return op < PlannedOp::kCount ? kNames[static_cast<int>(op)] : nullptr; }

PlannedOp planned_op_named(c10::string_view name) {
  for (int i = 0; i < static_cast<int>(PlannedOp::kCount); ++i) {
    if (name == kNames[i]) return static_cast<PlannedOp>(i);
  }
  return PlannedOp::kCount;
}

CallKey::CallKey(PlannedOp op, c10::string_view group_name, const char* op_name)
    : op_(op), group_(resolve_group(group_name, op_name)) {
  bytes_.reserve(256);
  append(static_cast<int64_t>(op));
  // The group object and size as well as its name: a name can come back for another group once the first is
  // destroyed.
  append(reinterpret_cast<intptr_t>(group_.get()));
  append(group_->getSize());
  append(at::get_num_threads());
  text(group_name);
}

CallKey& CallKey::tensor(const at::Tensor& t) {
  append(static_cast<int64_t>(t.scalar_type()));
  append(static_cast<int64_t>(t.device().type()));
  append(t.device().index());
  append(static_cast<int64_t>(t.layout()));
  append(t.dim());
  for (const int64_t size : t.sizes()) append(size);
  for (const int64_t stride : t.strides()) append(stride);
  return *this;
}

CallKey& CallKey::tensors(at::TensorList ts) {
  append(static_cast<int64_t>(ts.size()));
  for (const at::Tensor& t : ts) tensor(t);
  return *this;
}

CallKey& CallKey::value(int64_t v) {
  append(v);
  return *this;
}

CallKey& CallKey::text(c10::string_view s) {
  append(static_cast<int64_t>(s.size()));
  bytes_.append(s.data(), s.size());
  return *this;
}

std::optional<RememberedPlan> remembered_plan(const CallKey& key) {
  // A call that must be checked across ranks every time reaches the planner every time.
  if (!memo_enabled.load(std::memory_order_relaxed) || checks_every_call()) return std::nullopt;
  RememberedPlan plan;
  {
    std::lock_guard<std::mutex> lock(memo_mutex);
    const auto found = memo.find(key.bytes());
    if (found == memo.end()) return std::nullopt;
    plan = found->second;
  }
  set_planned_decision(key.op(), plan.decision);
  return plan;
}

void remember_plan(const CallKey& key, const RememberedPlan& plan) {
  std::lock_guard<std::mutex> lock(memo_mutex);
  memo[key.bytes()] = plan;
}

void forget_plans() {
  std::lock_guard<std::mutex> lock(memo_mutex);
  memo.clear();
  for (auto& id : latest.ids) id.store(-1, std::memory_order_relaxed);
}

void set_plan_memo(bool enabled) { memo_enabled.store(enabled, std::memory_order_relaxed); }

int64_t planned_decision(PlannedOp op) {
  return op < PlannedOp::kCount ? latest.ids[static_cast<size_t>(op)].load(std::memory_order_relaxed) : -1;
}

void set_planned_decision(PlannedOp op, int64_t decision) {
  latest.ids[static_cast<size_t>(op)].store(decision, std::memory_order_relaxed);
}

}  // namespace fused
}  // namespace fastmesh
