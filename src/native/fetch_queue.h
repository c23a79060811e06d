// The native job queue: a table's prefetches and read-aheads run on a C++ thread of its own, in submission order,
// and a ticket waits on its job without the GIL (no Python worker thread, so a fetch never waits for the GIL to start).
#pragma once

#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace tiergram {

// A job's work throws this to stop at a phase boundary once asked to (a cancelled ticket).
struct Cancelled {};

struct Job {
  enum State { kPending, kRunning, kDone, kCancelled };
  std::function<void(const std::atomic<bool> *cancel)> work;
  std::function<void()> on_cancel;  // run (without the job's lock) when the job is cancelled before it ran
  std::mutex mu;
  std::condition_variable cv;
  State state = kPending;
  std::exception_ptr error;
  std::atomic<bool> cancel{false};

  bool ended();
  // True once the job ended (timeout_s < 0: no limit).
  bool wait(double timeout_s);
  // Cancels a pending job (true); asks a running one to stop at its next phase (false: wait, then look).
  bool cancel_or_stop();
};

class FetchQueue {
 public:
  // background: a read-ahead queue, whose jobs' page reads give way to the reader's foreground reads (fetches).
  explicit FetchQueue(bool background = false);
  ~FetchQueue() { shutdown(true); }
  FetchQueue(const FetchQueue &) = delete;
  FetchQueue &operator=(const FetchQueue &) = delete;

  bool background() const { return background_; }
  // Queues a job (invalid_argument once shut down); the worker starts with the first one.
  void submit(const std::shared_ptr<Job> &job);
  // Stops taking jobs; cancel_pending: queued jobs are cancelled, else they run first. Waits for the running one.
  void shutdown(bool cancel_pending);

  // Test hook: the next job waits, once running, until release_held().
  void hold_next();
  bool wait_held(double timeout_s);
  void release_held();

 private:
  void loop();
  void hold_if_armed();

  bool background_;
  cpu_set_t cpus_;  // the creating thread's CPUs, the worker's once it starts
  bool has_cpus_ = false;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> q_;
  bool stop_ = false;
  std::thread worker_;
  enum Hold { kNone, kArmed, kHeld, kReleased };
  std::mutex hold_mu_;
  std::condition_variable hold_cv_;
  Hold hold_ = kNone;
};

}  // namespace tiergram
