// The native row cache (see row_cache.h): LRU over a slot array, with the Python reference's decisions.
#include "row_cache.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace tiergram {

NativeRowCache::NativeRowCache(uint64_t capacity, uint64_t row_bytes) : capacity_(capacity), row_bytes_(row_bytes) {
  if (capacity < 1) throw std::invalid_argument("cache capacity must be at least one row, got " + std::to_string(capacity));
  if (row_bytes < 1 || row_bytes > (1u << 30)) throw std::invalid_argument("row_bytes must be in [1, 2^30]");
  if (capacity > (uint64_t{1} << 40) / row_bytes)
    throw std::invalid_argument("cache of " + std::to_string(capacity) + " rows of " + std::to_string(row_bytes) +
                                " bytes is larger than 1 TiB");
  rows_.assign(capacity * row_bytes, 0);
  slot_key_.assign(capacity, -1);
  pins_.assign(capacity, 0);
  prev_.assign(capacity + 1, static_cast<int64_t>(capacity));
  next_.assign(capacity + 1, static_cast<int64_t>(capacity));
  size_t buckets = 16;
  while (buckets < 2 * capacity) buckets <<= 1;  // load factor <= 0.5: short probe runs
  hkeys_.assign(buckets, -1);
  hslots_.assign(buckets, -1);
  hmask_ = buckets - 1;
  shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(buckets));
}

uint64_t NativeRowCache::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return resident_;
}

int64_t NativeRowCache::find(int64_t key) const {
  for (size_t i = home(key);; i = (i + 1) & hmask_) {
    if (hkeys_[i] == key) return hslots_[i];
    if (hkeys_[i] < 0) return -1;
  }
}

void NativeRowCache::put(int64_t key, int64_t slot) {
  size_t i = home(key);
  while (hkeys_[i] >= 0) i = (i + 1) & hmask_;
  hkeys_[i] = key;
  hslots_[i] = slot;
  ++resident_;
}

void NativeRowCache::erase(int64_t key) {
  size_t i = home(key);
  while (hkeys_[i] != key) i = (i + 1) & hmask_;
  // Backward shift: move later entries of the run into the hole when their home allows it.
  for (size_t j = (i + 1) & hmask_; hkeys_[j] >= 0; j = (j + 1) & hmask_) {
    const size_t h = home(hkeys_[j]);
    // the entry at j may move to i if i lies cyclically in [h, j)
    if (((j - h) & hmask_) >= ((j - i) & hmask_)) {
      hkeys_[i] = hkeys_[j];
      hslots_[i] = hslots_[j];
      i = j;
    }
  }
  hkeys_[i] = -1;
  hslots_[i] = -1;
  --resident_;
}

void NativeRowCache::link_tail(int64_t slot) {
  const int64_t s = static_cast<int64_t>(capacity_);
  const int64_t last = prev_[s];
  next_[last] = slot;
  prev_[slot] = last;
  next_[slot] = s;
  prev_[s] = slot;
}

void NativeRowCache::unlink(int64_t slot) {
  next_[prev_[slot]] = next_[slot];
  prev_[next_[slot]] = prev_[slot];
}

void NativeRowCache::place(int64_t slot, int64_t key, const uint8_t *src) {
  std::memcpy(rows_.data() + static_cast<uint64_t>(slot) * row_bytes_, src, row_bytes_);
  slot_key_[slot] = key;
}

void NativeRowCache::probe_locked(const int64_t *keys, size_t n, int64_t *slots) {
  uint64_t hits = 0;
  constexpr size_t kAhead = 8;  // index buckets in flight: a large cache's index is DRAM-latency bound
  for (size_t i = 0; i < std::min(n, kAhead); ++i) __builtin_prefetch(&hkeys_[home(keys[i])]);
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) __builtin_prefetch(&hkeys_[home(keys[i + kAhead])]);
    const int64_t slot = find(keys[i]);
    slots[i] = slot;
    if (slot < 0) continue;
    ++hits;
    unlink(slot);  // touch: most recently used
    link_tail(slot);
    if (pins_[slot]++ == 0) ++pinned_slots_;
  }
  counters_.probes += n;
  counters_.hits += hits;
}

void NativeRowCache::probe(const int64_t *keys, size_t n, int64_t *slots) {
  std::lock_guard<std::mutex> lock(mu_);
  probe_locked(keys, n, slots);
}

void NativeRowCache::missing(const int64_t *keys, size_t n, uint8_t *out) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) out[i] = find(keys[i]) < 0;
}

uint64_t NativeRowCache::admit_locked(const int64_t *keys, size_t n, const uint8_t *const *src, bool unique) {
  std::vector<size_t> fresh;  // positions of the call's new keys, first occurrence, in call order
  fresh.reserve(n);
  if (unique) {
    for (size_t i = 0; i < n; ++i)
      if (find(keys[i]) < 0) fresh.push_back(i);
  } else {
    std::unordered_set<int64_t> seen;
    for (size_t i = 0; i < n; ++i)
      if (find(keys[i]) < 0 && seen.insert(keys[i]).second) fresh.push_back(i);
  }
  const size_t n_free = std::min<size_t>(fresh.size(), capacity_ - next_free_);
  for (size_t k = 0; k < n_free; ++k) {
    const int64_t slot = static_cast<int64_t>(next_free_++);
    put(keys[fresh[k]], slot);
    link_tail(slot);
    place(slot, keys[fresh[k]], src[fresh[k]]);
  }
  const size_t rest = fresh.size() - n_free;
  if (rest > 0) {
    if (pinned_slots_ == capacity_) {
      counters_.rejected += rest;  // no victim can exist
    } else {
      // Every victim in one pass over the LRU order before any is replaced (so the call's own later keys are
      // never victims of each other), skipping pinned slots.
      std::vector<int64_t> victims;
      victims.reserve(rest);
      const int64_t s = static_cast<int64_t>(capacity_);
      for (int64_t v = next_[s]; v != s && victims.size() < rest; v = next_[v])
        if (pins_[v] == 0) victims.push_back(v);
      counters_.rejected += rest - victims.size();
      for (size_t j = 0; j < victims.size(); ++j) {
        const int64_t slot = victims[j];
        const size_t i = fresh[n_free + j];
        erase(slot_key_[slot]);
        unlink(slot);
        ++counters_.evicted;
        put(keys[i], slot);
        link_tail(slot);
        place(slot, keys[i], src[i]);
      }
    }
  }
  uint64_t entered = 0;  // a key placed early in the call may have been a later key's victim
  for (size_t i : fresh) entered += find(keys[i]) >= 0;
  counters_.admitted += entered;
  return entered;
}

uint64_t NativeRowCache::admit(const int64_t *keys, size_t n, const uint8_t *const *src) {
  std::lock_guard<std::mutex> lock(mu_);
  return admit_locked(keys, n, src, false);
}

void NativeRowCache::unpin_locked(const int64_t *slots, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    if (pins_[slot]-- == 1) --pinned_slots_;
  }
}

void NativeRowCache::unpin(const int64_t *slots, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (slots[i] >= static_cast<int64_t>(capacity_))
      throw std::out_of_range("slot " + std::to_string(slots[i]) + " at index " + std::to_string(i) +
                              " is outside the cache's " + std::to_string(capacity_) + " slots");
  std::lock_guard<std::mutex> lock(mu_);
  unpin_locked(slots, n);
}

NativeRowCache::Counters NativeRowCache::counters() {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

void NativeRowCache::order(std::vector<int64_t> &keys, std::vector<int64_t> &slots) {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t s = static_cast<int64_t>(capacity_);
  for (int64_t v = next_[s]; v != s; v = next_[v]) {
    keys.push_back(slot_key_[v]);
    slots.push_back(v);
  }
}

void NativeRowCache::hold_next_fetch() {
  std::lock_guard<std::mutex> lock(hold_mu_);
  hold_ = Hold::kArmed;
}

bool NativeRowCache::wait_held(double timeout_s) {
  std::unique_lock<std::mutex> lock(hold_mu_);
  return hold_cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return hold_ == Hold::kHeld; });
}

void NativeRowCache::release_held() {
  std::lock_guard<std::mutex> lock(hold_mu_);
  if (hold_ == Hold::kHeld) hold_ = Hold::kReleased;
  else hold_ = Hold::kNone;  // armed but never reached: disarm
  hold_cv_.notify_all();
}

void NativeRowCache::maybe_hold() {
  std::unique_lock<std::mutex> lock(hold_mu_);
  if (hold_ != Hold::kArmed) return;
  hold_ = Hold::kHeld;
  hold_cv_.notify_all();
  hold_cv_.wait(lock, [&] { return hold_ == Hold::kReleased; });
  hold_ = Hold::kNone;
}

void NativeRowCache::check_invariants() {
  std::lock_guard<std::mutex> lock(mu_);
  auto fail = [](const std::string &what) { throw std::logic_error("native row cache invariant broken: " + what); };
  uint64_t linked = 0, pinned = 0;
  const int64_t s = static_cast<int64_t>(capacity_);
  for (int64_t v = next_[s]; v != s; v = next_[v]) {
    if (++linked > capacity_) fail("LRU list has a cycle");
    if (slot_key_[v] < 0) fail("free slot " + std::to_string(v) + " in the LRU list");
    if (find(slot_key_[v]) != v) fail("slot " + std::to_string(v) + " key not indexed to it");
    if (next_[prev_[v]] != v) fail("LRU links disagree at slot " + std::to_string(v));
  }
  if (linked != resident_) fail("LRU list holds " + std::to_string(linked) + " slots, index " + std::to_string(resident_));
  if (resident_ + (capacity_ - next_free_) != capacity_) fail("resident + free != capacity");
  for (uint64_t v = 0; v < capacity_; ++v) {
    if (pins_[v] < 0) fail("slot " + std::to_string(v) + " has negative pins");
    pinned += pins_[v] > 0;
  }
  if (pinned != pinned_slots_) fail("pinned slot count out of date");
}

}  // namespace tiergram
