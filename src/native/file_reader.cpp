// Batched O_DIRECT page reads: io_uring (raw syscalls, see uring.h) with a thread-pool pread fallback.
//
// Concurrency: several Python threads may call read_pages on one reader. The io_uring backend gives each
// call a ring of its own, taken from a pool of idle rings (created on demand), so calls never share a ring
// and never wait on each other; the thread backend runs every call's reads on one shared pool of workers.
// close() waits for running calls before it releases the fd and the rings.
#include <fcntl.h>
#include <nanobind/stl/filesystem.h>
#include <nanobind/stl/string.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "bindings.h"
#include "common.h"
#include "file_reader.h"
#include "uring.h"

namespace tiergram {

namespace {

constexpr uint64_t kDirectAlign = 4096;  // buffer alignment we demand for O_DIRECT (covers 512e and 4Kn disks)
constexpr unsigned kMaxQueueDepth = 4096;
constexpr unsigned kMaxThreads = 64;  // more pread threads than this only add scheduling cost
// While a fetch is in flight a read-ahead keeps this many reads at the device (a 190-page fetch beside a QD-128
// read-ahead took 2.7x as long as alone, beside QD 32 1.3x, QD 8 1.1x; docs/decisions.md).
constexpr unsigned kYieldDepth = 8;

// A page that could not be read correctly twice; becomes tiergram._native.PageReadError (an OSError).
struct PageReadFailure : std::runtime_error {
  int err;
  PageReadFailure(int e, const std::string &msg) : std::runtime_error(msg), err(e) {}
};

// An OS error outside page reads (open, ring setup); becomes OSError(errno, message), so ENOENT
// arrives as FileNotFoundError.
struct OsFailure : std::runtime_error {
  int err;
  OsFailure(int e, const std::string &msg) : std::runtime_error(msg), err(e) {}
};

PyObject *g_page_read_error = nullptr;

// Says once per process, on stderr, which slower path we fell back to and why.
void say_once(std::atomic<bool> &said, const std::string &msg) {
  if (!said.exchange(true)) std::fprintf(stderr, "tiergram: %s\n", msg.c_str());
}
std::atomic<bool> g_said_uring{false}, g_said_direct{false}, g_said_stall{false};

// One blocking positioned read (the thread pool's, and the io_uring backend's way round a stalled ring).
int32_t pread_op(int fd, const ReadOp &op) {
  ssize_t r;
  do r = pread(fd, op.dst, op.len, static_cast<off_t>(op.offset));
  while (r < 0 && errno == EINTR);
  return r < 0 ? -errno : static_cast<int32_t>(r);
}

struct BackendReads {
  size_t fixed = 0;    // reads that went out as READ_FIXED into a registered buffer
  size_t stalled = 0;  // reads a stalled ring gave up on, re-read with pread
  size_t yielded = 0;  // reads offered while giving way to foreground reads
};

// How a background read gives way: while *foreground > 0, at most `depth` of its reads in flight (0: never).
struct GiveWay {
  const std::atomic<int> *foreground = nullptr;
  unsigned depth = 0;
};

class ReadBackend {
 public:
  virtual ~ReadBackend() = default;
  virtual const char *name() const = 0;
  // Reads every op once, setting op.res; never throws for a failed read (that is op.res < 0). area: the
  // registrable staging buffer the ops' dst lie in, or nullptr.
  virtual BackendReads read(int fd, ReadOp *ops, size_t n, const StagingArea *area, GiveWay give_way) = 0;
  // errno of a refused buffer registration (0: none refused).
  virtual int buffer_refused() const { return 0; }
  // How long a call waits with no read completing before it gives the rest up (< 0: for ever); io_uring only.
  virtual void set_stall_ns(int64_t) {}
};

class UringBackend : public ReadBackend {
 public:
  UringBackend(unsigned depth, int64_t stall_ns) : depth_(depth), stall_ns_(stall_ns) {
    idle_.push_back(std::make_unique<Ring>(depth));
  }
  const char *name() const override { return "io_uring"; }

  BackendReads read(int fd, ReadOp *ops, size_t n, const StagingArea *area, GiveWay give_way) override {
    std::unique_ptr<Ring> ring = acquire(area ? area->serial : 0);
    BackendReads got;
    got.fixed = ring->run(fd, ops, n, depth_, area, stall_ns_.load(), give_way.foreground, give_way.depth);
    got.yielded = ring->yielded();
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ring->buffer_refused()) buffer_refused_ = ring->buffer_refused();
      // A retired ring may still owe the kernel a read: it is closed here, never reused (the next call makes one).
      if (!ring->retired()) idle_.push_back(std::move(ring));
      cv_.notify_one();
    }
    // The kernel completed none of these reads for the stall timeout (a lost completion would otherwise hang the
    // caller for ever): read them the slow, sure way.
    for (size_t i = 0; i < n; ++i)
      if (ops[i].res == kStalled) ops[i].res = pread_op(fd, ops[i]), ++got.stalled;
    return got;
  }

  int buffer_refused() const override { return buffer_refused_.load(); }
  void set_stall_ns(int64_t ns) override { stall_ns_ = ns; }

 private:
  // Prefers an idle ring that has `serial`'s staging area registered already (each thread's staging buffer
  // then stays with one ring and is registered once), else the most recently used one.
  std::unique_ptr<Ring> take_locked(uint64_t serial) {
    size_t pick = idle_.size() - 1;
    if (serial != 0)
      for (size_t i = 0; i < idle_.size(); ++i)
        if (idle_[i]->buffer_serial() == serial) pick = i;
    auto r = std::move(idle_[pick]);
    idle_.erase(idle_.begin() + static_cast<std::ptrdiff_t>(pick));
    return r;
  }

  std::unique_ptr<Ring> acquire(uint64_t serial) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!idle_.empty()) return take_locked(serial);
    }
    try {
      return std::make_unique<Ring>(depth_);  // another call holds every ring: make one more
    } catch (const UringUnavailable &) {
      // Out of ring memory (RLIMIT_MEMLOCK on old kernels): share the rings we have.
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !idle_.empty(); });
      return take_locked(serial);
    }
  }

  unsigned depth_;
  std::atomic<int64_t> stall_ns_;
  std::atomic<int> buffer_refused_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Ring>> idle_;
};

class ThreadBackend : public ReadBackend {
 public:
  explicit ThreadBackend(unsigned n_threads) {
    for (unsigned i = 0; i < n_threads; ++i) workers_.emplace_back([this] { work(); });
  }
  ~ThreadBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_work_.notify_all();
    for (auto &t : workers_) t.join();
  }
  const char *name() const override { return "threads"; }

  BackendReads read(int fd, ReadOp *ops, size_t n, const StagingArea *, GiveWay) override {
    if (n == 0) return {};
    Job job;
    job.fd = fd, job.ops = ops, job.n = n;
    std::unique_lock<std::mutex> lock(mu_);
    jobs_.push_back(&job);
    cv_work_.notify_all();
    job.cv_done.wait(lock, [&] { return job.done == job.n; });
    return {};
  }

 private:
  struct Job {
    int fd = -1;
    ReadOp *ops = nullptr;
    size_t n = 0;
    size_t next = 0, done = 0;
    std::condition_variable cv_done;
  };

  void work() {
    name_this_thread("tiergram-read");
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_work_.wait(lock, [&] { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      Job *job = jobs_.front();
      ReadOp &op = job->ops[job->next++];
      if (job->next == job->n) jobs_.pop_front();  // every op handed out; the caller still waits for `done`
      lock.unlock();
      op.res = pread_op(job->fd, op);
      lock.lock();
      if (++job->done == job->n) job->cv_done.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable cv_work_;
  std::deque<Job *> jobs_;
  bool stop_ = false;
};

enum class Fault { kEio, kShort, kFlip, kStall };

class PageReader : public PageSource {
 public:
  PageReader(const std::filesystem::path &path, uint64_t data_offset, uint64_t page_size, uint64_t n_pages,
             unsigned queue_depth, const std::string &backend, bool direct, double stall_timeout_s)
      : path_(path.string()), data_offset_(data_offset), page_size_(page_size), n_pages_(n_pages),
        queue_depth_(queue_depth), want_direct_(direct), seen_(new std::atomic<uint64_t>[(n_pages + 63) / 64]()) {
    require(page_size >= 512 && page_size <= (1u << 30) && (page_size & (page_size - 1)) == 0,
            "page_size must be a power of two between 512 and 2^30, got " + std::to_string(page_size));
    require(n_pages <= (uint64_t{1} << 32), "n_pages " + std::to_string(n_pages) + " exceeds the u32 page index");
    require(data_offset <= (uint64_t{1} << 62) && n_pages * page_size <= (uint64_t{1} << 62) - data_offset,
            "data_offset + n_pages * page_size overflows a file offset");
    require(queue_depth >= 1 && queue_depth <= kMaxQueueDepth,
            "queue_depth must be in [1, " + std::to_string(kMaxQueueDepth) + "], got " + std::to_string(queue_depth));
    require(backend == "auto" || backend == "io_uring" || backend == "threads",
            "backend must be 'auto', 'io_uring' or 'threads', got '" + backend + "'");
    const int64_t stall_ns = stall_timeout_ns(stall_timeout_s);
    require(!direct || data_offset % 512 == 0,
            "data_offset " + std::to_string(data_offset) + " is not a multiple of 512, as O_DIRECT needs");

    fd_ = open(path_.c_str(), O_RDONLY | O_CLOEXEC | (direct ? O_DIRECT : 0));
    if (fd_ < 0 && direct && errno == EINVAL) {
      // The filesystem refuses O_DIRECT (e.g. tmpfs before Linux 6.6): read through the page cache.
      say_once(g_said_direct, "O_DIRECT not supported for " + path_ + ", using buffered reads");
      fd_ = open(path_.c_str(), O_RDONLY | O_CLOEXEC);
      direct_ = false;
    } else {
      direct_ = direct;
    }
    if (fd_ < 0) {
      const int err = errno;
      throw OsFailure(err, "cannot open " + path_ + ": " + std::strerror(err));
    }

    try {
      if (backend != "threads") {
        try {
          backend_ = std::make_unique<UringBackend>(queue_depth, stall_ns);
        } catch (const UringUnavailable &e) {
          const std::string why =
              "io_uring unavailable (errno " + std::to_string(e.err) + ": " + std::strerror(e.err) + ")";
          if (backend == "io_uring") throw OsFailure(e.err, why);
          say_once(g_said_uring, why + ", using thread-pool pread");
        }
      }
      if (!backend_) backend_ = std::make_unique<ThreadBackend>(std::min(queue_depth, kMaxThreads));
      backend_name_ = backend_->name();
    } catch (...) {
      ::close(fd_);
      throw;
    }
  }

  ~PageReader() { close(); }

  void close() {
    std::unique_lock<std::mutex> lock(mu_);
    closed_ = true;
    cv_idle_.wait(lock, [&] { return active_ == 0; });
    backend_.reset();
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    for (int &end : stall_pipe_)
      if (end >= 0) ::close(end), end = -1;
  }

  void read_pages(IdsIn pages, BytesOut out, bool verify, bool background) {
    const size_t m = pages.size();
    require(pages.ndim() == 1, "pages must be a 1-D int64 array");
    require(out.size() / page_size_ == m && out.size() % page_size_ == 0,
            "out has " + std::to_string(out.size()) + " bytes, expected " + std::to_string(m) + " pages of " +
                std::to_string(page_size_) + " = " + std::to_string(m * page_size_));
    if (m == 0) return;
    require(!want_direct_ || reinterpret_cast<uintptr_t>(out.data()) % kDirectAlign == 0,
            "out must be aligned to " + std::to_string(kDirectAlign) +
                " bytes for O_DIRECT reads (use tiergram.tiers.aligned.aligned_empty)");
    const int64_t *ids = pages.data();
    for (size_t i = 0; i < m; ++i)
      if (ids[i] < 0 || static_cast<uint64_t>(ids[i]) >= n_pages_)
        throw nb::index_error(("page id " + std::to_string(ids[i]) + " (position " + std::to_string(i) +
                               ") is out of range: " + path_ + " has " + std::to_string(n_pages_) + " pages")
                                  .c_str());

    nb::gil_scoped_release release;
    read_nogil(ids, m, out.data(), verify, nullptr, background);
  }

  void read_nogil(const int64_t *ids, size_t m, uint8_t *out, bool verify, const StagingArea *area = nullptr,
                  bool background = false) override {
    if (m == 0) return;
    CallGuard guard(*this);  // taken without the GIL: let go before the GIL is taken back
    ForegroundGuard fg(*this, !background);
    std::vector<ReadOp> ops(m);
    for (size_t i = 0; i < m; ++i)
      ops[i] = ReadOp{data_offset_ + static_cast<uint64_t>(ids[i]) * page_size_, out + i * page_size_,
                      static_cast<uint32_t>(page_size_), 0};
    std::vector<size_t> bad = read_once(ops, ids, nullptr, verify, area, background);
    note_read(ids, m);  // (a page that fails twice throws below; it was read all the same)
    if (bad.empty()) return;

    // Re-read each failed page once: a transient error or a torn read should not fail the request.
    std::vector<ReadOp> again(bad.size());
    for (size_t k = 0; k < bad.size(); ++k) again[k] = ops[bad[k]];
    std::vector<size_t> still = read_once(again, ids, bad.data(), verify, area, background);
    if (still.empty()) return;
    const ReadOp &op = again[still[0]];
    const int64_t page = ids[bad[still[0]]];
    std::string msg = "cannot read page " + std::to_string(page) + " of " + path_ + " (file offset " +
                      std::to_string(op.offset) + ", tried twice): " + cause(op, verify);
    if (still.size() > 1) msg += " (" + std::to_string(still.size()) + " pages of this request failed)";
    throw PageReadFailure(op.res < 0 ? -op.res : EIO, msg);
  }

  void inject_fault(const std::string &kind, int64_t page, int times) {
    Fault f;
    if (kind == "eio") f = Fault::kEio;
    else if (kind == "short") f = Fault::kShort;
    else if (kind == "flip") f = Fault::kFlip;
    else if (kind == "stall") f = Fault::kStall;
    else throw std::invalid_argument("fault kind must be 'eio', 'short', 'flip' or 'stall', got '" + kind + "'");
    if (page < 0 || static_cast<uint64_t>(page) >= n_pages_)
      throw nb::index_error(("page id " + std::to_string(page) + " is out of range").c_str());
    require(times >= 0, "times must be >= 0");
    std::lock_guard<std::mutex> lock(fault_mu_);
    if (f == Fault::kStall) {
      require(backend_name_ == "io_uring", "the 'stall' fault needs the io_uring backend, this reader uses " +
                                               backend_name_);
      // A stalled read is a real io_uring read of an empty pipe whose write end stays open: it never completes.
      if (stall_pipe_[0] < 0 && pipe2(stall_pipe_, O_CLOEXEC) < 0) {
        const int err = errno;
        throw OsFailure(err, std::string("cannot make the stall fault's pipe: ") + std::strerror(err));
      }
    }
    if (times == 0) faults_.erase(page);
    else faults_[page] = {f, times};
    any_faults_ = !faults_.empty();
  }

  void clear_faults() {
    std::lock_guard<std::mutex> lock(fault_mu_);
    faults_.clear();
    any_faults_ = false;
  }

  const std::string &path() const { return path_; }
  const std::string &backend() const { return backend_name_; }
  unsigned queue_depth() const { return queue_depth_; }
  uint64_t page_size() const override { return page_size_; }
  uint64_t n_pages() const override { return n_pages_; }
  uint64_t data_offset() const { return data_offset_; }
  bool direct() const { return direct_; }
  uint64_t fixed_reads() const { return fixed_reads_.load(); }
  uint64_t stalled_reads() const { return stalled_reads_.load(); }
  uint64_t yielded_reads() const { return yielded_reads_.load(); }
  double stall_timeout_s() const { return stall_timeout_s_.load(); }
  void set_stall_timeout_s(double s) {
    const int64_t ns = stall_timeout_ns(s);
    std::lock_guard<std::mutex> lock(mu_);
    if (backend_) backend_->set_stall_ns(ns);
  }
  uint64_t first_reads() const { return first_reads_.load(); }

  // Pages [first, first + count) were read by another path of this process (a whole-table scan): counted as read.
  void mark_read(int64_t first, int64_t count) {
    if (first < 0 || count < 0 || static_cast<uint64_t>(first) > n_pages_ ||
        static_cast<uint64_t>(count) > n_pages_ - static_cast<uint64_t>(first))
      throw nb::index_error(("pages [" + std::to_string(first) + ", " + std::to_string(first) + " + " +
                             std::to_string(count) + ") are out of range: " + path_ + " has " +
                             std::to_string(n_pages_) + " pages")
                                .c_str());
    // a word of the bitmap at a time (no list of page ids: a 1 TiB table has 268M pages)
    uint64_t page = static_cast<uint64_t>(first), added = 0;
    const uint64_t end = page + static_cast<uint64_t>(count);
    while (page < end) {
      const uint64_t lo = page & 63, hi = std::min<uint64_t>(64, lo + (end - page));
      const uint64_t mask = (hi == 64 ? ~uint64_t{0} : (uint64_t{1} << hi) - 1) & ~((uint64_t{1} << lo) - 1);
      added += static_cast<uint64_t>(
          __builtin_popcountll(mask & ~seen_[page >> 6].fetch_or(mask, std::memory_order_relaxed)));
      page = (page | 63) + 1;
    }
    first_reads_ += added;
  }
  int buffer_refused() const {
    std::lock_guard<std::mutex> lock(mu_);
    return backend_ ? backend_->buffer_refused() : 0;
  }

 private:
  // Validates a stall timeout in seconds (inf: none) and keeps it; returns it in ns (-1: none).
  int64_t stall_timeout_ns(double s) {
    require(s > 0, "stall_timeout_s must be > 0 seconds (inf: wait for ever), got " + std::to_string(s));
    stall_timeout_s_ = s;
    return std::isinf(s) ? -1 : static_cast<int64_t>(s * 1e9);
  }

  // Counts a call's foreground reads in flight, which background calls give way to.
  struct ForegroundGuard {
    PageReader &r;
    bool on;
    ForegroundGuard(PageReader &reader, bool foreground) : r(reader), on(foreground) {
      if (on) r.foreground_.fetch_add(1, std::memory_order_relaxed);
    }
    ~ForegroundGuard() {
      if (on) r.foreground_.fetch_sub(1, std::memory_order_relaxed);
    }
  };

  // Counts running calls so that close() can wait for them.
  struct CallGuard {
    PageReader &r;
    explicit CallGuard(PageReader &reader) : r(reader) {
      std::lock_guard<std::mutex> lock(r.mu_);
      if (r.closed_) throw std::invalid_argument("PageReader for " + r.path_ + " is closed");
      ++r.active_;
    }
    ~CallGuard() {
      std::lock_guard<std::mutex> lock(r.mu_);
      if (--r.active_ == 0) r.cv_idle_.notify_all();
    }
  };

  // Counts the pages of a request this reader had never read: a cache under the disk (a VM's volume, a SAN) can hold
  // what was read before, so the share of first reads says which rate a workload's reads get.
  void note_read(const int64_t *ids, size_t m) {
    uint64_t first = 0;
    for (size_t i = 0; i < m; ++i) {
      const uint64_t page = static_cast<uint64_t>(ids[i]), bit = uint64_t{1} << (page & 63);
      if (!(seen_[page >> 6].fetch_or(bit, std::memory_order_relaxed) & bit)) ++first;
    }
    first_reads_ += first;
  }

  // Reads ops once; returns the positions (in ops) that failed. ops[k] reads page ids[pos ? pos[k] : k].
  std::vector<size_t> read_once(std::vector<ReadOp> &ops, const int64_t *ids, const size_t *pos, bool verify,
                                const StagingArea *area, bool background) {
    if (any_faults_) route_stalls(ops, ids, pos);
    const GiveWay give_way = background ? GiveWay{&foreground_, kYieldDepth} : GiveWay{};
    const BackendReads got = backend_->read(fd_, ops.data(), ops.size(), area, give_way);
    fixed_reads_ += got.fixed;
    yielded_reads_ += got.yielded;
    if (got.stalled) {
      stalled_reads_ += got.stalled;
      char secs[32];
      std::snprintf(secs, sizeof secs, "%g", stall_timeout_s_.load());
      say_once(g_said_stall, "io_uring reads of " + path_ + " made no progress for " + secs + " s; cancelled " +
                                 std::to_string(got.stalled) + " and re-read them with pread (stalled_reads)");
    }
    std::vector<size_t> bad;
    for (size_t k = 0; k < ops.size(); ++k) {
      ReadOp &op = ops[k];
      const int64_t page = ids[pos ? pos[k] : k];
      if (any_faults_) apply_fault(op, page);
      bool ok = op.res == static_cast<int32_t>(op.len);
      if (ok && verify) ok = page_ok(op.dst, page_size_, static_cast<uint32_t>(page));
      if (!ok) bad.push_back(k);
    }
    return bad;
  }

  // Test hook: points the reads of pages with a pending 'stall' fault at the stall pipe (one use per read).
  void route_stalls(std::vector<ReadOp> &ops, const int64_t *ids, const size_t *pos) {
    std::lock_guard<std::mutex> lock(fault_mu_);
    for (size_t k = 0; k < ops.size(); ++k) {
      auto it = faults_.find(ids[pos ? pos[k] : k]);
      if (it == faults_.end() || it->second.first != Fault::kStall) continue;
      ops[k].fd = stall_pipe_[0];
      if (--it->second.second == 0) faults_.erase(it);
    }
    any_faults_ = !faults_.empty();
  }

  // Test hook: corrupts the outcome of a read of a page that has a pending injected fault.
  void apply_fault(ReadOp &op, int64_t page) {
    std::lock_guard<std::mutex> lock(fault_mu_);
    auto it = faults_.find(page);
    if (it == faults_.end() || it->second.first == Fault::kStall) return;
    switch (it->second.first) {
      case Fault::kEio: op.res = -EIO; break;
      case Fault::kShort: op.res = op.res > 0 ? std::min<int32_t>(op.res, op.len / 2) : op.res; break;
      case Fault::kFlip: op.dst[op.len / 3] ^= 0x10; break;
      case Fault::kStall: break;
    }
    if (--it->second.second == 0) faults_.erase(it);
    any_faults_ = !faults_.empty();
  }

  std::string cause(const ReadOp &op, bool verify) const {
    if (op.res < 0) return std::strerror(-op.res);
    if (op.res != static_cast<int32_t>(op.len))
      return "short read: got " + std::to_string(op.res) + " of " + std::to_string(op.len) + " bytes";
    return verify ? "checksum mismatch" : "unknown error";
  }

  std::string path_;
  uint64_t data_offset_, page_size_, n_pages_;
  unsigned queue_depth_;
  bool want_direct_, direct_ = false;
  std::atomic<uint64_t> fixed_reads_{0};
  std::atomic<uint64_t> stalled_reads_{0};
  std::atomic<int> foreground_{0};          // foreground calls running: background calls give way while > 0
  std::atomic<uint64_t> yielded_reads_{0};
  std::atomic<double> stall_timeout_s_{0};
  std::unique_ptr<std::atomic<uint64_t>[]> seen_;  // a bit per page read so far (n_pages / 8 bytes)
  std::atomic<uint64_t> first_reads_{0};
  int fd_ = -1;
  std::unique_ptr<ReadBackend> backend_;
  std::string backend_name_;

  mutable std::mutex mu_;
  std::condition_variable cv_idle_;
  unsigned active_ = 0;
  bool closed_ = false;

  std::mutex fault_mu_;
  std::unordered_map<int64_t, std::pair<Fault, int>> faults_;
  int stall_pipe_[2] = {-1, -1};  // the 'stall' fault's pipe (made on first use)
  std::atomic<bool> any_faults_{false};
};

}  // namespace

void register_file_reader(nb::module_ &m) {
  g_page_read_error = PyErr_NewExceptionWithDoc(
      "tiergram._native.PageReadError",
      "A page could not be read correctly (I/O error, short read or checksum mismatch), even after a retry.",
      PyExc_OSError, nullptr);
  m.attr("PageReadError") = nb::handle(g_page_read_error);
  nb::register_exception_translator([](const std::exception_ptr &p, void *) {
    // OSError(errno, message): .errno is set, and plain OSError maps ENOENT etc. to its subclasses.
    auto raise = [](PyObject *type, int err, const char *msg) {
      PyObject *exc = PyObject_CallFunction(type, "is", err, msg);
      if (exc) {
        PyErr_SetObject(type, exc);
        Py_DECREF(exc);
      }
    };
    try {
      std::rethrow_exception(p);
    } catch (const PageReadFailure &e) {
      raise(g_page_read_error, e.err, e.what());
    } catch (const OsFailure &e) {
      raise(PyExc_OSError, e.err, e.what());
    }
  });

  nb::class_<PageSource>(m, "PageSource", "A native page reader the fetch pipeline can drive.");
  nb::class_<PageReader, PageSource>(m, "PageReader",
                         "Reads whole table pages from a file with O_DIRECT, many at a time (io_uring, or a "
                         "pread thread pool), verifying each page's trailer.")
      .def(nb::init<const std::filesystem::path &, uint64_t, uint64_t, uint64_t, unsigned, const std::string &,
                    bool, double>(),
           nb::arg("path"), nb::arg("data_offset"), nb::arg("page_size"), nb::arg("n_pages"),
           nb::arg("queue_depth") = 128, nb::arg("backend") = "auto", nb::arg("direct") = true,
           nb::arg("stall_timeout_s") = 10.0,
           "io_uring: the fetch pipeline's per-thread staging buffers are registered with the rings "
           "(IORING_REGISTER_BUFFERS) and its reads are READ_FIXED (the kernel pins each buffer once, not per read); "
           "read_pages into a caller's buffer reads plainly. stall_timeout_s (io_uring, Linux 5.11+): when no read "
           "of a call completes for this long, its reads still in flight are cancelled and re-read with pread "
           "(counted in stalled_reads); inf waits for ever.")
      // noconvert: a converted copy of out would take the pages and leave the caller's buffer untouched,
      // and float page ids would be truncated silently.
      .def("read_pages", &PageReader::read_pages, nb::arg("pages").noconvert(), nb::arg("out").noconvert(),
           nb::arg("verify") = true, nb::arg("background") = false,
           "Read page pages[i] (int64 [M]) into out[i*page_size:(i+1)*page_size] (uint8 [M*page_size], 4096-aligned "
           "when direct), up to queue_depth reads in flight. A page that fails (I/O error, short read, checksum) is "
           "re-read once; a second failure raises PageReadError. background: a read-ahead, which gives way to "
           "the reader's foreground reads (yield_depth).")
      .def(
          "close", [](PageReader &r) {
            nb::gil_scoped_release release;
            r.close();
          },
          "Wait for running reads, then release the file and the rings.")
      .def("__enter__", [](nb::handle self) { return self; })
      .def(
          "__exit__",
          [](PageReader &r, nb::args) {
            nb::gil_scoped_release release;
            r.close();
          })
      .def("inject_fault", &PageReader::inject_fault, nb::arg("kind"), nb::arg("page"), nb::arg("times") = 1,
           "Test hook: make the next `times` reads of `page` fail: 'eio', 'short' (half the bytes), 'flip' (a bit "
           "of the delivered page flipped) or 'stall' (io_uring: the read goes to an empty pipe and never completes).")
      .def("clear_faults", &PageReader::clear_faults)
      .def_prop_ro("backend", &PageReader::backend)
      .def_prop_ro("queue_depth", &PageReader::queue_depth)
      .def_prop_ro("page_size", &PageReader::page_size)
      .def_prop_ro("n_pages", &PageReader::n_pages)
      .def_prop_ro("data_offset", &PageReader::data_offset)
      .def_prop_ro("direct", &PageReader::direct, "Whether the file is open with O_DIRECT.")
      .def_prop_ro("fixed_reads", &PageReader::fixed_reads,
                   "Reads that went out as READ_FIXED into a registered staging buffer, since the reader opened.")
      .def_prop_ro("stalled_reads", &PageReader::stalled_reads,
                   "Reads a stalled io_uring call cancelled and re-read with pread, since the reader opened.")
      .def_prop_ro("yield_depth", [](const PageReader &) { return kYieldDepth; },
                   "io_uring: while a foreground read of this reader is in flight, a background read (a read-ahead) "
                   "keeps at most this many reads at the device, so the fetch's reads do not queue behind its own.")
      .def_prop_ro("yielded_reads", &PageReader::yielded_reads,
                   "Background reads offered while giving way to a foreground read, since the reader opened.")
      .def_prop_rw("stall_timeout_s", &PageReader::stall_timeout_s, &PageReader::set_stall_timeout_s,
                   "io_uring: seconds a call waits with no read completing before it cancels the reads in flight "
                   "and re-reads them with pread (inf: for ever). Settable; the next call uses it.")
      .def_prop_ro("first_reads", &PageReader::first_reads,
                   "Pages this reader read for the first time since it opened (re-reads of a page not counted).")
      .def("mark_read", &PageReader::mark_read, nb::arg("first"), nb::arg("count"),
           "Count pages [first, first + count) as read (another path of this process read them, e.g. a whole-table "
           "scan); IndexError outside the table.")
      .def_prop_ro("buffer_refused", &PageReader::buffer_refused,
                   "errno of a buffer registration the kernel refused (0: none), e.g. ENOMEM under RLIMIT_MEMLOCK.")
      .def_prop_ro("path", &PageReader::path);
}

}  // namespace tiergram
