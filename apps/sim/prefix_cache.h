// PrefixCache: KV slots of prompt prefixes that later requests can reuse, keyed by token ids in
// blocks of `block_size` tokens. A block is a node of a tree: its key is (parent node, the
// block's tokens), so a node stands for the whole prefix up to and including its block, and a
// prompt matches the chain of nodes of its leading whole blocks.
//
// Requests reference the nodes they use (a reference on a node is also taken on each of its
// ancestors, so a referenced node never has an unreferenced ancestor). Unreferenced nodes keep
// their slots until evicted, leaves first, least recently used first. The cache never
// allocates slots: it takes over a request's slots on insert and hands them back on eviction.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

namespace flashkv::app {

class PrefixCache {
 public:
  explicit PrefixCache(int block_size);

  int block_size() const { return block_size_; }

  // The node chain (root block first) of the longest cached prefix of `tokens` in whole blocks.
  std::vector<int32_t> match(const std::vector<int32_t>& tokens) const;
  // The block_size slots of a node.
  const std::vector<int32_t>& slots(int32_t node) const;

  // Takes / drops one reference on each node of a chain (as match or insert returned it), and
  // marks the nodes used now (for least-recently-used eviction).
  void acquire(const std::vector<int32_t>& chain);
  void release(const std::vector<int32_t>& chain);

  // Caches the whole blocks of `tokens` that follow `chain` (the request's referenced nodes,
  // which must be the leading blocks of `tokens`), whose KV sits in `slots[i]` for token i. A
  // block found in the cache already (cached by another request meanwhile) is shared: its slots
  // replace the request's in `slots`, and the request's own slots of that block are appended to
  // `released` for the caller to free. Every node added to `chain` is referenced once more.
  void insert(const std::vector<int32_t>& tokens, std::vector<int32_t>& slots,
              std::vector<int32_t>& chain, std::vector<int32_t>& released);

  // Evicts unreferenced nodes, leaves first and least recently used first, until at least
  // `slots_wanted` slots were handed back or none is left to evict; returns the slots.
  std::vector<int32_t> evict(int64_t slots_wanted);

  int64_t num_nodes() const { return live_nodes_; }
  int64_t cached_slots() const { return live_nodes_ * block_size_; }  // held by all nodes
  int64_t evictable_slots() const { return unreferenced_nodes_ * block_size_; }
  int64_t evicted_nodes() const { return evicted_; }
  // Slots of every live node (for the end-of-run accounting).
  std::vector<int32_t> all_slots() const;
  // Throws flashkv::Error when the bookkeeping is inconsistent (for tests and the end of a run).
  void check_invariants() const;

 private:
  struct Node {
    int32_t parent = -1;  // -1: a root block
    std::vector<int32_t> tokens, slots;
    int32_t refs = 0;
    int32_t children = 0;
    uint64_t last_use = 0;
    uint64_t key = 0;
    bool live = false;
  };
  uint64_t key_of(int32_t parent, const int32_t* tokens) const;
  int32_t find(int32_t parent, const int32_t* tokens) const;
  void erase(int32_t node);

  int block_size_;
  std::vector<Node> nodes_;
  std::vector<int32_t> free_ids_;
  std::unordered_multimap<uint64_t, int32_t> index_;  // key -> node
  uint64_t clock_ = 0;
  int64_t live_nodes_ = 0, unreferenced_nodes_ = 0, evicted_ = 0;
};

}  // namespace flashkv::app
