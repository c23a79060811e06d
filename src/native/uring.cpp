// io_uring through raw syscalls (no liburing): ring setup, batched READ submission, completion reaping.
#include "uring.h"

#include <linux/io_uring.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <vector>

namespace tiergram {

namespace {

constexpr int32_t kPending = INT32_MIN;  // op not completed yet (no real result is this negative)
constexpr uint64_t kCancelTag = uint64_t{1} << 63;  // user_data of a cancel request (reads use their index)

int64_t now_ns() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

void *map_ring(int fd, size_t bytes, off_t what) {
  void *p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, what);
  if (p == MAP_FAILED) throw UringUnavailable{errno};
  return p;
}

template <typename T>
T *at(void *base, uint32_t offset) {
  return reinterpret_cast<T *>(static_cast<uint8_t *>(base) + offset);
}

}  // namespace

Ring::Ring(unsigned entries) {
  io_uring_params p;
  std::memset(&p, 0, sizeof p);
  p.flags = IORING_SETUP_CLAMP;  // a too-large depth is clamped to the kernel's limit instead of failing
  const long fd = syscall(__NR_io_uring_setup, entries, &p);
  if (fd < 0) throw UringUnavailable{errno};
  fd_ = static_cast<int>(fd);
  try {
    sq_entries_ = p.sq_entries;
    timed_waits_ = p.features & IORING_FEAT_EXT_ARG;
    sq_map_bytes_ = p.sq_off.array + p.sq_entries * sizeof(uint32_t);
    cq_map_bytes_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    if (p.features & IORING_FEAT_SINGLE_MMAP) {
      // SQ and CQ rings share one mapping (5.4+).
      sq_map_bytes_ = cq_map_bytes_ = std::max(sq_map_bytes_, cq_map_bytes_);
      sq_map_ = map_ring(fd_, sq_map_bytes_, IORING_OFF_SQ_RING);
    } else {
      sq_map_ = map_ring(fd_, sq_map_bytes_, IORING_OFF_SQ_RING);
      cq_map_ = map_ring(fd_, cq_map_bytes_, IORING_OFF_CQ_RING);
    }
    void *cq_base = cq_map_ ? cq_map_ : sq_map_;
    sqe_map_bytes_ = p.sq_entries * sizeof(io_uring_sqe);
    sqe_map_ = map_ring(fd_, sqe_map_bytes_, IORING_OFF_SQES);
    sq_tail_ = at<uint32_t>(sq_map_, p.sq_off.tail);
    sq_mask_ = *at<uint32_t>(sq_map_, p.sq_off.ring_mask);
    sq_array_ = at<uint32_t>(sq_map_, p.sq_off.array);
    cq_head_ = at<uint32_t>(cq_base, p.cq_off.head);
    cq_tail_ = at<uint32_t>(cq_base, p.cq_off.tail);
    cq_mask_ = *at<uint32_t>(cq_base, p.cq_off.ring_mask);
    sqes_ = static_cast<io_uring_sqe *>(sqe_map_);
    cqes_ = at<io_uring_cqe>(cq_base, p.cq_off.cqes);

    // IORING_OP_READ arrived in 5.6; ask the kernel rather than guess from its version.
    const unsigned n_ops = 256;
    std::vector<uint64_t> buf((sizeof(io_uring_probe) + n_ops * sizeof(io_uring_probe_op)) / 8 + 1);
    auto *probe = reinterpret_cast<io_uring_probe *>(buf.data());
    if (syscall(__NR_io_uring_register, fd_, IORING_REGISTER_PROBE, probe, n_ops) < 0) throw UringUnavailable{errno};
    if (probe->last_op < IORING_OP_READ || !(probe->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED))
      throw UringUnavailable{EOPNOTSUPP};
  } catch (...) {
    release();
    throw;
  }
}

Ring::~Ring() { release(); }

void Ring::release() {
  if (sqe_map_) munmap(sqe_map_, sqe_map_bytes_);
  if (cq_map_) munmap(cq_map_, cq_map_bytes_);
  if (sq_map_) munmap(sq_map_, sq_map_bytes_);
  if (fd_ >= 0) close(fd_);
  sqe_map_ = cq_map_ = sq_map_ = nullptr;
  fd_ = -1;
}

int Ring::enter(unsigned to_submit, unsigned min_complete, int64_t timeout_ns) {
  long r;
  if (timeout_ns >= 0 && timed_waits_) {
    __kernel_timespec ts{timeout_ns / 1000000000, timeout_ns % 1000000000};
    io_uring_getevents_arg arg;
    std::memset(&arg, 0, sizeof arg);
    arg.sigmask_sz = _NSIG / 8;
    arg.ts = reinterpret_cast<uintptr_t>(&ts);
    r = syscall(__NR_io_uring_enter, fd_, to_submit, min_complete, IORING_ENTER_GETEVENTS | IORING_ENTER_EXT_ARG,
                &arg, sizeof arg);
  } else {
    r = syscall(__NR_io_uring_enter, fd_, to_submit, min_complete, IORING_ENTER_GETEVENTS, nullptr, 0);
  }
  return r < 0 ? -errno : static_cast<int>(r);
}

unsigned Ring::reap(ReadOp *ops, size_t n) {
  uint32_t head = *cq_head_;  // only this thread writes the CQ head
  // Acquire: once we see the kernel's new tail, the CQEs before it are fully written.
  const uint32_t tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
  unsigned got = 0;  // read completions (a cancel request's own completion is not one)
  for (; head != tail; ++head) {
    const io_uring_cqe &c = cqes_[head & cq_mask_];
    if (c.user_data < n) ops[c.user_data].res = c.res, ++got;
  }
  // Release: our reads of those CQEs are done before the kernel may overwrite their slots.
  __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
  return got;
}

bool Ring::settle(ReadOp *ops, size_t n, size_t offered, unsigned &inflight, int64_t stall_ns, bool stalled) {
  // The kernel may still write into the caller's buffers, so we cannot return before every read ends — unless it
  // neither completes nor cancels one (a lost completion), where the only way out is to retire the ring.
  const bool bounded = stall_ns >= 0 && timed_waits_;
  bool cancelled = false;
  int64_t since = now_ns();
  while (inflight > 0) {
    if (stalled && !cancelled) {
      cancel(ops, offered);
      cancelled = true;
      since = now_ns();
    }
    const int64_t left = bounded ? stall_ns - (now_ns() - since) : -1;
    if (bounded && left <= 0) {
      if (!cancelled) {
        stalled = true;  // no read completed for a stall period while we waited: cancel them
        continue;
      }
      retired_ = true;
      return true;
    }
    const int r = enter(0, 1, left);
    // If waiting itself fails, poll: completions still land in the CQ, and each syscall runs task work.
    if (r < 0 && r != -EINTR && r != -ETIME) {
      const timespec ms{0, 1000000};
      nanosleep(&ms, nullptr);
    }
    const unsigned got = reap(ops, n);
    inflight -= std::min(inflight, got);
    if (got > 0 && !cancelled) since = now_ns();
  }
  return cancelled;
}

void Ring::cancel(ReadOp *ops, size_t offered) {
  // One IORING_OP_ASYNC_CANCEL per read still in flight, matched by user_data (5.5+; CANCEL_ANY would need 5.19).
  // The SQ is empty here (unconsumed SQEs were withdrawn), so each pass fills up to sq_entries_ slots.
  size_t i = 0;
  while (i < offered) {
    uint32_t tail = *sq_tail_;
    unsigned batch = 0;
    for (; i < offered && batch < sq_entries_; ++i) {
      if (ops[i].res != kPending) continue;
      const unsigned idx = tail & sq_mask_;
      io_uring_sqe &s = sqes_[idx];
      std::memset(&s, 0, sizeof s);
      s.opcode = IORING_OP_ASYNC_CANCEL;
      s.fd = -1;
      s.addr = i;  // the user_data of the read to cancel
      s.user_data = kCancelTag | i;
      sq_array_[idx] = idx;
      ++tail, ++batch;
    }
    __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
    while (batch > 0) {
      const int r = enter(batch, 0);
      if (r == -EINTR) continue;
      if (r <= 0) {  // the kernel takes no cancels: withdraw them; the bounded wait then retires the ring
        __atomic_store_n(sq_tail_, *sq_tail_ - batch, __ATOMIC_RELEASE);
        return;
      }
      batch -= static_cast<unsigned>(r);
    }
  }
}

bool Ring::use_fixed_buffer(const StagingArea &area) {
  if (buffer_serial_ == area.serial) return true;
  if (buffer_refused_) return false;
  // No read is in flight on this ring between runs, so the old registration can go.
  if (buffer_serial_ != 0 && syscall(__NR_io_uring_register, fd_, IORING_UNREGISTER_BUFFERS, nullptr, 0) < 0) {
    buffer_refused_ = errno;
    return false;
  }
  buffer_serial_ = 0, buffer_base_ = nullptr, buffer_bytes_ = 0;
  iovec iov{area.base, area.bytes};
  if (syscall(__NR_io_uring_register, fd_, IORING_REGISTER_BUFFERS, &iov, 1) < 0) {
    buffer_refused_ = errno;
    return false;
  }
  buffer_serial_ = area.serial, buffer_base_ = area.base, buffer_bytes_ = area.bytes;
  return true;
}

size_t Ring::run(int fd, ReadOp *ops, size_t n, unsigned depth, const StagingArea *fixed_buffer, int64_t stall_ns, const std::atomic<int> *yield_to,
                 unsigned yield_depth) {
  depth = std::max(1u, std::min(depth, sq_entries_));
  if (yield_depth == 0 || yield_depth >= depth) yield_to = nullptr;
  yielded_ = 0;
  const bool fixed_buf = fixed_buffer && fixed_buffer->serial != 0 && use_fixed_buffer(*fixed_buffer);
  size_t n_fixed = 0;
  for (size_t i = 0; i < n; ++i) ops[i].res = kPending;
  size_t next = 0, done = 0;
  unsigned queued = 0;     // SQEs written but not yet consumed by the kernel
  unsigned inflight = 0;   // consumed by the kernel, completion not reaped yet
  bool wait_only = false;  // the kernel took fewer SQEs than offered: wait for room before offering again
  int err = 0;
  bool stalled = false;  // no read completed for stall_ns
  const bool bounded = stall_ns >= 0 && timed_waits_;
  int64_t progress_at = now_ns();  // when a read last completed (or the run began)
  while (done < n) {
    uint32_t tail = *sq_tail_;  // only this thread writes the SQ tail
    // Giving way: a foreground read's pages would wait behind every read of ours already at the device.
    const bool yielding = yield_to && yield_to->load(std::memory_order_relaxed) > 0;
    const unsigned cap = yielding ? yield_depth : depth;
    const size_t next_before = next;
    while (next < n && queued + inflight < cap) {
      const unsigned idx = tail & sq_mask_;
      io_uring_sqe &s = sqes_[idx];
      std::memset(&s, 0, sizeof s);
      const ReadOp &op = ops[next];
      // READ_FIXED only for a dst wholly inside the registered area (the kernel checks too, and fails the read).
      const bool own_fd = op.fd >= 0;  // a read pointed at another fd: plain READ on that fd
      const bool in_buf = fixed_buf && !own_fd && op.dst >= buffer_base_ && op.len <= buffer_bytes_ &&
                          static_cast<size_t>(op.dst - buffer_base_) <= buffer_bytes_ - op.len;
      s.opcode = in_buf ? IORING_OP_READ_FIXED : IORING_OP_READ;
      s.buf_index = 0;
      n_fixed += in_buf;
      s.fd = own_fd ? op.fd : fd;
      s.off = op.offset;
      s.addr = reinterpret_cast<uintptr_t>(op.dst);
      s.len = op.len;
      s.user_data = next;
      sq_array_[idx] = idx;
      ++tail, ++next, ++queued;
    }
    // Release: the SQEs and array slots are visible to the kernel before the tail that publishes them.
    __atomic_store_n(sq_tail_, tail, __ATOMIC_RELEASE);
    if (yielding) yielded_ += next - next_before;

    const unsigned to_submit = wait_only ? 0 : queued;
    if (to_submit == 0 && inflight == 0) {
      err = EIO;  // a completion went missing; waiting would block forever
      break;
    }
    // While more reads wait to be offered, return once a quarter of those known in flight have completed rather
    // than after the first: each io_uring_enter then reaps a batch (fewer syscalls per page) while the rest keep
    // the queue busy. Once all are offered, wait for every known read. Only reads the kernel already holds are
    // counted: it may take fewer of this call's SQEs than offered, and waiting for more than exist would block.
    const unsigned want = next < n ? std::max(1u, inflight / 4) : std::max(1u, inflight);
    int64_t timeout = -1;
    if (bounded) {
      timeout = stall_ns - (now_ns() - progress_at);
      if (timeout <= 0 && inflight > 0) {
        stalled = true;
        break;
      }
      timeout = std::max<int64_t>(timeout, 0);
    }
    int ret = enter(to_submit, want, timeout);
    if (ret == -EINTR) continue;  // a signal: nothing was submitted, try again
    if (ret == -ETIME) ret = 0;   // the wait timed out before `want` reads completed (see above next time)
    if (ret == -EAGAIN || ret == -EBUSY) ret = 0;  // kernel short of resources: no progress this round
    if (ret < 0) {
      err = -ret;
      break;
    }
    if (ret == 0 && to_submit > 0 && inflight == 0) {
      err = EAGAIN;  // the kernel takes nothing and nothing is in flight to wait for: give up (caller retries)
      break;
    }
    queued -= static_cast<unsigned>(ret);
    inflight += static_cast<unsigned>(ret);
    const unsigned got = reap(ops, n);
    inflight -= std::min(inflight, got);
    done += got;
    if (got > 0) progress_at = now_ns();
    // Partial submission: the kernel returned without waiting; let completions make room before offering more.
    wait_only = static_cast<unsigned>(ret) < to_submit && inflight > 0;
  }
  if (err || stalled) {
    // Withdraw SQEs the kernel never consumed, so the next run does not submit them.
    __atomic_store_n(sq_tail_, *sq_tail_ - queued, __ATOMIC_RELEASE);
    const size_t offered = next - queued;
    const bool gave_up = settle(ops, n, offered, inflight, stall_ns, stalled) || stalled;
    for (size_t i = 0; i < n; ++i) {
      int32_t &res = ops[i].res;
      // A read we cancelled ends with -ECANCELED (-EINTR if a worker had started it): it stalled, not failed.
      if (res == kPending || (gave_up && (res == -ECANCELED || res == -EINTR))) res = gave_up ? kStalled : -err;
    }
  }
  return n_fixed;
}

}  // namespace tiergram
