// Reads typed values from a fuzzer's byte string (zeros once it runs out).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace flashkv::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  template <typename T>
  T take() {
    T v{};
    const size_t n = pos_ + sizeof(T) <= size_ ? sizeof(T) : size_ - pos_;
    std::memcpy(&v, data_ + pos_, n);
    pos_ += n;
    return v;
  }
  // An integer in [lo, hi].
  int64_t range(int64_t lo, int64_t hi) {
    const uint64_t span = static_cast<uint64_t>(hi - lo) + 1;
    return lo + static_cast<int64_t>(take<uint32_t>() % span);
  }
  bool flag() { return take<uint8_t>() & 1; }
  bool empty() const { return pos_ >= size_; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t pos_ = 0;
};

}  // namespace flashkv::fuzz
