#include "process_group.h"

#include "settings.h"

#include "fastmesh/checks.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/debug.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>

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

// torch 2.14 renames _allgather_base / _reduce_scatter_base to all_gather_single / reduce_scatter_single and
// keeps the old names as deprecated forwarders, which a later torch may drop; 2.11-2.13 have only the old names.
// Both reach the same dispatcher ops.
#if TORCH_VERSION_MAJOR > 2 || TORCH_VERSION_MINOR >= 14
#define FASTMESH_ALL_GATHER_SINGLE all_gather_single
#define FASTMESH_REDUCE_SCATTER_SINGLE reduce_scatter_single
#else
#define FASTMESH_ALL_GATHER_SINGLE _allgather_base
#define FASTMESH_REDUCE_SCATTER_SINGLE _reduce_scatter_base
#endif

Work start_all_gather(const Group& group, at::Tensor& output, at::Tensor& input) {
  c10d::AllgatherOptions options;
  options.asyncOp = true;
  return group->FASTMESH_ALL_GATHER_SINGLE(output, input, options);
}

Work start_reduce_scatter_sum(const Group& group, at::Tensor& output, at::Tensor& input) {
  c10d::ReduceScatterOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.asyncOp = true;
  return group->FASTMESH_REDUCE_SCATTER_SINGLE(output, input, options);
}

Work start_all_reduce_sum(const Group& group, at::Tensor& tensor) {
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  options.asyncOp = true;
  std::vector<at::Tensor> tensors{tensor};
  return group->allreduce(tensors, options);
}

bool point_to_point(const Group& group, const at::Device& device) {
  const Transport transport = transport_setting();
  if (transport == Transport::kCollective) return false;
  const std::string backend = group->getBackend(device.type())->getBackendName();
  if (transport == Transport::kAuto) return backend == "gloo";
  // "nccl" and its successors' names ("nccl2", ...) all post sends and receives the same way.
  TORCH_CHECK_VALUE(backend.rfind("nccl", 0) != 0, "FASTMESH_TRANSPORT",
                    "=p2p cannot run on NCCL: the fused ops post each send and receive on its own, and NCCL "
                    "deadlocks on those outside a group call (use \"auto\" or \"collective\")");
  return true;
}

namespace {

// A transfer that could not start: its wait raises the error that stopped it. gloo refuses a send or a receive
// on a connection its peer has closed when it is posted, not when it is waited for; as a work that fails, it
// is reported as a transfer that failed in flight (InFlight::wait), with its piece and peer.
class FailedToStart : public c10d::Work {
 public:
  FailedToStart(c10d::OpType type, std::exception_ptr error) : c10d::Work(-1, type) { finish(std::move(error)); }
};

template <typename Start>
Work started(c10d::OpType type, const Start& start) {
  try {
    return start();
  } catch (const std::exception&) {
    return c10::make_intrusive<FailedToStart>(type, std::current_exception());
  }
}

// The group's timeout for `device` as it is now (Transfer): its backend's options, or the backend's own default
// where a backend does not expose them.
std::chrono::milliseconds current_timeout(const Group& group, const at::Device& device) {
  try {
    return group->getBackend(device.type())->getBackendOptions()->timeout;
  } catch (const c10::Error&) {
    return std::chrono::milliseconds(0);
  }
}

void start_send(const Group& group, std::vector<Transfer>& transfers, const at::Tensor& tensor, int64_t peer, int tag) {
  std::vector<at::Tensor> tensors{tensor};
  Work work = started(c10d::OpType::SEND, [&] { return group->send(tensors, static_cast<int>(peer), tag); });
  transfers.emplace_back(std::move(work), Transfer::Kind::kSend, peer, current_timeout(group, tensor.device()));
}

void start_recv(const Group& group, std::vector<Transfer>& transfers, const at::Tensor& tensor, int64_t peer, int tag) {
  std::vector<at::Tensor> tensors{tensor};
  Work work = started(c10d::OpType::RECV, [&] { return group->recv(tensors, static_cast<int>(peer), tag); });
  transfers.emplace_back(std::move(work), Transfer::Kind::kReceive, peer, current_timeout(group, tensor.device()));
}

}  // namespace

std::vector<Transfer> start_piece_exchange(const Group& group, const at::Tensor& mine,
                                           const std::vector<at::Tensor>& parts, int tag) {
  const int64_t world = group->getSize(), rank = group->getRank();
  std::vector<Transfer> transfers;
  // Peers in ring order from this rank, so that no rank is every rank's first destination.
  for (int64_t step = 1; step < world; ++step) {
    const int64_t to = (rank + step) % world, from = (rank - step + world) % world;
    start_send(group, transfers, mine, to, tag);
    start_recv(group, transfers, parts[from], from, tag);
  }
  return transfers;
}

void start_piece_receives(const Group& group, const at::Tensor& received, int tag, std::vector<Transfer>& transfers) {
  const int64_t world = group->getSize(), rank = group->getRank();
  for (int64_t step = 1; step < world; ++step) {
    const int64_t from = (rank - step + world) % world;
    start_recv(group, transfers, received[from], from, tag);
  }
}

void start_piece_send(const Group& group, const at::Tensor& partial, int64_t to, int tag,
                      std::vector<Transfer>& transfers) {
  start_send(group, transfers, partial, to, tag);
}

namespace {

// Only op types every supported torch (2.11-2.14) has: the *_COALESCED ones are newer.
const char* collective_name(c10d::OpType type) {
  switch (type) {
    case c10d::OpType::ALLGATHER:
    case c10d::OpType::_ALLGATHER_BASE:
      return "all-gather";
    case c10d::OpType::REDUCE_SCATTER:
    case c10d::OpType::_REDUCE_SCATTER_BASE:
      return "reduce-scatter";
    case c10d::OpType::ALLREDUCE:
      return "all-reduce";
    default:
      return "collective";
  }
}

}  // namespace

// The backend's error stays the cause, in the text: a c10::Error's own message (without its C++ backtrace),
// or the what() of any other exception (gloo's IoException). A DistNetworkError stays one; anything else
// becomes a DistBackendError, as torch's own failed collectives are.
void InFlight::fail(size_t i, const Transfer& transfer, const std::exception& error) const {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  const std::string cause = c10_error ? c10_error->what_without_backtrace() : error.what();
  std::ostringstream message;
  message << op_ << ": the transfer of ";
  if (std::string(what_) == "piece") {
    message << "piece " << i + 1 << " of " << pieces_.size();
  } else {
    message << what_;
  }
  message << " failed on rank " << group_->getRank() << " of group \"" << group_->getGroupName() << "\" ("
          << group_->getSize() << " ranks): ";
  switch (transfer.kind) {
    case Transfer::Kind::kSend:
      message << "the send to rank " << transfer.peer;
      break;
    case Transfer::Kind::kReceive:
      message << "the receive from rank " << transfer.peer;
      break;
    case Transfer::Kind::kCollective:
      message << "its " << collective_name(transfer.work->retrieveOpType()) << ", a collective of the group's "
              << group_->getSize() << " ranks,";
      break;
  }
  message << " did not complete (a rank that exits or stalls fails its peers' transfers: fastmesh's docs/faults.md)."
          << "\nCaused by the backend's error: " << cause;
  if (dynamic_cast<const c10::DistNetworkError*>(&error)) C10_THROW_ERROR(DistNetworkError, message.str());
  C10_THROW_ERROR(DistBackendError, message.str());
}

namespace {

// A fixed-size fingerprint per tensor so that the check itself cannot mismatch: [ndim, dtype, sizes..., fold].
constexpr int64_t kShapeSlots = 10;
constexpr uint64_t kFnvPrime = 1099511628211ull;  // FNV-1a: folds what does not fit a fingerprint's slots

void fingerprint(const at::Tensor& tensor, int64_t* slots) {
  slots[0] = tensor.dim();
  slots[1] = static_cast<int64_t>(tensor.scalar_type());
  uint64_t fold = 0;  // dims past the slots, hashed: still detects a mismatch there
  for (int64_t i = 0; i < tensor.dim(); ++i) {
    if (i < kShapeSlots - 3) {
      slots[2 + i] = tensor.size(i);
    } else {
      fold = (fold ^ static_cast<uint64_t>(tensor.size(i))) * kFnvPrime;
    }
  }
  slots[kShapeSlots - 1] = static_cast<int64_t>(fold);
}

uint64_t text_hash(const std::string& text) {
  uint64_t hash = 14695981039346656037ull;
  for (const char c : text) hash = (hash ^ static_cast<unsigned char>(c)) * kFnvPrime;
  return hash;
}

// An option's value as text in fixed slots: [length, hash of the whole text, its first kOptionTextBytes bytes].
constexpr int64_t kOptionSlots = 4;
constexpr size_t kOptionTextBytes = (kOptionSlots - 2) * sizeof(int64_t);

void fingerprint(const std::string& value, int64_t* slots) {
  slots[0] = static_cast<int64_t>(value.size());
  slots[1] = static_cast<int64_t>(text_hash(value));
  char text[kOptionTextBytes] = {};
  value.copy(text, kOptionTextBytes);
  std::memcpy(slots + 2, text, kOptionTextBytes);
}

std::string describe_option(const int64_t* slots) {
  const size_t length = static_cast<size_t>(slots[0]);
  std::string text(reinterpret_cast<const char*>(slots + 2), std::min(length, kOptionTextBytes));
  return length > kOptionTextBytes ? text + "..." : text;
}

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

bool checks_every_call() { return c10d::debug_level() == c10d::DebugLevel::Detail || shape_check_every_call_setting(); }

namespace {

std::mutex checked_mutex;
std::set<std::string> checked_calls;  // group name / op / arguments whose first call passed the check

// `values` of every rank of the group, rank after rank, on the CPU (sent from `device`, which the group serves).
at::Tensor gather_longs(const Group& group, const char* op, const at::Device& device,
                        const std::vector<int64_t>& values) {
  const int64_t n = static_cast<int64_t>(values.size());
  at::Tensor mine = at::empty({n}, at::kLong);
  std::copy(values.begin(), values.end(), mine.mutable_data_ptr<int64_t>());
  at::Tensor send = device.is_cpu() ? mine : mine.to(device);
  at::Tensor all = at::empty({group->getSize() * n}, send.options());
  InFlight check(group, op, "the cross-rank shape check (before the pieces)");
  check.add({start_all_gather(group, all, send)});
  check.wait(0);
  return all.cpu();
}

std::string call_key(const Group& group, const char* op, const std::vector<std::string>& args,
                     const std::vector<Option>& options) {
  std::string key = group->getGroupName() + "/" + op;
  for (const std::string& arg : args) key += "/" + arg;
  for (const Option& option : options) key += "/" + option.first;
  return key;
}

// Every rank takes the same decision: the ranks of a group call its ops in the same order (as for any
// collective), so a call is the first of its op and arguments on the group on every rank or on none.
bool checks_this_call(const at::Device& device, const std::string& key) {
  if (checks_every_call()) return true;
  if (!device.is_cpu()) return false;
  std::lock_guard<std::mutex> lock(checked_mutex);
  return checked_calls.count(key) == 0;
}

void passed_check(const std::string& key) {
  std::lock_guard<std::mutex> lock(checked_mutex);
  checked_calls.insert(key);
}

}  // namespace

void check_same_shapes_on_all_ranks(const Group& group, const std::vector<at::Tensor>& tensors,
                                    const std::vector<std::string>& args, const std::vector<Option>& options,
                                    const char* op) {
  TORCH_CHECK_VALUE(!tensors.empty() && tensors.size() == args.size(), op,
                    ": the shape check takes one name per tensor, got ", tensors.size(), " tensors and ", args.size(),
                    " names");
  const int64_t world = group->getSize();
  const at::Device device = tensors[0].device();
  if (world == 1) return;
  const std::string key = call_key(group, op, args, options);
  if (!checks_this_call(device, key)) return;

  RECORD_USER_SCOPE("fastmesh::check_shapes");
  // The op and the operand count first, in a transfer of one size on every rank: the fingerprints' transfer is
  // sized by them, and transfers of different sizes abort gloo rather than raise.
  const int64_t op_hash = static_cast<int64_t>(text_hash(op));
  const at::Tensor headers = gather_longs(group, op, device, {op_hash, static_cast<int64_t>(tensors.size())});
  const int64_t* header_of = headers.const_data_ptr<int64_t>();
  std::ostringstream other_op, counts;
  for (int64_t r = 0; r < world; ++r) {
    if (header_of[2 * r] != op_hash) other_op << (other_op.tellp() > 0 ? ", " : "") << r;
    counts << (r ? ", " : "") << "rank " << r << ": " << header_of[2 * r + 1];
  }
  TORCH_CHECK_VALUE(other_op.tellp() == 0, op, ": every rank of the group must call the same op, but rank(s) ",
                    other_op.str(), " called another fused op where this rank called this one");
  for (int64_t r = 0; r < world; ++r) {
    if (header_of[2 * r + 1] == static_cast<int64_t>(tensors.size())) continue;
    std::ostringstream mine;
    for (size_t t = 0; t < args.size(); ++t) mine << (t ? ", " : "") << args[t];
    TORCH_CHECK_VALUE(false, op, ": every rank of the group must pass the same operands, got different numbers of ",
                      "tensors (", counts.str(), "; this rank's: ", mine.str(), ")");
  }

  // The same op on every rank: the same options, so the same transfer size.
  const int64_t tensor_slots = kShapeSlots * static_cast<int64_t>(tensors.size());
  const int64_t slots_per_rank = tensor_slots + kOptionSlots * static_cast<int64_t>(options.size());
  std::vector<int64_t> slots(slots_per_rank, 0);
  for (size_t t = 0; t < tensors.size(); ++t) fingerprint(tensors[t], slots.data() + t * kShapeSlots);
  for (size_t o = 0; o < options.size(); ++o)
    fingerprint(options[o].second, slots.data() + tensor_slots + o * kOptionSlots);
  const at::Tensor gathered = gather_longs(group, op, device, slots);
  const int64_t* theirs = gathered.const_data_ptr<int64_t>();
  auto same_on_every_rank = [&](int64_t first, int64_t count) {
    for (int64_t r = 0; r < world; ++r) {
      if (!std::equal(slots.begin() + first, slots.begin() + first + count, theirs + r * slots_per_rank + first)) {
        return false;
      }
    }
    return true;
  };
  for (size_t t = 0; t < tensors.size(); ++t) {
    if (same_on_every_rank(t * kShapeSlots, kShapeSlots)) continue;
    std::ostringstream ranks;
    for (int64_t r = 0; r < world; ++r) {
      ranks << "\n  rank " << r << ": " << describe(theirs + r * slots_per_rank + t * kShapeSlots);
    }
    TORCH_CHECK_VALUE(false, op, ": ", args[t],
                      " must have the same shape and dtype on every rank of the group, got:", ranks.str());
  }
  for (size_t o = 0; o < options.size(); ++o) {
    const int64_t first = tensor_slots + o * kOptionSlots;
    if (same_on_every_rank(first, kOptionSlots)) continue;
    std::ostringstream ranks;
    for (int64_t r = 0; r < world; ++r) {
      ranks << "\n  rank " << r << ": " << describe_option(theirs + r * slots_per_rank + first);
    }
    TORCH_CHECK_VALUE(false, op, ": ", options[o].first,
                      " must be the same on every rank of the group, got:", ranks.str());
  }
  passed_check(key);
}

// ---- fault injection (tests) ----

namespace {

enum class Fault : int { kNone = 0, kExit = 1, kRaise = 2, kStall = 3 };

// Pieces still to start before the fault; negative: none armed. One relaxed load per started transfer is all
// the pipelines pay.
std::atomic<int64_t> fault_countdown{-1};
std::atomic<int> fault_action{static_cast<int>(Fault::kNone)};

}  // namespace

void inject_fault(int64_t after, c10::string_view action) {
  Fault fault = Fault::kNone;
  if (action == "exit") fault = Fault::kExit;
  if (action == "raise") fault = Fault::kRaise;
  if (action == "stall") fault = Fault::kStall;
  TORCH_CHECK_VALUE(fault != Fault::kNone || action == "none", "inject_fault: action must be \"exit\", \"raise\", ",
                    "\"stall\" or \"none\", got \"", std::string(action), '"');
  TORCH_CHECK_VALUE(after >= 0, "inject_fault: after must be >= 0, got ", after);
  fault_action.store(static_cast<int>(fault));
  fault_countdown.store(fault == Fault::kNone ? -1 : after);
}

void InFlight::add(std::vector<Transfer> transfers) {
  pieces_.push_back(std::move(transfers));
  waited_.push_back(0);
  if (fault_countdown.load(std::memory_order_relaxed) < 0 || std::strcmp(what_, "piece") != 0) return;
  if (fault_countdown.fetch_sub(1) != 0) return;
  fault_countdown.store(-1);
  switch (static_cast<Fault>(fault_action.load())) {
    case Fault::kExit:  // as a crash: no clean-up, the process's sockets close with it
      std::_Exit(1);
    case Fault::kStall:  // alive but never progressing, as a rank stuck in its own work; its killer ends it
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    case Fault::kRaise:
      TORCH_CHECK(false, op_, ": injected fault (fastmesh._C.inject_fault) after starting ", what_, " ", pieces_.size(),
                  " on rank ", group_->getRank(), " of group \"", group_->getGroupName(), '"');
    case Fault::kNone:
      break;
  }
}

}  // namespace fused
}  // namespace fastmesh
