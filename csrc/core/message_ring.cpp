#include "core/message_ring.h"

#include <unistd.h>

#include <string>
#include <utility>

#include "core/errors.h"

namespace vllm_shm_arena {

namespace {

// Bytes a reader maps before ring_validate can say anything (the header's first line).
constexpr uint64_t kRingAttachMinBytes = 64;

}  // namespace

// ---------------------------------------------------------------------------------------------
// MessageRingWriter

std::unique_ptr<MessageRingWriter> MessageRingWriter::create(uint32_t n_readers,
                                                             uint32_t max_chunks,
                                                             uint64_t max_chunk_bytes,
                                                             const std::string& dir) {
  RingConfig cfg;
  cfg.n_readers = n_readers;
  cfg.max_chunks = max_chunks;
  cfg.max_chunk_bytes = max_chunk_bytes;
  const size_t bytes = ring_bytes(cfg);  // checks the shape
  const size_t tables = ring_metadata_bytes(cfg);
  std::unique_ptr<LivenessToken> token;
  auto init = [&](ShmRegion& r) {
    // The writer's token before the ring has a name; every table page backed before ring_init
    // stores into it (a full /dev/shm must fail here, not SIGBUS later).
    token = LivenessToken::take(r.path(), kWriterTokenByte, r.fd());
    if (!r.reserve(0, tables)) {
      throw ShmError("not enough shared memory in " + r.dir() + " for the message ring's " +
                     std::to_string(tables >> 10) +
                     " KiB of tables (the filesystem is full); free some space or enlarge it "
                     "(Docker: --shm-size; bare metal: mount -o remount,size=<N>G " +
                     r.dir() + ")");
    }
    ring_init(r.data(), r.size(), cfg);
  };
  std::shared_ptr<ShmRegion> region = ShmRegion::create(bytes, "vsa_ring_", dir, init);
  return std::unique_ptr<MessageRingWriter>(
      new MessageRingWriter(std::move(region), std::move(token)));
}

MessageRingWriter::MessageRingWriter(std::shared_ptr<ShmRegion> region,
                                     std::unique_ptr<LivenessToken> token)
    : owner_pid_(::getpid()), region_(std::move(region)) {
  writer_ =
      std::make_unique<RingWriter>(region_->data(), region_->size(),
                                   TokenFile{region_->path(), region_->fd()}, std::move(token));
  backed_.assign(writer_->config().max_chunks, 0);
}

MessageRingWriter::~MessageRingWriter() {
  if (!foreign()) region_->unlink();
}

bool MessageRingWriter::foreign() const { return ::getpid() != owner_pid_; }

void MessageRingWriter::require_owner(const char* what) const {
  if (foreign()) {
    // Worded for the Python face, whose class is RingWriter.
    throw InvalidArgument(std::string("RingWriter.") + what + ": this ring writer belongs to pid " +
                          std::to_string(owner_pid_) +
                          "; a forked child cannot use its parent's queue");
  }
}

uint8_t* MessageRingWriter::take_chunk(int64_t timeout_ns) {
  uint8_t* chunk = reserved_chunk_;
  reserved_chunk_ = nullptr;
  return chunk != nullptr ? chunk : writer_->acquire(timeout_ns);
}

bool MessageRingWriter::reserve(int64_t timeout_ns) {
  require_owner("reserve");
  if (reserved_chunk_ == nullptr) reserved_chunk_ = writer_->acquire(timeout_ns);
  return reserved_chunk_ != nullptr;
}

bool MessageRingWriter::back_chunk(uint8_t* chunk, uint64_t nbytes) {
  // The chunk for message `published() + 1` is number published() % max_chunks (ring.h).
  const uint64_t index = writer_->published() % writer_->config().max_chunks;
  if (backed_[index] >= nbytes) return true;
  const uint64_t offset = static_cast<uint64_t>(chunk - region_->data());
  if (!region_->reserve(offset, nbytes)) return false;
  backed_[index] = nbytes;
  return true;
}

RingWriteStatus MessageRingWriter::write(const FrameSpans& frames, uint32_t flags,
                                         int64_t timeout_ns) {
  require_owner("write");
  const uint64_t total = framed_size(frames);
  if (total > writer_->config().max_chunk_bytes) {
    throw InvalidArgument("message of " + std::to_string(total) +
                          " bytes does not fit a ring chunk of " +
                          std::to_string(writer_->config().max_chunk_bytes));
  }
  uint8_t* chunk = take_chunk(timeout_ns);
  if (chunk == nullptr) return RingWriteStatus::kTimeout;
  try {
    // Back the chunk's pages before the first store into them: a full /dev/shm then means
    // "send it over the socket", not SIGBUS.
    if (!back_chunk(chunk, total)) {
      // The caller's flags described the message that did not fit; the marker says only
      // "on the socket".
      writer_->publish(0, kRingFlagOverflow | kRingFlagNoSpace);
      ++no_space_;
      return RingWriteStatus::kNoSpace;
    }
    pack_frames(chunk, frames);
    writer_->publish(total, flags);
  } catch (...) {
    reserved_chunk_ = chunk;  // still acquired and unpublished: the next write uses it
    throw;
  }
  return RingWriteStatus::kOk;
}

bool MessageRingWriter::write_marker(uint32_t flags, int64_t timeout_ns) {
  require_owner("write_marker");
  if (take_chunk(timeout_ns) == nullptr) return false;
  writer_->publish(0, flags);
  return true;
}

void MessageRingWriter::shutdown() {
  require_owner("shutdown");
  writer_->shutdown();
}

void MessageRingWriter::unlink() {
  if (!foreign()) region_->unlink();
}

MessageRingWriterStats MessageRingWriter::stats() const {
  MessageRingWriterStats s;
  s.published = writer_->published();
  s.dropped_readers = writer_->dropped_readers();
  s.liveness_unknown = writer_->liveness_unknown();
  s.no_space = no_space_;
  return s;
}

// ---------------------------------------------------------------------------------------------
// MessageRingReader

std::unique_ptr<MessageRingReader> MessageRingReader::attach(const std::string& name, uint32_t rank,
                                                             const std::string& dir) {
  std::shared_ptr<ShmRegion> region = ShmRegion::attach(name, dir, kRingAttachMinBytes);
  ring_validate(region->data(), region->size());
  return std::unique_ptr<MessageRingReader>(new MessageRingReader(std::move(region), rank));
}

MessageRingReader::MessageRingReader(std::shared_ptr<ShmRegion> region, uint32_t rank)
    : region_(std::move(region)) {
  reader_ = std::make_unique<RingReader>(region_->data(), region_->size(), rank,
                                         TokenFile{region_->path(), region_->fd()});
}

RingMessage MessageRingReader::acquire(int64_t timeout_ns) {
  RingMessage m;
  const uint8_t* data = nullptr;
  uint64_t nbytes = 0;
  m.status = reader_->acquire(timeout_ns, &data, &nbytes, &m.flags);
  if (m.status != RingReader::Status::kOk) {
    m.flags = 0;
    return m;
  }
  try {
    m.frames = parse_frames(data, nbytes);  // nbytes was checked against the chunk by acquire
  } catch (...) {
    reader_->release();  // a corrupt message is refused, never left holding its chunk
    throw;
  }
  return m;
}

void MessageRingReader::release() { reader_->release(); }

}  // namespace vllm_shm_arena
