// The native row cache (see row_cache.h): LRU, LFU or lookahead over a slot array, with the Python reference's
// decisions.
#include "row_cache.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <stdexcept>
#include <string>
#include <unordered_set>

namespace tiergram {

Policy policy_from_name(const std::string &name) {
  if (name == "lru") return Policy::kLRU;
  if (name == "lfu") return Policy::kLFU;
  if (name == "lookahead") return Policy::kLookahead;
  throw std::invalid_argument("unknown cache policy '" + name + "' (valid: lru, lfu, lookahead)");
}

const char *policy_name(Policy p) {
  switch (p) {
    case Policy::kLRU: return "lru";
    case Policy::kLFU: return "lfu";
    default: return "lookahead";
  }
}

NativeRowCache::NativeRowCache(uint64_t capacity, uint64_t row_bytes, Policy policy)
    : capacity_(capacity), row_bytes_(row_bytes), policy_(policy) {
  if (capacity < 1) throw std::invalid_argument("cache capacity must be at least one row, got " + std::to_string(capacity));
  if (row_bytes < 1 || row_bytes > (1u << 30)) throw std::invalid_argument("row_bytes must be in [1, 2^30]");
  if (capacity > (uint64_t{1} << 40) / row_bytes)
    throw std::invalid_argument("cache of " + std::to_string(capacity) + " rows of " + std::to_string(row_bytes) +
                                " bytes is larger than 1 TiB");
  rows_.assign(capacity * row_bytes, 0);
  slot_key_.assign(capacity, -1);
  pins_.assign(capacity, 0);
  // two list sentinels: capacity (LRU / idle) and capacity + 1 (parked)
  prev_.assign(capacity + 2, 0);
  next_.assign(capacity + 2, 0);
  for (int64_t s : {static_cast<int64_t>(capacity), static_cast<int64_t>(capacity + 1)}) prev_[s] = next_[s] = s;
  if (policy == Policy::kLookahead) {
    state_.assign(capacity, 0);
    planned_.assign(capacity, -1);
  }
  size_t buckets = 16;
  while (buckets < 2 * capacity) buckets <<= 1;  // load factor <= 0.5: short probe runs
  index_.assign(buckets, Bucket{-1, -1});
  hmask_ = buckets - 1;
  shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(buckets));
}

uint64_t NativeRowCache::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return resident_;
}

int64_t NativeRowCache::find(int64_t key) const {
  for (size_t i = home(key);; i = (i + 1) & hmask_) {
    if (index_[i].key == key) return index_[i].slot;
    if (index_[i].key < 0) return -1;
  }
}

void NativeRowCache::find_all(const int64_t *keys, size_t n, int64_t *out) const {
  constexpr size_t kFindAhead = 16;
  for (size_t i = 0; i < std::min(n, kFindAhead); ++i) prefetch_bucket(keys[i]);
  for (size_t i = 0; i < n; ++i) {
    if (i + kFindAhead < n) prefetch_bucket(keys[i + kFindAhead]);
    out[i] = find(keys[i]);
  }
}

void NativeRowCache::put(int64_t key, int64_t slot) {
  size_t i = home(key);
  while (index_[i].key >= 0) i = (i + 1) & hmask_;
  index_[i] = {key, slot};
  ++resident_;
}

void NativeRowCache::erase(int64_t key) {
  size_t i = home(key);
  while (index_[i].key != key) i = (i + 1) & hmask_;
  // Backward shift: move later entries of the run into the hole when their home allows it.
  for (size_t j = (i + 1) & hmask_; index_[j].key >= 0; j = (j + 1) & hmask_) {
    const size_t h = home(index_[j].key);
    // the entry at j may move to i if i lies cyclically in [h, j)
    if (((j - h) & hmask_) >= ((j - i) & hmask_)) {
      index_[i] = index_[j];
      i = j;
    }
  }
  index_[i] = {-1, -1};
  --resident_;
}

void NativeRowCache::link_tail(int64_t slot, int64_t s) {
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

void NativeRowCache::probe_locked(const int64_t *keys, size_t n, int64_t *slots, int64_t batch) {
  uint64_t hits = 0;
  // A hit's LRU touch reads and writes its slot's links and its two neighbours' (random lines of arrays larger
  // than L2): ~5 cache misses a key when done one key after another. So the work is pipelined with prefetches:
  // index buckets kIndexAhead keys ahead, the slot (find) and its links and pin kSlotAhead ahead, the neighbours'
  // links kLinkAhead ahead. find() reads only the index, which a probe never changes, so slots can be found
  // ahead of the policy's steps; a neighbour prefetched from links that a touch in between changes is only a
  // wasted hint. The decisions stay the reference's, key by key, in order.
  constexpr size_t kIndexAhead = 16, kSlotAhead = 8, kLinkAhead = 4;
  auto find_ahead = [&](size_t j) {
    const int64_t s = slots[j] = find(keys[j]);
    if (s >= 0) {
      __builtin_prefetch(&prev_[s], 1);
      __builtin_prefetch(&next_[s], 1);
      __builtin_prefetch(&pins_[s], 1);
    }
  };
  for (size_t i = 0; i < std::min(n, kIndexAhead); ++i) prefetch_bucket(keys[i]);
  for (size_t i = 0; i < std::min(n, kSlotAhead); ++i) find_ahead(i);
  for (size_t i = 0; i < n; ++i) {
    if (i + kIndexAhead < n) prefetch_bucket(keys[i + kIndexAhead]);
    if (i + kSlotAhead < n) find_ahead(i + kSlotAhead);
    if (i + kLinkAhead < n && slots[i + kLinkAhead] >= 0) {
      const int64_t s = slots[i + kLinkAhead];
      __builtin_prefetch(&next_[prev_[s]], 1);
      __builtin_prefetch(&prev_[next_[s]], 1);
    }
    if (policy_ != Policy::kLRU) p_observe(keys[i]);
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    ++hits;
    p_touch(keys[i], slot);
    if (pins_[slot]++ == 0) ++pinned_slots_;
  }
  if (batch >= 0) retire_locked(batch);
  counters_.probes += n;
  counters_.hits += hits;
}

void NativeRowCache::probe(const int64_t *keys, size_t n, int64_t *slots, int64_t batch) {
  std::lock_guard<std::mutex> lock(mu_);
  probe_locked(keys, n, slots, batch);
}

uint64_t NativeRowCache::touch(const int64_t *keys, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t resident = 0;
  for (size_t i = 0; i < n; ++i) {
    if (policy_ != Policy::kLRU) p_observe(keys[i]);
    const int64_t slot = find(keys[i]);
    if (slot < 0) continue;
    ++resident;
    p_touch(keys[i], slot);
  }
  return resident;
}

int64_t NativeRowCache::announce(const int64_t *keys, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  return announce_locked(keys, n);
}

void NativeRowCache::retire(int64_t batch) {
  std::lock_guard<std::mutex> lock(mu_);
  retire_locked(batch);
}

uint64_t NativeRowCache::live_batches() {
  std::lock_guard<std::mutex> lock(mu_);
  return batches_.size();
}

// ---- the policies ----------------------------------------------------------------------------------------

void NativeRowCache::p_observe(int64_t key) {
  if (policy_ == Policy::kLFU) {
    ++freq_[key];
    if (++ticks_ % kDecayEvery == 0) {  // age: halve every count, forget the ones that reach 0 or 1 -> 0
      for (auto it = freq_.begin(); it != freq_.end();) {
        if (it->second > 1) {
          it->second /= 2;
          ++it;
        } else {
          it = freq_.erase(it);
        }
      }
      lfu_rebuild();
    }
  } else if (policy_ == Policy::kLookahead) {
    // accesses are learnt from announced batches; a new probe returns parked keys to the candidates
    const int64_t hs = static_cast<int64_t>(capacity_ + 1);
    if (next_[hs] != hs || !held_plans_.empty()) unpark();
  }
}

void NativeRowCache::p_touch(int64_t key, int64_t slot) {
  switch (policy_) {
    case Policy::kLRU:
      unlink(slot);  // most recently used
      link_tail(slot);
      break;
    case Policy::kLFU:
      lfu_push(freq(key), key);
      if (lfu_heap_.size() > 4 * resident_ + 64) lfu_rebuild();
      break;
    case Policy::kLookahead:
      if (state_[slot] == kIdle || state_[slot] == kHeld) {
        unlink(slot);
        link_tail(slot);
        state_[slot] = kIdle;
      }
      break;
  }
}

void NativeRowCache::p_insert(int64_t key, int64_t slot) {
  switch (policy_) {
    case Policy::kLRU: link_tail(slot); break;
    case Policy::kLFU: lfu_push(freq(key), key); break;
    case Policy::kLookahead: plan(key, slot); break;
  }
}

void NativeRowCache::p_remove(int64_t, int64_t slot) {
  if (policy_ == Policy::kLRU) {
    unlink(slot);
  } else if (policy_ == Policy::kLookahead) {
    if (state_[slot] == kIdle || state_[slot] == kHeld) unlink(slot);
    state_[slot] = 0;
    planned_[slot] = -1;
  }  // LFU: residency is the index's; stale heap entries are skipped
}

bool NativeRowCache::p_admit(int64_t key, int64_t victim) {
  if (victim < 0) return true;
  if (policy_ == Policy::kLFU) return freq(key) > freq(victim);
  if (policy_ == Policy::kLookahead) return next_use(key) <= next_use(victim);
  return true;
}

int64_t NativeRowCache::p_victim() {
  if (policy_ == Policy::kLFU) {
    // the unpinned resident key with the lowest count; pinned entries are put back after
    std::vector<std::pair<int64_t, int64_t>> skipped;
    int64_t found = -1;
    while (!lfu_heap_.empty()) {
      const auto top = lfu_heap_.front();
      const int64_t slot = find(top.second);
      if (slot < 0 || top.first != freq(top.second)) {
        std::pop_heap(lfu_heap_.begin(), lfu_heap_.end(), std::greater<>());
        lfu_heap_.pop_back();
      } else if (pins_[slot] > 0) {
        std::pop_heap(lfu_heap_.begin(), lfu_heap_.end(), std::greater<>());
        lfu_heap_.pop_back();
        skipped.push_back(top);
      } else {
        found = top.second;
        break;
      }
    }
    for (const auto &e : skipped) lfu_push(e.first, e.second);
    return found;
  }
  // lookahead: an idle key (LRU first), else the planned key used furthest ahead; keys met pinned are parked
  // until the next probe, and looked at once more only when nothing else is left
  la_flush();
  la_searching_ = true;
  int64_t found = la_unpinned();
  const int64_t hs = static_cast<int64_t>(capacity_ + 1);
  if (found < 0 && (next_[hs] != hs || !held_plans_.empty())) {
    unpark();
    found = la_unpinned();
  }
  la_searching_ = false;
  return found;
}

void NativeRowCache::lfu_push(int64_t f, int64_t key) {
  lfu_heap_.emplace_back(f, key);
  std::push_heap(lfu_heap_.begin(), lfu_heap_.end(), std::greater<>());
}

void NativeRowCache::lfu_rebuild() {
  lfu_heap_.clear();
  for (uint64_t slot = 0; slot < next_free_; ++slot) lfu_heap_.emplace_back(freq(slot_key_[slot]), slot_key_[slot]);
  std::make_heap(lfu_heap_.begin(), lfu_heap_.end(), std::greater<>());
}

int64_t NativeRowCache::next_use(int64_t key) {
  auto it = uses_.find(key);
  if (it == uses_.end()) return kNever;
  Uses &q = it->second;
  while (q.head < q.v.size() && batches_.find(q.v[q.head] >> 32) == batches_.end()) ++q.head;  // retired uses
  if (q.head == q.v.size()) {
    uses_.erase(it);
    return kNever;
  }
  if (q.head >= 8 && 2 * q.head >= q.v.size()) {  // drop the retired prefix now and then (amortised O(1))
    q.v.erase(q.v.begin(), q.v.begin() + static_cast<std::ptrdiff_t>(q.head));
    q.head = 0;
  }
  return q.v[q.head];
}

void NativeRowCache::la_push(int64_t neg, int64_t key) {
  if (la_searching_) {
    la_heap_.emplace_back(neg, key);
    std::push_heap(la_heap_.begin(), la_heap_.end(), std::greater<>());
  } else {
    la_pending_.emplace_back(neg, key);
  }
  // Every announce and probe re-files resident keys; without evictions nothing pops the stale entries.
  if (la_heap_.size() + la_pending_.size() > 4 * resident_ + 64) la_compact();
}

void NativeRowCache::la_flush() {
  if (la_pending_.empty()) return;
  if (8 * la_pending_.size() > la_heap_.size()) {
    la_heap_.insert(la_heap_.end(), la_pending_.begin(), la_pending_.end());
    std::make_heap(la_heap_.begin(), la_heap_.end(), std::greater<>());
  } else {
    for (const auto &e : la_pending_) {
      la_heap_.push_back(e);
      std::push_heap(la_heap_.begin(), la_heap_.end(), std::greater<>());
    }
  }
  la_pending_.clear();
}

// Drops stale and duplicate entries (the victim search skips both: no decision changes).
void NativeRowCache::la_compact() {
  la_heap_.insert(la_heap_.end(), la_pending_.begin(), la_pending_.end());
  la_pending_.clear();
  std::vector<uint8_t> kept(capacity_, 0);  // a valid entry per slot is kept once (its copies are equal)
  auto drop = [&](const std::pair<int64_t, int64_t> &e) {
    const int64_t slot = find(e.second);
    if (slot < 0 || state_[slot] != kPlanned || planned_[slot] != -e.first || kept[slot]) return true;
    kept[slot] = 1;
    return false;
  };
  la_heap_.erase(std::remove_if(la_heap_.begin(), la_heap_.end(), drop), la_heap_.end());
  std::make_heap(la_heap_.begin(), la_heap_.end(), std::greater<>());
}

void NativeRowCache::la_pop() {
  std::pop_heap(la_heap_.begin(), la_heap_.end(), std::greater<>());
  la_heap_.pop_back();
}

// Files a resident key by its next use: idle (no known use; appended to the idle list unless there already) or
// planned (pushed on the heap).
void NativeRowCache::plan(int64_t key, int64_t slot) {
  const int64_t nu = next_use(key);
  uint8_t st = state_[slot];
  if (st == kHeld) {
    unlink(slot);
    st = 0;
  }
  if (nu == kNever) {
    if (st != kIdle) link_tail(slot);
    state_[slot] = kIdle;
    planned_[slot] = -1;
  } else {
    if (st == kIdle) unlink(slot);
    state_[slot] = kPlanned;
    planned_[slot] = nu;
    la_push(-nu, key);
  }
}

void NativeRowCache::unpark() {
  const int64_t hs = static_cast<int64_t>(capacity_ + 1);
  while (next_[hs] != hs) {  // pinned by a lookup a moment ago: the most recently used idle keys
    const int64_t slot = next_[hs];
    unlink(slot);
    link_tail(slot);
    state_[slot] = kIdle;
  }
  for (const auto &e : held_plans_) la_push(e.first, e.second);  // entries gone stale meanwhile are skipped
  held_plans_.clear();
}

int64_t NativeRowCache::la_unpinned() {
  const int64_t s = static_cast<int64_t>(capacity_), hs = s + 1;
  while (next_[s] != s) {
    const int64_t slot = next_[s];
    if (pins_[slot] == 0) return slot_key_[slot];
    unlink(slot);
    link_tail(slot, hs);
    state_[slot] = kHeld;
  }
  while (!la_heap_.empty()) {
    const auto top = la_heap_.front();
    const int64_t key = top.second, slot = find(key);
    if (slot < 0 || state_[slot] != kPlanned || planned_[slot] != -top.first) {
      la_pop();  // stale: evicted or re-planned since
    } else if (next_use(key) != -top.first) {
      la_pop();
      plan(key, slot);  // its batch retired since: re-file it (it may have become idle)
      if (state_[slot] == kIdle && pins_[slot] == 0) return key;
    } else if (pins_[slot] > 0) {
      held_plans_.push_back(top);
      la_pop();
    } else {
      return key;
    }
  }
  for (int64_t v = next_[s]; v != s; v = next_[v])
    if (pins_[v] == 0) return slot_key_[v];
  return -1;
}

int64_t NativeRowCache::announce_locked(const int64_t *keys, size_t n) {
  if (policy_ != Policy::kLookahead) return -1;
  if (n >= (uint64_t{1} << 32)) throw std::invalid_argument("an announced batch of " + std::to_string(n) +
                                                             " keys is over 2^32");
  const int64_t batch = next_batch_++;
  batches_.emplace(batch, std::vector<int64_t>(keys, keys + n));
  if (uses_.bucket_count() < uses_.size() + n) uses_.reserve(uses_.size() + n);  // one rehash, not several
  constexpr size_t kAhead = 8;  // index buckets in flight (as probe)
  for (size_t i = 0; i < std::min(n, kAhead); ++i) prefetch_bucket(keys[i]);
  for (size_t i = 0; i < n; ++i) {
    if (i + kAhead < n) prefetch_bucket(keys[i + kAhead]);
    uses_[keys[i]].v.push_back(batch << 32 | static_cast<int64_t>(i));
    const int64_t slot = find(keys[i]);
    if (slot >= 0 && (state_[slot] == kIdle || state_[slot] == kHeld)) plan(keys[i], slot);
  }
  return batch;
}

void NativeRowCache::retire_locked(int64_t batch) {
  if (batch < 0) return;
  auto it = batches_.find(batch);
  if (it == batches_.end()) return;
  const std::vector<int64_t> keys = std::move(it->second);
  batches_.erase(it);
  for (int64_t k : keys) {
    const int64_t slot = find(k);
    if (slot >= 0 && state_[slot] == kPlanned) plan(k, slot);
    else next_use(k);  // drops the retired uses (the reference does so lazily; the answers are the same), so that
                       // keys announced and never cached do not pile up
  }
}

void NativeRowCache::missing(const int64_t *keys, size_t n, uint8_t *out) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) out[i] = find(keys[i]) < 0;
}

void NativeRowCache::replace(int64_t slot, int64_t key, const uint8_t *src) {
  const int64_t victim = slot_key_[slot];
  erase(victim);
  p_remove(victim, slot);
  ++counters_.evicted;
  put(key, slot);
  place(slot, key, src);
  p_insert(key, slot);
}

uint64_t NativeRowCache::admit_locked(const int64_t *keys, size_t n, const uint8_t *const *src, bool unique) {
  std::vector<size_t> fresh;  // positions of the call's new keys, first occurrence, in call order
  fresh.reserve(n);
  std::vector<int64_t> found(n);
  find_all(keys, n, found.data());
  if (unique) {
    for (size_t i = 0; i < n; ++i)
      if (found[i] < 0) fresh.push_back(i);
  } else {
    std::unordered_set<int64_t> seen;
    for (size_t i = 0; i < n; ++i)
      if (found[i] < 0 && seen.insert(keys[i]).second) fresh.push_back(i);
  }
  const size_t n_free = std::min<size_t>(fresh.size(), capacity_ - next_free_);
  const uint64_t first_free = next_free_;
  int64_t entered_lru = -1;  // LRU: how many of the call's keys are resident at its end, counted on the way
  for (size_t k = 0; k < n_free; ++k) {
    if (k + 8 < n_free) prefetch_bucket(keys[fresh[k + 8]]);
    const int64_t slot = static_cast<int64_t>(next_free_++);
    put(keys[fresh[k]], slot);
    place(slot, keys[fresh[k]], src[fresh[k]]);
    p_insert(keys[fresh[k]], slot);
  }
  const size_t rest = fresh.size() - n_free;
  if (rest > 0 && pinned_slots_ == capacity_) {
    counters_.rejected += rest;  // no victim can exist
  } else if (rest > 0 && policy_ == Policy::kLRU) {
    // Every victim in one pass over the LRU order before any is replaced (so the call's own later keys are
    // never victims of each other), skipping pinned slots.
    std::vector<int64_t> victims, victim_keys;  // slots, their keys (read here: the walk visits the slots anyway)
    victims.reserve(rest);
    victim_keys.reserve(rest);
    const int64_t s = static_cast<int64_t>(capacity_);
    for (int64_t v = next_[s]; v != s && victims.size() < rest; v = next_[v])
      if (pins_[v] == 0) {
        victims.push_back(v);
        victim_keys.push_back(slot_key_[v]);
      }
    counters_.rejected += rest - victims.size();
    // a victim that was a free slot this call filled evicts one of the call's own keys (the walk reaches those
    // only when the cache holds fewer slots than the call has keys); no other of the call's keys is a victim
    entered_lru = static_cast<int64_t>(n_free + victims.size());
    for (const int64_t v : victims)
      entered_lru -= static_cast<uint64_t>(v) >= first_free && static_cast<uint64_t>(v) < first_free + n_free;
    // A large cache's index and slots are DRAM: the buckets and row of replacement j are requested kAhead steps
    // before it runs. (No helper lambda: GCC 12 -O3 emitted none of the prefetches of the one this loop had.)
    constexpr size_t kAhead = 16;
    const size_t n_victims = victims.size();
    for (size_t j = 0; j < n_victims + kAhead; ++j) {
      if (j < n_victims) {
        const int64_t v = victims[j];
        prefetch_run(victim_keys[j]);
        prefetch_bucket(keys[fresh[n_free + j]]);
        __builtin_prefetch(rows_.data() + static_cast<uint64_t>(v) * row_bytes_, 1);
      }
      if (j >= kAhead) {
        const size_t k = j - kAhead, i = fresh[n_free + k];
        replace(victims[k], keys[i], src[i]);
      }
    }
  } else if (rest > 0) {
    // LFU / lookahead: one victim per key, which the policy may refuse to give up for it
    for (size_t j = n_free; j < fresh.size(); ++j) {
      const size_t i = fresh[j];
      const int64_t victim = p_victim();
      if (victim < 0 || !p_admit(keys[i], victim)) {
        ++counters_.rejected;
      } else {
        replace(find(victim), keys[i], src[i]);
      }
    }
  }
  uint64_t entered = 0;  // a key placed early in the call may have been a later key's victim
  if (policy_ == Policy::kLRU) {  // counted above when it evicted; else only the free slots took keys
    entered = entered_lru >= 0 ? static_cast<uint64_t>(entered_lru) : n_free;
  } else {
    std::vector<int64_t> fresh_keys(fresh.size());
    for (size_t k = 0; k < fresh.size(); ++k) fresh_keys[k] = keys[fresh[k]];
    find_all(fresh_keys.data(), fresh_keys.size(), found.data());
    for (size_t k = 0; k < fresh.size(); ++k) entered += found[k] >= 0;
  }
  counters_.admitted += entered;
  return entered;
}

uint64_t NativeRowCache::admit(const int64_t *keys, size_t n, const uint8_t *const *src) {
  std::lock_guard<std::mutex> lock(mu_);
  return admit_locked(keys, n, src, false);
}

void NativeRowCache::pin_resident_locked(const int64_t *keys, size_t n, int64_t *slots) {
  find_all(keys, n, slots);
  for (size_t i = 0; i < n; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    if (policy_ == Policy::kLRU) p_touch(keys[i], slot);  // the others' use was counted by the probe
    if (pins_[slot]++ == 0) ++pinned_slots_;
  }
}

void NativeRowCache::land_locked(const std::vector<int64_t> &keys) {
  for (int64_t k : keys) in_flight_.erase(k);
  landed_cv_.notify_all();
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
  auto walk = [&](int64_t s) {
    for (int64_t v = next_[s]; v != s; v = next_[v]) keys.push_back(slot_key_[v]), slots.push_back(v);
  };
  if (policy_ != Policy::kLFU) walk(static_cast<int64_t>(capacity_));
  if (policy_ == Policy::kLookahead) walk(static_cast<int64_t>(capacity_ + 1));
  if (policy_ == Policy::kLRU) return;
  for (uint64_t v = 0; v < next_free_; ++v) {
    if (policy_ == Policy::kLFU || state_[v] == kPlanned) {
      keys.push_back(slot_key_[v]);
      slots.push_back(static_cast<int64_t>(v));
    }
  }
}

void NativeRowCache::lookahead_state(std::vector<int64_t> &idle, std::vector<int64_t> &held,
                                     std::vector<int64_t> &planned, std::vector<int64_t> &next_use) {
  std::lock_guard<std::mutex> lock(mu_);
  if (policy_ != Policy::kLookahead) throw std::invalid_argument("the cache's policy is not lookahead");
  const int64_t s = static_cast<int64_t>(capacity_);
  for (int64_t v = next_[s]; v != s; v = next_[v]) idle.push_back(slot_key_[v]);
  for (int64_t v = next_[s + 1]; v != s + 1; v = next_[v]) held.push_back(slot_key_[v]);
  for (uint64_t v = 0; v < next_free_; ++v)
    if (state_[v] == kPlanned) planned.push_back(slot_key_[v]), next_use.push_back(planned_[v]);
}

std::vector<int64_t> NativeRowCache::frequencies(const int64_t *keys, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out(n);
  for (size_t i = 0; i < n; ++i) out[i] = freq(keys[i]);
  return out;
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
  auto walk = [&](int64_t s, uint8_t want) {
    for (int64_t v = next_[s]; v != s; v = next_[v]) {
      if (++linked > capacity_) fail("a slot list has a cycle");
      if (slot_key_[v] < 0) fail("free slot " + std::to_string(v) + " in a slot list");
      if (find(slot_key_[v]) != v) fail("slot " + std::to_string(v) + " key not indexed to it");
      if (next_[prev_[v]] != v) fail("list links disagree at slot " + std::to_string(v));
      if (want && state_[v] != want) fail("slot " + std::to_string(v) + " is in the wrong lookahead list");
    }
  };
  const int64_t s = static_cast<int64_t>(capacity_);
  if (policy_ == Policy::kLRU) walk(s, 0);
  if (policy_ == Policy::kLookahead) {
    walk(s, kIdle);
    walk(s + 1, kHeld);
    for (uint64_t v = 0; v < next_free_; ++v) {
      if (state_[v] == kPlanned) ++linked;
      else if (state_[v] != kIdle && state_[v] != kHeld) fail("resident slot " + std::to_string(v) + " not filed");
    }
  }
  if (policy_ == Policy::kLFU) {
    linked = resident_;
    for (uint64_t v = 0; v < next_free_; ++v)
      if (find(slot_key_[v]) != static_cast<int64_t>(v)) fail("slot " + std::to_string(v) + " key not indexed to it");
  }
  if (linked != resident_) fail("the policy holds " + std::to_string(linked) + " slots, index " + std::to_string(resident_));
  if (resident_ + (capacity_ - next_free_) != capacity_) fail("resident + free != capacity");
  for (uint64_t v = 0; v < capacity_; ++v) {
    if (pins_[v] < 0) fail("slot " + std::to_string(v) + " has negative pins");
    pinned += pins_[v] > 0;
  }
  if (pinned != pinned_slots_) fail("pinned slot count out of date");
}

}  // namespace tiergram
