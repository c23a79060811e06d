// A minimal io_uring driven through raw syscalls: enough to keep a batch of positioned reads in flight.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>

struct io_uring_sqe;  // <linux/io_uring.h>, included by uring.cpp only
struct io_uring_cqe;

namespace tiergram {

// A long-lived buffer the pipeline reads pages into, which a reader may register with its rings (io_uring fixed
// buffers: the kernel pins its pages once instead of per read). `serial` names one allocation: a freed buffer's
// address may come back for a new one, and a registration must never be taken for the old one's.
struct StagingArea {
  uint8_t *base = nullptr;
  size_t bytes = 0;
  uint64_t serial = 0;
};

// One positioned read of `len` bytes at `offset` into `dst`. `res` receives the bytes read or -errno.
// fd: -1 reads the run's file; a test hook may point one read at another fd (a pipe that never has data).
struct ReadOp {
  uint64_t offset = 0;
  uint8_t *dst = nullptr;
  uint32_t len = 0;
  int32_t res = 0;
  int fd = -1;
};

// res of a read the ring gave up on: no read of the run completed for the stall timeout, so the reads still in
// flight were cancelled (or never offered). The caller reads it another way.
constexpr int32_t kStalled = -ETIMEDOUT;

// Thrown when the kernel will not give us a usable ring (ENOSYS, EPERM under seccomp, ENOMEM, too old).
struct UringUnavailable {
  int err;
};

// One submission/completion queue pair. Not thread-safe: one caller at a time (callers pool rings).
class Ring {
 public:
  explicit Ring(unsigned entries);  // throws UringUnavailable
  ~Ring();
  Ring(const Ring &) = delete;
  Ring &operator=(const Ring &) = delete;

  unsigned entries() const { return sq_entries_; }

  // Reads every op from `fd` keeping at most `depth` in flight, and sets each op's `res`. If the ring
  // itself fails (io_uring_enter error), the ops not completed get -errno: the caller sees them as failed
  // reads. Returns only once the kernel holds no reference to any `dst`. Each io_uring_enter waits for a quarter of
  // the reads in flight, not the first: 3.6 against 4.2 us of CPU per page at QD 128 (docs/decisions.md).
  // fixed_buffer: the staging area to register with the ring (IORING_REGISTER_BUFFERS, kept until another area
  // comes); reads whose dst lies inside it are READ_FIXED, which spares the kernel pinning the page per read.
  // If the kernel refuses the registration (RLIMIT_MEMLOCK without CAP_IPC_LOCK) the ring reads plainly.
  // stall_ns: when no read completes for this long (and the kernel can time a wait, 5.11+), the reads in flight are
  // cancelled and every read not done gets kStalled; < 0 waits without a bound. A read the kernel neither completes
  // nor cancels within a second stall period retires the ring (retired()): it must not be used again.
  // Returns how many reads went out as READ_FIXED.
  // yield_to: while it is > 0 (another caller's reads are in flight on this file), keep at most yield_depth reads in
  // flight instead of depth, so that theirs do not queue behind ours at the device. Returns the reads offered while
  // yielding in yielded().
  size_t run(int fd, ReadOp *ops, size_t n, unsigned depth, const StagingArea *fixed_buffer = nullptr, int64_t stall_ns = -1,
             const std::atomic<int> *yield_to = nullptr, unsigned yield_depth = 0);
  size_t yielded() const { return yielded_; }

  bool retired() const { return retired_; }

  uint64_t buffer_serial() const { return buffer_serial_; }
  int buffer_refused() const { return buffer_refused_; }

 private:
  void release();
  int enter(unsigned to_submit, unsigned min_complete, int64_t timeout_ns = -1);
  unsigned reap(ReadOp *ops, size_t n);
  // Waits for the `inflight` reads among ops[0, offered); cancels them first if `stalled`, or once none completes
  // for stall_ns. Returns whether it cancelled (retired_ set if a cancelled read still did not end).
  bool settle(ReadOp *ops, size_t n, size_t offered, unsigned &inflight, int64_t stall_ns, bool stalled);
  void cancel(ReadOp *ops, size_t offered);

  bool use_fixed_buffer(const StagingArea &area);

  int fd_ = -1;
  uint64_t buffer_serial_ = 0;     // the staging area registered as buffer 0 (0: none)
  uint8_t *buffer_base_ = nullptr;
  size_t buffer_bytes_ = 0;
  int buffer_refused_ = 0;         // errno of a refused buffer registration: do not ask again
  unsigned sq_entries_ = 0;
  bool timed_waits_ = false;  // IORING_FEAT_EXT_ARG: io_uring_enter takes a timeout
  bool retired_ = false;      // a read outlived its cancellation: the kernel may still hold a dst
  size_t yielded_ = 0;        // the last run's reads offered while it gave way
  void *sq_map_ = nullptr, *cq_map_ = nullptr, *sqe_map_ = nullptr;
  size_t sq_map_bytes_ = 0, cq_map_bytes_ = 0, sqe_map_bytes_ = 0;
  // Ring fields shared with the kernel (pointers into the mappings).
  uint32_t *sq_tail_ = nullptr, *sq_array_ = nullptr, *cq_head_ = nullptr, *cq_tail_ = nullptr;
  uint32_t sq_mask_ = 0, cq_mask_ = 0;  // constant for the ring's life
  ::io_uring_sqe *sqes_ = nullptr;
  ::io_uring_cqe *cqes_ = nullptr;
};

}  // namespace tiergram
