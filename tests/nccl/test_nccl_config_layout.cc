// The transport's own ncclConfig_t (plugins/transport_nccl/nccl_loader.h, which the plugin uses
// so that it builds without NCCL) against a real nccl.h. Built only when CMake found one
// (tests/nccl/CMakeLists.txt: the CUDA toolkit's, /usr/local/include, or the nvidia-nccl-cu*
// wheel under the build's Python); KVBTEST_NCCL_HEADER names the one used.
//
// Every field the transport declares must sit at the header's offset with the header's size,
// and MakeNcclConfig must set what NCCL_CONFIG_INITIALIZER sets, except `blocking` (0), `size`
// (the bytes up to and including splitShare) and `version` (2.18.0, older than the header's).
// That older version is what makes the struct valid for newer NCCLs: NCCL copies
// min(config->size, its sizeof(ncclConfig_t)) bytes over its own NCCL_CONFIG_INITIALIZER and
// resets to its defaults each field newer than config->version, so it reads only the fields 2.18
// had (nccl_loader.h says more).
#include <gtest/gtest.h>
#include <nccl.h>  // the real one: the global ::ncclConfig_t

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include "nccl_loader.h"  // kvbridge::nccl::ncclConfig_t, MakeNcclConfig

namespace {

using Ours = kvbridge::nccl::ncclConfig_t;
using Theirs = ::ncclConfig_t;

#define KVBTEST_SAME_FIELD(f)                                                                     \
  static_assert(offsetof(Ours, f) == offsetof(Theirs, f), "ncclConfig_t::" #f " offset differs"); \
  static_assert(sizeof(Ours::f) == sizeof(Theirs::f), "ncclConfig_t::" #f " size differs")

KVBTEST_SAME_FIELD(size);
KVBTEST_SAME_FIELD(magic);
KVBTEST_SAME_FIELD(version);
KVBTEST_SAME_FIELD(blocking);
KVBTEST_SAME_FIELD(cgaClusterSize);
KVBTEST_SAME_FIELD(minCTAs);
KVBTEST_SAME_FIELD(maxCTAs);
KVBTEST_SAME_FIELD(netName);
KVBTEST_SAME_FIELD(splitShare);
#undef KVBTEST_SAME_FIELD

static_assert(kvbridge::nccl::kNcclConfigBytes <= sizeof(Theirs),
              "the config we hand NCCL is no longer than the header's");
static_assert(kvbridge::nccl::kNcclConfigVersion == NCCL_VERSION(2, 18, 0));
static_assert(kvbridge::nccl::kNcclConfigVersion <=
                  NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH),
              "the header is older than the config version we claim");
static_assert(kvbridge::nccl::kMinNcclVersionCode >= NCCL_VERSION(2, 18, 0),
              "a loadable NCCL older than 2.18 would not know splitShare");
static_assert(kvbridge::nccl::ncclInProgress == ::ncclInProgress);
static_assert(kvbridge::nccl::ncclSuccess == ::ncclSuccess);
static_assert(kvbridge::nccl::ncclUint8 == ::ncclUint8);
static_assert(sizeof(kvbridge::nccl::ncclUniqueId) == sizeof(::ncclUniqueId));

TEST(NcclConfigLayout, FieldsMatchTheRealHeader) {
  // The static_asserts above are the check; this records which header passed.
  std::printf("checked against %s (NCCL %d.%d.%d): sizeof ncclConfig_t %zu, ours hands %zu\n",
              KVBTEST_NCCL_HEADER, NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH, sizeof(Theirs),
              kvbridge::nccl::kNcclConfigBytes);
  EXPECT_EQ(kvbridge::nccl::kNcclConfigBytes, offsetof(Theirs, splitShare) + sizeof(int));
}

TEST(NcclConfigLayout, ValuesAreThoseOfNcclConfigInitializer) {
  const Theirs init = NCCL_CONFIG_INITIALIZER;
  const Ours ours = kvbridge::nccl::MakeNcclConfig(0);
  EXPECT_EQ(ours.magic, init.magic);
  EXPECT_EQ(ours.cgaClusterSize, init.cgaClusterSize);
  EXPECT_EQ(ours.minCTAs, init.minCTAs);
  EXPECT_EQ(ours.maxCTAs, init.maxCTAs);
  EXPECT_EQ(ours.netName, init.netName);
  EXPECT_EQ(ours.splitShare, init.splitShare);
  EXPECT_EQ(init.blocking, NCCL_CONFIG_UNDEF_INT);
  EXPECT_EQ(ours.blocking, 0);  // non-blocking communicators, on purpose
  EXPECT_EQ(kvbridge::nccl::MakeNcclConfig(1).blocking, 1);
  // Differ on purpose: an older version and only its fields' bytes (see the file comment).
  EXPECT_EQ(init.version, static_cast<unsigned>(NCCL_VERSION(NCCL_MAJOR, NCCL_MINOR, NCCL_PATCH)));
  EXPECT_EQ(ours.version, static_cast<unsigned>(NCCL_VERSION(2, 18, 0)));
  EXPECT_LE(ours.version, init.version);
  EXPECT_EQ(init.size, sizeof(Theirs));
  EXPECT_EQ(ours.size, kvbridge::nccl::kNcclConfigBytes);

  // What NCCL does with it: copy `size` bytes over its initializer. Every field we did not
  // mean to set comes out as the initializer's, and the ones we set as we set them.
  Theirs seen = NCCL_CONFIG_INITIALIZER;
  std::memcpy(&seen, &ours, std::min<size_t>(ours.size, sizeof(Theirs)));
  EXPECT_EQ(seen.magic, init.magic);
  EXPECT_EQ(seen.blocking, 0);
  EXPECT_EQ(seen.cgaClusterSize, NCCL_CONFIG_UNDEF_INT);
  EXPECT_EQ(seen.netName, nullptr);
  EXPECT_EQ(seen.splitShare, NCCL_CONFIG_UNDEF_INT);
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 19, 0)
  EXPECT_EQ(seen.trafficClass, init.trafficClass) << "read past splitShare";
#endif
}

}  // namespace
