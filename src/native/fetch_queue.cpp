// The native job queue (fetch_queue.h).
#include "fetch_queue.h"

#include <pthread.h>

#include <chrono>
#include <stdexcept>

#include "common.h"

namespace tiergram {

bool Job::ended() {
  std::lock_guard<std::mutex> lock(mu);
  return state == kDone || state == kCancelled;
}

bool Job::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu);
  auto over = [&] { return state == kDone || state == kCancelled; };
  if (timeout_s < 0) {
    cv.wait(lock, over);
    return true;
  }
  return cv.wait_for(lock, std::chrono::duration<double>(timeout_s), over);
}

bool Job::cancel_or_stop() {
  {
    std::lock_guard<std::mutex> lock(mu);
    if (state != kPending) {
      if (state == kRunning) cancel = true;
      return state == kCancelled;
    }
    state = kCancelled;
    cv.notify_all();
  }
  if (on_cancel) on_cancel();  // outside the job's lock: it takes the cache's
  return true;
}

FetchQueue::FetchQueue(bool background) : background_(background) {
  // The worker starts at the first submit, from whichever thread submits (a server's step thread, which may have a
  // CPU of its own): it takes the CPUs of the thread that made the queue instead.
  CPU_ZERO(&cpus_);
  has_cpus_ = pthread_getaffinity_np(pthread_self(), sizeof(cpus_), &cpus_) == 0;
}

void FetchQueue::submit(const std::shared_ptr<Job> &job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw std::invalid_argument("the fetch queue is shut down (the table was closed)");
    if (!worker_.joinable()) worker_ = std::thread([this] { loop(); });
    q_.push_back(job);
  }
  // Outside the lock: a worker woken inside it would block on it again.
  cv_.notify_one();
}

void FetchQueue::shutdown(bool cancel_pending) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    if (cancel_pending) {
      for (auto &job : q_) job->cancel_or_stop();  // a queued job is pending or was cancelled meanwhile
      q_.clear();
    }
  }
  cv_.notify_all();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

void FetchQueue::hold_next() {
  std::lock_guard<std::mutex> lock(hold_mu_);
  hold_ = kArmed;
}

bool FetchQueue::wait_held(double timeout_s) {
  std::unique_lock<std::mutex> lock(hold_mu_);
  return hold_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return hold_ == kHeld; });
}

void FetchQueue::release_held() {
  std::lock_guard<std::mutex> lock(hold_mu_);
  hold_ = hold_ == kHeld ? kReleased : kNone;
  hold_cv_.notify_all();
}

void FetchQueue::hold_if_armed() {
  std::unique_lock<std::mutex> lock(hold_mu_);
  if (hold_ != kArmed) return;
  hold_ = kHeld;
  hold_cv_.notify_all();
  hold_cv_.wait(lock, [&] { return hold_ == kReleased; });
  hold_ = kNone;
}

void FetchQueue::loop() {
  name_this_thread(background_ ? "tiergram-warm" : "tiergram-fetch");
  if (has_cpus_) pthread_setaffinity_np(pthread_self(), sizeof(cpus_), &cpus_);  // refused: stays as created
  for (;;) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;  // stopped and drained
      job = std::move(q_.front());
      q_.pop_front();
    }
    {
      std::lock_guard<std::mutex> jl(job->mu);
      if (job->state != Job::kPending) continue;  // cancelled while queued
      job->state = Job::kRunning;
    }
    hold_if_armed();
    Job::State end = Job::kDone;
    std::exception_ptr error;
    try {
      job->work(&job->cancel);
    } catch (const Cancelled &) {
      end = Job::kCancelled;
    } catch (...) {
      error = std::current_exception();
    }
    std::lock_guard<std::mutex> jl(job->mu);
    job->state = end;
    job->error = error;
    job->work = nullptr;  // what it captured goes now
    job->cv.notify_all();
  }
}

}  // namespace tiergram
