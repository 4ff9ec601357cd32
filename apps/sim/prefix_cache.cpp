#include "prefix_cache.h"

#include <algorithm>
#include <queue>

#include "flashkv/core/error.h"

namespace flashkv::app {

PrefixCache::PrefixCache(int block_size) : block_size_(block_size) {
  FLASHKV_CHECK(block_size >= 1, "PrefixCache: block_size: expected >= 1, got ", block_size);
}

uint64_t PrefixCache::key_of(int32_t parent, const int32_t* tokens) const {
  // FNV-1a over the parent id and the block's tokens.
  uint64_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t x) {
    for (int i = 0; i < 4; ++i) {
      h ^= (x >> (16 * i)) & 0xFFFF;
      h *= 1099511628211ull;
    }
  };
  mix(static_cast<uint64_t>(static_cast<int64_t>(parent)));
  for (int i = 0; i < block_size_; ++i) mix(static_cast<uint32_t>(tokens[i]));
  return h;
}

int32_t PrefixCache::find(int32_t parent, const int32_t* tokens) const {
  auto range = index_.equal_range(key_of(parent, tokens));
  for (auto it = range.first; it != range.second; ++it) {
    const Node& n = nodes_[it->second];
    if (n.parent == parent && std::equal(n.tokens.begin(), n.tokens.end(), tokens))
      return it->second;
  }
  return -1;
}

std::vector<int32_t> PrefixCache::match(const std::vector<int32_t>& tokens) const {
  std::vector<int32_t> chain;
  int32_t parent = -1;
  for (size_t b = 0; (b + 1) * block_size_ <= tokens.size(); ++b) {
    const int32_t node = find(parent, tokens.data() + b * block_size_);
    if (node < 0) break;
    chain.push_back(node);
    parent = node;
  }
  return chain;
}

const std::vector<int32_t>& PrefixCache::slots(int32_t node) const {
  FLASHKV_CHECK(node >= 0 && node < static_cast<int32_t>(nodes_.size()) && nodes_[node].live,
                "PrefixCache: node ", node, " is not cached");
  return nodes_[node].slots;
}

void PrefixCache::acquire(const std::vector<int32_t>& chain) {
  for (int32_t id : chain) slots(id);  // all valid before anything changes
  ++clock_;
  for (int32_t id : chain) {
    Node& n = nodes_[id];
    if (n.refs++ == 0) --unreferenced_nodes_;
    n.last_use = clock_;
  }
}

void PrefixCache::release(const std::vector<int32_t>& chain) {
  for (int32_t id : chain) {
    slots(id);  // throws unless cached
    FLASHKV_CHECK(nodes_[id].refs > 0, "PrefixCache: release of node ", id, " without a reference");
  }
  ++clock_;
  for (int32_t id : chain) {
    Node& n = nodes_[id];
    if (--n.refs == 0) ++unreferenced_nodes_;
    n.last_use = clock_;
  }
}

void PrefixCache::insert(const std::vector<int32_t>& tokens, std::vector<int32_t>& slots,
                         std::vector<int32_t>& chain, std::vector<int32_t>& released) {
  FLASHKV_CHECK(slots.size() >= tokens.size(), "PrefixCache::insert: ", tokens.size(),
                " tokens but ", slots.size(), " slots");
  FLASHKV_CHECK(chain.size() * block_size_ <= tokens.size(), "PrefixCache::insert: a chain of ",
                chain.size(), " blocks is longer than the ", tokens.size(), " tokens");
  const size_t B = static_cast<size_t>(block_size_);
  int32_t parent = chain.empty() ? -1 : chain.back();
  std::vector<int32_t> added;
  for (size_t b = chain.size(); (b + 1) * B <= tokens.size(); ++b) {
    const int32_t* block_tokens = tokens.data() + b * B;
    int32_t id = find(parent, block_tokens);
    if (id >= 0) {
      // Cached meanwhile by another request: share its slots, give ours back.
      Node& n = nodes_[id];
      for (size_t j = 0; j < B; ++j) {
        if (slots[b * B + j] != n.slots[j]) released.push_back(slots[b * B + j]);
        slots[b * B + j] = n.slots[j];
      }
    } else {
      if (free_ids_.empty()) {
        id = static_cast<int32_t>(nodes_.size());
        nodes_.emplace_back();
      } else {
        id = free_ids_.back();
        free_ids_.pop_back();
      }
      Node& n = nodes_[id];
      n = Node();
      n.parent = parent;
      n.tokens.assign(block_tokens, block_tokens + B);
      n.slots.assign(slots.begin() + b * B, slots.begin() + (b + 1) * B);
      n.key = key_of(parent, block_tokens);
      n.live = true;
      index_.emplace(n.key, id);
      if (parent >= 0) ++nodes_[parent].children;
      ++live_nodes_;
      ++unreferenced_nodes_;  // until acquired below
    }
    added.push_back(id);
    parent = id;
  }
  // One more reference on every node of the chain: the new nodes' ancestors are the chain's
  // nodes, which the request already holds, so only the added nodes are acquired.
  acquire(added);
  chain.insert(chain.end(), added.begin(), added.end());
}

void PrefixCache::erase(int32_t id) {
  Node& n = nodes_[id];
  auto range = index_.equal_range(n.key);
  for (auto it = range.first; it != range.second; ++it)
    if (it->second == id) {
      index_.erase(it);
      break;
    }
  if (n.parent >= 0) --nodes_[n.parent].children;
  n.live = false;
  n.tokens.clear();
  n.slots.clear();
  free_ids_.push_back(id);
  --live_nodes_;
  --unreferenced_nodes_;
  ++evicted_;
}

std::vector<int32_t> PrefixCache::evict(int64_t slots_wanted) {
  std::vector<int32_t> out;
  // Unreferenced leaves by last use; a parent whose last child goes becomes a candidate.
  using Entry = std::pair<uint64_t, int32_t>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> leaves;
  for (int32_t id = 0; id < static_cast<int32_t>(nodes_.size()); ++id) {
    const Node& n = nodes_[id];
    if (n.live && n.refs == 0 && n.children == 0) leaves.emplace(n.last_use, id);
  }
  while (static_cast<int64_t>(out.size()) < slots_wanted && !leaves.empty()) {
    const int32_t id = leaves.top().second;
    leaves.pop();
    const int32_t parent = nodes_[id].parent;
    out.insert(out.end(), nodes_[id].slots.begin(), nodes_[id].slots.end());
    erase(id);
    if (parent >= 0) {
      const Node& p = nodes_[parent];
      if (p.refs == 0 && p.children == 0) leaves.emplace(p.last_use, parent);
    }
  }
  return out;
}

std::vector<int32_t> PrefixCache::all_slots() const {
  std::vector<int32_t> s;
  for (const Node& n : nodes_)
    if (n.live) s.insert(s.end(), n.slots.begin(), n.slots.end());
  return s;
}

void PrefixCache::check_invariants() const {
  int64_t live = 0, unreferenced = 0;
  std::vector<int32_t> children(nodes_.size(), 0);
  for (size_t id = 0; id < nodes_.size(); ++id) {
    const Node& n = nodes_[id];
    if (!n.live) continue;
    ++live;
    if (n.refs == 0) ++unreferenced;
    FLASHKV_CHECK(n.refs >= 0, "PrefixCache: node ", id, " has ", n.refs, " references");
    FLASHKV_CHECK(static_cast<int>(n.slots.size()) == block_size_ &&
                      static_cast<int>(n.tokens.size()) == block_size_,
                  "PrefixCache: node ", id, " holds ", n.slots.size(), " slots");
    if (n.parent >= 0) {
      const Node& p = nodes_[n.parent];
      FLASHKV_CHECK(p.live, "PrefixCache: node ", id, " has an evicted parent");
      FLASHKV_CHECK(p.refs >= n.refs, "PrefixCache: node ", id,
                    " has more references than its parent");
      ++children[n.parent];
    }
  }
  for (size_t id = 0; id < nodes_.size(); ++id)
    if (nodes_[id].live)
      FLASHKV_CHECK(children[id] == nodes_[id].children, "PrefixCache: node ", id, " child count");
  FLASHKV_CHECK(live == live_nodes_ && unreferenced == unreferenced_nodes_,
                "PrefixCache: node counts out of step");
}

}  // namespace flashkv::app
