#include "process_group.h"

#include "fastmesh/checks.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/debug.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <mutex>
#include <set>
#include <sstream>
#include <string>

namespace fastmesh {
namespace fused {

Group resolve_group(c10::string_view group_name, const char* op) {
  const std::string name(group_name);
  try {
    return c10d::resolve_process_group(name);
  } catch (const c10::Error&) {
    TORCH_CHECK_VALUE(false, op, ": group_name ", '"', name, '"',
                      " names no registered process group (pass fastmesh.group_name(group) of a live group)");
  }
}

// torch 2.14 renames _allgather_base / _reduce_scatter_base to all_gather_single / reduce_scatter_single
// and deprecates the old names; 2.11 has only the old ones. Both reach the same dispatcher ops.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
Work start_all_gather(const Group& group, at::Tensor& output, at::Tensor& input) {
  c10d::AllgatherOptions options;
  options.asyncOp = true;
  return group->_allgather_base(output, input, options);
}

Work start_reduce_scatter_sum(const Group& group, at::Tensor& output, at::Tensor& input) {
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.asyncOp = true;
  return group->_reduce_scatter_base(output, input, options);
}
#pragma GCC diagnostic pop

Work start_all_reduce_sum(const Group& group, at::Tensor& tensor) {
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.asyncOp = true;
  std::vector<at::Tensor> tensors{tensor};
  return group->allreduce(tensors, options);
}

bool point_to_point(const Group& group, const at::Device& device) {
  return group->getBackend(device.type())->getBackendName() == "gloo";
}

namespace {

void start_send(const Group& group, std::vector<Work>& works, const at::Tensor& tensor, int64_t peer, int tag) {
  std::vector<at::Tensor> tensors{tensor};
  works.push_back(group->send(tensors, static_cast<int>(peer), tag));
}

void start_recv(const Group& group, std::vector<Work>& works, const at::Tensor& tensor, int64_t peer, int tag) {
  std::vector<at::Tensor> tensors{tensor};
  works.push_back(group->recv(tensors, static_cast<int>(peer), tag));
}

}  // namespace

std::vector<Work> start_piece_exchange(const Group& group, const at::Tensor& mine, const std::vector<at::Tensor>& parts,
                                       int tag) {
  const int64_t world = group->getSize(), rank = group->getRank();
  std::vector<Work> works;
  // Peers in ring order from this rank, so that no rank is every rank's first destination.
  for (int64_t step = 1; step < world; ++step) {
    const int64_t to = (rank + step) % world, from = (rank - step + world) % world;
    start_send(group, works, mine, to, tag);
    start_recv(group, works, parts[from], from, tag);
  }
  return works;
}

void start_piece_receives(const Group& group, const at::Tensor& received, int tag, std::vector<Work>& works) {
  const int64_t world = group->getSize(), rank = group->getRank();
  for (int64_t step = 1; step < world; ++step) {
    const int64_t from = (rank - step + world) % world;
    start_recv(group, works, received[from], from, tag);
  }
}

void start_piece_send(const Group& group, const at::Tensor& partial, int64_t to, int tag, std::vector<Work>& works) {
  start_send(group, works, partial, to, tag);
}

namespace {

// A fixed-size fingerprint so that the check itself cannot mismatch: [ndim, dtype, sizes..., fold].
constexpr int64_t kShapeSlots = 10;

std::string describe(const int64_t* slots) {
  std::ostringstream out;
  const int64_t ndim = slots[0];
  out << "shape [";
  for (int64_t i = 0; i < std::min(ndim, kShapeSlots - 3); ++i) out << (i ? ", " : "") << slots[2 + i];
  if (ndim > kShapeSlots - 3) out << ", ...";
  out << "] " << torch_dtype_name(static_cast<c10::ScalarType>(slots[1]));
  return out.str();
}

}  // namespace

namespace {

std::mutex checked_mutex;
std::set<std::string> checked_calls;  // group name / op / argument whose first call passed the check

std::string call_key(const Group& group, const char* op, const char* arg) {
  return group->getGroupName() + "/" + op + "/" + arg;
}

// Every rank takes the same decision: the ranks of a group call its ops in the same order (as for any
// collective), so a call is the first of its op and argument on the group on every rank or on none.
bool checks_this_call(const Group& group, const at::Tensor& tensor, const char* op, const char* arg) {
  if (c10d::debug_level() == c10d::DebugLevel::Detail) return true;
  if (!tensor.device().is_cpu()) return false;
  std::lock_guard<std::mutex> lock(checked_mutex);
  return checked_calls.count(call_key(group, op, arg)) == 0;
}

void passed_check(const Group& group, const char* op, const char* arg) {
  std::lock_guard<std::mutex> lock(checked_mutex);
  checked_calls.insert(call_key(group, op, arg));
}

}  // namespace

void check_same_shape_on_all_ranks(const Group& group, const at::Tensor& tensor, const char* op, const char* arg) {
  const int64_t world = group->getSize();
  if (world == 1 || !checks_this_call(group, tensor, op, arg)) return;
  const bool on_cpu = tensor.device().is_cpu();

  at::Tensor mine = at::zeros({kShapeSlots}, at::kLong);
  int64_t* slots = mine.mutable_data_ptr<int64_t>();
  slots[0] = tensor.dim();
  slots[1] = static_cast<int64_t>(tensor.scalar_type());
  uint64_t fold = 0;  // dims past the slots, hashed (FNV-1a): still detects a mismatch there
  for (int64_t i = 0; i < tensor.dim(); ++i) {
    if (i < kShapeSlots - 3) {
      slots[2 + i] = tensor.size(i);
    } else {
      fold = (fold ^ static_cast<uint64_t>(tensor.size(i))) * 1099511628211ull;
    }
  }
  slots[kShapeSlots - 1] = static_cast<int64_t>(fold);

  at::Tensor send = on_cpu ? mine : mine.to(tensor.device());
  at::Tensor all = at::empty({world * kShapeSlots}, send.options());
  {
    RECORD_USER_SCOPE("fastmesh::check_shapes");
    start_all_gather(group, all, send)->wait();
  }
  const at::Tensor gathered = all.cpu();
  const int64_t* theirs = gathered.const_data_ptr<int64_t>();
  bool same = true;
  for (int64_t i = 0; i < world * kShapeSlots; ++i) same = same && theirs[i] == slots[i % kShapeSlots];
  if (same) {
    passed_check(group, op, arg);
    return;
  }
  std::ostringstream ranks;
  for (int64_t r = 0; r < world; ++r) ranks << "\n  rank " << r << ": " << describe(theirs + r * kShapeSlots);
  TORCH_CHECK_VALUE(false, op, ": ", arg,
                    " must have the same shape and dtype on every rank of the group, got:", ranks.str());
}

}  // namespace fused
}  // namespace fastmesh
