// The native row cache: encoded rows of one table in a slot array, a key -> slot index, LRU order, pins.
//
// It makes the same decisions as the Python reference (tiergram/cache/row_cache.py with the LRU policy), call for
// call: free slots are handed out in increasing order, a probe touches its hits in the order given, an admit takes
// its victims in one pass over the LRU order (pinned slots skipped) before placing any of the call's keys in them.
// A property test drives both with the same operations and compares hits, victims and rows bit for bit.
#pragma once

#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <vector>

namespace tiergram {

class NativeRowCache {
 public:
  NativeRowCache(uint64_t capacity, uint64_t row_bytes);

  uint64_t capacity() const { return capacity_; }
  uint64_t row_bytes() const { return row_bytes_; }
  uint64_t size();

  // slots[i] = slot of keys[i] or -1; every hit is touched (LRU) and pinned. Counts probes and hits.
  void probe(const int64_t *keys, size_t n, int64_t *slots);
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
  // Resident keys, least recently used first, with their slots.
  void order(std::vector<int64_t> &keys, std::vector<int64_t> &slots);
  // Throws std::logic_error naming the first broken invariant (index, slot keys, LRU links, pins).
  void check_invariants();

  std::mutex &mutex() { return mu_; }

  // Test hook: the next fetch through this cache stops after its probe (its hits pinned) until release_held().
  void hold_next_fetch();
  bool wait_held(double timeout_s);  // true once a fetch is held
  void release_held();
  void maybe_hold();  // called by the fetch pipeline after its probe, without the cache lock

  // The lock-held parts, for the fetch pipeline (which takes mutex() itself around them).
  void probe_locked(const int64_t *keys, size_t n, int64_t *slots);
  uint64_t admit_locked(const int64_t *keys, size_t n, const uint8_t *const *src, bool unique);
  void unpin_locked(const int64_t *slots, size_t n);
  bool contains_locked(int64_t key) const { return find(key) >= 0; }

 private:
  // Open addressing with linear probing over a power-of-two table; backward-shift deletion (no tombstones).
  int64_t find(int64_t key) const;
  void put(int64_t key, int64_t slot);
  void erase(int64_t key);
  size_t home(int64_t key) const {
    return static_cast<size_t>((static_cast<uint64_t>(key) * 0x9E3779B97F4A7C15ull) >> shift_);
  }

  void link_tail(int64_t slot);
  void unlink(int64_t slot);
  void place(int64_t slot, int64_t key, const uint8_t *src);

  uint64_t capacity_, row_bytes_;
  std::vector<uint8_t> rows_;
  std::vector<int64_t> slot_key_;  // -1: free
  std::vector<int32_t> pins_;
  uint64_t pinned_slots_ = 0;  // slots with pins > 0
  uint64_t next_free_ = 0;     // slots [next_free_, capacity) were never used (slots are never freed again)
  uint64_t resident_ = 0;
  // LRU list over slots: node capacity_ is the sentinel; next_ from it is the least recently used.
  std::vector<int64_t> prev_, next_;
  // index
  std::vector<int64_t> hkeys_, hslots_;
  size_t hmask_ = 0;
  unsigned shift_ = 0;
  Counters counters_;
  std::mutex mu_;

  enum class Hold { kNone, kArmed, kHeld, kReleased };
  std::mutex hold_mu_;
  std::condition_variable hold_cv_;
  Hold hold_ = Hold::kNone;
};

}  // namespace tiergram
