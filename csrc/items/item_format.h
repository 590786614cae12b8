// The item format's tags and byte order (Note [Item format] in items.h),
// shared by the encoder (item_encoder.cpp) and the reader (item_reader.cpp).
#pragma once

#include <cstdint>

namespace torchshm {

enum Tag : uint8_t {
  kNone = 'N',
  kTrue = 'T',
  kFalse = 'F',
  kInt = 'i',
  kFloat = 'f',
  kStr = 's',
  kTableStr = 'k',
  kBytes = 'y',
  kList = 'l',
  kTuple = 't',
  kDict = 'd',
};

inline uint64_t to_little_endian(uint64_t bits) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  return __builtin_bswap64(bits);
#else
  return bits;
#endif
}

}  // namespace torchshm
