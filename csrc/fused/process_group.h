// What the fused collectives need from c10d: a group resolved by name, the two collectives they pipeline
// (with one spelling across torch 2.11-2.14), and a cheap cross-rank check of the communicated shape.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/util/string_view.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <string>
#include <utility>
#include <vector>

namespace fastmesh {
namespace fused {

using Group = c10::intrusive_ptr<c10d::ProcessGroup>;
using Work = c10::intrusive_ptr<c10d::Work>;

// The group registered under `group_name`, or an error naming the op and the name.
Group resolve_group(c10::string_view group_name, const char* op);

// Asynchronous all-gather of `input` into `output` (`world` copies of input's shape, rank-major).
Work start_all_gather(const Group& group, at::Tensor& output, at::Tensor& input);

// Asynchronous sum reduce-scatter of `input` (`world` blocks of output's shape, rank-major) into `output`.
Work start_reduce_scatter_sum(const Group& group, at::Tensor& output, at::Tensor& input);

// Asynchronous sum all-reduce of `tensor` (contiguous) in place.
Work start_all_reduce_sum(const Group& group, at::Tensor& tensor);

// How the pieces of a fused op travel for tensors on `device`: true for point-to-point (send/recv), false for
// the backend's collectives (one all-gather or reduce-scatter per piece). FASTMESH_TRANSPORT, read on every
// call (an internal option, for tests), decides:
// - "auto" (or unset): point-to-point where the group's backend for that device is gloo (its send/recv is
//   faster than its collectives, and takes less of the CPU the multiplies need:
//   docs/design/fused-collectives.md), collectives elsewhere (NCCL's are bandwidth-optimal);
// - "collective": collectives on every backend, gloo included (the path NCCL takes, testable on CPU);
// - "p2p": point-to-point on every backend but NCCL, where it is an error: the pipelines post each send and
//   receive on its own, and NCCL deadlocks on unmatched ones outside a group call.
// Any other value is an error naming the variable. Every rank must see the same value.
bool point_to_point(const Group& group, const at::Device& device);

// One transfer of a piece, with whom it waits on for the error of a failed wait: a send to or a receive from
// `peer` (a rank of the group), or a collective of the whole group (a Work converts to one).
//
// A point-to-point transfer is waited for with the group's timeout as it is now (`timeout`), not as it was when
// the group was made: gloo's send and receive keep the latter otherwise, and torch's dist.set_timeout (which
// init_mesh uses for a mesh's groups) changes only what its collectives wait. A collective is waited for with
// the backend's own default (NCCL's wait must not block the host).
struct Transfer {
  enum class Kind { kCollective, kSend, kReceive };
  Transfer(Work work) : work(std::move(work)) {}  // NOLINT(google-explicit-constructor): a collective
  Transfer(Work work, Kind kind, int64_t peer, std::chrono::milliseconds timeout)
      : work(std::move(work)), kind(kind), peer(peer), timeout(timeout) {}
  void wait() const { kind == Kind::kCollective ? work->wait() : work->wait(timeout); }
  Work work;
  Kind kind = Kind::kCollective;
  int64_t peer = -1;
  std::chrono::milliseconds timeout{0};  // 0: the backend's default
};

// Starts the point-to-point exchange of one all-gather piece: `mine` goes to every other rank and
// parts[j] (contiguous, mine's shape) receives rank j's piece, for every j != rank. `tag` tells a call's
// pieces apart.
std::vector<Transfer> start_piece_exchange(const Group& group, const at::Tensor& mine,
                                           const std::vector<at::Tensor>& parts, int tag);

// Point-to-point transfers of one reduce-scatter piece (`tag` tells a call's pieces apart): the others'
// partials of this rank's block are received into received[j] ([world, rows, N]; every j != rank), and
// this rank's partial for rank j, once computed, is sent to j. The caller sums what it received.
void start_piece_receives(const Group& group, const at::Tensor& received, int tag, std::vector<Transfer>& transfers);
void start_piece_send(const Group& group, const at::Tensor& partial, int64_t to, int tag,
                      std::vector<Transfer>& transfers);

// Transfers started by a pipeline, one group of transfers per piece.
//
// A wait that fails (on gloo: at once for a peer that exited, at the group's timeout for one that stalled; on
// NCCL a wait does not block the host, and only TORCH_NCCL_BLOCKING_WAIT=1 makes it fail instead of the
// watchdog), or the wait of a transfer that could not start, raises a DistBackendError (RuntimeError in
// Python) naming the op, the group, this rank, the piece and the peer it waited on (or the collective), with
// the backend's error as its cause, in the text (docs/faults.md).
//
// Whatever is still pending when it goes out of scope is waited for, the rest of a failed piece included: an
// error part-way through a pipeline (an exception from a multiply, a failed wait) must not leave transfers in
// flight on the group, or the group's next operation would take their messages. Errors of those late waits
// are dropped: the exception already unwinding is the one to report.
class InFlight {
 public:
  // `op` names the op in errors, `what` what each group of transfers carries: "piece" is counted ("piece 2 of
  // 4"), anything else names a lone transfer ("a_scale (gathered before the pieces)").
  InFlight(Group group, const char* op, const char* what = "piece") : group_(std::move(group)), op_(op), what_(what) {}
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  ~InFlight() {
    for (size_t i = 0; i < pieces_.size(); ++i) {
      for (size_t t = waited_[i]; t < pieces_[i].size(); ++t) {
        try {
          pieces_[i][t].wait();
        } catch (...) {
        }
      }
    }
  }
  // Takes the transfers of the next piece (already started); this is where inject_fault strikes.
  void add(std::vector<Transfer> transfers);
  // Named in profiles: the time a pipeline is blocked on communication (exposed, not overlapped).
  void wait(size_t i) {
    RECORD_USER_SCOPE("fastmesh::wait_transfer");
    while (waited_[i] < pieces_[i].size()) {
      const Transfer& transfer = pieces_[i][waited_[i]++];  // counted first: a failed one is not waited again
      try {
        transfer.wait();
      } catch (const std::exception& error) {
        fail(i, transfer, error);
      }
    }
  }
  size_t size() const { return pieces_.size(); }

 private:
  [[noreturn]] void fail(size_t i, const Transfer& transfer, const std::exception& error) const;

  Group group_;
  const char* op_;
  const char* what_;
  std::vector<std::vector<Transfer>> pieces_;
  std::vector<size_t> waited_;  // per piece, how many of its transfers have been waited for
};

// An option of a fused op (its name, its value as text), compared across ranks by the shape check.
using Option = std::pair<std::string, std::string>;

// Errors on every rank, naming the op, the argument and each rank's shape, unless every rank calls the same op
// with the same number of tensors, each of `tensors` (named by `args`) has the same shape and dtype on every rank
// of `group`, and so has each of `options` the same value. A transfer of mismatched sizes is not an error gloo
// reports: it aborts the receiving process (an uncatchable C++ exception on its I/O thread) and hands the sender
// garbage; options that differ change what travels or what is summed. The check is two small all-gathers (the op
// and the count, then every fingerprint), but also a barrier at the start of the op (docs/errors.md has its
// measured cost). So by default it runs on the first call of each op and arguments on each CPU group;
// FASTMESH_SHAPE_CHECK=every (or TORCH_DISTRIBUTED_DEBUG=DETAIL) checks every call, on CPU and CUDA (where it
// also syncs the host). Otherwise equal shapes and options are the caller's duty, as for torch's own collectives.
void check_same_shapes_on_all_ranks(const Group& group, const std::vector<at::Tensor>& tensors,
                                    const std::vector<std::string>& args, const std::vector<Option>& options,
                                    const char* op);

// Whether check_same_shapes_on_all_ranks checks every call (FASTMESH_SHAPE_CHECK=every or
// TORCH_DISTRIBUTED_DEBUG=DETAIL) rather than the first of each op and arguments.
bool checks_every_call();

// Test-only fault injection (tests/test_faults.py): the fused ops' next pipeline pieces (not the shape check, not
// the FP8 scales' gather) start as usual until `after` of them have started; the one after that starts, then
// `action` strikes: "exit" ends the process at once (as a crash), "raise" throws from the op (the transfers it
// started are still drained), "stall" blocks the op forever. "none" disarms. Process-wide, one fault at a time.
void inject_fault(int64_t after, c10::string_view action);

}  // namespace fused
}  // namespace fastmesh
