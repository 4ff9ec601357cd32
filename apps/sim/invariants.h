// Checks of the serving state that must hold between any two scheduler steps (the soak test
// runs them after every step), written as plain functions of the state's parts so that a test
// can hand them a deliberately broken state and see them fail.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flashkv/core/tensor.h"
#include "flashkv/kvcache/allocator.h"
#include "flashkv/kvcache/req_to_token_pool.h"

namespace flashkv::app {

// One holder of KV slots: a running request (the slots that are its own) or the prefix cache.
struct SlotOwner {
  std::string name;  // "request 12", "the prefix cache"
  std::vector<int32_t> slots;
};

// Slot ownership: every slot an owner lists lies in the pool, is allocated, and is listed once
// over all owners (a slot live twice would be written by two requests); and every allocated
// page holds a slot some owner lists (otherwise it leaked: nobody will ever free it). Returns ""
// when this holds, else the first violation, naming the slot and its owners.
std::string check_slot_ownership(const KVAllocator& allocator,
                                 const std::vector<SlotOwner>& owners);

// A running request's req_to_token row and the slots it should list.
struct RequestRow {
  std::string name;
  int32_t row = -1;
  const std::vector<int32_t>* slots = nullptr;  // token positions 0, 1, ... of the row
};

// Request rows: each request's row is allocated, held by no other request, and lists its slots;
// no other row is in use. Returns "" or the first violation.
std::string check_request_rows(const ReqToTokenPool& pool, const std::vector<RequestRow>& rows);

// The element index (row-major) of the first NaN or Inf of a contiguous host tensor of a float
// dtype, or -1 when every element is finite.
int64_t first_nonfinite(const TensorView& t);

}  // namespace flashkv::app
