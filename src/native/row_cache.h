// The native row cache: encoded rows of one table in a slot array, a key -> slot index, pins, and an eviction
// policy: LRU, LFU with frequency admission, or lookahead (windowed Belady over announced batches).
//
// It makes the same decisions as the Python reference (tiergram/cache/row_cache.py with the policies of
// tiergram/cache/policies.py), call for call: free slots are handed out in increasing order, a probe observes and
// touches its keys in the order given; an LRU admit takes its victims in one pass over the LRU order (pinned slots
// skipped) before placing any of the call's keys in them, an LFU or lookahead admit asks for one victim per key and
// lets the policy refuse it. A property test drives both with the same operations and compares hits, victims, the
// policy's order and rows bit for bit.
#pragma once

#include <cstdint>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "common.h"

namespace tiergram {

enum class Policy { kLRU, kLFU, kLookahead };
// The policy named "lru", "lfu" or "lookahead"; invalid_argument names the valid ones.
Policy policy_from_name(const std::string &name);
const char *policy_name(Policy p);

class NativeRowCache {
 public:
  NativeRowCache(uint64_t capacity, uint64_t row_bytes, Policy policy = Policy::kLRU);

  uint64_t capacity() const { return capacity_; }
  uint64_t row_bytes() const { return row_bytes_; }
  Policy policy() const { return policy_; }
  uint64_t size();

  // slots[i] = slot of keys[i] or -1; every key is observed, every hit touched and pinned. Counts probes and hits.
  // batch >= 0: the id announce() gave for these keys (lookahead); probing retires it.
  void probe(const int64_t *keys, size_t n, int64_t *slots, int64_t batch = -1);
  // Lookahead: tells the policy the keys [n] a later probe will ask for, in order; returns the batch id (-1 for the
  // other policies, which learn nothing from it).
  int64_t announce(const int64_t *keys, size_t n);
  // Forgets an announced batch that will not be probed (a cancelled prefetch); batch < 0 is ignored.
  void retire(int64_t batch);
  // Announced batches not yet probed or retired.
  uint64_t live_batches();
  // Marks the resident keys of [n] used, in order, as a probe's hits would be (every key observed), without
  // pinning or counting: a preload that admitted rows in file order sets their recency (LRU: the last the most
  // recent). Returns how many were resident.
  uint64_t touch(const int64_t *keys, size_t n);
  // out[i] = 1 if keys[i] is not resident (no pins, nothing counted, no touch).
  void missing(const int64_t *keys, size_t n, uint8_t *out);
  // Offers keys [n] whose encoded rows are at src[i] (row_bytes each); returns how many entered. Duplicates and
  // resident keys are skipped (the first occurrence of a new key counts).
  uint64_t admit(const int64_t *keys, size_t n, const uint8_t *const *src);
  // Releases pins taken by probe (slots < 0 are ignored).
  void unpin(const int64_t *slots, size_t n);

  // The slot array [capacity, row_bytes]; a pinned slot's row does not change until it is unpinned.
  uint8_t *rows() { return rows_.data(); }
  const uint8_t *row(int64_t slot) const { return rows_.data() + static_cast<uint64_t>(slot) * row_bytes_; }
  int32_t *pins() { return pins_.data(); }
  int64_t *slot_keys() { return slot_key_.data(); }

  struct Counters {
    uint64_t probes = 0, hits = 0, admitted = 0, rejected = 0, evicted = 0;
  };
  Counters counters();
  // Resident keys with their slots: LRU least recently used first; LFU in slot order; lookahead idle keys (least
  // recently used first), then parked keys, then planned keys in slot order.
  void order(std::vector<int64_t> &keys, std::vector<int64_t> &slots);
  // Lookahead: (idle keys in LRU order, parked keys in order, planned keys, their next use), for tests.
  void lookahead_state(std::vector<int64_t> &idle, std::vector<int64_t> &held, std::vector<int64_t> &planned,
                       std::vector<int64_t> &next_use);
  // LFU: the count of each key (0 if never seen or aged out).
  std::vector<int64_t> frequencies(const int64_t *keys, size_t n);
  // Throws std::logic_error naming the first broken invariant (index, slot keys, LRU links, pins).
  void check_invariants();

  std::mutex &mutex() { return mu_; }

  // Test hook: the next fetch through this cache stops after its probe (its hits pinned), or the next read-ahead
  // once its keys are marked in flight, until release_held().
  void hold_next_fetch();
  bool wait_held(double timeout_s);  // true once a fetch is held
  void release_held();
  void maybe_hold();  // called by the fetch pipeline after its probe, without the cache lock

  // The lock-held parts, for the fetch pipeline (which takes mutex() itself around them).
  void probe_locked(const int64_t *keys, size_t n, int64_t *slots, int64_t batch = -1);
  int64_t announce_locked(const int64_t *keys, size_t n);
  void retire_locked(int64_t batch);
  uint64_t admit_locked(const int64_t *keys, size_t n, const uint8_t *const *src, bool unique);
  void unpin_locked(const int64_t *slots, size_t n);
  bool contains_locked(int64_t key) const { return find(key) >= 0; }
  // Pins the resident keys of [n] (slots[i] = slot or -1) without counting a probe or observing: for a fetch that
  // waited for rows a read-ahead had in flight, after the probe that counted them.
  void pin_resident_locked(const int64_t *keys, size_t n, int64_t *slots);

  // Reads in flight: keys a read-ahead is reading and has not yet admitted. A fetch that misses one waits for it
  // to land instead of reading its page a second time; a read-ahead skips the keys another has in flight.
  bool any_in_flight_locked() const { return !in_flight_.empty(); }
  bool in_flight_locked(int64_t key) const { return in_flight_.count(key) != 0; }
  void mark_in_flight_locked(const std::vector<int64_t> &keys) { in_flight_.insert(keys.begin(), keys.end()); }
  void land_locked(const std::vector<int64_t> &keys);  // the keys' reads ended (admitted or failed): wakes waiters
  // Waits (the lock held by `lock`, released while waiting) until none of keys [n] is in flight; false if
  // `stop()` became true first (checked every 20 ms).
  template <class Stop>
  bool wait_landed(std::unique_lock<std::mutex> &lock, const int64_t *keys, size_t n, Stop stop) {
    auto landed = [&] {
      for (size_t i = 0; i < n; ++i)
        if (in_flight_.count(keys[i])) return false;
      return true;
    };
    while (!landed()) {
      if (stop()) return false;
      landed_cv_.wait_for(lock, std::chrono::milliseconds(20));
    }
    return true;
  }

 private:
  // Open addressing with linear probing over a power-of-two table; backward-shift deletion (no tombstones).
  int64_t find(int64_t key) const;
  void prefetch_bucket(int64_t key) const { __builtin_prefetch(&index_[home(key)]); }
  // For an erase, which also reads the buckets after the key's: the key's line and, when the key sits in the last
  // two buckets of its line (4 to a line), the next line.
  void prefetch_run(int64_t key) const {
    const size_t h = home(key);
    __builtin_prefetch(&index_[h]);
    __builtin_prefetch(&index_[(h + 2) & hmask_]);
  }
  // find() of keys [n], keys kFindAhead ahead prefetched: out[i] = slot or -1 (the index is DRAM in a large cache).
  void find_all(const int64_t *keys, size_t n, int64_t *out) const;
  void put(int64_t key, int64_t slot);
  void erase(int64_t key);
  size_t home(int64_t key) const {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  // Intrusive lists over slots: sentinel capacity_ heads the LRU list (lookahead: the idle list), capacity_ + 1
  // the lookahead's parked list.
  void link_tail(int64_t slot, int64_t sentinel);
  void link_tail(int64_t slot) { link_tail(slot, static_cast<int64_t>(capacity_)); }
  void unlink(int64_t slot);
  void place(int64_t slot, int64_t key, const uint8_t *src);
  bool pinned_key(int64_t key) const { return pins_[find(key)] > 0; }

  // The policy's hooks, in the reference's terms (keys are global row ids; all but observe/admit_ok see resident
  // keys only). LRU keeps its order in the LRU list alone.
  void p_observe(int64_t key);
  void p_touch(int64_t key, int64_t slot);
  void p_insert(int64_t key, int64_t slot);
  void p_remove(int64_t key, int64_t slot);
  int64_t p_victim();  // a resident unpinned key, or -1
  bool p_admit(int64_t key, int64_t victim);
  void replace(int64_t slot, int64_t key, const uint8_t *src);  // evicts the slot's key, gives the slot to key

  // LFU (TinyLFU-style ageing: counts halve every kDecayEvery observations).
  static constexpr uint64_t kDecayEvery = uint64_t{1} << 20;
  int64_t freq(int64_t key) const {
    auto it = freq_.find(key);
    return it == freq_.end() ? 0 : it->second;
  }
  void lfu_push(int64_t f, int64_t key);
  void lfu_rebuild();

  // Lookahead.
  static constexpr int64_t kNever = int64_t{1} << 62;
  enum : uint8_t { kIdle = 1, kHeld = 2, kPlanned = 3 };
  int64_t next_use(int64_t key);
  void plan(int64_t key, int64_t slot);
  void unpark();
  int64_t la_unpinned();
  void la_push(int64_t neg, int64_t key);
  void la_pop();
  void la_flush();
  void la_compact();

  uint64_t capacity_, row_bytes_;
  Policy policy_;
  HugeVector<uint8_t> rows_;  // the slot array and the index below: on huge pages (random access, see HugeAlloc)
  HugeVector<int64_t> slot_key_;  // -1: free
  HugeVector<int32_t> pins_;
  uint64_t pinned_slots_ = 0;  // slots with pins > 0
  uint64_t next_free_ = 0;     // slots [next_free_, capacity) were never used (slots are never freed again)
  uint64_t resident_ = 0;
  // LRU list over slots: node capacity_ is the sentinel; next_ from it is the least recently used.
  HugeVector<int64_t> prev_, next_;
  // index: key and slot side by side, so a lookup, insert or erase touches one cache line, not two
  struct Bucket {
    int64_t key, slot;  // key -1: empty
  };
  HugeVector<Bucket> index_;
  size_t hmask_ = 0;
  unsigned shift_ = 0;
  Counters counters_;
  std::mutex mu_;
  std::unordered_set<int64_t> in_flight_;
  std::condition_variable landed_cv_;

  // LFU: count per key seen (resident or not), min-heap of (count when pushed, key), stale entries skipped.
  std::unordered_map<int64_t, int64_t> freq_;
  std::vector<std::pair<int64_t, int64_t>> lfu_heap_;
  uint64_t ticks_ = 0;

  // Lookahead: announced uses per key (batch << 32 | index, in order), live batches, per-slot state and next use,
  // a max-heap on next use (as a min-heap of (-next use, key)), and the heap entries parked until the next probe.
  struct Uses {  // a queue of positions: v[head..] (a deque costs two allocations per key; most keys have 1-2 uses)
    std::vector<int64_t> v;
    size_t head = 0;
  };
  std::unordered_map<int64_t, Uses> uses_;
  std::unordered_map<int64_t, std::vector<int64_t>> batches_;
  int64_t next_batch_ = 0;
  std::vector<uint8_t> state_;
  std::vector<int64_t> planned_;
  std::vector<std::pair<int64_t, int64_t>> la_heap_, held_plans_;
  // Entries filed outside a victim search wait here and join the heap when one starts: a push of a later use
  // sifts to the root (log n cache misses in a large heap), and most entries go stale before any eviction.
  std::vector<std::pair<int64_t, int64_t>> la_pending_;
  bool la_searching_ = false;

  enum class Hold { kNone, kArmed, kHeld, kReleased };
  std::mutex hold_mu_;
  std::condition_variable hold_cv_;
  Hold hold_ = Hold::kNone;
};

}  // namespace tiergram
