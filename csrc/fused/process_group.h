// What the fused collectives need from c10d: a group resolved by name, the two collectives they pipeline
// (with one spelling across torch 2.11-2.14), and a cheap cross-rank check of the communicated shape.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/record_function.h>
#include <c10/util/string_view.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

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

// How the pieces of a fused op travel for tensors on `device`: point-to-point where the group's backend for
// that device is gloo (its send/recv is faster than its collectives, and takes less of the CPU the multiplies
// need: docs/design/fused-collectives.md), collectives elsewhere (NCCL's are bandwidth-optimal).
bool point_to_point(const Group& group, const at::Device& device);

// Starts the point-to-point exchange of one all-gather piece: `mine` goes to every other rank and
// parts[j] (contiguous, mine's shape) receives rank j's piece, for every j != rank. `tag` tells a call's
// pieces apart.
std::vector<Work> start_piece_exchange(const Group& group, const at::Tensor& mine, const std::vector<at::Tensor>& parts,
                                       int tag);

// Point-to-point transfers of one reduce-scatter piece (`tag` tells a call's pieces apart): the others'
// partials of this rank's block are received into received[j] ([world, rows, N]; every j != rank), and
// this rank's partial for rank j, once computed, is sent to j. The caller sums what it received.
void start_piece_receives(const Group& group, const at::Tensor& received, int tag, std::vector<Work>& works);
void start_piece_send(const Group& group, const at::Tensor& partial, int64_t to, int tag, std::vector<Work>& works);

// Transfers started by a pipeline, one group of works per piece. Whatever is still pending when it goes
// out of scope is waited for: an error part-way through a pipeline (an exception from a multiply) must not
// leave transfers in flight on the group, or the group's next operation would take their messages. Errors
// of those late waits are dropped: the exception already unwinding is the one to report.
class InFlight {
 public:
  InFlight() = default;
  InFlight(const InFlight&) = delete;
  InFlight& operator=(const InFlight&) = delete;
  ~InFlight() {
    for (size_t i = 0; i < works_.size(); ++i) {
      if (waited_[i]) continue;
      for (const Work& work : works_[i]) {
        try {
          work->wait();
        } catch (...) {
        }
      }
    }
  }
  void add(std::vector<Work> works) {
    works_.push_back(std::move(works));
    waited_.push_back(false);
  }
  // Named in profiles: the time a pipeline is blocked on communication (exposed, not overlapped).
  void wait(size_t i) {
    RECORD_USER_SCOPE("fastmesh::wait_transfer");
    waited_[i] = true;
    for (const Work& work : works_[i]) work->wait();
  }
  size_t size() const { return works_.size(); }

 private:
  std::vector<std::vector<Work>> works_;
  std::vector<bool> waited_;
};

// Errors on every rank, naming the op, the argument and each rank's shape, unless `tensor` has the same
// shape and dtype on every rank of `group`. A transfer of mismatched sizes is not an error gloo reports:
// it aborts the receiving process (an uncatchable C++ exception on its I/O thread) and hands the sender
// garbage. The check is one small all-gather, but also a barrier at the start of every op, too slow for every
// call (docs/design/fused-collectives.md). So it runs on the first call of each op and argument on each CPU
// group, and on every call (CPU or CUDA) with TORCH_DISTRIBUTED_DEBUG=DETAIL; otherwise equal shapes are the
// caller's duty, as for torch's own collectives.
void check_same_shape_on_all_ranks(const Group& group, const at::Tensor& tensor, const char* op, const char* arg);

}  // namespace fused
}  // namespace fastmesh
