// The system and XLA FFI headers of grouped_swiglu.cc (forward) and grouped_swiglu_bwd.cc
// (backward) of impl="cpu", and `namespace ffi = xla::ffi`: included first, at global
// scope, before each library's anonymous namespace (which includes kernel_common.h).
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX2__) || defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
