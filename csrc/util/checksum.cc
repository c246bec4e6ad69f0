#include "util/checksum.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#include <nmmintrin.h>
#endif

namespace kvbridge::util {
namespace {

constexpr uint32_t kCastagnoliReflected = 0x82f63b78;

// Slicing-by-8 tables for machines without the CRC32 instruction.
struct Tables {
  std::array<std::array<uint32_t, 256>, 8> t{};
  Tables() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCastagnoliReflected : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i) {
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xff];
    }
  }
};

uint32_t Crc32cPortable(uint32_t crc, const uint8_t* p, size_t n) {
  static const Tables tables;
  const auto& t = tables.t;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    v ^= crc;
    crc = t[7][v & 0xff] ^ t[6][(v >> 8) & 0xff] ^ t[5][(v >> 16) & 0xff] ^ t[4][(v >> 24) & 0xff] ^
          t[3][(v >> 32) & 0xff] ^ t[2][(v >> 40) & 0xff] ^ t[1][(v >> 48) & 0xff] ^ t[0][v >> 56];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) crc = (crc >> 8) ^ t[0][(crc ^ *p++) & 0xff];
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cSse42Serial(uint32_t crc, const uint8_t* p,
                                                             size_t n) {
  uint64_t c = crc;
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = _mm_crc32_u64(c, v);
    p += 8;
    n -= 8;
  }
  auto c32 = static_cast<uint32_t>(c);
  while (n-- > 0) c32 = _mm_crc32_u8(c32, *p++);
  return c32;
}

// The CRC32 instruction takes 3 cycles but can start one per cycle, so three independent
// streams run about three times as fast as one. The CRC register update is linear over GF(2):
// crc(c, A||B) = crc(c, A) advanced over |B| zero bytes, xor crc(0, B). Advancing over kLane zero
// bytes is itself linear, a 32x32 bit matrix whose column i is the register 1<<i advanced.
constexpr size_t kLane = 1024;

// The matrix is applied a byte of the register at a time through four 256-entry tables (16
// KiB, built once): four loads per 3 KiB block. Applying it bit by bit (32 conditional xors,
// twice a block) cost more than the block's 384 CRC32 instructions: 8 MiB took 1.1-2.0 ms
// that way and 0.46-0.49 ms this way on this project's 2-core test VM.
struct ZeroShift {
  uint32_t table[4][256];
  ZeroShift() {
    static const uint8_t zeros[kLane] = {};
    uint32_t column[32];
    for (int i = 0; i < 32; ++i) column[i] = Crc32cSse42Serial(uint32_t{1} << i, zeros, kLane);
    for (int k = 0; k < 4; ++k) {
      for (uint32_t b = 0; b < 256; ++b) {
        uint32_t r = 0;
        for (int i = 0; i < 8; ++i) {
          if (b & (1u << i)) r ^= column[8 * k + i];
        }
        table[k][b] = r;
      }
    }
  }
  uint32_t Apply(uint32_t v) const {
    return table[0][v & 0xff] ^ table[1][(v >> 8) & 0xff] ^ table[2][(v >> 16) & 0xff] ^
           table[3][v >> 24];
  }
};

__attribute__((target("sse4.2"))) uint32_t Crc32cSse42(uint32_t crc, const uint8_t* p, size_t n) {
  static const ZeroShift shift;
  while (n >= 3 * kLane) {
    uint64_t a = crc, b = 0, c = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t va, vb, vc;
      std::memcpy(&va, p + i, 8);
      std::memcpy(&vb, p + kLane + i, 8);
      std::memcpy(&vc, p + 2 * kLane + i, 8);
      a = _mm_crc32_u64(a, va);
      b = _mm_crc32_u64(b, vb);
      c = _mm_crc32_u64(c, vc);
    }
    crc = shift.Apply(shift.Apply(static_cast<uint32_t>(a)) ^ static_cast<uint32_t>(b)) ^
          static_cast<uint32_t>(c);
    p += 3 * kLane;
    n -= 3 * kLane;
  }
  return Crc32cSse42Serial(crc, p, n);
}
#endif

// Polynomials modulo the CRC's, in the register's reflected order (bit 31 is x^0): the
// product a*b mod P, one bit of a at a time.
uint32_t MulModP(uint32_t a, uint32_t b) {
  uint32_t product = 0;
  for (uint32_t bit = uint32_t{1} << 31; bit != 0; bit >>= 1) {
    if (a & bit) product ^= b;
    b = (b & 1) ? (b >> 1) ^ kCastagnoliReflected : b >> 1;
  }
  return product;
}

// x^(2^k) mod P for k = 0..66 (a length's bits shifted by 3), each the square of the last.
struct PowersOfX {
  std::array<uint32_t, 67> x2k{};
  PowersOfX() {
    x2k[0] = uint32_t{1} << 30;  // x^1
    for (size_t k = 1; k < x2k.size(); ++k) x2k[k] = MulModP(x2k[k - 1], x2k[k - 1]);
  }
};

// x^n mod P, in the register's reflected order.
uint32_t XPowModP(uint64_t n) {
  static const PowersOfX powers;
  uint32_t r = uint32_t{1} << 31;  // x^0
  for (size_t k = 0; n != 0; n >>= 1, ++k) {
    if (n & 1) r = MulModP(powers.x2k[k], r);
  }
  return r;
}

#if defined(__x86_64__)
// Folding with carry-less multiplication (VPCLMULQDQ on 512-bit registers: four 128-bit lanes
// an instruction). A 128-bit block X of the message, D bits before another one, may be
// replaced by Y = X x^D mod P added into that one: the CRC of the message does not change. With
// X = L x^64 + H (L the block's first 8 bytes), Y = clmul(L, x^(D+63) mod P) xor
// clmul(H, x^(D-1) mod P): in the reflected order a carry-less product comes out multiplied by
// x, hence 63 and -1 rather than 64 and 0; each product has at most 96 bits. Four registers
// (256 bytes) fold forward 256 bytes at a time, then into one register, then into one block,
// whose CRC (from 0, by the CRC32 instruction) continues over the bytes left: that is the CRC
// of the whole, since the blocks folded away only moved its value forward.
struct FoldKeys {
  // Per 128-bit lane: the constant for the block's first 8 bytes, then for its last 8.
  static __m128i Pair(uint64_t d) {
    return _mm_set_epi64x(static_cast<long long>(uint64_t{XPowModP(d - 1)} << 32),
                          static_cast<long long>(uint64_t{XPowModP(d + 63)} << 32));
  }
  __m128i by256B = Pair(256 * 8), by64B = Pair(64 * 8), by48B = Pair(48 * 8), by32B = Pair(32 * 8),
          by16B = Pair(16 * 8);
};

__attribute__((target("pclmul,sse4.2"))) __m128i Fold16(__m128i x, __m128i keys) {
  return _mm_xor_si128(_mm_clmulepi64_si128(x, keys, 0x00), _mm_clmulepi64_si128(x, keys, 0x11));
}

__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"))) __m512i Fold64(__m512i x,
                                                                                    __m512i keys,
                                                                                    __m512i data) {
  return _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x, keys, 0x00),
                                   _mm512_clmulepi64_epi128(x, keys, 0x11), data, 0x96);
}

// What the folding loop does with the bytes it reads besides checksumming them.
enum class Stores { kNone, kCached, kStreaming };

template <Stores kStores>
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"))) inline void Store256(
    uint8_t* d, __m512i a, __m512i b, __m512i c, __m512i e) {
  if constexpr (kStores == Stores::kCached) {
    _mm512_storeu_si512(d, a);
    _mm512_storeu_si512(d + 64, b);
    _mm512_storeu_si512(d + 128, c);
    _mm512_storeu_si512(d + 192, e);
  } else if constexpr (kStores == Stores::kStreaming) {  // d is 64-byte aligned
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + 192), e);
  }
}

// The CRC of [p, p+n) from `crc`, n >= 256; with kStores other than kNone, those bytes also
// written to d as they pass through the registers (kStreaming: d 64-byte aligned, the stores
// bypass the cache): so the CRC is the one of exactly the bytes written, however p changes
// meanwhile.
template <Stores kStores>
__attribute__((target("avx512f,avx512vl,vpclmulqdq,pclmul,sse4.2"))) uint32_t FoldVpclmul(
    uint32_t crc, uint8_t* d, const uint8_t* p, size_t n) {
  static const FoldKeys keys;
  const __m512i k256 = _mm512_maskz_broadcast_i32x4(0xffff, keys.by256B);
  __m512i x0 = _mm512_loadu_si512(p), x1 = _mm512_loadu_si512(p + 64),
          x2 = _mm512_loadu_si512(p + 128), x3 = _mm512_loadu_si512(p + 192);
  Store256<kStores>(d, x0, x1, x2, x3);
  x0 = _mm512_xor_si512(x0, _mm512_zextsi128_si512(_mm_cvtsi32_si128(static_cast<int>(crc))));
  p += 256;
  d += kStores == Stores::kNone ? 0 : 256;
  n -= 256;
  while (n >= 256) {
    const __m512i a = _mm512_loadu_si512(p), b = _mm512_loadu_si512(p + 64),
                  c = _mm512_loadu_si512(p + 128), e = _mm512_loadu_si512(p + 192);
    Store256<kStores>(d, a, b, c, e);
    x0 = Fold64(x0, k256, a);
    x1 = Fold64(x1, k256, b);
    x2 = Fold64(x2, k256, c);
    x3 = Fold64(x3, k256, e);
    p += 256;
    d += kStores == Stores::kNone ? 0 : 256;
    n -= 256;
  }
  if constexpr (kStores == Stores::kStreaming) _mm_sfence();
  // The tail (under 256 bytes) from p: copied first, then checksummed from the copy.
  if constexpr (kStores != Stores::kNone) {
    std::memcpy(d, p, n);
    p = d;
  }
  const __m512i k64 = _mm512_maskz_broadcast_i32x4(0xffff, keys.by64B);
  x1 = Fold64(x0, k64, x1);
  x2 = Fold64(x1, k64, x2);
  x3 = Fold64(x2, k64, x3);
  // The register's four blocks, 48, 32, 16 and 0 bytes before its end, into the last.
  __m128i x = _mm512_maskz_extracti32x4_epi32(0xf, x3, 3);
  x = _mm_xor_si128(x, Fold16(_mm512_maskz_extracti32x4_epi32(0xf, x3, 0), keys.by48B));
  x = _mm_xor_si128(x, Fold16(_mm512_maskz_extracti32x4_epi32(0xf, x3, 1), keys.by32B));
  x = _mm_xor_si128(x, Fold16(_mm512_maskz_extracti32x4_epi32(0xf, x3, 2), keys.by16B));
  while (n >= 16) {
    x = _mm_xor_si128(Fold16(x, keys.by16B), _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    p += 16;
    n -= 16;
  }
  uint64_t c = _mm_crc32_u64(0, static_cast<uint64_t>(_mm_cvtsi128_si64(x)));
  c = _mm_crc32_u64(c, static_cast<uint64_t>(_mm_extract_epi64(x, 1)));
  return Crc32cSse42Serial(static_cast<uint32_t>(c), p, n);
}

uint32_t Crc32cVpclmul(uint32_t crc, const uint8_t* p, size_t n) {
  if (n < 512) return Crc32cSse42(crc, p, n);
  return FoldVpclmul<Stores::kNone>(crc, nullptr, p, n);
}

// CopyCrc32c's fused loop. Below 512 bytes, or to reach a 64-byte aligned d for streaming
// stores, a memcpy and the CRC32 instruction over the copy (in cache).
uint32_t CopyCrc32cVpclmul(uint32_t crc, uint8_t* d, const uint8_t* p, size_t n, bool streaming) {
  if (streaming) {
    const size_t head = std::min(n, (64 - reinterpret_cast<uintptr_t>(d) % 64) % 64);
    std::memcpy(d, p, head);
    crc = Crc32cSse42Serial(crc, d, head);
    d += head;
    p += head;
    n -= head;
  }
  if (n < 512) {
    std::memcpy(d, p, n);
    return Crc32cSse42(crc, d, n);
  }
  return streaming ? FoldVpclmul<Stores::kStreaming>(crc, d, p, n)
                   : FoldVpclmul<Stores::kCached>(crc, d, p, n);
}
#endif

using CrcFn = uint32_t (*)(uint32_t, const uint8_t*, size_t);
using CopyCrcFn = uint32_t (*)(uint32_t, uint8_t*, const uint8_t*, size_t, bool);

// Copy then checksum the copy, a chunk at a time so that each is read back from the cache
// (a 1 MiB object read from memory twice, once to copy and once to check, takes about twice
// as long). No streaming stores: the copy is read right after.
template <CrcFn kCrc>
uint32_t CopyThenCrc(uint32_t crc, uint8_t* d, const uint8_t* p, size_t n, bool /*streaming*/) {
  constexpr size_t kChunk = 64 << 10;  // well inside L2 with its source
  for (size_t at = 0; at < n; at += kChunk) {
    const size_t len = std::min(kChunk, n - at);
    std::memcpy(d + at, p + at, len);
    crc = kCrc(crc, d + at, len);
  }
  return crc;
}

struct Impl {
  const char* name;
  CrcFn fn;
  CopyCrcFn copy;
};

// The implementations this CPU can run, fastest first.
std::vector<Impl> Available() {
  std::vector<Impl> out;
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("vpclmulqdq") && __builtin_cpu_supports("pclmul") &&
      __builtin_cpu_supports("sse4.2")) {
    out.push_back({"vpclmulqdq", Crc32cVpclmul, CopyCrc32cVpclmul});
  }
  if (__builtin_cpu_supports("sse4.2")) {
    out.push_back({"sse4.2", Crc32cSse42, CopyThenCrc<Crc32cSse42>});
  }
#endif
  out.push_back({"table", Crc32cPortable, CopyThenCrc<Crc32cPortable>});
  return out;
}

const Impl& Best() {
  static const Impl best = Available().front();
  return best;
}

}  // namespace

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  // Appending |B| bytes multiplies A's (unconditioned) register by x^(8|B|); the pre- and
  // post-inversion cancel between the three values, so the conditioned CRCs combine the same.
  static const PowersOfX powers;
  uint32_t shift = uint32_t{1} << 31;  // x^0
  uint64_t bits = len_b;
  for (size_t k = 3; bits != 0; bits >>= 1, ++k) {  // x^(8 len) = x^(len << 3)
    if (bits & 1) shift = MulModP(powers.x2k[k], shift);
  }
  return MulModP(shift, crc_a) ^ crc_b;
}

uint32_t Crc32c(const void* data, size_t len, uint32_t crc) {
  static const CrcFn fn = Best().fn;
  return ~fn(~crc, static_cast<const uint8_t*>(data), len);
}

uint32_t CopyCrc32c(void* dst, const void* src, size_t len, uint32_t crc, CopyStores stores) {
  static const CopyCrcFn fn = Best().copy;
  return ~fn(~crc, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), len,
             stores == CopyStores::kStreaming);
}

const char* Crc32cImplementation() { return Best().name; }

std::vector<std::string> Crc32cImplementationsForTest() {
  std::vector<std::string> names;
  for (const Impl& i : Available()) names.push_back(i.name);
  return names;
}

uint32_t Crc32cWithForTest(const std::string& implementation, const void* data, size_t len,
                           uint32_t crc) {
  for (const Impl& i : Available()) {
    if (implementation == i.name) return ~i.fn(~crc, static_cast<const uint8_t*>(data), len);
  }
  return 0;
}

uint32_t CopyCrc32cWithForTest(const std::string& implementation, void* dst, const void* src,
                               size_t len, uint32_t crc, CopyStores stores) {
  for (const Impl& i : Available()) {
    if (implementation == i.name) {
      return ~i.copy(~crc, static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(src), len,
                     stores == CopyStores::kStreaming);
    }
  }
  return 0;
}

uint32_t Crc32cPortableForTest(const void* data, size_t len, uint32_t crc) {
  return ~Crc32cPortable(~crc, static_cast<const uint8_t*>(data), len);
}

}  // namespace kvbridge::util
