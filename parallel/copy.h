// Strided byte copies on one device, ordered on the stream for a GPU (graph-capturable: they
// only enqueue), and the grow-only buffers of the sharded operators.
#pragma once

#include <cstddef>
#include <vector>

#include "flashkv/core/buffer.h"

namespace flashkv::parallel::detail {

// `height` rows of `width` bytes: row r from src + r * spitch to dst + r * dpitch.
void copy_2d(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
             Device device, Stream stream);

// Makes bufs[i] at least `bytes` long on `device` (contents lost when it grows) and returns its
// memory.
void* reserve(std::vector<Buffer>& bufs, size_t i, size_t bytes, Device device);

// A contiguous view over `data`.
TensorView view(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device);

}  // namespace flashkv::parallel::detail
