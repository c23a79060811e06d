// Python bindings of the fetch pipeline (pipeline.h) and its job queue (fetch_queue.h): arguments checked with the
// GIL held, the work run without it; a queued job's arrays kept alive until it ends.
#include <nanobind/stl/pair.h>

#include <string>
#include <utility>
#include <vector>

#include "bindings.h"
#include "fetch_queue.h"
#include "pipeline.h"

namespace tiergram {

namespace {

using Counts = nb::ndarray<int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

Table table_of(PageSource &src, IdsIn head_offsets, IdsIn head_rows, uint64_t rows_per_page, int codec,
               uint64_t dim) {
  require(head_offsets.ndim() == 1 && head_offsets.size() == head_rows.size() && head_offsets.size() > 0,
          "head_offsets and head_rows must be int64 [H] of the same length");
  return make_table(src, head_offsets.data(), head_rows.data(), head_offsets.size(), rows_per_page, codec, dim);
}

void check_ids_shape(const Table &t, IdsIn ids) {
  require(ids.size() % t.n_heads == 0,
          "row ids: last dimension must equal the table's " + std::to_string(t.n_heads) + " heads");
}

void check_cache_rows(const NativeRowCache *cache, const Table &t) {
  require(cache == nullptr || cache->row_bytes() == t.view.geo.row_bytes,
          "cache rows are " + std::to_string(cache ? cache->row_bytes() : 0) + " bytes, the table's " +
              std::to_string(t.view.geo.row_bytes));
}

FetchArgs prepare_fetch(PageSource &src, NativeRowCache *cache, IdsIn ids, IdsIn head_offsets, IdsIn head_rows,
                        uint64_t rows_per_page, int codec, uint64_t dim, AnyOut out, Counts acc, Counts tier_acc) {
  FetchArgs a;
  a.t = table_of(src, head_offsets, head_rows, rows_per_page, codec, dim);
  const uint64_t H = a.t.n_heads;
  check_cache_rows(cache, a.t);
  check_ids_shape(a.t, ids);
  require(ids.size() < (uint64_t{1} << 32), "a lookup of " + std::to_string(ids.size()) + " ids is over 2^32");
  require(acc.size() == 4 * H + 4, "acc must be int64 [4 * H + 4] = [" + std::to_string(4 * H + 4) + "]");
  require(tier_acc.size() == 2, "tier_acc must be int64 [2]");
  a.kind = out_kind(out);
  check_out_size(out, a.kind, ids.size(), dim, a.t.view.geo.row_bytes);
  a.src = &src, a.cache = cache, a.ids = ids.data(), a.n = ids.size(), a.out = out.data();
  a.acc = acc.data(), a.tier_acc = tier_acc.data();
  return a;
}

WarmArgs prepare_warm(PageSource &src, NativeRowCache &cache, IdsIn ids, IdsIn head_offsets, IdsIn head_rows,
                      uint64_t rows_per_page, int codec, uint64_t dim, Counts acc, Counts tier_acc) {
  WarmArgs a;
  a.t = table_of(src, head_offsets, head_rows, rows_per_page, codec, dim);
  check_cache_rows(&cache, a.t);
  check_ids_shape(a.t, ids);
  require(acc.size() == 2 && tier_acc.size() == 2, "acc and tier_acc must be int64 [2]");
  a.src = &src, a.cache = &cache, a.ids = ids.data(), a.n = ids.size(), a.acc = acc.data();
  a.tier_acc = tier_acc.data();
  return a;
}

int64_t fetch(PageSource &src, NativeRowCache *cache, IdsIn ids, IdsIn head_offsets, IdsIn head_rows,
              uint64_t rows_per_page, int codec, uint64_t dim, AnyOut out, Counts acc, Counts tier_acc) {
  const FetchArgs a =
      prepare_fetch(src, cache, ids, head_offsets, head_rows, rows_per_page, codec, dim, out, acc, tier_acc);
  nb::gil_scoped_release release;
  return run_fetch(a, nullptr);
}

std::pair<int64_t, int64_t> warm(PageSource &src, NativeRowCache &cache, IdsIn ids, IdsIn head_offsets,
                                 IdsIn head_rows, uint64_t rows_per_page, int codec, uint64_t dim, Counts acc,
                                 Counts tier_acc) {
  const WarmArgs a = prepare_warm(src, cache, ids, head_offsets, head_rows, rows_per_page, codec, dim, acc, tier_acc);
  nb::gil_scoped_release release;
  return run_warm(a, nullptr);
}

// What a queued job's raw pointers point into (Python objects: taken and let go with the GIL held).
struct Keep {
  nb::object reader, cache;
  IdsIn ids, head_offsets, head_rows;
  AnyOut out;
  Counts acc, tier_acc;
};

// Handles dropped before their job ended (the engine fires read-aheads and forgets them): their arrays wait here
// until the job ends, and are let go by the next call into the queue, which holds the GIL.
struct Orphans {
  std::mutex mu;
  std::vector<std::pair<std::shared_ptr<Job>, Keep>> list;

  void add(std::shared_ptr<Job> job, Keep keep) {
    std::lock_guard<std::mutex> lock(mu);
    list.emplace_back(std::move(job), std::move(keep));
  }
  // GIL held. Lets go of the arrays of the jobs that ended.
  void reap() {
    std::vector<Keep> dead;
    {
      std::lock_guard<std::mutex> lock(mu);
      for (size_t i = 0; i < list.size();) {
        if (list[i].first->ended()) {
          dead.push_back(std::move(list[i].second));
          list[i] = std::move(list.back());
          list.pop_back();
        } else {
          ++i;
        }
      }
    }
  }  // dead's references go here, outside the lock
};

// The queue as Python holds it: with the arrays of the jobs whose handles were dropped before they ended.
struct PyFetchQueue : FetchQueue {
  using FetchQueue::FetchQueue;
  std::shared_ptr<Orphans> orphans = std::make_shared<Orphans>();
  ~PyFetchQueue() {
    shutdown(true);
    orphans->reap();
  }
};

PyObject *g_cancelled_error = nullptr;  // concurrent.futures.CancelledError

// The Python handle of a queued job. It keeps every array the job reads or writes alive; dropped before the job
// ended (a job runs whether or not anyone waits for it, as a Future does), it leaves them to the queue's orphans.
class FetchJob {
 public:
  FetchJob(std::shared_ptr<Job> job, Keep keep, std::shared_ptr<Orphans> orphans)
      : job_(std::move(job)), keep_(std::move(keep)), orphans_(std::move(orphans)) {}
  FetchJob(const FetchJob &) = delete;
  FetchJob &operator=(const FetchJob &) = delete;
  ~FetchJob() {
    if (!job_->ended()) orphans_->add(job_, std::move(keep_));
  }

  bool done() { return job_->ended(); }

  const char *state() {
    std::lock_guard<std::mutex> lock(job_->mu);
    switch (job_->state) {
      case Job::kPending: return "pending";
      case Job::kRunning: return "running";
      case Job::kDone: return "done";
      default: return "cancelled";
    }
  }

  bool wait(double timeout_s) {
    nb::gil_scoped_release release;
    return job_->wait(timeout_s);
  }

  // Raises the job's error (IndexError, PageReadError, ...) or CancelledError; the job must have ended.
  void result() {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(job_->mu);
      if (job_->state == Job::kCancelled) {
        PyErr_SetString(g_cancelled_error, "the fetch was cancelled");
        throw nb::python_error();
      }
      require(job_->state == Job::kDone, "the fetch has not finished");
      error = job_->error;
    }
    if (error) std::rethrow_exception(error);
  }

  bool cancel() { return job_->cancel_or_stop(); }

 private:
  std::shared_ptr<Job> job_;
  Keep keep_;
  std::shared_ptr<Orphans> orphans_;
};

// Queues a job and hands Python its handle; a job that cannot be queued runs its on_cancel (nothing else would).
FetchJob *enqueue(PyFetchQueue &q, const std::shared_ptr<Job> &job, Keep keep) {
  auto *handle = new FetchJob(job, std::move(keep), q.orphans);
  try {
    q.orphans->reap();
    // Without the GIL: on a busy machine the woken worker may take this core at once and run the whole fetch
    // before the caller resumes, and other Python threads run meanwhile.
    nb::gil_scoped_release release;
    q.submit(job);
  } catch (...) {
    if (job->on_cancel) job->on_cancel();  // never queued: e.g. nothing will probe an announced batch
    delete handle;
    throw;
  }
  return handle;
}

FetchJob *submit_fetch(PyFetchQueue &q, nb::handle reader, nb::handle cache_obj, IdsIn ids, IdsIn head_offsets,
                       IdsIn head_rows, uint64_t rows_per_page, int codec, uint64_t dim, AnyOut out, Counts acc,
                       Counts tier_acc) {
  PageSource &src = nb::cast<PageSource &>(reader);
  NativeRowCache *cache = cache_obj.is_none() ? nullptr : &nb::cast<NativeRowCache &>(cache_obj);
  FetchArgs a = prepare_fetch(src, cache, ids, head_offsets, head_rows, rows_per_page, codec, dim, out, acc, tier_acc);
  a.background = q.background();
  auto job = std::make_shared<Job>();
  {
    nb::gil_scoped_release release;  // the caller's arrays stay alive for the call
    check_ids(a.t.view, a.ids, a.n);  // a bad id raises IndexError here, in the caller, not later in wait()
    if (cache && cache->policy() == Policy::kLookahead) {
      // Tell the lookahead policy these rows are coming (sorted distinct keys, as the reference announces them), in
      // queue order; the job's probe retires the batch, a cancellation or a failure before the probe too.
      std::vector<int64_t> uniq;
      sorted_unique(a.t, a.ids, a.n, uniq);
      a.batch = cache->announce(uniq.data(), uniq.size());
      job->on_cancel = [cache, batch = a.batch] { cache->retire(batch); };
    }
  }
  job->work = [a](const std::atomic<bool> *cancel) { run_fetch(a, cancel); };
  return enqueue(q, job, Keep{nb::borrow(reader), nb::borrow(cache_obj), ids, head_offsets, head_rows, out, acc,
                              tier_acc});
}

FetchJob *submit_warm(PyFetchQueue &q, nb::handle reader, nb::handle cache_obj, IdsIn ids, IdsIn head_offsets,
                      IdsIn head_rows, uint64_t rows_per_page, int codec, uint64_t dim, Counts acc, Counts tier_acc) {
  PageSource &src = nb::cast<PageSource &>(reader);
  NativeRowCache &cache = nb::cast<NativeRowCache &>(cache_obj);
  WarmArgs a = prepare_warm(src, cache, ids, head_offsets, head_rows, rows_per_page, codec, dim, acc, tier_acc);
  a.background = q.background();
  {
    nb::gil_scoped_release release;
    check_ids(a.t.view, a.ids, a.n);  // a bad id raises IndexError in the caller
  }
  auto job = std::make_shared<Job>();
  job->work = [a](const std::atomic<bool> *cancel) { run_warm(a, cancel); };
  return enqueue(q, job, Keep{nb::borrow(reader), nb::borrow(cache_obj), ids, head_offsets, head_rows, AnyOut(), acc,
                              tier_acc});
}

}  // namespace

void register_pipeline(nb::module_ &m) {
  g_cancelled_error = nb::module_::import_("concurrent.futures").attr("CancelledError").ptr();
  Py_INCREF(g_cancelled_error);
  m.def("fetch", &fetch, nb::arg("reader"), nb::arg("cache").none(), nb::arg("ids").noconvert(),
        nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
        nb::arg("codec"), nb::arg("dim"), nb::arg("out").noconvert(), nb::arg("acc").noconvert(),
        nb::arg("tier_acc").noconvert(),
        "Rows of per-head ids int64 [N, H] into out [N, H, D] (f32/bf16) or uint8 [N, H, row_bytes], through the "
        "cache (None: no cache) and the reader, in one call without the GIL. Adds (atomically) into acc int64 "
        "[4H + 4] the ids, distinct rows, hits and misses per head, then lookups, pages read, hit rows and miss "
        "rows; into tier_acc int64 [2] rows and pages read. Returns the pages read. IndexError names head and id; "
        "a page that cannot be read raises PageReadError and admits nothing.");
  m.def("warm", &warm, nb::arg("reader"), nb::arg("cache"), nb::arg("ids").noconvert(),
        nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
        nb::arg("codec"), nb::arg("dim"), nb::arg("acc").noconvert(), nb::arg("tier_acc").noconvert(),
        "Read the rows of per-head ids int64 [N, H] that the cache lacks into it (no pins, no probes counted); adds "
        "rows admitted and pages read into acc int64 [2], rows and pages read into tier_acc; returns both.");
  m.def("set_staging_keep_bytes", &set_staging_keep_bytes, nb::arg("bytes"),
        "Test hook: the page bytes a thread's staging buffer keeps (16 MiB); reads of more pages go in chunks of "
        "this size, their rows copied out after each. Returns the previous value.");

  nb::class_<FetchJob>(m, "FetchJob", "A queued fetch or read-ahead; keeps its arrays alive until it ends.")
      .def("done", &FetchJob::done)
      .def_prop_ro("state", &FetchJob::state, "'pending', 'running', 'done' or 'cancelled'.")
      .def("wait", &FetchJob::wait, nb::arg("timeout_s") = -1.0,
           "True once the job ended (timeout_s < 0: wait as long as it takes); the GIL is released meanwhile.")
      .def("result", &FetchJob::result, "Raise the job's error, or CancelledError; nothing if it succeeded.")
      .def("cancel", &FetchJob::cancel,
           "Cancel a queued job (True); a running one is asked to stop at its next phase (returns False).");

  nb::class_<PyFetchQueue>(m, "FetchQueue",
                           "One C++ worker thread running fetches (and read-aheads) in submission order.")
      .def(nb::init<bool>(), nb::arg("background") = false,
           "background: a read-ahead queue; its page reads give way to the reader's other reads (yield_depth).")
      .def("fetch", &submit_fetch, nb::arg("reader"), nb::arg("cache").none(), nb::arg("ids").noconvert(),
           nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
           nb::arg("codec"), nb::arg("dim"), nb::arg("out").noconvert(), nb::arg("acc").noconvert(),
           nb::arg("tier_acc").noconvert(), nb::rv_policy::take_ownership,
           "Queue what fetch() does; argument errors and out-of-range ids (IndexError) raise here, read errors from "
           "the job's result().")
      .def("warm", &submit_warm, nb::arg("reader"), nb::arg("cache"), nb::arg("ids").noconvert(),
           nb::arg("head_offsets").noconvert(), nb::arg("head_rows").noconvert(), nb::arg("rows_per_page"),
           nb::arg("codec"), nb::arg("dim"), nb::arg("acc").noconvert(), nb::arg("tier_acc").noconvert(),
           nb::rv_policy::take_ownership, "Queue what warm() does.")
      .def(
          "marker",
          [](PyFetchQueue &q) {
            auto job = std::make_shared<Job>();
            job->work = [](const std::atomic<bool> *) {};
            return enqueue(q, job, Keep{});
          },
          nb::rv_policy::take_ownership, "A job that does nothing: it ends once every job queued before it has.")
      .def(
          "shutdown",
          [](PyFetchQueue &q, bool cancel_pending) {
            {
              nb::gil_scoped_release release;
              q.shutdown(cancel_pending);
            }
            q.orphans->reap();  // every job has ended now
          },
          nb::arg("cancel_pending") = true,
          "Take no more jobs; cancel the queued ones (or run them first); wait for the running one.")
      .def("hold_next", &PyFetchQueue::hold_next,
           "Test hook: the next job waits, once running, until release_held().")
      .def(
          "wait_held",
          [](PyFetchQueue &q, double timeout_s) {
            nb::gil_scoped_release release;
            return q.wait_held(timeout_s);
          },
          nb::arg("timeout_s"))
      .def("release_held", &PyFetchQueue::release_held);
}

}  // namespace tiergram
