// Peers in the same process (EngineOptions::local_copy): ops to another engine of this process
// are memory copies, checked against the peer's live registrations; the transport is not used.
// Real tcp engines, so that "no socket" is visible in the transport's byte counters.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <atomic>
#include <cstring>
#include <map>
#include <thread>
#include <vector>

#include "kvbridge/engine.h"
#include "tests/common/test_util.h"
#include "util/checksum.h"

namespace kvbridge {
namespace {

using testing::Buffer;
using testing::LoopbackOptions;
using testing::Must;

EngineOptions Options(const std::string& node_id, bool local_copy,
                      std::map<std::string, std::string> config = {}) {
  EngineOptions o = LoopbackOptions("tcp", node_id);
  o.local_copy = local_copy;
  o.plugin_config = std::move(config);
  return o;
}

uint64_t TcpBytes(const TransferEngine& e) {
  TransportStats s = Must(e.GetTransportStats("tcp"));
  return s.bytes_written + s.bytes_read;
}

class LocalCopyTest : public ::testing::Test {
 protected:
  void Start(bool local_copy, std::map<std::string, std::string> config = {}) {
    a_ = Must(TransferEngine::Create(Options("lc-a", local_copy, std::move(config))));
    b_ = Must(TransferEngine::Create(Options("lc-b", local_copy)));
    Must(a_->RegisterMemory(mem_a_.data(), mem_a_.size()));
    seg_b_ = Must(b_->RegisterMemory(mem_b_.data(), mem_b_.size()));
    Must(a_->AddPeer(b_->LocalDescriptor()));
  }
  TransferOp Op(OpCode code, size_t a_off, uint64_t len, uint64_t b_off) const {
    return TransferOp{code, mem_a_.data() + a_off, len, "lc-b", seg_b_, b_off};
  }

  Buffer mem_a_{1 << 20}, mem_b_{1 << 20};
  std::unique_ptr<TransferEngine> a_, b_;
  SegmentId seg_b_ = 0;
};

TEST_F(LocalCopyTest, WritesAndReadsAreCopiesWithoutTheTransport) {
  Start(/*local_copy=*/true);
  mem_a_.Fill(7);
  std::vector<TransferOp> writes;
  for (size_t i = 0; i < 64; ++i) writes.push_back(Op(OpCode::kWrite, i * 1024, 1024, i * 4096));
  ASSERT_TRUE(a_->Transfer(writes).ok());
  for (size_t i = 0; i < 64; ++i) {
    EXPECT_TRUE(mem_b_.Matches(7, i * 4096, 1024, i * 1024)) << "write " << i;
  }
  std::memset(mem_a_.data(), 0, mem_a_.size());
  std::vector<TransferOp> reads;
  for (size_t i = 0; i < 64; ++i) reads.push_back(Op(OpCode::kRead, i * 1024, 1024, i * 4096));
  ASSERT_TRUE(a_->Transfer(reads).ok());
  EXPECT_TRUE(mem_a_.Matches(7, 0, 64 * 1024, 0));
  EXPECT_EQ(a_->GetPeerHealth("lc-b")->local_copy_ops, 128u);
  EXPECT_EQ(TcpBytes(*a_), 0u) << "a copy in this process went over a socket";
  EXPECT_EQ(TcpBytes(*b_), 0u);
}

TEST_F(LocalCopyTest, OffTheTransportMovesTheBytes) {
  Start(/*local_copy=*/false);
  mem_a_.Fill(9);
  ASSERT_TRUE(a_->Transfer(std::vector{Op(OpCode::kWrite, 0, 65536, 0)}).ok());
  EXPECT_TRUE(mem_b_.Matches(9, 0, 65536, 0));
  EXPECT_EQ(a_->GetPeerHealth("lc-b")->local_copy_ops, 0u);
  EXPECT_GE(TcpBytes(*a_), 65536u);
}

// A read or a write copied in this process gives the CRC-32C of what it copied
// (TransferOp::checksum), taken chunk by chunk. Through the tcp transport each gets the
// checksum its lane took as the bytes landed or left (KVB_TCAP_OP_CRC32C); with
// tcp.op_checksums=0 no op gets one.
TEST_F(LocalCopyTest, CopiedOpsGiveTheChecksumOfTheirBytes) {
  enum Mode { kCopied, kTcp, kTcpWithout };
  for (Mode mode : {kCopied, kTcp, kTcpWithout}) {
    SCOPED_TRACE(mode == kCopied ? "copied" : mode == kTcp ? "tcp" : "tcp.op_checksums=0");
    const bool local_copy = mode == kCopied;
    const bool crcs_taken = mode != kTcpWithout;
    Start(local_copy, mode == kTcpWithout
                          ? std::map<std::string, std::string>{{"tcp.op_checksums", "0"}}
                          : std::map<std::string, std::string>{});
    mem_b_.Fill(3);
    std::memset(mem_a_.data(), 0, mem_a_.size());
    mem_a_.Fill(5, 512 << 10, 4096);  // what the write sends
    // Sizes around the engine's 64 KiB chunk, at odd offsets.
    const uint64_t sizes[] = {1, 4095, 65536, 65537, 200000};
    std::vector<OpChecksum> crcs(std::size(sizes) + 1);
    std::vector<TransferOp> ops;
    uint64_t at = 0;
    for (size_t i = 0; i < std::size(sizes); ++i) {
      ops.push_back(Op(OpCode::kRead, at, sizes[i], at + 7));
      ops.back().checksum = &crcs[i];
      at += sizes[i];
    }
    // A write from clear of the reads' destinations, to clear of their sources.
    ops.push_back(Op(OpCode::kWrite, 512 << 10, 4096, at + 65536));
    ops.back().checksum = &crcs.back();
    crcs.back().crc32c = 12345;
    ASSERT_TRUE(a_->Transfer(ops).ok());
    at = 0;
    for (size_t i = 0; i < std::size(sizes); ++i) {
      EXPECT_TRUE(mem_a_.Matches(3, at, sizes[i], at + 7)) << "read " << i;
      EXPECT_EQ(crcs[i].computed, crcs_taken) << "read " << i;
      if (crcs_taken) {
        EXPECT_EQ(crcs[i].crc32c, util::Crc32c(mem_a_.data() + at, sizes[i])) << "read " << i;
      } else {
        EXPECT_EQ(crcs[i].crc32c, 0u);
      }
      at += sizes[i];
    }
    EXPECT_TRUE(mem_b_.Matches(5, at + 65536, 4096, 512 << 10)) << "the write";
    EXPECT_EQ(crcs.back().computed, crcs_taken) << "the write";
    EXPECT_EQ(crcs.back().crc32c,
              crcs_taken ? util::Crc32c(mem_a_.data() + (512 << 10), 4096) : 12345u);
    a_.reset();
    b_.reset();
  }
}

// From 1 MiB of copies in one Submit the ops are cut into 256 KiB pieces that several threads
// copy (local_copy_threads); each read's checksum is joined from its pieces'. The bytes and the
// checksums are the same as one thread's, for ops smaller than a piece, of a piece and a byte,
// and of many pieces at odd offsets.
TEST(LocalCopyThreads, SharedCopiesMoveTheSameBytesAndChecksums) {
  constexpr size_t kBytes = 8 << 20;
  const uint64_t sizes[] = {1, 4095, (256 << 10) + 1, 3 << 20, (1 << 20) + 12345, 65536, 777};
  for (uint32_t threads : {1u, 3u}) {
    SCOPED_TRACE(std::to_string(threads) + " threads");
    EngineOptions oa = Options("lct-a", true), ob = Options("lct-b", true);
    oa.local_copy_threads = threads;
    auto a = Must(TransferEngine::Create(oa));
    auto b = Must(TransferEngine::Create(ob));
    Buffer mem_a(kBytes), mem_b(kBytes);
    Must(a->RegisterMemory(mem_a.data(), kBytes));
    const SegmentId seg = Must(b->RegisterMemory(mem_b.data(), kBytes));
    Must(a->AddPeer(b->LocalDescriptor()));
    // Writes first: a's bytes into b at offset +3.
    mem_a.Fill(11);
    std::memset(mem_b.data(), 0, kBytes);
    std::vector<TransferOp> ops;
    uint64_t at = 0;
    for (uint64_t n : sizes) {
      ops.push_back(TransferOp{OpCode::kWrite, mem_a.data() + at, n, "lct-b", seg, at + 3});
      at += n;
    }
    ASSERT_LT(at + 3, kBytes);
    ASSERT_TRUE(a->Transfer(ops).ok());
    EXPECT_TRUE(mem_b.Matches(11, 3, at, 0)) << "a write's bytes differ";
    // Then reads back, each asking for its checksum.
    std::memset(mem_a.data(), 0, kBytes);
    std::vector<OpChecksum> crcs(std::size(sizes));
    for (size_t i = 0; i < ops.size(); ++i) {
      ops[i].opcode = OpCode::kRead;
      ops[i].checksum = &crcs[i];
    }
    ASSERT_TRUE(a->Transfer(ops).ok());
    EXPECT_TRUE(mem_a.Matches(11, 0, at, 0)) << "a read's bytes differ";
    at = 0;
    for (size_t i = 0; i < std::size(sizes); ++i) {
      EXPECT_TRUE(crcs[i].computed) << "read " << i;
      EXPECT_EQ(crcs[i].crc32c, util::Crc32c(mem_a.data() + at, sizes[i])) << "read " << i;
      at += sizes[i];
    }
    EXPECT_EQ(a->GetPeerHealth("lct-b")->local_copy_ops, 2 * std::size(sizes));
    EXPECT_EQ(TcpBytes(*a), 0u);
  }
}

TEST_F(LocalCopyTest, BoundsAndRegistrationAreThePeersLiveOnes) {
  Start(/*local_copy=*/true);
  Status oob = a_->Transfer(std::vector{Op(OpCode::kWrite, 0, 8192, mem_b_.size() - 4096)});
  EXPECT_TRUE(oob.Is(StatusCode::kOutOfBounds)) << oob.ToString();
  // Deregistered on the peer: the descriptor this engine holds still lists the segment, the
  // copy must not write into memory its owner may have freed.
  ASSERT_TRUE(b_->DeregisterMemory(seg_b_).ok());
  mem_b_.Fill(3);
  mem_a_.Fill(4);
  Status gone = a_->Transfer(std::vector{Op(OpCode::kWrite, 0, 4096, 0)});
  EXPECT_TRUE(gone.Is(StatusCode::kNotRegistered)) << gone.ToString();
  EXPECT_NE(gone.message().find("deregistered"), std::string::npos) << gone.ToString();
  EXPECT_TRUE(mem_b_.Matches(3, 0, 4096, 0)) << "a write landed in deregistered memory";
}

TEST_F(LocalCopyTest, APeerEngineGoneOrReplacedIsNeverCopiedInto) {
  Start(/*local_copy=*/true);
  b_.reset();  // the peer engine is destroyed; this engine still holds its descriptor
  Status st = a_->Transfer(std::vector{Op(OpCode::kWrite, 0, 4096, 0)}, SubmitOptions{500, 0});
  EXPECT_FALSE(st.ok());
  // A new engine with the same node id is another incarnation: it is reached once its
  // descriptor is added, and then by a copy again.
  b_ = Must(TransferEngine::Create(Options("lc-b", true)));
  seg_b_ = Must(b_->RegisterMemory(mem_b_.data(), mem_b_.size()));
  Must(a_->AddPeer(b_->LocalDescriptor()));
  mem_a_.Fill(5);
  ASSERT_TRUE(a_->Transfer(std::vector{Op(OpCode::kWrite, 0, 4096, 0)}).ok());
  EXPECT_TRUE(mem_b_.Matches(5, 0, 4096, 0));
  EXPECT_EQ(a_->GetPeerHealth("lc-b")->local_copy_ops, 1u);
}

// Copies race the peer's deregistration of memory it unmaps as soon as DeregisterMemory
// returns: a copy after that would fault. Every op is OK or NOT_REGISTERED, nothing else.
TEST_F(LocalCopyTest, DeregistrationRacingCopiesNeverLeavesACopyIntoFreedMemory) {
  Start(/*local_copy=*/true);
  constexpr size_t kLen = 1 << 20;
  std::atomic<bool> stop{false};
  std::atomic<uint64_t> ok{0}, refused{0}, other{0};
  std::atomic<SegmentId> seg{0};
  std::vector<std::thread> writers;
  for (int t = 0; t < 2; ++t) {
    writers.emplace_back([&, t] {
      while (!stop.load()) {
        const SegmentId s = seg.load();
        if (s == 0) continue;
        std::vector<TransferOp> ops;
        for (size_t i = 0; i < 16; ++i) {
          ops.push_back(TransferOp{t == 0 ? OpCode::kWrite : OpCode::kRead,
                                   mem_a_.data() + t * 65536 + i * 4096, 4096, "lc-b", s,
                                   i * 65536});
        }
        Result<BatchId> id = a_->Submit(ops);
        if (!id.ok()) {
          other.fetch_add(1);
          continue;
        }
        for (const Status& st : a_->Wait(id.value()).op_status) {
          (st.ok() ? ok : st.Is(StatusCode::kNotRegistered) ? refused : other).fetch_add(1);
        }
      }
    });
  }
  for (int round = 0; round < 200; ++round) {
    void* p = mmap(nullptr, kLen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ASSERT_NE(p, MAP_FAILED);
    const SegmentId s = Must(b_->RegisterMemory(p, kLen));
    Must(a_->AddPeer(b_->LocalDescriptor()));
    seg.store(s);
    std::this_thread::sleep_for(std::chrono::microseconds(200));
    ASSERT_TRUE(b_->DeregisterMemory(s).ok());
    ASSERT_EQ(munmap(p, kLen), 0);  // a copy into it now would fault
  }
  stop.store(true);
  for (auto& w : writers) w.join();
  EXPECT_GT(ok.load(), 0u);
  EXPECT_GT(refused.load(), 0u);
  EXPECT_EQ(other.load(), 0u);
}

}  // namespace
}  // namespace kvbridge
